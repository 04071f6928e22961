"""Accelerator in this process (world size 1): precision, accumulation, config, prepare.

Data sharding and checkpoints are in test_accel_data.py. Tolerances: SGD on float32 with the
same samples per step differs only in the order of floating-point sums, so 1e-6.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbaccel
from nbaccel import Accelerator
from nbaccel.accel import precision
from nbaccel.accel.data.loaders import PreparedDataLoader
from nbaccel.accel.optim import AcceleratedOptimizer, AcceleratedScheduler

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


class Elementwise(torch.nn.Module):
    """``x * w``: autocast leaves mul in fp32, so gradients are exact (grad = sum of x)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def grad_norm(parameters: Any) -> float:
    return float(torch.cat([p.grad.flatten() for p in parameters]).norm())


def fp16_setup() -> tuple[Accelerator, torch.nn.Module, AcceleratedOptimizer, Any]:
    acc = Accelerator(mixed_precision="fp16")
    model = Elementwise()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


# -- mixed precision -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_prepared_forward_autocasts_inner_layers_and_returns_fp32(mode: str) -> None:
    acc = Accelerator(mixed_precision=mode)
    model = mlp()
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    prepared, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = prepared(torch.randn(4, 3))
    assert seen == [LOW[mode]]  # the inner Linear ran in low precision
    assert out.dtype == torch.float32
    acc.backward(out.pow(2).mean())
    assert all(p.dtype == torch.float32 for p in prepared.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    with acc.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == LOW[mode]
    with acc.autocast(enabled=False):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    # By default (as in Accelerate) unwrap_model keeps the autocast forward: training that
    # goes on with the same module object is unchanged.
    kept = acc.unwrap_model(prepared)
    seen.clear()
    assert kept is model and kept(torch.randn(4, 3)).dtype == torch.float32
    assert seen == [LOW[mode]]
    # keep_fp32_wrapper=False restores the user's forward: no autocast any more.
    inner = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
    seen.clear()
    assert inner is model and inner(torch.randn(4, 3)).dtype == torch.float32
    assert seen == [torch.float32]


def test_no_mixed_precision_changes_nothing() -> None:
    acc = Accelerator(mixed_precision="no")
    model = mlp()
    forward = model.forward
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    assert acc.prepare(model) is model and model.forward == forward
    model(torch.randn(2, 3))
    with acc.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert seen == [torch.float32] and acc.scaler is None and acc.mixed_precision == "no"


def test_fp16_backward_scales_the_loss_and_clipping_unscales_first() -> None:
    acc, model, _opt, _ = fp16_setup()
    assert isinstance(acc.scaler, torch.amp.GradScaler) and acc.scaler.is_enabled()
    assert acc.scaler._device == "cpu"  # a bare GradScaler() would be CUDA-only, disabled
    x = torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]])
    true_grad = x.sum(0)
    acc.backward(model(x).sum())
    scale = acc.scaler.get_scale()
    assert scale > 1 and torch.equal(model.w.grad, true_grad * scale)
    norm = acc.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert norm is not None and float(norm) == pytest.approx(float(true_grad.norm()), rel=1e-5)
    assert grad_norm(model.parameters()) <= 1.0 + 1e-5  # clipped after unscaling
    acc.unscale_gradients()  # a second unscale this step must not divide again
    assert grad_norm(model.parameters()) == pytest.approx(1.0, rel=1e-4)


def test_fp16_inf_gradient_skips_the_step_and_the_scheduler() -> None:
    acc, model, opt, sched = fp16_setup()
    before = model.w.detach().clone()
    lr, scale = sched.get_last_lr(), acc.scaler.get_scale()
    acc.backward(model(torch.tensor([[float("inf"), 1.0, 1.0]])).sum())
    opt.step()
    sched.step()
    opt.zero_grad()
    assert acc.optimizer_step_was_skipped
    assert torch.equal(model.w.detach(), before)
    assert sched.get_last_lr() == lr and acc.scaler.get_scale() == scale / 2
    acc.backward(model(torch.ones(1, 3)).sum())  # a finite step goes through again
    opt.step()
    sched.step()
    assert not acc.optimizer_step_was_skipped
    assert not torch.equal(model.w.detach(), before) and sched.get_last_lr() == [lr[0] / 2]


def test_fp16_scaler_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    acc, model, opt, _ = fp16_setup()
    acc.backward(model(torch.tensor([[float("nan"), 1.0, 1.0]])).sum())
    opt.step()  # skipped: the scale halves
    saved = acc.scaler.state_dict()
    acc.save_state(tmp_path)
    fresh, *_ = fp16_setup()
    assert fresh.scaler.get_scale() != saved["scale"]
    fresh.load_state(tmp_path)
    assert fresh.scaler.state_dict() == saved


def test_unknown_precision_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(nbaccel.ConfigError, match=r"'fp8' is not one of 'no', 'fp16', 'bf16'"):
        Accelerator(mixed_precision="fp8")


def test_bf16_on_a_gpu_without_bf16_is_a_clear_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(precision, "_cuda_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(nbaccel.ConfigError, match=r"T4 has none\. Use mixed_precision='fp16'"):
        precision.check_device_supports("bf16", cuda)
    precision.check_device_supports("fp16", cuda)  # fp16 needs no bf16 support
    monkeypatch.setattr(precision, "_cuda_bf16_supported", lambda: True)
    precision.check_device_supports("bf16", cuda)
    with pytest.raises(nbaccel.ConfigError, match="not available on device type 'meta'"):
        precision.check_device_supports("bf16", torch.device("meta"))


# -- gradient accumulation -----------------------------------------------------------------
def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(12, 3, generator=generator), torch.randn(12, 1, generator=generator)


def test_k_micro_batches_equal_one_step_on_a_k_times_batch() -> None:
    x, y = regression_data()
    reference = mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    # What the accumulated gradient must be after each micro-batch: the running sum of loss/k.
    probe = mlp()
    expected = []
    for i in range(3):
        part = slice(4 * i, 4 * i + 4)
        (torch.nn.functional.mse_loss(probe(x[part]), y[part]) / 3).backward()
        expected.append(probe[0].weight.grad.clone())

    acc = Accelerator(gradient_accumulation_steps=3)
    model = mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    start = [p.detach().clone() for p in model.parameters()]
    for i in range(3):
        part = slice(4 * i, 4 * i + 4)
        with acc.accumulate(model):
            assert acc.sync_gradients == (i == 2)
            acc.backward(torch.nn.functional.mse_loss(model(x[part]), y[part]))
            assert float((model[0].weight.grad - expected[i]).abs().max()) < 1e-6
            if i < 2:
                assert acc.clip_grad_norm_(model.parameters(), 1e9) is None
            opt.step()
            opt.zero_grad()
            if i < 2:  # step and zero_grad were no-ops: parameters unchanged, gradients kept
                assert all(
                    torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True)
                )
                assert model[0].weight.grad is not None
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert float((p.detach() - q.detach()).abs().max()) < 1e-6
    assert model[0].weight.grad is None  # the real zero_grad ran at the sync step
    assert acc.step == 3


def test_sync_pattern_and_the_last_batch_of_a_loader_forces_a_sync() -> None:
    acc = Accelerator(gradient_accumulation_steps=3)
    pattern = []
    for _ in range(7):
        with acc.accumulate():
            pattern.append(acc.sync_gradients)
    assert pattern == [False, False, True, False, False, True, False]
    acc = Accelerator(gradient_accumulation_steps=2)
    loader = acc.prepare(DataLoader(torch.arange(5), batch_size=1))
    pattern = []
    for _ in loader:
        with acc.accumulate():
            pattern.append(acc.sync_gradients)
    assert pattern == [False, True, False, True, True]


def test_every_epoch_starts_a_fresh_accumulation_cycle() -> None:
    acc = Accelerator(gradient_accumulation_steps=2)
    loader = acc.prepare(DataLoader(torch.arange(5), batch_size=1))
    epochs = []
    for _ in range(2):
        pattern = []
        for _ in loader:
            with acc.accumulate():
                pattern.append(acc.sync_gradients)
        epochs.append(pattern)
    assert epochs == [[False, True, False, True, True]] * 2


# -- config --------------------------------------------------------------------------------
def test_explicit_arguments_win_over_the_config_object() -> None:
    config = nbaccel.Config(mixed_precision="fp16", gradient_accumulation_steps=4, max_grad_norm=2)
    acc = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2, config=config)
    assert acc.mixed_precision == "bf16" and acc.scaler is None
    assert acc.gradient_accumulation_steps == 2 and acc.config.max_grad_norm == 2
    assert Accelerator(config=config).gradient_accumulation_steps == 4


def huge_gradient_step(acc: Accelerator, model: Any, opt: Any, user_clip: float | None) -> float:
    """One step with a gradient of norm ~1e4; returns the gradient norm after the step."""
    opt.zero_grad()
    acc.backward(1000 * model(torch.full((2, 3), 5.0)).sum())
    if user_clip is not None:
        acc.clip_grad_norm_(model.parameters(), user_clip)
    opt.step()
    return grad_norm(model.parameters())


def test_config_max_grad_norm_clips_in_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def counting_clip(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        calls.append(max_norm)
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", counting_clip)
    acc = Accelerator(config=nbaccel.Config(max_grad_norm=0.5))
    model = torch.nn.Linear(3, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    assert huge_gradient_step(acc, model, opt, user_clip=None) <= 0.5 + 1e-5
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert float((after - before).norm()) == pytest.approx(0.5, rel=1e-4)  # lr 1 x clipped
    assert calls == [0.5]
    # The user's clip replaces the config's (no second clip in step) ...
    assert huge_gradient_step(acc, model, opt, user_clip=1e9) > 1000 and calls == [0.5, 1e9]
    # ... for that step only.
    assert huge_gradient_step(acc, model, opt, user_clip=None) <= 0.5 + 1e-5
    assert calls == [0.5, 1e9, 0.5]


def test_invalid_accumulation_and_xla_without_torch_xla_are_config_errors() -> None:
    with pytest.raises(nbaccel.ConfigError, match="gradient_accumulation_steps must be >= 1"):
        Accelerator(gradient_accumulation_steps=0)
    if importlib.util.find_spec("torch_xla") is not None:
        return  # the XLA environment trains with it: tests/xla
    with pytest.raises(nbaccel.ConfigError, match=r"torch_xla.*not installed.*nbaccel\[xla\]"):
        Accelerator(config=nbaccel.Config(strategy="xla"))


def test_fsdp_with_one_process_warns_and_trains_unsharded() -> None:
    with pytest.warns(UserWarning, match="nothing to shard, so the model trains unsharded"):
        acc = Accelerator(config=nbaccel.Config(strategy="fsdp"))
    model = acc.prepare(torch.nn.Linear(3, 1))
    assert acc.distributed_type.value == "NO"
    assert type(model) is torch.nn.Linear


# -- scheduler -----------------------------------------------------------------------------
def test_scheduler_steps_only_after_real_optimizer_steps() -> None:
    acc = Accelerator(gradient_accumulation_steps=2)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    lrs = []
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.ones(2, 3)).sum())
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == [1.0, 0.5, 0.5, 0.25]
    assert sched.last_epoch == 2  # forwarded to the wrapped scheduler


def test_scheduler_not_tied_to_the_optimizer_steps_on_every_call() -> None:
    acc = Accelerator(gradient_accumulation_steps=2, step_scheduler_with_optimizer=False)
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    opt, sched = acc.prepare(opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    with acc.accumulate():  # not a sync step: the optimizer does not step
        sched.step()
    assert sched.get_last_lr() == [0.5]


# -- prepare -------------------------------------------------------------------------------
def test_prepare_any_order_returns_the_same_order() -> None:
    acc = Accelerator()
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    loader = DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=2)
    out = acc.prepare(sched, loader, opt, model)
    kinds = (AcceleratedScheduler, PreparedDataLoader, AcceleratedOptimizer, torch.nn.Linear)
    assert [type(o) for o in out] == list(kinds)
    assert out[0].optimizers == [out[2]] and out[2].optimizer is opt
    assert acc.prepare(out[2]) is out[2]  # already prepared: returned alone, not re-wrapped
    assert isinstance(acc.prepare(torch.nn.Linear(1, 1)), torch.nn.Linear)


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ("text", "got str as argument 1"),
        (TensorDataset(torch.ones(2)), "Wrap a Dataset in a DataLoader first"),
        (DataLoader(torch.ones(4), batch_size=None), "batch_size=None"),
    ],
)
def test_prepare_rejects_what_it_cannot_prepare(obj: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        Accelerator().prepare(torch.nn.Linear(1, 1), obj)


# -- collectives and process helpers ---------------------------------------------------------
def test_single_process_collectives() -> None:
    acc = Accelerator()
    ones = torch.ones(2, 2)
    gathered = acc.gather({"a": torch.tensor(3.0), "b": [ones]})
    assert gathered["a"].shape == (1,) and gathered["a"].item() == 3.0
    assert torch.equal(gathered["b"][0], torch.ones(2, 2))
    gathered["b"][0].add_(1)
    assert torch.equal(ones, torch.ones(2, 2))  # a copy, not the caller's tensor
    assert acc.reduce(torch.tensor([2.0]), "mean").tolist() == [2.0]
    assert acc.reduce({"x": torch.tensor([2.0])}, "sum", scale=3.0)["x"].tolist() == [6.0]
    assert torch.equal(acc.pad_across_processes(torch.ones(2, 3), dim=1), torch.ones(2, 3))
    with pytest.raises(ValueError, match="'max' is not one of"):
        acc.reduce(torch.ones(1), "max")
    for call in (acc.gather, acc.reduce, acc.pad_across_processes):
        with pytest.raises(TypeError, match="expected tensors"):
            call({"a": "text"})


def test_gather_for_metrics_drops_the_padding_of_the_last_batch() -> None:
    acc = Accelerator()
    rows = torch.arange(8).reshape(4, 2)
    assert acc.gather_for_metrics(rows).shape == (4, 2)  # not at the end: all rows
    acc.gradient_state.end_of_dataloader, acc.gradient_state.remainder = True, 3
    assert torch.equal(acc.gather_for_metrics(rows), rows[:3])
    assert acc.gather_for_metrics({"r": [rows]})["r"][0].shape == (3, 2)
    assert acc.gather_for_metrics(["a", "b", "c", "d"]) == ["a", "b", "c"]


def test_main_process_helpers(capsys: pytest.CaptureFixture[str]) -> None:
    acc = Accelerator()
    assert (acc.num_processes, acc.process_index, acc.is_main_process) == (1, 0, True)
    assert acc.distributed_type == nbaccel.DistributedType.NO and str(acc.device) == "cpu"
    ran: list[str] = []
    with acc.main_process_first():
        ran.append("block")
    acc.wait_for_everyone()

    def answer(x: int) -> int:
        """Doc."""
        return x + 1

    wrapped: Callable[[int], int] = acc.on_main_process(answer)
    assert ran == ["block"] and wrapped(1) == 2 and wrapped.__name__ == "answer"
    acc.print("hello", 3, sep="-")
    assert capsys.readouterr().out == "hello-3\n"


# -- torch.compile and saving ----------------------------------------------------------------
class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.nn.Linear(4, 4, bias=False)
        self.decode = torch.nn.Linear(4, 4)
        self.decode.weight = self.encode.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(torch.tanh(self.encode(x)))


def test_dynamo_backend_compiles_and_unwrap_peels_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, load_model

    acc = Accelerator(dynamo_backend="aot_eager")
    torch.manual_seed(0)
    model = Tied()
    compiled = acc.prepare(model)
    assert compiled is not model and hasattr(compiled, "_orig_mod")
    assert acc.unwrap_model(compiled, keep_torch_compile=False) is model
    assert acc.unwrap_model(compiled) is compiled  # Accelerate's default keeps it compiled
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert float((compiled(x) - model(x)).abs().max()) < 1e-6
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    acc.save_model(compiled, tmp_path / "out")
    assert set(load_file(tmp_path / "out" / "model.safetensors")) <= {
        "encode.weight",
        "decode.weight",
        "decode.bias",
    }
    restored = Tied()
    load_model(restored, tmp_path / "out" / "model.safetensors")
    for (k, v), (k2, v2) in zip(
        restored.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(v, v2)
    assert restored.decode.weight is restored.encode.weight


def test_save_model_strips_the_ddp_prefix(tmp_path: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    init = functools.partial(dist.init_process_group, "gloo", rank=0, world_size=1)
    init(init_method=f"file://{tmp_path / 'store'}")
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        Accelerator().save_model(ddp, tmp_path)
    finally:
        dist.destroy_process_group()
    assert set(load_file(tmp_path / "model.safetensors")) == {"weight", "bias"}


def test_free_memory_forgets_what_was_prepared() -> None:
    import gc
    import weakref

    acc = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    alive = weakref.ref(model)
    model, optimizer = acc.free_memory(model, optimizer)
    gc.collect()
    assert (model, optimizer) == (None, None)
    assert alive() is None  # the Accelerator kept no reference


def test_outputs_with_non_tensor_leaves_still_come_back_in_fp32() -> None:
    class Scored(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            return {"logits": self.linear(x), "count": len(x), "note": "ok"}

    acc = Accelerator(mixed_precision="bf16")
    out = acc.prepare(Scored())(torch.randn(4, 3))
    assert out["logits"].dtype == torch.float32  # computed in bf16, handed back in fp32
    assert (out["count"], out["note"]) == (4, "ok")


def test_accelerates_gradient_accumulation_plugin_is_read_by_its_fields() -> None:
    from nbaccel.utils import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=3, sync_each_batch=True)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    assert acc.gradient_accumulation_steps == 3
    assert acc.config.sync_each_batch is True
