"""The parity programs on one device kind, as a table: ``make test-gpu`` runs them on the GPU.

``python -m tests.parity.on_device OUT_DIR [--device cuda|cpu] [--programs NAME...]`` runs the
programs under Accelerate and under nbaccel (``runner``) with as many processes as there are
GPUs, at most 2 (on CPU: 2), compares each program's numbers with
``test_accelerate_parity.differences`` and writes ``OUT_DIR/parity.md`` (a Markdown table)
and ``OUT_DIR/parity.json``. It prints the table too and returns 0 when every program ran
under both and agreed (1 otherwise): the table, not the code, is the result.

On CUDA the tolerance is the suite's (bit-for-bit up to the last bits) and the largest
difference is shown beside it, so a GPU kernel that sums in another order on each side shows
as a figure, not only as a failure. With one process, programs written for two (their own
``checks``) may fail their checks under both frameworks alike: the table says which side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nbaccel.hardware.devices import visible_gpu_count
from tests.multiprocess.test_accelerate_parity import DEFAULT_TOLERANCE, TOLERANCES, differences
from tests.parity import runner


def largest_difference(expected: Any, actual: Any) -> float:
    """The largest relative difference between two programs' float results (0 if none)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        keys = expected.keys() & actual.keys() - {"info"}
        return max((largest_difference(expected[k], actual[k]) for k in keys), default=0.0)
    if isinstance(expected, list) and isinstance(actual, list):
        pairs = zip(expected, actual, strict=False)
        return max((largest_difference(a, b) for a, b in pairs), default=0.0)
    if isinstance(expected, float) and isinstance(actual, int | float):
        if math.isnan(expected) or math.isnan(actual):
            return 0.0 if math.isnan(expected) and math.isnan(actual) else math.inf
        return abs(expected - actual) / max(abs(expected), 1e-12)
    return 0.0


def compare(out_dir: Path, name: str) -> dict[str, Any]:
    """One program's row: how it ended under each framework, and their agreement."""
    row: dict[str, Any] = {"program": name}
    outcomes = {fw: runner.read_outcome(out_dir, fw, name) for fw in ("accelerate", "nbaccel")}
    for framework, outcome in outcomes.items():
        failure = outcome.failure()
        checks = (outcome.result or {}).get("checks", {})
        failed_checks = sorted(k for k, ok in checks.items() if not ok)
        row[framework] = (
            "failed: " + failure.splitlines()[-1][:120]
            if failure
            else ("checks failed: " + ", ".join(failed_checks) if failed_checks else "ran")
        )
    reference, mine = outcomes["accelerate"].result, outcomes["nbaccel"].result
    if reference is None or mine is None:
        row["agree"], row["differences"], row["largest"] = None, None, None
        return row
    found = differences(reference, mine, TOLERANCES.get(name, DEFAULT_TOLERANCE))
    row["agree"] = not found
    row["differences"] = found[:5]
    row["largest"] = largest_difference(reference, mine)
    return row


def table(rows: list[dict[str, Any]], device: str, processes: int) -> list[str]:
    lines = [
        f"Parity programs on {device}, {processes} process(es) each side:",
        "",
        "| program | Accelerate | nbaccel | same numbers | largest rel. difference |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        agree = {None: "—", True: "yes", False: "NO"}[row["agree"]]
        largest = "—" if row["largest"] is None else f"{row['largest']:.1e}"
        lines.append(
            f"| {row['program']} | {row['accelerate']} | {row['nbaccel']} | {agree} | {largest} |"
        )
    for row in rows:
        if row["differences"]:
            lines.append(f"\n{row['program']}: " + "; ".join(row["differences"]))
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--programs", nargs="+")
    parser.add_argument(
        "--budget", type=float, default=300, help="seconds for both sides; Accelerate's gets 55 %"
    )
    args = parser.parse_args(argv)
    gpus = visible_gpu_count(os.environ)
    if args.device == "cuda" and gpus == 0:
        parser.error("no GPU is visible here: use --device cpu")
    processes = max(1, min(2, gpus)) if args.device == "cuda" else 2
    names = tuple(args.programs or runner.CPU_PROGRAMS + runner.CUDA_PROGRAMS)
    if args.device == "cpu":
        names = tuple(n for n in names if n not in runner.CUDA_PROGRAMS)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        driver = runner.launch_under_accelerate(
            names,
            args.out_dir,
            num_processes=processes,
            device=args.device,
            timeout=args.budget * 0.55,
        )
        print(driver.stdout[-2000:] + driver.stderr[-2000:], flush=True)
    except subprocess.TimeoutExpired:
        print(f"Accelerate's side did not finish in {args.budget * 0.55:.0f} s", flush=True)
    accelerate_seconds = time.monotonic() - started
    write(args.out_dir, [compare(args.out_dir, name) for name in names], args.device, processes)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # nbaccel's launch: the same device as above
    # A program that makes no progress for this long is stopped as hung (runner's rule).
    hung = max(30.0, args.budget - (time.monotonic() - started))
    facts = runner.launch_under_nbaccel(
        names,
        args.out_dir,
        str(args.out_dir / "runs"),
        num_processes=processes,
        seconds_per_program=hung,
    )
    rows = [compare(args.out_dir, name) for name in names]
    note = (
        f"Accelerate's side {accelerate_seconds:.0f} s, nbaccel's {facts['seconds']:.0f} s "
        f"({facts['launches']} launch(es))."
    )
    print("\n".join(write(args.out_dir, rows, args.device, processes, note)), flush=True)
    return 0 if all(row["agree"] for row in rows) else 1


def write(
    out_dir: Path, rows: list[dict[str, Any]], device: str, processes: int, note: str = ""
) -> list[str]:
    """``parity.md`` and ``parity.json`` (written after each side: a run stopped midway
    still leaves what it had)."""
    lines = table(rows, device, processes) + ([f"\n{note}"] if note else [])
    (out_dir / "parity.md").write_text("\n".join(lines) + "\n")
    (out_dir / "parity.json").write_text(json.dumps(rows, indent=1))
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
