"""``Tracking``: the Accelerator's experiment-tracking part (``init_trackers``, ``log``,
``get_tracker``, ``end_training``).

``log`` feeds the launcher's metrics stream (``run.metrics``, the live curve) and the
trackers chosen with ``log_with``, from the main process only, as in Accelerate.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbaccel.accel.state import ProcessState
from nbaccel.accel.trackers import Tracker, start_trackers
from nbaccel.config.schema import Config
from nbaccel.metrics import log_metrics


class Tracking:
    """The trackers of one Accelerator (started on the main process only)."""

    def __init__(self, config: Config, state: ProcessState, barrier: Callable[[], None]) -> None:
        self.config = config
        self.state = state
        self.barrier = barrier
        self.trackers: list[Tracker] = []

    @property
    def project_dir(self) -> Path:
        """Where trackers write: ``project_dir`` from the config, else the run's folder."""
        return Path(self.config.project_dir or self.state.run_dir or ".")

    def start(
        self,
        project_name: str,
        config: dict[str, Any] | None,
        init_kwargs: dict[str, dict[str, Any]] | None,
    ) -> None:
        if self.state.is_main_process:
            self.trackers = start_trackers(
                self.config.log_with, project_name, self.project_dir, config, init_kwargs
            )

    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, Any]) -> None:
        if not self.state.is_main_process:
            return
        record = log_metrics(values, step=step)
        step_value = record.pop("step")
        for tracker in self.trackers:
            extra = log_kwargs.get(tracker.name)
            if extra:  # Accelerate's per-tracker keywords; a tracker that takes none says so
                tracker.log(record, step_value, **extra)
            else:
                tracker.log(record, step_value)

    def end(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.barrier()
