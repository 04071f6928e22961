"""``nbaccel.load_into``: trained weights into a model built in the kernel.

The weights come from wherever training left them: the kept workers (``run.state_dict()``,
``workers.state_dict()``: tensors viewing shared memory), a state dict already in hand, or
a file or folder (``save_model``'s ``model.safetensors`` or its shards, ``pytorch_model.bin``,
a ``save_state`` checkpoint's ``model_0.pt``). torch is imported only when called (the model
given is a torch module already).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The weight files a folder may hold, in the order they are looked for.
_FOLDER_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "model_0.pt",
)
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's, when saved with them


def load_into(model: Any, source: Any, *, strict: bool = False, assign: bool = False) -> Any:
    """Load trained weights into ``model`` (a module built in this process) and report what
    did not match: returns torch's ``(missing_keys, unexpected_keys)``, and says them when
    there are any.

    ``source``: a state dict; anything with a ``state_dict()`` that gives one (``run`` of a
    ``keep_workers`` launch, ``nbaccel.Workers``); or a path (a ``.safetensors``, ``.bin`` or
    ``.pt`` file, or a folder ``save_model`` or ``save_state`` wrote). ``strict=True`` raises
    on any mismatch instead; ``assign=True`` makes the model's parameters the source's
    tensors (no copy: with ``run.state_dict()``, the shared memory they view).

    >>> import torch, nbaccel
    >>> trained, fresh = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    >>> nbaccel.load_into(fresh, trained.state_dict())
    <All keys matched successfully>
    >>> torch.equal(fresh.weight, trained.weight)
    True
    """
    state = _state_of(source)
    state = _without_wrapper_prefix(state, model)
    result = model.load_state_dict(state, strict=strict, assign=assign)
    if result.missing_keys or result.unexpected_keys:
        print(f"nbaccel.load_into: {_mismatch(result.missing_keys, result.unexpected_keys)}")
    return result


def _state_of(source: Any) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    if isinstance(source, (str, Path)):
        return _read(Path(source))
    state_dict = getattr(source, "state_dict", None)
    if callable(state_dict):
        state = state_dict()
        if isinstance(state, Mapping):
            return state
    raise TypeError(
        f"load_into takes a state dict, a run or workers (their state_dict()), or a path; "
        f"got a {type(source).__name__}."
    )


def _read(path: Path) -> Mapping[str, Any]:
    """The weights a file or folder holds."""
    if path.is_dir():
        for name in _FOLDER_FILES:
            if (path / name).exists():
                return _read(path / name)
        raise FileNotFoundError(
            f"{path} holds none of {', '.join(_FOLDER_FILES)}: point load_into at the weights "
            "file itself, or at the folder save_model (or save_state) wrote."
        )
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.name.endswith(".index.json"):  # shards: {"weight_map": {key: file}}
        files = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        merged: dict[str, Any] = {}
        for name in files:
            merged.update(_read(path.parent / name))
        return merged
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    import torch

    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, Mapping):
        raise TypeError(f"{path} holds a {type(loaded).__name__}, not a state dict")
    return loaded


def _without_wrapper_prefix(state: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """``state`` with a wrapper's prefix taken off every key, when every key has it and the
    model's keys do not (weights saved from a DDP or compiled model)."""
    own = set(model.state_dict())
    for prefix in _WRAPPER_PREFIXES:
        if state and all(key.startswith(prefix) for key in state) and not own & set(state):
            return {key[len(prefix) :]: value for key, value in state.items()}
    return state


def _mismatch(missing: list[str], unexpected: list[str]) -> str:
    """What did not match, briefly.

    >>> _mismatch(["a.weight"], [])
    "1 of the model's keys had no weights in the source (kept as they were): 'a.weight'"
    """
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} of the model's keys had no weights in the source (kept as they "
            f"were): {_first(missing)}"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} keys of the source are not in the model (ignored): "
            f"{_first(unexpected)}"
        )
    return "; ".join(parts)


def _first(keys: list[str], shown: int = 5) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(map(repr, keys[:shown])) + more
