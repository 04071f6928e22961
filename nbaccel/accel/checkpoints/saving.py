"""``Accelerator.save``: ``torch.save`` (or safetensors) from one process, as in Accelerate.

Libraries pass it as their writer, e.g. ``model.save_pretrained(dir, save_function=acc.save)``
(transformers 4.x, diffusers, peft), and call it on every rank; only one process writes, so
the ranks never race on the same file:

- the main process, or each machine's local main process with ``save_on_each_node``
  (``ProjectConfiguration(save_on_each_node=True)``), for folders that are not shared;
- ``safe_serialization=False`` (the default): ``torch.save(obj, f)``, any picklable object,
  ``f`` a path or a file object; tensors that share storage (tied weights) stay shared;
- ``safe_serialization=True``: a safetensors file holding a dict of tensors, with the
  ``{"format": "pt"}`` metadata transformers' loaders look for. safetensors refuses tensors that
  share memory, so of each group of names that share storage the first is kept and the others
  are dropped with a warning (``from_pretrained`` re-ties them), as Accelerate does; non-
  contiguous tensors are made contiguous.

Keys are written as given: a ``module.`` prefix from a DDP-wrapped model's ``state_dict`` stays
(Accelerate does not strip it either; ``accelerator.get_state_dict(model)`` gives clean names).
XLA tensors are copied to the CPU first, as Accelerate does on TPUs.

Where Accelerate is narrower: it drops shared tensors only from an ``OrderedDict`` (what
``state_dict()`` returns) and lets safetensors fail on a plain ``dict``; nbaccel treats every
dict alike, so ``{k: v for k, v in model.state_dict().items()}`` saves too.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import IO, Any

import torch

from nbaccel.accel.nested.collectives import tree_map


def writes_here(
    is_main_process: bool, is_local_main_process: bool, save_on_each_node: bool = False
) -> bool:
    """Whether this process is the one that writes: main process, or local main per node.

    >>> writes_here(True, True), writes_here(False, True), writes_here(False, True, True)
    (True, False, True)
    """
    return is_local_main_process if save_on_each_node else is_main_process


def save(
    obj: Any,
    f: str | os.PathLike[str] | IO[bytes],
    *,
    is_main_process: bool,
    is_local_main_process: bool,
    save_on_each_node: bool = False,
    safe_serialization: bool = False,
) -> None:
    """Write ``obj`` to ``f`` from the process that writes (see the module docstring).

    The others return at once: wait with ``wait_for_everyone()`` before reading the file on
    another rank.

    >>> import tempfile, pathlib
    >>> from safetensors.torch import load_file
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "model.safetensors"
    >>> weights = torch.nn.Linear(2, 2).state_dict()
    >>> save(weights, path, is_main_process=True, is_local_main_process=True,
    ...      safe_serialization=True)
    >>> sorted(load_file(path))
    ['bias', 'weight']
    >>> save(weights, path.with_name("rank1.bin"), is_main_process=False,
    ...      is_local_main_process=False)
    >>> path.with_name("rank1.bin").exists()  # only the main process writes
    False
    """
    if not writes_here(is_main_process, is_local_main_process, save_on_each_node):
        return
    obj = tree_map(_off_xla, obj, other=lambda leaf: leaf)
    if not safe_serialization:
        torch.save(obj, f)
        return
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(
            f"save(..., safe_serialization=True) writes a safetensors file, which needs a path; "
            f"got {type(f).__name__}. Pass a file name, or safe_serialization=False to "
            "torch.save into a file object."
        )
    from safetensors.torch import save_file

    save_file(_safetensors_ready(obj), os.fspath(f), metadata={"format": "pt"})


def _off_xla(tensor: torch.Tensor) -> torch.Tensor:
    # torch_xla tensors all report one storage pointer, which would make every tensor look
    # tied; on the CPU they are ordinary tensors (Accelerate converts them too).
    return tensor.cpu() if tensor.device.type == "xla" else tensor


def _safetensors_ready(obj: Any) -> dict[str, torch.Tensor]:
    """``obj`` as safetensors takes it: names to contiguous tensors, no two sharing memory."""
    if not isinstance(obj, Mapping):
        raise TypeError(
            f"save(..., safe_serialization=True) writes a safetensors file, which holds a dict "
            f"of tensors; got {type(obj).__name__}. Pass a state dict, or "
            "safe_serialization=False to torch.save any picklable object."
        )
    not_tensors = sorted(str(k) for k, v in obj.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise TypeError(
            f"save(..., safe_serialization=True): safetensors holds only tensors, but "
            f"{', '.join(not_tensors[:5])} {'is' if len(not_tensors) == 1 else 'are'} not. "
            "Save those with safe_serialization=False (torch.save), or leave them out."
        )
    kept: dict[str, torch.Tensor] = {}
    first_of_storage: dict[tuple[torch.device, int, int], str] = {}
    dropped: list[str] = []
    for name, tensor in obj.items():
        key = _storage_key(tensor)
        if key in first_of_storage:
            dropped.append(str(name))
            continue
        first_of_storage[key] = str(name)
        kept[str(name)] = tensor.contiguous()
    if dropped:
        warnings.warn(
            f"save(..., safe_serialization=True) left out {', '.join(dropped)}: they share "
            "memory with a tensor saved under another name (tied weights), which safetensors "
            "cannot store twice. from_pretrained re-ties them; loading by name needs the tie "
            "restored by hand (safetensors.torch.load_model does it).",
            stacklevel=4,  # the program's acc.save(...) call, through the facade
        )
    return kept


def _storage_key(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """Tensors with equal keys share memory: same storage, and it is not empty.

    Empty tensors get their own key (id), as safetensors only refuses overlapping bytes.
    """
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return (tensor.device, id(tensor), 0)
    return (tensor.device, storage.data_ptr(), storage.nbytes())
