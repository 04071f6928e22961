"""nbaccel.runs(): run folders read back, states told apart, prune keeps what it must."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest

import nbaccel
from nbaccel.launcher.detached.run_listing import find_run, list_runs

NOW = 1_800_000_000.0


def make_run(
    runs: Path,
    run_id: str,
    *,
    started: float,
    ended: str | None = None,
    supervisor_pid: int | None = None,
    metrics: int = 0,
    ranks: int = 2,
) -> Path:
    run_dir = runs / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"config": {}, "sources": {}}))
    os.utime(run_dir / "config.json", (started, started))
    for rank in range(ranks):
        (run_dir / f"rank{rank}.log").write_text("")
    lines = [
        {
            "time": started + step,
            "event": "metric",
            "rank": 0,
            "step": step,
            "values": {"loss": 1 / (step + 1)},
        }
        for step in range(metrics)
    ]
    if ended:
        lines.append({"time": started + 100, "event": "ended", "state": ended})
    (run_dir / "events.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if supervisor_pid is not None:
        record = {"pid": supervisor_pid, "started": started, "world_size": ranks, "address": "\0x"}
        (run_dir / "supervisor.json").write_text(json.dumps(record))
    return run_dir


def test_states_and_order(tmp_path: Path) -> None:
    make_run(tmp_path, "a-done", started=NOW - 500, ended="succeeded", metrics=3)
    make_run(tmp_path, "b-lost", started=NOW - 400, supervisor_pid=2**22 + 7)  # no such pid
    make_run(tmp_path, "c-kernel", started=NOW - 300)
    make_run(tmp_path, "d-live", started=NOW - 200, supervisor_pid=os.getpid())  # not a supervisor
    make_run(tmp_path, "e-failed", started=NOW - 100, ended="failed", ranks=4)
    (tmp_path / "not-a-run").mkdir()
    table = list_runs(tmp_path, now=NOW)
    assert [(r.run_id, r.state) for r in table] == [
        ("e-failed", "failed"),
        ("d-live", "lost"),  # a live pid that is no supervisor is not believed
        ("c-kernel", "unknown"),
        ("b-lost", "lost"),
        ("a-done", "succeeded"),
    ]
    done = table[-1]
    assert done.elapsed == 100 and done.world_size == 2 and not done.detached
    assert done.last_metrics == {"loss": pytest.approx(1 / 3), "step": 2}
    assert table[0].world_size == 4 and table[1].detached
    text = str(table)
    assert text.splitlines()[0].split() == [
        "run",
        "state",
        "started",
        "elapsed",
        "world",
        "last",
        "metrics",
    ]
    assert "loss=0.3333, step=2" in text
    assert "<td>e-failed</td>" in table._repr_html_()


def test_prune_keeps_the_newest_finished_and_every_unfinished_run(tmp_path: Path) -> None:
    for index, state in enumerate(["succeeded", "failed", None, "cancelled", "succeeded"]):
        make_run(tmp_path, f"run{index}", started=NOW - 1000 + index, ended=state)
    table = list_runs(tmp_path, prune=1, now=NOW)
    assert sorted(table.pruned) == ["run0", "run1", "run3"]
    assert [r.run_id for r in table] == ["run4", "run2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run2", "run4"]


def test_prune_by_age(tmp_path: Path) -> None:
    make_run(tmp_path, "old", started=NOW - 10 * 86400, ended="succeeded")
    make_run(tmp_path, "new", started=NOW - 3600, ended="succeeded")
    table = list_runs(tmp_path, prune=datetime.timedelta(days=7), now=NOW)
    assert table.pruned == ["old"] and [r.run_id for r in table] == ["new"]


@pytest.mark.parametrize("prune", [-1, True, 2.5, "7d"])
def test_bad_prune_is_refused_and_removes_nothing(tmp_path: Path, prune: object) -> None:
    make_run(tmp_path, "done", started=NOW, ended="succeeded")
    with pytest.raises(ValueError, match="prune="):
        list_runs(tmp_path, prune=prune, now=NOW)  # type: ignore[arg-type]
    assert (tmp_path / "done").exists()


def test_find_run(tmp_path: Path) -> None:
    make_run(tmp_path, "kernel-run", started=NOW)
    detached = make_run(tmp_path, "detached-run", started=NOW - 10, supervisor_pid=1)
    assert find_run(tmp_path, "latest") == detached  # the newest *detached* run
    assert find_run(tmp_path, "kernel-run") == tmp_path / "kernel-run"
    with pytest.raises(ValueError, match=r"no run 'nope' under .*newest: "):
        find_run(tmp_path, "nope")


def test_attach_refuses_a_run_that_was_not_detached(tmp_path: Path) -> None:
    make_run(tmp_path, "kernel-run", started=NOW)
    with pytest.raises(ValueError, match="only runs launched with detach=True"):
        nbaccel.attach("kernel-run", runs_dir=tmp_path, dashboard=False)
