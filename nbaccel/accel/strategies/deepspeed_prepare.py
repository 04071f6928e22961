"""``prepare()`` under ``strategy='deepspeed'``: model, optimizer and scheduler to one engine.

DeepSpeed builds one engine from one model and its optimizer and scheduler, and needs the
per-process batch size for its config; so, as in Accelerate, they come in one ``prepare``
call with the training dataloader. Dataloaders are sharded by the Accelerator as usual.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nbaccel.accel.strategies.deepspeed_engine import DeepSpeedRun
from nbaccel.config.deepspeed.settings import deepspeed_config, fill_auto_values
from nbaccel.config.schema import Config


def prepare_deepspeed(
    objects: list[Any],
    kinds: list[str],
    *,
    config: Config,
    given: Mapping[str, Any] | None = None,
    world_size: int,
    split_batches: bool,
    step_scheduler_with_optimizer: bool,
) -> tuple[dict[int, Any], DeepSpeedRun, dict[str, Any]]:
    """Build the engine; returns {position in ``objects``: what prepare returns there}, the
    run, and the DeepSpeed config it was built with (``auto`` values filled).

    ``given``: the config dict of ``DeepSpeedPlugin(hf_ds_config={...})``, which takes the
    place of ``deepspeed_config_file`` (``nbaccel.config.deepspeed.settings.deepspeed_config``)."""
    at = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in set(kinds)}
    models, optimizers = at.get("model", []), at.get("optimizer", [])
    schedulers = at.get("scheduler", [])
    if len(models) != 1 or len(optimizers) > 1 or len(schedulers) > 1:
        raise ValueError(
            "prepare() with strategy='deepspeed' takes exactly one model and at most one "
            f"optimizer and one scheduler in the same call (got {len(models)}, "
            f"{len(optimizers)}, {len(schedulers)}): DeepSpeed builds one engine from them. "
            "Pass them, with the training dataloader, to a single prepare() call."
        )
    loaders = [objects[i] for i in at.get("dataloader", [])]
    micro = _batch_size(loaders[0]) if loaders else None
    if micro is not None and split_batches:
        micro //= world_size  # each process takes its slice of every batch
    ds = fill_auto_values(
        deepspeed_config(config, given),
        micro_batch_size=micro,
        world_size=world_size,
        accumulation_steps=config.gradient_accumulation_steps,
        max_grad_norm=config.max_grad_norm,
        mixed_precision=config.mixed_precision,
        hidden_size=getattr(getattr(objects[models[0]], "config", None), "hidden_size", None),
    )
    scheduler = objects[schedulers[0]] if schedulers else None
    run = DeepSpeedRun(
        objects[models[0]],
        objects[optimizers[0]] if optimizers else None,
        scheduler if step_scheduler_with_optimizer else None,  # else the user steps it
        ds,
        scheduler_steps=1 if split_batches else world_size,
    )
    replaced: dict[int, Any] = {models[0]: run.engine}
    if optimizers:
        replaced[optimizers[0]] = run.optimizer
    if schedulers and step_scheduler_with_optimizer:
        replaced[schedulers[0]] = run.scheduler
    return replaced, run, ds


def _batch_size(loader: Any) -> int | None:
    size = loader.batch_size
    if size is None and loader.batch_sampler is not None:
        size = getattr(loader.batch_sampler, "batch_size", None)
    return None if size is None else int(size)
