"""``CallDisplay``: a call's dashboard is made only for a call with something to show, gets
every event of the call in order, and nothing after its end (no kernel: ``make`` records)."""

from __future__ import annotations

import threading

from nbaccel.events import Event, LogLine, Metric, RunEnded, RunStarted, RunState
from nbaccel.interactive.call_display import CallDisplay, Made

START = RunStarted("r", 2, "/tmp/r", 0.0)
DONE = RunEnded(RunState.SUCCEEDED, None, 0.01, 0.0)


class Recorder:
    """What ``make`` made: the events its dashboard got, and how it was shown."""

    def __init__(self) -> None:
        self.made = 0
        self.events: list[Event] = []
        self.shown: list[bool] = []
        self.live = threading.Event()

    def make(self) -> Made:
        self.made += 1

        def show(live: bool) -> None:
            self.shown.append(live)
            if live:
                self.live.set()

        return self.events.append, show


def test_a_quiet_short_call_makes_no_dashboard() -> None:
    record = Recorder()
    display = CallDisplay(record.make, 60.0, frozenset({0}))
    for event in (START, LogLine(1, "rank 1 only", False, False, 0.0), DONE):
        display(event)  # rank 1's line is not shown in this call: text would not print it
    assert record.made == 0


def test_a_short_call_that_printed_shows_its_summary_with_every_event() -> None:
    record = Recorder()
    display = CallDisplay(record.make, 60.0, frozenset({0}))
    line = LogLine(0, "hello", False, False, 0.0)
    for event in (START, line, DONE):
        display(event)
    assert record.made == 1 and record.shown == [False]  # the summary alone
    assert record.events == [START, line, DONE]
    display(LogLine(0, "late", False, False, 0.0))  # after the end: not this call's
    assert record.events == [START, line, DONE]


def test_a_metric_or_a_failure_is_worth_a_summary() -> None:
    for worth in (Metric(0, 1, {"loss": 1.0}, 0.0), RunEnded(RunState.FAILED, None, 0.1, 0.0)):
        record = Recorder()
        display = CallDisplay(record.make, 60.0, None)
        for event in (START, worth) if isinstance(worth, RunEnded) else (START, worth, DONE):
            display(event)
        assert record.made == 1, worth


def test_a_call_that_goes_on_shows_its_widgets_then_gets_the_rest_in_order() -> None:
    record = Recorder()
    display = CallDisplay(record.make, 0.01, None)
    display(START)
    assert record.live.wait(10), "the call went on: its widgets should show"
    later = LogLine(0, "later", False, False, 0.0)
    display(later)
    display(DONE)
    assert record.made == 1 and record.shown == [True]
    assert record.events == [START, later, DONE]


def test_dashboard_after_zero_shows_the_widgets_at_the_start() -> None:
    record = Recorder()
    display = CallDisplay(record.make, 0.0, None)
    display(START)
    assert record.made == 1 and record.shown == [True] and record.events == [START]
