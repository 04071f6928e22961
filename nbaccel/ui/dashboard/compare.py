"""Earlier runs to overlay on the dashboard's curve: found in the same ``runs_dir``.

Every run keeps its metrics in ``<runs_dir>/<run id>/events.jsonl``; run ids begin with
the launch time (``20261125-181712-54fef4``), so sorting them sorts the runs. The picker
lists the newest earlier runs; a picked run's rank-0 metrics are read once (on the
dashboard's UI thread, or the kernel's once the run has ended) and kept. Stdlib and
``run_folder.read_metrics`` only: the kernel never imports torch.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path

from nbaccel.launcher.run_folder import read_metrics

MAX_LISTED = 20  # the newest earlier runs offered; older ones are still on disk
MAX_POINTS = 4000  # per overlaid series, as the live series' bound
COLOURS = ("#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")  # plots.OVERLAY_COLOURS

Series = tuple[list[int], list[float]]


def earlier_runs(run_dir: str | Path, limit: int = MAX_LISTED) -> list[str]:
    """Run ids in ``run_dir``'s parent that started before it and logged events, newest
    first (at most ``limit``).

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> for name in ("20260101-000000-aaaaaa", "20260102-000000-bbbbbb", "20260103-000000-cc"):
    ...     (root / name).mkdir(); _ = (root / name / "events.jsonl").write_text("")
    >>> earlier_runs(root / "20260103-000000-cc")
    ['20260102-000000-bbbbbb', '20260101-000000-aaaaaa']
    """
    current = Path(run_dir)
    try:
        # Names only, newest first; then one stat per run until ``limit`` are found: a
        # runs_dir of thousands of runs costs each launch its listing, not a stat per run.
        names = sorted((n for n in os.listdir(current.parent) if n < current.name), reverse=True)
        found: list[str] = []
        for name in names:
            if len(found) == limit:
                break
            if (current.parent / name / "events.jsonl").is_file():
                found.append(name)
    except OSError:  # the folder went away, or is not readable: nothing to compare with
        return []
    return found


class EarlierRuns:
    """The picked earlier runs and their metrics, read once each from ``events.jsonl``.

    >>> import json, tempfile
    >>> root = Path(tempfile.mkdtemp()); (root / "r1").mkdir()
    >>> record = {"event": "metric", "rank": 0, "step": 3, "values": {"loss": 0.5}}
    >>> _ = (root / "r1" / "events.jsonl").write_text(json.dumps(record) + "\\n")
    >>> runs = EarlierRuns(root / "r2")
    >>> runs.pick(["r1"]); runs.overlays("loss")
    [('r1', [3], [0.5])]
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.runs_dir = Path(run_dir).parent
        self.picked: tuple[str, ...] = ()
        self._series: dict[str, dict[str, Series]] = {}
        self.problems: dict[str, str] = {}  # run id -> why its metrics could not be read

    def pick(self, run_ids: Sequence[str]) -> None:
        """Overlay these runs (in this order) from now on, reading the new ones."""
        self.picked = tuple(run_ids)
        for run_id in self.picked:
            if run_id not in self._series:
                self._series[run_id] = self._read(run_id)

    def overlays(self, metric: str) -> list[tuple[str, list[int], list[float]]]:
        """``(run id, steps, values)`` of ``metric`` for each picked run that logged it."""
        found = []
        for run_id in self.picked:
            steps, values = self._series.get(run_id, {}).get(metric, ([], []))
            if steps:
                found.append((run_id, steps, values))
        return found

    def legend_html(self, metric: str, current: str) -> str:
        """The curve's legend: this run, then each picked run in its line's colour (a run
        that did not log ``metric``, or could not be read, says so)."""
        if not self.picked:
            return ""
        items = [f"<span style='color:#1f77b4'>&#9644; {html.escape(current)} (this run)</span>"]
        drawn = {run_id for run_id, _, _ in self.overlays(metric)}
        index = 0
        for run_id in self.picked:
            name = html.escape(run_id)
            if run_id in drawn:
                colour = COLOURS[index % len(COLOURS)]
                index += 1
                items.append(f"<span style='color:{colour}'>&#9644; {name}</span>")
            else:
                why = self.problems.get(run_id, f"no {metric}")
                items.append(f"<span style='color:#999'>{name} ({html.escape(why)})</span>")
        return (
            "<div style='font-family:monospace;font-size:85%'>" + " &nbsp; ".join(items) + "</div>"
        )

    def _read(self, run_id: str) -> dict[str, Series]:
        try:
            records = read_metrics(self.runs_dir / run_id / "events.jsonl", rank=0)
        except (OSError, ValueError) as error:
            self.problems[run_id] = f"unreadable: {error}"
            return {}
        series: dict[str, Series] = {}
        for record in records:
            step = int(record["step"])
            for name, value in record.items():
                if name != "step" and isinstance(value, int | float):
                    steps, values = series.setdefault(name, ([], []))
                    steps.append(step)
                    values.append(float(value))
        for name, (steps, values) in series.items():
            stride = -(-len(steps) // MAX_POINTS)
            if stride > 1:  # keep the shape at bounded cost, as the live series does
                series[name] = (steps[::stride], values[::stride])
        return series
