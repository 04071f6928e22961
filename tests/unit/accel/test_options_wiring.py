"""Every option of Accelerate's plugins, handlers and configurations reaches the worker.

One process: a one-rank gloo group stands in for DDP, FSDP2 and the process group's timeout;
a stand-in for deepspeed for the DeepSpeed engine. What needs two ranks (rng_types,
dispatch_batches, join_uneven_inputs, the timeout of a launch's group) is in
tests/multiprocess/test_options_wiring.py. Accelerate's own classes are the reference where
they run in one process (``SeedableRandomSampler``, ``GradientAccumulationPlugin``).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

from nbaccel import Accelerator
from nbaccel.accel.data.loaders import PreparedIterableLoader, ShardPlan
from nbaccel.accel.data.rng_sync import rngs_to_synchronize
from nbaccel.accel.optim import AcceleratedScheduler, GradientState
from nbaccel.accel.precision import Precision
from nbaccel.accel.state import DistributedType, ProcessState, apply_init_process_group_kwargs
from nbaccel.accel.strategies import DataParallel, DeepSpeed, models, sharding
from nbaccel.accel.strategies.data_parallel import register_comm_hook
from nbaccel.accel.strategies.deepspeed_engine import DeepSpeedRun
from nbaccel.config.accelerate.kwargs_handlers import (
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    TorchDynamoPlugin,
)
from nbaccel.config.accelerate.plugins import DeepSpeedPlugin
from nbaccel.config.accelerator_options import AcceleratorOptions, apply_accelerator_arguments
from nbaccel.config.deepspeed.settings import deepspeed_config, fill_auto_values
from nbaccel.config.schema import Config
from nbaccel.config.sections import FSDPOptions
from nbaccel.utils import DataLoaderConfiguration

CPU = torch.device("cpu")


def one_rank(kind: DistributedType = DistributedType.MULTI_CPU) -> ProcessState:
    return ProcessState(0, 0, 1, 1, CPU, kind, "")


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real gloo group of one rank (timeout 100 s), so DDP and FSDP2 run in-process."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=100),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def group_timeout() -> timedelta:
    backend = distributed_c10d._get_default_group()._get_backend(CPU)
    timeout: timedelta = backend.options._timeout
    return timeout


def options_with(**arguments: Any) -> AcceleratorOptions:
    return apply_accelerator_arguments(Config(), **arguments)


# -- 1. FSDP mixed precision ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("param", "reduce", "mixed", "expected"),
    [
        ("auto", "auto", torch.bfloat16, (torch.bfloat16, torch.float32)),  # today's default
        ("auto", "auto", None, (None, torch.float32)),
        ("fp32", "bf16", torch.bfloat16, (torch.float32, torch.bfloat16)),
        ("fp16", "fp16", None, (torch.float16, torch.float16)),
    ],
)
def test_fsdp_dtypes_become_the_mixed_precision_policy(
    param: str, reduce: str, mixed: torch.dtype | None, expected: tuple[Any, Any]
) -> None:
    policy = sharding.mixed_precision_policy(
        FSDPOptions(param_dtype=param, reduce_dtype=reduce), mixed
    )
    assert (policy.param_dtype, policy.reduce_dtype) == expected


def test_fsdp_shards_with_the_configured_policy(one_rank_group: None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fsdp = FSDPOptions(auto_wrap_policy="NO_WRAP", param_dtype="bf16", reduce_dtype="fp16")
    sharding.shard_model(model, fsdp, one_rank(DistributedType.FSDP), None)
    policy = model._get_fsdp_state()._mp_policy  # type: ignore[operator]
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float16)
    # The parameters are gathered in bf16 for the forward, so the output comes back in it.
    assert model(torch.ones(3, 4)).dtype == torch.bfloat16


# -- 2. torch.compile keywords and regional compilation ------------------------------------
class Breaks(torch.nn.Module):
    """A forward with a graph break: fullgraph=True must refuse to compile it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        torch._dynamo.graph_break()
        return x * 2


def test_compile_keywords_reach_torch_compile() -> None:
    torch._dynamo.reset()
    strict = models.Compilation("aot_eager", {"fullgraph": True})
    prepared = models.prepare_model(
        Breaks(), one_rank(), Precision("no", CPU), device_placement=True, compilation=strict
    )
    with pytest.raises(Exception, match=r"(?i)graph.break"):
        prepared(torch.ones(2, 3))
    lenient = models.Compilation("aot_eager")
    prepared = models.prepare_model(
        Breaks(), one_rank(), Precision("no", CPU), device_placement=True, compilation=lenient
    )
    assert prepared(torch.ones(2, 3)).shape == (2, 3)


def test_compilation_comes_from_the_dynamo_plugin_and_config() -> None:
    plugin = TorchDynamoPlugin(
        backend="aot_eager", mode="max-autotune", dynamic=False, use_regional_compilation=True
    )
    compiled = models.Compilation.of(options_with(dynamo_plugin=plugin))
    assert compiled.keywords() == {"backend": "aot_eager", "mode": "max-autotune", "dynamic": False}
    assert compiled.regional
    assert not models.Compilation.of(options_with()).enabled


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)
        )
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_regional_compilation_compiles_each_block_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    torch._dynamo.reset()
    model, eager = Blocks(), Blocks()
    keys = list(model.state_dict())
    seen: list[dict[str, Any]] = []
    real_compile = torch.compile

    def recording(target: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real_compile(target, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    regional = models.Compilation("aot_eager", {"dynamic": False}, regional=True)
    prepared = models.prepare_model(
        model, one_rank(), Precision("no", CPU), device_placement=True, compilation=regional
    )
    assert prepared is model  # in place: same module, same keys
    assert list(prepared.state_dict()) == keys
    compiled = [m for m in model.modules() if m._compiled_call_impl is not None]
    assert compiled == [model.embed, *model.blocks, model.head]
    assert model._compiled_call_impl is None  # the root's own loop stays eager
    assert seen == [{"backend": "aot_eager", "dynamic": False}] * 5
    x = torch.randn(5, 4)
    assert torch.allclose(prepared(x), eager(x), atol=1e-6)


# -- 3. DDP communication hooks ---------------------------------------------------------------
def ddp_with(**handler: Any) -> DistributedDataParallel:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 3))
    options = options_with(kwargs_handlers=[DistributedDataParallelKwargs(**handler)])
    register_comm_hook(model, options, CPU)
    return model


def test_fp16_hook_reduces_gradients_in_half_precision(one_rank_group: None) -> None:
    model = ddp_with(comm_hook="fp16")
    torch.manual_seed(1)
    model(torch.randn(2, 4) * 1.2345).sum().backward()
    grad = model.module.weight.grad
    assert grad is not None
    assert torch.equal(grad, grad.half().float())  # rounded through fp16 on the way
    plain = DistributedDataParallel(torch.nn.Linear(4, 3))
    torch.manual_seed(1)
    plain(torch.randn(2, 4) * 1.2345).sum().backward()
    assert plain.module.weight.grad is not None
    assert not torch.equal(plain.module.weight.grad, plain.module.weight.grad.half().float())


def test_power_sgd_gets_its_state_from_comm_state_option(one_rank_group: None) -> None:
    model = ddp_with(
        comm_hook="power_sgd",
        comm_wrapper="fp16",
        comm_state_option={"matrix_approximation_rank": 2, "start_powerSGD_iter": 3},
    )
    [(hook, state)] = model._comm_hooks
    assert isinstance(state, powerSGD_hook.PowerSGDState)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (2, 3)
    assert hook.__name__ == "fp16_compress_wrapper_hook"
    for _ in range(4):  # past start_powerSGD_iter: compression runs on gloo
        model(torch.randn(2, 4)).sum().backward()


@pytest.mark.parametrize(
    ("handler", "error", "match"),
    [
        ({"comm_wrapper": "fp16"}, ValueError, "comm_hook is 'no'"),
        ({"comm_hook": "fp16", "comm_state_option": {"a": 1}}, ValueError, "PowerSGD's state"),
        ({"comm_hook": "bf16"}, NotImplementedError, "bf16 compression needs NCCL"),
        (
            {"comm_hook": "power_sgd", "comm_wrapper": "bf16"},
            NotImplementedError,
            "over gloo. Use 'fp16'",
        ),
        ({"comm_hook": "batched_power_sgd"}, NotImplementedError, "Use comm_hook='power_sgd'"),
    ],
)
def test_hooks_that_cannot_run_here_are_refused_at_prepare(
    one_rank_group: None, handler: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ddp_with(**handler)


def test_torchs_batched_power_sgd_still_fails_as_the_refusal_says(one_rank_group: None) -> None:
    # If a torch release fixes the hook, this fails: then drop the refusal above.
    model = DistributedDataParallel(torch.nn.Linear(4, 3))
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.batched_powerSGD_hook)
    with pytest.raises(AssertionError):
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()


def test_ddp_strategy_wraps_registers_and_compiles(one_rank_group: None) -> None:
    options = options_with(
        kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="fp16")],
        dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True),
    )
    strategy = DataParallel(one_rank(), options.config, options)
    wrapped, _ = strategy.prepare_model(
        Blocks(), Precision("no", CPU), device_placement=True, ddp_kwargs={}
    )
    assert isinstance(wrapped, DistributedDataParallel) and len(wrapped._comm_hooks) == 1
    assert all(block._compiled_call_impl is not None for block in wrapped.module.blocks)


# -- 4. DeepSpeed: the plugin's config dict and 16-bit saving under ZeRO-3 ------------------
class FakeEngine:
    """DeepSpeed's engine as far as saving goes: its 16-bit gathering returns tensors of its
    own making (float16 sevens), which nothing else would produce."""

    def __init__(self, module: torch.nn.Module, config: dict[str, Any]) -> None:
        self.module, self.config, self.gathered_16bit = module, config, 0

    def _zero3_consolidated_16bit_state_dict(self) -> dict[str, torch.Tensor]:
        self.gathered_16bit += 1
        return {
            k: torch.full_like(v, 7.0, dtype=torch.float16)
            for k, v in self.module.state_dict().items()
        }


@pytest.fixture
def fake_deepspeed(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {"fp32 gathers": 0}

    def initialize(**kwargs: Any) -> tuple[Any, ...]:
        seen.update(kwargs)
        engine = FakeEngine(kwargs["model"], kwargs["config"])
        return engine, kwargs.get("optimizer"), None, None

    def full_fp32(tensor: torch.Tensor) -> torch.Tensor:
        # DeepSpeed's fp32 master copy, which differs from the module's 16-bit weights.
        seen["fp32 gathers"] += 1
        return tensor.detach().float() + 100.0

    fake = types.SimpleNamespace(
        initialize=initialize, utils=types.SimpleNamespace(safe_get_full_fp32_param=full_fp32)
    )
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    return seen


def test_deepspeed_strategy_builds_from_the_plugins_config_dict(
    fake_deepspeed: dict[str, Any],
) -> None:
    given = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto"}
    options = apply_accelerator_arguments(
        Config(), deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=given)
    )
    assert options.config.deepspeed.zero_stage != 1  # the dict, not the options, must rule
    strategy = DeepSpeed(one_rank(DistributedType.DEEPSPEED), options.config, options)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(torch.zeros(8, 2), batch_size=4)
    strategy.prepare_engine(
        [model, optimizer, loader],
        ["model", "optimizer", "dataloader"],
        split_batches=False,
        step_scheduler_with_optimizer=True,
    )
    built = fake_deepspeed["config"]
    assert built["zero_optimization"] == {"stage": 1}
    assert built["train_micro_batch_size_per_gpu"] == 4


def zero3(save_16bit: bool) -> dict[str, Any]:
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": save_16bit}
    ds = deepspeed_config(Config(strategy="deepspeed"), {"zero_optimization": zero})
    return fill_auto_values(
        ds, micro_batch_size=2, world_size=1, accumulation_steps=1, max_grad_norm=None,
        mixed_precision="bf16",
    )  # fmt: skip


def test_zero3_save_16bit_model_gives_deepspeeds_16bit_weights(
    fake_deepspeed: dict[str, Any],
) -> None:
    run = DeepSpeedRun(torch.nn.Linear(2, 1), None, None, zero3(True))
    state = run.consolidated_state_dict()
    # DeepSpeed's gathered 16-bit tensors, handed over as they are (not the masters, no cast).
    assert run.engine.gathered_16bit == 1 and fake_deepspeed["fp32 gathers"] == 0
    assert set(state) == {"weight", "bias"}
    for tensor in state.values():
        assert tensor.dtype == torch.float16 and bool((tensor == 7.0).all())
    assert run.accelerate_state_dict().keys() == state.keys()  # get_state_dict: the same


def test_zero3_without_16bit_saving_keeps_the_fp32_master_copy(
    fake_deepspeed: dict[str, Any],
) -> None:
    model = torch.nn.Linear(2, 1)
    run = DeepSpeedRun(model, None, None, zero3(False))
    state = run.consolidated_state_dict()
    assert run.engine.gathered_16bit == 0 and fake_deepspeed["fp32 gathers"] == 2
    assert torch.equal(state["weight"], model.weight.detach() + 100.0)  # the masters


def zero2_bf16() -> dict[str, Any]:
    ds = deepspeed_config(Config(strategy="deepspeed"), {"zero_optimization": {"stage": 2}})
    return fill_auto_values(
        ds, micro_batch_size=2, world_size=1, accumulation_steps=1, max_grad_norm=None,
        mixed_precision="bf16",
    )  # fmt: skip


def test_get_state_dict_under_zero2_is_the_modules_own_weights_as_in_accelerate(
    fake_deepspeed: dict[str, Any],
) -> None:
    # DeepSpeed casts the module to bf16 and keeps fp32 masters in its optimizer. Accelerate's
    # get_state_dict gives the module's weights (a parity program's norm differed by 2e-4 when
    # nbaccel gave the masters); save_model keeps writing the masters.
    model = torch.nn.Linear(2, 1).to(torch.bfloat16)
    run = DeepSpeedRun(model, None, None, zero2_bf16())
    state = run.accelerate_state_dict()
    assert fake_deepspeed["fp32 gathers"] == 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor) and state[name].dtype == torch.bfloat16
        assert state[name].data_ptr() != tensor.data_ptr()  # a copy, safe to keep
    assert torch.equal(run.consolidated_state_dict()["weight"], model.weight.float() + 100.0)


# -- 5. InitProcessGroupKwargs on the existing group -------------------------------------------
def test_timeout_is_applied_to_the_existing_group(one_rank_group: None) -> None:
    # Also the guard on torch's private _set_pg_timeout: this fails if a release drops it.
    assert group_timeout() == timedelta(seconds=100)
    apply_init_process_group_kwargs({"timeout": timedelta(seconds=7)}, CPU)
    assert group_timeout() == timedelta(seconds=7)


def test_data_parallel_applies_the_handlers_timeout(one_rank_group: None) -> None:
    from nbaccel.utils import InitProcessGroupKwargs

    options = options_with(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=9))])
    assert options.config.collective_timeout == 9
    state = ProcessState(0, 0, 2, 2, CPU, DistributedType.MULTI_CPU, "")  # as if two ranks
    DataParallel(state, options.config, options)
    assert group_timeout() == timedelta(seconds=9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "nccl"}, "already exists with 'gloo' for cpu"),
        ({"backend": "cpu:mpi,cuda:nccl"}, "cannot change its backend"),
        ({"init_method": "tcp://10.0.0.1:1234"}, "cannot meet again"),
    ],
)
def test_a_different_backend_or_rendezvous_is_refused(
    one_rank_group: None, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        apply_init_process_group_kwargs(kwargs, CPU)
    assert group_timeout() == timedelta(seconds=100)  # nothing applied


def test_the_groups_own_backend_and_env_rendezvous_are_accepted(one_rank_group: None) -> None:
    # Accepted means applied: the timeout given beside them reaches the group, which keeps
    # its backend (a refusal raises before anything is applied, as the test above shows).
    seven, eight = timedelta(seconds=7), timedelta(seconds=8)
    own = {"backend": "gloo", "init_method": "env://", "timeout": seven}
    apply_init_process_group_kwargs(own, CPU)
    assert group_timeout() == seven
    apply_init_process_group_kwargs({"backend": "cpu:gloo,cuda:nccl", "timeout": eight}, CPU)
    assert group_timeout() == eight
    assert dist.get_backend() == "gloo"


# -- 6. DataLoaderConfiguration ------------------------------------------------------------------
def order(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch]


def test_data_seed_is_the_shuffling_seed_and_draws_nothing_global() -> None:
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(data_seed=5))
    before = torch.get_rng_state()
    loader = acc.prepare(DataLoader(range(10), batch_size=5, shuffle=True))
    assert torch.equal(torch.get_rng_state(), before)  # as Accelerate's seedable sampler
    assert loader.plan.seed == 5
    for epoch in range(2):
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch))
        assert order(loader) == expected.tolist()


def test_use_seedable_sampler_gives_accelerates_seedable_order() -> None:
    from accelerate.data_loader import SeedableRandomSampler

    torch.manual_seed(42)  # what set_seed(42) does to torch: the seed both take
    theirs = SeedableRandomSampler(data_source=range(12))
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    loader = acc.prepare(DataLoader(range(12), batch_size=4, shuffle=True))
    for epoch in range(3):
        theirs.set_epoch(epoch)
        assert order(loader) == list(theirs)


class Moved:
    """A batch type with its own ``.to`` (as transformers' BatchEncoding)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def to(self, device: torch.device, **kwargs: Any) -> Moved:
        self.calls.append(kwargs)
        return self


@pytest.mark.parametrize("non_blocking", [True, False])
def test_non_blocking_reaches_the_copy_to_the_device(non_blocking: bool) -> None:
    config = DataLoaderConfiguration(non_blocking=non_blocking)
    acc = Accelerator(dataloader_config=config)
    loader = acc.prepare(DataLoader(range(4), batch_size=2, collate_fn=lambda _: Moved()))
    batch = next(iter(loader))
    assert batch.calls == ([{"non_blocking": True}] if non_blocking else [{}])


def test_stateful_dataloader_calls_resume_where_the_state_was_taken() -> None:
    config = DataLoaderConfiguration(use_stateful_dataloader=True, data_seed=3)

    def fresh() -> Any:
        return Accelerator(dataloader_config=config).prepare(
            DataLoader(range(20), batch_size=2, shuffle=True)
        )

    loader = fresh()
    first, state, rest = [], None, []
    for number, batch in enumerate(loader):
        (first if state is None else rest).append(batch.tolist())
        if number == 3:
            state = loader.state_dict()  # mid-epoch, inside the loop, as with torchdata
    resumed = fresh()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest and len(first) == 4


def test_dispatch_batches_on_one_process_reads_as_usual() -> None:
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = acc.prepare(DataLoader(range(6), batch_size=2))
    assert order(loader) == list(range(6)) and acc.dispatch_batches


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from torch.arange(10)


@pytest.mark.parametrize("rank", [0, 1])
def test_split_batches_slices_an_iterable_datasets_batches(rank: int) -> None:
    plan = ShardPlan(rank=rank, world_size=2, seed=0, split_batches=True)
    loader = PreparedIterableLoader(DataLoader(Stream(), batch_size=4), plan, None, GradientState())
    got = [b.tolist() for b in loader]
    # Batches [0-3], [4-7], [8, 9]: each rank its half; the last completes to a multiple of 2.
    expected = [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]][rank]
    assert got == expected and loader.batch_size == 2


# -- 7. rng_types ---------------------------------------------------------------------------------
def test_rng_types_names_what_each_pass_synchronises() -> None:
    assert rngs_to_synchronize(("generator",), CPU) == ()  # the shared seed already does it
    assert rngs_to_synchronize(("torch", "generator"), CPU) == ("torch",)
    with pytest.raises(NotImplementedError, match=r"'npu'.*CPUs, CUDA GPUs and TPUs"):
        rngs_to_synchronize(("npu",), CPU)
    with pytest.raises(ValueError, match=r"'xla'.*computes on cpu"):
        rngs_to_synchronize(("xla",), CPU)


def test_an_unsupported_rng_type_fails_at_prepare() -> None:
    acc = Accelerator(rng_types=["cuda"], cpu=True)
    with pytest.raises(ValueError, match="'cuda', but this process computes on cpu"):
        acc.prepare(DataLoader(range(4), batch_size=2))


# -- 8. GradientAccumulationPlugin -----------------------------------------------------------------
def test_sync_with_dataloader_off_lets_cycles_run_across_epochs() -> None:
    grads = GradientState(accumulation_steps=3)
    grads.end_of_dataloader = True
    assert grads.next_micro_step()  # the last batch of an epoch syncs
    grads.sync_with_dataloader = False
    assert [grads.next_micro_step() for _ in range(3)] == [False, False, True]


def test_the_plugins_sync_with_dataloader_reaches_the_gradient_state() -> None:
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    acc.prepare(DataLoader(range(4), batch_size=1))
    assert acc.gradient_state.sync_with_dataloader is False


def test_sync_with_dataloader_off_accumulates_over_the_end_of_an_epoch() -> None:
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    model = torch.nn.Linear(1, 1)
    loader = acc.prepare(DataLoader(torch.ones(3, 1), batch_size=1))
    syncs = []
    for _ in range(2):
        for _batch in loader:
            with acc.accumulate(model):
                syncs.append(acc.sync_gradients)
    assert syncs == [False, True, False, True, False, True]  # 3 batches an epoch, cycles of 2


def test_accelerate_never_applies_adjust_scheduler() -> None:
    # What AcceleratedScheduler's docstring rests on: Accelerate reads the flag back from
    # to_kwargs(), which drops its default. If this fails, Accelerate changed: revisit.
    from accelerate.utils import GradientAccumulationPlugin as Theirs

    assert "adjust_scheduler" not in Theirs(num_steps=2, adjust_scheduler=True).to_kwargs()


@pytest.mark.parametrize("adjust", [True, False])
def test_the_schedule_moves_on_optimizer_steps_only_with_either_adjust_scheduler(
    adjust: bool,
) -> None:
    plugin = GradientAccumulationPlugin(num_steps=2, adjust_scheduler=adjust)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, schedule = acc.prepare(model, optimizer, schedule)
    assert isinstance(schedule, AcceleratedScheduler)
    rates = []
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.ones(1, 1)).sum())
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        rates.append(schedule.get_last_lr()[0])
    assert rates == [1.0, 0.5, 0.5, 0.25]
    assert schedule.scheduler._step_count == 3  # construction + 2 real steps, as Accelerate


# -- 9. the sampler's plan follows even_batches and split_batches --------------------------------
def test_split_batches_change_after_len_is_followed() -> None:
    from nbaccel.accel.data.sharded_sampler import ShardedBatchSampler

    plan = ShardPlan(rank=1, world_size=2, seed=0)
    sampler = ShardedBatchSampler(torch.utils.data.BatchSampler(range(8), 4, False), plan)
    assert len(sampler) == 1 and list(sampler) == [[4, 5, 6, 7]]
    plan.split_batches = True
    assert len(sampler) == 2 and list(sampler) == [[2, 3], [6, 7]]
