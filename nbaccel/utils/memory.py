"""Finding a batch size that fits (``find_executable_batch_size``) and freeing memory.

As Accelerate 1.x does, a run that fails for lack of memory is retried with the batch size
times 0.9 (or what ``reduce_batch_size_fn`` returns), and the size that worked is where the
next call starts. Unlike Accelerate, the processes of a distributed run agree: an attempt
counts only when it fitted on every rank, so all ranks continue with one batch size (in
Accelerate, a rank that fitted would go on alone while another retried smaller).
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

from nbaccel.accel.partial_state import PartialState

__all__ = ["find_executable_batch_size", "release_memory", "should_reduce_batch_size"]

# What torch's allocators say when they run out (CUDA and ROCm, MPS, CPU, HPU), and cuDNN's
# error for shapes it cannot run, which a smaller batch also avoids: Accelerate's list.
_OUT_OF_MEMORY = (
    " out of memory.",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` means "out of memory": torch's ``OutOfMemoryError``, Python's
    ``MemoryError``, or a ``RuntimeError`` with an allocator's out-of-memory message.

    >>> should_reduce_batch_size(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    True
    >>> should_reduce_batch_size(ValueError("bad shape"))
    False
    """
    if isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        message = str(exception.args[0])
        return any(sign in message for sign in _OUT_OF_MEMORY)
    return False


def release_memory(*objects: Any) -> list[None]:
    """Collect garbage and empty the device cache; returns one None per object, so
    ``a, b = release_memory(a, b)`` drops the caller's references too.

    >>> release_memory(torch.ones(2), torch.ones(3))
    [None, None]
    """
    _free_cached_memory()
    return [None for _ in objects]


def _free_cached_memory() -> None:
    gc.collect()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # never initialise CUDA
        torch.cuda.empty_cache()


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorator: call ``function(batch_size, *args)``, retrying with a smaller batch size
    while it runs out of memory (see ``should_reduce_batch_size``).

    The decorated function takes ``batch_size`` as its first parameter, and the caller
    leaves it out. Sizes go ``starting_batch_size``, then ``int(size * 0.9)`` each time (or
    ``reduce_batch_size_fn()``); reaching 0 raises ``RuntimeError``.

    >>> @find_executable_batch_size(starting_batch_size=100)
    ... def train(batch_size, rows):
    ...     if batch_size * rows > 600:
    ...         raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
    ...     return batch_size
    >>> train(8)
    72
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def smaller() -> int:
        if reduce_batch_size_fn is not None:
            return int(reduce_batch_size_fn())
        return int(batch_size * 0.9)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        _check_batch_size_not_passed(function, args)
        _free_cached_memory()
        state = PartialState()
        while True:
            if batch_size <= 0:
                raise RuntimeError(
                    f"find_executable_batch_size: {function.__name__} ran out of memory at "
                    f"every batch size down to 1 (it started at {starting_batch_size}). "
                    "Free memory (a smaller model, mixed precision, gradient checkpointing) "
                    "or use fewer processes per device."
                )
            try:
                result, fitted = function(batch_size, *args, **kwargs), True
            except Exception as error:  # out-of-memory is told apart from the rest here
                if not should_reduce_batch_size(error):
                    raise
                result, fitted = None, False
            if not fitted:
                _free_cached_memory()  # after the except block: the traceback is gone
            if _fitted_everywhere(state, fitted):
                return result
            result = None
            batch_size = smaller()

    return run


def _fitted_everywhere(state: PartialState, fitted: bool) -> bool:
    if not state.use_distributed:
        return fitted
    return all(state.strategy.gather_object([fitted]))


def _check_batch_size_not_passed(function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    parameters = list(inspect.signature(function).parameters)
    if len(parameters) < len(args) + 1:
        given = ", ".join(
            f"{name}={value!r}" for name, value in zip(parameters[1:], args[1:], strict=False)
        )
        raise TypeError(
            f"{function.__name__} got the batch size as its first argument, but "
            "find_executable_batch_size passes it itself. Call it without: "
            f"{function.__name__}({given})."
        )
