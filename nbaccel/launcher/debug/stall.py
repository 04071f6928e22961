"""When a run has stalled: no rank printed, logged a metric or finished a step for a while.

``StallWatch`` is pure logic over the clock it is given, kept by the run's pump thread: every
sign of life (``activity``) starts the quiet period again; ``due`` says once per stall, after
``seconds`` of quiet, that the ranks should be asked for their stacks, and never while a
rank is stopped in a debugger (its peers wait for it: that is no stall). ``StallReports``
is the part of a run's pump that asks the ranks then and emits the ``StallWarning``, and
emits the hub's notices. Stdlib only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nbaccel.errors import CollectiveTimeout
from nbaccel.events import Event, Notice, StallWarning
from nbaccel.launcher.debug.hub import DebugHub
from nbaccel.launcher.debug.stacks import STACKS_TIMEOUT, describe


class StallWatch:
    """One run's quiet periods.

    >>> watch = StallWatch(seconds=5.0, now=0.0)
    >>> watch.due(4.0, paused=False), watch.due(5.0, paused=False), watch.due(9.0, paused=False)
    (False, True, False)
    >>> watch.activity(10.0); watch.due(15.0, paused=True), watch.due(19.0, paused=False)
    (False, False)
    >>> watch.due(20.0, paused=False)  # 5 s after the debugger was left
    True
    """

    def __init__(self, seconds: float | None, now: float) -> None:
        self.seconds = seconds
        self._since = now  # the last sign of life
        self._warned = False  # this stall was told already

    def activity(self, now: float) -> None:
        self._since = now
        self._warned = False

    def quiet_for(self, now: float) -> float:
        return now - self._since

    def due(self, now: float, *, paused: bool) -> bool:
        """Whether to warn now (once per stall; a debugger stop pauses it: the quiet period
        starts again when the debugger is left)."""
        if self.seconds is None or self._warned:
            return False
        if paused:
            self._since = now
            return False
        if now - self._since >= self.seconds:
            self._warned = True
            return True
        return False

    def next_deadline(self) -> float | None:
        """When ``due`` may next say yes (None: not in this stall)."""
        if self.seconds is None or self._warned:
            return None
        return self._since + self.seconds


class StallReports:
    """The stall warning and the debug channels' notices, as a run's pump thread handles
    them (a part of ``pump.RunPump``, whose state it reads)."""

    _debug: DebugHub | None
    _stall: StallWatch
    _post: Callable[[dict[str, Any]], None]
    _emit: Callable[[Event], None]
    _record: Callable[[dict[str, Any]], None]
    host_of: Callable[[int], str | None]

    def _post_notice(self, text: str) -> None:
        """Tell ``text`` as a Notice (from any thread: the pump thread emits it)."""
        self._post({"op": "notice", "text": text})

    def _check_stall(self, live: list[int], now: float) -> None:
        """On the pump thread's every turn: once a stall is due, ask the live ranks for
        their stacks (answered on the hub's thread, then handed back as "stall")."""
        hub = self._debug
        if not live or hub is None or not self._stall.due(now, paused=bool(hub.debugging)):
            return
        seconds = self._stall.quiet_for(now)

        def answered(got: dict[int, dict[str, Any]]) -> None:
            self._post({"op": "stall", "answers": got, "asked": live, "seconds": seconds})

        hub.request_stacks(live, STACKS_TIMEOUT, answered)

    def _on_stall_message(self, message: dict[str, Any]) -> None:
        if message["op"] == "notice":
            self._emit(Notice(message["text"], time.time()))
            return
        if message["op"] == "watch_stalls":  # interactive workers: only while a call runs
            self._stall.seconds = message["seconds"]
            self._stall.activity(time.monotonic())
            return
        answers, asked, seconds = message["answers"], message["asked"], message["seconds"]
        stacks = {}
        for rank in asked:
            if rank in answers:
                stacks[rank] = describe(rank, self.host_of(rank), answers[rank])
            else:
                stacks[rank] = (
                    f"rank {rank}: no answer within {STACKS_TIMEOUT:g} s (a thread holds "
                    "the GIL in C code?); run.stacks() reads faulthandler's dump from its log."
                )
        waits = {rank: answers.get(rank, {}).get("waits_in") for rank in asked}
        self._record({"event": "stall", "seconds": seconds, "waits_in": waits})
        self._emit(StallWarning(seconds, stacks, waits, time.time()))

    def _note_debugged(self, error: BaseException | None, stuck: list[int]) -> None:
        """A collective timed out while a stuck rank was in pdb: torch's timeout kept
        running (docs/debugging.md), and the error says so with the fix."""
        hub = self._debug
        debugged = sorted(set(stuck) & hub.stopped_in_debugger()) if hub is not None else []
        if isinstance(error, CollectiveTimeout) and debugged and error.args:
            ranks = ", ".join(map(str, debugged))
            error.args = (
                f"{error.args[0]}\n[nbaccel] rank(s) {ranks} were stopped in the debugger: "
                "torch cannot pause a collective's timeout, so the ranks waiting for them timed "
                "out. For longer debugging sessions raise collective_timeout (seconds) in the "
                "launch.",
                *error.args[1:],
            )
