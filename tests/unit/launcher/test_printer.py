"""Text output: rank 0 bare, other ranks labelled, progress bars redrawn in place."""

from __future__ import annotations

import io

from nbaccel.errors import WorkerError
from nbaccel.events import LogLine, RunEnded, RunState
from nbaccel.launcher.printer import TextPrinter


def line(rank: int, text: str, replace: bool = False, partial: bool = False) -> LogLine:
    return LogLine(rank, text, replace, partial, 0.0)


def test_only_shown_ranks_and_labels() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, frozenset({0}), announce_end=False)
    printer(line(0, "hello"))
    printer(line(1, "hidden"))
    assert out.getvalue() == "hello\n"
    out = io.StringIO()
    printer = TextPrinter(out, None, announce_end=False)
    printer(line(0, "a"))
    printer(line(1, "b"))
    assert out.getvalue() == "a\n[rank 1] b\n"


def test_progress_bar_is_redrawn_and_closed() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, None, announce_end=False)
    printer(line(0, " 10%", partial=True))
    printer(line(0, " 50%", replace=True, partial=True))
    printer(line(0, "100%", replace=True))
    printer(line(0, "done"))
    assert out.getvalue() == " 10%\r 50%\r100%\ndone\n"


def test_another_rank_breaks_an_open_progress_line() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, None, announce_end=False)
    printer(line(0, " 10%", partial=True))
    printer(line(1, "warning"))
    printer(line(0, " 20%", replace=True, partial=True))
    printer(RunEnded(RunState.SUCCEEDED, None, 1.0, 0.0))
    assert out.getvalue() == " 10%\n[rank 1] warning\n 20%\n"


def test_background_runs_announce_their_failure() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, frozenset({0}), announce_end=True)
    printer(RunEnded(RunState.FAILED, WorkerError("rank 1 was killed", rank=1), 1.0, 0.0))
    assert out.getvalue() == "nbaccel: run failed: rank 1 was killed\n"


def test_on_several_machines_every_rank_is_labelled_with_its_host() -> None:
    out = io.StringIO()
    hosts = {0: "node1", 3: "node2"}
    printer = TextPrinter(out, None, announce_end=False, host_of=hosts.get)
    printer(line(0, "a"))  # no WorkerStarted needed first: the run knows the host
    printer(line(3, "b"))
    assert out.getvalue() == "[node1:rank 0] a\n[node2:rank 3] b\n"


def test_a_stall_warning_prints_every_ranks_stack() -> None:
    from nbaccel.events import StallWarning

    stream = io.StringIO()
    printer = TextPrinter(stream, frozenset({0}), announce_end=False)
    printer(LogLine(0, "10%", False, True, 0.0))  # an open progress line is closed first
    stacks = {1: "rank 1: waiting in barrier\n  File t.py", 0: "rank 0: in train (t.py:9)"}
    printer(StallWarning(120.0, stacks, {0: None, 1: "barrier"}, 0.0))
    lines = stream.getvalue().splitlines()
    assert lines[0] == "10%"
    assert lines[1].startswith("nbaccel: no rank printed, logged a metric or finished a step")
    assert lines[2:] == ["rank 0: in train (t.py:9)", "rank 1: waiting in barrier", "  File t.py"]


def test_what_the_workers_wait_for_is_said_before_they_start() -> None:
    # A cold start said nothing for seconds (issue 39, item 19): the wait is named.
    from nbaccel.events import Waiting

    out = io.StringIO()
    printer = TextPrinter(out, None, announce_end=False)
    printer(line(0, " 10%", partial=True))
    printer(Waiting("the helper imports torch (the first launch only)", 0.0))
    assert (
        out.getvalue()
        == " 10%\nnbaccel: starting: the helper imports torch (the first launch only)\n"
    )
