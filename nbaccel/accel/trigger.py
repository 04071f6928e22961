"""``Accelerator.set_trigger`` / ``check_trigger``: one rank tells all to stop (early stopping).

Any rank may ``set_trigger()`` (say its loss went NaN); every rank then calls
``check_trigger()`` at the same point of the loop, which sums the flags over ranks (one
all-reduce) and answers ``True`` everywhere if any rank set it, then clears it. As in
Accelerate the flag is a tensor on the device (``flag_tensor``), created on first use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class TriggerFlag:
    """The flag behind ``set_trigger`` / ``check_trigger``.

    ``reduce`` sums a tensor over ranks (the Accelerator's ``reduce``); it must be called by
    every rank, so ``check`` must be too.

    >>> flag = TriggerFlag(torch.device("cpu"), reduce=lambda t: t)
    >>> flag.check()
    False
    >>> flag.set()
    >>> flag.check(), flag.check()
    (True, False)
    """

    def __init__(
        self, device: torch.device, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.device = device
        self.reduce = reduce
        self.tensor: torch.Tensor | None = None  # Accelerate's flag_tensor

    def set(self) -> None:
        """Raise the flag on this rank (no communication)."""
        self.tensor = torch.tensor(1, device=self.device)

    def check(self) -> bool:
        """Whether any rank raised the flag since the last check; clears it. Collective."""
        if self.tensor is None:
            self.tensor = torch.tensor(0, device=self.device)
        raised = int(self.reduce(self.tensor).item()) >= 1
        if raised:
            self.tensor = torch.tensor(0, device=self.device)
        return raised
