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
import gc
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from nbaccel.accel import strategies
from nbaccel.accel.autosave.autosave import AutoSave
from nbaccel.accel.checkpointing import Checkpoints
from nbaccel.accel.communication import Communication
from nbaccel.accel.data.skip_batches import skip_first_batches
from nbaccel.accel.forwarding import option, part_member, settable
from nbaccel.accel.optim import GradientState
from nbaccel.accel.partial_state import AcceleratorState
from nbaccel.accel.preparation import Prepared
from nbaccel.accel.refusals import refuse_arguments, refuse_members
from nbaccel.accel.state import DistributedType, launch_config
from nbaccel.accel.strategies import ddp_controls, device_map
from nbaccel.accel.tracking.tracking import Tracking
from nbaccel.accel.training_step import TrainingStep
from nbaccel.config.accelerate.kwargs_handlers import collect_handlers
from nbaccel.config.accelerator_options import apply_accelerator_arguments
from nbaccel.config.schema import Config, flatten
from nbaccel.context import active_session
from nbaccel.metrics import report_settings


def _process_member(name: str) -> Any:
    return part_member("state", AcceleratorState, name)


def _checkpoint_member(name: str) -> Any:
    return part_member("_checkpoints", Checkpoints, name)


def _tracking_member(name: str) -> Any:
    return part_member("_tracking", Tracking, name)


def _step_member(name: str) -> Any:
    return part_member("_step", TrainingStep, name)


def _communication_member(name: str) -> Any:
    return part_member("_communication", Communication, name)


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

    _step: TrainingStep  # the parts, made in __init__
    _communication: Communication

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
        launch = launch_config(config)
        self.options = apply_accelerator_arguments(
            launch,
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
        if self.strategy.state.is_main_process:
            self._report_settings(launch)
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
            # max_grad_norm from the config: clipped inside each optimizer step.
            clip=(lambda opt: self._step.config_clip(opt)) if self.config.max_grad_norm else None,
        )
        if (session := active_session()) is not None:
            session.accelerator = self  # kept workers find what it prepared (context.py)
        self._checkpoints = Checkpoints(self._prepared, self.gradient_state, self.options.project)
        # Periodic saves, save-and-stop and resume: from the launch's config, not the
        # Accelerator's arguments (the launch decided where checkpoints live).
        self._autosave = AutoSave(launch, self._checkpoints)
        self._prepared.boundary = self._autosave.boundary
        self._tracking = Tracking(
            self.config, self.strategy.state, self.wait_for_everyone, self.handlers.profile
        )
        # Accelerate keeps these as plain attributes; so does nbaccel (code may set them).
        self.dataloader_config = self.options.dataloader
        self.project_configuration = self.options.project
        self.rng_types = list(self.options.rng_types)
        self.log_with = list(self.config.log_with)
        self.native_amp = self.config.mixed_precision in ("fp16", "bf16")
        handlers = self.handlers
        self.ddp_handler, self.scaler_handler, self.init_handler = (
            handlers.ddp,
            handlers.scaler,
            handlers.init,
        )
        self.autocast_handler, self.profile_handler = handlers.autocast, handlers.profile
        self._step = TrainingStep(self._prepared, self.gradient_state, self.config.max_grad_norm)
        self._communication = Communication(self.strategy, self.gradient_state)

    def _report_settings(self, launch: Config) -> None:
        # Only the worker sees the plugins and arguments: rank 0 tells the launcher what
        # changed (run_dir/accelerator_config.json, the dashboard's header, text output).
        before, after = flatten(launch), flatten(self.config)
        changed = {name: value for name, value in after.items() if before[name] != value}
        if changed:
            sources = {name: self.options.sources.get(name, "Accelerator") for name in changed}
            report_settings(changed, sources)

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
    split_batches = property(lambda self: self._prepared.split_batches)
    dispatch_batches = option("dataloader_config.dispatch_batches", "From dataloader_config.")
    non_blocking = option("dataloader_config.non_blocking", "From dataloader_config.")
    use_seedable_sampler = option("dataloader_config.use_seedable_sampler", "Ditto.")
    use_stateful_dataloader = option("dataloader_config.use_stateful_dataloader", "Ditto.")
    logging_dir = option("project_configuration.logging_dir", "Where trackers write.")
    save_iteration = option("project_configuration.iteration", "Next automatic checkpoint's n.")
    deepspeed_plugin = option("state.deepspeed_plugin", "DeepSpeed's settings, or None.")
    deepspeed_config = settable("strategy.ds_config", "The DeepSpeed config of the engine.")
    deepspeed_engine_wrapped = settable("strategy.run", "DeepSpeed's engine and its run.")
    scaler = settable("_prepared.precision.scaler", "The fp16 GradScaler, or None.")
    flag_tensor = settable("_communication.trigger.tensor", "set_trigger's flag.")
    parallelism_config = None  # no ParallelismConfig: refused (refusals.py)
    torch_device_mesh = None
    is_composable_parallelism_enabled = False
    should_save_model = property(lambda self: True, doc="Every rank takes part in saving.")
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

    # -- prepare ---------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Wrap models, optimizers, schedulers and dataloaders, in any order and number.

        Returns them in the order given (one object alone when one was passed).
        """
        placement = device_placement or [self.device_placement] * len(objects)
        result = self._prepared.prepare(objects, placement)
        self._autosave.watch_models(self._prepared.models)
        return result[0] if len(result) == 1 else tuple(result)

    completed_steps = property(
        lambda self: self._autosave.completed("completed_steps"),
        doc="Optimizer steps taken, those before a resume included (restored with the state).",
    )
    completed_epochs = property(
        lambda self: self._autosave.completed("completed_epochs"),
        doc="Passes over the first prepared DataLoader done, those before a resume included.",
    )

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
                "slice_fn_for_dispatch: with dispatch_batches=True nbaccel's rank 0 sends each "
                "rank the samples that sharding would give it; a custom slicing function is "
                "not supported. Leave slice_fn_for_dispatch unset."
            )
        placement = self.device_placement if device_placement is None else device_placement
        return self._prepared.dataloader(data_loader, placement)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``dataloader`` starting ``num_batches`` into this epoch (once). After
        ``load_state`` it replaces the restored position, so nothing is skipped twice."""
        return skip_first_batches(dataloader, num_batches)

    # -- the step (TrainingStep's members, but accumulate) ---------------------------------
    @contextlib.contextmanager
    def accumulate(self, *models_: torch.nn.Module) -> Iterator[None]:
        """One micro-step: gradients sync (and the optimizer steps) every k-th call.

        On the other calls the gradient reduction of DDP or FSDP is suspended (unless
        ``sync_each_batch``) and ``step`` / ``zero_grad`` of prepared optimizers do nothing.
        The last batch of a prepared dataloader syncs (unless the ``GradientAccumulationPlugin``
        says ``sync_with_dataloader=False``), so an epoch never ends with gradients left over.
        """
        self.step += 1
        grads = self.gradient_state
        grads.next_micro_step()
        with contextlib.ExitStack() as stack:
            if not grads.sync_gradients and not self.config.sync_each_batch:
                for model in models_:
                    stack.enter_context(self.strategy.no_sync(model))
            yield

    backward = _step_member("backward")
    lomo_backward = _step_member("lomo_backward")
    no_sync = _step_member("no_sync")
    trigger_sync_in_backward = staticmethod(ddp_controls.trigger_sync_in_backward)
    join_uneven_inputs = _step_member("join_uneven_inputs")
    autocast = _step_member("autocast")
    unscale_gradients = _step_member("unscale_gradients")
    clip_grad_norm_ = _step_member("clip_grad_norm_")
    clip_grad_value_ = _step_member("clip_grad_value_")
    has_lomo_optimizer = settable("_step.has_lomo_optimizer", "A LOMO optimizer was prepared.")

    # -- across processes (Communication's members) ----------------------------------------
    gather = _communication_member("gather")
    gather_for_metrics = _communication_member("gather_for_metrics")
    reduce = _communication_member("reduce")
    pad_across_processes = _communication_member("pad_across_processes")
    set_trigger = _communication_member("set_trigger")
    check_trigger = _communication_member("check_trigger")

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

    get_state_dict = _checkpoint_member("get_state_dict")
    save = _checkpoint_member("save")
    save_model = _checkpoint_member("save_model")
    save_state = _checkpoint_member("save_state")
    load_state = _checkpoint_member("load_state")
    register_for_checkpointing = _checkpoint_member("register_for_checkpointing")
    register_save_state_pre_hook = _checkpoint_member("register_save_state_pre_hook")
    register_load_state_pre_hook = _checkpoint_member("register_load_state_pre_hook")

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """True when ``model`` was dispatched over several devices with a device map."""
        return device_map.verify_device_map(model)

    # -- trackers and profiling (Tracking's members) --------------------------------------
    project_dir = _tracking_member("project_dir")
    init_trackers = _tracking_member("init_trackers")
    log = _tracking_member("log")
    get_tracker = _tracking_member("get_tracker")
    end_training = _tracking_member("end_training")
    profile = _tracking_member("profile")

    @property
    def trackers(self) -> list[Any]:
        """The started trackers (main process; empty elsewhere)."""
        return self._tracking.trackers

    @trackers.setter
    def trackers(self, value: list[Any]) -> None:
        self._tracking.trackers = value

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


__all__ = ["Accelerator"]
