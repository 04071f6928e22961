"""Device memory read inside a worker and reported to the parent (XLA devices).

The parent can read GPU memory (NVML) and process memory (``/proc``) by itself, but a TPU's
memory is known only to the process that drives it: ``xm.get_memory_info(device)`` returns
``{'bytes_used', 'bytes_limit', 'peak_bytes_used'}``. So each XLA worker runs a small daemon
thread that reads it about once a second and sends a ``device_memory`` message up the event
pipe, which the parent turns into ``nbaccel.events.DeviceMemory`` for the dashboard.

Stdlib only: the caller passes the reading function, so this module imports neither torch
nor torch_xla.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from nbaccel.events import DeviceMemory

RESEND_SECONDS = 5.0  # an unchanged reading is sent again this often (a sign of life)
STOP_TIMEOUT = 2.0  # how long stop() waits for the thread


def start_device_memory_reports(
    send: Callable[[DeviceMemory], None],
    device: str,
    read: Callable[[], Mapping[str, int]],
    interval: float = 1.0,
    *,
    rank: int,
    resend: float = RESEND_SECONDS,
) -> Callable[[], None]:
    """Start a daemon thread that reports ``read()`` through ``send``; return its ``stop()``.

    Every ``interval`` seconds (the first time at once) the thread calls ``read()``, a
    mapping like ``xm.get_memory_info(device)``'s, and sends a ``DeviceMemory`` of ``rank``
    (``peak``/``limit`` None when missing) when
    the reading changed, or every ``resend`` seconds when it did not. The first exception,
    from ``read()`` or ``send``, ends the thread for good without sending anything: the CPU
    XLA device raises ``RuntimeError('Bad StatusOr access: UNIMPLEMENTED: GetAllocatorStats
    is not supported')`` (torch_xla 2.9), and its dashboard keeps showing "n/a". ``stop()``
    wakes the thread at once and joins it (at most 2 s); calling it again does nothing.

    >>> sent = []
    >>> info = {"bytes_used": 2048, "peak_bytes_used": 4096, "bytes_limit": 2**34}
    >>> stop = start_device_memory_reports(sent.append, "xla:0", lambda: info, 60, rank=0)
    >>> stop()
    >>> [(m.rank, m.device, m.used, m.peak, m.limit) for m in sent]
    [(0, 'xla:0', 2048, 4096, 17179869184)]
    >>> def unsupported():
    ...     raise RuntimeError("UNIMPLEMENTED: GetAllocatorStats is not supported")
    >>> sent.clear()
    >>> start_device_memory_reports(sent.append, "xla:0", unsupported, rank=0)()
    >>> sent
    []
    """
    stopping = threading.Event()

    def loop() -> None:
        last: tuple[int, int | None, int | None] | None = None
        last_sent = 0.0
        while True:
            try:
                reading = _reading(read())
                now = time.monotonic()
                if reading != last or now - last_sent >= resend:
                    used, peak, limit = reading
                    send(DeviceMemory(rank, device, used, peak, limit, time.time()))
                    last, last_sent = reading, now
            except Exception:  # noqa: BLE001 - unsupported device or closed pipe: stop quietly
                return
            if stopping.wait(interval):
                return

    thread = threading.Thread(target=loop, name="nbaccel-device-memory", daemon=True)
    thread.start()

    def stop() -> None:
        stopping.set()
        if thread is not threading.current_thread():
            thread.join(STOP_TIMEOUT)

    return stop


def _reading(info: Mapping[str, int]) -> tuple[int, int | None, int | None]:
    """(used, peak, limit) from ``xm.get_memory_info``'s keys; KeyError without bytes_used.

    >>> _reading({"bytes_used": 1, "bytes_limit": 8})
    (1, None, 8)
    """
    peak, limit = info.get("peak_bytes_used"), info.get("bytes_limit")
    return (
        int(info["bytes_used"]),
        None if peak is None else int(peak),
        None if limit is None else int(limit),
    )
