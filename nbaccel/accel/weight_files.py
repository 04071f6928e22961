"""The weight files ``save_model`` writes, as Accelerate (and transformers) lay them out.

One file when the weights fit in ``max_shard_size`` — ``model.safetensors``, or
``pytorch_model.bin`` with ``safe_serialization=False`` — else numbered shards
(``model-00001-of-00003.safetensors``) and an index (``model.safetensors.index.json``:
``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``) that ``from_pretrained``
and ``safetensors``/``torch.load`` users read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from nbaccel.accel import models

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
        written = models.save_state_file(weights, path.parent)
        return written if path.name == written.name else written.replace(path)
    partial = path.with_name(f".{path.name}.partial")
    torch.save({k: v.detach().cpu() for k, v in weights.items()}, partial)
    return partial.replace(path)
