"""``Accelerator``: the training-loop API of Hugging Face Accelerate, run by nbaccel.

A facade over parts, each in its own module: the ``Strategy`` of the backend
(``strategies/``: single device, DDP, ZeRO-1, FSDP2, DeepSpeed, XLA, XLA SPMD) chosen once
from the resolved config, ``Precision`` (autocast and the loss scaler), ``GradientState``
(accumulation), ``Prepared`` (what ``prepare`` made), ``Checkpoints`` and ``Tracking``.
Settings come from the launch that started this worker
(``notebook_launcher(..., mixed_precision="bf16")``); explicit arguments win. Outside nbaccel
(torchrun, a plain script) they come from ``NBACCEL_*`` / ``ACCELERATE_*`` environment
variables and the default config file, as in ``nbaccel.config.resolve``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from nbaccel.accel import collectives, strategies
from nbaccel.accel.checkpointing import Checkpoints, LoadHook, SaveHook
from nbaccel.accel.optim import AcceleratedOptimizer, GradientState
from nbaccel.accel.preparation import Prepared
from nbaccel.accel.state import DistributedType, ProcessState, launch_config
from nbaccel.accel.tracking import Tracking
from nbaccel.config.schema import Config

F = TypeVar("F", bound=Callable[..., Any])


class Accelerator:
    """Runs one training loop correctly on 1 process, N CPU processes or N GPUs.

    >>> import torch
    >>> acc = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> model, opt = acc.prepare(model, opt)
    >>> for _ in range(2):
    ...     with acc.accumulate(model):
    ...         loss = model(torch.ones(8, 4)).pow(2).mean()
    ...         acc.backward(loss)
    ...         opt.step(); opt.zero_grad()
    >>> acc.step, acc.sync_gradients, acc.num_processes, str(acc.device)
    (2, True, 1, 'cpu')
    """

    def __init__(
        self,
        *,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool | None = None,
        log_with: str | list[str] | tuple[str, ...] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        dynamo_backend: str | None = None,
        device_placement: bool = True,
        split_batches: bool = False,
        even_batches: bool = True,
        step_scheduler_with_optimizer: bool = True,
        ddp_kwargs: dict[str, Any] | None = None,
        gradient_accumulation_plugin: Any = None,
        config: Config | None = None,
    ) -> None:
        explicit = {
            "mixed_precision": mixed_precision,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "use_cpu": cpu,
            "log_with": (log_with,) if isinstance(log_with, str) else log_with,
            "project_dir": os.fspath(project_dir) if project_dir is not None else None,
            "dynamo_backend": dynamo_backend,
        }
        if gradient_accumulation_plugin is not None:  # Accelerate's, read by its fields
            explicit["gradient_accumulation_steps"] = gradient_accumulation_plugin.num_steps
            explicit["sync_each_batch"] = gradient_accumulation_plugin.sync_each_batch
        # Validated here (ConfigError naming the choices) before any state is touched.
        self.config = launch_config(config).replace(
            **{k: v for k, v in explicit.items() if v is not None}
        )
        self.strategy = strategies.start(self.config)
        self.state: ProcessState = self.strategy.state
        self.gradients = GradientState(accumulation_steps=self.config.gradient_accumulation_steps)
        self.device_placement = device_placement
        self._prepared = Prepared(
            self.strategy,
            self.strategy.make_precision(self.config.mixed_precision),
            self.gradients,
            split_batches=split_batches,
            even_batches=even_batches,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            ddp_kwargs=dict(ddp_kwargs or {}),
            clip=self._config_clip if self.config.max_grad_norm is not None else None,
        )
        self._checkpoints = Checkpoints(self._prepared, self.gradients)
        self._tracking = Tracking(self.config, self.state, self.wait_for_everyone)
        self._trigger = False  # set_trigger / check_trigger

    # -- who and where -------------------------------------------------------------------
    device = property(lambda self: self.state.device)
    process_index = property(lambda self: self.state.rank)
    local_process_index = property(lambda self: self.state.local_rank)
    num_processes = property(lambda self: self.state.world_size)
    is_main_process = property(lambda self: self.state.is_main_process)
    is_local_main_process = property(lambda self: self.state.is_local_main_process)
    use_distributed = property(lambda self: self.state.use_distributed)
    mixed_precision = property(lambda self: self._prepared.precision.mode)
    precision = property(lambda self: self._prepared.precision)
    scaler = property(lambda self: self._prepared.precision.scaler)
    gradient_accumulation_steps = property(lambda self: self.gradients.accumulation_steps)
    sync_gradients = property(lambda self: self.gradients.sync_gradients)
    split_batches = property(lambda self: self._prepared.split_batches)
    even_batches = property(lambda self: self._prepared.even_batches)
    step_scheduler_with_optimizer = property(
        lambda self: self._prepared.step_scheduler_with_optimizer
    )
    trackers = property(lambda self: self._tracking.trackers)

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def is_fsdp2(self) -> bool:
        """True under FSDP: nbaccel's FSDP is always FSDP2 (``fully_shard``)."""
        return self.distributed_type is DistributedType.FSDP

    @property
    def multi_device(self) -> bool:
        """True with several GPUs (Accelerate's meaning: not for several CPU processes)."""
        return self.use_distributed and self.distributed_type is DistributedType.MULTI_GPU

    @property
    def step(self) -> int:
        """``accumulate()`` calls so far (micro-steps); restored by ``load_state``."""
        return self._checkpoints.step

    @step.setter
    def step(self, value: int) -> None:
        self._checkpoints.step = value

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last step was skipped for inf/NaN fp16 gradients."""
        return any(opt.step_was_skipped for opt in self._prepared.optimizers)

    # -- prepare ---------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Wrap models, optimizers, schedulers and dataloaders, in any order and number.

        Returns them in the order given (one object alone when one was passed).
        """
        placement = device_placement or [self.device_placement] * len(objects)
        result = self._prepared.prepare(objects, placement)
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """Prepare one model; ``evaluation_mode`` only places it, adds autocast and compiles
        (no DDP or sharding: for inference)."""
        placement = self.device_placement if device_placement is None else device_placement
        return self._prepared.model(model, placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: Any, device_placement: bool | None = None) -> Any:
        """Prepare one optimizer (after its model)."""
        return self._prepared.optimizer(optimizer, self.device_placement)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Prepare one learning-rate scheduler (after its optimizer)."""
        return self._prepared.scheduler(scheduler, self.device_placement)

    def prepare_data_loader(
        self,
        data_loader: Any,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        """Prepare one dataloader: this rank's shard, batches on the device."""
        if slice_fn_for_dispatch is not None:
            raise NotImplementedError(
                "slice_fn_for_dispatch applies to dispatch_batches=True, where rank 0 reads "
                "every batch and sends slices; nbaccel shards the sampler instead (each rank "
                "reads its own samples). Leave slice_fn_for_dispatch unset."
            )
        placement = self.device_placement if device_placement is None else device_placement
        return self._prepared.dataloader(data_loader, placement)

    # -- the step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled for fp16."""
        self.strategy.backward(
            loss,
            accumulation_steps=self.gradients.accumulation_steps,
            scaler=self.scaler,
            sync_gradients=self.sync_gradients,
            **kwargs,
        )

    @contextlib.contextmanager
    def accumulate(self, *models_: torch.nn.Module) -> Iterator[None]:
        """One micro-step: gradients sync (and the optimizer steps) every k-th call.

        On the other calls the gradient reduction of DDP or FSDP is suspended (unless
        ``sync_each_batch``) and ``step`` / ``zero_grad`` of prepared optimizers do nothing.
        The last batch of a prepared dataloader always syncs, so an epoch never ends with
        gradients left over.
        """
        self.step += 1
        grads = self.gradients
        grads.micro_steps_in_cycle += 1
        grads.sync_gradients = (
            grads.micro_steps_in_cycle >= grads.accumulation_steps or grads.end_of_dataloader
        )
        if grads.sync_gradients:  # the next epoch (or cycle) starts a fresh count
            grads.micro_steps_in_cycle = 0
        with contextlib.ExitStack() as stack:
            if not grads.sync_gradients and not self.config.sync_each_batch:
                for model in models_:
                    stack.enter_context(self.strategy.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Suspend the gradient reduction of a DDP or FSDP model (a no-op on one process)."""
        return self.strategy.no_sync(model)

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager[None]:
        """Autocast for the configured precision, for code outside the model's forward."""
        return self._prepared.precision.autocast(enabled)

    def unscale_gradients(self) -> None:
        """Unscale the fp16 gradients of every prepared optimizer (once per step)."""
        for optimizer in self._prepared.optimizers:
            optimizer.unscale_gradients()

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Unscale, then clip the gradients' total norm; None while accumulating."""
        if not self.sync_gradients:
            return None  # clipping a partial sum is meaningless (and would unscale twice)
        if not self.strategy.clips_in_engine:
            self._reduce_and_unscale()
        return self.strategy.clip_grad_norm_(list(parameters), max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale, then clamp each gradient to ``[-clip_value, clip_value]``."""
        if not self.sync_gradients:
            return
        self._reduce_and_unscale()
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    def _reduce_and_unscale(self) -> None:
        # XLA replicas all-reduce before clipping, so every replica clips the same sum.
        for optimizer in self._prepared.optimizers:
            optimizer.reduce_gradients()
        self.unscale_gradients()
        for optimizer in self._prepared.optimizers:
            optimizer.clipped = True

    def _config_clip(self, optimizer: AcceleratedOptimizer) -> None:
        # max_grad_norm from the config: clipped inside each optimizer step.
        optimizer.reduce_gradients()
        optimizer.unscale_gradients()
        assert self.config.max_grad_norm is not None
        torch.nn.utils.clip_grad_norm_(list(optimizer.parameters()), self.config.max_grad_norm)

    # -- across processes ------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Every rank's tensors concatenated along dim 0."""
        return self.strategy.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Like ``gather``, minus the samples repeated to even out the last batch."""
        as_objects = use_gather_object or not collectives.holds_tensors(input_data)
        data = self.strategy.gather_object(input_data) if as_objects else self.gather(input_data)
        if self.gradients.end_of_dataloader and self.gradients.remainder >= 0:
            # Gathered objects are one list (cut the list); tensors are cut row-wise.
            keep = self.gradients.remainder
            data = data[:keep] if as_objects else collectives.truncate(data, keep)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum or average tensors over ranks."""
        return self.strategy.reduce(tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors along ``dim`` to the largest size on any rank."""
        return self.strategy.pad_across_processes(tensor, dim, pad_index, pad_first)

    def wait_for_everyone(self) -> None:
        """A barrier across all processes."""
        self.strategy.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. downloads), then the others."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    def on_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on rank 0 only (None elsewhere)."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_main_process else None

        return wrapper  # type: ignore[return-value]

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # -- models and checkpoints ------------------------------------------------------------
    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> Any:
        """The user's module without DDP; without torch.compile and the autocast forward too
        when asked (Accelerate's defaults keep both, so training goes on unchanged)."""
        return self.strategy.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike[str]) -> None:
        """Write the consolidated weights to ``save_directory/model.safetensors`` (rank 0)."""
        self.strategy.before_save()
        self.strategy.save_model(model, Path(save_directory), self.is_main_process)
        self.wait_for_everyone()

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in save/load_state."""
        self._checkpoints.register(objects)

    def register_save_state_pre_hook(self, hook: SaveHook) -> Any:
        """Call ``hook(models, weights, output_dir)`` before each ``save_state``."""
        self._checkpoints.save_hooks.append(hook)
        return _Removable(self._checkpoints.save_hooks, hook)

    def register_load_state_pre_hook(self, hook: LoadHook) -> Any:
        """Call ``hook(models, input_dir)`` before each ``load_state``."""
        self._checkpoints.load_hooks.append(hook)
        return _Removable(self._checkpoints.load_hooks, hook)

    def save_state(self, output_dir: str | os.PathLike[str]) -> Path:
        """Save the whole training state atomically; every process must call it."""
        return self._checkpoints.save(output_dir)

    def load_state(self, input_dir: str | os.PathLike[str]) -> None:
        """Restore what ``save_state`` wrote, so training continues exactly."""
        self._checkpoints.load(input_dir)

    # -- trackers ----------------------------------------------------------------------------
    @property
    def project_dir(self) -> Path:
        """Where trackers write: ``project_dir`` from the config, else the run's folder."""
        return self._tracking.project_dir

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the ``log_with`` trackers (main process) under ``project_dir``."""
        self._tracking.start(project_name, config, init_kwargs)

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Record scalars from the main process: ``run.metrics``, the live curve, trackers."""
        self._tracking.log(values, step, log_kwargs or {})

    def end_training(self) -> None:
        """Flush and close the trackers; call at the end of training."""
        self._tracking.end()

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's whole state dict as plain tensors, gathered from the shards of FSDP
        or ZeRO-3 (every rank must call it then; rank 0 gets the weights, the others ``{}``).

        ``unwrap=False`` keeps the wrapper's keys (``module.`` under DDP) when unsharded.
        """
        self.strategy.before_save()
        if not unwrap and self.strategy.checkpoint_layout == "plain":
            return dict(model.state_dict())
        return self.strategy.full_state_dict(model)

    # -- triggers: one rank asks every rank to act (e.g. stop early) -----------------------
    def set_trigger(self) -> None:
        """Raise this rank's flag; ``check_trigger`` on every rank then returns True."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every rank if any rank called ``set_trigger`` since the last check (a
        collective: call it on every rank); resets the flag."""
        raised = torch.tensor(float(self._trigger), device=self.device)
        self._trigger = False
        return bool(self.reduce(raised, "sum").item() >= 1)

    # -- memory ----------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[None]:
        """Forget everything prepared, collect garbage and empty the CUDA cache.

        Call between two trainings in one process; returns ``None`` for each object passed,
        so ``model, opt = acc.free_memory(model, opt)`` drops the caller's references too.
        """
        self._prepared.forget()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return [None for _ in objects]

    clear = free_memory


class _Removable:
    """What ``register_*_pre_hook`` returns: ``.remove()`` takes the hook out again."""

    def __init__(self, hooks: list[Any], hook: Any) -> None:
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


__all__ = ["Accelerator"]
