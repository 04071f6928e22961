"""``Accelerator``: the training-loop API of Hugging Face Accelerate, run by nbaccel.

A facade over parts, each in its own module: the ``Strategy`` of the backend
(``strategies/``: single device, DDP, ZeRO-1, FSDP2, DeepSpeed, XLA, XLA SPMD) chosen once
from the resolved config; ``AcceleratorState`` (who this process is, and the process-level
members: ``split_between_processes``, ``on_process``, ...); ``Precision``;
``GradientState``; ``Prepared`` (what ``prepare`` made); ``Checkpoints``; ``Tracking``.
Accelerate's constructor arguments, plugins and kwargs handlers are applied to the launch's
config in one place (``nbaccel.config.accelerator_options``); members nbaccel does not offer
(tensor, context and pipeline parallelism, fp8, Megatron-LM) raise ``NotImplementedError``
naming the reason (``refusals``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from nbaccel.accel import (
    collectives,
    ddp_controls,
    device_map,
    lomo,
    profiling,
    saving,
    strategies,
    tracker_lookup,
)
from nbaccel.accel.checkpointing import Checkpoints, LoadHook, SaveHook
from nbaccel.accel.optim import AcceleratedOptimizer, GradientState
from nbaccel.accel.partial_state import AcceleratorState
from nbaccel.accel.preparation import Prepared
from nbaccel.accel.refusals import refuse_arguments, refuse_members
from nbaccel.accel.skip_batches import skip_first_batches
from nbaccel.accel.state import DistributedType, launch_config
from nbaccel.accel.tracking import Tracking
from nbaccel.accel.trigger import TriggerFlag
from nbaccel.config.accelerator_options import apply_accelerator_arguments
from nbaccel.config.kwargs_handlers import collect_handlers
from nbaccel.config.schema import Config


def _process_member(name: str) -> Any:
    """A member that ``AcceleratorState`` implements (same name, signature and docstring)."""
    member = getattr(AcceleratorState, name)
    if isinstance(member, property):
        return property(lambda self: getattr(self.state, name), doc=member.__doc__)

    @functools.wraps(member)
    def forward(self: Accelerator, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.state, name)(*args, **kwargs)

    return forward


def _option(path: str, doc: str) -> property:
    """A read-only view of one of the applied options (``options.dataloader.non_blocking``)."""
    return property(lambda self: functools.reduce(getattr, path.split("."), self), doc=doc)


@refuse_members
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
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool | None = None,
        dataloader_config: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: Sequence[Any] | None = None,
        log_with: str | Sequence[str] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: Any = None,
        gradient_accumulation_plugin: Any = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Sequence[Any] | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        *,
        even_batches: bool | None = None,
        ddp_kwargs: dict[str, Any] | None = None,
        config: Config | None = None,
    ) -> None:
        refuse_arguments(
            {
                "torch_tp_plugin": torch_tp_plugin,
                "megatron_lm_plugin": megatron_lm_plugin,
                "parallelism_config": parallelism_config,
            }
        )
        # Validated here (errors naming the field and the choices) before anything starts.
        self.options = apply_accelerator_arguments(
            launch_config(config),
            deepspeed_plugin=deepspeed_plugin,
            fsdp_plugin=fsdp_plugin,
            kwargs_handlers=kwargs_handlers,
            project_config=project_config,
            dataloader_config=dataloader_config,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            dynamo_plugin=dynamo_plugin,
            deepspeed_plugins=deepspeed_plugins,
            rng_types=rng_types,
            split_batches=split_batches,
            even_batches=even_batches,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            cpu=cpu,
            log_with=(log_with,) if isinstance(log_with, str) else log_with,
            project_dir=project_dir,
            dynamo_backend=dynamo_backend,
        )
        self.config = self.options.config
        self.handlers = collect_handlers(kwargs_handlers)  # validated above already
        self.strategy = strategies.start(self.config, self.options)
        self.state = AcceleratorState.of(
            self.strategy.state, strategy=self.strategy, config=self.config
        )
        self.gradient_state = GradientState(
            accumulation_steps=self.config.gradient_accumulation_steps
        )
        self.device_placement = device_placement
        precision = self.strategy.make_precision(
            self.config.mixed_precision,
            scaler_kwargs=self.options.grad_scaler_kwargs,
            autocast_kwargs=self.options.autocast_kwargs,
        )
        self._prepared = Prepared(
            self.strategy,
            precision,
            self.gradient_state,
            split_batches=self.options.dataloader.split_batches,
            even_batches=self.options.dataloader.even_batches,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            ddp_kwargs={**self.options.ddp_kwargs, **(ddp_kwargs or {})},
            clip=self._config_clip if self.config.max_grad_norm is not None else None,
        )
        self._checkpoints = Checkpoints(self._prepared, self.gradient_state, self.options.project)
        self._tracking = Tracking(self.config, self.strategy.state, self.wait_for_everyone)
        self._trigger = TriggerFlag(self.device, self.reduce)

    # -- who and where (AcceleratorState's members) --------------------------------------
    device = _process_member("device")
    process_index = _process_member("process_index")
    local_process_index = _process_member("local_process_index")
    num_processes = _process_member("num_processes")
    distributed_type: property = _process_member("distributed_type")
    use_distributed = _process_member("use_distributed")
    is_main_process = _process_member("is_main_process")
    is_local_main_process = _process_member("is_local_main_process")
    is_last_process = _process_member("is_last_process")
    wait_for_everyone = _process_member("wait_for_everyone")
    main_process_first = _process_member("main_process_first")
    local_main_process_first = _process_member("local_main_process_first")
    split_between_processes = _process_member("split_between_processes")
    on_main_process = _process_member("on_main_process")
    on_local_main_process = _process_member("on_local_main_process")
    on_last_process = _process_member("on_last_process")
    on_process = _process_member("on_process")
    on_local_process = _process_member("on_local_process")
    print = _process_member("print")

    # -- settings (read from the applied config and options) ------------------------------
    mixed_precision = property(lambda self: self._prepared.precision.mode)
    precision = property(lambda self: self._prepared.precision)
    native_amp = property(lambda self: self.mixed_precision in ("fp16", "bf16"))
    log_with = property(lambda self: list(self.config.log_with))
    split_batches = property(lambda self: self._prepared.split_batches)
    dataloader_config = _option("options.dataloader", "Accelerate's DataLoaderConfiguration.")
    dispatch_batches = _option("options.dataloader.dispatch_batches", "From dataloader_config.")
    non_blocking = _option("options.dataloader.non_blocking", "From dataloader_config.")
    use_seedable_sampler = _option("options.dataloader.use_seedable_sampler", "Ditto.")
    use_stateful_dataloader = _option("options.dataloader.use_stateful_dataloader", "Ditto.")
    project_configuration = _option("options.project", "Accelerate's ProjectConfiguration.")
    logging_dir = _option("options.project.logging_dir", "Where trackers write.")
    save_iteration = _option("options.project.iteration", "The next automatic checkpoint's number.")
    rng_types = _option("options.rng_types", "The random generators synchronised each epoch.")
    ddp_handler = _option("handlers.ddp", "The DistributedDataParallelKwargs given, or None.")
    scaler_handler = _option("handlers.scaler", "The GradScalerKwargs given, or None.")
    init_handler = _option("handlers.init", "The InitProcessGroupKwargs given, or None.")
    autocast_handler = _option("handlers.autocast", "The AutocastKwargs given, or None.")
    profile_handler = _option("handlers.profile", "The ProfileKwargs given, or None.")
    deepspeed_plugin = _option("state.deepspeed_plugin", "DeepSpeed's settings, or None.")
    deepspeed_config = property(lambda self: getattr(self.strategy, "ds_config", None))
    deepspeed_engine_wrapped = property(lambda self: self.strategy.engine)
    parallelism_config = property(lambda self: None, doc="None: no ParallelismConfig (refused).")
    is_composable_parallelism_enabled = property(lambda self: False)
    should_save_model = property(lambda self: True, doc="Every rank takes part in saving.")
    scaler = property(lambda self: self._prepared.precision.scaler)
    flag_tensor = property(lambda self: self._trigger.tensor, doc="set_trigger's flag.")
    is_fsdp2 = property(lambda self: self.distributed_type is DistributedType.FSDP)

    @property
    def multi_device(self) -> bool:
        """True with several GPUs (Accelerate's meaning: not for several CPU processes)."""
        return self.use_distributed and self.distributed_type is DistributedType.MULTI_GPU

    @property
    def even_batches(self) -> bool:
        """Whether ranks repeat samples so that every rank gets as many batches."""
        return self._prepared.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self._prepared.even_batches = value

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.accumulation_steps = value

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step syncs gradients (and the optimizer steps)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def step_scheduler_with_optimizer(self) -> bool:
        return self._prepared.step_scheduler_with_optimizer

    @step_scheduler_with_optimizer.setter
    def step_scheduler_with_optimizer(self, value: bool) -> None:
        self._prepared.step_scheduler_with_optimizer = value

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

    @property
    def has_lomo_optimizer(self) -> bool:
        return any(lomo.is_lomo_optimizer(o) for o in self._prepared.optimizers)

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

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``dataloader`` starting ``num_batches`` into this epoch (once). After
        ``load_state`` it replaces the restored position, so nothing is skipped twice."""
        return skip_first_batches(dataloader, num_batches)

    # -- the step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled for fp16 (with a
        LOMO optimizer and ``learning_rate=``: its fused backward, which also steps)."""
        learning_rate = kwargs.pop("learning_rate", None)
        if learning_rate is not None and self.has_lomo_optimizer:
            steps = self.gradient_accumulation_steps
            self.lomo_backward(loss / steps if steps > 1 else loss, learning_rate)
            return
        self.strategy.backward(
            loss,
            accumulation_steps=self.gradient_accumulation_steps,
            scaler=self.scaler,
            sync_gradients=self.sync_gradients,
            **kwargs,
        )

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """The fused backward-and-update of a prepared LOMO / AdaLomo optimizer."""
        lomo.lomo_backward(loss, learning_rate, self._prepared.optimizers)

    @contextlib.contextmanager
    def accumulate(self, *models_: torch.nn.Module) -> Iterator[None]:
        """One micro-step: gradients sync (and the optimizer steps) every k-th call.

        On the other calls the gradient reduction of DDP or FSDP is suspended (unless
        ``sync_each_batch``) and ``step`` / ``zero_grad`` of prepared optimizers do nothing.
        The last batch of a prepared dataloader always syncs, so an epoch never ends with
        gradients left over.
        """
        self.step += 1
        grads = self.gradient_state
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

    trigger_sync_in_backward = staticmethod(ddp_controls.trigger_sync_in_backward)

    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Train on uneven inputs: ranks that run out of batches shadow the others' all-reduces
        (torch's ``Join``); ``even_batches`` overrides the prepared loaders' inside the block."""
        return ddp_controls.join_uneven_inputs(
            joinables,
            even_batches,
            distributed_type=self.distributed_type,
            num_processes=self.num_processes,
            default_even_batches=self.even_batches,
            dataloaders=self._prepared.dataloaders,
        )

    def autocast(
        self, enabled: bool = True, autocast_handler: Any = None
    ) -> contextlib.AbstractContextManager[None]:
        """Autocast for the configured precision, for code outside the model's forward;
        ``autocast_handler`` (an ``AutocastKwargs``) overrides the Accelerator's."""
        handler = autocast_handler.to_kwargs() if autocast_handler is not None else {}
        return self._prepared.precision.autocast(enabled, **handler)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the fp16 gradients of ``optimizer`` (default: every prepared one); once
        per step."""
        chosen = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        for prepared in self._prepared.optimizers:
            if optimizer is None or prepared in chosen:
                prepared.unscale_gradients()

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
        grads = self.gradient_state
        if grads.end_of_dataloader and grads.remainder >= 0:
            # Gathered objects are one list (cut the list); tensors are cut row-wise.
            keep = grads.remainder
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

    def set_trigger(self) -> None:
        """Raise this rank's flag; ``check_trigger`` on every rank then returns True."""
        self._trigger.set()

    def check_trigger(self) -> bool:
        """True on every rank if any rank called ``set_trigger`` since the last check (a
        collective: call it on every rank); resets the flag."""
        return self._trigger.check()

    # -- models, weights and checkpoints -----------------------------------------------------
    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> Any:
        """The user's module without DDP; without torch.compile and the autocast forward too
        when asked (Accelerate's defaults keep both, so training goes on unchanged)."""
        return self.strategy.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's whole state dict as plain tensors, gathered from the shards of FSDP
        or ZeRO-3 (every rank must call it then; rank 0 gets the weights, the others ``{}``).
        ``unwrap=False`` keeps the wrapper's keys (``module.`` under DDP) when unsharded."""
        self.strategy.before_save()
        if not unwrap and self.strategy.checkpoint_layout == "plain":
            return dict(model.state_dict())
        return self.strategy.full_state_dict(model)

    def save(
        self, obj: Any, f: str | os.PathLike[str] | IO[bytes], safe_serialization: bool = False
    ) -> None:
        """``torch.save`` (or safetensors) from the process that writes: the main one, or each
        node's with ``save_on_each_node``. Fits ``save_pretrained(save_function=...)``."""
        saving.save(
            obj,
            f,
            is_main_process=self.is_main_process,
            is_local_main_process=self.is_local_main_process,
            save_on_each_node=self.options.project.save_on_each_node,
            safe_serialization=safe_serialization,
        )

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike[str]) -> None:
        """Write the consolidated weights to ``save_directory/model.safetensors`` (rank 0)."""
        self.strategy.before_save()
        self.strategy.save_model(model, Path(save_directory), self.is_main_process)
        self.wait_for_everyone()

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """True when ``model`` was dispatched over several devices with a device map."""
        return device_map.verify_device_map(model)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in save/load_state."""
        self._checkpoints.register(objects)

    def register_save_state_pre_hook(self, hook: SaveHook) -> Any:
        """Call ``hook(models, weights, output_dir)`` before each ``save_state``; popping an
        entry of ``weights`` leaves that model out. Returns a handle with ``remove()``."""
        self._checkpoints.save_hooks.append(hook)
        return _Removable(self._checkpoints.save_hooks, hook)

    def register_load_state_pre_hook(self, hook: LoadHook) -> Any:
        """Call ``hook(models, input_dir)`` before each ``load_state``; popping a model from
        ``models`` leaves it unloaded. Returns a handle with ``remove()``."""
        self._checkpoints.load_hooks.append(hook)
        return _Removable(self._checkpoints.load_hooks, hook)

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> Path:
        """Save the whole training state atomically; every process must call it. Without
        ``output_dir``: ``project_dir/checkpoints/checkpoint_<n>`` when the project config
        has ``automatic_checkpoint_naming`` (keeping its ``total_limit`` newest)."""
        _no_extra_arguments("save_state", save_model_func_kwargs)
        return self._checkpoints.save(output_dir)

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """Restore what ``save_state`` wrote, so training continues exactly (without
        ``input_dir``: the newest automatically named checkpoint)."""
        _no_extra_arguments("load_state", {**(load_kwargs or {}), **load_model_func_kwargs})
        self._checkpoints.load(input_dir)

    # -- trackers and profiling --------------------------------------------------------------
    project_dir = property(lambda self: self._tracking.project_dir, doc="Where trackers write.")
    trackers = property(lambda self: self._tracking.trackers)

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the ``log_with`` trackers (main process) under ``project_dir``."""
        self._tracking.start(project_name, config, init_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its library's object with ``unwrap=True``);
        a tracker that does nothing on the other ranks."""
        return tracker_lookup.get_tracker(self.trackers, name, unwrap)

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

    def profile(self, profile_handler: Any = None) -> contextlib.AbstractContextManager[Any]:
        """``torch.profiler`` around the block, set by ``ProfileKwargs``; with
        ``output_trace_dir`` each rank writes ``profile_<rank>.json`` there."""
        return profiling.profile(
            profile_handler or self.profile_handler,
            process_index=self.process_index,
            wait_for_everyone=self.wait_for_everyone,
        )

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


def _no_extra_arguments(member: str, given: dict[str, Any]) -> None:
    if given:
        raise NotImplementedError(
            f"{member}({', '.join(given)}=...): those keywords are passed by Accelerate to its "
            "model-file writer and reader (safetensors/torch.save of each model); nbaccel "
            "checkpoints are its own atomic layout (docs/accelerator.md), so it has none of "
            "them. Drop the keywords."
        )


class _Removable:
    """What ``register_*_pre_hook`` returns: ``.remove()`` takes the hook out again."""

    def __init__(self, hooks: list[Any], hook: Callable[..., Any]) -> None:
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


__all__ = ["Accelerator"]
