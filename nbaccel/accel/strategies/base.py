"""``Strategy``: how one backend distributes training, and the one-process default.

A strategy owns everything that differs between backends — wrapping models and
optimizers, suspending gradient sync, the backward pass, clipping, collectives, full state
dicts and the checkpoint layout — so the ``Accelerator`` facade never asks which backend it
runs on. This base class is the single-device strategy; the others override what differs:

    Strategy (one process)  <- DataParallel (DDP)  <- ZeroOne (DDP + ZeRO-1 optimizer)
                                                    <- FullySharded (FSDP2)
                                                    <- DeepSpeed
    XlaDataParallel (torch_xla replicas)  <- XlaSpmd (FSDPv2 over one process's devices)

``nbaccel.accel.strategies.start`` picks one, once, from the resolved config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from nbaccel.accel.checkpoints import weight_files
from nbaccel.accel.checkpoints.checkpoint import DeviceHooks
from nbaccel.accel.nested import collectives
from nbaccel.accel.precision import Precision
from nbaccel.accel.state import DistributedType, ProcessState
from nbaccel.accel.strategies import models
from nbaccel.accel.tracking.step_timing import StepTimer
from nbaccel.config.accelerator_options import AcceleratorOptions
from nbaccel.config.schema import Config
from nbaccel.context import active_session
from nbaccel.metrics import report_step_breakdown

# {id(original parameter): the parameter that replaced it} (FSDP shards in place).
ParameterSwap = dict[int, torch.nn.Parameter]
Batches = Iterator[Any]


class Strategy:
    """One process on one device: no wrapping, no communication.

    >>> import torch
    >>> from nbaccel.config.schema import Config
    >>> state = ProcessState(0, 0, 1, 1, torch.device("cpu"), DistributedType.NO, "")
    >>> strategy = Strategy(state, Config())
    >>> strategy.name, strategy.gather(torch.ones(2)).tolist(), strategy.checkpoint_layout
    ('single', [1.0, 1.0], 'plain')
    """

    name = "single"

    def __init__(
        self, state: ProcessState, config: Config, options: AcceleratorOptions | None = None
    ) -> None:
        self.state = state
        self.config = config
        # The Accelerator's keywords that are no config field (DDP's, the compiler's, ...).
        self.options = options if options is not None else AcceleratorOptions(config, {})
        # The step-time breakdown: on in launched workers; the prepared loaders, optimizers
        # and the backward mark their phases into it. Not on XLA devices, whose lazy tensors
        # run at the graph cut: host-side laps would time the tracing, not the step.
        self.step_timer = StepTimer(
            enabled=active_session() is not None and state.device.type != "xla",
            send=report_step_breakdown,
            distributed=state.world_size > 1,
            device=state.device,
        )

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    # -- precision ------------------------------------------------------------------------
    def make_precision(self, mode: str, **options: Any) -> Precision:
        """The autocast and loss-scaling part for ``mode`` on this backend (``options``:
        ``scaler_kwargs`` and ``autocast_kwargs`` for ``Precision``)."""
        return Precision(mode, self.state.device, **options)

    # -- models and optimizers ------------------------------------------------------------
    def prepare_engine(
        self, objects: list[Any], kinds: list[str], **options: Any
    ) -> dict[int, Any]:
        """Backends that build one engine from the model, optimizer and scheduler together
        (DeepSpeed) do it here; returns {position: replacement}. Others replace nothing."""
        return {}

    def prepare_model(
        self,
        model: torch.nn.Module,
        precision: Precision,
        *,
        device_placement: bool,
        ddp_kwargs: dict[str, Any],
    ) -> tuple[torch.nn.Module, ParameterSwap]:
        """What the training loop calls, and the parameters that were replaced."""
        prepared = models.prepare_model(
            model,
            self.state,
            precision,
            device_placement=device_placement,
            compilation=models.Compilation.of(self.options),
        )
        return prepared, {}

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to wrap (ZeRO-1 replaces it with a sharded one)."""
        return optimizer

    def optimizer_hooks(self) -> dict[str, Any]:
        """Extra ``AcceleratedOptimizer`` arguments (XLA: gradient all-reduce, graph cut)."""
        return {}

    def unwrap_model(
        self, model: torch.nn.Module, keep_autocast: bool, keep_compile: bool
    ) -> torch.nn.Module:
        """The user's module, without the wrappers ``prepare_model`` added."""
        return models.unwrap_model(model, keep_autocast=keep_autocast, keep_compile=keep_compile)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Suspend ``model``'s gradient reduction (nothing to suspend on one process)."""
        suspended: contextlib.AbstractContextManager[Any] = models.no_sync(model)
        return suspended

    # -- the step ---------------------------------------------------------------------------
    def backward(
        self,
        loss: torch.Tensor,
        *,
        accumulation_steps: int,
        scaler: torch.amp.GradScaler | None,
        sync_gradients: bool,
        **kwargs: Any,
    ) -> None:
        """``loss.backward()``, divided over the accumulation steps and scaled for fp16."""
        if accumulation_steps > 1:
            loss = loss / accumulation_steps
        if scaler is not None:
            loss = scaler.scale(loss)
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]

    def clip_grad_norm_(
        self, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor | None:
        """Clip the (already reduced and unscaled) gradients; returns their total norm."""
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
        # Sharded gradients are DTensors and so is their norm; callers log a plain tensor.
        full = getattr(norm, "full_tensor", None)
        return full() if full is not None else norm

    @property
    def clips_in_engine(self) -> bool:
        """True when the backend clips by its own config (DeepSpeed's gradient_clipping)."""
        return False

    # -- data -------------------------------------------------------------------------------
    def device_stream(self) -> Callable[[Batches], Batches] | None:
        """A generator moving batches to the device in the background, if the backend has
        one (torch_xla's loader); None: the prepared loader moves each batch itself."""
        return None

    # -- collectives ------------------------------------------------------------------------
    def gather(self, data: Any) -> Any:
        """Every rank's tensors concatenated along dim 0."""
        return collectives.gather(data)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object in rank order; lists are concatenated."""
        return collectives.gather_object(obj)

    def reduce(self, data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum or average tensors over ranks."""
        return collectives.reduce(data, reduction, scale)

    def pad_across_processes(self, data: Any, dim: int, pad_index: int, first: bool) -> Any:
        """Pad tensors along ``dim`` to the largest size on any rank."""
        return collectives.pad_across_processes(data, dim, pad_index, first)

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for on one process)."""

    def share(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (one process: the value)."""
        return value

    # -- state dicts and checkpoints ---------------------------------------------------------
    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights as plain tensors (every rank must call it under
        sharding; the sharded strategies return them on every rank)."""
        inner = self.unwrap_model(model, keep_autocast=True, keep_compile=False)
        return dict(inner.state_dict())

    def weights_to_save(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What ``save_model`` writes from rank 0 (every rank must call it)."""
        return self.full_state_dict(model)

    def save_model(
        self,
        model: torch.nn.Module,
        directory: Path,
        is_main: bool,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the consolidated weights under ``directory`` (rank 0), in one file or
        shards (``weight_files``)."""
        weights = self.weights_to_save(model)
        if is_main:
            weight_files.write_weights(weights, directory, max_shard_size, safe_serialization)

    @property
    def checkpoint_layout(self) -> str:
        """How ``save_state`` stores model and optimizer: ``plain`` (torch.save of whole
        tensors), ``sharded`` / ``full`` (torch.distributed.checkpoint), ``deepspeed``."""
        if self.config.strategy == "fsdp":
            # FSDP on one process keeps FSDP's layout, so its checkpoints load onto N ranks.
            sharded = self.config.fsdp.state_dict_type == "SHARDED_STATE_DICT"
            return "sharded" if sharded else "full"
        return "plain"

    def checkpoint_hooks(self) -> DeviceHooks | None:
        """Device-specific copies, barriers and RNG for checkpoints (XLA); None: torch's."""
        return None

    @property
    def engine(self) -> Any:
        """The backend's own engine module, which prepare() returns for the model (DeepSpeed)."""
        return None

    @property
    def checkpoint_engine(self) -> Any:
        """What saves and loads the engine with its own checkpoint code (DeepSpeed's run)."""
        return None

    def before_save(self) -> None:
        """Make every pending value real before weights are copied (XLA's graph)."""
