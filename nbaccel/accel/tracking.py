"""The Accelerator's logging members: ``init_trackers``, ``log``, ``end_training``.

``log`` feeds the launcher's metrics stream (``run.metrics``, the live curve) and the
trackers chosen with ``log_with``, from the main process only, as in Accelerate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nbaccel.accel.coordination import ProcessCoordination
from nbaccel.accel.trackers import Tracker, start_trackers
from nbaccel.config.schema import Config
from nbaccel.metrics import log_metrics


class Tracking(ProcessCoordination):
    """Base of ``Accelerator`` holding its experiment-tracking methods."""

    config: Config
    trackers: list[Tracker]

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
        """Start the ``log_with`` trackers (main process) under ``project_dir``."""
        if self.is_main_process:
            self.trackers = start_trackers(
                self.config.log_with, project_name, self.project_dir, config, init_kwargs
            )

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Record scalars from the main process: ``run.metrics``, the live curve, trackers."""
        if not self.is_main_process:
            return
        record = log_metrics(values, step=step)
        step_value = record.pop("step")
        for tracker in self.trackers:
            tracker.log(record, step_value)

    def end_training(self) -> None:
        """Flush and close the trackers; call at the end of training."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.wait_for_everyone()
