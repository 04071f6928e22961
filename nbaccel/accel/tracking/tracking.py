"""``Tracking``: the Accelerator's experiment-tracking and profiling part (``init_trackers``,
``log``, ``get_tracker``, ``end_training``, ``profile``).

``log`` feeds the launcher's metrics stream (``run.metrics``, the live curve) and the
trackers chosen with ``log_with``, from the main process only, as in Accelerate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbaccel.accel.state import ProcessState
from nbaccel.accel.tracking import profiling, tracker_lookup
from nbaccel.accel.tracking.trackers import Tracker, start_trackers
from nbaccel.config.schema import Config
from nbaccel.metrics import log_metrics


class Tracking:
    """The trackers of one Accelerator (started on the main process only)."""

    def __init__(
        self,
        config: Config,
        state: ProcessState,
        barrier: Callable[[], None],
        profile_handler: Any = None,
    ) -> None:
        self.config = config
        self.state = state
        self.barrier = barrier
        self.profile_handler = profile_handler  # the ProfileKwargs of kwargs_handlers
        self.trackers: list[Tracker] = []

    @property
    def project_dir(self) -> Path:
        """Where trackers write: ``project_dir`` from the config, else the run's folder."""
        return Path(self.config.project_dir or self.state.run_dir or ".")

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the ``log_with`` trackers (main process) under ``project_dir``; ``config``
        is stored as the run's hyperparameters, ``init_kwargs`` go to each library by name."""
        if self.state.is_main_process:
            self.trackers = start_trackers(
                self.config.log_with, project_name, self.project_dir, config, init_kwargs
            )

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Record scalars from the main process: ``run.metrics``, the live curve, trackers."""
        if not self.state.is_main_process:
            return
        record = log_metrics(values, step=step)
        step_value = record.pop("step")
        for tracker in self.trackers:
            extra = (log_kwargs or {}).get(tracker.name)
            if extra:  # Accelerate's per-tracker keywords; a tracker that takes none says so
                tracker.log(record, step_value, **extra)
            else:
                tracker.log(record, step_value)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its library's object with ``unwrap=True``);
        a tracker that does nothing on the other ranks."""
        return tracker_lookup.get_tracker(self.trackers, name, unwrap)

    def end_training(self) -> None:
        """Flush and close the trackers; call at the end of training."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.barrier()

    def profile(self, profile_handler: Any = None) -> contextlib.AbstractContextManager[Any]:
        """``torch.profiler`` around the block, set by ``ProfileKwargs``; with
        ``output_trace_dir`` each rank writes ``profile_<rank>.json`` there."""
        return profiling.profile(
            profile_handler or self.profile_handler,
            process_index=self.state.rank,
            wait_for_everyone=self.barrier,
        )
