"""A sweep's trials and what it gives back: ``Trial`` (one launch of ``train(config)``: its
config, devices, state, metrics and run) and ``Sweep`` (``.table``, ``.best``, ``.runs``).

Torch-free, as the kernel is: metrics are the numbers rank 0 logged, taken from each run's
events; a trial's return value is not unpickled unless asked (``trial.run.result()``).
"""

from __future__ import annotations

import importlib
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launcher.run import Run
from nbaccel.sweeps.packing import Slot

# A trial's states: waiting for a slot, then running, then one of the ends.
ENDED = ("succeeded", "failed", "pruned", "timed out", "stopped", "cancelled")


@dataclass
class Trial:
    """One trial: ``train(config)`` launched on its own devices, process group and folder."""

    number: int
    config: dict[str, Any]
    state: str = "pending"
    slot: Slot | None = None
    run: Run | None = None
    error: str = ""  # the first line of a failed trial's error
    started: float | None = None
    ended: float | None = None
    # name -> [(step, value)], as rank 0 logged them
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    optuna_trial: Any = None
    ending: str = ""  # what the sweep asked of a trial it stopped: "pruned", "timed out"...
    run_dir: str = ""  # its run folder (a detached sweep's trials have no Run here)

    @property
    def seconds(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.monotonic()) - self.started

    @property
    def step(self) -> int | None:
        """The last step rank 0 logged a metric at."""
        steps = [points[-1][0] for points in self.metrics.values() if points]
        return max(steps) if steps else None

    def last(self, name: str) -> float | None:
        points = self.metrics.get(name)
        return points[-1][1] if points else None

    def best_of(self, name: str, mode: str) -> float | None:
        values = [v for _, v in self.metrics.get(name, ()) if not math.isnan(v)]
        if not values:
            return None
        return min(values) if mode == "min" else max(values)


def new_sweep_id() -> str:
    """A sweep's id: when it started, and a few random hex digits (as run ids are)."""
    return time.strftime("sweep-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


SHOWN_WAIT = 15.0  # how long wait() waits, past the end, for the display's summary


class Sweep:
    """What ``nbaccel.sweep`` returns: its trials, as they go and once ended.

    ``table``: a pandas DataFrame, a row per trial (its config's keys as columns, the final
    and best value of each metric rank 0 logged, its state, seconds and run folder);
    ``best``: the best trial's config and metrics by ``metric`` and ``mode``; ``runs``: each
    started trial's ``Run``; ``wait()``, ``stop()``, ``stop_trial(number)``.
    """

    def __init__(
        self, trials: list[Trial], metric: str | None, mode: str, sweep_id: str = ""
    ) -> None:
        self.sweep_id = sweep_id or new_sweep_id()
        self.trials = trials
        self.metric = metric
        self.mode = mode
        self.study: Any = None
        self._done = threading.Event()
        self._shown = threading.Event()  # its display's last call returned: the summary is out
        self._lock = threading.Lock()  # trials change on the scheduler's thread
        self._stop: Callable[[int | None], None] = lambda number: None
        self.error: BaseException | None = None  # what ended the sweep early, if anything

    # ----- results ------------------------------------------------------------------
    @property
    def runs(self) -> list[Run]:
        """Every started trial's run, in trial order."""
        return [trial.run for trial in self.trials if trial.run is not None]

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def best(self) -> dict[str, Any] | None:
        """The best trial that succeeded, by ``metric`` (its last value) and ``mode``:
        ``{"trial", "config", "metrics", "run_dir"}``; None before one did. A pruned, stopped
        or failed trial is not ranked: its last value is not its result."""
        trial = self.best_trial()
        if trial is None:
            return None
        return {
            "trial": trial.number,
            "config": dict(trial.config),
            "metrics": {name: trial.last(name) for name in trial.metrics},
            "run_dir": trial.run_dir or None,
        }

    def best_trial(self) -> Trial | None:
        metric = self.metric
        if metric is None:
            return None
        scored = [
            (value, trial)
            for trial in self.trials
            if trial.state == "succeeded"
            and (value := trial.last(metric)) is not None
            and not math.isnan(value)  # a diverged trial is no best
        ]
        if not scored:
            return None
        pick = min if self.mode == "min" else max
        return pick(scored, key=lambda pair: pair[0])[1]

    def rows(self) -> list[dict[str, Any]]:
        """The table's rows as plain dicts (``table`` is these, as a DataFrame)."""
        names = sorted({name for trial in self.trials for name in trial.metrics})
        keys: list[str] = []
        for trial in self.trials:
            keys += [key for key in trial.config if key not in keys]
        rows = []
        for trial in self.trials:
            row: dict[str, Any] = {"trial": trial.number}
            row |= {key: trial.config.get(key) for key in keys}
            row["state"] = trial.state
            for name in names:
                row[name] = trial.last(name)
                row[f"best {name}"] = trial.best_of(name, self.mode)
            row["step"] = trial.step
            row["seconds"] = round(trial.seconds, 3) if trial.seconds is not None else None
            row["device"] = str(trial.slot) if trial.slot is not None else ""
            row["run_dir"] = trial.run_dir
            row["error"] = trial.error
            rows.append(row)
        return rows

    @property
    def table(self) -> Any:
        """A pandas DataFrame, a row per trial (see the class)."""
        try:
            pandas = importlib.import_module("pandas")  # untyped, so imported by name
        except ImportError:
            raise ImportError(
                "sweep.table is a pandas DataFrame, and pandas is not installed here: "
                "pip install pandas (sweep.rows() gives the same rows as dicts)."
            ) from None
        with self._lock:
            return pandas.DataFrame(self.rows()).set_index("trial")

    # ----- control ------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> Sweep:
        """Block until every trial has ended (a ``wait=False`` sweep), and its board has
        left its summary (a cell that waits keeps it in a saved notebook); the sweep."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the sweep still runs after {timeout} s")
        self._shown.wait(SHOWN_WAIT)  # bounded: a display that broke must not hold the cell
        return self

    def stop(self) -> None:
        """Stop every running trial and start no more (each trial ends ``stopped``)."""
        self._stop(None)

    def stop_trial(self, number: int) -> None:
        """Stop one running trial (it ends ``stopped``; its devices serve the next)."""
        self._stop(number)

    def __repr__(self) -> str:
        states: dict[str, int] = {}
        for trial in self.trials:
            states[trial.state] = states.get(trial.state, 0) + 1
        said = ", ".join(f"{count} {state}" for state, count in states.items())
        return f"<nbaccel.Sweep {len(self.trials)} trials: {said}>"
