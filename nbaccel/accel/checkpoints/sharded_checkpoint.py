"""Model and optimizer state of FSDP runs, through ``torch.distributed.checkpoint`` (DCP).

Two layouts, chosen by ``fsdp_state_dict_type``:

- ``sharded``: every rank writes its own shards into ``<state>/sharded/`` with ``dcp.save``;
  DCP's metadata records global shapes, so the state loads onto any number of processes
  (2 -> 1, 1 -> 2), also into a process without a process group.
- ``full``: the whole state dict gathered to rank 0 on the CPU and written as
  ``model_<i>.pt`` / ``optimizer_<i>.pt`` (optimizer keyed by parameter name).

Either way the files sit inside the staging folder that ``checkpoint.save_state`` renames
only after every rank finished, so a crash leaves the previous checkpoint whole. Loading
checks DCP's metadata against the model before anything is written into it, because
``dcp.load`` fills the live parameters in place. DCP reads through ``safe_dcp``'s reader and
planner, which unpickle nothing but what DCP's format holds (see that module).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from nbaccel.accel.checkpoints.checkpoint_files import inside
from nbaccel.accel.checkpoints.safe_dcp import SafePlanner, SafeReader, check_entries

SHARDED_FOLDER = "sharded"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def owners(models: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> list[int]:
    """For each optimizer, the index of the model whose parameters it updates."""
    found = []
    for i, optimizer in enumerate(optimizers):
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        match = [j for j, m in enumerate(models) if any(id(p) in params for p in m.parameters())]
        if not match:
            raise ValueError(
                f"save_state/load_state: optimizer {i} updates no parameter of a prepared "
                "model; with FSDP its state is saved by parameter name, so prepare() the "
                "model it trains in the same Accelerator."
            )
        found.append(match[0])
    return found


Pairs = list[tuple[torch.nn.Module, Any]]  # each optimizer with the model it updates


def _paired(models: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> Pairs:
    return [(models[j], opt) for opt, j in zip(optimizers, owners(models, optimizers), strict=True)]


def _state(
    models: Sequence[torch.nn.Module], pairs: Pairs, options: StateDictOptions
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i, model in enumerate(models):
        state[f"model_{i}"] = get_model_state_dict(model, options=options)
    for i, (owner, optimizer) in enumerate(pairs):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(owner, optimizer, options=options)
    return state


def save(
    folder: Path,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    *,
    full: bool,
    rank: int,
) -> None:
    """Write models' and optimizers' state into ``folder``; every rank must call it."""
    pairs = _paired(models, optimizers)
    if not full:
        dcp_save(_state(models, pairs, StateDictOptions()), checkpoint_id=folder / SHARDED_FOLDER)
        return
    state = _state(models, pairs, _FULL)  # collective: every rank gathers
    if rank == 0:
        for key, value in state.items():
            torch.save(value, folder / f"{key}.pt")


def load(
    folder: Path, models: Sequence[torch.nn.Module], optimizers: Sequence[Any], *, full: bool
) -> None:
    """Restore what ``save`` wrote, resharding to this run's processes."""
    pairs = _paired(models, optimizers)
    if full:
        options = StateDictOptions(full_state_dict=True)
        loaded = {
            f.stem: torch.load(f, map_location="cpu", weights_only=True)
            for f in folder.glob("*_*.pt")
            if f.stem.startswith(("model_", "optimizer_"))
        }
        _apply(models, pairs, loaded, options)
        return
    state = _state(models, pairs, StateDictOptions())
    reader = SafeReader(inside(folder, SHARDED_FOLDER, what=f"the checkpoint {folder}"))
    _check_metadata(reader, state)
    # The same reader (holding the metadata just checked) and a planner that loads with
    # weights_only: DCP's defaults would unpickle the files without restriction.
    try:
        check_entries(reader, reader.read_metadata())  # a tampered entry: refused, no change
        dcp_load(state, storage_reader=reader, planner=SafePlanner())
    except CheckpointException as error:
        # DCP wraps every rank's error in a BaseException (``except Exception`` misses it):
        # a refusal by SafePlanner surfaces as the ValueError it is, on every rank.
        refused = [e for e, _trace in error.failures.values() if isinstance(e, ValueError)]
        if refused:
            raise refused[0] from error
        raise
    _apply(models, pairs, state, StateDictOptions())


def _apply(
    models: Sequence[torch.nn.Module],
    pairs: Pairs,
    state: dict[str, Any],
    options: StateDictOptions,
) -> None:
    for i, model in enumerate(models):
        set_model_state_dict(model, state[f"model_{i}"], options=options)
    for i, (owner, optimizer) in enumerate(pairs):
        set_optimizer_state_dict(owner, optimizer, state[f"optimizer_{i}"], options=options)


def _check_metadata(reader: SafeReader, state: dict[str, Any]) -> None:
    # dcp.load writes into the live parameters as it reads: compare names and global
    # shapes first, so a foreign checkpoint changes nothing.
    path = Path(reader.path)
    if not (path / ".metadata").exists():
        raise ValueError(
            f"load_state: {path.parent} has no sharded model state (no {SHARDED_FOLDER}/"
            ".metadata): it was saved without FSDP's sharded state dict. Load it with the "
            "strategy it was saved with."
        )
    saved = reader.read_metadata().state_dict_metadata  # refuses a tampered file
    wrong = []
    for key, value in _flatten(state):
        if not isinstance(value, torch.Tensor):
            continue  # hyperparameters and names: DCP stores them as pickled bytes
        meta = saved.get(key)
        size = tuple(getattr(meta, "size", ()))
        if meta is None:
            wrong.append(f"{key} is not in the checkpoint")
        elif size and size != tuple(value.shape):
            wrong.append(f"{key}: saved {size}, now {tuple(value.shape)}")
    if wrong:
        shown = "; ".join(wrong[:5]) + (f"; and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        raise ValueError(
            f"load_state: the sharded checkpoint in {path.parent} does not match the prepared "
            f"models and optimizers ({shown}). Load it into the same model architecture and "
            "optimizer it was saved from."
        )


def _flatten(state: Any, prefix: str = "") -> list[tuple[str, Any]]:
    # DCP's metadata keys are the dotted paths of the nested state dict.
    if isinstance(state, dict):
        items: list[tuple[str, Any]] = []
        for key, value in state.items():
            items += _flatten(value, f"{prefix}.{key}" if prefix else str(key))
        return items
    return [(prefix, state)]


def full_model_state(
    model: torch.nn.Module, *, rank0_only: bool = True, offload_to_cpu: bool = True
) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict; every rank must call.

    Torch's ``FullStateDictConfig`` settings: ``rank0_only`` (the other ranks get ``{}``),
    ``offload_to_cpu`` (else the tensors stay on the training device).
    """
    if rank0_only and offload_to_cpu:  # torch's own path: gathered into rank 0's CPU memory
        return dict(get_model_state_dict(model, options=_FULL))  # type: ignore[arg-type]
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    full: dict[str, torch.Tensor] = {}
    # Sharded entries are DTensors: each is gathered on every rank in the same order (a
    # collective), one at a time, so the device holds one whole tensor beyond the model.
    sharded = get_model_state_dict(model, options=StateDictOptions())
    model_state: dict[str, torch.Tensor] = dict(sharded)  # type: ignore[arg-type]
    for name, value in model_state.items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value.detach()
        if keep:
            full[name] = whole.to("cpu", copy=True) if offload_to_cpu else whole
    return full
