"""``accelerate.utils.save``: ``torch.save`` (or safetensors) from one process, module-level.

The same writer as ``Accelerator.save`` (``nbaccel.accel.checkpoints.saving``), for code that has no
``Accelerator`` at hand: which process this is comes from ``PartialState()``, as in
Accelerate. Call it on every rank; only the main process (or, with ``save_on_each_node``,
each machine's local main process) writes, the others return at once.
"""

from __future__ import annotations

import os
from typing import IO, Any

from nbaccel.accel.checkpoints import saving
from nbaccel.accel.partial_state import PartialState

__all__ = ["save"]


def save(
    obj: Any,
    f: str | os.PathLike[str] | IO[bytes],
    save_on_each_node: bool = False,
    safe_serialization: bool = False,
) -> None:
    """Write ``obj`` to ``f`` from the process that writes; a stand-in for ``torch.save``.

    ``safe_serialization=True`` writes a safetensors file of a dict of tensors (tied weights
    kept once, with a warning), as ``Accelerator.save`` does.

    >>> import tempfile, pathlib, torch
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "weights.bin"
    >>> save({"w": torch.ones(2)}, path)
    >>> torch.load(path)
    {'w': tensor([1., 1.])}
    """
    state = PartialState()
    saving.save(
        obj,
        f,
        is_main_process=state.is_main_process,
        is_local_main_process=state.is_local_main_process,
        save_on_each_node=save_on_each_node,
        safe_serialization=safe_serialization,
    )
