"""Sweeps of real CPU/gloo launches: trials packed two at a time on this machine's cores,
a failing trial ending alone, an Optuna pruner stopping a trial, a stuck trial timed out,
one trial stopped, an interrupt stopping them all, and the kernel's data shared once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy
import optuna
import pytest

import nbaccel
from nbaccel.config.schema import usable_cpu_cores
from nbaccel.launcher.local.helper import shared_helper
from nbaccel.launcher.sharing.cache import CACHE
from tests.multiprocess.conftest import run_script
from tests.multiprocess.test_interactive_workers import wait_for

pytestmark = pytest.mark.timeout(300)

DATA = numpy.arange(4 << 20, dtype="f4")  # 16 MiB held in the kernel, read by every trial


def train(config: dict[str, Any]) -> dict[str, Any]:
    import time

    import torch.distributed as dist

    started = time.time()
    for step in range(config.get("steps", 3)):
        nbaccel.log_metrics({"loss": config["lr"] * 10 / (step + 1)}, step=step)
        time.sleep(config.get("pause", 0.05))
    if config.get("fail"):
        raise ValueError(f"trial with lr={config['lr']} broke")
    return {
        "started": started,
        "ended": time.time(),
        "world": dist.get_world_size(),
        "pid": os.getpid(),
        "parent": os.getppid(),
        "threads": __import__("torch").get_num_threads(),
        "data": float(DATA[-1]),
    }


def test_trials_pack_two_at_a_time_share_the_data_once_and_a_failure_stays_in_its_trial(
    runs_dir: str,
) -> None:
    written = CACHE.bytes_written
    configs = [{"lr": lr, "fail": lr == 0.3} for lr in (0.1, 0.2, 0.3, 0.4, 0.5)]
    sweep = nbaccel.sweep(
        train, configs, metric="loss", dashboard="text", runs_dir=runs_dir, use_cpu=True
    )
    states = [trial.state for trial in sweep.trials]
    assert states == ["succeeded", "succeeded", "failed", "succeeded", "succeeded"]
    failed = sweep.trials[2]
    assert "trial with lr=0.3 broke" in failed.error
    assert failed.run is not None and "broke" in str(failed.run.error)
    assert (failed.run.run_dir / "rank0.log").is_file()  # its folder and logs are kept
    values = [run.result() for run in sweep.runs if run.state is nbaccel.RunState.SUCCEEDED]
    assert all(v["world"] == 1 and v["data"] == float(DATA[-1]) for v in values)
    # The cores are shared out among the trials running at once: one thread each here.
    assert {v["threads"] for v in values} == {max(1, usable_cpu_cores() // 2)}
    # Every trial's worker came from the kernel's warm helper, as a later launch's does.
    assert {v["parent"] for v in values} == {shared_helper().pid}
    # Two slots on two cores: never three trials at once, and the slots were both used.
    spans = sorted((v["started"], v["ended"]) for v in values)
    for start, _ in spans:
        assert sum(s <= start < e for s, e in spans) <= 2
    assert {str(trial.slot) for trial in sweep.trials} == {"CPU slot 0", "CPU slot 1"}
    # The kernel's 16 MiB went to shared memory once for all five trials.
    assert CACHE.bytes_written - written < 2 * DATA.nbytes
    assert sweep.best is not None and sweep.best["config"]["lr"] == 0.1
    table = sweep.table
    assert list(table["state"]) == states and list(table["lr"]) == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert table.loc[0, "loss"] == pytest.approx(0.1 * 10 / 3)
    assert all(Path(folder).is_dir() for folder in table["run_dir"])


def test_an_optuna_pruner_stops_a_bad_trial_and_the_study_knows(runs_dir: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pruner = optuna.pruners.ThresholdPruner(upper=10.0)
    study = optuna.create_study(direction="minimize", pruner=pruner)
    for lr in (0.1, 5.0, 0.2):  # asked in this order; 5.0 is hopeless
        study.enqueue_trial({"lr": lr})

    def space(trial: optuna.Trial) -> dict[str, Any]:
        return {"lr": trial.suggest_float("lr", 0.1, 5.0), "steps": 200, "pause": 0.01}

    sweep = nbaccel.sweep(
        train,
        study,
        space=space,
        n_trials=3,
        metric="loss",
        max_concurrent=1,
        dashboard="text",
        runs_dir=runs_dir,
        use_cpu=True,
    )
    states = {trial.config["lr"]: trial.state for trial in sweep.trials}
    assert states[5.0] == "pruned"  # 5.0 * 10 = 50 > 10 at its first step: stopped early
    pruned = next(t for t in sweep.trials if t.state == "pruned")
    assert pruned.step is not None and pruned.step < 150
    kinds = sorted(t.state.name for t in study.trials)
    assert kinds == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert study.best_value == pytest.approx(0.1 * 10 / 200)
    assert [t.params["lr"] for t in study.trials] == [0.1, 5.0, 0.2]
    assert sweep.best is not None and sweep.best["config"]["lr"] == 0.1


def test_a_stuck_trial_times_out_and_its_slot_serves_the_next(runs_dir: str) -> None:
    configs = [{"lr": 0.1, "steps": 10**6, "pause": 0.01}, {"lr": 0.2}]
    sweep = nbaccel.sweep(
        train,
        configs,
        trial_timeout=3.0,
        max_concurrent=1,
        dashboard="text",
        runs_dir=runs_dir,
        use_cpu=True,
    )
    assert [t.state for t in sweep.trials] == ["timed out", "succeeded"]
    assert sweep.trials[0].seconds is not None and sweep.trials[0].seconds < 3.0 + 15


def test_one_trial_stopped_from_a_sweep_that_does_not_block(runs_dir: str) -> None:
    configs = [{"lr": 0.1, "steps": 10**6, "pause": 0.01}, {"lr": 0.2}, {"lr": 0.3}]
    sweep = nbaccel.sweep(
        train, configs, wait=False, dashboard="text", runs_dir=runs_dir, use_cpu=True
    )
    wait_for(lambda: sweep.trials[0].step is not None, 60, "the long trial to log")
    assert not sweep.done
    sweep.stop_trial(0)
    sweep.wait(60)
    assert [t.state for t in sweep.trials] == ["stopped", "succeeded", "succeeded"]


def test_an_interrupt_stops_the_sweep_and_every_trial_within_seconds(tmp_path: Path) -> None:
    done = run_script(
        """
        import os, signal, threading, time, psutil, nbaccel

        def train(config):
            import pathlib, time
            pathlib.Path(f"started-{config['n']}").touch()
            while True:
                time.sleep(0.01)

        def interrupt_once_running():
            deadline = time.monotonic() + 60
            while len([p for p in os.listdir(".") if p.startswith("started-")]) < 2:
                assert time.monotonic() < deadline, "the trials never started"
                time.sleep(0.02)
            asked.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

        asked = []
        threading.Thread(target=interrupt_once_running, daemon=True).start()
        try:
            nbaccel.sweep(train, [{"n": n} for n in range(4)], dashboard="text",
                          runs_dir="runs", use_cpu=True)
        except KeyboardInterrupt:
            stopped = time.monotonic()
        else:
            raise AssertionError("the sweep was not interrupted")
        print(f"took {stopped - asked[0]:.2f} s")
        def rank(process):  # a trial's worker (or its child), not the helper or its spares
            try:
                return " rank " in " ".join(process.cmdline()) or "nbaccel r" in process.name()
            except psutil.Error:
                return False

        workers = [p for p in psutil.Process().children(recursive=True) if rank(p)]
        gone, alive = psutil.wait_procs(workers, timeout=10)
        names = [p.name() for p in alive]
        print("left:", names)
        """,
        tmp_path,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "left: []" in done.stdout, done.stdout + done.stderr
    said = done.stdout
    assert "trial 0 cancelled" in said and "trial 1 cancelled" in said, said
    took = float(said.split("took ")[1].split()[0])
    assert took < 20, said  # every trial stopped within seconds (~1 s here; 5x headroom and more)


def test_a_detached_sweep_outlives_its_kernel_and_another_kernel_attaches(
    tmp_path: Path,
) -> None:
    started = run_script(
        """
        import nbaccel, optuna

        def train(config):
            import time
            for step in range(config.get("steps", 10)):
                nbaccel.log_metrics({"loss": config["lr"] / (step + 1)}, step=step)
                time.sleep(0.02)

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(storage="sqlite:///study.db", study_name="s")
        for lr in (0.3, 0.1):
            study.enqueue_trial({"lr": lr})
        space = lambda trial: {"lr": trial.suggest_float("lr", 0.05, 0.5)}
        sweep = nbaccel.sweep(train, study, space=space, n_trials=2, metric="loss",
                              detach=True, runs_dir="runs", use_cpu=True)
        long = nbaccel.sweep(train, [{"lr": 1.0, "steps": 10**6}, {"lr": 2.0}], detach=True,
                             runs_dir="runs", use_cpu=True, max_concurrent=1)
        print("ids", sweep.sweep_id, long.sweep_id, sweep.pid)
        """,
        tmp_path,
    )
    assert started.returncode == 0, started.stderr
    ids = started.stdout.split("ids ")[1].split()
    attached = run_script(
        f"""
        import time, psutil, optuna, nbaccel

        sweep = nbaccel.attach({ids[0]!r}, runs_dir="runs").wait(120)
        assert [t.state for t in sweep.trials] == ["succeeded", "succeeded"], sweep.rows()
        assert sweep.best["config"] == {{"lr": 0.1}}, sweep.best
        study = optuna.load_study(study_name="s", storage="sqlite:///study.db")
        assert study.best_params == {{"lr": 0.1}}, study.best_params   # told by the supervisor
        long = nbaccel.attach({ids[1]!r}, runs_dir="runs")
        deadline = time.monotonic() + 60
        while long.trials[0].step is None:          # reads the state file again each time
            assert time.monotonic() < deadline, "the long trial never logged"
            time.sleep(0.05)
        long.stop_trial(0)
        long.wait(60)
        assert [t.state for t in long.trials] == ["stopped", "succeeded"], long.rows()
        deadline = time.monotonic() + 30
        while psutil.pid_exists({ids[2]}) and psutil.Process({ids[2]}).status() != "zombie":
            assert time.monotonic() < deadline, "the supervisor outlived its sweep"
            time.sleep(0.05)
        print("ok")
        """,
        tmp_path,
        timeout=240,
    )
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert attached.stdout.strip().endswith("ok")


def trial_of_a_long_run(config: dict[str, Any]) -> dict[str, Any]:
    """The long-runs loop (Accelerator, prepared loader, periodic saves) as a sweep's trial."""
    from tests.multiprocess.test_long_runs import train as loop

    return loop(config["total"], -1, config.get("signal_at", -1))


def test_a_sweep_run_again_with_its_id_resumes_each_trial_from_its_own_checkpoints(
    tmp_path: Path, runs_dir: str
) -> None:
    options = {"runs_dir": runs_dir, "use_cpu": True, "dashboard": "text"}
    checkpoints = str(tmp_path / "ckpt")
    # Long enough that a stop asked at step 20 or 1,500 is agreed on (the ranks compare notes
    # every ~0.2 s of steps) well before the loop would end by itself, at different steps.
    configs = [{"total": 5000, "signal_at": 20}, {"total": 5000, "signal_at": 1500}]
    first = nbaccel.sweep(trial_of_a_long_run, configs, checkpoint_dir=checkpoints, **options)
    assert [t.state for t in first.trials] == ["stopped", "stopped"]  # saved, then stopped
    saved = [trial.run.saved_step for trial in first.trials if trial.run is not None]
    assert saved[0] is not None and saved[1] is not None and 20 <= saved[0] < saved[1]
    for number in (0, 1):  # trials never share a checkpoint folder
        assert (Path(checkpoints) / first.sweep_id / f"trial-{number}" / "LATEST").is_file()
    again = nbaccel.sweep(
        trial_of_a_long_run,
        [{"total": 5000}, {"total": 5000}],
        sweep_id=first.sweep_id,
        checkpoint_dir=checkpoints,
        resume="auto",
        **options,
    )
    assert [t.state for t in again.trials] == ["succeeded", "succeeded"]
    resumed = [run.result()["first"] for run in again.runs]
    assert resumed == saved  # each trial went on from the step it saved
