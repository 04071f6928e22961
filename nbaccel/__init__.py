"""nbaccel: launch distributed PyTorch training from a Jupyter cell.

Importing nbaccel never imports torch: the kernel stays free of CUDA and torch state, and
only the worker processes load torch.

>>> import nbaccel
>>> def world_size():
...     import torch.distributed as dist
...     return dist.get_world_size()
>>> nbaccel.notebook_launcher(world_size, num_processes=2)
2
"""

from typing import TYPE_CHECKING, Any

from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext, active_session
from nbaccel.errors import (
    CollectiveTimeout,
    ConfigError,
    HelperError,
    RemoteTraceback,
    RunCancelled,
    SerializationError,
    WorkerError,
)
from nbaccel.events import RunState
from nbaccel.launcher.run import Run
from nbaccel.launching import launch, notebook_launcher
from nbaccel.metrics import log_metrics

if TYPE_CHECKING:  # the worker-side API; loaded on first use so the kernel never imports torch
    from nbaccel.accel import Accelerator, DistributedType
    from nbaccel.ui.config_panel import ConfigPanel  # ipywidgets: loaded on first use too

# The worker-side names (they import torch), by the module that defines each: loaded on
# first use, so ``import nbaccel`` in the kernel stays torch-free.
_WORKER_SIDE = {
    "Accelerator": "nbaccel.accel",
    "DistributedType": "nbaccel.accel",
}


def __getattr__(name: str) -> Any:
    if name in _WORKER_SIDE:
        import importlib

        return getattr(importlib.import_module(_WORKER_SIDE[name]), name)
    if name == "ConfigPanel":
        import nbaccel.ui.config_panel

        return nbaccel.ui.config_panel.ConfigPanel
    raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")


__all__ = [
    "Accelerator",
    "CollectiveTimeout",
    "Config",
    "ConfigError",
    "ConfigPanel",
    "DistributedType",
    "HelperError",
    "ProcessContext",
    "RemoteTraceback",
    "Run",
    "RunCancelled",
    "RunState",
    "SerializationError",
    "WorkerError",
    "active_session",
    "launch",
    "log_metrics",
    "notebook_launcher",
    "resolve",
]
__version__ = "0.1.0"
