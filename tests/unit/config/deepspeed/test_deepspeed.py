"""The DeepSpeed config: files and options mapped, checked before launch, "auto" filled.

Runs everywhere (no deepspeed, no GPU). The last tests drive ``DeepSpeedRun`` against a
stand-in ``deepspeed`` module, for the calls the engine wrapper makes; training with the real
one is in tests/multiprocess/test_deepspeed_cuda.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from nbaccel.config.deepspeed.settings import (
    auto_paths,
    deepspeed_config,
    fill_auto_values,
    mixed_precision_of,
)
from nbaccel.config.schema import Config
from nbaccel.errors import ConfigError
from nbaccel.launcher import api

# The ZeRO-3 + offload example of Accelerate's DeepSpeed guide, with numbers where Accelerate
# would fill optimizer/scheduler values from DummyOptim/DummyScheduler.
GUIDE_EXAMPLE: dict[str, Any] = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": "auto",
        "sub_group_size": 1e9,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def write(tmp_path: Path, content: Any, name: str = "ds.json") -> str:
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content)
    elif name.endswith((".yaml", ".yml")):
        path.write_text(yaml.safe_dump(content))
    else:
        path.write_text(json.dumps(content))
    return str(path)


def with_file(path: str, **settings: Any) -> Config:
    return Config(strategy="deepspeed").replace(deepspeed_config_file=path, **settings)


def fill(ds: dict[str, Any], **run: Any) -> dict[str, Any]:
    values = dict(
        micro_batch_size=8,
        world_size=2,
        accumulation_steps=1,
        max_grad_norm=None,
        mixed_precision="no",
    )
    return fill_auto_values(ds, **{**values, **run})


# -- forms ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ds.json", "ds.yaml", "ds.yml"])
def test_the_guide_example_reads_as_json_and_yaml(tmp_path: Path, name: str) -> None:
    ds = deepspeed_config(with_file(write(tmp_path, GUIDE_EXAMPLE, name)))
    assert ds == GUIDE_EXAMPLE
    assert set(auto_paths(ds)) >= {"train_batch_size", "zero_optimization.reduce_bucket_size"}


def test_the_guide_example_filled_from_the_run(tmp_path: Path) -> None:
    ds = deepspeed_config(with_file(write(tmp_path, GUIDE_EXAMPLE), mixed_precision="bf16"))
    filled = fill(
        ds,
        micro_batch_size=4,
        world_size=8,
        accumulation_steps=2,
        max_grad_norm=1.0,
        mixed_precision="bf16",
        hidden_size=1024,
    )
    assert auto_paths(filled) == []
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["train_batch_size"] == 4 * 2 * 8
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["gradient_clipping"] == 1.0
    assert filled["fp16"]["enabled"] is False and filled["bf16"] == {"enabled": True}
    zero = filled["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1024 * 1024
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 1024 * 1024)
    assert zero["stage3_param_persistence_threshold"] == 10 * 1024
    # No hidden size in the run gives this one: dropped, so DeepSpeed's default applies.
    assert "stage3_gather_16bit_weights_on_model_save" not in zero
    assert filled["optimizer"] == GUIDE_EXAMPLE["optimizer"] and filled["steps_per_print"] == 2000
    assert ds == GUIDE_EXAMPLE  # filling works on a copy


def test_options_alone_build_the_config() -> None:
    config = Config(strategy="deepspeed").replace(
        deepspeed_zero_stage=3,
        deepspeed_offload_optimizer_device="cpu",
        deepspeed_offload_param_device="cpu",
    )
    ds = deepspeed_config(config)
    assert ds["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
    assert set(auto_paths(ds)) == {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    }
    filled = fill(ds, accumulation_steps=4, mixed_precision="fp16")
    assert filled["gradient_accumulation_steps"] == 4 and filled["train_batch_size"] == 64
    assert "gradient_clipping" not in filled  # no clipping: DeepSpeed's default 0
    # As Accelerate: fp16 where the config is silent casts the inputs too (auto_cast).
    assert filled["fp16"] == {"enabled": True, "auto_cast": True}
    assert filled["bf16"] == {"enabled": False}
    assert deepspeed_config(Config(strategy="deepspeed"))["zero_optimization"] == {"stage": 2}


def test_unknown_keys_are_kept_and_bfloat16_is_an_alias(tmp_path: Path) -> None:
    content = {"my_experiment_tag": "x", "bfloat16": {"enabled": True}}
    ds = deepspeed_config(with_file(write(tmp_path, content)))
    assert ds["my_experiment_tag"] == "x"
    assert mixed_precision_of(ds) == "bf16"
    with pytest.raises(ConfigError, match="mixed_precision='fp16'"):
        deepspeed_config(with_file(write(tmp_path, content), mixed_precision="fp16"))


# -- what is refused, and what the message says -----------------------------------------------
BAD_CONTENT = [
    ({"zero_optimisation": {"stage": 2}}, "did you mean 'zero_optimization'"),
    ({"gradient_clip": 1.0}, "did you mean 'gradient_clipping'"),
    ({"zero_optimization": {"stage": 4}}, "must be a ZeRO stage: 0 .off."),
    ({"zero_optimization": {"stage": "2"}}, "must be a ZeRO stage"),
    ({"zero_optimization": [2]}, 'must be a mapping: {"stage": 2'),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
        "must be one of 'none', 'cpu', 'nvme'",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "needs ZeRO stage 3 .* Use stage 3, or offload the optimizer only",
    ),
    (
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        "needs ZeRO stage 1, 2 or 3 .* Use stage 2",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        'needs a folder on an NVMe drive .*"nvme_path"',
    ),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "Enable one, or set both"),
    ({"fp16": {"enabled": "yes"}}, 'fp16.enabled=.yes. .* must be like {"enabled": true}'),
    ({"train_micro_batch_size_per_gpu": 0}, 'must be a whole number >= 1 or "auto"'),
    ({"train_batch_size": 12.5}, 'must be a whole number >= 1 or "auto"'),
    ({"gradient_clipping": -1}, 'must be a number >= 0 .0: no clipping. or "auto"'),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
        "optimizer.params.lr='auto' .* has nothing to be filled from.* Put a number there",
    ),
]


@pytest.mark.parametrize(("content", "fragment"), BAD_CONTENT)
def test_a_bad_file_is_refused_with_the_fix(
    tmp_path: Path, content: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment) as caught:
        deepspeed_config(with_file(write(tmp_path, content)))
    assert caught.value.field == "deepspeed_config_file"
    assert "ds.json" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "name", "fragment"),
    [
        ('{"zero_optimization": {"stage": 2},}', "ds.json", "not valid JSON: .* line 1"),
        ("zero_optimization: [stage: 2", "ds.yaml", "could not be read"),
        (
            '{"train_batch_size": 8, "train_batch_size": 16}',
            "ds.json",
            "sets 'train_batch_size' twice",
        ),
        ("[1, 2]", "ds.json", "holds a list, not a mapping"),
    ],
)
def test_an_unreadable_file_is_refused(tmp_path: Path, text: str, name: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as caught:
        deepspeed_config(with_file(write(tmp_path, text, name)))
    assert caught.value.field == "deepspeed_config_file"


def test_a_missing_file_names_the_way_out(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no such file .* leave deepspeed_config_file empty"):
        deepspeed_config(with_file(str(tmp_path / "nope.json")))


@pytest.mark.parametrize(
    ("content", "settings", "fragment", "field"),
    [
        (
            {"gradient_accumulation_steps": 8},
            {"gradient_accumulation_steps": 4},
            'gradient_accumulation_steps=4 for this run, but .* sets it to 8.* "auto"',
            "gradient_accumulation_steps",
        ),
        (
            {"bf16": {"enabled": True}},
            {"mixed_precision": "fp16"},
            "mixed_precision='fp16' for this run, but .* has bf16 enabled",
            "mixed_precision",
        ),
        (
            {"bf16": {"enabled": False}},
            {"mixed_precision": "bf16"},
            'has bf16 disabled.* "auto"',
            "mixed_precision",
        ),
        (
            {"gradient_clipping": 1.0},
            {"max_grad_norm": 0.5},
            "max_grad_norm=0.5 for this run, but .* gradient_clipping to 1.0",
            "max_grad_norm",
        ),
        (
            {"zero_optimization": {"stage": 2}},
            {"deepspeed_zero_stage": 3},
            "deepspeed_zero_stage=3 contradicts .* Remove deepspeed_zero_stage",
            "deepspeed_zero_stage",
        ),
        (
            {"zero_optimization": {"stage": 2}},
            {"deepspeed_offload_optimizer_device": "cpu"},
            "sets zero_optimization.offload_optimizer.device to nothing .DeepSpeed's default",
            "deepspeed_offload_optimizer_device",
        ),
    ],
)
def test_a_file_that_contradicts_the_run_is_refused(
    tmp_path: Path, content: dict[str, Any], settings: dict[str, Any], fragment: str, field: str
) -> None:
    with pytest.raises(ConfigError, match=fragment) as caught:
        deepspeed_config(with_file(write(tmp_path, content), **settings))
    assert caught.value.field == field


def test_the_file_rules_over_settings_left_at_their_defaults(tmp_path: Path) -> None:
    content = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "gradient_accumulation_steps": 8,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
    }
    ds = deepspeed_config(with_file(write(tmp_path, content)))  # zero_stage 2 is the default
    filled = fill(ds, micro_batch_size=2)
    assert filled["gradient_accumulation_steps"] == 8 and filled["train_batch_size"] == 32
    assert filled["gradient_clipping"] == 0.5 and mixed_precision_of(filled) == "bf16"
    agreeing = with_file(write(tmp_path, content), deepspeed_zero_stage=3, max_grad_norm=0.5)
    assert deepspeed_config(agreeing)["zero_optimization"]["stage"] == 3


def test_options_that_cannot_work_are_named_as_options() -> None:
    config = Config(strategy="deepspeed").replace(deepspeed_offload_param_device="cpu")
    with pytest.raises(ConfigError, match="deepspeed_offload_param_device='cpu' needs") as caught:
        deepspeed_config(config)
    assert caught.value.field == "deepspeed_offload_param_device"
    nvme = Config(strategy="deepspeed").replace(deepspeed_offload_optimizer_device="nvme")
    with pytest.raises(ConfigError, match="only a DeepSpeed config file can give it"):
        deepspeed_config(nvme)


# -- filling ----------------------------------------------------------------------------------
def test_batch_sizes_are_filled_or_checked() -> None:
    auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    assert (
        fill(auto, micro_batch_size=3, world_size=4, accumulation_steps=2)["train_batch_size"] == 24
    )
    # A global batch alone: the per-GPU one follows from it, dataloader or not.
    derived = fill(
        {"train_batch_size": 48}, micro_batch_size=None, world_size=4, accumulation_steps=2
    )
    assert derived["train_micro_batch_size_per_gpu"] == 6
    explicit = {"train_micro_batch_size_per_gpu": 5}
    assert fill(explicit, micro_batch_size=None, world_size=2)["train_batch_size"] == 10
    with pytest.raises(ConfigError, match=r"acc.prepare\(model, optimizer, loader\)") as caught:
        fill(auto, micro_batch_size=None)
    assert caught.value.field == "train_micro_batch_size_per_gpu"
    with pytest.raises(ConfigError, match="Make it a multiple of 8"):
        fill({"train_batch_size": 12}, micro_batch_size=None, world_size=4, accumulation_steps=2)
    with pytest.raises(ConfigError, match=r"= 16; DeepSpeed requires them to agree"):
        fill({"train_batch_size": 64}, micro_batch_size=8, world_size=2)


def test_clipping_precision_and_accumulation_come_from_the_run() -> None:
    filled = fill({}, max_grad_norm=2, accumulation_steps=3, mixed_precision="bf16")
    assert filled["gradient_clipping"] == 2.0 and filled["gradient_accumulation_steps"] == 3
    assert filled["bf16"] == {"enabled": True} and filled["fp16"] == {"enabled": False}
    assert "gradient_clipping" not in fill({"gradient_clipping": "auto"})
    assert fill({"fp16": {"enabled": "auto"}})["fp16"] == {"enabled": False}
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2 for this run"):
        fill({"gradient_accumulation_steps": 4}, accumulation_steps=2)
    with pytest.raises(ConfigError, match="nothing to be filled from"):
        fill({"scheduler": {"params": {"total_num_steps": "auto"}}})


# -- the parent side --------------------------------------------------------------------------
def test_importing_the_config_side_keeps_torch_out(tmp_path: Path) -> None:
    code = (
        "import sys, nbaccel.config.deepspeed.settings as d\n"
        "from nbaccel.config.schema import Config\n"
        "d.deepspeed_config(Config(strategy='deepspeed'))\n"
        "print('TORCH' if any(m == 'torch' or m.startswith('torch.') for m in sys.modules)"
        " else 'CLEAN', 'deepspeed' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["CLEAN", "False"]


def test_check_environment_refuses_a_bad_file_before_launch(tmp_path: Path) -> None:
    installed = lambda name: True  # noqa: E731
    bad = with_file(write(tmp_path, {"zero_optimization": {"stage": 7}}))
    with pytest.raises(ConfigError, match="must be a ZeRO stage"):
        api.check_environment(bad, 1, installed)
    api.check_environment(with_file(write(tmp_path, GUIDE_EXAMPLE, "good.json")), 1, installed)
    missing = with_file(str(tmp_path / "absent.json"))
    with pytest.raises(ConfigError, match="no such file"):
        api.check_environment(missing, 1, installed)
    # Other strategies never read the file.
    api.check_environment(missing.replace(strategy="ddp"), 1, installed)


# -- the worker side, against a stand-in for deepspeed ----------------------------------------
class FakeEngine:
    def __init__(self, model: Any, optimizer: Any, scheduler: Any, config: dict[str, Any]) -> None:
        self.module, self.optimizer, self.lr_scheduler, self.config = (
            model,
            optimizer,
            scheduler,
            config,
        )
        self.calls: list[Any] = []

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self.calls.append(("boundary", boundary))

    def backward(self, loss: Any) -> None:
        self.calls.append("backward")

    def step(self) -> None:
        self.calls.append("step")
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def get_global_grad_norm(self) -> float:
        return 0.25


@pytest.fixture
def fake_deepspeed(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def initialize(**kwargs: Any) -> tuple[Any, ...]:
        seen.update(kwargs)
        engine = FakeEngine(
            kwargs["model"], kwargs.get("optimizer"), kwargs.get("lr_scheduler"), kwargs["config"]
        )
        return engine, kwargs.get("optimizer"), None, kwargs.get("lr_scheduler")

    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(initialize=initialize))
    return seen


def test_deepspeed_run_drives_the_engine(fake_deepspeed: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    from nbaccel.accel.strategies.deepspeed_engine import DeepSpeedRun

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    ds = fill(deepspeed_config(Config(strategy="deepspeed")), accumulation_steps=2)
    run = DeepSpeedRun(model, optimizer, schedule, ds, scheduler_steps=2)
    config = fake_deepspeed["config"]
    assert config["zero_allow_untested_optimizer"] is True and config["steps_per_print"] > 10**6
    assert ds.get("steps_per_print") is None  # the caller's dict is left alone
    loss = model(torch.ones(1, 2)).sum()
    run.backward(loss, sync_gradients=False)
    run.optimizer.step()  # type: ignore[union-attr]  # the engine steps; these do nothing
    run.scheduler.step()  # type: ignore[union-attr]
    assert run.engine.calls == [("boundary", False), "backward"]
    run.backward(loss, sync_gradients=True)
    assert run.engine.calls[-3:] == [("boundary", True), "backward", "step"]
    assert run.scheduler.get_last_lr() == [0.25]  # type: ignore[union-attr]  # 2 steps / step
    assert run.optimizer.param_groups[0]["lr"] == 0.25  # type: ignore[union-attr]
    assert run.global_grad_norm() == 0.25 and not run.optimizer.step_was_skipped  # type: ignore[union-attr]
    run.backward(loss)  # DeepSpeed counts micro-steps itself: a step() after each backward
    assert run.engine.calls[-2:] == ["backward", "step"]


def test_deepspeed_run_refuses_what_deepspeed_cannot_take(fake_deepspeed: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    from nbaccel.accel.strategies.deepspeed_engine import DeepSpeedRun

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    ds = fill(deepspeed_config(Config(strategy="deepspeed")))
    with pytest.raises(
        ValueError,
        match=r"still has 'auto' in .*Fill it with "
        r"nbaccel.config.deepspeed.settings.fill_auto_values",
    ):
        DeepSpeedRun(model, optimizer, None, deepspeed_config(Config(strategy="deepspeed")))
    with pytest.raises(
        ValueError, match=r"config names one too \(AdamW\).* Remove the 'optimizer'"
    ):
        DeepSpeedRun(model, optimizer, None, {**ds, "optimizer": {"type": "AdamW"}})
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(ValueError, match=r"scheduler.step\(metric\) yourself"):
        DeepSpeedRun(model, optimizer, plateau, ds)
    run = DeepSpeedRun(model, None, None, {**ds, "optimizer": {"type": "AdamW"}})
    assert [id(p) for p in fake_deepspeed["model_parameters"]] == [
        id(p) for p in model.parameters()
    ]
    assert run.optimizer is None and run.scheduler is None


def test_deepspeed_missing_in_the_worker_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from nbaccel.accel.strategies.deepspeed_engine import import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install deepspeed"):
        import_deepspeed()
