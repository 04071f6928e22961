"""PartialState and AcceleratorState in this process; other ranks are simulated with
``PartialState.of`` (the members tested here read only rank and world size, no group).

``split_between_processes`` is compared with Accelerate's own method, run on an object that
claims the same rank and world size (its split reads only those two attributes, except for
padded tensors, which go through a collective: those are checked against the padded list).
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
import torch

from nbaccel.accel.partial_state import AcceleratorState, PartialState
from nbaccel.accel.state import DistributedType, ProcessState

CPU = torch.device("cpu")


def state_of(rank: int, world: int, local_rank: int | None = None, strategy: Any = None) -> Any:
    kind = DistributedType.MULTI_CPU if world > 1 else DistributedType.NO
    local = rank if local_rank is None else local_rank
    process = ProcessState(rank, local, world, world, CPU, kind, "")
    return PartialState.of(process, strategy=strategy)


def nbaccel_split(inputs: Any, rank: int, world: int, padding: bool) -> Any:
    with state_of(rank, world).split_between_processes(inputs, apply_padding=padding) as mine:
        return mine


def accelerate_split(inputs: Any, rank: int, world: int, padding: bool) -> Any:
    accelerate = pytest.importorskip("accelerate")
    fake = object.__new__(accelerate.PartialState)  # no Borg state: only these attributes
    fake.__dict__.update(num_processes=world, process_index=rank, device=CPU)
    with accelerate.PartialState.split_between_processes(fake, inputs, padding) as theirs:
        return theirs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [0, 1, 2, 3, 5, 7, 8])
@pytest.mark.parametrize("padding", [False, True])
def test_lists_split_exactly_as_accelerate(world: int, length: int, padding: bool) -> None:
    items = [f"item{i}" for i in range(length)]
    for rank in range(world):
        ours = nbaccel_split(list(items), rank, world, padding)
        if padding and length == 0 and world > 1:
            assert ours == []  # Accelerate fails here, on inputs[-1]: nothing to pad with
            continue
        assert ours == accelerate_split(list(items), rank, world, padding), (rank, world)


def test_the_split_covers_the_inputs_once_with_the_first_ranks_taking_the_extras() -> None:
    shares = [nbaccel_split(list(range(7)), rank, 3, False) for rank in range(3)]
    assert shares == [[0, 1, 2], [3, 4], [5, 6]]
    padded = [nbaccel_split(list(range(7)), rank, 3, True) for rank in range(3)]
    assert padded == [[0, 1, 2], [3, 4, 6], [5, 6, 6]]


@pytest.mark.parametrize("world", [2, 3])
def test_tuples_tensors_and_dicts_split_as_accelerate(world: int) -> None:
    # A str of the same length is handed over whole (it is no list, tuple or tensor).
    data = {"ids": list(range(5)), "x": torch.arange(10).reshape(5, 2), "name": "whole"}
    for rank in range(world):
        ours = nbaccel_split(data, rank, world, False)
        theirs = accelerate_split(copy.deepcopy(data), rank, world, False)
        assert ours["ids"] == theirs["ids"] and ours["name"] == theirs["name"] == "whole"
        assert torch.equal(ours["x"], theirs["x"])
        assert nbaccel_split(tuple(range(5)), rank, world, False) == accelerate_split(
            tuple(range(5)), rank, world, False
        )
        tensor = torch.arange(5.0)
        assert torch.equal(
            nbaccel_split(tensor, rank, world, False), accelerate_split(tensor, rank, world, False)
        )
    assert data["ids"] == list(range(5))  # the caller's dict is not modified (Accelerate's is)


@pytest.mark.parametrize(("world", "length"), [(2, 3), (3, 7), (4, 2), (3, 6)])
def test_padded_tensors_repeat_the_last_row_like_padded_lists(world: int, length: int) -> None:
    rows = torch.arange(length * 2).reshape(length, 2)
    for rank in range(world):
        ours = nbaccel_split(rows, rank, world, True)
        as_list = accelerate_split([r.tolist() for r in rows], rank, world, True)
        assert ours.tolist() == as_list
        assert ours.device == CPU and ours.dtype == rows.dtype


def test_padded_tuples_work_where_accelerate_fails() -> None:
    assert nbaccel_split((1, 2, 3), 1, 2, True) == (3, 3)


def test_dict_values_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        nbaccel_split({"a": [1, 2], "b": [1]}, 0, 2, False)


def test_one_process_gets_the_inputs_unchanged() -> None:
    inputs = {"a": [1, 2, 3]}
    assert nbaccel_split(inputs, 0, 1, True) is inputs


# -- decorators --------------------------------------------------------------------------------
def hello() -> str:
    return "ran"


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_decorators_run_only_on_their_process(rank: int) -> None:
    state = state_of(rank, 3)
    assert (state.on_main_process(hello)() == "ran") == (rank == 0)
    assert (state.on_last_process(hello)() == "ran") == (rank == 2)
    assert (state.on_local_main_process(hello)() == "ran") == (rank == 0)
    assert (state.on_process(1)(hello)() == "ran") == (rank == 1)  # nbaccel's short form
    assert (state.on_process(process_index=1)(hello)() == "ran") == (rank == 1)  # Accelerate's
    assert (state.on_process(hello, process_index=2)() == "ran") == (rank == 2)
    assert (state.on_local_process(local_process_index=1)(hello)() == "ran") == (rank == 1)
    assert (state.on_main_process()(hello)() == "ran") == (rank == 0)  # with parentheses


def test_a_skipped_function_returns_none_and_keeps_its_name() -> None:
    skipped = state_of(1, 2).on_main_process(hello)
    assert skipped() is None and skipped.__name__ == "hello"
    assert state_of(0, 2).on_main_process(hello) is hello  # the function itself, as Accelerate


def test_one_process_runs_every_decorated_function_as_accelerate_does() -> None:
    state = state_of(0, 1)
    assert state.on_process(process_index=3)(hello)() == "ran"
    assert state.on_last_process(hello)() == "ran"


def test_on_process_without_an_index_says_how_to_give_one() -> None:
    with pytest.raises(TypeError, match=r"on_process\(process_index=1\)"):
        state_of(0, 2).on_process(hello)
    with pytest.raises(TypeError, match=r"local_process_index=1"):
        state_of(0, 2).on_local_process()


# -- coordination ------------------------------------------------------------------------------
class RecordingStrategy:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def barrier(self) -> None:
        self.events.append("barrier")


@pytest.mark.parametrize("method", ["main_process_first", "local_main_process_first"])
def test_main_process_first_waits_after_on_the_main_and_before_elsewhere(method: str) -> None:
    orders = []
    for rank in (0, 1):
        events: list[str] = []
        state = state_of(rank, 2, strategy=RecordingStrategy(events))
        with getattr(state, method)():
            events.append("block")
        orders.append(events)
    assert orders == [["block", "barrier"], ["barrier", "block"]]


def test_wait_for_everyone_goes_through_the_strategy() -> None:
    events: list[str] = []
    state_of(0, 2, strategy=RecordingStrategy(events)).wait_for_everyone()
    assert events == ["barrier"]


def test_members_read_the_process_state() -> None:
    state = state_of(2, 4, local_rank=0)
    assert (state.process_index, state.local_process_index, state.num_processes) == (2, 0, 4)
    assert state.use_distributed and not state.is_main_process
    assert state.is_local_main_process and not state.is_last_process
    assert state.distributed_type is DistributedType.MULTI_CPU and state.device == CPU


def test_print_only_on_the_local_main_process(capsys: pytest.CaptureFixture[str]) -> None:
    state_of(1, 2, local_rank=0).print("shown")
    state_of(1, 2, local_rank=1).print("hidden")
    assert capsys.readouterr().out == "shown\n"


# -- this process, built from the launch (one process here) ---------------------------------
def test_a_plain_process_is_one_non_distributed_process() -> None:
    state = PartialState()
    assert (state.process_index, state.num_processes, state.use_distributed) == (0, 1, False)
    assert state.distributed_type is DistributedType.NO and state.backend is None
    state.wait_for_everyone()  # nothing to wait for
    assert PartialState(cpu=True).device == CPU
    assert PartialState(timeout=timedelta(seconds=5)).config.collective_timeout == 5.0


def test_the_repr_is_accelerates() -> None:
    accelerate = pytest.importorskip("accelerate")
    try:
        theirs = repr(accelerate.PartialState(cpu=True))
    finally:
        accelerate.PartialState._reset_state()
    assert repr(PartialState(cpu=True)) == theirs


def test_process_group_options_nbaccel_sets_itself_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="init_method"):
        PartialState(init_method="tcp://127.0.0.1:1")


def test_accelerator_state_reports_the_training_settings() -> None:
    state = AcceleratorState(mixed_precision="BF16")
    assert state.mixed_precision == "bf16"
    assert state.fsdp_plugin is None and state.deepspeed_plugin is None and not state.is_fsdp2
    assert repr(state).endswith("\nMixed precision type: bf16\n")
    assert state.process_index == 0


def test_of_reports_the_given_config_and_builds_no_strategy_until_needed() -> None:
    from nbaccel.config.schema import Config

    process = ProcessState(0, 0, 2, 2, CPU, DistributedType.FSDP, "")
    state = AcceleratorState.of(process, config=Config(strategy="fsdp", mixed_precision="fp16"))
    assert state._strategy is None
    assert state.mixed_precision == "fp16" and state.is_fsdp2
    assert state.fsdp_plugin is not None and state.fsdp_plugin.sharding_strategy == "FULL_SHARD"
