"""CPU tensors out of band: their storage as a ``PickleBuffer``, rebuilt around the receiver's
mapped view (torch's own pickling copies the storage into the pickle).

Only where the sending process already has torch (a kernel that imported it, any worker):
``reduce_tensor`` looks torch up in ``sys.modules`` and never imports it. It takes plain
tensors and parameters that own their whole storage (contiguous, from offset 0), on the
CPU, without hooks or subclasses; anything else (views into a larger storage, CUDA,
sparse, quantized) is pickled by torch as before. Two references to one tensor arrive as
one tensor; the receiver's tensor is writable, and writes stay in its process
(``segments.map_private``). Attributes set on a tensor or parameter (``t.meta = ...``)
travel with it, as torch's pickling keeps them.

The buffer handed out is a numpy view of the storage, made for the pickle and gone after
it: ``owner_of`` names the tensor behind it, so that the kernel's cache lets go of the
segment when the user's tensor goes (``cache``).
"""

from __future__ import annotations

import pickle
import sys
import weakref
from typing import Any

from nbaccel.launcher.sharing.packing import MIN_OUT_OF_BAND

# id() of a storage view handed out for a pickle -> the tensor it views; each goes with its
# view (a view lives as long as the pickle, or the cache's check of it, needs it).
_OWNERS: dict[int, Any] = {}


def owner_of(buffer_owner: object) -> object:
    """The object whose life an out-of-band buffer's memory follows: the tensor behind a
    storage view ``reduce_tensor`` made, else ``buffer_owner`` itself."""
    return _OWNERS.get(id(buffer_owner), buffer_owner)


def reduce_tensor(obj: Any) -> tuple[Any, ...] | None:
    """A reduction that hands out ``obj``'s storage as an out-of-band buffer, or None
    (pickle it as torch does)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    kind = type(obj)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        return None
    if not _plain(torch, obj):
        return None
    if obj._backward_hooks:
        return None  # torch's own pickling decides what becomes of hooks
    try:
        data = obj.detach().view(torch.uint8).numpy()  # the storage's bytes, not a copy
    except (RuntimeError, TypeError):  # numpy not installed, or a dtype it cannot view
        return None
    key = id(data)
    _OWNERS[key] = obj
    weakref.finalize(data, _OWNERS.pop, key, None)
    dtype = str(obj.dtype).removeprefix("torch.")
    return rebuild_tensor, (
        pickle.PickleBuffer(data),
        dtype,
        tuple(obj.shape),
        obj.requires_grad,
        kind is torch.nn.Parameter,
        dict(vars(obj)) or None,  # its own attributes (``t.meta = ...``), as torch keeps them
    )


def _plain(torch: Any, tensor: Any) -> bool:
    nbytes = tensor.numel() * tensor.element_size()
    return bool(
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and nbytes >= MIN_OUT_OF_BAND
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == nbytes
        and (tensor.is_leaf or not tensor.requires_grad)
    )


def rebuild_tensor(
    buffer: Any,
    dtype: str,
    shape: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
    attributes: dict[str, Any] | None = None,
) -> Any:
    """The tensor ``reduce_tensor`` described, viewing ``buffer`` (no copy where it is
    writable, as a mapped segment is)."""
    import torch

    if not isinstance(buffer, (bytearray, memoryview)) or memoryview(buffer).readonly:
        buffer = bytearray(buffer)  # torch.frombuffer warns on read-only memory
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    tensor = flat.view(getattr(torch, dtype)).view(shape)
    if parameter:
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    else:
        tensor = tensor.requires_grad_(requires_grad)
    for name, value in (attributes or {}).items():
        setattr(tensor, name, value)  # as torch's own rebuild does (_set_obj_state)
    return tensor
