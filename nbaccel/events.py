"""The event stream from workers to the parent, and the events that subscribers receive.

Workers write length-prefixed pickles of the dataclasses below (``WorkerMessage``) to a
pipe that only their parent holds (inherited, never a listening socket: nothing else can
connect or inject). The parent takes each by its type, sets its rank from the pipe, and
passes it on with the events it makes itself (log lines, exits, the end) to the text
printer, the dashboard and ``Run``. Plain data, stdlib only.
"""

from __future__ import annotations

import enum
import os
import pickle
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbaccel import unpickling

# A frame: this length prefix, then the pickle (encode_frame). Readers that must split a
# stream without unpickling it (the several-machines agent) use it too.
FRAME_HEADER = struct.Struct("<I")


class RunState(enum.Enum):
    """Lifecycle of a run: PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def done(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)


@dataclass(frozen=True)
class RunStarted:
    run_id: str
    world_size: int
    run_dir: str
    time: float


@dataclass(frozen=True)
class WorkerStarted:
    """A worker process is up (before the function runs): its pid, for memory readings.

    ``host``: where it runs on a several-machine launch (the name the launch was given);
    None on this machine. A pid on another host means nothing here. The worker sends it
    without a host; the parent fills it in.
    """

    rank: int
    pid: int
    time: float
    host: str | None = None
    attempt: int = 0  # torch elastic's restart count (max_restarts): 0 for the first workers


@dataclass(frozen=True)
class ModelPrepared:
    """Rank 0 prepared a model of ``num_params`` parameters (the dashboard's memory estimate)."""

    rank: int
    num_params: int
    time: float


@dataclass(frozen=True)
class SettingsApplied:
    """Rank 0's Accelerator changed settings from the launch's config (a plugin, a kwargs
    handler, its own arguments): ``{flat name: value}`` and each one's source."""

    rank: int
    values: dict[str, Any]
    sources: dict[str, str]
    time: float


@dataclass(frozen=True)
class LogLine:
    """One line of a rank's output.

    ``replace``: it overwrites the rank's previous line (a ``\\r`` redraw, e.g. tqdm).
    ``partial``: it ended with ``\\r``, so the next line of this rank may overwrite it.
    """

    rank: int
    text: str
    replace: bool
    partial: bool
    time: float


@dataclass(frozen=True)
class OutputMark:
    """A mark a rank put in its output (``launcher.output.mark_line``; parent-made): all it
    wrote before came first. Interactive workers mark the end of each command's output. Marks
    are nbaccel's: no log, line or display holds them."""

    rank: int
    text: str
    time: float


@dataclass(frozen=True)
class Metric:
    rank: int
    step: int
    values: Mapping[str, float]
    time: float


@dataclass(frozen=True)
class DeviceMemory:
    """A rank's device memory as its worker read it (XLA: ``xm.get_memory_info``), in bytes.

    ``device``: the worker's device name (e.g. ``xla:0``); ``peak``/``limit`` None when unknown.
    """

    rank: int
    device: str
    used: int
    peak: int | None
    limit: int | None
    time: float


@dataclass(frozen=True)
class StepBreakdown:
    """A rank's training steps over one window (about 0.5 s): where their time went.

    ``phases``: seconds per phase (data, forward, backward, communication, optimizer,
    other; see ``nbaccel.accel.tracking.step_timing``), summed over the ``steps``; together they are
    the steps' time. ``samples``/``tokens``: what the steps took (``tokens``: positions of
    ``input_ids``, None without them). ``peak_memory``: bytes per phase where the device
    reports it (CUDA), else None.
    """

    rank: int
    steps: int
    phases: Mapping[str, float]
    samples: int
    tokens: int | None
    peak_memory: Mapping[str, int] | None
    time: float

    @property
    def seconds(self) -> float:
        """The steps' time: the sum of the phases."""
        return sum(self.phases.values())


@dataclass(frozen=True)
class RankExited:
    """A worker process ended: exit code, or minus the signal number that killed it."""

    rank: int
    exitcode: int
    time: float


@dataclass(frozen=True)
class RunRestarted:
    """torch elastic restarted every worker after a failure (``max_restarts``).

    ``attempt``: the attempt now starting, counted from 0 (the first restart starts attempt
    1), of ``max_restarts + 1`` at most. ``rank``/``host``: who failed (None when unknown);
    ``reason``: how, in a few words (``killed by SIGKILL``, ``raised ValueError: ...``).
    """

    attempt: int
    max_restarts: int
    rank: int | None
    host: str | None
    reason: str
    time: float


@dataclass(frozen=True)
class RunEnded:
    state: RunState
    error: BaseException | None
    elapsed: float
    time: float


@dataclass(frozen=True)
class ResultReady:
    """A rank's function returned (worker -> parent only): its value, pickled, for
    ``Run.result``/``results`` (unpickled there, only when asked). ``buffers``: where the
    pickle's out-of-band buffers lie in the rank's result box (segment, offset, length)."""

    rank: int
    value: bytes
    buffers: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class Rank0Value:
    """Rank 0's value, pickled, read from the job's store by this machine's first worker
    (worker -> parent only). Sent where rank 0 runs on another machine: a job whose
    machines each launch from their own cell (``num_nodes=``, ``node_rank=``), each of
    which returns rank 0's value as Accelerate users expect of a launch."""

    rank: int
    value: bytes


@dataclass(frozen=True)
class WorkerFailed:
    """A rank's function raised or called ``sys.exit`` (worker -> parent only): what the
    parent needs to raise it (``launcher.failures.build_error``).

    ``type``: the exception's qualified name; ``exception``: it pickled, or None when it
    cannot be; ``cause``: 'error' (its own), 'timeout' or 'peer' (caused by another rank).
    """

    rank: int
    type: str
    message: str
    traceback: str
    exception: bytes | None
    cause: str
    time: float


@dataclass(frozen=True)
class ModulesImported:
    """The modules rank 0 imported while it ran, as (name, file) pairs (worker -> parent
    only): the parent picks the installed libraries among them for the helper to preload
    before the next launch (``launcher.local.preloading.preload_choice``). Plain strings:
    nothing the parent unpickles imports anything."""

    rank: int
    modules: tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class Notice:
    """Something the launcher tells about a launch (parent only), shown as ``nbaccel: text``:
    e.g. a library the helper would not preload, and why."""

    text: str
    time: float


@dataclass(frozen=True)
class StallWarning:
    """No rank printed, logged a metric or finished a step for ``seconds`` (the launch's
    ``stall_warning``): where each rank is now, read from its stack (parent-made, once per
    stall; the run goes on). ``stacks``: ``{rank: text}`` as ``Run.stacks`` gives them;
    ``waits_in``: ``{rank: the collective its main thread waits in, or None}``.

    >>> warning = StallWarning(120.0, {1: "rank 1: in train (t.py:3)"}, {1: "barrier"}, 0.0)
    >>> warning.waits_in[1]
    'barrier'
    """

    seconds: float
    stacks: Mapping[int, str]
    waits_in: Mapping[int, str | None]
    time: float


# What a worker sends on its event pipe: these dataclasses, pickled, and nothing else. The
# parent takes each by its type (``launcher.pump``) and sets ``rank`` from the pipe it came
# on, so no worker can speak for another rank.
WorkerMessage = (
    WorkerStarted
    | ModelPrepared
    | SettingsApplied
    | Metric
    | DeviceMemory
    | StepBreakdown
    | ResultReady
    | Rank0Value
    | WorkerFailed
    | ModulesImported
)


Event = (
    RunStarted
    | WorkerStarted
    | ModelPrepared
    | SettingsApplied
    | LogLine
    | OutputMark
    | Metric
    | DeviceMemory
    | StepBreakdown
    | RankExited
    | RunRestarted
    | RunEnded
    | Notice
    | StallWarning
)


def encode_frame(message: object) -> bytes:
    """Serialise one message (a ``WorkerMessage``, or a plain dict between nbaccel's own
    processes) as a length-prefixed pickle.

    >>> decoder = FrameDecoder()
    >>> decoder.feed(encode_frame(Metric(0, 1, {"loss": 0.5}, 0.0)))
    [Metric(rank=0, step=1, values={'loss': 0.5}, time=0.0)]
    """
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(body)) + body


@dataclass(frozen=True)
class UnreadableFrame:
    """What ``FrameDecoder`` gives in place of a frame it would not or could not read: a
    class of a module not imported here (``unpickling.ImportRefused``), or a corrupt frame.
    ``reason`` says which."""

    reason: str


class FrameDecoder:
    """Reassembles messages from pipe reads of any size. Frames are read with
    ``unpickling.loads`` (never importing a module, torch above all: the parent reads them);
    one it cannot read becomes an ``UnreadableFrame`` and the frames after it still come.

    >>> FrameDecoder().feed(FRAME_HEADER.pack(3) + b"bad")
    [UnreadableFrame(reason='UnpicklingError: ...')]
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= FRAME_HEADER.size:
            (length,) = FRAME_HEADER.unpack_from(self._buffer)
            end = FRAME_HEADER.size + length
            if len(self._buffer) < end:
                break
            body = bytes(self._buffer[FRAME_HEADER.size : end])
            del self._buffer[:end]
            try:
                messages.append(unpickling.loads(body))
            except Exception as error:  # noqa: BLE001 - any bad frame: say why, read on
                messages.append(UnreadableFrame(f"{type(error).__name__}: {error}"))
        return messages


class EventWriter:
    """The worker's end of the event pipe; safe to call from several threads.

    ``send`` writes at once. ``send_batched`` (metrics) collects frames and writes them
    together at most every ``batch_seconds`` (0.25 s: the live curve redraws at 2-5 Hz):
    each write wakes the parent, whose CPU is taken from the workers on a small machine;
    one write per logged step cost ~0.1-0.3 ms a step under gVisor. A background thread
    writes what is left after ``batch_seconds``, so a metric is never held longer; ``send``
    (a result, an error) first writes what is batched, so order is kept.
    """

    def __init__(self, fd: int, batch_seconds: float = 0.25) -> None:
        self._fd = fd
        self._lock = threading.Condition()
        self._batch_seconds = batch_seconds
        self._pending = bytearray()
        self._last_write = 0.0
        self._flusher: threading.Thread | None = None
        self._closed = False

    def send(self, message: object) -> None:
        with self._lock:
            self._pending += encode_frame(message)
            self._write_pending()

    def send_batched(self, message: object) -> None:
        with self._lock:
            first_held = not self._pending
            self._pending += encode_frame(message)
            now = time.monotonic()
            if now - self._last_write >= self._batch_seconds or len(self._pending) > 1 << 16:
                self._write_pending()
                return
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_when_due, name="nbaccel-events", daemon=True
                )
                self._flusher.start()
            if first_held:
                # Wake the flusher only to start its timed wait: a wake-up per call (a thread
                # switch and the GIL) cost ~70 us a step.
                self._lock.notify()

    def _flush_when_due(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._pending:
                    self._lock.wait()
                    continue
                due = self._last_write + self._batch_seconds - time.monotonic()
                if due > 0:
                    self._lock.wait(due)
                    continue
                self._write_pending()

    def _write_pending(self) -> None:
        if self._closed or not self._pending:
            return
        data = memoryview(bytes(self._pending))
        self._pending.clear()
        while data:
            written = os.write(self._fd, data)
            data = data[written:]
        self._last_write = time.monotonic()

    def close(self) -> None:
        with self._lock:
            self._write_pending()
            self._closed = True
            self._lock.notify()
            os.close(self._fd)
