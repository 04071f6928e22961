"""One widget row per config option, generated from the schema; the memory a device offers.

Helpers of ``nbaccel.ui.panel.config_panel``. The control a field gets follows from its ``Option``
(type, choices, optional): a Dropdown for choices (with "none" when optional), a
SelectMultiple for a list with choices, a Checkbox for a bool, IntText / FloatText for
numbers, and Text (parsed like an environment value, so "none" unsets) for the rest. Stdlib
and ipywidgets only; ``pynvml`` and ``psutil`` are imported when a memory limit is read.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets

from nbaccel.config.display import show_value
from nbaccel.config.schema import Config, Option, from_flat, option, parse_text, sections
from nbaccel.errors import ConfigError
from nbaccel.hardware.memory_estimate import MemoryEstimate, estimate_for_config
from nbaccel.ui.panel.config_groups import GROUPS, Machine, grouped_options

LABEL_WIDTH = "230px"
INPUT_WIDTH = "520px"
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


@dataclass
class FieldRow:
    """The widgets of one option: its input, where its value came from, help, problem."""

    option: Option
    input: Any
    source: Any  # HTML: "default", "from env NBACCEL_…", "changed (was …)"
    message: Any  # HTML: the ConfigError naming this field, hidden when there is none
    box: Any  # the row, hidden when the option does not apply


def make_row(opt: Option, value: Any) -> FieldRow:
    """The row for ``opt`` showing ``value``; DOM classes name it for browser tests.

    >>> from nbaccel.config.schema import option
    >>> row = make_row(option("num_processes"), None)
    >>> type(row.input).__name__, row.input.description, row.input.placeholder
    ('Text', 'num_processes', 'none')
    >>> read_input(row.option, row.input) is None
    True
    """
    control = _make_input(opt, value)
    control.add_class("nbaccel-panel-input")
    control.add_class(f"nbaccel-input-{opt.name}")
    source = widgets.HTML(layout=widgets.Layout(margin="0 0 0 8px"))
    source.add_class("nbaccel-panel-source")
    indent = f"0 0 0 calc({LABEL_WIDTH} + 8px)"
    help_text = widgets.HTML(
        # A block with its own line height: the widget's 28 px line made each wrapped help
        # line as tall as an input row.
        f'<div style="color:#777;font-size:85%;line-height:1.35">{html.escape(opt.help)}</div>',
        layout=widgets.Layout(margin=indent, width=INPUT_WIDTH),
    )
    message = widgets.HTML(layout=widgets.Layout(margin=indent, display="none"))
    message.add_class("nbaccel-panel-error")
    box = widgets.VBox(
        [widgets.HBox([control, source]), help_text, message],
        layout=widgets.Layout(margin="0 0 6px 0"),
    )
    box.add_class("nbaccel-panel-field")
    box.add_class(f"nbaccel-field-{opt.name}")
    return FieldRow(opt, control, source, message, box)


def _make_input(opt: Option, value: Any) -> Any:
    common: dict[str, Any] = {
        "description": opt.name,
        "tooltip": opt.help,
        "style": {"description_width": LABEL_WIDTH},
        "layout": widgets.Layout(width=INPUT_WIDTH),
    }
    if opt.kind is bool:
        return widgets.Checkbox(value=bool(value), **common)
    if opt.choices and opt.kind is tuple:
        labelled = [(str(choice), choice) for choice in opt.choices]
        return widgets.SelectMultiple(
            options=labelled, value=tuple(value), rows=len(labelled), **common
        )
    if opt.choices:
        labelled = [(str(choice), choice) for choice in opt.choices]
        if opt.optional:
            labelled.append(("none", None))
        return widgets.Dropdown(options=labelled, value=value, **common)
    if opt.kind is int and not opt.optional:
        return widgets.IntText(value=value, **common)
    if opt.kind is float and not opt.optional:
        return widgets.FloatText(value=value, **common)
    placeholder = "none" if opt.optional else ("comma list" if opt.kind is tuple else "")
    return widgets.Text(value=input_text(value), placeholder=placeholder, **common)


def read_input(opt: Option, control: Any) -> Any:
    """The typed value a control holds; ConfigError (naming the field) for unparsable text."""
    if isinstance(control, widgets.Text):
        return parse_text(opt, control.value)
    if isinstance(control, widgets.SelectMultiple):
        chosen = set(control.value)
        return tuple(choice for choice in opt.choices or () if choice in chosen)
    return control.value


def show_input(opt: Option, control: Any, value: Any) -> None:
    """Put ``value`` into the control (the inverse of ``read_input``)."""
    if isinstance(control, widgets.Text):
        control.value = input_text(value)
    elif isinstance(control, widgets.SelectMultiple):
        control.value = tuple(value)
    else:
        control.value = value


def input_text(value: Any) -> str:
    """How a text box shows a value: empty for None (the box's placeholder says "none").

    >>> input_text(None), input_text(("csv", "jsonl")), input_text(0.5)
    ('', 'csv,jsonl', '0.5')
    """
    if value is None:
        return ""
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def source_html(source: str, start_value: Any, changed: bool) -> str:
    """Where a value came from (resolve's source names), or that the panel changed it.

    >>> source_html("env:NBACCEL_MIXED_PRECISION", "bf16", changed=False)
    '<span style="color:#777">from env NBACCEL_MIXED_PRECISION</span>'
    >>> source_html("default", "no", changed=True)
    '<b style="color:#b35900">changed here</b> <span style="color:#777">(was no, default)</span>'
    """
    kind, _, where = source.partition(":")
    described = {
        "default": "default",
        "file": f"from file {where}",
        "env": f"from env {where}",
        "argument": "given in code",
    }.get(kind, source)
    if not changed:
        return f'<span style="color:#777">{html.escape(described)}</span>'
    was = html.escape(f"(was {show_value(start_value)}, {described})")
    return f'<b style="color:#b35900">changed here</b> <span style="color:#777">{was}</span>'


def problem_html(message: str) -> str:
    """A ConfigError message as shown next to its field (red)."""
    return f'<span style="color:#c62828">&#9888; {html.escape(message)}</span>'


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that fits.

    >>> format_bytes(3 * 2**30), format_bytes(1536), format_bytes(12)
    ('3.00 GiB', '1.50 KiB', '12.00 B')
    """
    name, size = next(((n, s) for n, s in _UNITS if abs(nbytes) >= s), _UNITS[-1])
    return f"{nbytes / size:.2f} {name}"


def validate(values: dict[str, Any], problems: dict[str, str]) -> tuple[Config | None, list[str]]:
    """The schema's own validation, one field at a time: a field with an error is set back to
    its default and checking goes on, so every problem shows at once. Adds each field's
    problem to ``problems``; returns the Config (None if anything is wrong) and the problems
    that name no field.

    >>> problems = {}
    >>> config, other = validate({"num_machines": 0, "machine_rank": 3}, problems)
    >>> config, other, sorted(problems)
    (None, [], ['machine_rank', 'num_machines'])
    """
    trial, general = dict(values), []
    for _ in range(len(trial) + 1):
        try:
            config = from_flat(trial)
        except ConfigError as error:
            name = error.field
            if name is None or name not in trial or name in problems:
                general.append(str(error))
                return None, general
            problems[name] = str(error)
            trial[name] = option(name).default
        else:
            return (None if problems else config), general
    return None, general


def memory_report(
    config: Config | None,
    num_params: int | None,
    *,
    gpus: int,
    limit: Callable[[Config, bool], tuple[int, str] | None],
) -> str:
    """The memory line of the panel: the estimate for ``config`` and whether it fits
    ``limit(config, on_gpu)``; ``gpus`` is the count visible to workers."""
    if num_params is None:
        return "<i>Memory estimate: pass model= or num_params= to the panel.</i>"
    if config is None:
        return "<i>Memory estimate: fix the marked fields first.</i>"
    on_gpu = not config.use_cpu and gpus > 0 and config.strategy != "xla"
    workers_gpus = gpus if on_gpu else 0
    here = config.processes_per_machine(workers_gpus)  # num_processes counts all machines
    try:
        world_size = config.total_processes(workers_gpus)
        estimate = estimate_for_config(config, num_params, world_size=world_size)
    except ValueError as error:
        return problem_html(str(error))
    return memory_html(estimate, local_processes=here, limit=limit(config, on_gpu), on_gpu=on_gpu)


def device_memory_limit(on_gpu: bool) -> tuple[int, str] | None:
    """Bytes the model states may use, and what that is: the smallest GPU's memory (NVML),
    or on CPU the host memory available now (psutil); None when it cannot be read."""
    if on_gpu:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                handles = [
                    pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
                ]
                totals = [int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - no nvidia-ml-py or no driver: the limit is unknown
            return None
        return (min(totals), "GPU memory") if totals else None
    try:
        import psutil

        return int(psutil.virtual_memory().available), "available host memory"
    except Exception:  # noqa: BLE001 - an unreadable /proc: the limit is unknown
        return None


def memory_html(
    estimate: MemoryEstimate, *, local_processes: int, limit: tuple[int, str] | None, on_gpu: bool
) -> str:
    """The estimate, and whether it fits the limit: per GPU, or on CPU all this machine's
    processes together (they share the host's memory)."""
    text = f"Estimated model states: {html.escape(estimate.describe())}"
    if limit is None:
        return text + " <i>(memory limit unknown)</i>"
    nbytes, what = limit
    if on_gpu:
        need, scope = estimate.total, "per GPU"
    else:
        need = (estimate.total + estimate.host) * local_processes
        scope = f"for {local_processes} process{'es' if local_processes > 1 else ''} here"
    share = f"{100 * need / nbytes:.0f}%" if nbytes else "n/a"
    verdict, colour = ("fits", "#2e7d32") if need <= nbytes else ("does not fit", "#c62828")
    return (
        f'{text}<br><b style="color:{colour}">{verdict}</b>: {format_bytes(need)} {scope} of '
        f"{format_bytes(nbytes)} {html.escape(what)} ({share}).<br><span style='color:#777'>"
        "Model states only (parameters, gradients, optimizer state, DDP buckets): "
        "activations and each worker's runtime (Python, torch, CUDA context) come on top; "
        "the dashboard of a run shows them measured.</span>"
    )


def group_boxes(rows: Mapping[str, FieldRow]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One Accordion per group of ``config_groups`` (open, but *advanced* collapsed) holding
    its rows in schema order; a nested section's rows sit in a box of their own, under the
    section's name. Returns ``({group key: accordion}, {section: its box})``."""
    groups: dict[str, Any] = {}
    sections_found: dict[str, Any] = {}
    for group in GROUPS:
        children: list[Any] = []
        for opt in grouped_options()[group.key]:
            section = opt.path.split(".")[0] if "." in opt.path else ""
            if not section:
                children.append(rows[opt.name].box)
                continue
            if section not in sections_found:
                header = widgets.HTML(
                    f"<b>{section}</b>: <span style='color:#777'>"
                    f"{html.escape(sections()[section])}</span>"
                )
                box = widgets.VBox([header], layout=widgets.Layout(margin="4px 0 4px 16px"))
                box.add_class("nbaccel-panel-section")
                box.add_class(f"nbaccel-section-{section}")
                sections_found[section] = box
                children.append(box)
            box = sections_found[section]
            box.children = (*box.children, rows[opt.name].box)
        accordion = widgets.Accordion(
            children=[widgets.VBox(children)],
            titles=(group.title,),
            selected_index=None if group.collapsed else 0,
        )
        accordion.add_class("nbaccel-panel-group")
        accordion.add_class(f"nbaccel-group-{group.key}")
        groups[group.key] = accordion
    return groups, sections_found


def show_groups(groups: Mapping[str, Any], rows: Mapping[str, FieldRow]) -> None:
    """Hide a group none of whose rows is shown; title each with what it holds now.

    The title counts the rows changed in the panel, so a collapsed group still says that
    it holds an edit."""
    for group in GROUPS:
        members = [rows[opt.name] for opt in grouped_options()[group.key]]
        visible = [row for row in members if row.box.layout.display != "none"]
        changed = sum("nbaccel-panel-changed" in row.box._dom_classes for row in visible)
        title = group.title + (f" ({changed} changed)" if changed else "")
        accordion = groups[group.key]
        if tuple(accordion.titles) != (title,):
            accordion.titles = (title,)
        accordion.layout.display = None if visible else "none"


def hidden_note(names: Sequence[str], machine: Machine) -> str:
    """What the machine filter hid, and why (empty when nothing was).

    >>> hidden_note(["xla_start_method"], Machine(gpus=0))
    "<span style='color:#777'>Hidden: xla_start_method (no GPU, no TPU on this machine)</span>"
    """
    if not names:
        return ""
    gpus = f"{machine.gpus} GPU{'s' if machine.gpus > 1 else ''}" if machine.gpus else "no GPU"
    tpus = f"{machine.tpu_chips} TPU chips" if machine.tpu_chips else "no TPU"
    return (
        f"<span style='color:#777'>Hidden: {html.escape(', '.join(names))} "
        f"({gpus}, {tpus} on this machine)</span>"
    )
