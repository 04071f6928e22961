"""What ``nbaccel.runs()`` shows: every run folder under ``runs_dir``, newest first.

Read from the folders alone (``config.json``, ``events.jsonl``, a detached run's
``supervisor.json``), so it works in any kernel, after any restart. A table in Jupyter
(``_repr_html_``), aligned text elsewhere. ``prune`` removes finished runs' folders.
"""

from __future__ import annotations

import datetime
import html
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from nbaccel.launcher.detached.attached import SUPERVISOR_RECORD

TAIL_BYTES = 1 << 16  # the last metrics are near the end of events.jsonl, however long


@dataclass(frozen=True)
class RunSummary:
    """One run folder, as far as its files tell."""

    run_id: str
    run_dir: Path
    state: str  # succeeded | failed | cancelled | running | lost | unknown
    detached: bool
    started: float  # seconds since the epoch
    elapsed: float
    world_size: int | None
    last_metrics: dict[str, Any]

    @property
    def finished(self) -> bool:
        return self.state in ("succeeded", "failed", "cancelled", "stopped", "lost")


class RunsTable(list[RunSummary]):
    """``nbaccel.runs()``'s answer: a list of ``RunSummary``, shown as a table."""

    pruned: list[str]

    def __init__(self, runs: list[RunSummary], pruned: list[str]) -> None:
        super().__init__(runs)
        self.pruned = pruned

    def rows(self) -> list[list[str]]:
        header = ["run", "state", "started", "elapsed", "world", "last metrics"]
        return [header] + [
            [
                run.run_id + (" (detached)" if run.detached else ""),
                run.state,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.started)),
                str(datetime.timedelta(seconds=round(run.elapsed))),
                "?" if run.world_size is None else str(run.world_size),
                ", ".join(f"{k}={_short(v)}" for k, v in run.last_metrics.items()),
            ]
            for run in self
        ]

    def __str__(self) -> str:
        rows = self.rows()
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        if self.pruned:
            lines.append(f"pruned {len(self.pruned)} run folder(s): {', '.join(self.pruned)}")
        return "\n".join(line.rstrip() for line in lines)

    __repr__ = __str__  # the text a terminal, or Jupyter's text/plain, shows

    def _repr_html_(self) -> str:
        head, *body = self.rows()
        cells = "".join(f"<th>{html.escape(c)}</th>" for c in head)
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body
        )
        pruned = f"<p>pruned: {html.escape(', '.join(self.pruned))}</p>" if self.pruned else ""
        return f"<table><thead><tr>{cells}</tr></thead><tbody>{rows}</tbody></table>{pruned}"


def list_runs(
    runs_dir: Path, prune: int | datetime.timedelta | None = None, now: float | None = None
) -> RunsTable:
    """The runs under ``runs_dir``, newest first; ``prune`` first removes finished runs:
    all but the newest ``prune`` of them (an int), or those started longer ago than it (a
    timedelta). A run still going is never removed.

    >>> import tempfile
    >>> print(list_runs(Path(tempfile.mkdtemp())))
    run  state  started  elapsed  world  last metrics
    """
    now = time.time() if now is None else now
    found = [summarise(path, now) for path in _run_dirs(runs_dir)]
    found.sort(key=lambda run: run.started, reverse=True)
    pruned: list[str] = []
    if prune is not None:
        finished = [run for run in found if run.finished]
        if isinstance(prune, datetime.timedelta):
            doomed = [run for run in finished if now - run.started > prune.total_seconds()]
        elif isinstance(prune, int) and not isinstance(prune, bool) and prune >= 0:
            doomed = finished[prune:]
        else:
            raise ValueError(
                f"prune={prune!r}: give the number of finished runs to keep (an int >= 0) "
                "or a datetime.timedelta (finished runs started longer ago are removed)."
            )
        for run in doomed:
            shutil.rmtree(run.run_dir)
            pruned.append(run.run_id)
        found = [run for run in found if run.run_id not in pruned]
    return RunsTable(found, pruned)


def summarise(run_dir: Path, now: float) -> RunSummary:
    """What one run folder says about its run."""
    record = _json(run_dir / SUPERVISOR_RECORD)
    ended, last_metrics = _tail(run_dir / "events.jsonl")
    started = record.get("started") or (run_dir / "config.json").stat().st_mtime
    if ended is not None:
        state, elapsed = ended["state"], ended["time"] - started
    elif record:
        state = "running" if _alive(record.get("pid")) else "lost"
        elapsed = now - started
    else:
        state, elapsed = "unknown", now - started  # a kernel's own run: that kernel knows
    world_size = record.get("world_size") or len(list(run_dir.glob("rank*.log"))) or None
    return RunSummary(
        run_dir.name, run_dir, state, bool(record), started, elapsed, world_size, last_metrics
    )


def find_run(runs_dir: Path, run_id: str) -> Path:
    """The folder of ``run_id`` (or of the newest detached run for ``"latest"``)."""
    if run_id == "latest":
        detached = [run for run in list_runs(runs_dir) if run.detached]
        if not detached:
            raise ValueError(f"no detached run under {runs_dir}: launch one with detach=True.")
        return detached[0].run_dir
    path = runs_dir / run_id
    if not (path / "config.json").exists():
        known = ", ".join(run.run_id for run in list_runs(runs_dir)[:5]) or "none"
        raise ValueError(f"no run {run_id!r} under {runs_dir} (newest: {known}).")
    return path


def _run_dirs(runs_dir: Path) -> list[Path]:
    if not runs_dir.is_dir():
        return []
    return [path for path in runs_dir.iterdir() if (path / "config.json").is_file()]


def _tail(events: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The ``ended`` record (None while running) and rank 0's last metrics."""
    if not events.exists():
        return None, {}
    with open(events, "rb") as file:
        file.seek(max(0, events.stat().st_size - TAIL_BYTES))
        lines = file.read().decode(errors="replace").splitlines()
    ended, metrics = None, {}
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # the first line of the tail is cut, or a killed writer's last
        if entry.get("event") == "ended":
            ended = entry
        elif entry.get("event") == "metric" and entry.get("rank") == 0:
            metrics = {**entry["values"], "step": entry["step"]}
    return ended, metrics


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        process = psutil.Process(pid)
        return "nbaccel.launcher.detached.supervisor_main" in " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _json(path: Path) -> dict[str, Any]:
    try:
        value: dict[str, Any] = json.loads(path.read_text())
        return value
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
