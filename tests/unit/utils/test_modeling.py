"""init_empty_weights / init_on_device: where parameters and buffers land, compared with
Accelerate's context managers for the same model, and that the patch never outlives the block."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from torch import nn

from nbaccel.utils import init_empty_weights, init_on_device


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def placement(model: nn.Module) -> dict[str, str]:
    return {name: t.device.type for name, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("include_buffers", [False, True])
def test_placement_matches_accelerate(include_buffers: bool) -> None:
    accelerate = pytest.importorskip("accelerate")
    with init_empty_weights(include_buffers=include_buffers):
        ours = build()
    with accelerate.init_empty_weights(include_buffers=include_buffers):
        theirs = build()
    assert placement(ours) == placement(theirs)
    assert ours[0].weight.is_meta and ours[0].weight.shape == (8, 4)
    assert ours[1].running_var.is_meta == include_buffers


def test_buffers_keep_their_values_by_default() -> None:
    with init_empty_weights():
        norm = nn.BatchNorm1d(3)
    assert torch.equal(norm.running_var, torch.ones(3))
    assert norm.weight.is_meta


def test_requires_grad_and_parameter_class_are_kept() -> None:
    class Tagged(nn.Parameter):
        def __new__(cls, data: torch.Tensor, requires_grad: bool = True, tag: str = "") -> Any:
            return super().__new__(cls, data, requires_grad)

        def __init__(self, data: torch.Tensor, requires_grad: bool = True, tag: str = ""):
            self.tag = tag

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)
            self.tagged = Tagged(torch.ones(3), tag="lora")

    with init_empty_weights():
        holder = Holder()
    assert holder.frozen.is_meta and not holder.frozen.requires_grad
    assert type(holder.tagged) is Tagged and holder.tagged.is_meta
    assert holder.tagged.tag == "lora" and holder.tagged.requires_grad


Block = Callable[[], AbstractContextManager[None]]


@pytest.mark.parametrize(
    "block", [init_empty_weights, lambda: init_on_device(torch.device("meta"), True)]
)
def test_models_built_after_the_block_are_real_even_after_an_error(block: Block) -> None:
    with pytest.raises(KeyError), block():
        raise KeyError("inside")
    assert not nn.Linear(2, 2).weight.is_meta
    assert not torch.empty(1).is_meta


def test_init_on_device_takes_a_device_name() -> None:
    with init_on_device("cpu"):
        layer = nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu"


def test_the_accelerate_variable_decides_when_include_buffers_is_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "true")
    with init_empty_weights():
        norm = nn.BatchNorm1d(2)
    assert norm.running_mean.is_meta
    with init_empty_weights(include_buffers=False):
        norm = nn.BatchNorm1d(2)
    assert not norm.running_mean.is_meta
