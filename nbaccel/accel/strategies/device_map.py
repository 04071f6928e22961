"""``Accelerator.verify_device_map``: was this model dispatched over devices for inference?

Big-model inference (``from_pretrained(..., device_map="auto")``) spreads a model's layers over
several devices and records the placement in ``hf_device_map``. Such a model cannot be trained
with data parallelism; Accelerate's ``verify_device_map`` tells it apart, and so does this.
"""

from __future__ import annotations

import torch


def verify_device_map(model: torch.nn.Module) -> bool:
    """True when ``model`` or a submodule has an ``hf_device_map`` with more than one entry.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> verify_device_map(model)
    False
    >>> model[1].hf_device_map = {"0": "cpu", "1": "disk"}
    >>> verify_device_map(model)
    True
    """
    return any(len(getattr(m, "hf_device_map", None) or ()) > 1 for m in model.modules())
