"""The step-time breakdown's CUDA path on a fake ``torch.cuda``: per-phase peak memory without
touching the allocator's peak counter, which belongs to the user (issue 23, point 1: a
training script printing ``torch.cuda.max_memory_allocated()`` read 1.46 GiB under nbaccel
where its run peaked at 23.66 GiB, because the breakdown reset the counter at every phase).

The fake keeps the caching allocator's two figures (bytes held now, highest ever) as the real
one does, records every call, and fails a test that resets a peak. Its events complete at
once and time nothing: only the memory figures are under test here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nbaccel.accel.tracking.step_timing import BACKWARD, OPTIMIZER, StepTimer


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.0  # milliseconds


class FakeCuda:
    """What ``StepTimer`` may use of ``torch.cuda``, with an allocator of plain counters."""

    Event = FakeEvent

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.calls: list[str] = []

    # the allocator, driven by the test
    def allocate(self, size: int) -> None:
        self.current += size
        self.peak = max(self.peak, self.current)

    def free(self, size: int) -> None:
        self.current -= size

    # torch.cuda's API
    def current_stream(self, device: Any = None) -> str:
        return "stream"

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        self.calls.append("memory_stats_as_nested_dict")
        counts = {"current": self.current, "peak": self.peak, "allocated": 0, "freed": 0}
        return {"allocated_bytes": {"all": counts, "large_pool": {}, "small_pool": {}}}

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak  # what the user's script reads

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.calls.append("reset_peak_memory_stats")
        raise AssertionError("the step timer reset the user's peak-memory counter")

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the step timer used torch.cuda.{name}, which the fake lacks")


GIB = 1 << 30


def run_steps(
    cuda: FakeCuda, steps: int, backward_extra: list[int], before: Any = None
) -> list[dict[str, Any]]:
    """``steps`` steps of a loop whose forward holds 2 GiB of activations until backward,
    whose backward briefly needs ``backward_extra[step]`` more, and whose optimizer step
    briefly needs 1 GiB (Adam's temporaries)."""
    sent: list[dict[str, Any]] = []
    timer = StepTimer(
        enabled=True, send=sent.append, device=torch.device("cuda", 0), interval=0.0, cuda=cuda
    )
    loader = object()
    if before is not None:
        before()  # after the Accelerator (and its timer) exist, before the loop
    cuda.allocate(3 * GIB)  # weights and optimizer state, before the loop
    for step in range(steps):
        timer.begin_data(loader)
        cuda.allocate(1 << 20)  # the batch
        timer.end_data(torch.zeros(4, 3))
        cuda.allocate(2 * GIB)  # activations kept for backward
        previous = timer.enter(BACKWARD)
        cuda.allocate(backward_extra[step])
        cuda.free(backward_extra[step] + 2 * GIB)
        timer.leave(previous)
        previous = timer.enter(OPTIMIZER)
        cuda.allocate(GIB)
        cuda.free(GIB)
        timer.leave(previous)
        cuda.free(1 << 20)
    timer.loop_ended(loader)
    return sent


def test_the_users_peak_counter_is_never_reset_and_reads_the_runs_peak() -> None:
    cuda = FakeCuda()
    sent = run_steps(cuda, steps=6, backward_extra=[GIB, 3 * GIB, GIB, GIB, GIB, GIB])
    assert "reset_peak_memory_stats" not in cuda.calls
    assert sent and sum(window["steps"] for window in sent) == 6
    # The run peaked in step 2's backward: 3 GiB + 1 MiB + 2 GiB + 3 GiB.
    run_peak = 8 * GIB + (1 << 20)
    assert cuda.max_memory_allocated() == run_peak


def test_each_rise_of_the_peak_is_credited_to_the_phase_it_rose_in() -> None:
    cuda = FakeCuda()
    sent = run_steps(cuda, steps=6, backward_extra=[GIB, 3 * GIB, GIB, GIB, GIB, GIB])
    last = sent[-1]["peak_memory"]
    run_peak = 8 * GIB + (1 << 20)
    assert last[BACKWARD] == run_peak  # where the run's peak was reached
    assert max(last, key=last.get) == BACKWARD  # what the dashboard names
    # The optimizer's 1 GiB on 3 GiB + 1 MiB held never raised the peak (step 1's backward
    # had reached 6 GiB already): its figure is the bytes held at its edges, a lower bound.
    assert last[OPTIMIZER] == 3 * GIB + (1 << 20)
    # Forward holds weights, batch and activations as it ends: 5 GiB + 1 MiB, no more.
    assert last["forward"] == 5 * GIB + (1 << 20)
    assert last["data"] < last["forward"]


def test_windows_carry_the_runs_peaks_so_far() -> None:
    cuda = FakeCuda()
    sent = run_steps(cuda, steps=4, backward_extra=[GIB, 3 * GIB, GIB, GIB])
    backward = [window["peak_memory"][BACKWARD] for window in sent]
    assert backward == sorted(backward)  # never falls back to a window's lower bound
    assert backward[-1] == 8 * GIB + (1 << 20)


def test_a_peak_before_the_loop_is_not_credited_to_the_first_phase() -> None:
    cuda = FakeCuda()

    def evaluate_first() -> None:  # a model loaded and checked before training, then freed
        cuda.allocate(10 * GIB)
        cuda.free(10 * GIB)

    sent = run_steps(cuda, steps=2, backward_extra=[GIB, GIB], before=evaluate_first)
    last = sent[-1]["peak_memory"]
    assert max(last.values()) < 10 * GIB
    assert cuda.max_memory_allocated() == 10 * GIB  # the user's counter: untouched


def test_a_user_resetting_the_counter_mid_run_still_gets_rises_credited() -> None:
    cuda = FakeCuda()
    sent: list[dict[str, Any]] = []
    timer = StepTimer(
        enabled=True, send=sent.append, device=torch.device("cuda", 0), interval=0.0, cuda=cuda
    )
    loader = object()
    for forward, backward, evaluation in ((4 * GIB, 0, 3 * GIB), (0, 5 * GIB, 0)):
        timer.begin_data(loader)
        timer.end_data(torch.zeros(4, 3))
        cuda.allocate(forward)
        cuda.free(forward)
        previous = timer.enter(BACKWARD)
        cuda.allocate(backward)
        cuda.free(backward)
        timer.leave(previous)
        # The user's own code ("other"): torch.cuda.reset_peak_memory_stats(), then an
        # evaluation that needs 3 GiB: below the 4 GiB the timer saw, yet this phase's.
        cuda.peak = cuda.current
        cuda.allocate(evaluation)
        cuda.free(evaluation)
    timer.loop_ended(loader)
    peaks = sent[-1]["peak_memory"]
    assert peaks["forward"] == 4 * GIB
    assert peaks["other"] == 3 * GIB  # read as "not a rise", it would be lost (0)
    assert peaks[BACKWARD] == 5 * GIB  # the next rise, credited where it happened
    assert "reset_peak_memory_stats" not in cuda.calls


@pytest.mark.cuda
def test_on_a_gpu_the_users_peak_survives_the_breakdown() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    timer = StepTimer(enabled=True, send=lambda _window: None, device=device)
    loader = object()
    for _ in range(3):
        timer.begin_data(loader)
        x = torch.zeros(1 << 20, device=device)  # 4 MiB
        timer.end_data(x)
        previous = timer.enter(BACKWARD)
        big = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # 256 MiB
        del big
        timer.leave(previous)
        del x
    timer.loop_ended(loader)
    assert torch.cuda.max_memory_allocated(device) - base >= 256 << 20
