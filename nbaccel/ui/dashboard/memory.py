"""Memory readings taken in the parent while a run goes: NVML per GPU, psutil per CPU worker,
and what XLA workers report about their devices (``DeviceMemory`` events).

A daemon thread samples about once a second and hands the readings to a callback (the
dashboard's queue). Nothing here runs in, or waits for, a worker: a reading costs the
parent tens of microseconds per process (a ``/proc`` read) or one NVML call per GPU, so
training is never slowed. NVML (``nvidia-ml-py``, imported as ``pynvml``) is loaded lazily
on the sampling thread and is optional; tests pass a fake module. Never imports torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import psutil

from nbaccel.errors import ConfigError
from nbaccel.events import DeviceMemory
from nbaccel.hardware.devices import choose_gpus
from nbaccel.ui.dashboard.model import MemoryReading

Pids = Callable[[], Mapping[int, int]]


class MemorySource(Protocol):
    """Something that can be asked for the current readings."""

    def read(self) -> list[MemoryReading]: ...

    def worker_started(self, pid: int) -> None: ...

    def close(self) -> None: ...


class ProcessMemory:
    """Resident memory (RSS) of each worker process, its peak, and the machine's RAM as limit;
    beside RSS, the pages the worker alone holds (USS) and its share of shared ones (PSS).

    The peak is the kernel's high-water mark (``VmHWM``), so a spike between two samples
    still shows. On CPU that is the closest thing to "device memory" there is; note that the
    C allocator keeps freed memory, so RSS rarely goes down. RSS counts data every rank maps
    from shared memory (``sharing``) once per rank; PSS splits it among them, so the ranks'
    PSS add up to what they take together. USS and PSS are read at most once every
    ``detail_every`` seconds, the first time that long after the source was made: such a
    read walks the worker's page tables (~2.5 ms for a bare torch worker, more per resident
    GiB), and the readings a run's first second asks for (one as each worker starts) cost
    a launch that ends within it ~30 ms of a 2-core machine; RSS and its peak cost ~0.05 ms.
    PSS is shown only while a run goes, and a bare worker shares nothing yet.

    >>> import os
    >>> [reading] = ProcessMemory(lambda: {0: os.getpid()}, detail_every=0).read()
    >>> reading.device, reading.current > 0, reading.peak >= reading.current
    ('rank 0 (cpu)', True, True)
    >>> reading.private <= reading.proportional <= reading.current
    True
    """

    def __init__(
        self,
        pids: Pids,
        proc_root: Path = Path("/proc"),
        *,
        detail_every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pids = pids
        self._proc_root = proc_root
        self._processes: dict[int, psutil.Process] = {}
        self._at_start: dict[int, int] = {}  # pid -> RSS when the worker reported in
        self._detail_every, self._clock = detail_every, clock
        self._next_detail = clock() + detail_every

    def read(self) -> list[MemoryReading]:
        limit = int(psutil.virtual_memory().total)
        now = self._clock()
        detailed = now >= self._next_detail
        if detailed:
            self._next_detail = now + self._detail_every
        readings = []
        for rank, pid in sorted(self._pids().items()):
            current = peak = private = proportional = None
            try:
                process = self._processes.get(pid) or psutil.Process(pid)
                self._processes[pid] = process
                # An exited worker not yet reaped (a zombie) has no memory left: its RSS
                # reads 0, which is no reading of the run ("n/a" instead).
                if process.status() == psutil.STATUS_ZOMBIE:
                    raise psutil.NoSuchProcess(pid)
                if detailed:
                    full = process.memory_full_info()
                    current = int(full.rss) or None
                    private, proportional = int(full.uss), int(full.pss)
                else:
                    current = int(process.memory_info().rss) or None
                peak = self._high_water_mark(pid)
            except (psutil.Error, OSError):
                self._processes.pop(pid, None)  # it has exited: "n/a" from now on
            baseline = min(self._at_start.values(), default=None)
            readings.append(
                MemoryReading(
                    f"rank {rank} (cpu)",
                    current,
                    peak,
                    limit,
                    private=private,
                    proportional=proportional,
                    baseline=baseline,
                )
            )
        return readings

    def worker_started(self, pid: int) -> None:
        """Read a worker's RSS now, as it reports itself started: it has just been forked
        from nbaccel's helper (Python, torch and nbaccel imported) and has not loaded the
        function yet, so this is what a bare worker holds. (Not the helper's own RSS: a
        forked child maps the helper's file-backed pages only as it touches them, so the
        helper reads ~70 MiB more than a fresh worker, measured.) Called on the run's pump
        thread with the ``WorkerStarted`` event: one ``/proc`` read."""
        try:
            self._at_start[pid] = int(psutil.Process(pid).memory_info().rss)
        except (psutil.Error, OSError):
            pass  # already gone: no baseline from it

    def _high_water_mark(self, pid: int) -> int | None:
        try:
            status = (self._proc_root / str(pid) / "status").read_text()
        except OSError:
            return None  # not Linux, or the process is gone
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return None

    def close(self) -> None:
        self._processes.clear()


class NvmlMemory:
    """Used and total memory of the GPUs the ranks use, read through NVML.

    Rank ``r`` uses CUDA device ``r`` (local rank), which ``CUDA_VISIBLE_DEVICES`` maps to
    an NVML index or UUID. If NVML cannot start, readings come from ``fallback``.

    >>> class FakeNvml:
    ...     def nvmlInit(self): pass
    ...     def nvmlShutdown(self): pass
    ...     def nvmlDeviceGetHandleByIndex(self, index): return index
    ...     def nvmlDeviceGetMemoryInfo(self, handle):
    ...         return type("Info", (), {"used": 2**30 * (handle + 1), "total": 2**34})()
    >>> source = NvmlMemory(2, {"CUDA_VISIBLE_DEVICES": "1,0"}, nvml=FakeNvml())
    >>> [(r.device, r.current // 2**30) for r in source.read()]
    [('cuda:0 (GPU 1)', 2), ('cuda:1 (GPU 0)', 1)]
    """

    def __init__(
        self,
        gpus: int,
        env: Mapping[str, str],
        *,
        nvml: Any = None,
        fallback: MemorySource | None = None,
    ) -> None:
        self._gpus = gpus
        self._visible = [e.strip() for e in env.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        self._nvml = nvml
        self._fallback = fallback
        self._handles: list[tuple[str, Any]] | None = None
        self._failed = False

    def read(self) -> list[MemoryReading]:
        if self._handles is None and not self._failed:
            self._start()
        if self._handles is None:
            return self._fallback.read() if self._fallback is not None else []
        readings = []
        for device, handle in self._handles:
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                readings.append(MemoryReading(device, int(info.used), None, int(info.total)))
            except Exception:  # noqa: BLE001 - a GPU that stops answering reads "n/a"
                readings.append(MemoryReading(device, None, None, None))
        return readings

    def worker_started(self, pid: int) -> None:
        if self._fallback is not None:
            self._fallback.worker_started(pid)

    def _start(self) -> None:
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self._handles = [self._handle(index) for index in range(self._gpus)]
        except Exception:  # noqa: BLE001 - no NVML or no driver: fall back to process memory
            self._failed, self._handles = True, None

    def _handle(self, index: int) -> tuple[str, Any]:
        entry = self._visible[index] if index < len(self._visible) and self._visible[0] else ""
        if entry.startswith(("GPU-", "MIG-")):
            return f"cuda:{index} ({entry[:12]})", self._nvml.nvmlDeviceGetHandleByUUID(entry)
        physical = int(entry) if entry.isdigit() else index
        return f"cuda:{index} (GPU {physical})", self._nvml.nvmlDeviceGetHandleByIndex(physical)

    def close(self) -> None:
        if self._handles is not None:
            self._handles = None
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down is best effort
                pass
        if self._fallback is not None:
            self._fallback.close()


class ReportedMemory:
    """Device memory that the workers read themselves (XLA) and report as ``DeviceMemory``.

    ``post`` (the run's pump thread) keeps each rank's latest report; ``read`` (the sampler's
    thread) gives one reading per rank, "n/a" for a rank that has reported nothing, such as
    the CPU XLA device, which cannot tell its memory. ``device``: the PJRT device ("TPU",
    "CPU"), for the labels; None labels them "xla".

    >>> from nbaccel.events import DeviceMemory
    >>> source = ReportedMemory(2, "TPU")
    >>> source.post(DeviceMemory(1, "xla:0", 2**30, 2**31, 2**34, 0.0))
    True
    >>> [(r.device, r.current, r.peak, r.limit) for r in source.read()]
    [('rank 0 (TPU:0)', None, None, None), ('rank 1 (TPU:1)', 1073741824, 2147483648, 17179869184)]
    """

    def __init__(self, world_size: int, device: str | None = None, *, remote: bool = False) -> None:
        self._world_size = world_size
        self._device = device
        # Ranks on other machines (hosts=): each report names its host and device.
        self._remote = remote
        self._latest: dict[int, DeviceMemory] = {}
        self._lock = threading.Lock()

    def label(self, rank: int, report: DeviceMemory | None = None) -> str:
        """The bar's name for ``rank``: ``rank 0 (TPU:0)``, ``rank 0 (xla)``, or on another
        machine its report's ``host:device``: ``rank 3 (node2:cuda1)``."""
        if self._remote:
            return f"rank {rank} ({report.device})" if report is not None else f"rank {rank}"
        return f"rank {rank} ({self._device}:{rank})" if self._device else f"rank {rank} (xla)"

    def post(self, event: DeviceMemory) -> bool:
        """Keep ``event`` as its rank's reading (any thread); True for a rank's first report."""
        with self._lock:
            first = event.rank not in self._latest
            self._latest[event.rank] = event
        return first

    def read(self) -> list[MemoryReading]:
        with self._lock:
            latest = dict(self._latest)
        readings = []
        for rank in sorted(set(range(self._world_size)) | set(latest)):
            event = latest.get(rank)
            if event is None:
                readings.append(MemoryReading(self.label(rank), None, None, None))
            else:
                readings.append(
                    MemoryReading(self.label(rank, event), event.used, event.peak, event.limit)
                )
        return readings

    def worker_started(self, pid: int) -> None:
        pass  # the workers report their device memory themselves

    def close(self) -> None:
        pass


def memory_source(
    *,
    world_size: int,
    gpus: int,
    strategy: str,
    pids: Pids,
    env: Mapping[str, str],
    xla_device: str | None = None,
    remote: bool = False,
    gpu_ids: str = "all",
) -> MemorySource:
    """The right source for a run: NVML when it uses GPUs, worker reports for XLA and for
    ranks on other machines (``remote``: ``hosts=``), else psutil.

    ``xla_device``: the PJRT device ("TPU", "CPU") of a launch through torch_xla, else None.
    ``env``: the launching process's environment; ``gpu_ids``: the run's, which narrowed the
    GPUs its workers see (the readings follow them: rank r on the r-th of ``gpu_ids``).

    >>> memory_source(world_size=2, gpus=0, strategy="auto", pids=dict, env={}).read()
    []
    >>> [r.device for r in memory_source(
    ...     world_size=1, gpus=0, strategy="fsdp", pids=dict, env={}, xla_device="TPU").read()]
    ['rank 0 (TPU:0)']
    """
    if remote:
        return ReportedMemory(world_size, remote=True)
    if xla_device is not None or strategy == "xla":
        return ReportedMemory(world_size, xla_device)
    processes = ProcessMemory(pids)
    if gpus:
        return NvmlMemory(min(gpus, world_size), _workers_env(env, gpu_ids), fallback=processes)
    return processes


def _workers_env(env: Mapping[str, str], gpu_ids: str) -> Mapping[str, str]:
    """``env`` with the ``CUDA_VISIBLE_DEVICES`` the workers got from ``gpu_ids``.

    >>> _workers_env({"CUDA_VISIBLE_DEVICES": "4,5,6"}, "2,0")["CUDA_VISIBLE_DEVICES"]
    '6,4'
    """
    try:
        return {**env, **choose_gpus(gpu_ids, env, visible=None).worker_env()}
    except ConfigError:  # the launch checked it; an env changed since: read what it says
        return env


class MemorySampler:
    """Calls ``on_readings`` with fresh readings every ``interval`` seconds on a daemon thread.

    >>> got = []
    >>> sampler = MemorySampler(ReportedMemory(1), got.append, interval=60)
    >>> sampler.start(); sampler.stop()
    >>> [(r.device, r.current, r.peak, r.limit) for r in got[0]]
    [('rank 0 (xla)', None, None, None)]
    """

    def __init__(
        self,
        source: MemorySource,
        on_readings: Callable[[list[MemoryReading]], None],
        interval: float = 1.0,
    ) -> None:
        self._source = source
        self._on_readings = on_readings
        self._interval = interval
        self._stopping = threading.Event()
        self._poked = threading.Event()  # set by wake() and stop(): read (or end) now
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="nbaccel-memory", daemon=True)
        self._thread.start()

    def sample(self) -> list[MemoryReading]:
        """One reading now, also handed to the callback."""
        readings = self._source.read()
        if readings:
            self._on_readings(readings)
        return readings

    def worker_started(self, pid: int) -> None:
        """A worker reported itself started: let the source take its start reading, then
        read every worker at once (a run shorter than the interval would otherwise end with
        no reading at all)."""
        self._source.worker_started(pid)
        self.wake()

    def wake(self) -> None:
        """Read now rather than at the next interval (a worker just started: a run shorter
        than the interval would otherwise end with no reading at all)."""
        self._poked.set()

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread (within ``timeout``); the source is closed on its way out."""
        self._stopping.set()
        self._poked.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            # The first reading at once; then the poke event's timed wait paces the loop,
            # and wake() or stop() cut the wait short.
            while True:
                try:
                    self.sample()
                except Exception:  # noqa: BLE001 - a failed reading must not end sampling
                    pass
                self._poked.wait(self._interval)
                self._poked.clear()
                if self._stopping.is_set():
                    break
        finally:
            self._source.close()
