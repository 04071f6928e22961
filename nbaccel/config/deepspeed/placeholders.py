"""``DummyOptim`` and ``DummyScheduler``: stand-ins for the optimizer and LR scheduler that a
DeepSpeed config builds. Torch-free.

When the DeepSpeed config has an ``optimizer`` (or ``scheduler``) section, DeepSpeed builds
that object itself; the training loop still passes something to ``prepare`` in its place, as
Accelerate's guide shows::

    optimizer = DummyOptim(model.parameters(), lr=3e-5, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)

``prepare`` returns DeepSpeed's optimizer and scheduler in their places. The placeholders
carry the values the config leaves ``"auto"``: ``deepspeed_inputs`` fills them by Accelerate's
rules and says what ``deepspeed.initialize`` gets besides the config (the parameters to
optimise, a scheduler factory). Only ``"auto"`` values are filled; numbers in the config stay.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FILLED_PATHS", "DeepSpeedInputs", "DummyOptim", "DummyScheduler", "deepspeed_inputs"]

# The config values the placeholders can fill (checks before launch let "auto" through there).
FILLED_PATHS = (
    "optimizer.params.lr",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
)


class DummyOptim:
    """The optimizer the DeepSpeed config's ``optimizer`` section builds, over ``params``
    (parameters or parameter groups); ``lr`` and ``weight_decay`` fill the section's ``"auto"``.

    >>> DummyOptim([], lr=0.1).lr
    0.1
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0, **kwargs: Any
    ) -> None:
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """The LR scheduler of the DeepSpeed config's ``scheduler`` section, or the one
    ``lr_scheduler_callable(optimizer)`` builds on DeepSpeed's optimizer.

    Its steps fill the section's ``"auto"`` warm-up values: from 0 up to the optimizer's
    learning rate in ``warmup_num_steps``, over ``total_num_steps`` steps in all (counted as
    Accelerate counts them: batches of the whole run, divided among the processes).

    >>> DummyScheduler(DummyOptim([]), total_num_steps=100).warmup_num_steps
    0
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


@dataclass(frozen=True)
class DeepSpeedInputs:
    """What ``deepspeed.initialize`` gets: the config with the placeholders' values filled,
    the parameters its optimizer optimises (``None``: the model's trainable ones, or the
    torch optimizer's) and a scheduler factory (``None``: the config's section, if any)."""

    config: dict[str, Any]
    model_parameters: Iterable[Any] | None = None
    lr_scheduler: Callable[[Any], Any] | None = None


def deepspeed_inputs(
    ds_config: Mapping[str, Any],
    optimizer: Any,
    scheduler: Any,
    *,
    num_processes: int,
    split_batches: bool,
) -> DeepSpeedInputs:
    """Check ``optimizer`` and ``scheduler`` (what ``prepare`` got: placeholders, torch
    objects or ``None``) against the config, and fill its ``"auto"`` values from them.

    >>> ds = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1}}}
    >>> inputs = deepspeed_inputs(ds, DummyOptim(["p"], lr=0.5), None, num_processes=2,
    ...                           split_batches=False)
    >>> inputs.config["optimizer"]["params"], inputs.model_parameters
    ({'lr': 0.5, 'weight_decay': 0.1}, ['p'])
    """
    _check(ds_config, optimizer, scheduler)
    config = copy.deepcopy(dict(ds_config))
    model_parameters = None
    if isinstance(optimizer, DummyOptim):
        model_parameters = optimizer.params
        _fill(config, "optimizer.params.lr", optimizer.lr)
        _fill(config, "optimizer.params.weight_decay", optimizer.weight_decay)
    lr_scheduler = None
    if isinstance(scheduler, DummyScheduler):
        lr_scheduler = scheduler.lr_scheduler_callable
        if lr_scheduler is None:
            _fill_schedule(config, scheduler, num_processes, split_batches)
    return DeepSpeedInputs(config, model_parameters, lr_scheduler)


def _check(ds_config: Mapping[str, Any], optimizer: Any, scheduler: Any) -> None:
    """Accelerate's rules: a placeholder needs the config section it stands for."""
    if isinstance(optimizer, DummyOptim) and "optimizer" not in ds_config:
        raise ValueError(
            "prepare() got a DummyOptim, but the DeepSpeed config has no 'optimizer' section "
            "for DeepSpeed to build the optimizer from. Add the section to the config, or "
            "pass a torch optimizer instead of the DummyOptim."
        )
    torch_scheduler = scheduler is not None and not isinstance(scheduler, DummyScheduler)
    if isinstance(optimizer, DummyOptim) and torch_scheduler:
        raise ValueError(
            f"prepare() got a DummyOptim and a {type(scheduler).__name__}: a torch LR "
            "scheduler needs a torch optimizer to drive, and DeepSpeed builds the optimizer "
            "here. Use DummyScheduler (the config's 'scheduler' section, or "
            "lr_scheduler_callable=...) with DummyOptim."
        )
    if not isinstance(scheduler, DummyScheduler):
        return
    has_section = "scheduler" in ds_config
    has_callable = scheduler.lr_scheduler_callable is not None
    if not has_section and not has_callable:
        raise ValueError(
            "prepare() got a DummyScheduler, but the DeepSpeed config has no 'scheduler' "
            "section and the DummyScheduler no lr_scheduler_callable: nothing says which "
            "schedule to build. Add the section, or pass "
            "DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: ...)."
        )
    if has_section and has_callable:
        # Accelerate hands DeepSpeed both, and DeepSpeed quietly keeps the config's.
        raise ValueError(
            "prepare() got a DummyScheduler with lr_scheduler_callable, and the DeepSpeed "
            "config has a 'scheduler' section too; DeepSpeed builds one scheduler. Remove the "
            "section, or the lr_scheduler_callable."
        )


def _fill_schedule(
    config: dict[str, Any], scheduler: DummyScheduler, num_processes: int, split_batches: bool
) -> None:
    optimizer = scheduler.optimizer
    defaults = getattr(optimizer, "defaults", None)  # a torch optimizer's, else DummyOptim's lr
    max_lr = defaults["lr"] if isinstance(defaults, Mapping) else getattr(optimizer, "lr", None)
    _fill(config, "scheduler.params.warmup_min_lr", 0)
    _fill(config, "scheduler.params.warmup_max_lr", max_lr)
    # DeepSpeed refuses 0 warm-up steps (older versions made them 2): Accelerate passes >= 1.
    _fill(config, "scheduler.params.warmup_num_steps", max(1, scheduler.warmup_num_steps))
    if scheduler.total_num_steps is not None:
        # Accelerate's count: the whole run's batches; each process takes its share of them
        # (with split_batches every process sees every batch, split).
        total = scheduler.total_num_steps
        steps = total if split_batches else math.ceil(total / num_processes)
        _fill(config, "scheduler.params.total_num_steps", steps)


def _fill(config: dict[str, Any], path: str, value: Any) -> None:
    """Set ``path`` to ``value`` where the config holds ``"auto"`` there; else leave it."""
    *parents, leaf = path.split(".")
    node: Any = config
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and node.get(leaf) == "auto":
        node[leaf] = value
