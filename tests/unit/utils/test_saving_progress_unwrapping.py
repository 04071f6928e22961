"""nbaccel.utils.save, tqdm and extract_model_from_parallel in one process, next to
Accelerate's own functions run on the same inputs (the rank-dependent halves run on two real
ranks in tests/multiprocess/test_utils_names.py)."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nbaccel.accel.precision import Precision
from nbaccel.accel.state import DistributedType, ProcessState
from nbaccel.accel.strategies.models import prepare_model
from nbaccel.utils import extract_model_from_parallel, save, tqdm


@pytest.fixture
def accelerate_utils() -> Iterator[Any]:
    """Accelerate's utils; its PartialState singleton is reset afterwards and must leave no
    environment variables behind."""
    module = pytest.importorskip("accelerate.utils")
    environment = _environment()
    yield module
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert _environment() == environment


def _environment() -> dict[str, str]:
    # torch's inductor sets TORCHINDUCTOR_CACHE_DIR when torch.compile first loads it.
    skip = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
    return {k: v for k, v in os.environ.items() if k not in skip}


# -- save ------------------------------------------------------------------------------------
def tied_state() -> OrderedDict[str, torch.Tensor]:
    weight = torch.arange(6.0).reshape(2, 3)
    return OrderedDict(embed=weight, head=weight, bias=torch.ones(2))


@pytest.mark.parametrize("safe_serialization", [False, True])
def test_save_writes_what_accelerates_save_writes(
    accelerate_utils: Any, tmp_path: Path, safe_serialization: bool
) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    expected = pytest.warns(UserWarning, match="head") if safe_serialization else nullcontext()
    with expected:
        save(tied_state(), ours, safe_serialization=safe_serialization)
    accelerate_utils.save(tied_state(), theirs, safe_serialization=safe_serialization)
    if safe_serialization:  # tied weights: the first name is kept, in both
        mine, reference = load_file(ours), load_file(theirs)
    else:
        mine, reference = torch.load(ours), torch.load(theirs)
        assert mine["embed"].data_ptr() == mine["head"].data_ptr()  # ties stay with torch.save
    assert list(mine) == list(reference)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)


def test_save_takes_a_file_object_as_torch_save_does(tmp_path: Path) -> None:
    with (tmp_path / "w.bin").open("wb") as file:
        save({"step": 3}, file)
    assert torch.load(tmp_path / "w.bin") == {"step": 3}


# -- tqdm ------------------------------------------------------------------------------------
def test_tqdm_shows_on_the_main_process_as_accelerates(accelerate_utils: Any) -> None:
    for kwargs in ({}, {"main_process_only": False}, {"disable": True}):
        ours, theirs = tqdm(range(3), **kwargs), accelerate_utils.tqdm(range(3), **kwargs)
        assert ours.disable == theirs.disable == ("disable" in kwargs), kwargs
        assert list(ours) == list(theirs) == [0, 1, 2]
        assert type(ours) is type(theirs)  # tqdm.auto's choice, both ways


def test_tqdm_refuses_a_bool_first_argument_as_accelerate_does(accelerate_utils: Any) -> None:
    with pytest.raises(ValueError, match="main_process_only"):
        accelerate_utils.tqdm(True, range(3))
    with pytest.raises(ValueError, match="main_process_only"):
        tqdm(True, range(3))


# -- extract_model_from_parallel -------------------------------------------------------------
def test_wrappers_come_off_as_with_accelerates(accelerate_utils: Any) -> None:
    inner = nn.Linear(3, 2)
    parallel = nn.DataParallel(inner)  # no GPU: a plain wrapper holding .module
    compiled = torch.compile(parallel)  # Accelerate's own order: compile around the wrapper
    for model, keep in ((parallel, True), (compiled, False), (compiled, True)):
        ours = extract_model_from_parallel(model, keep_torch_compile=keep)
        theirs = accelerate_utils.extract_model_from_parallel(model, keep_torch_compile=keep)
        assert ours is theirs
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is inner
    kept = extract_model_from_parallel(compiled)
    assert kept is compiled and kept._orig_mod is inner  # type: ignore[comparison-overlap]


def test_recursive_unwraps_submodules_as_accelerates(accelerate_utils: Any) -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.DataParallel(nn.Linear(2, 2)), nn.ReLU())

    ours = extract_model_from_parallel(build(), recursive=True)
    theirs = accelerate_utils.extract_model_from_parallel(build(), recursive=True)
    assert [type(m).__name__ for m in ours.modules()] == [
        type(m).__name__ for m in theirs.modules()
    ]
    assert isinstance(ours[0], nn.Linear)


def test_keep_fp32_wrapper_false_restores_the_full_precision_forward() -> None:
    torch.manual_seed(0)
    model, x = nn.Linear(16, 16), torch.randn(4, 16)
    exact = model(x)
    one = ProcessState(0, 0, 1, 1, torch.device("cpu"), DistributedType.NO, "")
    prepared = prepare_model(
        model,
        one,
        Precision("bf16", torch.device("cpu")),
        device_placement=True,
        dynamo_backend="no",
    )
    assert not torch.equal(prepared(x), exact)  # computed in bf16 under autocast
    assert not torch.equal(extract_model_from_parallel(prepared)(x), exact)  # kept by default
    unwrapped = extract_model_from_parallel(prepared, keep_fp32_wrapper=False)
    assert unwrapped is model and torch.equal(unwrapped(x), exact)
