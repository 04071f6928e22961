"""The sweep's parts without processes: packing on a simulated 8-GPU box, configs from
lists, grids and a real Optuna study, what a sweep refuses before anything starts, and its
table, best trial and text lines."""

from __future__ import annotations

import io
import random
from pathlib import Path

import optuna
import pytest

import nbaccel
from nbaccel.errors import ConfigError
from nbaccel.sweeps import TextLines
from nbaccel.sweeps.configs import Configs, expand
from nbaccel.sweeps.packing import Packer, Slot
from nbaccel.sweeps.trials import Sweep, Trial


@pytest.mark.parametrize("per_trial", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", range(5))
def test_packing_never_gives_a_device_to_two_trials_and_reuses_freed_ones(
    per_trial: int, seed: int
) -> None:
    """An event simulation of 40 trials of random lengths on 8 GPUs."""
    rng = random.Random(seed)
    packer = Packer(devices=range(8), per_trial=per_trial)
    assert packer.capacity == 8 // per_trial
    running: list[tuple[float, Slot]] = []  # (end time, slot)
    now, waiting, used = 0.0, 40, set()
    while waiting or running:
        while waiting and (slot := packer.take()) is not None:
            busy = {d for _, s in running for d in s.devices}
            assert not busy & set(slot.devices), "a device in two trials at once"
            assert len(slot.devices) == per_trial
            running.append((now + rng.uniform(0.1, 3.0), slot))
            used |= set(slot.devices)
            waiting -= 1
        assert len(running) <= packer.capacity
        running.sort(key=lambda item: item[0])
        now, slot = running.pop(0)
        packer.give(slot)  # the freed devices serve the next trial at once
    assert used == set(range(8 // per_trial * per_trial))


def test_packing_refuses_what_cannot_fit_and_caps_concurrency() -> None:
    with pytest.raises(ValueError, match="needs 4 GPUs per trial, and 2 are visible"):
        Packer(devices=[0, 1], per_trial=4)
    assert Packer(devices=range(8), per_trial=1, max_concurrent=3).capacity == 3
    cpu = Packer((), per_trial=1, cpu_slots=2)
    assert [cpu.take(), cpu.take(), cpu.take()] == [Slot(0), Slot(1), None]
    with pytest.raises(ValueError, match="was not taken"):
        cpu.give(Slot(5))


def test_a_grid_is_every_combination_and_bad_configs_say_what_to_give() -> None:
    assert len(expand({"lr": [1, 2, 3], "batch": [8, 16], "seed": [0]})) == 6
    with pytest.raises(TypeError, match=r"write lr=\[0\.1\]"):
        expand({"lr": 0.1})
    with pytest.raises(TypeError, match=r"configs\[1\] is a int"):
        expand([{"lr": 1}, 3])
    with pytest.raises(ValueError, match=r"space= .* and n_trials="):
        Configs(optuna.create_study())
    with pytest.raises(ValueError, match="belong to a sweep over an Optuna study"):
        Configs([{"lr": 1}], n_trials=3)


def test_an_optuna_study_is_asked_when_a_slot_is_free_and_told_each_end() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize")
    configs = Configs(
        study, space=lambda trial: {"lr": trial.suggest_float("lr", 0.001, 1.0)}, n_trials=3
    )
    asked = [configs.next_config() for _ in range(4)]
    assert asked[3] is None  # n_trials handed out
    (first, t0), (_, t1), (_, t2) = asked[:3]  # type: ignore[misc]
    assert 0.001 <= first["lr"] <= 1.0
    configs.tell(t0, "succeeded", 0.5)
    configs.tell(t1, "pruned", 0.9)
    configs.tell(t2, "failed", None)
    states = [trial.state.name for trial in study.trials]
    assert states == ["COMPLETE", "PRUNED", "FAIL"]
    assert study.best_value == 0.5


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"hosts": ["node1"]}, "hosts= is not supported by nbaccel.sweep"),
        ({"num_processes": 4}, "processes_per_trial= sets"),
        ({"keep_workers": True}, "keep_workers= is not supported"),
        ({"mode": "best"}, "mode='best'"),
        ({"mixed_precision": "fp64"}, "mixed_precision"),
        ({"processes_per_trial": 0}, "processes_per_trial=0"),
    ],
)
def test_a_sweep_refuses_bad_input_before_anything_starts(
    options: dict[str, object], said: str, tmp_path: Path
) -> None:
    with pytest.raises((ConfigError, ValueError), match=said.replace("(", r"\(")):
        nbaccel.sweep(
            print, [{"lr": 1}], dashboard="text", runs_dir=str(tmp_path), use_cpu=True, **options
        )
    assert not any(tmp_path.iterdir())  # no run folder: nothing was launched


def sweep_of(states_and_losses: list[tuple[str, list[float]]]) -> Sweep:
    trials = []
    for number, (state, losses) in enumerate(states_and_losses):
        trial = Trial(number, {"lr": 10.0**-number}, state=state)
        trial.metrics["loss"] = [(step, loss) for step, loss in enumerate(losses)]
        trial.started, trial.ended = 0.0, 1.5
        trials.append(trial)
    return Sweep(trials, "loss", "min")


def test_the_table_and_best_trial_rank_by_the_metric_and_skip_unfinished_trials() -> None:
    sweep = sweep_of(
        [("succeeded", [0.9, 0.4]), ("succeeded", [0.8, 0.3, 0.35]), ("failed", [0.1])]
    )
    assert sweep.best is not None and sweep.best["trial"] == 1  # a failed trial is not best
    rows = sweep.table
    assert list(rows.index) == [0, 1, 2]
    assert list(rows["loss"]) == [0.4, 0.35, 0.1]
    assert list(rows["best loss"]) == [0.4, 0.3, 0.1]
    assert list(rows["lr"]) == [1.0, 0.1, 0.01]
    assert list(rows["state"]) == ["succeeded", "succeeded", "failed"]
    assert list(rows["seconds"]) == [1.5, 1.5, 1.5]
    assert sweep_of([("succeeded", [])]).best is None


def test_text_lines_say_each_start_and_end_once_and_the_best_at_the_end() -> None:
    stream = io.StringIO()
    sweep = sweep_of([("running", [0.5]), ("pending", [])])
    sweep.trials[0].slot = Slot(0)
    lines = TextLines(stream, Packer((), 1, cpu_slots=2), total=2)
    lines(sweep)
    lines(sweep)  # nothing changed: nothing said again
    sweep.trials[0].state = "succeeded"
    sweep._done.set()
    lines(sweep)
    said = stream.getvalue().splitlines()
    assert said[0] == "nbaccel: sweep of 2 trials, 2 at a time on CPU slots of 1 process"
    assert said[1] == "nbaccel: trial 0 on CPU slot 0: {'lr': 1.0}"
    assert said[2] == "nbaccel: trial 0 succeeded in 1.5 s: loss 0.5 (best so far)"
    assert said[3] == "nbaccel: sweep ended; best trial 0: loss 0.5 with {'lr': 1.0}"
    assert len(said) == 4


def test_a_detached_sweep_over_a_study_in_memory_is_refused(tmp_path: Path) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with pytest.raises(ConfigError, match="storage another process can open"):
        nbaccel.sweep(
            print,
            optuna.create_study(),
            space=lambda trial: {"lr": trial.suggest_float("lr", 0.1, 1.0)},
            n_trials=2,
            detach=True,
            dashboard="text",
            runs_dir=str(tmp_path),
            use_cpu=True,
        )
    assert not any(tmp_path.iterdir())


def test_an_interrupted_optuna_trial_is_told_it_failed_not_left_running() -> None:
    from nbaccel.sweeps.scheduler import Scheduler

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    configs = Configs(study, space=lambda t: {"lr": t.suggest_float("lr", 0.1, 1.0)}, n_trials=1)
    config, asked = configs.next_config()  # type: ignore[misc]
    trial = Trial(0, config, state="running", optuna_trial=asked, slot=Slot(0))
    sweep = Sweep([trial], "loss", "min")
    packer = Packer((), 1, cpu_slots=1)
    assert packer.take() == Slot(0)
    scheduler = Scheduler(print, configs, packer, sweep, {})
    scheduler._running[0] = trial
    scheduler._stop_all("cancelled")
    assert trial.state == "cancelled"
    assert [t.state.name for t in study.trials] == ["FAIL"]
    assert packer.take() == Slot(0)  # its slot is free again


def test_a_diverged_trial_is_never_the_best() -> None:
    sweep = sweep_of([("succeeded", [float("nan")]), ("succeeded", [0.1])])
    assert sweep.best is not None and sweep.best["trial"] == 1


def test_a_trial_that_finished_before_its_stop_took_effect_succeeded() -> None:
    from nbaccel.events import RunEnded, RunState
    from nbaccel.sweeps.scheduler import Scheduler

    trial = Trial(0, {"lr": 1.0}, state="running", slot=Slot(0), ending="pruned")
    sweep = Sweep([trial], "loss", "min")
    packer = Packer((), 1, cpu_slots=1)
    packer.take()
    scheduler = Scheduler(print, Configs([]), packer, sweep, {})
    scheduler._running[0] = trial
    scheduler._take((trial, RunEnded(RunState.SUCCEEDED, None, 1.0, 0.0)))
    assert trial.state == "succeeded"
    stopped = Trial(1, {}, state="running", slot=Slot(0), ending="pruned")
    packer.take()
    scheduler._running[1] = stopped
    scheduler._take((stopped, RunEnded(RunState.CANCELLED, None, 1.0, 0.0)))
    assert stopped.state == "pruned"
