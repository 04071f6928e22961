"""The config panel's groups (as the wizard asks) and the fields this machine hides."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ipywidgets")

from nbaccel.config.display import applies
from nbaccel.config.schema import option, options
from nbaccel.ui.panel.config_groups import GROUPS, Machine, group_of, grouped_options, matters_here
from nbaccel.ui.panel.config_panel import ConfigPanel

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # no GPUs, no HOME: no default config file is read
TITLES = [
    "Processes and machines",
    "Precision",
    "Strategy and sharding",
    "Training loop",
    "Logging",
    "Advanced",
]


def shown(widget: Any) -> bool:
    return widget.layout.display != "none"


def visible_names(panel: ConfigPanel, key: str) -> list[str]:
    return [opt.name for opt in grouped_options()[key] if shown(panel.rows[opt.name].box)]


def test_every_field_is_in_one_group_and_the_named_ones_exist() -> None:
    assert [group.title for group in GROUPS] == TITLES
    named = [name for group in GROUPS for name in group.fields]
    assert len(named) == len(set(named))
    for name in named:  # a renamed schema field must not silently fall into "advanced"
        if name.endswith("."):
            assert any(opt.path.startswith(name) for opt in options()), name
        else:
            assert option(name).name == name
    members = [opt.name for opts in grouped_options().values() for opt in opts]
    assert sorted(members) == sorted(opt.name for opt in options())
    assert group_of(option("deepspeed_zero_stage")).key == "strategy"
    assert group_of(option("dynamo_mode")).key == "loop"
    assert {opt.name for opt in grouped_options()["advanced"]} >= {
        "init_process_group",
        "collective_timeout",
        "metrics_in_memory",
    }


def test_groups_follow_the_wizards_order() -> None:
    """Within a group, fields come in schema order: the order the wizard asks them."""
    order = {opt.name: index for index, opt in enumerate(options())}
    for opts in grouped_options().values():
        indexes = [order[opt.name] for opt in opts]
        assert indexes == sorted(indexes)


def test_the_panel_shows_the_groups_with_advanced_collapsed() -> None:
    panel = ConfigPanel(num_processes=2, env=NO_GPU)
    accordions = [panel.group_boxes[group.key] for group in GROUPS]
    assert [child for child in panel.widget.children if child in accordions] == accordions
    assert [tuple(box.titles) for box in accordions] == [(title,) for title in TITLES]
    assert [box.selected_index for box in accordions] == [0, 0, 0, 0, 0, None]
    assert "nbaccel-group-advanced" in panel.group_boxes["advanced"]._dom_classes
    # Only what applies on a one-machine CPU box with strategy auto:
    assert visible_names(panel, "processes") == [
        "num_processes",
        "num_machines",
        "hosts",
        "max_restarts",
    ]
    # How the kernel reaches hosts matters only once there are hosts.
    assert not applies("ssh_options", {"hosts": ()})
    assert applies("remote_python", {"hosts": ("node1", "node2")})
    assert visible_names(panel, "strategy") == ["strategy", "shard_optimizer_state"]
    assert visible_names(panel, "loop") == [
        "gradient_accumulation_steps",
        "max_grad_norm",
        "dynamo_backend",
    ]
    # Fields it hid because of this machine are named, with the reason.
    assert "use_cpu, gpu_ids, xla_start_method" in panel.hidden_note.value
    assert "no GPU, no TPU" in panel.hidden_note.value


def test_without_a_tpu_xla_start_method_is_hidden_unless_it_can_matter() -> None:
    panel = ConfigPanel(env=NO_GPU)
    row = panel.rows["xla_start_method"].box
    assert not shown(row)
    panel.inputs["strategy"].value = "xla"  # a TPU run prepared here: it matters again
    assert shown(row)
    panel.inputs["strategy"].value = "auto"
    assert not shown(row)
    panel.show_all.value = True  # preparing a config for another machine
    assert shown(row) and panel.hidden_note.value == ""
    with_tpu = ConfigPanel(env={**NO_GPU, "PJRT_DEVICE": "TPU"})
    assert shown(with_tpu.rows["xla_start_method"].box)
    assert "xla_start_method" not in with_tpu.hidden_note.value


def test_a_value_set_on_purpose_is_never_hidden_and_is_kept() -> None:
    panel = ConfigPanel(xla_start_method="fork", env=NO_GPU)
    assert shown(panel.rows["xla_start_method"].box)
    assert panel.config.xla_start_method == "fork"
    panel = ConfigPanel(use_cpu=True, env=NO_GPU)
    assert shown(panel.rows["use_cpu"].box) and panel.config.use_cpu


def test_machine_relevance_rules() -> None:
    values = {"strategy": "auto", "use_cpu": False, "xla_start_method": "spawn"}
    use_cpu = option("use_cpu")
    assert not matters_here(use_cpu, Machine(gpus=0), values)
    assert matters_here(use_cpu, Machine(gpus=2), values)
    assert matters_here(option("xla_start_method"), Machine(0, pjrt_device=True), values)
    assert matters_here(option("strategy"), Machine(gpus=0), values)  # not a machine rule


def test_a_collapsed_group_title_counts_its_changes() -> None:
    panel = ConfigPanel(env=NO_GPU)
    advanced = panel.group_boxes["advanced"]
    assert shown(advanced) and advanced.titles == ("Advanced",)
    panel.inputs["collective_timeout"].value = 60.0
    assert advanced.titles == ("Advanced (1 changed)",)  # collapsed, it still says so
    assert advanced.selected_index is None
