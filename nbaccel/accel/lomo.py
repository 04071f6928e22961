"""LOMO optimizers (``lomo_optim.Lomo`` / ``AdaLomo``): Accelerate's ``lomo_backward``.

LOMO fuses the update into the backward pass: ``optimizer.fused_backward(loss, lr)`` computes
each gradient and applies it at once, so no gradient is kept and ``optimizer.step()`` does
nothing. As in Accelerate:

- ``accelerator.backward(loss, learning_rate=lr)`` with a LOMO optimizer prepared goes through
  ``lomo_backward`` (after dividing the loss by the accumulation steps); the prepared LOMO
  optimizer's ``step`` is a no-op;
- ``lomo_backward(loss, learning_rate)`` calls ``fused_backward`` of every prepared LOMO
  optimizer, and raises ``ValueError`` without a learning rate or without a LOMO optimizer
  (Accelerate's type: a program that catches it keeps working).

LOMO optimizers are recognised by class (``Lomo`` or ``AdaLomo`` from the ``lomo_optim``
package), without importing ``lomo_optim``: it imports transformers, which takes seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_LOMO_CLASSES = frozenset({"Lomo", "AdaLomo"})


def is_lomo_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the optimizer a prepared one wraps) is a LOMO optimizer.

    >>> is_lomo_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    False
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the user's
    return any(
        klass.__name__ in _LOMO_CLASSES and klass.__module__.split(".")[0] == "lomo_optim"
        for klass in type(inner).__mro__
    )


def lomo_backward(
    loss: torch.Tensor, learning_rate: float | None, optimizers: Iterable[Any]
) -> None:
    """``fused_backward(loss, learning_rate)`` on each LOMO optimizer among ``optimizers``.

    >>> lomo_backward(torch.tensor(1.0), 0.1, [])
    Traceback (most recent call last):
    ...
    ValueError: lomo_backward found no LOMO optimizer among the 0 prepared optimizers: ...
    """
    if learning_rate is None:
        raise ValueError(
            "lomo_backward needs the learning rate: LOMO applies the update inside the backward "
            "pass. Call accelerator.backward(loss, learning_rate=lr) (or lomo_backward(loss, lr))."
        )
    optimizers = list(optimizers)
    lomo = [getattr(o, "optimizer", o) for o in optimizers if is_lomo_optimizer(o)]
    if not lomo:
        kinds = ", ".join(sorted({type(getattr(o, "optimizer", o)).__name__ for o in optimizers}))
        raise ValueError(
            f"lomo_backward found no LOMO optimizer among the {len(optimizers)} prepared "
            f"optimizers{f' ({kinds})' if kinds else ''}: it runs the fused backward of "
            "lomo_optim.Lomo / AdaLomo only. Prepare one (pip install lomo-optim; "
            "accelerator.prepare(Lomo(model, lr=...))), or call accelerator.backward(loss) "
            "without learning_rate for other optimizers."
        )
    for optimizer in lomo:
        optimizer.fused_backward(loss, learning_rate)
