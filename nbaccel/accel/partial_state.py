"""``PartialState`` and ``AcceleratorState``: Hugging Face Accelerate's process-level API.

Who this process is (rank, world size, device, distributed type) and how it coordinates
with the others (barriers, main-process-first blocks, per-rank decorators, splitting inputs
between ranks), with Accelerate's names and meanings, so ``from nbaccel import PartialState``
runs code written for ``from accelerate import PartialState`` unchanged.

Unlike Accelerate's, these are not singletons sharing one hidden dict: ``PartialState()``
reads the launch again each time (the nbaccel launch's context, torchrun's environment, or
one process) and costs little, since the process group is initialised only once. The
``Accelerator`` holds one built with ``PartialState.of(process_state)`` and forwards its
process-level members to it. Barriers go through the backend's ``Strategy`` (torch_xla's
rendezvous on XLA devices, ``torch.distributed`` elsewhere).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from nbaccel.accel.data.process_split import split_for_process
from nbaccel.accel.state import DistributedType, ProcessState, launch_config
from nbaccel.accel.strategies import Strategy, detect_process_state, strategy_for
from nbaccel.config.schema import Config, DeepSpeedOptions, FSDPOptions

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["AcceleratorState", "DistributedType", "PartialState"]


class PartialState:
    """This process's place in the run, and the helpers that coordinate processes.

    ``cpu=True`` keeps the process on the CPU; ``timeout=`` (a ``timedelta``) sets how long
    collectives may wait, as Accelerate's ``InitProcessGroupKwargs(timeout=...)`` does.

    >>> state = PartialState()
    >>> state.process_index, state.num_processes, state.is_main_process
    (0, 1, True)
    >>> with state.split_between_processes(["a", "b", "c"]) as mine:
    ...     mine
    ['a', 'b', 'c']
    """

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        changes: dict[str, Any] = {"use_cpu": True} if cpu else {}
        timeout = kwargs.pop("timeout", None)
        if timeout is not None:
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            changes["collective_timeout"] = float(seconds)
        backend = kwargs.pop("backend", None)
        if kwargs:
            raise NotImplementedError(
                f"PartialState({', '.join(sorted(kwargs))}=...) is not supported: nbaccel "
                "initialises the process group itself (gloo on CPU, NCCL on GPUs, torch_xla on "
                "TPUs) from the launch. Only timeout= and backend= are taken; set the rest "
                "through the launch's config (nbaccel.Config fields) instead."
            )
        config = launch_config(None)
        config = config.replace(**changes) if changes else config
        self._state = detect_process_state(config)
        self._config: Config | None = config
        self._strategy: Strategy | None = None
        if backend is not None and self.use_distributed and backend not in str(self.backend):
            raise NotImplementedError(
                f"PartialState(backend={backend!r}): this run's process group uses "
                f"{self.backend!r}, which nbaccel chose for the device ({self.device.type}); "
                "it cannot be changed here. Leave backend out, or launch with use_cpu=True "
                "for gloo."
            )

    @classmethod
    def of(
        cls,
        state: ProcessState,
        *,
        strategy: Strategy | None = None,
        config: Config | None = None,
    ) -> PartialState:
        """The PartialState of an already detected ``state`` (what ``Accelerator`` holds).

        ``strategy`` carries the barriers (default: the one the distributed type asks for);
        ``config`` the settings ``AcceleratorState`` reports (default: the launch's).

        >>> one = ProcessState(0, 0, 1, 1, torch.device("cpu"), DistributedType.NO, "")
        >>> PartialState.of(one).is_last_process
        True
        """
        made = cls.__new__(cls)
        made._state, made._strategy, made._config = state, strategy, config
        return made

    # -- who and where -------------------------------------------------------------------
    @property
    def state(self) -> ProcessState:
        """nbaccel's own record of this process (rank, world size, device, ...)."""
        return self._state

    @property
    def config(self) -> Config:
        """The resolved settings of this process's launch (explicit ``cpu=`` applied)."""
        if self._config is None:
            self._config = launch_config(None)
        return self._config

    @property
    def strategy(self) -> Strategy:
        """The backend's strategy, which carries this state's barriers and collectives."""
        if self._strategy is None:
            self._strategy = strategy_for(self._state, self.config)
        return self._strategy

    @property
    def process_index(self) -> int:
        """This process's rank among all processes (0 .. num_processes-1)."""
        return self._state.rank

    @property
    def local_process_index(self) -> int:
        """This process's rank among the processes of its machine."""
        return self._state.local_rank

    @property
    def num_processes(self) -> int:
        """How many processes take part (one under torch_xla's SPMD, which drives all chips)."""
        return self._state.world_size

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._state.device

    @property
    def distributed_type(self) -> DistributedType:
        """How training is distributed (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``, ...)."""
        return self._state.distributed_type

    @property
    def backend(self) -> str | None:
        """The default process group's backend (``"gloo"``, ``"nccl"``, ...); None without one."""
        if self.distributed_type is DistributedType.XLA:
            return "xla"
        return str(dist.get_backend()) if dist.is_initialized() else None

    @property
    def initialized(self) -> bool:
        """Always True: a PartialState is built from the launch when it is created."""
        return True

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.distributed_type is not DistributedType.NO and self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        """True on the process of rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of each machine."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on the process of the highest rank."""
        return self.process_index == self.num_processes - 1

    # -- coordination ----------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """A barrier: returns once every process has called it (at once with one process)."""
        self.strategy.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (a download, a cache), the others after it is done."""
        with self._goes_first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """The first process of each machine runs the block first, then the others."""
        with self._goes_first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _goes_first(self, first: bool) -> Iterator[None]:
        if not first:
            self.wait_for_everyone()
        # No try/finally, as in Accelerate: if the first process fails inside the block the
        # others must not go on as if it had finished (a half-written download); they stay
        # at the barrier until the launcher stops the run.
        yield
        if first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of ``inputs``; the first ranks take one more
        when the length does not divide evenly (Accelerate's split exactly).

        ``inputs``: a list, tuple, tensor, a dict of those (all of one length), or a
        ``datasets.Dataset``. With ``apply_padding`` every share has the same length, padded
        by repeating the last element of ``inputs``, so results can be gathered; drop the
        padding afterwards. Padded tensor shares are moved to ``device``, as Accelerate does.
        A dict is split into a new dict; the caller's dict is left as it was.

        >>> two = [ProcessState(r, r, 2, 2, torch.device("cpu"), DistributedType.MULTI_CPU, "")
        ...        for r in (0, 1)]
        >>> for state in two:
        ...     with PartialState.of(state).split_between_processes([1, 2, 3], True) as mine:
        ...         print(state.rank, mine)
        0 [1, 2]
        1 [3, 3]
        """
        if self.num_processes == 1:
            yield inputs
            return
        yield split_for_process(
            inputs, self.process_index, self.num_processes, apply_padding, self.device
        )

    # -- per-process decorators (decided when decorating, as in Accelerate) ------------------
    def on_main_process(self, function: F | None = None) -> Any:
        """Decorator: ``function`` runs on rank 0; elsewhere calls return None.

        >>> one = ProcessState(0, 0, 1, 1, torch.device("cpu"), DistributedType.NO, "")
        >>> @PartialState.of(one).on_main_process
        ... def hello():
        ...     return "hi"
        >>> hello()
        'hi'
        """
        return self._runs_here(self.is_main_process, function)

    def on_local_main_process(self, function: F | None = None) -> Any:
        """Decorator: ``function`` runs on the first process of each machine only."""
        return self._runs_here(self.is_local_main_process, function)

    def on_last_process(self, function: F | None = None) -> Any:
        """Decorator: ``function`` runs on the process of the highest rank only."""
        return self._runs_here(self.is_last_process, function)

    def on_process(self, function: F | int | None = None, process_index: int | None = None) -> Any:
        """Decorator: ``function`` runs on rank ``process_index`` only. Both
        ``@state.on_process(process_index=1)`` (Accelerate's form) and ``@state.on_process(1)``.
        """
        chosen, index = _function_and_index(function, process_index, "on_process", "process_index")
        return self._runs_here(self.process_index == index, chosen)

    def on_local_process(
        self, function: F | int | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: ``function`` runs on the process of local rank ``local_process_index``
        of each machine only (``@state.on_local_process(local_process_index=1)``)."""
        chosen, index = _function_and_index(
            function, local_process_index, "on_local_process", "local_process_index"
        )
        return self._runs_here(self.local_process_index == index, chosen)

    def _runs_here(self, here: bool, function: Callable[..., Any] | None) -> Any:
        if function is None:  # used with parentheses: @state.on_main_process()
            return functools.partial(self._runs_here, here)
        # As Accelerate: with a single process every decorated function runs.
        if here or not self.use_distributed:
            return function

        @functools.wraps(function)
        def skipped(*args: Any, **kwargs: Any) -> None:
            return None

        return skipped

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the first process of each machine only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy ``group`` (default: the default process group) if it exists."""
        if dist.is_initialized():
            dist.destroy_process_group(group)

    def __repr__(self) -> str:
        backend = self.backend
        return (
            f"Distributed environment: {self.distributed_type}"
            f"{'  Backend: ' + backend if backend else ''}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )


class AcceleratorState(PartialState):
    """``PartialState`` plus the training settings Accelerate's ``AcceleratorState`` reports,
    read from the launch's resolved ``Config``.

    Not shared between instances: ``AcceleratorState()`` sees the launch's settings, not
    arguments given to some ``Accelerator(...)``; use ``accelerator.state`` for those.

    >>> AcceleratorState(mixed_precision="bf16").mixed_precision
    'bf16'
    """

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any):
        super().__init__(cpu, **kwargs)
        if mixed_precision is not None:
            self._config = self.config.replace(mixed_precision=mixed_precision.lower())

    @property
    def mixed_precision(self) -> str:
        """``"no"``, ``"fp16"`` or ``"bf16"``."""
        return self.config.mixed_precision

    # These hold nbaccel's config sections, which carry the settings of Accelerate's
    # plugins under nbaccel's field names.
    @property
    def fsdp_plugin(self) -> FSDPOptions | None:
        """The FSDP settings when training shards with FSDP; None otherwise."""
        return self.config.fsdp if self.distributed_type is DistributedType.FSDP else None

    @property
    def deepspeed_plugin(self) -> DeepSpeedOptions | None:
        """The DeepSpeed settings when training runs DeepSpeed; None otherwise."""
        return self.config.deepspeed if self.distributed_type is DistributedType.DEEPSPEED else None

    @property
    def is_fsdp2(self) -> bool:
        """True under FSDP: nbaccel shards with FSDP2 (``fully_shard``) only."""
        return self.distributed_type is DistributedType.FSDP

    def __repr__(self) -> str:
        return f"{super().__repr__()}\nMixed precision type: {self.mixed_precision}\n"


def _function_and_index(
    function: Any, index: int | None, name: str, keyword: str
) -> tuple[Callable[..., Any] | None, int]:
    if isinstance(function, int) and not isinstance(function, bool):
        function, index = None, function  # @state.on_process(1)
    if index is None:
        raise TypeError(
            f"{name} needs the index of the process to run on, e.g. "
            f"@state.{name}(1) or @state.{name}({keyword}=1)."
        )
    return function, index
