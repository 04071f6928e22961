"""Run the programs in ``programs/`` under Hugging Face Accelerate and under nbaccel.

Each program is a plain script in the style of Accelerate's examples: it takes
``--output_json PATH --output_dir DIR`` and its rank 0 writes its numbers (losses, parameter
sums, metrics) to PATH. Under nbaccel the same text runs with the imports changed
(``from accelerate`` -> ``from nbaccel``, ``accelerate.utils`` -> ``nbaccel.utils``).

How each side runs, and why:

- Accelerate keeps process-wide singletons (``AcceleratorState``, ``GradientState``), so
  every program needs fresh processes. ``python -m tests.parity.runner OUT NAME...`` imports
  torch, Accelerate and transformers once, then runs each program through
  ``accelerate.notebook_launcher`` (2 forked CPU processes with ``ACCELERATE_USE_CPU=true``,
  which Accelerate needs to go distributed on a CPU-only machine): about 0.2 s a launch
  instead of ~5 s of imports per process.
- nbaccel promises no singletons, so one ``nbaccel.launch`` runs the programs one after
  the other in the same two workers. A program that raises ends that launch (the other rank
  may wait in a collective the failed one never joins); the rest start again in a new one.
  A launch in which no program finishes for ``seconds_per_program`` is stopped as hung, and
  a launch that fails before any program starts fails them all (it would fail again).

Both sides call ``torch.set_num_threads(1)`` first: the two launchers size torch's thread
pool differently, and a different number of threads may sum in a different order.

Outcomes land in ``OUT/<framework>/``: ``NAME.json`` (the program's numbers),
``NAME.rank<R>.error.txt`` (a traceback) for each rank that failed (``rank-launch`` when
the launch, not the program, failed) and ``NAME.started``.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROGRAMS = Path(__file__).resolve().parent / "programs"
ROOT = PROGRAMS.parents[2]

# In the order they run: those that need nothing beyond the Accelerator first.
CPU_PROGRAMS = (
    "bert_classification",
    "gpt2_causal_lm",
    "gradient_accumulation",
    "bf16_autocast",
    "no_sync_uneven_eval",
    "checkpoint_resume",
    "save_pretrained",
    "trackers",
    "fsdp_plugin",
    "fsdp_state_dict_every_rank",
    "automatic_checkpoint_naming",
    "batch_size_finder",
    "split_between_processes",
    "kwargs_handlers",
)
CUDA_PROGRAMS = ("deepspeed_plugin",)
PROGRAM_TIMEOUT = 60  # seconds for one program under Accelerate (each takes ~0.2-2 s)

_FROM_ACCELERATE = re.compile(r"^(\s*)from accelerate\b", re.MULTILINE)
_ANY_ACCELERATE_IMPORT = re.compile(r"^\s*(from|import)\s+accelerate\b", re.MULTILINE)


def to_nbaccel(source: str) -> str:
    """The program text with Accelerate's imports changed to nbaccel's, and nothing else.

    >>> to_nbaccel("from accelerate import Accelerator\\nfrom accelerate.utils import set_seed\\n")
    'from nbaccel import Accelerator\\nfrom nbaccel.utils import set_seed\\n'
    """
    rewritten = _FROM_ACCELERATE.sub(r"\1from nbaccel", source).replace(
        "accelerate.utils", "nbaccel.utils"
    )
    left = _ANY_ACCELERATE_IMPORT.search(rewritten)
    if left is not None:  # `import accelerate` would keep running Accelerate's code
        raise ValueError(f"the rewrite left an Accelerate import: {left.group(0).strip()!r}")
    return rewritten


def result_path(out_dir: str | Path, framework: str, name: str) -> Path:
    return Path(out_dir) / framework / f"{name}.json"


def error_path(out_dir: str | Path, framework: str, name: str, rank: str) -> Path:
    return Path(out_dir) / framework / f"{name}.rank{rank}.error.txt"


def started_path(out_dir: str | Path, framework: str, name: str) -> Path:
    return Path(out_dir) / framework / f"{name}.started"


def run_program(name: str, framework: str, out_dir: str) -> None:
    """Run one program as ``__main__`` in this (worker) process; on failure, write this
    rank's traceback next to the results and raise."""
    import torch

    started_path(out_dir, framework, name).touch()
    torch.set_num_threads(1)
    path = PROGRAMS / f"{name}.py"
    source = path.read_text()
    if framework == "nbaccel":
        source = to_nbaccel(source)
    work_dir = Path(out_dir) / framework / f"{name}-work"
    work_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(path), "--output_json", str(result_path(out_dir, framework, name))]
    argv += ["--output_dir", str(work_dir)]
    namespace = {"__name__": "__main__", "__file__": str(path), "__builtins__": builtins}
    saved_argv = sys.argv
    sys.argv = argv
    try:
        exec(compile(source, str(path), "exec"), namespace)
    except BaseException:
        rank = os.environ.get("RANK", "0")
        error_path(out_dir, framework, name, rank).write_text(traceback.format_exc())
        raise
    finally:
        sys.argv = saved_argv


def run_programs(names: list[str], framework: str, out_dir: str) -> list[str]:
    """nbaccel's worker function: the programs one after another; the first failure ends it.

    Returns the names it ran: it stops early when a program left no process group (as
    ``end_training`` may: Accelerate's ends it unless a notebook launcher forked the
    process), since the next program needs one.
    """
    import torch.distributed as dist

    ran = []
    for name in names:
        run_program(name, framework, out_dir)
        ran.append(name)
        if not dist.is_initialized():
            break
    return ran


@dataclass
class Outcome:
    """What one program left behind under one framework."""

    result: dict[str, Any] | None
    errors: dict[str, str] = field(default_factory=dict)  # rank -> traceback

    def failure(self) -> str | None:
        if self.errors:
            rank, text = sorted(self.errors.items())[0]
            return f"rank {rank} failed:\n{text}"
        if self.result is None:
            return "no result was written (the launch failed before the program ran?)"
        return None


def read_outcome(out_dir: str | Path, framework: str, name: str) -> Outcome:
    path = result_path(out_dir, framework, name)
    result = json.loads(path.read_text()) if path.exists() else None
    errors = {
        found.name.split(".")[-3].removeprefix("rank"): found.read_text()
        for found in (Path(out_dir) / framework).glob(f"{name}.rank*.error.txt")
    }
    return Outcome(result, errors)


def launch_under_nbaccel(
    names: tuple[str, ...],
    out_dir: Path,
    runs_dir: str,
    num_processes: int = 2,
    seconds_per_program: float = 60,
) -> dict[str, Any]:
    """Run ``names`` under nbaccel, relaunching after each failed program.

    Returns facts about the runs (launch count, wall time); outcomes are read from disk.
    """
    import nbaccel

    (out_dir / "nbaccel").mkdir(parents=True, exist_ok=True)
    remaining, launches, started = list(names), 0, time.monotonic()
    while remaining:
        launches += 1
        run = nbaccel.launch(
            run_programs,
            args=(remaining, "nbaccel", str(out_dir)),
            num_processes=num_processes,
            runs_dir=runs_dir,
            dashboard="text",
        )
        launched = time.monotonic()
        _wait_while_programs_finish(run, remaining, out_dir, seconds_per_program)
        seconds = time.monotonic() - launched
        print(
            f"parity: nbaccel launch {launches} ({remaining[0]}..., {len(remaining)} programs)"
            f" {run.state.value} after {seconds:.1f} s",
            flush=True,
        )
        if run.state is nbaccel.RunState.SUCCEEDED:
            remaining = remaining[len(run.result()) :]
            continue
        unfinished = [n for n in remaining if not _finished_cleanly(out_dir, n)]
        if not unfinished:  # every program finished; the failure came after them
            break
        failed = unfinished[0]
        reason = f"launch {run.run_id} ended as {run.state.value}: {run.error!r}\n"
        if not started_path(out_dir, "nbaccel", remaining[0]).exists():
            # No program started: the launch itself is broken, and would be again.
            for name in remaining:
                error_path(out_dir, "nbaccel", name, "-launch").write_text(reason)
            break
        if not read_outcome(out_dir, "nbaccel", failed).errors:
            # Nothing in the program raised: it hung, or its process died.
            error_path(out_dir, "nbaccel", failed, "-launch").write_text(reason)
        remaining = remaining[remaining.index(failed) + 1 :]
    return {"launches": launches, "seconds": time.monotonic() - started}


def _wait_while_programs_finish(
    run: Any, names: list[str], out_dir: Path, seconds_per_program: float
) -> None:
    """Wait for ``run`` to end; stop it once no program has finished for
    ``seconds_per_program`` (a hang: a deadlock, or a rank waiting for a dead peer)."""
    finished, progress_at = 0, time.monotonic()
    while True:
        try:
            run.wait(timeout=2)
            return
        except TimeoutError:
            pass
        now_finished = sum(result_path(out_dir, "nbaccel", n).exists() for n in names)
        if now_finished > finished:
            finished, progress_at = now_finished, time.monotonic()
        elif time.monotonic() - progress_at > seconds_per_program:
            run.stop()
            return


def _finished_cleanly(out_dir: Path, name: str) -> bool:
    outcome = read_outcome(out_dir, "nbaccel", name)
    return outcome.result is not None and not outcome.errors


def launch_under_accelerate(
    names: tuple[str, ...],
    out_dir: Path,
    num_processes: int = 2,
    device: str = "cpu",
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run ``names`` under Accelerate in a driver process (see the module docstring)."""
    # OMP_NUM_THREADS: else Accelerate resizes torch's thread pool (cores / processes).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if device == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "-m", "tests.parity.runner", str(out_dir), str(num_processes), *names],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def main(argv: list[str]) -> int:
    """The Accelerate driver: ``python -m tests.parity.runner OUT_DIR PROCESSES NAME...``.

    Each program's ``notebook_launcher`` call runs in a forked child of this process, which
    only imported modules: the launcher's threads (torch elastic's agent and store) never
    accumulate in the process that forks the next program, and a hung program is killed
    with its process group after ``PROGRAM_TIMEOUT`` seconds instead of stopping the rest.
    """
    import multiprocessing

    out_dir, processes, names = argv[0], int(argv[1]), argv[2:]
    (Path(out_dir) / "accelerate").mkdir(parents=True, exist_ok=True)
    # Loaded once here, before the forks, so no program pays for the imports.
    import accelerate  # noqa: F401
    import torch  # noqa: F401
    import transformers

    for model in ("BertForSequenceClassification", "GPT2LMHeadModel", "get_scheduler"):
        getattr(transformers, model)
    fork = multiprocessing.get_context("fork")
    for name in names:
        started = time.monotonic()
        # Accelerate is the reference, not what is tested: a launch of its that hangs (seen
        # about once in a few dozen runs on a loaded 2-core machine, in torch elastic's
        # start-up; its fork of a process with threads can also leave children stuck, 1
        # launch in ~60 in benchmarks/data_handoff.py) gets two more tries before the program
        # counts as failed (a CI run on 2026-11-28 had trackers hang twice in a row).
        for attempt in (1, 2, 3):
            for stale in (Path(out_dir) / "accelerate").glob(f"{name}.*"):
                stale.unlink()  # what an earlier attempt left
            # Its work folder too: a program that appends there (TensorBoard's event files,
            # hparams.yml) would report both attempts' records.
            shutil.rmtree(Path(out_dir) / "accelerate" / f"{name}-work", ignore_errors=True)
            child = fork.Process(
                target=_launch_one, args=(name, out_dir, processes), name=f"parity-{name}"
            )
            child.start()
            child.join(PROGRAM_TIMEOUT)
            if child.exitcode == 0 and result_path(out_dir, "accelerate", name).exists():
                break
            if child.exitcode is None:
                os.killpg(child.pid, signal.SIGKILL)  # the launcher and its workers
                child.join()
                error_path(out_dir, "accelerate", name, "-launch").write_text(
                    f"{name} did not finish within {PROGRAM_TIMEOUT} s under Accelerate "
                    f"(attempt {attempt}); killed.\n"
                )
        print(f"parity: {name} under accelerate: {time.monotonic() - started:.1f} s", flush=True)
    return 0


def _launch_one(name: str, out_dir: str, processes: int) -> None:
    import accelerate

    os.setsid()  # one process group: the driver can kill the launcher and its workers
    try:
        accelerate.notebook_launcher(
            run_program,
            args=(name, "accelerate", out_dir),
            num_processes=processes,
            use_port=_free_port(),
        )
    except BaseException:
        error_path(out_dir, "accelerate", name, "-launch").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
