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

from nbaccel.config import Config
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
from nbaccel.launcher.api import launch, notebook_launcher
from nbaccel.launcher.run import Run
from nbaccel.metrics import log_metrics
from nbaccel.resolve import resolve

__all__ = [
    "CollectiveTimeout",
    "Config",
    "ConfigError",
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
