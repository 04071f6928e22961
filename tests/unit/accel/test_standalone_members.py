"""Accelerator members that need no strategy, as free functions, compared with Accelerate.

``save``, ``profile``, ``join_uneven_inputs``, ``trigger_sync_in_backward``, ``get_tracker``,
``lomo_backward``, ``verify_device_map`` and ``set_trigger`` / ``check_trigger``: the facade
calls these. Where Accelerate's own function can run in one process (its ``save``, its
staticmethod ``trigger_sync_in_backward``, ``verify_device_map``) the two are run side by side.
DDP is exercised on a one-rank gloo group (no processes); ``join_uneven_inputs`` with really
uneven ranks needs two processes and belongs to tests/multiprocess.
"""

from __future__ import annotations

import json
import types
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from nbaccel.accel import lomo
from nbaccel.accel.checkpoints import saving
from nbaccel.accel.data.loaders import PreparedDataLoader, PreparedIterableLoader, ShardPlan
from nbaccel.accel.optim import AcceleratedOptimizer, GradientState
from nbaccel.accel.state import DistributedType
from nbaccel.accel.strategies import device_map
from nbaccel.accel.strategies.ddp_controls import join_uneven_inputs, trigger_sync_in_backward
from nbaccel.accel.tracking import profiling, tracker_lookup
from nbaccel.accel.tracking.trackers import CSVTracker
from nbaccel.accel.trigger import TriggerFlag

MAIN = {"is_main_process": True, "is_local_main_process": True}


class Tied(torch.nn.Module):
    """An embedding tied to the output layer, as in language models."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def with_ddp_prefix(state: dict[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    """What a DDP-wrapped model's ``state_dict()`` gives: the same tensors under ``module.``."""
    return OrderedDict((f"module.{k}", v) for k, v in state.items())


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real gloo process group of one rank, so DDP and Join run without processes."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- save ----------------------------------------------------------------------------------
def test_save_pickle_format_keeps_keys_and_ties_as_accelerate_does(tmp_path: Path) -> None:
    from accelerate.utils import save as accelerate_save

    state = with_ddp_prefix(Tied().state_dict())
    saving.save(state, tmp_path / "ours.bin", **MAIN)
    accelerate_save(state, tmp_path / "theirs.bin")
    ours = torch.load(tmp_path / "ours.bin")
    theirs = torch.load(tmp_path / "theirs.bin")
    assert list(ours) == list(theirs) == ["module.embed.weight", "module.head.weight"]
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    # torch.save keeps the tie: both names load as views of one storage.
    assert ours["module.embed.weight"].data_ptr() == ours["module.head.weight"].data_ptr()


def test_save_safetensors_drops_tied_duplicates_like_accelerate(tmp_path: Path) -> None:
    from accelerate.utils import save as accelerate_save
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = with_ddp_prefix(Tied().state_dict())
    state["module.scale"] = torch.ones(4, 2).t()  # not contiguous: must be made so
    with pytest.warns(UserWarning, match=r"module\.head\.weight.*tied weights"):
        saving.save(state, tmp_path / "ours.safetensors", safe_serialization=True, **MAIN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerate_save(state, tmp_path / "theirs.safetensors", safe_serialization=True)
    ours = load_file(tmp_path / "ours.safetensors")
    theirs = load_file(tmp_path / "theirs.safetensors")
    assert sorted(ours) == sorted(theirs) == ["module.embed.weight", "module.scale"]
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    with safe_open(tmp_path / "ours.safetensors", "pt") as file:
        assert file.metadata() == {"format": "pt"}  # what transformers' loaders check


def test_save_safetensors_takes_a_plain_dict_too(tmp_path: Path) -> None:
    # transformers 4.x's save_pretrained(save_function=accelerator.save) hands over plain
    # dict shards; Accelerate cleans only OrderedDicts, nbaccel every dict.
    shard = dict(Tied().state_dict())
    with pytest.warns(UserWarning, match="head.weight"):
        saving.save(shard, tmp_path / "shard.safetensors", safe_serialization=True, **MAIN)
    from safetensors.torch import load_file

    assert list(load_file(tmp_path / "shard.safetensors")) == ["embed.weight"]


def test_only_the_writing_process_writes(tmp_path: Path) -> None:
    obj = {"step": 3}
    saving.save(obj, tmp_path / "rank1.bin", is_main_process=False, is_local_main_process=False)
    saving.save(obj, tmp_path / "local.bin", is_main_process=False, is_local_main_process=True)
    saving.save(
        obj,
        tmp_path / "per_node.bin",
        is_main_process=False,
        is_local_main_process=True,
        save_on_each_node=True,
    )
    saving.save(
        obj,
        tmp_path / "main_not_local.bin",
        is_main_process=True,
        is_local_main_process=False,
        save_on_each_node=True,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["per_node.bin"]
    assert torch.load(tmp_path / "per_node.bin") == obj


def test_save_into_a_file_object_and_of_any_object(tmp_path: Path) -> None:
    with open(tmp_path / "list.bin", "wb") as file:
        saving.save([0, 1, 2, 3], file, **MAIN)
    assert torch.load(tmp_path / "list.bin") == [0, 1, 2, 3]


def test_safetensors_refusals_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="dict of tensors; got list"):
        saving.save([torch.ones(1)], tmp_path / "x", safe_serialization=True, **MAIN)
    with pytest.raises(TypeError, match="step is not"):
        saving.save(
            {"w": torch.ones(1), "step": 3}, tmp_path / "x", safe_serialization=True, **MAIN
        )
    with open(tmp_path / "y", "wb") as file, pytest.raises(TypeError, match="needs a path"):
        saving.save({"w": torch.ones(1)}, file, safe_serialization=True, **MAIN)
    assert not (tmp_path / "x").exists()


# -- profile -------------------------------------------------------------------------------
def test_profile_writes_the_trace_then_waits(tmp_path: Path) -> None:
    from accelerate.utils import ProfileKwargs  # Accelerate's own handler is read by field

    events: list[str] = []
    settings = ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path / "traces"))
    with profiling.profile(
        settings, process_index=3, wait_for_everyone=lambda: events.append("waited")
    ) as prof:
        torch.ones(16, 16) @ torch.ones(16, 16)
        events.append("block")
    assert events == ["block", "waited"]
    trace = json.loads((tmp_path / "traces" / "profile_3.json").read_text())
    assert any(e.get("name") == "aten::matmul" for e in trace["traceEvents"])
    assert any(e.key == "aten::matmul" for e in prof.key_averages())


def test_profile_honours_schedule_callback_and_shapes() -> None:
    ready: list[int] = []
    settings = types.SimpleNamespace(
        schedule_option={"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
        on_trace_ready=lambda prof: ready.append(prof.step_num),
        record_shapes=True,
    )
    with profiling.profile(settings, process_index=0, wait_for_everyone=lambda: None) as prof:
        for _ in range(5):
            torch.ones(4, 6) @ torch.ones(6, 2)
            prof.step()
    assert ready == [4]  # one trace: after wait 1 + warmup 1 + active 2 steps
    shapes = {str(e.input_shapes) for e in prof.key_averages(group_by_input_shape=True)}
    assert any("[4, 6]" in s and "[6, 2]" in s for s in shapes)


def test_profile_builds_each_flag_into_the_profiler() -> None:
    flags = ("record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules")
    built = profiling.build_profiler(types.SimpleNamespace(**dict.fromkeys(flags, True)))
    assert built.record_shapes and built.profile_memory and built.with_stack
    assert built.with_flops and built.with_modules
    default = profiling.build_profiler(None)
    assert not (default.record_shapes or default.with_stack or default.with_flops)


def test_profile_exports_nothing_when_the_block_fails(tmp_path: Path) -> None:
    waited: list[bool] = []
    settings = types.SimpleNamespace(output_trace_dir=str(tmp_path))
    with (
        pytest.raises(KeyError),
        profiling.profile(settings, process_index=0, wait_for_everyone=lambda: waited.append(True)),
    ):
        raise KeyError("boom")
    assert list(tmp_path.iterdir()) == [] and waited == []


def test_profile_refuses_an_unknown_activity_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'tpu'.*\['cpu', 'cuda'"):
        profiling.build_profiler(types.SimpleNamespace(activities=["cpu", "tpu"]))


# -- join_uneven_inputs --------------------------------------------------------------------
def prepared_loader(rank: int, world: int, samples: int = 10) -> PreparedDataLoader:
    dataset = TensorDataset(torch.arange(samples))
    plan = ShardPlan(rank=rank, world_size=world, seed=0)
    return PreparedDataLoader(DataLoader(dataset, batch_size=4), plan, None, GradientState())


def ddp_model() -> torch.nn.parallel.DistributedDataParallel:
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))


def test_join_overrides_even_batches_for_the_block_and_restores_it(one_rank_group: None) -> None:
    model, loader = ddp_model(), prepared_loader(rank=1, world=2)
    with join_uneven_inputs(
        [model],
        even_batches=False,
        distributed_type=DistributedType.MULTI_CPU,
        num_processes=2,
        default_even_batches=True,
        dataloaders=[loader],
    ):
        assert loader.plan.even_batches is False
        assert model._join_config.enable  # uneven batches: Join shadows collectives
        batches = [b[0].tolist() for b in loader]
    assert loader.plan.even_batches is True
    # Rank 1 of 2 over 10 samples in batches of 4: [4..7] only (rank 0 gets [0..3], [8, 9]),
    # as Accelerate's BatchSamplerShard(even_batches=False) deals them.
    assert batches == [[4, 5, 6, 7]]


def test_join_override_applies_after_len_was_taken(one_rank_group: None) -> None:
    model, loader = ddp_model(), prepared_loader(rank=1, world=2)
    assert len(loader) == 2  # e.g. to size a scheduler: padded to even batches
    with join_uneven_inputs(
        [model],
        even_batches=False,
        distributed_type=DistributedType.MULTI_CPU,
        num_processes=2,
        default_even_batches=True,
        dataloaders=[loader],
    ):
        assert [b[0].tolist() for b in loader] == [[4, 5, 6, 7]]


def test_join_with_even_batches_leaves_join_disabled(one_rank_group: None) -> None:
    model, loader = ddp_model(), prepared_loader(rank=0, world=2)
    with join_uneven_inputs(
        [model],
        distributed_type=DistributedType.MULTI_CPU,
        num_processes=2,
        default_even_batches=True,
        dataloaders=[loader],
    ):
        assert not model._join_config.enable
        assert loader.plan.even_batches is True


def test_join_restores_loaders_when_the_block_raises(one_rank_group: None) -> None:
    loader = prepared_loader(rank=0, world=2)
    with (
        pytest.raises(RuntimeError, match="inside"),
        join_uneven_inputs(
            [ddp_model()],
            even_batches=False,
            distributed_type=DistributedType.MULTI_CPU,
            num_processes=2,
            default_even_batches=True,
            dataloaders=[loader],
        ),
    ):
        raise RuntimeError("inside")
    assert loader.plan.even_batches is True


def test_join_warns_about_iterable_loaders(one_rank_group: None) -> None:
    class Stream(IterableDataset[torch.Tensor]):
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.arange(6))

    plan = ShardPlan(rank=0, world_size=2, seed=0)
    stream = PreparedIterableLoader(DataLoader(Stream(), batch_size=2), plan, None, GradientState())
    with (
        pytest.warns(UserWarning, match="IterableDataset"),
        join_uneven_inputs(
            [ddp_model()],
            even_batches=False,
            distributed_type=DistributedType.MULTI_CPU,
            num_processes=2,
            default_even_batches=True,
            dataloaders=[stream],
        ),
    ):
        pass
    assert stream.plan.even_batches is True


def test_join_refuses_what_torch_cannot_join(one_rank_group: None) -> None:
    options: dict[str, Any] = {
        "distributed_type": DistributedType.MULTI_CPU,
        "num_processes": 2,
        "default_even_batches": True,
    }
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with (
        pytest.raises(TypeError, match=r"joinables\[1\] is a SGD"),
        join_uneven_inputs([ddp_model(), optimizer], **options),
    ):
        pass
    with pytest.raises(ValueError, match="no joinables"), join_uneven_inputs([], **options):
        pass


def test_join_does_nothing_on_one_process_and_warns_outside_ddp() -> None:
    loader = prepared_loader(rank=0, world=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one process: silently nothing, as in Accelerate
        with join_uneven_inputs(
            ["not even a model"],
            even_batches=False,
            distributed_type=DistributedType.NO,
            num_processes=1,
            default_even_batches=True,
            dataloaders=[loader],
        ):
            pass
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.XLA):
        with (
            pytest.warns(UserWarning, match=f"no effect under {kind.value}"),
            join_uneven_inputs(
                [],
                even_batches=False,
                distributed_type=kind,
                num_processes=2,
                default_even_batches=True,
                dataloaders=[loader],
            ),
        ):
            assert loader.plan.even_batches is True  # Accelerate leaves loaders alone too


# -- trigger_sync_in_backward --------------------------------------------------------------
def allreduces_in_backward(trigger: Any) -> list[int]:
    """All-reduces run by the backward of each of two losses forwarded under no_sync: the
    first backward plain, the second inside ``trigger(model)``."""
    model = ddp_model()
    calls: list[int] = []

    # Unannotated: DDP compares the annotations with its types, and this module's are strings.
    def allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
        calls[-1] += 1
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    model.register_comm_hook(None, allreduce_hook)
    with model.no_sync():
        loss_a = model(torch.ones(2, 2)).sum()
        loss_b = model(torch.ones(2, 2)).sum()
    calls.append(0)
    loss_a.backward()
    calls.append(0)
    with trigger(model):
        loss_b.backward()
    return calls


def test_trigger_sync_in_backward_matches_accelerate(one_rank_group: None) -> None:
    from accelerate import Accelerator as AccelerateAccelerator

    ours = allreduces_in_backward(trigger_sync_in_backward)
    theirs = allreduces_in_backward(AccelerateAccelerator.trigger_sync_in_backward)
    assert ours == theirs == [0, 1]  # only the triggered backward reduced (one bucket)


def test_trigger_sync_in_backward_restores_no_sync_flags(one_rank_group: None) -> None:
    model = ddp_model()
    model.require_backward_grad_sync = False
    with trigger_sync_in_backward(model):
        assert model.require_backward_grad_sync
        model(torch.ones(1, 2)).sum().backward()
    assert model.require_backward_grad_sync is False


def test_trigger_sync_in_backward_ignores_modules_that_are_not_ddp() -> None:
    # A module with DDP's attributes that is no DDP (FSDP's, say): left alone, as Accelerate
    # does; a duck-typed check would flip its flag or call its reducer (which raises here).
    class Reducer:
        def prepare_for_backward(self, outputs: Any) -> None:
            raise AssertionError("the reducer of a module that is not DDP was prepared")

    lookalike = torch.nn.Linear(2, 1)
    lookalike.require_backward_grad_sync = False
    lookalike.require_forward_param_sync = False
    lookalike.reducer = Reducer()
    with trigger_sync_in_backward(lookalike):
        assert lookalike.require_backward_grad_sync is False
        assert lookalike.require_forward_param_sync is False
    assert lookalike.require_backward_grad_sync is False


# -- get_tracker ---------------------------------------------------------------------------
def test_get_tracker_finds_by_name_and_unwraps(tmp_path: Path) -> None:
    csv = CSVTracker("proj", tmp_path, {})
    library_object = object()
    wrapped = types.SimpleNamespace(name="tensorboard", tracker=library_object)
    try:
        assert tracker_lookup.get_tracker([csv, wrapped], "csv") is csv
        assert tracker_lookup.get_tracker([csv, wrapped], "tensorboard", unwrap=True) is (
            library_object
        )
        with pytest.raises(ValueError, match=r"'wandb'.*'csv', 'tensorboard'"):
            tracker_lookup.get_tracker([csv, wrapped], "wandb")
    finally:
        csv.finish()


def test_get_tracker_without_trackers_is_a_blank_that_does_nothing() -> None:
    from accelerate.tracking import GeneralTracker

    blank = tracker_lookup.get_tracker([], "wandb", unwrap=True)
    accelerate_blank = GeneralTracker(_blank=True)
    for method in ("start", "store_init_configuration", "log", "finish"):
        assert hasattr(accelerate_blank, method) and hasattr(blank, method)
    blank.store_init_configuration({"lr": 0.1})
    assert blank.log({"loss": 1.0}, step=2) is None
    blank.finish()
    assert not hasattr(blank, "tracker") and not hasattr(accelerate_blank, "tracker")


def test_get_tracker_unwrap_without_a_library_object_says_so() -> None:
    bare = types.SimpleNamespace(name="jsonl")
    with pytest.raises(NotImplementedError, match="jsonl tracker does not expose"):
        tracker_lookup.get_tracker([bare], "jsonl", unwrap=True)


# -- lomo_backward -------------------------------------------------------------------------
class Lomo(torch.optim.SGD):
    """Stands in for lomo_optim.Lomo (not installed): recognised by class and package."""

    __module__ = "lomo_optim.lomo"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model.parameters(), lr=0.0)
        self.fused: list[tuple[float, float]] = []

    def fused_backward(self, loss: torch.Tensor, lr: float) -> None:
        self.fused.append((float(loss), lr))


def test_lomo_backward_runs_each_lomo_optimizers_fused_backward() -> None:
    model = torch.nn.Linear(1, 1)
    fused = Lomo(model)
    prepared = AcceleratedOptimizer(fused, GradientState(), None)
    other = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    assert lomo.is_lomo_optimizer(prepared) and lomo.is_lomo_optimizer(fused)
    assert not lomo.is_lomo_optimizer(other)
    lomo.lomo_backward(torch.tensor(2.5), 0.01, [other, prepared])
    assert fused.fused == [(2.5, 0.01)]


def test_lomo_backward_refuses_without_lr_or_lomo_optimizer() -> None:
    other = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs the learning rate"):
        lomo.lomo_backward(torch.tensor(1.0), None, [Lomo(torch.nn.Linear(1, 1))])
    with pytest.raises(ValueError, match=r"no LOMO optimizer among the 1 prepared.*\(SGD\)"):
        lomo.lomo_backward(torch.tensor(1.0), 0.1, [other])


# -- verify_device_map ---------------------------------------------------------------------
def test_verify_device_map_agrees_with_accelerate() -> None:
    from accelerate import Accelerator as AccelerateAccelerator

    def model_with(maps: dict[int, Any]) -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
        for index, value in maps.items():
            model[index].hf_device_map = value
        return model

    cases = [{}, {0: {"": "cpu"}}, {1: {"a": "cpu", "b": 0}}, {0: {}}]
    for maps in cases:
        model = model_with(maps)
        # verify_device_map reads nothing from the Accelerator: called unbound on a stand-in.
        theirs = AccelerateAccelerator.verify_device_map(None, model)  # type: ignore[arg-type]
        assert device_map.verify_device_map(model) is theirs, maps
    assert [device_map.verify_device_map(model_with(m)) for m in cases] == [
        False,
        False,
        True,
        False,
    ]


# -- set_trigger / check_trigger -----------------------------------------------------------
def test_trigger_flag_any_rank_raises_it_for_all() -> None:
    others = [torch.tensor(0)]  # what the other rank contributes to the sum

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        return tensor + others[0]

    flag = TriggerFlag(torch.device("cpu"), reduce)
    assert flag.check() is False and flag.tensor is not None and int(flag.tensor) == 0
    others[0] = torch.tensor(1)  # the other rank called set_trigger
    assert flag.check() is True
    others[0] = torch.tensor(0)
    flag.set()
    assert int(flag.tensor) == 1
    assert flag.check() is True and int(flag.tensor) == 0
    assert flag.check() is False
