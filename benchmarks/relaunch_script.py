"""The script case of ``relaunch_real_cell.py``: a sweep in a plain ``python`` script.

The script imports torch and transformers (and the launcher), defines the tiny-BERT
``train`` of the notebook case, and calls the launcher ``launches`` times in a loop, back
to back, each call timed in the script (``time.perf_counter()`` around it). No kernel: no
prewarm at import, no watch of the imports, no pause between launches. Ways:

* ``script nbaccel``: ``nbaccel.notebook_launcher(train, num_processes=2, dashboard=False)``;
* ``script accelerate``: ``accelerate.notebook_launcher(train, num_processes=2)`` with
  ``ACCELERATE_USE_CPU=true`` and a free port per launch (it forks the script, which has
  transformers imported).

Each script runs in its own session with its own temporary folder; on a timeout its whole
process group is killed. Rows (``script_rows``): the first launch, and the later ones (2nd to
last), per way, with the ratio to Accelerate's same launches, pooled and paired by round.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_util import FREE_PORT, median, run_command

SCRIPT_TIMEOUT_S = 600.0  # the whole script: imports, and every launch

HEADS = {
    "script nbaccel": "import nbaccel, torch, transformers\n",
    "script accelerate": "import os\nos.environ['ACCELERATE_USE_CPU'] = 'true'\n"
    "import accelerate, torch, transformers\n",
}
CALLS = {
    "script nbaccel": "nbaccel.notebook_launcher(train, num_processes=2, dashboard=False, "
    "runs_dir={runs!r})",
    "script accelerate": "accelerate.notebook_launcher(train, num_processes=2, "
    "use_port=str(_free_port()))",
}


def script_source(way: str, train_source: str, launches: int, runs: str) -> str:
    """The script: timed imports, ``train``, then ``launches`` timed calls; prints JSON."""
    call = CALLS[way].format(runs=runs)
    return (
        "import json, time\n"
        "_t0 = time.perf_counter()\n"
        + HEADS[way]
        + "from transformers import BertConfig, BertForSequenceClassification\n"
        "_import_s = time.perf_counter() - _t0\n"
        + train_source
        + FREE_PORT
        + "if __name__ == '__main__':\n"
        "    _seconds = []\n"
        f"    for _ in range({launches}):\n"
        "        _started = time.perf_counter()\n"
        f"        {call}\n"
        "        _seconds.append(time.perf_counter() - _started)\n"
        "    print('RESULT ' + json.dumps({'import_s': _import_s, 'launches': _seconds}))\n"
    )


def run_script_loop(way: str, train_source: str, launches: int) -> dict[str, Any]:
    """One script of ``way``: its import time and every launch's seconds, or an error."""
    result: dict[str, Any] = {"way": way}
    with tempfile.TemporaryDirectory(prefix="relaunch-script-") as scratch:
        root = Path(scratch)
        script = root / "sweep.py"
        script.write_text(script_source(way, train_source, launches, str(root / "runs")))
        try:
            done = run_command([sys.executable, str(script)], SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            result["error"] = f"still running after {SCRIPT_TIMEOUT_S:.0f} s (killed)"
            return result
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not found:
            result["error"] = f"exit {done.returncode}: {done.stderr.strip()[-1500:]}"
            return result
        result.update(json.loads(found[-1][len("RESULT ") :]))
    return result


def samples(scripts: list[dict[str, Any]], way: str, which: str) -> list[float]:
    """Seconds of ``way``'s first launches (``which="first"``) or of its later ones."""
    found = []
    for script in scripts:
        if script["way"] == way and "launches" in script:
            launches = script["launches"]
            found += launches[:1] if which == "first" else launches[1:]
    return found


def script_rows(rounds: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Rows like ``relaunch_real_cell.summarize``'s: median, n, fail, ratio, paired."""
    everything = [k for kernels in rounds for k in kernels]
    rows: dict[str, dict[str, Any]] = {}
    for which, label in (("first", "script loop, first"), ("later", "script loop, 2nd on")):
        peer = median(samples(everything, "script accelerate", which))
        for way in ("script nbaccel", "script accelerate"):
            values = samples(everything, way, which)
            if not values and not any(k["way"] == way for k in everything):
                continue
            row: dict[str, Any] = {"median": median(values), "n": len(values)}
            row["fail"] = sum(k["way"] == way and "error" in k for k in everything)
            if row["median"] is not None and peer:
                row["ratio"] = row["median"] / peer
            paired = []
            for kernels in rounds:
                mine = median(samples(kernels, way, which))
                theirs = median(samples(kernels, "script accelerate", which))
                if mine is not None and theirs:
                    paired.append(mine / theirs)
            row["paired"] = median(paired)
            rows[f"{way.removeprefix('script ')} | {label}"] = row
    for way in ("script nbaccel", "script accelerate"):
        imports = [k["import_s"] for k in everything if k["way"] == way and "import_s" in k]
        if imports:
            name = f"{way.removeprefix('script ')} | script imports"
            rows[name] = {"median": median(imports), "n": len(imports), "fail": 0}
    return rows


def script_per_launch(rounds: list[list[dict[str, Any]]]) -> list[str]:
    """Every script's launches, in order: where the time went, launch by launch."""
    lines = []
    for index, kernels in enumerate(rounds):
        for k in kernels:
            if k["way"].startswith("script ") and "launches" in k:
                each = " ".join(f"{s:.3f}" for s in k["launches"])
                lines.append(f"  round {index + 1} {k['way']:<18} launches (s): {each}")
    return lines
