"""The step every rank saves or stops at: agreed through the sums, whatever each rank's clock."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from nbaccel.accel.autosave.agreement import CHECK_SECONDS, StepAgreement
from nbaccel.accel.autosave.stop_requests import StopRequests
from nbaccel.config.cadence import Cadence, effective, parse
from nbaccel.config.schema import Config
from nbaccel.errors import ConfigError


class FakeWorld:
    """An all-reduce over ``n`` ranks run as threads: each call waits for every rank's."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._barrier = threading.Barrier(n, timeout=10)
        self._values: list[list[int]] = [[] for _ in range(n)]

    def reduce_for(self, rank: int) -> Callable[[list[int]], list[int]]:
        def reduce_sum(values: list[int]) -> list[int]:
            self._values[rank] = values
            self._barrier.wait()
            summed = [sum(column) for column in zip(*self._values, strict=True)]
            self._barrier.wait()  # every rank has read the sums before the next call
            return summed

        return reduce_sum


@pytest.mark.parametrize("cadence", [Cadence(seconds=0.5), Cadence(steps=7), None])
def test_ranks_of_different_speeds_decide_the_same_at_every_step(cadence: Cadence | None) -> None:
    world = FakeWorld(3)
    speeds = [0.001, 0.004, 0.0025]  # seconds per step: each rank's own clock
    stop_on = {1: 120}  # rank 1 is asked to stop at its step 120
    decided: list[list[tuple[int, bool, bool]]] = [[] for _ in speeds]

    def rank(r: int) -> None:
        now = [0.0]
        agreement = StepAgreement(world.reduce_for(r), 3, cadence, clock=lambda: now[0])
        for step in range(1, 400):
            now[0] += speeds[r]
            asked = step >= stop_on.get(r, 10**9)
            decision = agreement.at_step(step, stop_asked=asked)
            if decision is not None:
                decided[r].append((step, decision.save, decision.stop))
                if decision.save:
                    agreement.saved(step)
                if decision.stop:
                    return

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert decided[0] == decided[1] == decided[2]  # the same checks, the same answers
    stops = [step for step, _, stop in decided[0] if stop]
    assert len(stops) == 1 and stops[0] >= 120
    # The stop came within one check interval of the request (~CHECK_SECONDS of steps).
    assert stops[0] - 120 <= CHECK_SECONDS / min(speeds) + 1
    saves = [step for step, save, _ in decided[0] if save]
    if cadence is not None and cadence.steps is not None:
        assert [s for s in saves if s != stops[0]] == [7 * k for k in range(1, len(saves))]
    if cadence is None:
        assert saves == stops  # off: only the stop saves


def test_the_check_interval_grows_with_fast_steps_and_lands_on_step_multiples() -> None:
    now = [0.0]
    agreement = StepAgreement(lambda v: v, 1, Cadence(steps=500), clock=lambda: now[0])
    checks = []
    for step in range(1, 2001):
        now[0] += 0.0001  # 0.1 ms steps: ~2,000 steps make CHECK_SECONDS
        if agreement.at_step(step, stop_asked=False) is not None:
            checks.append(step)
    assert {500, 1000, 1500, 2000} <= set(checks)
    assert len(checks) < 40  # not a collective every step


def test_cadences_parse_and_auto_follows_where_checkpoints_go() -> None:
    assert parse("15min") == Cadence(seconds=900.0)
    assert parse("2h") == Cadence(seconds=7200.0)
    assert parse(" 500 steps ") == Cadence(steps=500)
    assert parse("90") == Cadence(seconds=90.0) and parse("off") is None
    for bad in ("0", "1.5 steps", "soon", "-3", "5 parsecs"):
        with pytest.raises(ConfigError, match="is not a cadence"):
            parse(bad)
    assert effective(Config()) is None
    assert effective(Config.replace(Config(), checkpoint_dir="/d")) == Cadence(seconds=900.0)
    assert effective(Config.replace(Config(), checkpoint_every=600)) == Cadence(seconds=600.0)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        Config.replace(Config(), checkpoint_every="often")


def test_a_stop_request_is_kept_with_why_and_the_handlers_go_back() -> None:
    import signal

    before = signal.getsignal(signal.SIGUSR1)
    requests = StopRequests()
    requests.install()
    try:
        signal.raise_signal(signal.SIGUSR1)
        assert requests.requested and requests.why == "SIGUSR1"
    finally:
        requests.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before
