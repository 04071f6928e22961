"""The step-time breakdown: the worker's laps (``StepTimer``) and the parent's reading
(``StepBoard``: throughput, straggler). Time is a fake clock here; a real 2-process run is
in tests/multiprocess/test_step_breakdown.py."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.accel.tracking.step_timing import (
    BACKWARD,
    COMMUNICATION,
    OPTIMIZER,
    StepTimer,
    disabled_timer,
)
from nbaccel.events import StepBreakdown
from nbaccel.step_board import StepBoard, Straggler


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def make_timer(interval: float = 1e9) -> tuple[StepTimer, FakeClock, list[dict[str, Any]]]:
    clock, sent = FakeClock(), []
    timer = StepTimer(enabled=True, send=sent.append, interval=interval, clock=clock)
    return timer, clock, sent


def one_step(
    timer: StepTimer, clock: FakeClock, loader: object, batch: Any, **seconds: float
) -> None:
    """data, forward, backward, other, optimizer, other: each for the seconds given."""
    timer.begin_data(loader)
    clock.spend(seconds.get("data", 0.0))
    timer.end_data(batch)
    clock.spend(seconds.get("forward", 0.0))
    previous = timer.enter(BACKWARD)
    clock.spend(seconds.get("backward", 0.0))
    timer.leave(previous)
    clock.spend(seconds.get("between", 0.0))
    previous = timer.enter(OPTIMIZER)
    clock.spend(seconds.get("optimizer", 0.0))
    timer.leave(previous)
    clock.spend(seconds.get("after", 0.0))


def test_each_phase_gets_its_laps_and_they_add_up_to_the_step_time() -> None:
    timer, clock, sent = make_timer()
    loader, batch = object(), torch.zeros(8, 2)
    for _ in range(3):
        one_step(timer, clock, loader, batch, data=1, forward=2, backward=3, between=0.5,
                 optimizer=4, after=0.25)  # fmt: skip
    timer.loop_ended(loader)
    (window,) = sent
    assert window["steps"] == 3
    assert window["phases"] == {
        "data": 3.0, "forward": 6.0, "backward": 9.0, "optimizer": 12.0, "other": 2.25
    }  # fmt: skip
    assert sum(window["phases"].values()) == clock.now  # every moment in exactly one phase
    assert window["samples"] == 24 and window["tokens"] is None


def test_tokens_are_counted_from_input_ids_and_samples_from_dim_0() -> None:
    timer, clock, sent = make_timer()
    loader = object()
    batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.zeros(4)}
    one_step(timer, clock, loader, batch, data=1)
    one_step(timer, clock, loader, batch, data=1)
    timer.loop_ended(loader)
    assert (sent[0]["samples"], sent[0]["tokens"]) == (8, 128)


def test_iterations_without_training_are_dropped_and_passes_are_apart() -> None:
    timer, clock, sent = make_timer()
    train, evaluation, batch = object(), object(), torch.zeros(2)
    one_step(timer, clock, train, batch, data=1, backward=1)
    for _ in range(3):  # an evaluation pass: data and forward only
        timer.begin_data(evaluation)
        clock.spend(10)
        timer.end_data(batch)
        clock.spend(10)
    timer.begin_data(evaluation)  # exhausted
    timer.loop_ended(evaluation)
    clock.spend(100)  # between passes: in no step
    one_step(timer, clock, train, batch, data=1, backward=1)
    timer.loop_ended(train)
    assert [w["steps"] for w in sent] == [1, 1]
    # The first step ended when evaluation asked for its first batch.
    assert [sum(w["phases"].values()) for w in sent] == [2.0, 2.0]
    assert all(w["samples"] == 2 for w in sent)


def test_a_second_loader_of_the_same_step_does_not_end_it() -> None:
    timer, clock, sent = make_timer()
    first, second, batch = object(), object(), torch.zeros(3)
    for _ in range(2):  # zip(first, second)
        timer.begin_data(first)
        clock.spend(1)
        timer.end_data(batch)
        timer.begin_data(second)
        clock.spend(1)
        timer.end_data(batch)
        previous = timer.enter(BACKWARD)
        clock.spend(1)
        timer.leave(previous)
    timer.loop_ended(first)
    assert sent[0]["steps"] == 2
    assert sent[0]["phases"]["data"] == 4.0 and sent[0]["samples"] == 12


def test_a_loop_left_early_ends_its_step_and_nested_calls_return_to_the_outer_one() -> None:
    timer, clock, sent = make_timer()
    loader = object()
    timer.begin_data(loader)
    timer.end_data(torch.zeros(1))
    outer = timer.enter(OPTIMIZER)
    clock.spend(1)
    inner = timer.enter(OPTIMIZER)  # clipping inside the optimizer step
    clock.spend(1)
    timer.leave(inner)
    clock.spend(1)  # still the optimizer's
    timer.leave(outer)
    clock.spend(1)
    timer.loop_ended(loader)  # break: the step trained, so it counts
    assert sent[0]["steps"] == 1
    assert sent[0]["phases"] == {"data": 0.0, "forward": 0.0, "optimizer": 3.0, "other": 1.0}


def test_windows_are_sent_when_the_interval_passed_and_at_the_end() -> None:
    timer, clock, sent = make_timer(interval=0.5)
    loader, batch = object(), torch.zeros(1)
    for _ in range(10):
        one_step(timer, clock, loader, batch, forward=0.1, backward=0.1)
    timer.loop_ended(loader)
    # Steps of 0.2 s: a window goes with the first step that ends >= 0.5 s after the
    # last one went (at 0.6, 1.2, 1.8 s); the rest when the pass ends.
    assert [w["steps"] for w in sent] == [3, 3, 3, 1]
    assert sum(w["steps"] for w in sent) == 10
    assert sum(sum(w["phases"].values()) for w in sent) == pytest.approx(2.0)


def test_marks_outside_a_loop_and_a_disabled_timer_do_nothing() -> None:
    timer, _clock, sent = make_timer()
    assert timer.enter(BACKWARD) is None  # no prepared loader is being iterated
    timer.leave(None)
    timer.end_data(torch.zeros(1))
    off = disabled_timer()
    off.begin_data(object())
    assert off.enter(BACKWARD) is None
    off.loop_ended(object())
    assert sent == []


def test_the_wait_for_the_reduction_is_communication_not_backward() -> None:
    # A stand-in for DDP's reducer: an autograd final callback, queued when a gradient is
    # ready (as DDP queues its finalize), that waits 50 ms. The timer's mark runs first.
    sent: list[dict[str, Any]] = []
    timer = StepTimer(enabled=True, send=sent.append)
    weight = torch.ones(3, requires_grad=True)

    def queue_wait(grad: torch.Tensor) -> None:
        engine: Any = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: time.sleep(0.05))

    weight.register_hook(queue_wait)
    loader = object()
    timer.begin_data(loader)
    timer.end_data(torch.zeros(1))
    loss = (weight * 2).sum()
    previous = timer.enter(BACKWARD)
    timer.watch_reduction(loss)
    loss.backward()
    timer.leave(previous)
    timer.loop_ended(loader)
    phases = sent[0]["phases"]
    assert phases[COMMUNICATION] >= 0.05
    assert phases[BACKWARD] < 0.05


def test_the_reduction_watch_leaves_the_losss_own_hooks_alone() -> None:
    # The watch lends one hook dict to the loss while registering it: a hook the user put
    # on the loss before still runs (the watch then registers the public way), and one put
    # on after gets a dict of its own, not the dict every later step shares.
    timer, _clock, _sent = make_timer()
    weight = torch.ones(3, requires_grad=True)
    seen: list[str | None] = []
    engine: Any = torch.autograd.Variable._execution_engine
    # A stand-in for DDP's reducer: at a gradient, it queues a final callback; that one
    # finds the mark's callback (queued as backward began) ran: the phase is communication.
    weight.register_hook(lambda grad: engine.queue_callback(lambda: seen.append(timer._phase)))
    loader = object()
    for hooked_before in (True, False):
        timer.begin_data(loader)
        timer.end_data(torch.zeros(1))
        loss = (weight * 2).sum()
        if hooked_before:
            loss.register_hook(lambda grad: seen.append("before"))
        previous = timer.enter(BACKWARD)
        timer.watch_reduction(loss)
        if not hooked_before:
            loss.register_hook(lambda grad: seen.append("after"))
        loss.backward()
        timer.leave(previous)
    timer.loop_ended(loader)
    assert seen == ["before", COMMUNICATION, "after", COMMUNICATION]
    assert list(timer._loss_hooks) == [0]  # the shared dict holds only the mark
    assert loss._backward_hooks is not None and len(loss._backward_hooks) == 1


def test_a_prepared_loop_marks_every_phase_in_process() -> None:
    acc = Accelerator(cpu=True)
    sent: list[dict[str, Any]] = []
    acc.strategy.step_timer = StepTimer(enabled=True, send=sent.append)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(20, 4), torch.randn(20, 2))
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=4))
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert sum(w["steps"] for w in sent) == 5 and sum(w["samples"] for w in sent) == 20
    phases = set().union(*(w["phases"] for w in sent))
    # One process: nothing to wait for, so no communication phase.
    assert phases == {"data", "forward", "backward", "optimizer", "other"}


def breakdown(
    rank: int,
    busy: float,
    wait: float,
    samples: int = 32,
    tokens: int | None = None,
    steps: int = 10,
) -> StepBreakdown:
    """A window of ``steps`` equal steps: ``busy`` and ``wait`` seconds each, ``samples``
    and ``tokens`` each."""
    phases = {"forward": busy * steps, "communication": wait * steps, "data": 0.0}
    tokens = None if tokens is None else tokens * steps
    return StepBreakdown(rank, steps, phases, samples * steps, tokens, None, 0.0)


def test_throughput_sums_ranks_and_has_tokens_only_with_input_ids() -> None:
    board = StepBoard()
    board.add(breakdown(0, 0.1, 0.1, samples=32))
    board.add(breakdown(1, 0.1, 0.1, samples=32))
    assert board.throughput() == (pytest.approx(320.0), None)
    board.add(breakdown(0, 0.2, 0.0, samples=32, tokens=512))
    samples, tokens = board.throughput()
    # rank 0: 64 samples in 0.4 s; rank 1: 32 in 0.2 s; tokens only where reported.
    assert samples == pytest.approx(320.0) and tokens == pytest.approx(512 / 0.4)


def test_the_straggler_is_named_only_beyond_the_threshold() -> None:
    board = StepBoard(threshold=0.15)
    for rank in range(4):  # lockstep: equal steps; the slow rank waits least
        busy = 0.0114 if rank == 2 else 0.010
        board.add(breakdown(rank, busy, 0.012 - busy))
    assert board.straggler() is None  # 14 % over the others: within the threshold
    board.add(breakdown(3, 0.0120, 0.0))  # rank 3 now averages 0.011 in its recent windows
    assert board.straggler() is None
    board.add(breakdown(1, 0.0300, 0.0))  # rank 1 averages 0.020: twice the others
    slow = board.straggler()
    assert slow is not None and slow.rank == 1
    # The others: 0.010, 0.011, 0.0114 s busy per step; their median is 0.011.
    assert slow.excess == pytest.approx(0.020 / 0.011 - 1)
    assert "slowest rank 1" in board.summary()
    assert StepBoard().straggler() is None and StepBoard().summary() == ""


def test_no_straggler_is_named_from_a_few_warm_up_steps() -> None:
    board = StepBoard()
    board.add(breakdown(0, 0.010, 0.0, steps=9))
    board.add(breakdown(1, 0.030, 0.0, steps=9))  # 3x slower, but only 9 steps each
    assert board.straggler() is None
    board.add(breakdown(0, 0.010, 0.0, steps=1))
    board.add(breakdown(1, 0.030, 0.0, steps=1))
    assert board.straggler() == Straggler(1, pytest.approx(0.030), pytest.approx(0.010))


def test_recent_figures_per_step_and_peak_memory_per_phase() -> None:
    board = StepBoard()
    board.add(StepBreakdown(0, 2, {"forward": 0.2, "backward": 0.4}, 16, None, {"forward": 5}, 0))
    board.add(StepBreakdown(0, 2, {"forward": 0.2, "backward": 0.2}, 16, None, {"forward": 9}, 0))
    recent = board.recent(0)
    assert recent.steps == 4 and recent.step_seconds == pytest.approx(0.25)
    assert recent.phases == pytest.approx({"forward": 0.1, "backward": 0.15})
    assert recent.peak_memory == {"forward": 9}
    assert board.version == 2


@pytest.mark.cuda
def test_cuda_laps_are_read_without_a_sync_and_report_peak_memory() -> None:
    device = torch.device("cuda", 0)
    sent: list[dict[str, Any]] = []
    timer = StepTimer(enabled=True, send=sent.append, device=device)
    loader = object()
    for _ in range(5):
        timer.begin_data(loader)
        x = torch.randn(1024, 1024, device=device)
        timer.end_data(x)
        y = x @ x
        previous = timer.enter(BACKWARD)
        big = torch.empty(64 << 20, dtype=torch.uint8, device=device)  # 64 MiB in backward
        y = y @ x
        del big
        timer.leave(previous)
    timer.loop_ended(loader)
    torch.cuda.synchronize()
    assert sum(w["steps"] for w in sent) >= 1
    peaks: dict[str, int] = {}
    for window in sent:
        for phase, peak in window["peak_memory"].items():
            peaks[phase] = max(peaks.get(phase, 0), peak)
    assert peaks["backward"] >= 64 << 20 > peaks["data"]
