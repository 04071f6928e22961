"""find_executable_batch_size in one process, against Accelerate's decorator where it is the
reference (the sizes tried), and release_memory. Agreement between ranks is checked with two
real processes in tests/multiprocess/test_partial_state_and_utils.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from nbaccel.utils import find_executable_batch_size, release_memory, should_reduce_batch_size

CPU_OOM = "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"


def fits_below(limit: int, tried: list[int], error: Callable[[], BaseException]) -> Any:
    def train(batch_size: int, rows: int) -> tuple[int, int]:
        tried.append(batch_size)
        if batch_size > limit:
            raise error()
        return batch_size, rows

    return train


def test_cpu_out_of_memory_retries_smaller_with_accelerates_sizes() -> None:
    accelerate_utils = pytest.importorskip("accelerate.utils")
    ours: list[int] = []
    theirs: list[int] = []
    result = find_executable_batch_size(starting_batch_size=128)(
        fits_below(60, ours, lambda: RuntimeError(CPU_OOM))
    )(7)
    reference = accelerate_utils.find_executable_batch_size(starting_batch_size=128)(
        fits_below(60, theirs, lambda: RuntimeError(CPU_OOM))
    )(7)
    assert ours == theirs == [128, 115, 103, 92, 82, 73, 65, 58]
    assert result == reference == (58, 7)


def test_memory_error_and_torch_out_of_memory_also_retry() -> None:
    tried: list[int] = []
    find_executable_batch_size(fits_below(10, tried, MemoryError), starting_batch_size=16)(1)
    assert tried == [16, 14, 12, 10]
    cuda_style = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert should_reduce_batch_size(cuda_style)


def test_reaching_zero_raises_a_clear_error() -> None:
    tried: list[int] = []
    train = find_executable_batch_size(
        fits_below(0, tried, lambda: RuntimeError(CPU_OOM)), starting_batch_size=3
    )
    with pytest.raises(RuntimeError, match="ran out of memory at every batch size down to 1"):
        train(1)
    assert tried == [3, 2, 1]


def test_other_errors_propagate_at_once() -> None:
    tried: list[int] = []
    train = find_executable_batch_size(fits_below(0, tried, lambda: ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        train(1)
    assert tried == [128]
    two_args = RuntimeError("CUDA error: out of memory.", "detail")  # Accelerate: one arg only
    assert not should_reduce_batch_size(two_args)


def test_the_size_that_fitted_is_where_the_next_call_starts() -> None:
    tried: list[int] = []
    train = find_executable_batch_size(
        fits_below(100, tried, lambda: RuntimeError(CPU_OOM)), starting_batch_size=120
    )
    train(1)
    train(2)
    assert tried == [120, 108, 97, 97]


def test_a_custom_reduction_is_used() -> None:
    sizes = iter([50, 25])
    tried: list[int] = []
    train = find_executable_batch_size(
        fits_below(30, tried, lambda: RuntimeError(CPU_OOM)),
        starting_batch_size=100,
        reduce_batch_size_fn=lambda: next(sizes),
    )
    assert train(0) == (25, 0)
    assert tried == [100, 50, 25]


def test_passing_the_batch_size_yourself_is_refused() -> None:
    @find_executable_batch_size
    def train(batch_size: int, rows: int) -> int:
        return batch_size

    with pytest.raises(TypeError, match=r"Call it without: train\(rows=3\)"):
        train(64, 3)


def test_release_memory_returns_one_none_per_object() -> None:
    a, b = torch.ones(3), torch.ones(2)
    a, b = release_memory(a, b)
    assert (a, b) == (None, None)
