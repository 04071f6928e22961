"""How messages travel on a pipe or a stream between nbaccel's processes: length-prefixed
pickles (``encode_frame``), reassembled from reads of any size and read without importing
anything (``FrameDecoder``, through ``unpickling``), and the worker's end of its event pipe,
which batches metrics (``EventWriter``). The messages themselves are ``nbaccel.events``'.
Plain data, stdlib only.
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from nbaccel import unpickling

# A frame: this length prefix, then the pickle (encode_frame). Readers that must split a
# stream without unpickling it (the several-machines agent) use it too.
FRAME_HEADER = struct.Struct("<I")


def encode_frame(message: object) -> bytes:
    """Serialise one message (a ``WorkerMessage``, or a plain dict between nbaccel's own
    processes) as a length-prefixed pickle.

    >>> decoder = FrameDecoder()
    >>> decoder.feed(encode_frame({"op": "ready"}))
    [{'op': 'ready'}]
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

    def flush(self) -> None:
        """Write what is batched now (interactive workers: before a call's end-of-output mark,
        so the call's summary holds every metric it logged)."""
        with self._lock:
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
