"""Relaunching a real notebook cell (transformers imported in the kernel) on 2 CPU processes:
nbaccel beside Accelerate's ``notebook_launcher`` (fork) and torchrun, in real Jupyter kernels.

What is measured
----------------
The most common notebook: a first cell imports torch and transformers, a second defines
``train``, which builds a tiny BERT from a config (``BertConfig`` /
``BertForSequenceClassification``, nothing downloaded), wraps it in DDP and takes one
training step; then the user runs the launch cell, again and again. Each launch cell times
the whole call inside the kernel (``time.perf_counter()`` around it), from the call until it
returned (workers reaped): that is the figure reported.

Everything runs in real ipykernels driven through jupyter_client, never in a script:
nbaccel starts its helper at ``import nbaccel`` only in a kernel, and offers the helper the
kernel's installed libraries after every cell (IPython's ``post_run_cell``), which it imports
("preloads") while the kernel is idle, so that its workers are forked with transformers
already imported. Every kernel is fresh (its own TMPDIR, runtime and IPython dirs) and is
shut down, with everything it started, before the next one starts.

Ways (one kernel each, per round; the ways' kernels are interleaved, order reversed every
other round, so the machine's drift falls on all of them alike):

* ``nbaccel``: ``nbaccel.notebook_launcher(train, num_processes=2, dashboard=False)``;
* ``accelerate``: ``accelerate.notebook_launcher(train, num_processes=2)`` with
  ``ACCELERATE_USE_CPU=true`` set in the kernel before the import (else each CPU rank runs
  on its own) and a free port (29500 may be taken on a shared machine). It forks the kernel
  (torch elastic, start_method="fork"), so its workers inherit transformers;
* ``torchrun``: the same function as a script, ``python -m torch.distributed.run
  --nproc_per_node 2`` run from the kernel with ``subprocess.run``: every launch is a first.

``train`` calls ``init_process_group("gloo")`` itself where the launcher has not (Accelerate,
torchrun) and destroys it then; nbaccel's workers get the group ready-made.

Launches per kernel:

* **first after import, 0 s**: the launch cell right after the import and def cells, as
  fast as the client can send them (a user who runs all cells at once);
* **first after import, think**: the launch cell ``--think-first`` s (3) after the def cell
  returned (a user writing the launch cell);
* **warm, back-to-back**: the kernel of the 0 s first launch relaunches ``--warm`` times,
  each launch cell sent as soon as the previous one returned;
* **warm, think**: the kernel of the think-time first launch relaunches ``--warm`` times,
  ``--think-warm`` s (1.5) between a launch cell's end and the next (in a notebook there is
  always a pause between two runs of a cell: the helper preloads and forks spares then).

A **pure-torch** cell (kernel: ``import torch`` and the launcher only; the function does one
``all_reduce``) is measured the same way for nbaccel and Accelerate: the trivial case must
not pay for the preloading.

**A script's loop** (``relaunch_script.py``): the same ``train`` in a plain ``python`` script
that imports torch and transformers and calls the launcher ``--script-launches`` (5) times
back to back, a sweep; nbaccel and Accelerate's fork, one script each per round. No kernel:
no helper before the first launch, no watch of the imports, never a pause. Rows: the first
launch, and the later ones; the launch-by-launch seconds are printed too.

A reference kernel, ``nbaccel no-prewarm`` (``NBACCEL_PREWARM=0``: no helper until the
first launch, no preloading), runs the import cell and one first launch each round: what the
prewarm costs the import cell (its helper imports torch on the same cores meanwhile) and
gives the first launch. The rows "import cell + first, 0 s" add cell 1 and the 0 s first
launch: what the user waits for from the imports to the first result.

After its launches, each nbaccel kernel waits (bounded) for the helper's preload and prints
the helper's resident memory: ``rss`` and ``grown`` from the helper's ``preloaded`` report
(grown = what the preloads added), and psutil's RSS / USS of the helper and its spares.

Reading the output
------------------
One table row per way and case: median seconds of the whole call, n, failures, and the ratio
to Accelerate's same case (pooled medians). The targets (issue 26) take the median over the
rounds of the per-round ratio nbaccel / Accelerate (each round's kernels ran side by side):

* warm relaunch <= 1.0 x Accelerate's (aim 0.8 x), back-to-back and with think time;
* first launch after the import cell <= 1.2 x Accelerate's first, at 0 s and at think time;
* pure-torch warm launch <= 0.5 x Accelerate's, back-to-back and with think time;
* a script's loop (issue 30): from the second launch <= 1.0 x Accelerate's, back to back
  (the first launch is measured too: it must not get notably slower).

The machine may be loaded and noisy: the load average is printed; compare ratios, rerun.

Usage::

    python benchmarks/relaunch_real_cell.py                # 3 rounds, 4 warm per kernel
    python benchmarks/relaunch_real_cell.py --quick        # smoke run: 1 round, 2 warm
    python benchmarks/relaunch_real_cell.py --rounds 5 --json samples.json
    python benchmarks/relaunch_real_cell.py --only script --rounds 2   # the sweep only
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_util import FREE_PORT, median, progress, seconds, verdict
from relaunch_script import run_script_loop, script_per_launch, script_rows

WORLD_SIZE = 2
KERNEL_TIMEOUT_S = 120.0  # kernel start, and the import cell on a loaded machine
CELL_TIMEOUT_S = 180.0  # one launch cell (torchrun's workers import transformers each time)
PRELOAD_TIMEOUT_S = 90.0  # the helper's preload of transformers after the launches
EXIT_TIMEOUT_S = 60.0  # a kernel's children (nbaccel's helper) after its shutdown
TORCHRUN_TIMEOUT_S = 60  # one torchrun launch takes ~6 s here; two of eight hung once

TARGET_WARM = 1.0
AIM_WARM = 0.8
TARGET_FIRST = 1.2
TARGET_PURE = 0.5
TARGET_SCRIPT = 1.0

# The function a notebook defines: a tiny BERT from a config, one DDP training step.
TRAIN_SOURCE = """
def train():
    import torch
    import torch.distributed as dist
    from transformers import BertConfig, BertForSequenceClassification

    own_group = not dist.is_initialized()  # nbaccel's workers get the group ready-made
    if own_group:
        dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=128, max_position_embeddings=64,
        )
        model = torch.nn.parallel.DistributedDataParallel(BertForSequenceClassification(config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, config.vocab_size, (4, 16))
        labels = torch.randint(0, 2, (4,))
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        return float(loss)
    finally:
        if own_group:
            dist.destroy_process_group()
"""

# The trivial cell: nothing beyond torch, one all_reduce.
PURE_SOURCE = """
def train():
    import torch
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")
    try:
        value = torch.ones(1)
        dist.all_reduce(value)
        return float(value)
    finally:
        if own_group:
            dist.destroy_process_group()
"""

# Defined with the function (cell 2), untimed: torchrun from the kernel (and FREE_PORT).
TORCHRUN = f"""
def _torchrun(script, port):
    import subprocess, sys
    import psutil

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", port, script]
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as agent:
        try:
            out, err = agent.communicate(timeout={TORCHRUN_TIMEOUT_S})
        except subprocess.TimeoutExpired:
            # Its workers sit in sessions of their own and hold its pipes: kill them too.
            tree = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(True)]
            for process in tree:
                process.kill()
            psutil.wait_procs(tree, timeout=10)
            out, err = agent.communicate(timeout=10)
            raise RuntimeError(f"torchrun still running after {TORCHRUN_TIMEOUT_S} s; its "
                               f"stderr ended with: {{err[-1500:]}}") from None
    return subprocess.CompletedProcess(command, agent.returncode, out, err)
"""

# Cell 1 per way (timed in the kernel from its first statement).
IMPORT_CELLS = {
    "nbaccel": "import nbaccel, torch, transformers\n"
    "from transformers import BertConfig, BertForSequenceClassification",
    "accelerate": "import os\nos.environ['ACCELERATE_USE_CPU'] = 'true'\n"
    "import accelerate, torch, transformers\n"
    "from transformers import BertConfig, BertForSequenceClassification",
    "torchrun": "import subprocess, sys, torch, transformers\n"
    "from transformers import BertConfig, BertForSequenceClassification",
    "nbaccel pure": "import nbaccel, torch",
    "accelerate pure": "import os\nos.environ['ACCELERATE_USE_CPU'] = 'true'\n"
    "import accelerate, torch",
}

IMPORT_CELLS["nbaccel no-prewarm"] = IMPORT_CELLS["nbaccel"]
# The reference for the import cell and the first launch: nbaccel without its prewarm (no
# helper until the first launch, no preloading: the kernel's cells are not watched).
KERNEL_ENV = {"nbaccel no-prewarm": {"NBACCEL_PREWARM": "0"}}

# The launch cell's call per way; {runs} and {script} are filled in per kernel.
CALLS = {
    "nbaccel": "nbaccel.notebook_launcher(train, num_processes=2, dashboard=False, "
    "runs_dir={runs!r})",
    "accelerate": "accelerate.notebook_launcher(train, num_processes=2, use_port=_port)",
    "torchrun": "_torchrun({script!r}, _port)",
}

# After the launches of an nbaccel kernel: the helper's memory once it has preloaded.
MEMORY_CELL = """
import psutil, time as _time
from nbaccel.launcher.local.helper import NOTICES, current_helper
_h = current_helper()
_memory = {}
if _h is not None:
    _memory["preload_done"] = _h.wait_preloaded(PRELOAD_TIMEOUT_S)
    _memory.update({k: v for k, v in _h.preloaded.items() if k != "op"})
    def _mem(process):
        try:  # a spare may be retired (and gone) between the listing and the reading
            info = process.memory_full_info()
            return info.rss, info.uss, info.pss
        except psutil.Error:
            return 0, 0, 0
    _helper = psutil.Process(_h.pid)
    # After its report the helper replaces its spares with ones that have the preloads:
    # read them once they are there again (bounded; a reading, not a synchronisation).
    # Old spares may still be exiting (zombies until reaped): count the living only.
    _until = _time.monotonic() + 20
    while True:
        _spares = [p for p in _helper.children(recursive=True) if _mem(p) != (0, 0, 0)]
        if len(_spares) >= 2 or _time.monotonic() > _until:
            break
        _time.sleep(0.1)
    _memory["helper_rss"], _memory["helper_uss"], _memory["helper_pss"] = _mem(_helper)
    _memory["spares"] = len(_spares)
    _memory["spares_rss"] = sum(_mem(p)[0] for p in _spares)
    _memory["spares_uss"] = sum(_mem(p)[1] for p in _spares)
    _memory["spares_pss"] = sum(_mem(p)[2] for p in _spares)
_memory["notices"] = list(NOTICES)
""".replace("PRELOAD_TIMEOUT_S", repr(PRELOAD_TIMEOUT_S))


def launch_cell(way: str, runs: str, script: str) -> str:
    """The timed launch cell; ``_pre``: the helper's preload report when the cell started."""
    call = CALLS[way.split()[0]].format(runs=runs, script=script)
    lines = ["import time as _time"]
    if way.startswith("nbaccel"):
        lines.append("from nbaccel.launcher.local.helper import current_helper as _ch")
        lines.append("_pre = dict(_ch().preloaded) if _ch() is not None else {}")
    else:
        lines += ["_pre = {}", "_port = str(_free_port())"]
    lines += [
        "_started = _time.perf_counter()",
        f"_result = {call}",
        "_seconds = _time.perf_counter() - _started",
    ]
    if way == "torchrun":
        lines.append(
            "assert _result.returncode == 0, f'torchrun exited {_result.returncode}: '"
            " + _result.stderr[-2000:]"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- kernels


class Kernel:
    """A fresh ipykernel with private dirs; ``cell`` runs code and returns expressions."""

    def __init__(self, root: Path, extra_env: dict[str, str]) -> None:
        from jupyter_client import KernelManager

        env = {**os.environ, **extra_env}
        env.pop("MPLBACKEND", None)  # the inline backend would be handed to workers
        for name in ("TMPDIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
            folder = root / name.lower()
            folder.mkdir(parents=True)
            env[name] = str(folder)
        self.manager = KernelManager(kernel_name="python3")
        # The kernel's own stderr (ipykernel's start-up warnings) would drown the progress.
        self.manager.start_kernel(cwd=str(root), env=env, stderr=subprocess.DEVNULL)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=KERNEL_TIMEOUT_S)
        self.pid = int(self.cell("import os", pid="os.getpid()")["pid"])

    def cell(
        self, code: str, timeout: float = CELL_TIMEOUT_S, **expressions: str
    ) -> dict[str, Any]:
        """Run ``code``; raise with the traceback if it failed; the JSON values asked for."""
        wrapped = {name: f"__import__('json').dumps({expr})" for name, expr in expressions.items()}
        printed: list[str] = []

        def keep(msg: dict[str, Any]) -> None:  # the cell's output, for an error message
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])

        reply = self.client.execute_interactive(
            code, user_expressions=wrapped, timeout=timeout, output_hook=keep
        )
        content = reply["content"]
        if content["status"] != "ok":
            trace = "\n".join(content.get("traceback", []))
            raise RuntimeError(f"cell failed: {content.get('evalue')}\n{trace[-1500:]}")
        values = {}
        for name, value in content["user_expressions"].items():
            if value["status"] != "ok":
                raise RuntimeError(f"{name}: {value.get('evalue')}")
            values[name] = json.loads(ast.literal_eval(value["data"]["text/plain"]))
        return values

    def close(self) -> list[str]:
        """Shut the kernel down and wait for what it started; kill and name what stayed."""
        import psutil

        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            children = []
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)
        _, running = psutil.wait_procs(children, timeout=EXIT_TIMEOUT_S)
        killed = []
        for process in running:
            with contextlib.suppress(psutil.Error):
                killed.append(f"{process.pid} {' '.join(process.cmdline())[:80]}")
                process.kill()
        psutil.wait_procs(running, timeout=5.0)
        return killed


def sleep_until(moment: float) -> None:
    """The user's pause between two cells (the scenario, not a synchronisation)."""
    time.sleep(max(0.0, moment - time.perf_counter()))


def run_kernel(way: str, think_first: float, pauses: list[float]) -> dict[str, Any]:
    """One kernel: import cell, def cell, ``think_first`` s, the first launch, then one
    relaunch per entry of ``pauses`` (the seconds before it)."""
    result: dict[str, Any] = {"way": way, "think_first": think_first}
    with tempfile.TemporaryDirectory(prefix="relaunch-") as scratch:
        root = Path(scratch)
        script = root / "train_script.py"
        source = PURE_SOURCE if way.endswith("pure") else TRAIN_SOURCE
        script.write_text(source + "\nif __name__ == '__main__':\n    train()\n")
        cell = launch_cell(way, str(root / "runs"), str(script))
        kernel = Kernel(root / "kernel", KERNEL_ENV.get(way, {}))
        samples: list[dict[str, Any]] = []
        try:
            timed = f"import time as _time\n_t0 = _time.perf_counter()\n{IMPORT_CELLS[way]}\n"
            timed += "_import_s = _time.perf_counter() - _t0"
            result["import_s"] = kernel.cell(timed, import_s="_import_s")["import_s"]
            kernel.cell(source + FREE_PORT + TORCHRUN)
            for pause in [think_first, *pauses]:
                sleep_until(time.perf_counter() + pause)
                started = time.perf_counter()
                found = kernel.cell(cell, launch_s="_seconds", pre="_pre")
                cell_s = time.perf_counter() - started
                samples.append({"s": found["launch_s"], "cell_s": cell_s, "pause": pause, **found})
            result["first"], result["warm"] = samples[0], samples[1:]
            if way.startswith("nbaccel") and way != "nbaccel no-prewarm":
                timeout = PRELOAD_TIMEOUT_S + 60
                try:
                    result["memory"] = kernel.cell(MEMORY_CELL, timeout, m="_memory")["m"]
                except RuntimeError as error:  # the launches stand; the reading failed
                    result["memory"] = {"error": str(error)[:300]}
        except Exception as error:  # noqa: BLE001 - a failed kernel is a result, not a crash
            result["error"] = f"{type(error).__name__}: {error}"
            result["before_error"] = samples  # kept in the JSON, left out of the medians
        finally:
            killed = kernel.close()
            if killed:
                result["killed"] = killed
    return result


# --------------------------------------------------------------------------- the run


def plan(args: argparse.Namespace) -> list[tuple[str, float, list[float]]]:
    """One round's kernels: (way, think before the first launch, pauses before relaunches).

    The real cell: one kernel per first-launch case, its relaunches back-to-back after the
    0 s first and with think time after the think-time first. The pure-torch cell: one
    kernel, relaunched back-to-back, then with think time."""
    back, think = [0.0] * args.warm, [args.think_warm] * args.warm
    kernels: list[tuple[str, float, list[float]]] = []
    if args.only != "script":
        for way in ("nbaccel", "accelerate"):
            kernels += [(way, 0.0, back), (way, args.think_first, think)]
        kernels += [(way, 0.0, back + think) for way in ("nbaccel pure", "accelerate pure")]
        kernels.append(("torchrun", 0.0, [0.0] * (args.torchrun - 1)))
        kernels.append(("nbaccel no-prewarm", 0.0, []))
    if args.only != "kernels" and args.script_launches:
        kernels += [("script nbaccel", 0.0, []), ("script accelerate", 0.0, [])]
    return kernels


def collect(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    rounds = []
    for index in range(args.rounds):
        kernels = plan(args)
        if index % 2:
            kernels.reverse()
        done = []
        for way, think_first, pauses in kernels:
            progress(
                f"round {index + 1}/{args.rounds}: {way}, first after {think_first:g} s, then"
                f" pauses {pauses}  (load {os.getloadavg()[0]:.1f})"
            )
            if way.startswith("script "):
                done.append(run_script_loop(way, TRAIN_SOURCE, args.script_launches))
            else:
                done.append(run_kernel(way, think_first, pauses))
            if "error" in done[-1]:
                progress(f"  failed: {done[-1]['error'].splitlines()[0]}")
        rounds.append(done)
    return rounds


CASES = (  # (row label, which launches of which kernels)
    ("first, 0 s", "first", "back"),
    ("first, think", "first", "think"),
    ("warm, back-to-back", "warm", "back"),
    ("warm, think", "warm", "think"),
)


def samples_of(kernels: list[dict[str, Any]], way: str, kind: str, pause: str) -> list[float]:
    """Launch seconds of ``way``'s kernels: their first launches (``pause``: after 0 s or
    after think time) or their relaunches (``pause``: back-to-back or after think time)."""
    chosen = [k for k in kernels if k["way"] == way and "error" not in k]
    if kind == "first":
        return [k["first"]["s"] for k in chosen if (k["think_first"] > 0) == (pause == "think")]
    return [s["s"] for k in chosen for s in k["warm"] if (s["pause"] > 0) == (pause == "think")]


def summarize(rounds: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Rows: name -> median seconds, n, fail, pooled ratio and per-round paired ratio."""
    everything = [k for kernels in rounds for k in kernels]
    rows: dict[str, dict[str, Any]] = {}
    for peer_way, ways in (("accelerate", ("nbaccel",)), ("accelerate pure", ("nbaccel pure",))):
        for label, kind, pause in CASES:
            peer = median(samples_of(everything, peer_way, kind, pause))
            for way in (*ways, peer_way):
                values = samples_of(everything, way, kind, pause)
                failed = [k for k in everything if k["way"] == way and "error" in k]
                row: dict[str, Any] = {"median": median(values), "n": len(values)}
                row["fail"] = len(failed) if kind == "first" else 0
                if row["median"] is not None and peer:
                    row["ratio"] = row["median"] / peer
                paired = []
                for kernels in rounds:
                    mine = median(samples_of(kernels, way, kind, pause))
                    theirs = median(samples_of(kernels, peer_way, kind, pause))
                    if mine is not None and theirs:
                        paired.append(mine / theirs)
                row["paired"] = median(paired)
                rows[f"{way} | {label}"] = row
    torchrun = [k for k in everything if k["way"] == "torchrun" and "error" not in k]
    values = [s["s"] for k in torchrun for s in [k["first"], *k["warm"]]]
    peer = rows.get("accelerate | warm, think", {}).get("median")
    found = median(values)
    rows["torchrun | every launch"] = {
        "median": found,
        "n": len(values),
        "fail": sum(k["way"] == "torchrun" and "error" in k for k in everything),
    }
    if found is not None and peer:
        rows["torchrun | every launch"]["ratio"] = found / peer
    no_prewarm = samples_of(everything, "nbaccel no-prewarm", "first", "back")
    rows["nbaccel no-prewarm | first, 0 s"] = {
        "median": median(no_prewarm),
        "n": len(no_prewarm),
        "fail": sum(k["way"] == "nbaccel no-prewarm" and "error" in k for k in everything),
    }
    ways = ("nbaccel", "nbaccel no-prewarm", "accelerate", "torchrun")
    for way in (*ways, "nbaccel pure", "accelerate pure"):
        imports = [k["import_s"] for k in everything if k["way"] == way and "import_s" in k]
        rows[f"{way} | import cell"] = {"median": median(imports), "n": len(imports), "fail": 0}
    for way in ways:  # what the user waits for from cell 1 to the first result, 0 s think
        totals = [
            k["import_s"] + k["first"]["s"]
            for k in everything
            if k["way"] == way and "error" not in k and k["think_first"] == 0
        ]
        rows[f"{way} | import cell + first, 0 s"] = {
            "median": median(totals),
            "n": len(totals),
            "fail": 0,
        }
    accelerate = rows["accelerate | import cell + first, 0 s"]["median"]
    for way in ways:
        row = rows[f"{way} | import cell + first, 0 s"]
        if row["median"] is not None and accelerate:
            row["ratio"] = row["median"] / accelerate
    rows.update(script_rows(rounds))
    return {name: row for name, row in rows.items() if row["n"] or row["fail"]}


def format_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        f"{'way | case':<40}{'median s':>10}{'n':>4}{'fail':>5}{'/ accel':>9}{'paired':>8}",
        "-" * 76,
    ]
    for name, row in rows.items():
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "-"
        paired = f"{row['paired']:.2f}x" if row.get("paired") is not None else "-"
        lines.append(
            f"{name:<40}{seconds(row['median']):>10}{row['n']:>4}{row['fail']:>5}"
            f"{ratio:>9}{paired:>8}"
        )
    lines.append(
        "('/ accel': median over Accelerate's median, same case, same cell kind (torchrun: over"
        " Accelerate's warm-think); 'paired': median over rounds of that round's ratio;"
        " 'import cell': cell 1 timed in the kernel)"
    )
    return lines


def format_targets(rows: dict[str, dict[str, Any]], think_first: float) -> list[str]:
    lines = []
    goals: list[tuple[str, str, float, str]] = [
        ("warm relaunch, back-to-back", "nbaccel | warm, back-to-back", TARGET_WARM, "aim 0.8x"),
        ("warm relaunch, think time", "nbaccel | warm, think", TARGET_WARM, "aim 0.8x"),
        (
            "first launch right after the import cell (0 s)",
            "nbaccel | first, 0 s",
            TARGET_FIRST,
            "",
        ),
        (
            f"first launch {think_first:g} s after the import cell",
            "nbaccel | first, think",
            TARGET_FIRST,
            "",
        ),
        ("pure-torch warm, back-to-back", "nbaccel pure | warm, back-to-back", TARGET_PURE, ""),
        ("pure-torch warm, think time", "nbaccel pure | warm, think", TARGET_PURE, ""),
        (
            "script loop, back to back, 2nd launch on",
            "nbaccel | script loop, 2nd on",
            TARGET_SCRIPT,
            "",
        ),
    ]
    for text, name, limit, aim in goals:
        row = rows.get(name, {})
        paired = row.get("paired")
        if paired is None:
            lines.append(f"target {text}: not measured")
            continue
        met = verdict(paired <= limit)
        extra = f"; {aim}: {verdict(paired <= AIM_WARM)}" if aim else ""
        lines.append(
            f"target {text}: nbaccel / accelerate paired {paired:.2f}x <= {limit:g}x  {met}"
            f"  (medians {row['median']:.3f} s vs {row['median'] / row['ratio']:.3f} s{extra})"
        )
    return lines


def format_memory(rounds: list[list[dict[str, Any]]]) -> list[str]:
    mib = 1024 * 1024
    lines = [
        "helper memory after its preload (MiB; per nbaccel kernel, after its launches; rss and"
        " grown: the helper's report, grown = what its preloads added; USS: pages only that"
        " process has, PSS: shared pages split among their sharers)"
    ]
    for kernels in rounds:
        for k in kernels:
            memory = k.get("memory")
            if not memory or "helper_rss" not in memory:
                continue
            pss = (memory["helper_pss"] + memory["spares_pss"]) / mib
            lines.append(
                f"  {k['way']:<13} preload done {memory.get('preload_done')!s:<5}"
                f" rss {memory.get('rss', 0) / mib:4.0f} grown {memory.get('grown', 0) / mib:3.0f}"
                f" | helper RSS {memory['helper_rss'] / mib:4.0f}"
                f" USS {memory['helper_uss'] / mib:3.0f}"
                f" | {memory['spares']} spares RSS {memory['spares_rss'] / mib:4.0f}"
                f" USS {memory['spares_uss'] / mib:3.0f} | PSS helper+spares {pss:4.0f}"
                f" | modules {memory.get('modules', '-')}"
                + (f"  notices {memory['notices']}" if memory.get("notices") else "")
            )
    return lines


def format_first_state(rounds: list[list[dict[str, Any]]]) -> list[str]:
    """How far the helper's preload had got when each nbaccel first launch started."""
    seen: dict[str, list[str]] = {}
    for kernels in rounds:
        for k in kernels:
            if k["way"] == "nbaccel" and "first" in k:
                pre = k["first"].get("pre", {})
                key = f"first after {k['think_first']:g} s"
                seen.setdefault(key, []).append(str(pre.get("modules", "none yet")))
    return [
        f"helper's sys.modules count at nbaccel's {key} (preload report): {', '.join(v)}"
        for key, v in seen.items()
    ]


def errors(rounds: list[list[dict[str, Any]]]) -> list[str]:
    found = []
    for index, kernels in enumerate(rounds):
        for k in kernels:
            if "error" in k:
                found.append(f"round {index + 1} {k['way']}: {k['error'][:600]}")
            if "killed" in k:
                found.append(f"round {index + 1} {k['way']}: killed after shutdown {k['killed']}")
    return found


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 2 warm")
    parser.add_argument("--rounds", type=int, help="paired rounds (default 3)")
    parser.add_argument("--warm", type=int, help="relaunches per kernel (default 4)")
    parser.add_argument("--torchrun", type=int, help="torchrun launches per round (default 2)")
    parser.add_argument("--think-first", type=float, default=3.0, help="s before 1st launch")
    parser.add_argument("--think-warm", type=float, default=1.5, help="s between relaunches")
    parser.add_argument("--json", metavar="PATH", help="write every raw sample here")
    parser.add_argument(
        "--script-launches", type=int, default=5, help="launches per script loop (0: none)"
    )
    parser.add_argument(
        "--only",
        choices=("all", "kernels", "script"),
        default="all",
        help="run only the kernels' cases or only the script's loop",
    )
    args = parser.parse_args(argv)
    defaults = (1, 2, 1) if args.quick else (3, 4, 2)
    for name, value in zip(("rounds", "warm", "torchrun"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rounds < 1 or args.warm < 1 or args.torchrun < 1:
        parser.error("--rounds, --warm and --torchrun must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_before = os.getloadavg()
    rounds = collect(args)
    rows = summarize(rounds)
    print(
        f"Relaunching a real cell (tiny BERT, one DDP step; torch + transformers imported in the"
        f" kernel), {WORLD_SIZE} CPU processes, real ipykernels. Whole launch call, medians in s."
    )
    print(
        f"{args.rounds} rounds, {args.warm} relaunches per kernel, think before first"
        f" {args.think_first:g} s, between relaunches {args.think_warm:g} s;"
        f" {os.cpu_count()} CPUs, load average before {load_before[0]:.2f}, after"
        f" {os.getloadavg()[0]:.2f} (shared machine: noisy figures); run took"
        f" {time.perf_counter() - started:.0f} s"
    )
    for line in (
        format_table(rows)
        + format_targets(rows, args.think_first)
        + format_first_state(rounds)
        + format_memory(rounds)
        + script_per_launch(rounds)
        + errors(rounds)
    ):
        print(line)
    if args.json:
        record = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
        Path(args.json).write_text(json.dumps({**record, "rounds": rounds}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
