"""A worker's own memory, reported up its event pipe where the kernel cannot read it.

On this machine the dashboard reads every rank's memory itself (NVML for GPUs, ``/proc``
for processes). A rank on another machine (``hosts=``) is out of its reach, so that worker
reads its device and sends ``DeviceMemory`` about once a second (``device_memory``'s
reporter), labelled ``host:device`` as the kernel names the host: ``node2:cuda1``, or
``node2:cpu`` for a CPU process (its resident memory against the host's).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable

import psutil

from nbaccel.frames import EventWriter
from nbaccel.launcher.bootstrap.device_memory import start_device_memory_reports


def report_memory(events: EventWriter, host: str, rank: int, *, cuda: bool) -> Callable[[], None]:
    """Start reporting this process's device (``cuda``) or its memory; return ``stop()``.

    >>> from nbaccel.frames import FrameDecoder
    >>> read_end, write_end = os.pipe()
    >>> stop = report_memory(EventWriter(write_end), "node2", 3, cuda=False)
    >>> stop()
    >>> [report] = FrameDecoder().feed(os.read(read_end, 4096))
    >>> report.rank, report.device, report.used > 0, report.limit == psutil.virtual_memory().total
    (3, 'node2:cpu', True, True)
    """
    if cuda:
        import torch

        index = int(os.environ.get("LOCAL_RANK", "0"))  # elastic's: this rank's GPU

        def read_gpu() -> dict[str, int]:
            free, total = torch.cuda.mem_get_info(index)
            return {"bytes_used": total - free, "bytes_limit": total}

        return start_device_memory_reports(events.send, f"{host}:cuda{index}", read_gpu, rank=rank)
    process = psutil.Process()
    host_total = psutil.virtual_memory().total

    def read_process() -> dict[str, int]:
        used = process.memory_info().rss
        # ru_maxrss (KiB on Linux): the peak resident memory, which the kernel updates
        # lazily, so a fresh reading can be above it.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"bytes_used": used, "peak_bytes_used": max(used, peak), "bytes_limit": host_total}

    return start_device_memory_reports(events.send, f"{host}:cpu", read_process, rank=rank)
