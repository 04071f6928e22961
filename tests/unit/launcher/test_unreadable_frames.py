"""A worker's frame that the parent will not read (it names a class of a module not imported
here, as a torch object would) costs that message only: the parent imports nothing, records
why in events.jsonl, and the run goes on. Driven with the fake starter of test_restarts.py."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

from nbaccel.events import Metric, RunState
from nbaccel.frames import encode_frame
from tests.unit.launcher.outcome.test_restarts import Started

ELSEWHERE = "nbaccel_test_not_imported_here"


def refused_frame() -> bytes:
    """A Metric holding an object of a module that is not in sys.modules once it is sent."""
    module = types.ModuleType(ELSEWHERE)

    class Scalar:
        pass

    Scalar.__module__, Scalar.__qualname__ = ELSEWHERE, "Scalar"
    module.Scalar = Scalar  # type: ignore[attr-defined]
    sys.modules[ELSEWHERE] = module
    try:
        return encode_frame(Metric(1, 0, {"loss": Scalar()}, 0.0))  # type: ignore[dict-item]
    finally:
        del sys.modules[ELSEWHERE]


def test_a_frame_naming_a_module_not_imported_is_recorded_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    run = Started(tmp_path, max_restarts=0)
    for rank in (0, 1):
        run.started(rank, 0)
    _, fds = run.helper.spawned[1]
    os.write(fds[2], refused_frame())  # rank 1's event pipe
    for rank in (0, 1):
        run.result(rank, rank)
    assert run.end({0: 0, 1: 0}) is RunState.SUCCEEDED, run.run.error
    assert run.run.results() == {0: 0, 1: 1}
    assert ELSEWHERE not in sys.modules
    [record] = [r for r in run.records() if r["event"] == "unreadable"]
    assert record["rank"] == 1
    assert (
        f"ImportRefused: a message from another nbaccel process holds a {ELSEWHERE}.Scalar"
        in (record["reason"])
    )
    assert run.run.metrics == []  # the refused metric, and nothing in its place
