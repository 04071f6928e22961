"""The sweep's loop, in the kernel: start a trial on each free slot, follow the trials'
events, prune, time out, and free a trial's slot when it ends.

Every trial is a launch (``launcher.api.start``: its own process group, port and run folder,
forked from the warm helper, the kernel's data shared once through the segment cache) whose
events are posted here by a subscriber; the loop blocks on that queue, so nothing polls. A
failed trial ends alone (named, its logs in its run folder); an interrupt stops every running
trial and raises. Optuna trials are asked for when a slot is free and told how they ended;
a pruner sees each value of the sweep's metric as rank 0 logs it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.config.schema import usable_cpu_cores
from nbaccel.errors import hidden_frames
from nbaccel.events import Event, Metric, RunEnded, RunState
from nbaccel.launcher.api import start
from nbaccel.launcher.run import Run
from nbaccel.sweeps.configs import Configs
from nbaccel.sweeps.packing import Packer, Slot
from nbaccel.sweeps.trials import Sweep, Trial

STOP_WAIT = 15.0  # how long an interrupted sweep waits for its trials' processes to end
# What a trial's end is when the sweep stopped it, by why it was stopped.
_STATE_OF_RUN = {
    RunState.SUCCEEDED: "succeeded",
    RunState.FAILED: "failed",
    RunState.STOPPED: "stopped",
    RunState.CANCELLED: "stopped",
}

# What watches the sweep (its display): called after each change, on the loop's thread.
Watcher = Callable[[Sweep], None]


class Scheduler:
    """Runs ``train(config)`` for every config of ``configs`` on the slots of ``packer``."""

    def __init__(
        self,
        train: Callable[..., Any],
        configs: Configs,
        packer: Packer,
        sweep: Sweep,
        launch_options: Mapping[str, Any],
        trial_timeout: float | None = None,
        watch: Watcher = lambda sweep: None,
    ) -> None:
        self._train, self._configs, self._packer = train, configs, packer
        self._sweep, self._options = sweep, dict(launch_options)
        self._timeout, self._watch = trial_timeout, watch
        self._events: queue.SimpleQueue[tuple[Trial, Event | None]] = queue.SimpleQueue()
        self._running: dict[int, Trial] = {}
        self._no_more = False  # stop() was asked: start nothing new
        sweep._stop = self._ask_stop

    def run(self) -> None:
        """The loop, until every trial has ended; an interrupt stops them all and raises."""
        sweep = self._sweep
        try:
            while True:
                self._fill_slots()
                if not self._running:
                    break
                self._take(self._next_event())
        except BaseException as error:
            self._stop_all("cancelled" if isinstance(error, KeyboardInterrupt) else "stopped")
            sweep.error = error
            raise
        finally:
            for trial in sweep.trials:
                if trial.state == "pending":
                    trial.state = "cancelled"  # never started: the sweep ended first
            sweep._done.set()
            try:
                self._watch(sweep)
            finally:
                sweep._shown.set()

    # ----- starting ---------------------------------------------------------------
    def _fill_slots(self) -> None:
        while not self._no_more:
            slot = self._packer.take()
            if slot is None:
                return
            trial = self._next_trial()
            if trial is None:
                self._packer.give(slot)
                return
            self._start(trial, slot)

    def _next_trial(self) -> Trial | None:
        sweep = self._sweep
        pending = [trial for trial in sweep.trials if trial.state == "pending"]
        if pending:
            return pending[0]
        asked = self._configs.next_config()
        if asked is None:
            return None
        config, optuna_trial = asked
        trial = Trial(len(sweep.trials), config, optuna_trial=optuna_trial)
        with sweep._lock:
            sweep.trials.append(trial)
        return trial

    def _start(self, trial: Trial, slot: Slot) -> None:
        options = dict(self._options)
        if options.get("checkpoint_dir"):  # each trial resumes from its own checkpoints
            place = str(options["checkpoint_dir"]).rstrip("/")
            options["checkpoint_dir"] = f"{place}/{self._sweep.sweep_id}/trial-{trial.number}"
        if slot.gpu_ids is not None:
            options["gpu_ids"] = slot.gpu_ids
        else:
            options["use_cpu"] = True
        # The cores shared out among every trial running at once, not each trial's alone:
        # two 1-process trials on 2 cores with 2 threads each ran 10-20x slower.
        busy = self._packer.capacity * self._packer.per_trial
        options.setdefault("threads_per_process", max(1, usable_cpu_cores() // busy))
        trial.slot, trial.state, trial.started = slot, "running", time.monotonic()
        self._running[trial.number] = trial

        def show(run: Run, gpus: int) -> None:
            trial.run, trial.run_dir = run, str(run.run_dir)
            run.subscribe(lambda event: self._post(trial, event))

        try:
            with hidden_frames():
                start(self._train, (trial.config,), None, None, None, options, show=show)
        except Exception as error:  # noqa: BLE001 - a trial that cannot start fails alone
            self._end(trial, "failed", f"{type(error).__name__}: {error}")
            return
        self._watch(self._sweep)

    # ----- following --------------------------------------------------------------
    def _post(self, trial: Trial, event: Event) -> None:
        """A trial's run subscriber (its pump thread): only what the loop needs."""
        run = trial.run
        if isinstance(event, RunEnded) or (
            isinstance(event, Metric) and run is not None and event.rank == run.ranks[0]
        ):
            self._events.put((trial, event))

    def _next_event(self) -> tuple[Trial, Event | None]:
        """The next trial event; at a trial's deadline, that trial with None."""
        deadline = self._next_deadline()
        while True:
            wait = None if deadline is None else max(0.0, deadline[0] - time.monotonic())
            try:
                # A bounded wait even without a deadline: an interrupt reaches this thread
                # between waits (a blocking get would not wake for it).
                return self._events.get(timeout=min(wait, 0.5) if wait is not None else 0.5)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline[0]:
                    return deadline[1], None

    def _next_deadline(self) -> tuple[float, Trial] | None:
        if self._timeout is None:
            return None
        due = [
            (trial.started + self._timeout, trial)
            for trial in self._running.values()
            if trial.started is not None and not trial.ending
        ]
        return min(due, key=lambda pair: pair[0]) if due else None

    def _take(self, item: tuple[Trial, Event | None]) -> None:
        trial, event = item
        if event is None:  # its deadline
            self._stop_trial(trial, "timed out")
            return
        if isinstance(event, Metric):
            with self._sweep._lock:  # the kernel may be reading the table meanwhile
                for name, value in event.values.items():
                    if isinstance(value, (int, float)):
                        trial.metrics.setdefault(name, []).append((event.step, float(value)))
            self._prune(trial, event)
            self._watch(self._sweep)
            return
        assert isinstance(event, RunEnded)
        state = _STATE_OF_RUN.get(event.state, "failed")
        if trial.ending and event.state is not RunState.SUCCEEDED:
            state = trial.ending  # it ended as asked (a trial that finished first succeeded)
        error = event.error
        first = str(error).splitlines()[0] if error is not None and str(error) else ""
        self._end(trial, state, f"{type(error).__name__}: {first}" if error else "")

    def _prune(self, trial: Trial, event: Metric) -> None:
        metric, optuna_trial = self._sweep.metric, trial.optuna_trial
        if optuna_trial is None or metric is None or trial.ending:
            return
        value = event.values.get(metric)
        if not isinstance(value, (int, float)):
            return
        optuna_trial.report(float(value), event.step)
        if optuna_trial.should_prune():
            self._stop_trial(trial, "pruned")

    def _end(self, trial: Trial, state: str, error: str = "") -> None:
        trial.state, trial.error, trial.ended = state, error, time.monotonic()
        self._running.pop(trial.number, None)
        if trial.slot is not None:
            self._packer.give(trial.slot)
        metric = self._sweep.metric
        value = trial.last(metric) if metric is not None else None
        self._configs.tell(trial.optuna_trial, state, value)
        self._watch(self._sweep)

    # ----- stopping ---------------------------------------------------------------
    def _stop_trial(self, trial: Trial, why: str) -> None:
        """Ask a running trial to stop; its end comes as an event and says ``why``."""
        if trial.ending or trial.run is None:
            return
        trial.ending = why
        _ask_stop_run(trial.run)

    def _ask_stop(self, number: int | None) -> None:
        """``sweep.stop()`` / ``sweep.stop_trial(n)``, from any thread."""
        if number is None:
            self._no_more = True
        for trial in list(self._running.values()):
            if number is None or trial.number == number:
                self._stop_trial(trial, "stopped")

    def _stop_all(self, why: str) -> None:
        """Every running trial stopped, and waited for (bounded): an interrupt's end."""
        self._no_more = True
        running = list(self._running.values())
        for trial in running:
            trial.ending = trial.ending or why
            if trial.run is not None:
                _ask_stop_run(trial.run)
        deadline = time.monotonic() + STOP_WAIT
        for trial in running:
            if trial.run is not None:
                try:
                    trial.run._await_end(max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    pass
            trial.state, trial.ended = trial.ending, time.monotonic()
            if trial.slot is not None:
                self._packer.give(trial.slot)
            self._configs.tell(trial.optuna_trial, trial.state, None)  # not left RUNNING
        self._running.clear()


def _ask_stop_run(run: Run) -> None:
    try:
        run.stop(timeout=0.0)  # asked now; its end comes through the run's events
    except TimeoutError:
        pass
