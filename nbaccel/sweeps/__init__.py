"""``nbaccel.sweep``: many trials of a training function from one cell, packed onto device
subsets, pruned, compared, sharing the kernel's data.

An entry point above the launcher (as ``launching.py`` is): the configs (``configs.py``),
the packing of devices (``packing.py``), the loop that launches and follows the trials
(``scheduler.py``) and what it returns (``trials.py``); shown as text here, or as one
dashboard in a Jupyter kernel (``nbaccel.ui.sweep_board``). See docs/sweeps.md.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.config.resolve import ConfigSource, resolve
from nbaccel.config.schema import usable_cpu_cores
from nbaccel.errors import ConfigError, hidden_frames
from nbaccel.hardware.devices import choose_gpus, visible_gpu_count
from nbaccel.sweeps.configs import Configs
from nbaccel.sweeps.packing import Packer, cpu_slots
from nbaccel.sweeps.scheduler import Scheduler, Watcher
from nbaccel.sweeps.trials import Sweep, Trial

__all__ = ["Sweep", "Trial", "sweep"]

# Launch settings a sweep decides itself, per trial, or does not serve (yet).
_REFUSED = {
    "num_processes": "processes_per_trial= sets each trial's processes",
    "keep_workers": "each trial's workers end with it",
    "hosts": "a sweep packs trials onto this machine's devices",
    "num_machines": "a sweep packs trials onto this machine's devices",
    "max_restarts": "a failed trial ends alone; run it again as a trial of its own",
}


def sweep(
    train: Callable[[dict[str, Any]], Any],
    configs: Any,
    processes_per_trial: int = 1,
    *,
    max_concurrent: int | None = None,
    metric: str | None = None,
    mode: str = "min",
    space: Callable[[Any], Mapping[str, Any]] | None = None,
    n_trials: int | None = None,
    trial_timeout: float | None = None,
    wait: bool = True,
    dashboard: str | bool = "auto",
    sweep_id: str | None = None,
    config: ConfigSource = None,
    **overrides: Any,
) -> Sweep:
    """Run ``train(config)`` once per config, each trial on its own devices, process group,
    port and run folder, as many at once as the devices allow; return a ``Sweep``.

    ``configs``: a list of dicts, a grid (a dict of lists: every combination), or an Optuna
    study (with ``space``, a function of an Optuna trial giving its config, and
    ``n_trials``; a pruner sees ``metric`` as rank 0 logs it). ``processes_per_trial``:
    each trial's processes (GPUs; on a machine without GPUs, CPU processes, as many trials
    at once as the cores allow); ``max_concurrent`` caps it. ``metric``/``mode``: what
    ``best`` and Optuna rank by (its last logged value). ``trial_timeout``: seconds after
    which a trial is stopped (``timed out``). ``wait=False`` returns at once
    (``sweep.wait()``); ``detach=True`` hands the sweep to a supervisor that outlives the
    kernel (``nbaccel.attach(sweep.sweep_id)``). ``sweep_id``: an earlier sweep's, to run its
    trials again where they left off (with ``checkpoint_dir`` and ``resume="auto"``). Any
    launch setting as a keyword (``mixed_precision="bf16"``), for every trial; ``gpu_ids``
    names the GPUs to pack the trials onto.

    >>> import nbaccel
    >>> def train(config):
    ...     nbaccel.log_metrics({"loss": (config["lr"] - 0.1) ** 2})
    ...     return config["lr"]
    >>> result = nbaccel.sweep(train, {"lr": [0.01, 0.1, 1.0]}, metric="loss", dashboard="text")
    ... # doctest: +ELLIPSIS
    nbaccel: sweep of 3 trials, 2 at a time on CPU slots of 1 process
    ...
    >>> result.best["config"], list(result.table["state"])
    ({'lr': 0.1}, ['succeeded', 'succeeded', 'succeeded'])
    """
    with hidden_frames():
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: 'min' or 'max' (how {metric or 'the metric'} ranks)")
        for key, why in _REFUSED.items():
            if overrides.get(key):
                raise ConfigError(f"{key}= is not supported by nbaccel.sweep: {why}.", field=key)
        from nbaccel.ui.choose import choose_display

        choose_display(dashboard, blocking=wait)  # a wrong choice fails before anything starts
        sources = Configs(configs, space, n_trials)
        resolved = resolve(dict(overrides), env=os.environ, config=config)  # bad values: now
        packer = _packer(resolved.config, processes_per_trial, max_concurrent)
        trials: list[Trial] = []
        if sources.study is None:  # every trial known now: the table lists them all
            while (asked := sources.next_config()) is not None:
                trials.append(Trial(len(trials), asked[0]))
        result = Sweep(trials, metric, mode, sweep_id or "")
        result.study = sources.study
        detach = bool(overrides.pop("detach", False))
        options = {**overrides, "num_processes": processes_per_trial}
        if config is not None:
            options["config"] = config
        if detach:
            return _detached(
                train,
                result,
                sources,
                packer,
                options,
                space,
                n_trials,
                trial_timeout,
                resolved.config.runs_dir,
                dashboard,
            )
        watch = _display(dashboard, result, packer, sources.total, wait)
        scheduler = Scheduler(train, sources, packer, result, options, trial_timeout, watch)
        if wait:
            scheduler.run()
            return result
        thread = threading.Thread(target=_run_quietly, args=(scheduler,), daemon=True)
        thread.name = "nbaccel-sweep"
        thread.start()
        return result


def _detached(
    train: Callable[..., Any],
    result: Sweep,
    sources: Configs,
    packer: Packer,
    options: dict[str, Any],
    space: Any,
    n_trials: int | None,
    trial_timeout: float | None,
    runs_dir: str,
    dashboard: str | bool,
) -> Sweep:
    """Hand the sweep to a supervisor of its own (``detached.py``); what follows it, with
    its board in a kernel."""
    from nbaccel.sweeps.detached import show_attached, start_detached, sweeps_dir

    study, storage = sources.study, None
    if study is not None:
        backend = getattr(study, "_storage", None)
        storage = getattr(backend, "url", None) or getattr(
            getattr(backend, "_backend", None), "url", None
        )
        if storage is None:
            raise ConfigError(
                "detach=True over an Optuna study needs the study in a storage another process "
                "can open: optuna.create_study(storage='sqlite:///sweep.db', study_name=...). "
                "One in memory lives and dies with this kernel.",
                field="detach",
            )
    devices = [device for slot in packer.slots for device in slot.devices]
    plan = {
        "folder": str(sweeps_dir(runs_dir) / result.sweep_id),
        "sweep_id": result.sweep_id,
        "train": train,
        "configs": [trial.config for trial in result.trials] if study is None else None,
        "space": space if study is not None else None,
        "n_trials": n_trials if study is not None else None,
        "study_name": study.study_name if study is not None else None,
        "storage": storage,
        "metric": result.metric,
        "mode": result.mode,
        "devices": devices,
        "per_trial": packer.per_trial,
        "cpu_slots": packer.capacity,
        "max_concurrent": packer.capacity,
        "options": options,
        "trial_timeout": trial_timeout,
    }
    attached = start_detached(plan, runs_dir, result.sweep_id)
    sys.stdout.write(
        f"nbaccel: sweep {result.sweep_id} runs detached (supervisor pid {attached.pid}): "
        f"nbaccel.attach({result.sweep_id!r}) finds it again from any kernel\n"
    )
    return show_attached(attached, dashboard)


def _run_quietly(scheduler: Scheduler) -> None:
    try:
        scheduler.run()
    except BaseException:  # noqa: BLE001 - kept on the sweep (sweep.error), said by its display
        pass


def _packer(config: Any, per_trial: int, max_concurrent: int | None) -> Packer:
    """The slots: GPUs (``gpu_ids``, else every visible one) unless the run is on CPU."""
    if not isinstance(per_trial, int) or per_trial < 1:
        raise ValueError(f"processes_per_trial={per_trial!r}: a positive number of processes")
    gpus = 0 if config.use_cpu else visible_gpu_count(os.environ)
    if gpus:
        choose_gpus(config.gpu_ids, os.environ, visible=gpus)  # checked: ids that exist
        listed = config.gpu_ids != "all"
        devices = [int(i) for i in config.gpu_ids.split(",")] if listed else range(gpus)
        return Packer(devices, per_trial, max_concurrent=max_concurrent)
    slots = cpu_slots(usable_cpu_cores(), per_trial)
    return Packer((), per_trial, cpu_slots=slots, max_concurrent=max_concurrent)


def _display(
    dashboard: str | bool, sweep: Sweep, packer: Packer, total: int, blocking: bool
) -> Watcher:
    """How the sweep is shown: the widget board in a Jupyter kernel (``ui.sweep_board``;
    ``blocking``: its buttons cannot receive clicks), else text lines."""
    from nbaccel.ui.choose import wants_widgets

    if wants_widgets(dashboard):
        from nbaccel.ui.sweep_board import SweepBoard  # ipywidgets: only now

        return SweepBoard(sweep, packer.capacity, blocking=blocking, total=total)
    return TextLines(sys.stdout, packer, total)


class TextLines:
    """The sweep as text: a line when it starts, when each trial starts and ends."""

    def __init__(self, stream: Any, packer: Packer, total: int) -> None:
        self._stream = stream
        self._said: dict[int, str] = {}  # trial number -> the state last said
        slots = packer.slots
        where = (
            f"GPU slots of {packer.per_trial}"
            if slots and slots[0].devices
            else f"CPU slots of {packer.per_trial} process{'es' if packer.per_trial > 1 else ''}"
        )
        stream.write(f"nbaccel: sweep of {total} trials, {packer.capacity} at a time on {where}\n")

    def __call__(self, sweep: Sweep) -> None:
        best = sweep.best_trial()
        for trial in list(sweep.trials):
            if self._said.get(trial.number) == trial.state or trial.state == "pending":
                continue
            self._said[trial.number] = trial.state
            self._stream.write(self._line(sweep, trial, best) + "\n")
        if sweep.done:
            self._stream.write(self._summary(sweep, best) + "\n")
        self._stream.flush()

    @staticmethod
    def _line(sweep: Sweep, trial: Trial, best: Trial | None) -> str:
        if trial.state == "running":
            return f"nbaccel: trial {trial.number} on {trial.slot}: {trial.config}"
        seconds = f" in {trial.seconds:.1f} s" if trial.seconds is not None else ""
        value = trial.last(sweep.metric) if sweep.metric else None
        said = f": {sweep.metric} {value:.6g}" if value is not None else ""
        star = " (best so far)" if best is trial else ""
        error = f": {trial.error}" if trial.error else ""
        return f"nbaccel: trial {trial.number} {trial.state}{seconds}{said}{star}{error}"

    @staticmethod
    def _summary(sweep: Sweep, best: Trial | None) -> str:
        if best is None:
            return f"nbaccel: sweep ended: {sweep!r}"
        value = best.last(sweep.metric) if sweep.metric else None
        return (
            f"nbaccel: sweep ended; best trial {best.number}: {sweep.metric} {value:.6g} "
            f"with {best.config}"
        )
