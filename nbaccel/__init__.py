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

import os as _os
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from nbaccel import lazy_names as _lazy_names
from nbaccel.errors import (
    CollectiveTimeout,
    ConfigError,
    DebuggerQuit,
    HelperError,
    RemoteTraceback,
    RunCancelled,
    SerializationError,
    WorkerError,
    WorkersEnded,
)
from nbaccel.launcher.prewarm import prewarm as _prewarm
from nbaccel.ui.kernel import in_kernel as _in_kernel

if _TYPE_CHECKING:  # every name of __getattr__'s table, for type checkers
    from nbaccel.accel import Accelerator
    from nbaccel.accel.autosave.save_due import save_due
    from nbaccel.accel.data.skip_batches import skip_first_batches
    from nbaccel.accel.partial_state import AcceleratorState, PartialState
    from nbaccel.accel.refusals import (
        ParallelismConfig,
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
        infer_auto_device_map,
        load_checkpoint_and_dispatch,
        load_checkpoint_in_model,
        prepare_pippy,
    )
    from nbaccel.config.accelerate.configs import DataLoaderConfiguration
    from nbaccel.config.accelerate.enums import DistributedType
    from nbaccel.config.accelerate.kwargs_handlers import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    from nbaccel.config.accelerate.plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from nbaccel.config.resolve import resolve
    from nbaccel.config.schema import Config
    from nbaccel.context import ProcessContext, active_session
    from nbaccel.detached_runs import attach, runs
    from nbaccel.events import RunState
    from nbaccel.interactive import Workers, last_workers
    from nbaccel.interactive.model_loading import load_into
    from nbaccel.launcher.run import Run
    from nbaccel.launching import debug_launcher, launch, notebook_launcher
    from nbaccel.metrics import log_metrics
    from nbaccel.sweeps import Sweep, sweep
    from nbaccel.ui.panel.config_panel import ConfigPanel  # ipywidgets: loaded on first use too
    from nbaccel.utils.availability import is_rich_available
    from nbaccel.utils.memory import find_executable_batch_size
    from nbaccel.utils.modeling import init_empty_weights, init_on_device
    from nbaccel.utils.random import synchronize_rng_states

# Every public name but the errors, by the module that defines it, loaded on first use
# (PEP 562): ``import nbaccel`` in the kernel stays torch-free. The worker-side ones import
# torch: ``from nbaccel import Accelerator`` in a kernel gives a stand-in that loads it when
# used (lazy_names.py), and the real class wherever torch is loaded already (workers).
# Accelerate's top-level config objects are torch-free, loaded so all the same.
_LAZY = {
    "Config": "nbaccel.config.schema",
    "ConfigPanel": "nbaccel.ui.panel.config_panel",  # ipywidgets
    "ProcessContext": "nbaccel.context",
    "Run": "nbaccel.launcher.run",
    "Workers": "nbaccel.interactive",
    "last_workers": "nbaccel.interactive",
    "load_into": "nbaccel.interactive.model_loading",
    "sweep": "nbaccel.sweeps",
    "Sweep": "nbaccel.sweeps",
    "RunState": "nbaccel.events",
    "active_session": "nbaccel.context",
    "attach": "nbaccel.detached_runs",
    "debug_launcher": "nbaccel.launching",
    "launch": "nbaccel.launching",
    "log_metrics": "nbaccel.metrics",
    "save_due": "nbaccel.accel.autosave.save_due",
    "notebook_launcher": "nbaccel.launching",
    "resolve": "nbaccel.config.resolve",
    "runs": "nbaccel.detached_runs",
    "Accelerator": "nbaccel.accel",
    "AutocastKwargs": "nbaccel.config.accelerate.kwargs_handlers",
    "DDPCommunicationHookType": "nbaccel.config.accelerate.kwargs_handlers",
    "DataLoaderConfiguration": "nbaccel.config.accelerate.configs",
    "DeepSpeedPlugin": "nbaccel.config.accelerate.plugins",
    "DistributedDataParallelKwargs": "nbaccel.config.accelerate.kwargs_handlers",
    "FullyShardedDataParallelPlugin": "nbaccel.config.accelerate.plugins",
    "GradScalerKwargs": "nbaccel.config.accelerate.kwargs_handlers",
    "InitProcessGroupKwargs": "nbaccel.config.accelerate.kwargs_handlers",
    "ProfileKwargs": "nbaccel.config.accelerate.kwargs_handlers",
    "DistributedType": "nbaccel.config.accelerate.enums",  # torch-free: the real enum
    "PartialState": "nbaccel.accel.partial_state",
    "AcceleratorState": "nbaccel.accel.partial_state",
    "skip_first_batches": "nbaccel.accel.data.skip_batches",
    "find_executable_batch_size": "nbaccel.utils.memory",
    "init_empty_weights": "nbaccel.utils.modeling",
    "init_on_device": "nbaccel.utils.modeling",
    "synchronize_rng_states": "nbaccel.utils.random",
    "is_rich_available": "nbaccel.utils.availability",
    # Refused by name: calling one raises NotImplementedError with the reason (accel/refusals.py).
    "ParallelismConfig": "nbaccel.accel.refusals",
    "prepare_pippy": "nbaccel.accel.refusals",
    "cpu_offload": "nbaccel.accel.refusals",
    "cpu_offload_with_hook": "nbaccel.accel.refusals",
    "disk_offload": "nbaccel.accel.refusals",
    "dispatch_model": "nbaccel.accel.refusals",
    "infer_auto_device_map": "nbaccel.accel.refusals",
    "load_checkpoint_and_dispatch": "nbaccel.accel.refusals",
    "load_checkpoint_in_model": "nbaccel.accel.refusals",
}


def load_ipython_extension(ipython: _Any) -> None:
    """``%load_ext nbaccel``: the ``%%nbaccel`` cell magic (docs/interactive.md) and the
    ``%nbaccel_debug`` line magic (docs/debugging.md)."""
    from nbaccel.interactive.magic import load_ipython_extension as load

    load(ipython)


def __getattr__(name: str) -> _Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")
    value = _lazy_names.load(_LAZY[name], name, package=__name__)
    if not isinstance(value, _lazy_names.StandIn):
        globals()[name] = value  # the real object: the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    # Tab completion in a notebook lists the names not loaded yet too.
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Accelerator",
    "AcceleratorState",
    "AutocastKwargs",
    "CollectiveTimeout",
    "Config",
    "ConfigError",
    "ConfigPanel",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DebuggerQuit",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "HelperError",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "ProcessContext",
    "ProfileKwargs",
    "RemoteTraceback",
    "Run",
    "RunCancelled",
    "RunState",
    "SerializationError",
    "Sweep",
    "WorkerError",
    "Workers",
    "WorkersEnded",
    "active_session",
    "attach",
    "cpu_offload",
    "cpu_offload_with_hook",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "is_rich_available",
    "last_workers",
    "launch",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "load_into",
    "log_metrics",
    "notebook_launcher",
    "prepare_pippy",
    "resolve",
    "runs",
    "save_due",
    "skip_first_batches",
    "sweep",
    "synchronize_rng_states",
]
__version__ = "0.1.0"

# In a Jupyter kernel, start the helper process now, in the background (NBACCEL_PREWARM=0:
# not at all; a script: never): it imports torch while the user writes the next cells, so
# the first launch costs what a later one does. Then load the launch path, off the helper's
# way, since a launch is coming. Last in this file, so that every name above is defined
# when the launch path's modules import this package. Elsewhere names load on first use:
# the helper's and every worker's interpreter import this package first, and each module
# imported here would delay their ``import torch`` (~0.05-0.1 s for the launch path).
if _prewarm(_os.environ, in_kernel=_in_kernel()) is not None:
    import nbaccel.launching as _launch_path  # noqa: F401 - loaded now, used later
