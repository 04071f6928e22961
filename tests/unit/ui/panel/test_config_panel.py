"""nbaccel.ConfigPanel: widgets generated from the schema, driven as a browser would drive them.

Each test sets widget values and clicks buttons directly, then asserts on what the widgets
show. Nothing is launched: ``nbaccel.launch`` is replaced by a recorder.
"""

from __future__ import annotations

import html
import shlex
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ipywidgets")

import ipywidgets as widgets

import nbaccel
from nbaccel.cli import build_parser
from nbaccel.cli.flags import explicit_values
from nbaccel.config.display import applies
from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config, from_flat, options
from nbaccel.errors import ConfigError
from nbaccel.events import RunEnded, RunState
from nbaccel.hardware.memory_estimate import estimate_for_config
from nbaccel.ui.panel import config_widgets
from nbaccel.ui.panel.config_groups import group_of
from nbaccel.ui.panel.config_panel import ConfigPanel

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # no GPUs, no HOME: no default config file is read


def panel_(*args: Any, env: dict[str, str] | None = None, **kwargs: Any) -> ConfigPanel:
    return ConfigPanel(*args, env={**NO_GPU, **(env or {})}, **kwargs)


def shown(widget: Any) -> bool:
    return widget.layout.display != "none"


def train(x: int) -> int:
    return x


# ----- generated from the schema -----------------------------------------------------------
def expected_widget(opt: Any) -> type:
    if opt.kind is bool:
        return widgets.Checkbox
    if opt.choices:
        return widgets.SelectMultiple if opt.kind is tuple else widgets.Dropdown
    if opt.kind is int and not opt.optional:
        return widgets.IntText
    if opt.kind is float and not opt.optional:
        return widgets.FloatText
    return widgets.Text


def test_every_schema_option_has_a_widget_chosen_by_its_type_with_its_help() -> None:
    panel = panel_()
    assert list(panel.inputs) == [opt.name for opt in options()]
    for opt in options():
        control = panel.inputs[opt.name]
        assert type(control) is expected_widget(opt), opt.name
        assert control.description == opt.name
        assert control.tooltip == opt.help
        assert f"nbaccel-input-{opt.name}" in control._dom_classes
        row = panel.rows[opt.name]
        assert f"nbaccel-field-{opt.name}" in row.box._dom_classes
        assert any(
            html.escape(opt.help) in getattr(child, "value", "") for child in row.box.children
        ), opt.name
        # the row belongs to the displayed tree: its group's box, or its section's inside it
        section = opt.path.split(".")[0] if "." in opt.path else None
        group = panel.group_boxes[group_of(opt).key]
        assert group in panel.widget.children
        parent = panel.section_boxes[section] if section else group.children[0]
        assert row.box in parent.children
        if section:
            assert parent in group.children[0].children
    optional = [opt for opt in options() if opt.optional and opt.choices]
    for opt in optional:
        assert ("none", None) in panel.inputs[opt.name].options


def test_hidden_rows_follow_the_wizards_applies_when() -> None:
    panel = panel_()
    fsdp, deepspeed = panel.section_boxes["fsdp"], panel.section_boxes["deepspeed"]
    assert not shown(fsdp) and not shown(deepspeed)
    assert not shown(panel.rows["machine_rank"].box)
    assert not shown(panel.rows["sync_each_batch"].box)
    panel.inputs["strategy"].value = "fsdp"
    assert shown(fsdp) and not shown(deepspeed)
    assert not shown(panel.rows["shard_optimizer_state"].box)
    panel.inputs["strategy"].value = "deepspeed"
    assert shown(deepspeed) and not shown(fsdp)
    panel.inputs["num_machines"].value = 2
    panel.inputs["gradient_accumulation_steps"].value = 4
    assert shown(panel.rows["machine_rank"].box) and shown(panel.rows["sync_each_batch"].box)
    values = {
        name: config_widgets.read_input(row.option, row.input) for name, row in panel.rows.items()
    }
    panel.show_all.value = True  # the wizard knows nothing of this machine
    for opt in options():
        assert shown(panel.rows[opt.name].box) == applies(opt.path, values), opt.name


def test_text_fields_parse_like_env_values_and_none_unsets() -> None:
    panel = panel_(num_processes=2, max_grad_norm=1.0)
    assert panel.inputs["num_processes"].value == "2"
    panel.inputs["num_processes"].value = "none"
    panel.inputs["max_grad_norm"].value = " 0.5 "
    panel.inputs["log_with"].value = ("jsonl", "csv")
    config = panel.config
    assert config.num_processes is None
    assert config.max_grad_norm == 0.5
    assert config.log_with == ("csv", "jsonl")  # schema order


# ----- starting values and their sources -------------------------------------------------
def test_starts_from_resolve_and_shows_each_source(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("strategy: fsdp\nfsdp:\n  cpu_offload: true\n")
    env = {"NBACCEL_MIXED_PRECISION": "bf16"}
    panel = panel_(config=str(path), env=env, num_processes=3)
    expected = resolve({"num_processes": 3}, env={**NO_GPU, **env}, config=str(path))
    assert panel.start == expected.config
    assert panel.inputs["mixed_precision"].value == "bf16"
    assert panel.inputs["fsdp_cpu_offload"].value is True
    assert panel.changed == {}
    source = {name: row.source.value for name, row in panel.rows.items()}
    assert "from env NBACCEL_MIXED_PRECISION" in source["mixed_precision"]
    assert f"from file {path}" in source["strategy"]
    assert "given in code" in source["num_processes"]
    assert ">default<" in source["gradient_accumulation_steps"]


def test_what_the_user_changed_is_marked_and_listed() -> None:
    panel = panel_(env={"NBACCEL_MIXED_PRECISION": "bf16"})
    row = panel.rows["mixed_precision"]
    panel.inputs["mixed_precision"].value = "fp16"
    assert panel.changed == {"mixed_precision": "fp16"}
    assert "changed here" in row.source.value
    assert "was bf16, from env NBACCEL_MIXED_PRECISION" in row.source.value
    assert "nbaccel-panel-changed" in row.box._dom_classes
    panel.inputs["mixed_precision"].value = "bf16"
    assert panel.changed == {}
    assert "changed here" not in row.source.value
    assert "nbaccel-panel-changed" not in row.box._dom_classes


# ----- validation on every change ------------------------------------------------------------
def test_invalid_values_show_next_to_their_fields_and_disable_launch() -> None:
    panel = panel_(train, args=(1,), use_cpu=True)
    assert not panel.launch_button.disabled and panel.problems == {}
    panel.inputs["num_machines"].value = 0
    panel.inputs["num_processes"].value = "two"
    assert set(panel.problems) == {"num_machines", "num_processes"}  # all at once
    assert "num_machines must be &gt;= 1, got 0." in panel.messages["num_machines"].value
    assert shown(panel.messages["num_machines"])
    assert "is not a valid int" in panel.messages["num_processes"].value
    assert not shown(panel.messages["strategy"])
    assert panel.launch_button.disabled and panel.save_button.disabled
    with pytest.raises(ConfigError, match="num_machines must be >= 1"):
        _ = panel.config
    panel.inputs["num_machines"].value = 2
    panel.inputs["machine_rank"].value = 5  # a combination: named field gets the message
    assert set(panel.problems) == {"num_processes", "machine_rank"}
    assert "machine_rank=5 but num_machines=2" in panel.messages["machine_rank"].value
    panel.inputs["machine_rank"].value = 1
    panel.inputs["num_processes"].value = "2"
    assert panel.problems == {} and not panel.launch_button.disabled
    assert panel.config.machine_rank == 1


def test_a_hidden_field_takes_its_default_as_in_the_wizard() -> None:
    panel = panel_()
    panel.inputs["strategy"].value = "fsdp"
    panel.inputs["fsdp_sharding_strategy"].value = "HYBRID_SHARD"
    assert "HYBRID_SHARD" in panel.problems["fsdp_sharding_strategy"]
    panel.inputs["strategy"].value = "ddp"  # fsdp options no longer apply: no problem
    assert panel.problems == {}
    assert panel.config.fsdp.sharding_strategy == "FULL_SHARD"
    assert panel.changed == {"strategy": "ddp"}
    panel.inputs["strategy"].value = "fsdp"  # the widget kept what was chosen
    assert "fsdp_sharding_strategy" in panel.problems


def test_what_this_machine_cannot_run_blocks_launch_but_not_save() -> None:
    panel = panel_(train, args=(1,))
    panel.inputs["strategy"].value = "deepspeed"  # needs CUDA GPUs; none here
    assert "On this machine" in panel.problems["strategy"]
    assert panel.launch_button.disabled
    assert not panel.save_button.disabled and panel.config.strategy == "deepspeed"


# ----- buttons ---------------------------------------------------------------------------------
def test_save_as_yaml_writes_the_config_file_format(tmp_path: Path) -> None:
    panel = panel_(num_processes=2)
    panel.inputs["strategy"].value = "fsdp"
    panel.inputs["fsdp_cpu_offload"].value = True
    path = tmp_path / "sub" / "panel.yaml"
    panel.path_text.value = str(path)
    panel.save_button.click()
    assert path.read_text().startswith("# nbaccel config")
    assert resolve(env={}, config=path, use_default_file=False).config == panel.config
    assert "Saved" in panel.status.value and str(path) in panel.status.value
    panel.path_text.value = str(tmp_path)  # a folder: the error is shown, nothing raised
    panel.save_button.click()
    assert "Could not save" in panel.status.value


def test_the_launch_command_has_only_non_default_flags_and_round_trips() -> None:
    panel = panel_(num_processes=2)
    panel.inputs["mixed_precision"].value = "bf16"
    panel.inputs["log_with"].value = ("csv",)
    assert not shown(panel.command_text)
    panel.command_button.click()
    assert shown(panel.command_text)
    command = panel.command_text.value
    assert command == (
        "nbaccel launch --num_processes 2 --mixed_precision bf16 --log_with csv SCRIPT.py"
    )
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert resolve(explicit_values(args), env={}, use_default_file=False).config == panel.config
    panel.inputs["strategy"].value = "fsdp"  # kept up to date while shown
    assert "--strategy fsdp" in panel.command_text.value
    panel.command_button.click()
    assert not shown(panel.command_text)


class FakeRun:
    def __init__(self) -> None:
        self.state = RunState.RUNNING
        self.run_id = "run-1"
        self.run_dir = Path("/tmp/run-1")
        self.error: BaseException | None = None
        self.subscribers: list[Callable[[Any], None]] = []
        self.stopped = False

    def subscribe(self, subscriber: Callable[[Any], None]) -> None:
        self.subscribers.append(subscriber)

    def stop(self) -> RunState:
        self.stopped = True
        return self.end(RunState.CANCELLED)

    def end(self, state: RunState, error: BaseException | None = None) -> RunState:
        self.state, self.error = state, error
        for subscriber in self.subscribers:
            subscriber(RunEnded(state, error, 1.0, 0.0))
        return state


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def fake_launch(function: Any, **kwargs: Any) -> FakeRun:
        calls.append({"function": function, **kwargs, "run": FakeRun()})
        return calls[-1]["run"]  # type: ignore[no-any-return]

    monkeypatch.setattr(nbaccel, "launch", fake_launch)
    return calls


def test_launch_starts_a_non_blocking_run_with_the_panels_values(
    launches: list[dict[str, Any]],
) -> None:
    env = {"NBACCEL_MIXED_PRECISION": "bf16"}
    panel = panel_(train, args=(5,), kwargs={}, env=env, num_processes=1)
    panel.inputs["mixed_precision"].value = "no"  # back to the default: env must not win
    panel.launch_button.click()
    (call,) = launches
    assert call["function"] is train and call["args"] == (5,)
    launched = resolve(env={**NO_GPU, **env}, config=call["config"]).config
    assert launched == panel.config and launched.mixed_precision == "no"
    run = call["run"]
    assert panel.run is run
    assert panel.launch_button.disabled and not panel.stop_button.disabled
    assert "run-1" in panel.status.value and "running" in panel.status.value
    run.end(RunState.FAILED, ValueError("boom\nmore"))  # on the pump thread, in real life
    assert "failed: boom" in panel.status.value
    assert not panel.launch_button.disabled and panel.stop_button.disabled


def test_stop_button_stops_the_panels_run(launches: list[dict[str, Any]]) -> None:
    panel = panel_(train, args=(5,), num_processes=1)
    panel.launch_button.click()
    panel.stop_button.click()
    assert launches[0]["run"].stopped
    assert "cancelled" in panel.status.value


def test_without_a_function_launch_is_disabled_and_explains(
    launches: list[dict[str, Any]],
) -> None:
    panel = panel_()
    assert panel.launch_button.disabled
    assert "notebook_launcher(train, config=panel.config)" in panel.status.value
    with pytest.raises(TypeError, match="no function to launch"):
        panel.launch()
    run = panel.launch(train, 3)
    assert launches[0]["args"] == (3,) and panel.run is run


def test_a_launch_that_fails_to_start_is_shown_in_the_panel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(function: Any, **kwargs: Any) -> None:
        raise ConfigError("num_processes=1, but only 0 GPU(s) are visible")

    monkeypatch.setattr(nbaccel, "launch", refuse)
    panel = panel_(train, args=(1,))
    panel.launch_button.click()
    assert "Launch failed" in panel.status.value and panel.run is None


# ----- memory estimate -------------------------------------------------------------------------
def test_memory_estimate_follows_precision_and_sharding() -> None:
    panel = panel_(num_processes=2, use_cpu=True, num_params=10**6, memory_limit=10**9)
    estimate = estimate_for_config(Config(num_processes=2, use_cpu=True), 10**6)
    assert estimate.describe() in panel.memory.value and "fits" in panel.memory.value
    panel.inputs["strategy"].value = "fsdp"
    panel.inputs["mixed_precision"].value = "bf16"
    sharded = estimate_for_config(panel.config, 10**6)
    assert sharded.total < estimate.total
    assert sharded.describe() in panel.memory.value
    panel.inputs["num_processes"].value = "0"
    assert "fix the marked fields" in panel.memory.value


def test_memory_estimate_says_when_it_does_not_fit() -> None:
    panel = panel_(num_processes=2, use_cpu=True, num_params=10**8, memory_limit=10**9)
    assert "does not fit" in panel.memory.value
    assert "for 2 processes here" in panel.memory.value  # CPU processes share host memory


def test_memory_estimate_counts_a_model_by_duck_typing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Param:
        def numel(self) -> int:
            return 1000

    class Model:
        def parameters(self) -> list[Param]:
            return [Param(), Param()]

    monkeypatch.setattr(config_widgets, "device_memory_limit", lambda on_gpu: None)
    panel = panel_(model=Model(), num_processes=1, use_cpu=True)
    expected = estimate_for_config(panel.config, 2000).describe()
    assert expected in panel.memory.value and "memory limit unknown" in panel.memory.value
    assert "pass model= or num_params=" in panel_().memory.value


def test_host_memory_is_the_limit_of_a_cpu_run(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []

    def limit(on_gpu: bool) -> tuple[int, str]:
        seen.append(on_gpu)
        return 2**40, "available host memory"

    monkeypatch.setattr(config_widgets, "device_memory_limit", limit)
    panel = panel_(num_params=10**6, use_cpu=True)
    panel.inputs["mixed_precision"].value = "bf16"
    assert "of 1024.00 GiB available host memory" in panel.memory.value
    assert seen == [False]  # read once, not on every change


def test_device_memory_limit_is_the_smallest_gpu_from_nvml(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=[80, 40][h] * 2**30),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert config_widgets.device_memory_limit(on_gpu=True) == (40 * 2**30, "GPU memory")
    assert calls == ["init", "shutdown"]
    fake.nvmlInit = lambda: (_ for _ in ()).throw(RuntimeError("no driver"))
    assert config_widgets.device_memory_limit(on_gpu=True) is None
    nbytes, what = config_widgets.device_memory_limit(on_gpu=False) or (0, "")
    assert nbytes > 0 and what == "available host memory"


# ----- display -----------------------------------------------------------------------------------
def test_a_bare_panel_displays_its_widget() -> None:
    panel = panel_()
    bundle = panel._repr_mimebundle_()
    view = bundle["application/vnd.jupyter.widget-view+json"]
    assert view["model_id"] == panel.widget.model_id
    assert "nbaccel-config-panel" in panel.widget._dom_classes
    for button, dom_class in (
        (panel.launch_button, "nbaccel-panel-launch"),
        (panel.stop_button, "nbaccel-panel-stop"),
        (panel.save_button, "nbaccel-panel-save"),
        (panel.command_button, "nbaccel-panel-command"),
    ):
        assert dom_class in button._dom_classes


def test_the_panel_is_exported_lazily_and_validates_from_flat_names() -> None:
    assert nbaccel.ConfigPanel is ConfigPanel
    panel = panel_(fsdp_cpu_offload=True, strategy="fsdp")
    assert panel.config == from_flat({"fsdp_cpu_offload": True, "strategy": "fsdp"})
    with pytest.raises(ConfigError, match="Did you mean"):
        panel_(mixed_precison="bf16")


def test_a_panel_passed_as_config_runs_what_it_shows_over_env_and_files() -> None:
    from nbaccel.config.resolve import resolve

    panel = ConfigPanel(mixed_precision="no")
    resolved = resolve({}, env={"NBACCEL_MIXED_PRECISION": "bf16"}, config=panel)
    assert resolved.config.mixed_precision == "no"  # the panel shows "no": env must not win
    assert resolved.sources["mixed_precision"] == "config panel"


def test_gpu_ids_has_its_row_with_processes_and_is_checked_against_this_machine() -> None:
    panel = panel_(train, args=(1,))
    assert group_of(panel.rows["gpu_ids"].option).key == "processes"
    assert not shown(panel.rows["gpu_ids"].box)  # no GPU here: nothing to choose
    panel.show_all.value = True
    assert shown(panel.rows["gpu_ids"].box)
    panel.inputs["gpu_ids"].value = "1,1"
    assert "names GPU 1 twice" in panel.problems["gpu_ids"]
    panel.inputs["gpu_ids"].value = "1,0"
    assert panel.config.gpu_ids == "1,0"
    assert "On this machine" in panel.problems["gpu_ids"]  # no GPU is visible here
    assert "no GPU is visible here" in panel.problems["gpu_ids"]
    panel.inputs["use_cpu"].value = True  # CPU processes: the wizard skips it, as the panel
    assert not shown(panel.rows["gpu_ids"].box) and panel.config.gpu_ids == "all"
