"""DeepSpeed's engine behind the Accelerator (strategy='deepspeed'); worker side.

``DeepSpeedRun`` hands model, optimizer and scheduler to ``deepspeed.initialize`` (with a
config that ``nbaccel.config.deepspeed.settings.fill_auto_values`` filled) and offers what the
Accelerator calls: the engine for ``prepare`` to return, ``backward`` (which also steps: the
engine accumulates, clips and steps), optimizer and scheduler stand-ins whose ``step`` does
nothing, checkpoints through the engine (each rank its own shards) and the consolidated weights.
deepspeed is imported only when a run is built: this module imports wherever torch does.
"""

from __future__ import annotations

import copy
import importlib
import os
from pathlib import Path
from typing import Any

import torch

from nbaccel.accel.checkpoints.weight_files import save_state_file
from nbaccel.accel.optim import AcceleratedOptimizer, AcceleratedScheduler, GradientState
from nbaccel.config.deepspeed.settings import auto_paths

CHECKPOINT_TAG = "deepspeed"
_QUIET = 2**31 - 1  # steps_per_print: DeepSpeed's own progress line, never (nbaccel shows one)
_NOTHING = torch.empty(0)  # what ranks other than 0 keep of a gathered weight
_SAVE_16BIT = "stage3_gather_16bit_weights_on_model_save"


def import_deepspeed(module: str = "deepspeed") -> Any:
    """``import deepspeed`` (or a submodule of it), naming the fix when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"strategy='deepspeed' needs the deepspeed package in the worker's Python ({exc}). "
            "Install it there with `pip install deepspeed` (CUDA GPUs only), or use "
            "strategy='fsdp', which needs nothing beyond torch."
        ) from exc


def engine_config(ds_config: dict[str, Any], *, torch_optimizer: bool) -> dict[str, Any]:
    """The config ``deepspeed.initialize`` gets: a copy of ``ds_config`` (filled by
    ``fill_auto_values``) with what nbaccel adds, as Accelerate's ``_prepare_deepspeed`` does.

    ``torch_optimizer``: a torch optimizer goes to the engine (not one the config names).

    >>> built = engine_config({"zero_optimization": {"stage": 2}}, torch_optimizer=True)
    >>> built["zero_allow_untested_optimizer"], built["steps_per_print"]
    (True, 2147483647)
    """
    if auto_paths(ds_config):
        raise ValueError(
            f"The DeepSpeed config still has 'auto' in {', '.join(auto_paths(ds_config))}, "
            "which DeepSpeed refuses. Fill it with "
            "nbaccel.config.deepspeed.settings.fill_auto_values."
        )
    config = copy.deepcopy(ds_config)  # deepspeed.initialize may write into it
    config.setdefault("steps_per_print", _QUIET)
    if torch_optimizer:
        # ZeRO refuses optimizers DeepSpeed did not test (SGD, say) unless allowed; a
        # user's torch optimizer is what Accelerate lets through too.
        config.setdefault("zero_allow_untested_optimizer", True)
    return config


class DeepSpeedRun:
    """One ``deepspeed.initialize``: the engine, and what the Accelerator hands out around it.

    ``scheduler_steps``: schedule steps per optimizer step (Accelerate's convention, as in
    ``AcceleratedScheduler``: the process count, 1 with ``split_batches``). Pass
    ``scheduler=None`` when the user steps it (``step_scheduler_with_optimizer=False``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any | None,
        ds_config: dict[str, Any],
        *,
        scheduler_steps: int = 1,
    ) -> None:
        deepspeed = import_deepspeed()
        config = engine_config(ds_config, torch_optimizer=optimizer is not None)
        kwargs: dict[str, Any] = {"model": model, "config": config}
        if optimizer is not None:
            _refuse_both(config, "optimizer", optimizer)
            kwargs["optimizer"] = _cpu_optimizer_if_offloaded(optimizer, config)
        elif "optimizer" in config:  # DeepSpeed builds the optimizer the config names
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
        if scheduler is not None:
            _refuse_both(config, "scheduler", scheduler)
            kwargs["lr_scheduler"] = _ScheduleSteps(scheduler, scheduler_steps)
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(**kwargs)
        self.engine: Any = engine
        zero = config.get("zero_optimization", {})
        self.zero_stage = int(zero.get("stage", 0))
        # zero3_save_16bit_model / the config's stage3_gather_16bit_weights_on_model_save.
        self.saves_16bit = self.zero_stage == 3 and bool(zero.get(_SAVE_16BIT, False))
        self.optimizer = None if ds_optimizer is None else DeepSpeedOptimizer(ds_optimizer)
        inner = scheduler if scheduler is not None else ds_scheduler
        self.scheduler = None if inner is None else DeepSpeedScheduler(inner, self.optimizer)

    def backward(
        self, loss: torch.Tensor, *, sync_gradients: bool | None = None, **kw: Any
    ) -> None:
        """``engine.backward``, then ``engine.step`` at an accumulation boundary.

        The engine divides the loss by gradient_accumulation_steps, reduces, clips, steps,
        zeroes and scales fp16 losses: the Accelerator must neither divide the loss nor clip.
        ``sync_gradients`` (the Accelerator's) marks the boundary, so an epoch's last batch
        steps as elsewhere in nbaccel; None lets DeepSpeed count micro-steps itself.
        """
        if sync_gradients is not None:
            self.engine.set_gradient_accumulation_boundary(sync_gradients)
        self.engine.backward(loss, **kw)
        # With the boundary set, DeepSpeed expects one step() after the boundary's backward;
        # counting itself, a step() after every backward (it steps only at its boundary).
        if sync_gradients is None or sync_gradients:
            self.engine.step()

    def global_grad_norm(self) -> float | None:
        """The gradient norm at the last optimizer step, before clipping (None before one)."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def save_checkpoint(self, directory: str | os.PathLike[str], tag: str = CHECKPOINT_TAG) -> Path:
        """Each rank writes its shards (model, optimizer, scheduler) to directory/tag; collective.

        Resume with the same process count and ZeRO stage (DeepSpeed's universal checkpoints
        could reshard; they are not used here)."""
        self.engine.save_checkpoint(os.fspath(directory), tag=tag)
        return Path(directory) / tag

    def load_checkpoint(self, directory: str | os.PathLike[str], tag: str = CHECKPOINT_TAG) -> None:
        """Restore what ``save_checkpoint`` wrote (collective)."""
        found = (Path(directory) / tag).is_dir()  # else DeepSpeed fails a bare assert (0.19)
        path = found and self.engine.load_checkpoint(os.fspath(directory), tag=tag)[0]
        if not path:  # (older DeepSpeed logs a warning and returns None: training restarts)
            raise FileNotFoundError(
                f"No DeepSpeed checkpoint {tag!r} in {directory}, so there is nothing to "
                "restore. Load the folder save_state wrote, with the same ZeRO stage and "
                "process count."
            )

    def accelerate_state_dict(self) -> dict[str, torch.Tensor]:
        """What Accelerate's ``get_state_dict`` returns under DeepSpeed; collective at ZeRO-3.

        ZeRO 0-2: the engine's module holds whole weights on every rank, in the dtype it
        trains in (bf16/fp16 under mixed precision, cast by the engine): CPU copies of them on
        every rank, as Accelerate's ``clone_tensors_for_torch_save(module.state_dict())``. Not
        the fp32 master copy: under bf16 the two differ by bf16 rounding (a parity program's
        weight norm by 2e-4 relative). ZeRO-3: ``consolidated_state_dict`` (Accelerate refuses
        without the 16-bit save; nbaccel gives the fp32 master copy then).
        """
        if self.zero_stage == 3:
            return self.consolidated_state_dict()
        module_state = self.engine.module.state_dict()
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module_state.items()}

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU on rank 0, ``{}`` elsewhere; collective.
        What ``save_model`` writes.

        Under ZeRO-3 with ``zero3_save_16bit_model`` (the config's
        stage3_gather_16bit_weights_on_model_save), Accelerate's meaning: the 16-bit training
        copy DeepSpeed consolidates (``engine._zero3_consolidated_16bit_state_dict()``).
        Otherwise (where Accelerate refuses under ZeRO-3) the fp32 master copy the optimizer
        keeps: for ZeRO 1-3 from ``deepspeed.utils.safe_get_full_fp32_param`` (gathered from
        every rank's partition), at stage 0 with fp16/bf16 from DeepSpeed's FP16 optimizer's
        fp32 groups. Frozen parameters (no master copy) come as they are, gathered under ZeRO-3.
        """
        if self.saves_16bit:
            return self._sixteen_bit_state_dict()
        deepspeed = import_deepspeed()
        main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        optimizer = self.optimizer.optimizer if self.optimizer is not None else None
        masters = _stage0_masters(optimizer) if self.zero_stage == 0 else {}
        copies: dict[int, torch.Tensor] = {}  # tied weights: gathered once, saved shared
        result: dict[str, torch.Tensor] = {}
        # Each gather is a collective: every rank walks the same names in the same order.
        for name, tensor in self.engine.module.state_dict(keep_vars=True).items():
            if id(tensor) not in copies:
                full = masters.get(id(tensor))
                full = _full_weight(tensor, deepspeed) if full is None else full
                copies[id(tensor)] = full.detach().to("cpu", copy=True) if main else _NOTHING
            if main:
                result[name] = copies[id(tensor)]
        return result

    def _sixteen_bit_state_dict(self) -> dict[str, torch.Tensor]:
        # DeepSpeed fills it on rank 0 only (an empty dict, or None in older releases, elsewhere).
        gathered = self.engine._zero3_consolidated_16bit_state_dict()
        main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        return (
            {name: tensor.detach().cpu() for name, tensor in (gathered or {}).items()}
            if main
            else {}
        )

    def save_model(self, directory: str | os.PathLike[str]) -> Path | None:
        """Write ``directory/model.safetensors`` on rank 0 (its path, else None); collective."""
        state = self.consolidated_state_dict()
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return None
        return save_state_file(state, Path(directory))


class DeepSpeedOptimizer(AcceleratedOptimizer):
    """The optimizer ``prepare`` returns under DeepSpeed, as Accelerate's wrapper.

    ``step``/``zero_grad`` do nothing (``backward`` ran ``engine.step()``); ``param_groups``
    (read or set the LR, build a scheduler on it) and ``state_dict`` are DeepSpeed's. Under
    ZeRO that state dict is this rank's partition: checkpoint with ``save_checkpoint``.
    """

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer, GradientState(), scaler=None, clip=None)

    def step(self, closure: Any = None) -> Any:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    @property
    def step_was_skipped(self) -> bool:
        """True when DeepSpeed's fp16 loss scaler skipped the last step (inf/NaN gradients)."""
        return bool(getattr(self.optimizer, "overflow", False))

    @step_was_skipped.setter
    def step_was_skipped(self, value: bool) -> None:
        pass  # the base class assigns it; DeepSpeed's optimizer knows


class DeepSpeedScheduler(AcceleratedScheduler):
    """The scheduler ``prepare`` returns: the engine steps it, so ``step`` does nothing."""

    def __init__(self, scheduler: Any, optimizer: DeepSpeedOptimizer | None) -> None:
        optimizers: list[AcceleratedOptimizer] = [optimizer] if optimizer is not None else []
        super().__init__(scheduler, optimizers, GradientState(), steps_per_optimizer_step=1)

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None


class _ScheduleSteps:
    """What the engine steps after each optimizer step: the user's scheduler, ``times`` steps.

    DeepSpeed steps its scheduler once per optimizer step and not after an fp16 overflow;
    Accelerate's schedules advance once per process. Everything else is the scheduler's own
    (``state_dict``/``load_state_dict`` for DeepSpeed's checkpoints).
    """

    def __init__(self, scheduler: Any, times: int) -> None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "ReduceLROnPlateau steps on a metric, which DeepSpeed's engine cannot give it. "
                "Under DeepSpeed keep it out of prepare() and call scheduler.step(metric) "
                "yourself."
            )
        self.scheduler, self.times = scheduler, times

    def step(self, *args: Any, **kwargs: Any) -> None:
        # DeepSpeed may pass lr_kwargs or a batch size; torch schedulers take neither.
        for _ in range(self.times):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past it
            if total is not None and self.scheduler.last_epoch >= total:
                return
            self.scheduler.step()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def _full_weight(tensor: torch.Tensor, deepspeed: Any) -> torch.Tensor:
    partitioned = hasattr(tensor, "ds_id")  # ZeRO-3 holds only this rank's slice here
    if tensor.requires_grad and (not partitioned or hasattr(tensor, "_z3_optimizer")):
        full = deepspeed.utils.safe_get_full_fp32_param(tensor)
        if full is not None:
            return full  # type: ignore[no-any-return]
    if partitioned:
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            return tensor.detach().clone()
    return tensor.detach()  # replicated: a buffer, or a parameter no optimizer partitions


def _stage0_masters(optimizer: Any) -> dict[int, torch.Tensor]:
    """{id(param): its fp32 copy} from DeepSpeed's FP16 optimizers (stage 0 with fp16/bf16),
    which keep the copies per group (unfused) or flat per group (fused), unlinked to params."""
    found: dict[int, torch.Tensor] = {}
    fp32 = getattr(optimizer, "fp32_groups", None) or getattr(optimizer, "fp32_groups_flat", [])
    for lows, highs in zip(getattr(optimizer, "fp16_groups", []), fp32, strict=False):
        if isinstance(highs, torch.Tensor):  # fused: one flat tensor, params in group order
            sizes = [p.numel() for p in lows]
            highs = torch.split(highs[: sum(sizes)], sizes)
        for low, high in zip(lows, highs, strict=False):
            if high.numel() == low.numel():
                found[id(low)] = high.view_as(low)
    return found


def _refuse_both(config: dict[str, Any], kind: str, given: Any) -> None:
    if kind in config:
        raise ValueError(
            f"prepare() was given a torch {kind} ({type(given).__name__}), and the DeepSpeed "
            f"config names one too ({config[kind].get('type', '?')}); DeepSpeed takes one. Remove "
            f"the {kind!r} section from the config, or leave the {kind} out of prepare()."
        )


def _cpu_optimizer_if_offloaded(optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> Any:
    """With optimizer offload DeepSpeed steps on the CPU with its own optimizers only: swap
    torch's Adam/AdamW for DeepSpeedCPUAdam, as Accelerate does (DeepSpeed refuses others,
    naming the fix: its CPU optimizers, or "zero_force_ds_cpu_optimizer": false)."""
    device = (config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device")
    if device in (None, "none") or not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return optimizer
    if config.get("zero_force_ds_cpu_optimizer") is False:
        return optimizer
    defaults = optimizer.defaults
    decoupled = isinstance(optimizer, torch.optim.AdamW) or defaults.get("decoupled_weight_decay")
    cpu_adam = import_deepspeed("deepspeed.ops.adam").DeepSpeedCPUAdam
    return cpu_adam(
        optimizer.param_groups,
        **{key: defaults[key] for key in ("lr", "betas", "eps", "weight_decay")},
        adamw_mode=bool(decoupled),
    )
