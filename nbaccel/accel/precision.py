"""Mixed precision: autocast on the right device type, fp32 master weights, fp16 loss scaling.

Parameters and gradients stay fp32; only the forward pass runs in ``bf16``/``fp16`` under
``torch.autocast``. fp16 adds a ``GradScaler`` for the device (a bare ``GradScaler()``
assumes CUDA and silently disables itself on CPU), whose state goes into checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from nbaccel.config.schema import MIXED_PRECISIONS
from nbaccel.errors import ConfigError

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Precision:
    """The precision policy of one Accelerator.

    >>> p = Precision("bf16", torch.device("cpu"))
    >>> with p.autocast():
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
    >>> p.scaler is None
    True
    """

    def __init__(
        self,
        mode: str,
        device: torch.device,
        sharded: bool = False,
        engine_scales: bool = False,
        scaler_kwargs: dict[str, Any] | None = None,
        autocast_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if mode not in MIXED_PRECISIONS:
            raise ConfigError(
                f"mixed_precision={mode!r} is not one of {', '.join(map(repr, MIXED_PRECISIONS))}.",
                field="mixed_precision",
            )
        check_device_supports(mode, device)
        self.mode = mode
        self.device = device
        self.dtype = _DTYPES.get(mode)
        # AutocastKwargs' (enabled, cache_enabled) and GradScalerKwargs' keywords.
        self.autocast_kwargs = dict(autocast_kwargs or {})
        scaler_kwargs = dict(scaler_kwargs or {})
        self.scaler: torch.amp.GradScaler | None = None
        if mode != "fp16" or engine_scales:  # DeepSpeed's engine scales fp16 losses itself
            return
        if sharded:
            # Each FSDP rank sees only its gradient shards: the sharded scaler all-reduces
            # "found inf" so that every rank skips the same steps.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device.type, **scaler_kwargs)
        else:
            self.scaler = torch.amp.GradScaler(device.type, **scaler_kwargs)

    def forward_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """What a prepared model's forward runs under: ``autocast()`` with no override,
        as one ``torch.autocast`` object (no generator around it: it runs every step)."""
        options = dict(self.autocast_kwargs)
        if self.dtype is None or not options.pop("enabled", True):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, **options)

    @contextlib.contextmanager
    def autocast(self, enabled: bool = True, **handler: Any) -> Iterator[None]:
        """Run the block under autocast for this precision (a no-op for ``"no"``).

        ``handler``: an ``AutocastKwargs``' keywords (``enabled``, ``cache_enabled``), over
        the Accelerator's own handler.
        """
        options = {**self.autocast_kwargs, **handler}
        if self.dtype is None or not enabled or not options.pop("enabled", True):
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype, **options):
            yield


def check_device_supports(mode: str, device: torch.device) -> None:
    """Raise ConfigError when ``device`` cannot run ``mode``; before any state is changed."""
    if mode == "bf16" and device.type == "cuda" and not _cuda_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"mixed_precision='bf16' needs a GPU with bfloat16 support (compute capability 8.0 "
            f"or newer, e.g. A100, H100), but {name} has none. Use mixed_precision='fp16', or "
            "'no'.",
            field="mixed_precision",
        )
    if mode != "no" and device.type not in ("cpu", "cuda", "xla", "mps"):
        raise ConfigError(
            f"mixed_precision={mode!r} is not available on device type {device.type!r}. Use "
            "mixed_precision='no'.",
            field="mixed_precision",
        )


def _cuda_bf16_supported() -> bool:
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))
