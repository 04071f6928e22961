"""The weight files ``save_model`` writes, as Accelerate (and transformers) lay them out.

One file when the weights fit in ``max_shard_size`` — ``model.safetensors``, or
``pytorch_model.bin`` with ``safe_serialization=False`` — else numbered shards
(``model-00001-of-00003.safetensors``) and an index (``model.safetensors.index.json``:
``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``) that ``from_pretrained``
and ``safetensors``/``torch.load`` users read.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size_in_bytes(size: int | str) -> int:
    """``"10GB"`` (powers of ten, as Hugging Face reads them), ``"5GiB"`` or bytes.

    >>> size_in_bytes("10GB"), size_in_bytes("1MiB"), size_in_bytes(123)
    (10000000000, 1048576, 123)
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if match is None:
        raise ValueError(
            f"max_shard_size={size!r} is not a size: give bytes (an int) or a number with a "
            "unit such as '10GB', '500MB' or '4GiB'."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def write_weights(
    weights: dict[str, torch.Tensor],
    directory: Path,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[Path]:
    """Write ``weights`` under ``directory`` in one file or shards; returns the files."""
    limit = size_in_bytes(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name, tensor in weights.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and filled + size > limit:  # a tensor over the limit gets its own
            shards.append({})
            filled = 0
        shards[-1][name] = tensor
        filled += size
    stem, suffix = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    directory.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        return [_write(shards[0], directory / f"{stem}.{suffix}", safe_serialization)]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        path = directory / f"{stem}-{number:05d}-of-{len(shards):05d}.{suffix}"
        written.append(_write(shard, path, safe_serialization))
        weight_map |= dict.fromkeys(shard, path.name)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / f"{stem}.{suffix}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return written


def _write(weights: dict[str, torch.Tensor], path: Path, safe: bool) -> Path:
    if safe:
        written = save_state_file(weights, path.parent)
        return written if path.name == written.name else written.replace(path)
    partial = path.with_name(f".{path.name}.partial")
    torch.save({k: v.detach().cpu() for k, v in weights.items()}, partial)
    return partial.replace(path)


def save_state_file(weights: dict[str, torch.Tensor], directory: Path) -> Path:
    """Write a state dict to ``directory/model.safetensors``, atomically."""
    from safetensors.torch import save_model

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    partial = directory / ".model.safetensors.partial"
    cpu_copy = {k: _own_storage(v.detach().cpu()) for k, v in weights.items()}
    # save_model reads state_dict(); give it CPU tensors without moving the live model.
    holder = _StateHolder(cpu_copy)
    save_model(holder, str(partial), metadata={"format": "pt"})
    # safetensors creates its file 0600; a checkpoint is the user's output, so it gets the
    # mode any file they create gets (what torch.save gives): 0666 minus the umask.
    partial.chmod(0o666 & ~current_umask())
    partial.replace(path)
    return path


def current_umask() -> int:
    """This process's umask, read without changing it (Linux); else set and put back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    # A slice of a bigger buffer (FSDP's gathered parameters) is refused by safetensors as
    # "not covering the entire storage"; tied weights (a whole shared storage) stay shared.
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole else tensor.clone()


class _StateHolder(torch.nn.Module):
    """A module whose state_dict is a given dict; lets safetensors save a CPU copy."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._state = state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._state
