"""nbaccel.utils' enums against Accelerate's, member by member, read from the installed
``accelerate`` (a new member there fails here), and taken wherever Accelerate takes them."""

from __future__ import annotations

import enum
from typing import Any

import pytest

import nbaccel
import nbaccel.utils
from nbaccel.accel.state import DistributedType as ReportedDistributedType
from nbaccel.config.accelerate.configs import resolve_rng_types

accelerate_utils = pytest.importorskip("accelerate.utils")

NAMES = ("PrecisionType", "DynamoBackend", "LoggerType", "RNGType", "DistributedType")


def members(enum_class: Any) -> list[tuple[str, str]]:
    return [(member.name, member.value) for member in enum_class]


@pytest.mark.parametrize("name", NAMES)
def test_members_names_and_values_are_accelerates(name: str) -> None:
    ours, theirs = getattr(nbaccel.utils, name), getattr(accelerate_utils, name)
    assert members(ours) == members(theirs)  # same order too: list() and iteration agree
    assert issubclass(ours, str) and issubclass(ours, enum.Enum)


@pytest.mark.parametrize("name", NAMES)
def test_members_print_and_test_membership_as_accelerates(name: str) -> None:
    ours, theirs = getattr(nbaccel.utils, name), getattr(accelerate_utils, name)
    for mine, reference in zip(ours, theirs, strict=True):
        assert str(mine) == str(reference) and f"{mine}" == f"{reference}"
        assert repr(mine) == repr(reference)
    if hasattr(theirs, "list"):  # BaseEnum's: values test with `in`, and list() lists them
        assert ours.list() == theirs.list()
        first = next(iter(theirs)).value
        assert (first in ours) == (first in theirs) is True
        assert ("no such value" in ours) == ("no such value" in theirs) is False


def test_a_member_equals_its_value_so_nbaccel_takes_it_as_a_string() -> None:
    from nbaccel.utils import LoggerType, PrecisionType, RNGType

    assert PrecisionType.BF16 == "bf16" and LoggerType.COMETML == "comet_ml"
    assert resolve_rng_types([RNGType.TORCH, RNGType.GENERATOR]) == ("torch", "generator")


def test_accelerator_arguments_take_the_enums() -> None:
    from nbaccel.utils import DynamoBackend, PrecisionType

    accelerator = nbaccel.Accelerator(
        mixed_precision=PrecisionType.BF16, dynamo_backend=DynamoBackend.NO, cpu=True
    )
    assert accelerator.mixed_precision == "bf16"
    assert type(accelerator.mixed_precision) is str  # a plain value, not the enum, is stored


def test_distributed_type_is_the_one_the_accelerator_reports() -> None:
    # `accelerator.distributed_type is DistributedType.MULTI_GPU` must work with either import.
    assert nbaccel.utils.DistributedType is ReportedDistributedType
    assert nbaccel.DistributedType is ReportedDistributedType
    assert nbaccel.PartialState().distributed_type is nbaccel.utils.DistributedType.NO
