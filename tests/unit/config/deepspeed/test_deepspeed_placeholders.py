"""DummyOptim / DummyScheduler: Accelerate's signatures, its consistency rules, and the DeepSpeed
config values they fill (Accelerate's ``_prepare_deepspeed``: only ``"auto"`` is replaced)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest

from nbaccel.config.deepspeed.placeholders import (
    FILLED_PATHS,
    DummyOptim,
    DummyScheduler,
    deepspeed_inputs,
)


def auto_config() -> dict[str, Any]:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {"stage": 2},
    }


@pytest.mark.parametrize("name", ["DummyOptim", "DummyScheduler"])
def test_constructors_are_accelerates(name: str) -> None:
    theirs = getattr(pytest.importorskip("accelerate.utils.deepspeed"), name)
    ours = {"DummyOptim": DummyOptim, "DummyScheduler": DummyScheduler}[name]
    mine = inspect.signature(ours).parameters
    reference = inspect.signature(theirs).parameters
    assert [(p.name, p.kind, p.default) for p in mine.values()] == [
        (p.name, p.kind, p.default) for p in reference.values()
    ]
    arguments = {"params": ["p"]} if name == "DummyOptim" else {"optimizer": "opt"}
    assert vars(ours(**arguments, extra=1)) == vars(theirs(**arguments, extra=1))


def test_the_placeholders_fill_every_auto_value_as_accelerate_does() -> None:
    params = [object()]
    optimizer = DummyOptim(params, lr=3e-4, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, total_num_steps=1001, warmup_num_steps=0)
    inputs = deepspeed_inputs(
        auto_config(), optimizer, scheduler, num_processes=4, split_batches=False
    )
    assert inputs.config["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.01}
    assert inputs.config["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,  # DummyOptim has no defaults: its lr
        "warmup_num_steps": 1,  # 0 is raised to 1: DeepSpeed refuses 0
        "total_num_steps": math.ceil(1001 / 4),  # each process's share of the run's batches
    }
    assert inputs.model_parameters is params and inputs.lr_scheduler is None
    assert sorted(FILLED_PATHS) == sorted(
        f"{section}.params.{key}"
        for section in ("optimizer", "scheduler")
        for key in auto_config()[section]["params"]
    )


def test_numbers_in_the_config_stay_and_the_input_is_not_changed() -> None:
    ds = auto_config()
    ds["optimizer"]["params"]["lr"] = 0.5
    ds["scheduler"]["params"]["total_num_steps"] = 77
    optimizer = DummyOptim([], lr=0.1)
    inputs = deepspeed_inputs(
        ds,
        optimizer,
        DummyScheduler(optimizer, total_num_steps=10, warmup_num_steps=3),
        num_processes=2,
        split_batches=True,
    )
    assert inputs.config["optimizer"]["params"]["lr"] == 0.5
    assert inputs.config["scheduler"]["params"]["total_num_steps"] == 77
    assert inputs.config["scheduler"]["params"]["warmup_num_steps"] == 3
    assert ds["optimizer"]["params"]["weight_decay"] == "auto"  # a copy was filled


def test_split_batches_counts_the_whole_run_on_every_process() -> None:
    optimizer = DummyOptim([], lr=0.1)
    inputs = deepspeed_inputs(
        auto_config(),
        optimizer,
        DummyScheduler(optimizer, total_num_steps=10),
        num_processes=4,
        split_batches=True,
    )
    assert inputs.config["scheduler"]["params"]["total_num_steps"] == 10


def test_a_torch_optimizers_lr_tops_the_warmup() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    ds = auto_config()
    del ds["optimizer"]
    inputs = deepspeed_inputs(
        ds, optimizer, DummyScheduler(optimizer), num_processes=1, split_batches=False
    )
    assert inputs.config["scheduler"]["params"]["warmup_max_lr"] == 0.25
    assert inputs.config["scheduler"]["params"]["total_num_steps"] == "auto"  # not given
    assert inputs.model_parameters is None  # the torch optimizer's own


def test_a_scheduler_callable_goes_to_deepspeed() -> None:
    ds = auto_config()
    del ds["scheduler"]

    def build(optimizer: Any) -> str:
        return f"schedule of {optimizer}"

    optimizer = DummyOptim([])
    scheduler = DummyScheduler(optimizer, lr_scheduler_callable=build)
    inputs = deepspeed_inputs(ds, optimizer, scheduler, num_processes=1, split_batches=False)
    assert inputs.lr_scheduler is build and "scheduler" not in inputs.config


@pytest.mark.parametrize(
    ("drop", "scheduler_kind", "message"),
    [
        ("optimizer", None, "no 'optimizer' section"),
        ("scheduler", "dummy", "no 'scheduler' section"),
        (None, "torch", "DummyOptim and a LambdaLR"),
        (None, "callable", "'scheduler' section too"),
    ],
)
def test_inconsistent_placeholders_are_refused(
    drop: str | None, scheduler_kind: str | None, message: str
) -> None:
    torch = pytest.importorskip("torch")
    ds = auto_config()
    if drop:
        del ds[drop]
    optimizer = DummyOptim([torch.zeros(1, requires_grad=True)])
    scheduler: Any = {
        None: None,
        "dummy": DummyScheduler(optimizer),
        "callable": DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: opt),
        "torch": torch.optim.lr_scheduler.LambdaLR(
            torch.optim.SGD([torch.zeros(1, requires_grad=True)]), lambda step: 1.0
        ),
    }[scheduler_kind]
    with pytest.raises(ValueError, match=message):
        deepspeed_inputs(ds, optimizer, scheduler, num_processes=1, split_batches=False)
