"""``save_state`` / ``load_state``: whole-training checkpoints, written atomically.

Layout of a checkpoint folder ``ckpt/``::

    ckpt/LATEST                 the name of the complete state folder (replaced atomically)
    ckpt/state-<id>/meta.json   format, counts, step counters, dataloader positions
    ckpt/state-<id>/model_0.pt, optimizer_0.pt, scheduler_0.pt, scaler.pt, custom_0.pt
    ckpt/state-<id>/random_states_<rank>.pt   python, numpy, torch, CUDA and XLA RNGs, per rank
    ckpt/state-<id>/sharded/    FSDP's model and optimizer shards (DCP), instead of model_*.pt

Model weights and optimizer state load onto any number of processes (sharded ones are
resharded by DCP); dataloader positions are converted to the new number of processes, and a
rank that did not exist when saving keeps its own random state.

Every rank writes into ``ckpt/.partial-<id>``; after a barrier rank 0 renames it to
``state-<id>`` and only then points ``LATEST`` at it, fsyncing each step first
(``checkpoint_files.publish``). A crash, a killed rank or a power loss at any moment leaves
``LATEST`` naming the previous whole checkpoint. Loading reads and checks every file before
it changes anything, with ``weights_only=True`` (DCP's pickled metadata through an
allowlist, ``safe_dcp``), and refuses names that lead out of the folder. On XLA devices
(``DeviceHooks``) tensors are copied to the CPU before they are written, so checkpoints load
anywhere.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.accel.checkpoints import sharded_checkpoint
from nbaccel.accel.checkpoints.checkpoint_files import fsync_file, inside, publish

FORMAT = 1
LATEST = "LATEST"
_LAYOUT_HINT = {
    "plain": "whole state dicts, as DDP and single-process runs write them",
    "sharded": "FSDP with fsdp_state_dict_type=SHARDED_STATE_DICT",
    "full": "FSDP with fsdp_state_dict_type=FULL_STATE_DICT",
    "deepspeed": "DeepSpeed's own checkpoint of its engine",
}
_ACCELERATE_FILES = ("model.safetensors", "pytorch_model.bin", "optimizer.bin")


@dataclass
class DeviceHooks:
    """How a device that torch.distributed does not drive (XLA) saves and agrees.

    ``to_host`` copies device tensors to the CPU before ``torch.save``; ``barrier`` and
    ``share`` (rank 0's string on every rank) replace the process group's; the device's own
    random state is saved and restored per rank (and set back after saving, so the saving
    run goes on as a loading one does); ``after_load`` runs before that state is restored.
    """

    to_host: Callable[[Any], Any]
    barrier: Callable[[], None]
    share: Callable[[str], str]
    rng_state: Callable[[], Any]
    set_rng_state: Callable[[Any], None]
    after_load: Callable[[], None]


@dataclass
class Stateful:
    """The objects a checkpoint covers, in ``prepare`` order within each kind."""

    models: Sequence[torch.nn.Module]
    optimizers: Sequence[Any]
    schedulers: Sequence[Any]
    dataloaders: Sequence[Any]
    scaler: torch.amp.GradScaler | None
    custom: Sequence[Any]
    # plain: rank 0 writes whole state dicts; sharded / full: FSDP through DCP
    # (nbaccel.accel.checkpoints.sharded_checkpoint), every rank taking part.
    layout: str = "plain"
    engine: Any = None  # layout "deepspeed": the DeepSpeedRun whose engine checkpoints itself
    device: DeviceHooks | None = None  # XLA; None: torch.distributed and plain torch.save

    def counts(self) -> dict[str, int]:
        return {
            "models": len(self.models),
            "optimizers": len(self.optimizers),
            "schedulers": len(self.schedulers),
            "dataloaders": len(self.dataloaders),
            "scaler": int(self.scaler is not None),
            "custom": len(self.custom),
        }


def save_state(
    directory: str | os.PathLike[str],
    objects: Stateful,
    *,
    rank: int,
    world_size: int,
    progress: dict[str, int],
    name: str | None = None,
    keep: int = 1,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint of ``objects`` under ``directory``; every rank must call it.

    ``name``: the state's name when every rank knows it already (periodic saves name it by
    the step), else rank 0 draws one and shares it. ``keep``: how many states stay.
    ``extra_files(staging)``: each rank's own additions (compiled artifacts, the metrics).
    """
    root = Path(directory)
    hooks = objects.device
    host = hooks.to_host if hooks is not None else _same
    barrier = hooks.barrier if hooks is not None else _barrier
    share = hooks.share if hooks is not None else _broadcast
    if name is None:
        name = _agree_on_name(root, rank, share)  # rank 0 made the folder before sharing
    else:
        _prepare_named(root, rank, name)
        barrier()  # the staging folder exists before any rank writes into it
    staging = root / f".partial-{name}"
    inner_optimizers = [getattr(o, "optimizer", o) for o in objects.optimizers]
    if objects.layout == "deepspeed":  # every rank writes its ZeRO partitions
        objects.engine.save_checkpoint(staging)
    elif objects.layout != "plain":
        sharded_checkpoint.save(
            staging, objects.models, inner_optimizers, full=objects.layout == "full", rank=rank
        )
    for optimizer in inner_optimizers:
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: every rank sends its part
            optimizer.consolidate_state_dict(to=0)
    if rank == 0 and objects.layout == "plain":
        for i, model in enumerate(objects.models):
            torch.save(host(model.state_dict()), staging / f"model_{i}.pt")
        for i, optimizer in enumerate(objects.optimizers):
            torch.save(host(optimizer.state_dict()), staging / f"optimizer_{i}.pt")
    if rank == 0:
        for i, scheduler in enumerate(objects.schedulers):
            torch.save(host(scheduler.state_dict()), staging / f"scheduler_{i}.pt")
        if objects.scaler is not None:
            torch.save(objects.scaler.state_dict(), staging / "scaler.pt")
        for i, obj in enumerate(objects.custom):
            torch.save(host(obj.state_dict()), staging / f"custom_{i}.pt")
        (staging / "meta.json").write_text(json.dumps(meta(objects, world_size, progress)))
    if extra_files is not None:
        extra_files(staging)
    randomness = rng_states()
    if hooks is not None:
        randomness["device"] = hooks.rng_state()
    random_file = staging / f"random_states_{rank}.pt"
    torch.save(randomness, random_file)
    # The one file every rank writes: on storage shared between machines only the machine
    # that wrote it can flush it. Rank 0's own files are flushed by publish() below.
    fsync_file(random_file)
    barrier()  # every rank's files are in the staging folder
    final = root / f"state-{name}"
    if rank == 0:
        # Every file and folder of the state is fsynced here (rank 0's, DCP's metadata,
        # DeepSpeed's; the other ranks flushed their own, and DCP syncs its shards), then the
        # folder is renamed and LATEST moved, durably at each step. After the barrier nobody
        # writes there, so the walk races with nothing.
        publish(root, staging, final, LATEST)
        prune(root, keep, final)
    barrier()  # nobody reads or saves again before the commit
    if hooks is not None:
        # XLA advances its seed at every graph cut (sync), and saving cut several after the
        # seed was read: go on from the seed as saved, where a loading run goes on from.
        hooks.set_rng_state(randomness["device"])
    return final


def meta(objects: Stateful, world_size: int, progress: dict[str, int]) -> dict[str, Any]:
    """What ``meta.json`` holds: the format, the layout and counts that loading checks, the
    step counters, each dataloader's position, and when it was saved."""
    return {
        "format": FORMAT,
        "layout": objects.layout,
        "counts": objects.counts(),
        "world_size": world_size,
        "progress": progress,
        "dataloaders": [loader.state_dict() for loader in objects.dataloaders],
        "saved_at": time.time(),
    }


def prune(root: Path, keep: int, final: Path) -> None:
    """Remove all but the ``keep`` newest states (``final``, just published, among them)."""
    states = [p for p in root.glob("state-*") if p != final and p.is_dir()]
    states.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in states[max(0, keep - 1) :]:
        shutil.rmtree(old, ignore_errors=True)


def _prepare_named(root: Path, rank: int, name: str) -> None:
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".partial-*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        (root / f".partial-{name}").mkdir()


def _agree_on_name(root: Path, rank: int, share: Callable[[str], str]) -> str:
    name = uuid.uuid4().hex[:12] if rank == 0 else ""
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".partial-*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        (root / f".partial-{name}").mkdir()
    return share(name)


def _broadcast(name: str) -> str:
    names = [name]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(names, src=0)
    return names[0]


def _same(state: Any) -> Any:
    return state


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def load_state(
    directory: str | os.PathLike[str], objects: Stateful, *, rank: int, world_size: int = 1
) -> dict[str, int]:
    """Restore ``objects`` from the checkpoint under ``directory``; returns the progress saved
    with it (step counters).

    Raises FileNotFoundError / ValueError, changing nothing, when the folder is missing,
    holds only an interrupted save, is not an nbaccel checkpoint, or does not match.
    """
    folder = find_checkpoint(Path(directory))
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{folder} has checkpoint format {meta.get('format')!r}; this nbaccel reads "
            f"format {FORMAT}. Load it with the nbaccel version that wrote it."
        )
    _check_counts(folder, meta["counts"], objects.counts())
    layout = meta.get("layout", "plain")
    if layout != objects.layout:
        raise ValueError(
            f"load_state: {folder} holds the {layout!r} model layout, but this Accelerator "
            f"saves and loads {objects.layout!r} ({_LAYOUT_HINT[objects.layout]}). Load it with "
            "the strategy and fsdp_state_dict_type it was saved with."
        )

    # Read everything first: a bad file must not leave a half-restored training state.
    def load(name: str) -> Any:
        return torch.load(folder / name, map_location="cpu", weights_only=True)

    plain = layout == "plain"
    models = [load(f"model_{i}.pt") for i in range(len(objects.models))] if plain else []
    optimizers = (
        [load(f"optimizer_{i}.pt") for i in range(len(objects.optimizers))] if plain else []
    )
    schedulers = [load(f"scheduler_{i}.pt") for i in range(len(objects.schedulers))]
    scaler = load("scaler.pt") if objects.scaler is not None else None
    custom = [load(f"custom_{i}.pt") for i in range(len(objects.custom))]
    rng_file = folder / f"random_states_{rank}.pt"
    rngs = load(rng_file.name) if rng_file.exists() else None
    if layout == "deepspeed":
        objects.engine.load_checkpoint(folder)
    elif not plain:  # checks DCP's metadata before it fills the parameters in place
        inner = [getattr(o, "optimizer", o) for o in objects.optimizers]
        sharded_checkpoint.load(folder, objects.models, inner, full=layout == "full")
    for model, state in zip(objects.models, models, strict=False):
        model.load_state_dict(state)
    for optimizer, state in zip(objects.optimizers, optimizers, strict=False):
        optimizer.load_state_dict(state)
    for scheduler, state in zip(objects.schedulers, schedulers, strict=True):
        scheduler.load_state_dict(state)
    if objects.scaler is not None and scaler is not None:
        objects.scaler.load_state_dict(scaler)
    for obj, state in zip(objects.custom, custom, strict=True):
        obj.load_state_dict(state)
    saved_world = int(meta.get("world_size", world_size))
    for loader, state in zip(objects.dataloaders, meta["dataloaders"], strict=True):
        loader.load_state_dict(state, saved_world_size=saved_world)
    if objects.device is not None:
        objects.device.after_load()  # before the seed is set: a cut advances XLA's seed
    if rngs is not None:  # absent when this run has more ranks than the saving one
        set_rng_states(rngs)
        if objects.device is not None and "device" in rngs:
            objects.device.set_rng_state(rngs["device"])
    return {name: int(value) for name, value in meta["progress"].items()}


def find_checkpoint(root: Path) -> Path:
    """The complete state folder ``root/LATEST`` names, or a clear error."""
    if not root.is_dir():
        raise FileNotFoundError(
            f"load_state: no checkpoint folder at {root}. Check the path, or call "
            "save_state() with it first."
        )
    pointer = root / LATEST
    if not pointer.exists() and root.name.startswith("state-") and (root / "meta.json").exists():
        return root  # a state folder itself (what a durable copy is fetched as)
    if not pointer.exists():
        if any(root.glob(".partial-*")):
            why = "it holds only a save that never finished (the run stopped during save_state)"
        elif any((root / f).exists() for f in _ACCELERATE_FILES):
            why = "it looks like a Hugging Face Accelerate checkpoint, which nbaccel cannot read"
        else:
            why = f"it has no {LATEST} file naming a saved state"
        raise ValueError(
            f"load_state: {root} is not a complete nbaccel checkpoint: {why}. Pass a folder "
            "written by Accelerator.save_state()."
        )
    name = pointer.read_text().strip()
    folder = inside(root, name, what=f"{root}/{LATEST}")
    if Path(name).name != name or not name.startswith("state-"):
        raise ValueError(
            f"load_state: {root}/{LATEST} names {name!r}, but it must name a state-* folder "
            "directly inside the checkpoint folder, as save_state writes it; nothing was "
            "loaded. The file was edited or damaged: restore the checkpoint or save again."
        )
    if not (folder / "meta.json").exists():
        raise ValueError(
            f"load_state: {root}/{LATEST} names {folder.name}, which is missing or incomplete "
            "(was it copied partially?). Restore the folder or save again."
        )
    return folder


def _check_counts(folder: Path, saved: dict[str, int], current: dict[str, int]) -> None:
    wrong = [
        f"{k}: saved {saved.get(k, 0)}, prepared now {v}"
        for k, v in current.items()
        if saved.get(k, 0) != v
    ]
    if wrong:
        raise ValueError(
            f"load_state: the checkpoint in {folder} does not match this Accelerator ("
            + "; ".join(wrong)
            + "). prepare() the same models, optimizers, schedulers and dataloaders, with the "
            "same mixed_precision and register_for_checkpointing() calls, as the saving run."
        )


def rng_states() -> dict[str, Any]:
    """This process's random number generator states, loadable with weights_only=True."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        assert isinstance(keys, np.ndarray)
        # ndarrays do not pass weights_only loading; tensors and plain values do.
        states["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(_as_tuple(states["python"]))
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        n = states["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
        )
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _as_tuple(value: Any) -> Any:
    # random.setstate needs tuples; a round trip through torch.load may give lists.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
