"""The supervisor's side of a detached run's attach channel.

A Unix socket in the abstract namespace (its name, random, is kept in the 0600
``run_dir/supervisor.json``): no file to clean up, no TCP port, and every connection is
checked with ``SO_PEERCRED`` so only this user's processes are served. A client sends one
line, ``follow``, ``stacks``, ``stop`` or ``save-stop``. ``follow`` gets what happened so
far, then every new event
as it happens (length-prefixed pickled ``{"event": Event}`` frames, ``frames.encode_frame``)
until the run ends. ``stacks`` gets ``{"stacks": {rank: text}}`` (``Run.stacks``: where each
rank is now, nothing stopped). ``stop`` stops the run as ■ would. Stdlib only.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections import deque
from typing import TYPE_CHECKING

from nbaccel.events import DeviceMemory, Event, LogLine, Metric, RunEnded, StepBreakdown
from nbaccel.frames import encode_frame
from nbaccel.launcher import control

if TYPE_CHECKING:
    from nbaccel.launcher.run import Run

LOG_LINES_KEPT = 500  # per rank: the dashboard shows a bounded tail, the file has them all
METRICS_KEPT = 50_000  # rank 0's curve; events.jsonl keeps every metric
STEP_WINDOWS_KEPT = 20  # per rank: the step panel shows the last seconds
SEND_TIMEOUT = 5.0  # a client that stops reading is dropped rather than stall the run


class History:
    """What a newly attached client is sent first: bounded, in the order a display needs."""

    def __init__(self) -> None:
        self.events: list[Event] = []  # starts, exits, settings: few
        self.metrics: deque[Event] = deque(maxlen=METRICS_KEPT)
        self.memory: dict[int, Event] = {}  # the latest reading per rank
        self.logs: dict[int, deque[Event]] = {}
        self.steps: dict[int, deque[Event]] = {}
        self.ended: RunEnded | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, LogLine):
            self.logs.setdefault(event.rank, deque(maxlen=LOG_LINES_KEPT)).append(event)
        elif isinstance(event, Metric):
            self.metrics.append(event)
        elif isinstance(event, DeviceMemory):
            self.memory[event.rank] = event
        elif isinstance(event, StepBreakdown):
            self.steps.setdefault(event.rank, deque(maxlen=STEP_WINDOWS_KEPT)).append(event)
        elif isinstance(event, RunEnded):
            self.ended = event
        else:
            self.events.append(event)

    def replay(self) -> list[Event]:
        logs = [line for rank in sorted(self.logs) for line in self.logs[rank]]
        steps = [window for rank in sorted(self.steps) for window in self.steps[rank]]
        ended = [self.ended] if self.ended is not None else []
        return [*self.events, *self.metrics, *steps, *self.memory.values(), *logs, *ended]


class AttachServer:
    """Serves one run's events and Stop to this user's processes."""

    def __init__(self) -> None:
        self.address = f"\0nbaccel-attach-{secrets.token_hex(16)}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.address)
        self._server.listen(16)
        self._lock = threading.Lock()  # history and followers change together
        self._history = History()
        self._followers: list[socket.socket] = []
        self._run: Run | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="nbaccel-attach", daemon=True)

    def show(self, run: Run, _gpus: int) -> None:
        """The ``Display`` the supervisor's launch uses: every event goes to followers."""
        self._run = run
        run.subscribe(self._on_event)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and drop every follower (each has had the run's end)."""
        self._closing.set()
        try:  # wake accept() at once
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as waker:
                waker.connect(self.address)
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._server.close()
        with self._lock:
            for follower in self._followers:
                follower.close()
            self._followers.clear()

    def _on_event(self, event: Event) -> None:  # the pump thread
        with self._lock:
            self._history.add(event)
            frame = encode_frame({"event": event})
            for follower in list(self._followers):
                if not _send(follower, frame):
                    self._followers.remove(follower)
            if isinstance(event, RunEnded):
                for follower in self._followers:
                    follower.close()  # the end was the last frame: the client sees EOF
                self._followers.clear()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            if self._closing.is_set() or not control.same_user(conn):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(SEND_TIMEOUT)
        try:
            request = conn.makefile("rb").readline(64).strip()
        except OSError:
            conn.close()
            return
        if request == b"stacks" and self._run is not None:
            try:
                answer: dict[str, object] = {"stacks": self._run.stacks()}
            except RuntimeError as error:  # the run has ended
                answer = {"error": str(error)}
            _send(conn, encode_frame(answer))
            conn.close()
        elif request in (b"stop", b"save-stop") and self._run is not None:
            try:  # returns once every worker is gone
                self._run.stop(save=request == b"save-stop")
            except TimeoutError:
                pass  # the follower sees the end when it comes
            _send(conn, encode_frame({"stopped": self._run.state.value}))
            conn.close()
        elif request == b"follow":
            with self._lock:  # no event can slip between the replay and going live
                frames = b"".join(encode_frame({"event": e}) for e in self._history.replay())
                if _send(conn, frames) and self._history.ended is None:
                    self._followers.append(conn)
                else:
                    conn.close()
        else:
            conn.close()


def _send(conn: socket.socket, data: bytes) -> bool:
    try:
        conn.sendall(data)
        return True
    except OSError:
        conn.close()
        return False
