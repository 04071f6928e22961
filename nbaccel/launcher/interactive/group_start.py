"""How a ``WorkerGroup`` (``workers.py``) comes to be: started as one long launch of the serve
loop (``_start``), or taken over from a ``keep_workers`` run whose function returned on every
rank (``take_over``); either way each rank's connection is taken (``connect.accept_ranks``)
and the group is live. Also which group was made last (``%%nbaccel`` runs there)."""

from __future__ import annotations

import dataclasses
import secrets
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Self

from nbaccel.config.resolve import ConfigSource
from nbaccel.launcher import api
from nbaccel.launcher.bootstrap.payload import build_payload, cell_sources
from nbaccel.launcher.checks import refuse_unsupported
from nbaccel.launcher.control import listen
from nbaccel.launcher.interactive.calls import Replies, Sender
from nbaccel.launcher.interactive.connect import accept_ranks
from nbaccel.launcher.interactive.ending import shut
from nbaccel.launcher.interactive.on_rank import serve_on_rank
from nbaccel.launcher.interactive.relay import CellRelay
from nbaccel.launcher.planned import KeptEnd
from nbaccel.launcher.printer import TextPrinter
from nbaccel.launcher.run import Run
from nbaccel.launcher.sharing.cache import limit_bytes

# The last group made in this process, weakly: where ``%%nbaccel`` without a name runs.
_last_made: weakref.ref[Any] | None = None


def last_workers() -> Any:
    """The last ``Workers`` made in this process, if it still exists (closed or not)."""
    return _last_made() if _last_made is not None else None


def remember(group: Any) -> None:
    """``group`` is the last one made."""
    global _last_made
    _last_made = weakref.ref(group)


class GroupStart:
    """The start of a ``WorkerGroup``: its state is set here."""

    _num_processes: int | None
    _config: ConfigSource
    _overrides: dict[str, Any]
    _seq: int
    _memory: dict[int, dict[str, int]]
    _watchers: list[Callable[[Any], None]]
    _busy: threading.Lock
    _ended_why: str
    _last_run: Run
    _run: Run | None

    @classmethod
    def take_over(cls, run: Run, keep: KeptEnd) -> Self:
        """The group a ``keep_workers`` run's ranks make once their function returned: they
        connect to ``keep.listener`` now (``outcome.kept``). ``restart()`` later starts plain
        workers with the run's config."""
        group = cls.__new__(cls)
        group._adopt(run, keep)
        return group

    def _adopt(self, run: Run, keep: KeptEnd) -> None:
        self._num_processes, self._config = len(run.ranks), run.config
        self._overrides = {}
        self._seq = 0
        self._memory = {}
        self._watchers = []
        self._busy = threading.Lock()
        self._local = keep.listener.family == socket.AF_UNIX
        self._share_limit = limit_bytes(run.config.shared_memory_limit_gb) if self._local else 0
        self._sent_sources: set[str] = set()  # the payload had them; a call sends the rest
        self._relay = CellRelay()
        self._run, self._last_run, self._ended_why = None, run, ""
        self._subscribe_relay(run, keep.gpus)
        try:
            self._take_ranks(run, keep.listener, keep.token)
        except BaseException:
            keep.listener.close()
            raise
        remember(self)

    def _start(self) -> None:
        # Planned first with a stand-in address: where the workers run decides where the
        # kernel listens (here, or facing the hosts), and so the serve loop's arguments.
        # Never keep_workers: these ranks serve from the start.
        overrides = {**self._overrides, "keep_workers": False}
        planned = api.plan(
            serve_on_rank, ("", ""), self._num_processes, None, self._config, overrides
        )
        config = planned.resolved.config
        refuse_unsupported(config, planned.xla)
        token = secrets.token_hex(32)
        placement = planned.placement
        facing = placement.first_address if placement is not None and config.hosts else None
        listener, address = listen(facing, token)
        # Shared memory reaches ranks over the Unix socket (its frames carry fds), not TCP.
        self._local = listener.family == socket.AF_UNIX
        self._share_limit = limit_bytes(config.shared_memory_limit_gb) if self._local else 0
        payload = build_payload(serve_on_rank, (address, token), {}, config)
        # The payload carries the cells' source lines known now; each call sends newer ones.
        self._sent_sources = set(cell_sources())
        self._relay = CellRelay()
        self._run, self._ended_why = None, ""
        run: Run | None = None
        try:
            run = api.start_plan(
                dataclasses.replace(planned, payload=payload), show=self._subscribe_relay
            )
            self._last_run = run
            self._take_ranks(run, listener, token)
        except BaseException:
            if run is not None:
                run.stop()
            listener.close()
            raise

    def _take_ranks(self, run: Run, listener: socket.socket, token: str) -> None:
        """Take each rank's connection; the group is live from then on."""
        self._conns, self._pids = accept_ranks(listener, run, token)
        self._run = run
        self._listener = listener
        self._replies = Replies(self._conns)
        self._sender = Sender(self._conns)
        self._last_failed: int | None = None  # the rank the last failed call named
        # A rank stopped in pdb: the call's wait wakes (and q interrupts the call, no more).
        run._debug_stops_wake(self._replies.poke, quit_ends="the call")
        run._watch_stalls(False)  # only while a call runs
        # Workers dropped without close() (a setup cell run again, a script's end) end too:
        # the finalizer holds what it closes, never this object.
        self._finalizer = weakref.finalize(
            self, shut, run, self._replies, self._sender, self._conns, listener, 10.0
        )

    def _subscribe_relay(self, run: Run, gpus: int) -> None:
        self._gpus = gpus
        # Between calls (a rank's thread printing), output goes out as text.
        self._idle = TextPrinter(sys.stdout, run.shown_ranks(), announce_end=False)
        self._relay.target = self._idle
        run.subscribe(self._relay)
