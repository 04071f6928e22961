"""The DeepSpeed engine nbaccel builds is the one Accelerate builds, key by key.

Accelerate's side is its own ``DeepSpeedPlugin`` (installed in the venv) taken through the
steps its ``AcceleratorState`` and ``Accelerator._prepare_deepspeed`` (1.15) apply before
``deepspeed.initialize``: ``set_mixed_precision``, then the values ``_prepare_deepspeed``
fills into ``"auto"``. nbaccel's side is the whole ``prepare`` path (plugin -> config ->
``DeepSpeed.prepare_engine``) up to a stand-in ``deepspeed.initialize`` that records the config.
No deepspeed and no GPU needed; the engines themselves meet in the parity program
(tests/parity/programs/deepspeed_plugin.py, CUDA).

Keys that differ only in spelling DeepSpeed's own default are normalised away, each named in
``deepspeed_meaning``.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from nbaccel.accel.state import DistributedType, ProcessState
from nbaccel.accel.strategies import DeepSpeed
from nbaccel.config.accelerate.plugins import DeepSpeedPlugin
from nbaccel.config.accelerator_options import apply_accelerator_arguments
from nbaccel.config.schema import Config

PARITY_PROGRAM = {"zero_stage": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}


@pytest.fixture(autouse=True)
def no_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):  # Accelerate's plugin reads ACCELERATE_* where unset
        if name.startswith("ACCELERATE_"):
            monkeypatch.delenv(name)


def stand_in_deepspeed(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A stand-in ``deepspeed`` whose ``initialize`` records what it was given (installed
    after Accelerate's side ran: Accelerate looks for the real package's import spec)."""
    seen: dict[str, Any] = {}

    def initialize(**kwargs: Any) -> tuple[Any, ...]:
        seen.update(kwargs)
        return types.SimpleNamespace(module=kwargs["model"]), kwargs.get("optimizer"), None, None

    class DeepSpeedCPUAdam:  # what optimizer offload swaps torch's AdamW for
        def __init__(self, groups: Any, **kwargs: Any) -> None:
            self.param_groups, self.kwargs = groups, kwargs

    adam = types.SimpleNamespace(DeepSpeedCPUAdam=DeepSpeedCPUAdam)
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(initialize=initialize))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", adam)
    return seen


def accelerates(
    plugin: dict[str, Any], *, mixed_precision: str, micro: int, world: int
) -> dict[str, Any]:
    """The config Accelerate 1.15 passes to ``deepspeed.initialize`` for a torch optimizer
    and a DataLoader of ``micro`` samples a batch on ``world`` processes."""
    from accelerate.utils import DeepSpeedPlugin as AcceleratePlugin

    theirs = AcceleratePlugin(**plugin)
    theirs.set_mixed_precision(mixed_precision)  # AcceleratorState, for DistributedType.DEEPSPEED
    # _prepare_deepspeed: accumulation steps (the plugin's win over the Accelerator's 1) ...
    theirs.fill_match(
        "gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=1
    )
    steps = theirs.get_value("gradient_accumulation_steps")
    # ... then its config_kwargs into every "auto" ...
    theirs.deepspeed_config_process(
        must_match=False,
        **{
            "gradient_clipping": 1.0,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
            "train_micro_batch_size_per_gpu": micro,
            "train_batch_size": micro * steps * world,
        },
    )
    # ... and, for a torch optimizer, this.
    theirs.deepspeed_config["zero_allow_untested_optimizer"] = True
    return dict(theirs.deepspeed_config)


def nbaccels(
    plugin: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    *,
    mixed_precision: str,
    micro: int,
    world: int,
    launch: Config | None = None,
) -> dict[str, Any]:
    seen = stand_in_deepspeed(monkeypatch)
    options = apply_accelerator_arguments(
        launch or Config(),
        deepspeed_plugin=DeepSpeedPlugin(**plugin),
        mixed_precision=mixed_precision,
    )
    state = ProcessState(0, 0, world, world, torch.device("cpu"), DistributedType.DEEPSPEED, "")
    strategy = DeepSpeed(state, options.config, options)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(torch.zeros(4 * micro, 2), batch_size=micro)
    strategy.prepare_engine(
        [model, optimizer, loader],
        ["model", "optimizer", "dataloader"],
        split_batches=False,
        step_scheduler_with_optimizer=True,
    )
    config: dict[str, Any] = seen["config"]
    config["optimizer given"] = type(seen["optimizer"]).__name__
    return config


def deepspeed_meaning(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the spellings of DeepSpeed's own defaults that only one side writes:

    - ``steps_per_print``: Accelerate writes inf, nbaccel 2**31 - 1 (JSON has no inf): never;
    - ``zero_optimization``: Accelerate's plugin writes ``offload_*: {"device": "none",
      "nvme_path": None}`` and ``stage3_gather_16bit_weights_on_model_save: False``, which are
      DeepSpeed's defaults; nbaccel leaves them out.
    """
    meaning = dict(config)
    meaning.pop("optimizer given", None)
    quiet = meaning.pop("steps_per_print")
    assert quiet == math.inf or quiet >= 2**31 - 1, quiet
    zero = dict(meaning.get("zero_optimization", {}))
    for part in ("offload_optimizer", "offload_param"):
        section = {k: v for k, v in zero.pop(part, {}).items() if v is not None}
        if section.get("device", "none") != "none":
            zero[part] = section
    if zero.get("stage3_gather_16bit_weights_on_model_save") is False:
        del zero["stage3_gather_16bit_weights_on_model_save"]
    meaning["zero_optimization"] = zero
    return meaning


@pytest.mark.parametrize("world", [1, 2])
def test_the_parity_programs_engine_config_is_accelerates(
    monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    run = {"mixed_precision": "bf16", "micro": 4, "world": world}
    theirs = accelerates(PARITY_PROGRAM, **run)
    ours = nbaccels(PARITY_PROGRAM, monkeypatch, **run)
    assert deepspeed_meaning(ours) == deepspeed_meaning(theirs)
    # What the engine's numbers hang on, spelled out: the same clipping, the same dtypes,
    # the same batch arithmetic, the user's AdamW handed over as is.
    assert ours["gradient_clipping"] == 1.0 and ours["bf16"] == {"enabled": True}
    assert ours["fp16"] == {"enabled": False} and "communication_data_type" not in ours
    assert ours["train_batch_size"] == 4 * 2 * world
    assert ours["optimizer given"] == "AdamW"


@pytest.mark.parametrize(
    ("plugin", "mixed_precision"),
    [
        ({}, "no"),  # nothing about clipping: Accelerate's engine clips at 1.0, so does nbaccel's
        ({"zero_stage": 1, "gradient_clipping": 0.5}, "fp16"),  # fp16 casts inputs (auto_cast)
        ({"zero_stage": 3, "zero3_save_16bit_model": True, "offload_param_device": "cpu"}, "bf16"),
        (
            {"zero_stage": 2, "offload_optimizer_device": "cpu", "gradient_accumulation_steps": 4},
            "no",
        ),
    ],
    ids=repr,
)
def test_other_plugin_settings_build_accelerates_engine_config(
    monkeypatch: pytest.MonkeyPatch, plugin: dict[str, Any], mixed_precision: str
) -> None:
    run = {"mixed_precision": mixed_precision, "micro": 8, "world": 2}
    theirs = accelerates(plugin, **run)
    assert deepspeed_meaning(nbaccels(plugin, monkeypatch, **run)) == deepspeed_meaning(theirs)


def test_a_launch_that_chose_its_clipping_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # As Accelerate's plugin reads ACCELERATE_GRADIENT_CLIPPING, which the launch exports.
    launch = Config(max_grad_norm=0.25)
    ours = nbaccels({}, monkeypatch, mixed_precision="no", micro=8, world=2, launch=launch)
    assert ours["gradient_clipping"] == 0.25
