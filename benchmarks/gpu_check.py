"""``make test-gpu``: everything nbaccel checks on a GPU, in one run that fits a short loan.

A GPU machine is lent here for a quarter of an hour at a time, its start included, with
torch, Accelerate, transformers and pytest but nothing to download from. This script, run
there from the repository root, does in order, each part in its own process group under its
own time limit (a part over its limit is killed with its children and the next one starts):

1. **install** the wheels ``make gpu-wheels`` put in ``.gpu-wheels/`` (DeepSpeed and its
   needs, tensorboardX, nvidia-ml-py, pytest-timeout: ``benchmarks/gpu_wheels.sh``) into a
   folder put first on ``PYTHONPATH`` (``pip install --no-index --no-deps --target``);
2. **environment**: the GPUs, driver, torch / CUDA / Accelerate / transformers / DeepSpeed;
3. **step rate**: ``benchmarks/gpu_step_rate.py`` (raw loop, nbaccel, Accelerate; GPT-2 124M);
4. **parity**: the Accelerate programs of ``tests/parity`` on the GPU under both frameworks
   (``tests/parity/on_device.py``);
5. **cuda tests**: every test marked ``cuda`` (pytest ``-m cuda``), DeepSpeed's last.

It writes one report, ``gpu-report.md``, with the logs beside it, into ``$OUT`` when that is
set (the device tool brings that folder back), else into ``gpu-check/`` here. With one GPU the
report lists the multi-GPU paths that stayed unrun. Limits add up to 470 s (8 minutes with
the start of Python and the report): ``--limit part=SECONDS`` changes one.

``--dry-run`` runs the same plumbing on a machine without a GPU: each part on the CPU with
tiny sizes (the cuda tests are collected and skipped), so the report is written in about a
minute. docs/gpu-check.md says how to run it with the device tool.

>>> Part("env", ["true"], 5).log
'env.log'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMITS = {
    "install": 20,
    "env": 15,
    "cuda-launch": 25,
    "step-rate": 65,
    "parity": 115,
    "cuda-tests": 230,
}
DRY_LIMITS = {
    "install": 30,
    "env": 30,
    "cuda-launch": 60,
    "step-rate": 120,
    "parity": 120,
    "cuda-tests": 120,
}
PARITY_CUDA_TEST = (
    "tests/multiprocess/test_accelerate_parity.py::"
    "test_the_cuda_program_gives_accelerates_numbers_under_nbaccel"
)
UNRUN_WITH_ONE_GPU = (
    "NCCL collectives across devices (the cuda tests launch one rank per visible GPU, at "
    "most 2: here a world of 1, so no all-reduce crossed devices)",
    "DDP across GPUs against one GPU on the full batch (test_accel_cuda: ran with 1 rank)",
    "FSDP2 sharding across GPUs, with and without CPU offload (test_sharding_cuda: 1 rank, "
    "nothing sharded)",
    "DeepSpeed ZeRO-2/3 partitioning across GPUs (test_deepspeed_cuda: 1 rank)",
    "resume from a checkpoint saved by 2 GPU ranks (test_accel_cuda)",
    "the parity programs with 2 processes on GPUs (ran with 1 process each side)",
)
ENV_PROBE = r"""
import importlib.metadata, json, subprocess, torch
info = {"torch": torch.__version__, "cuda (torch built with)": str(torch.version.cuda),
        "gpus": torch.cuda.device_count()}
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    info[f"gpu {i}"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
for module, dist in (("accelerate", "accelerate"), ("transformers", "transformers"),
                     (None, "deepspeed"), ("tensorboardX", "tensorboardX"),
                     ("pynvml", "nvidia-ml-py")):
    try:  # DeepSpeed is not imported here (seconds): the cuda tests import it
        if module is not None:
            __import__(module)
        info[dist] = importlib.metadata.version(dist)
    except Exception as error:
        info[dist] = f"not importable: {type(error).__name__}: {error}"[:160]
try:
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    found = subprocess.run(query, capture_output=True, text=True, timeout=10)
    info["driver"] = found.stdout.strip()
except Exception:
    info["driver"] = "nvidia-smi not found"
print("ENV " + json.dumps(info))
"""


@dataclass
class Part:
    """One step of the check: a command, its time limit, and its log's file name."""

    name: str
    command: list[str]
    limit: float

    @property
    def log(self) -> str:
        return f"{self.name}.log"


@dataclass
class Outcome:
    name: str
    status: str  # "ok", "exit N", "timed out after N s", "not run: why"
    seconds: float


def run_part(part: Part, out_dir: Path, env: dict[str, str]) -> Outcome:
    """Run ``part`` in its own process group, its output into ``out_dir/part.log``; past its
    limit the whole group (workers, launchers) is terminated, then killed."""
    started = time.monotonic()
    print(f"== {part.name} (limit {part.limit:.0f} s): {' '.join(part.command)}", flush=True)
    with (out_dir / part.log).open("w") as log:
        try:
            process = subprocess.Popen(
                part.command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                start_new_session=True,
            )  # fmt: skip
        except OSError as error:
            return Outcome(part.name, f"not run: {error}", 0.0)
        try:
            code = process.wait(timeout=part.limit)
        except subprocess.TimeoutExpired:
            _end_group(process)
            seconds = time.monotonic() - started
            log.write(f"\n== killed: over its limit of {part.limit:.0f} s\n")
            return Outcome(part.name, f"timed out after {seconds:.0f} s", seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # what it left running
    seconds = time.monotonic() - started
    return Outcome(part.name, "ok" if code == 0 else f"exit {code}", seconds)


def _end_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def cuda_test_files() -> list[str]:
    """The test files that hold ``cuda``-marked tests (only those: another file may import
    what the GPU machine lacks, and a collection error would stop the whole run),
    DeepSpeed's last: they are the slowest (33-40 s each on an H100)."""
    files = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if "pytest.mark.cuda" in path.read_text()
    ]
    return sorted(files, key=lambda name: "deepspeed" in name)


def plan(args: argparse.Namespace, work: Path) -> list[Part]:
    python = sys.executable
    limits = {**(DRY_LIMITS if args.dry_run else LIMITS), **args.limit}
    wheels = sorted(str(w) for w in args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
    install = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    install += ["--no-cache-dir", "--upgrade", "--target", str(args.site), *wheels]
    if args.dry_run:  # the GPU machine's Python: are the wheels installable there, one each?
        install += ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
        install += [f"--platform=manylinux{tag}_x86_64" for tag in ("_2_28", "_2_17", "2014")]
    cuda_launch = [python, "benchmarks/cuda_launch.py"]
    cuda_launch += ["--device", "cpu", "--launches", "3"] if args.dry_run else []
    step_rate = [python, "benchmarks/gpu_step_rate.py", "--json", str(work / "step-rate.json")]
    tiny = ["--device", "cpu", "--size", "tiny", "--quick"]
    step_rate += tiny if args.dry_run else ["--rounds", "8", "--block", "4"]
    parity = [python, "-m", "tests.parity.on_device", str(work / "parity")]
    parity += ["--budget", str(limits["parity"] - 10)]
    parity += ["--device", "cpu", "--programs", "gradient_accumulation"] if args.dry_run else []
    # -o timeout: one hung test cannot take the whole part (pytest-timeout travels as a
    # wheel; without it the option is only a warning). The parity test of DeepSpeed's
    # program is left out: the parity part runs that program already.
    tests = [python, "-m", "pytest", "-m", "cuda", "-v", "-rA", "-p", "no:cacheprovider"]
    tests += ["-o", "timeout=150", "--deselect", PARITY_CUDA_TEST, *cuda_test_files()]
    parts = [
        Part("install", install if wheels else ["true"], limits["install"]),
        Part("env", [python, "-c", ENV_PROBE], limits["env"]),
        Part("cuda-launch", cuda_launch, limits["cuda-launch"]),
        Part("step-rate", step_rate, limits["step-rate"]),
        Part("parity", parity, limits["parity"]),
        Part("cuda-tests", tests, limits["cuda-tests"]),
    ]
    return [part for part in parts if part.name not in args.skip]


def child_env(site: Path | None, work: Path) -> dict[str, str]:
    paths = [str(site or ""), str(ROOT), os.environ.get("PYTHONPATH", "")]
    tmp = work / "tmp"  # inductor and the tests' temporary files: this run's own
    tmp.mkdir(exist_ok=True)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",  # nothing can be downloaded there: fail at once, not retry
        "TRANSFORMERS_OFFLINE": "1",
        "TMPDIR": str(tmp),
    }


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def summarize_tests(log: str) -> list[str]:
    """Counts per outcome from pytest -v lines (also when pytest was killed), the failures,
    and pytest's own summary line when it got that far."""
    outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", log, re.M)
    counts: dict[str, int] = {}
    for _test, outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    lines = [", ".join(f"{n} {o.lower()}" for o, n in sorted(counts.items())) or "no test ran"]
    final = re.findall(r"^=+ (.* in [\d.]+s.*?) =+$", log, re.M)
    if final:
        lines.append(f"pytest: {final[-1]}")
    lines += [f"- {o}: `{t}`" for t, o in outcomes if o in ("FAILED", "ERROR")]
    lines += [f"- {line}" for line in re.findall(r"^SKIPPED \[\d+\] .*$", log, re.M)]
    return lines


def report(outcomes: list[Outcome], out_dir: Path, work: Path, dry_run: bool) -> str:
    env_line = re.search(r"^ENV (.*)$", read(out_dir / "env.log"), re.M)
    env = json.loads(env_line.group(1)) if env_line else {}
    title = "GPU check (dry run on the CPU)" if dry_run else "GPU check"
    lines = [f"# {title}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()] or ["- environment: unknown"]
    lines += ["", "| part | outcome | seconds |", "|---|---|---|"]
    lines += [f"| {o.name} | {o.status} | {o.seconds:.0f} |" for o in outcomes]
    step_rate = work / "step-rate.json"
    lines += ["", "## Step rate (benchmarks/gpu_step_rate.py)", ""]
    if step_rate.exists():
        data = json.loads(step_rate.read_text())
        lines += [", ".join(f"{k} {v}" for k, v in data["info"].items()), "", *data["table"]]
    else:
        lines.append("No figures: see step-rate.log.")
    lines += ["", "## A warm launch to a first CUDA op (benchmarks/cuda_launch.py)", ""]
    launch = re.search(r"^CUDA_LAUNCH (.*)$", read(out_dir / "cuda-launch.log"), re.M)
    lines.append(launch.group(1) if launch else "No figures: see cuda-launch.log.")
    lines += ["", "## Parity programs (tests/parity/on_device.py)", ""]
    lines.append(read(work / "parity" / "parity.md").strip() or "No table: see parity.log.")
    lines += ["", "## cuda tests", "", *summarize_tests(read(out_dir / "cuda-tests.log"))]
    if not dry_run and int(env.get("gpus", 0)) < 2:
        lines += ["", "## Multi-GPU paths left unrun (this machine has one GPU)", ""]
        lines += [f"- {path}" for path in UNRUN_WITH_ONE_GPU]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = os.environ.get("OUT") or str(ROOT / "gpu-check")
    parser.add_argument("--out", type=Path, default=Path(default_out), help="report and logs")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "gpu-site")
    parser.add_argument("--dry-run", action="store_true", help="the plumbing, on the CPU")
    parser.add_argument("--skip", nargs="*", default=[], choices=sorted(LIMITS))
    parser.add_argument(
        "--limit", action="append", default=[], metavar="PART=SECONDS", help="e.g. parity=120"
    )
    args = parser.parse_args(argv)
    args.limit = {k: float(v) for k, v in (item.split("=", 1) for item in args.limit)}
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-", ignore_cleanup_errors=True) as scratch:
        work = Path(scratch)  # the parts' many files; only logs and the report go to out
        if args.dry_run:  # the wheels are for Python 3.12: installed aside, not used here
            args.site = work / "site-py3.12"
        env = child_env(None if args.dry_run else args.site, work)
        outcomes = [run_part(part, args.out, env) for part in plan(args, work)]
        text = report(outcomes, args.out, work, args.dry_run)
        if (work / "step-rate.json").exists():
            (args.out / "step-rate.json").write_text((work / "step-rate.json").read_text())
    text += f"\nWhole check: {time.monotonic() - started:.0f} s.\n"
    (args.out / "gpu-report.md").write_text(text)
    print(text, flush=True)
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
