"""XLA device memory: the worker's reporter thread and the dashboard's source fed by events.

No sleeps: the fake reading function counts its calls and sets events, and the tests wait
on those with timeouts; the reporter runs with millisecond intervals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from nbaccel.config.schema import Config
from nbaccel.events import DeviceMemory, Metric
from nbaccel.launcher.bootstrap.device_memory import start_device_memory_reports
from nbaccel.launcher.run import Run
from nbaccel.ui.dashboard.memory import MemorySampler, ProcessMemory, ReportedMemory, memory_source
from nbaccel.ui.dashboard.model import MemoryReading

GiB = 2**30


class FakeRead:
    """Returns ``values`` (changeable by the test); ``calls(n)`` waits until n reads were made."""

    def __init__(self, used: int = GiB, *, fail: BaseException | None = None) -> None:
        self.info: dict[str, int] = {
            "bytes_used": used,
            "peak_bytes_used": 2 * GiB,
            "bytes_limit": 16 * GiB,
        }
        self.fail = fail
        self.count = 0
        self._changed = threading.Condition()

    def __call__(self) -> Mapping[str, int]:
        with self._changed:
            self.count += 1
            self._changed.notify_all()
            if self.fail is not None:
                raise self.fail
            return dict(self.info)

    def calls(self, n: int, timeout: float = 10.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.count >= n, timeout)

    def set_used(self, used: int) -> int:
        """Change the reading; the number of reads made so far."""
        with self._changed:
            self.info["bytes_used"] = used
            return self.count


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    event = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            return False
        event.wait(0.005)
    return True


def test_a_changed_reading_is_sent_and_an_unchanged_one_is_not_repeated() -> None:
    sent: list[DeviceMemory] = []
    read = FakeRead()
    stop = start_device_memory_reports(
        sent.append, "xla:0", read, interval=0.001, resend=600, rank=0
    )
    try:
        assert read.calls(20)  # 20 equal readings: one message
        assert len(sent) == 1
        before = read.set_used(3 * GiB)
        assert read.calls(before + 20)
        assert wait_until(lambda: len(sent) == 2)
    finally:
        stop()
    assert [m.used for m in sent] == [GiB, 3 * GiB]
    first = sent[0]
    assert isinstance(first, DeviceMemory) and (first.rank, first.device) == (0, "xla:0")
    assert (first.peak, first.limit) == (2 * GiB, 16 * GiB)
    assert abs(first.time - time.time()) < 60


def test_an_unchanged_reading_is_sent_again_after_the_resend_period() -> None:
    sent: list[DeviceMemory] = []
    read = FakeRead()
    stop = start_device_memory_reports(
        sent.append, "xla:0", read, interval=0.001, resend=0.0, rank=0
    )
    try:
        assert wait_until(lambda: len(sent) >= 3)
    finally:
        stop()
    assert {m.used for m in sent} == {GiB}


def test_missing_peak_and_limit_are_none() -> None:
    sent: list[DeviceMemory] = []
    stop = start_device_memory_reports(sent.append, "xla:1", lambda: {"bytes_used": 5}, 60, rank=0)
    stop()
    assert [(m.used, m.peak, m.limit) for m in sent] == [(5, None, None)]


def test_an_unsupported_device_stops_the_reporter_quietly() -> None:
    sent: list[DeviceMemory] = []
    read = FakeRead(fail=RuntimeError("Bad StatusOr access: UNIMPLEMENTED: GetAllocatorStats"))
    stop = start_device_memory_reports(sent.append, "xla:0", read, interval=0.001, rank=0)
    assert read.calls(1)
    assert not read.calls(2, timeout=0.2)  # it never reads again
    stop()
    assert sent == [] and read.count == 1


def test_a_failing_send_stops_the_reporter() -> None:
    read = FakeRead()

    def send(message: DeviceMemory) -> None:
        raise BrokenPipeError("the parent is gone")

    stop = start_device_memory_reports(send, "xla:0", read, interval=0.001, rank=0)
    assert read.calls(1)
    assert not read.calls(2, timeout=0.2)
    stop()


def test_stop_ends_the_thread_promptly_even_with_a_long_interval() -> None:
    read = FakeRead()
    sent: list[DeviceMemory] = []
    stop = start_device_memory_reports(sent.append, "xla:0", read, interval=3600, rank=0)
    assert read.calls(1)
    started = time.monotonic()
    stop()
    assert time.monotonic() - started < 1.0
    assert not any(t.name == "nbaccel-device-memory" for t in threading.enumerate())
    stop()  # again: nothing happens
    assert len(sent) == 1


# ----- the parent's source ---------------------------------------------------------------
def memory(rank: int, used: int, peak: int | None = None, limit: int | None = None) -> DeviceMemory:
    return DeviceMemory(rank, "xla:0", used, peak, limit, 0.0)


def test_reported_memory_is_na_until_a_rank_reports() -> None:
    source = ReportedMemory(2, "CPU")
    assert source.read() == [
        MemoryReading("rank 0 (CPU:0)", None, None, None),
        MemoryReading("rank 1 (CPU:1)", None, None, None),
    ]


def test_reported_memory_keeps_each_ranks_latest_report() -> None:
    source = ReportedMemory(2, "TPU")
    assert source.post(memory(1, GiB, 2 * GiB, 16 * GiB)) is True
    assert source.post(memory(1, 3 * GiB, 4 * GiB, 16 * GiB)) is False  # not the first
    assert source.read() == [
        MemoryReading("rank 0 (TPU:0)", None, None, None),
        MemoryReading("rank 1 (TPU:1)", 3 * GiB, 4 * GiB, 16 * GiB),
    ]
    assert ReportedMemory(1).read() == [MemoryReading("rank 0 (xla)", None, None, None)]


def test_reported_memory_takes_posts_from_another_thread() -> None:
    source = ReportedMemory(4, "TPU")
    posters = [
        threading.Thread(target=lambda r=r: [source.post(memory(r, i)) for i in range(200)])
        for r in range(4)
    ]
    for poster in posters:
        poster.start()
    for poster in posters:
        poster.join(timeout=10)
    assert [r.current for r in source.read()] == [199] * 4


def test_memory_source_uses_worker_reports_for_xla_runs_only() -> None:
    options: dict[str, Any] = {"world_size": 2, "gpus": 0, "pids": dict, "env": {}}
    tpu = memory_source(strategy="fsdp", xla_device="TPU", **options)
    assert isinstance(tpu, ReportedMemory) and tpu.read()[1].device == "rank 1 (TPU:1)"
    assert isinstance(memory_source(strategy="xla", **options), ReportedMemory)
    assert isinstance(memory_source(strategy="ddp", **options), ProcessMemory)


# ----- attached to a run -----------------------------------------------------------------
class FakeRun:
    shown_ranks = Run.shown_ranks  # the real one: it reads config and ranks only

    def __init__(self, world_size: int = 2, xla_device: str | None = None) -> None:
        self.config = Config()
        self.world_size = world_size
        self.ranks = tuple(range(world_size))
        self.worker_pids: dict[int, int] = {}
        self.subscribers: list[Any] = []
        self.xla_device = xla_device  # as Run: "TPU"/"CPU" for torch_xla launches, else None

    def subscribe(self, subscriber: Any) -> None:
        self.subscribers.append(subscriber)

    def emit(self, event: Any) -> None:
        for subscriber in self.subscribers:
            subscriber(event)


def test_an_xla_dashboard_shows_what_the_workers_report() -> None:
    pytest.importorskip("ipywidgets")
    pytest.importorskip("matplotlib")
    from nbaccel.ui.attach import attach_dashboard

    run = FakeRun(xla_device="TPU")
    dash = attach_dashboard(run, blocking=True, gpus=0, show=False)  # type: ignore[arg-type]
    sampler = dash._sampler
    assert isinstance(sampler, MemorySampler)
    assert isinstance(sampler._source, ReportedMemory)
    assert len(run.subscribers) == 2 and dash in run.subscribers
    reporter = next(s for s in run.subscribers if s is not dash)
    reporter(Metric(0, 1, {"loss": 1.0}, 0.0))  # other events are not its business
    reporter(memory(0, GiB, 2 * GiB, 16 * GiB))
    assert sampler._poked.is_set()  # the first report is read at once
    sampler.sample()  # what the sampler's thread does, then the UI applies it
    dash.flush(timeout=30)
    assert dash.model.memory == [
        MemoryReading("rank 0 (TPU:0)", GiB, 2 * GiB, 16 * GiB),
        MemoryReading("rank 1 (TPU:1)", None, None, None),  # nothing from rank 1 yet: n/a
    ]


def test_a_cpu_run_keeps_process_memory_and_one_subscriber() -> None:
    pytest.importorskip("ipywidgets")
    pytest.importorskip("matplotlib")
    from nbaccel.ui.attach import attach_dashboard

    run = FakeRun()
    dash = attach_dashboard(run, blocking=True, gpus=0, show=False)  # type: ignore[arg-type]
    assert run.subscribers == [dash]
    assert dash._sampler is not None and isinstance(dash._sampler._source, ProcessMemory)
