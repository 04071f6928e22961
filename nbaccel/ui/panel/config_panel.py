"""``nbaccel.ConfigPanel``: the config schema as a form of widgets, checked on every change.

One row per schema option (a field added to ``Config`` appears here untouched), starting
from ``resolve()`` (defaults < files < env < the keywords given to the panel) and labelled
with each value's source. Rows are grouped as the wizard asks (``config_groups``: processes
and machines, precision, strategy and sharding, training loop, logging; *advanced*
collapsed). Rows that do not apply are hidden by the wizard's own ``APPLIES_WHEN`` (a hidden
option takes its default, as in ``nbaccel config``), and so are fields that cannot matter on
this machine (``xla_start_method`` without a TPU), unless "show settings for other
machines" is ticked or they hold a value other than the default. Every change runs the
schema's validation and shows each ``ConfigError`` next to the field it names; Launch
stays disabled until the config is valid and this machine can run it.

While a blocking cell runs, the browser's widget events do not reach the kernel (FACTS.md),
so the Launch button starts a non-blocking ``nbaccel.launch`` and keeps the Run in
``panel.run``; for a blocking launch, run ``notebook_launcher(train, config=panel.config)``
in the next cell. The kernel never imports torch: a model's size is counted by duck typing.
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from nbaccel.config.display import applies, launch_flags
from nbaccel.config.files import save
from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config, flatten, option, options
from nbaccel.errors import ConfigError
from nbaccel.events import Event, RunEnded, RunState
from nbaccel.hardware.devices import detect_tpu, visible_gpu_count
from nbaccel.hardware.memory_estimate import count_parameters
from nbaccel.launcher.api import plan_world_size
from nbaccel.ui.panel import config_widgets as cw
from nbaccel.ui.panel.config_groups import Machine, matters_here

if TYPE_CHECKING:
    from nbaccel.launcher.run import Run

__all__ = ["ConfigPanel"]


class ConfigPanel:
    """Widgets for every config option, with Launch, Save as YAML and the CLI command.

    ``function``/``args``/``kwargs`` are what Launch runs; ``config`` (a Config, mapping or
    YAML path) and keywords named like config fields set starting values above files and
    env; ``model`` or ``num_params`` turn on the memory estimate, compared with
    ``memory_limit`` bytes (default: the smallest GPU's memory from NVML, or the host memory
    available now for CPU runs). ``env`` replaces ``os.environ`` as resolve's environment.

    ``panel.widget`` is the container (a bare ``panel`` in a cell displays it), ``inputs``
    the input widget of each field by flat name, ``problems`` the messages shown,
    ``changed`` what was edited here, ``config`` the result and ``run`` the last launch.

    >>> panel = ConfigPanel(num_processes=2, use_cpu=True, num_params=10**6, env={})
    >>> panel.inputs["strategy"].value = "fsdp"     # what a click in the browser does
    >>> panel.changed
    {'strategy': 'fsdp'}
    >>> panel.config.strategy, panel.sources["num_processes"]
    ('fsdp', 'argument')
    >>> panel.inputs["num_machines"].value = 0      # shown next to the field, before launch
    >>> panel.problems
    {'num_machines': 'num_machines must be >= 1, got 0.'}
    >>> panel.launch_button.disabled
    True
    """

    def __init__(
        self,
        function: Callable[..., Any] | None = None,
        args: tuple[Any, ...] | list[Any] = (),
        *,
        kwargs: Mapping[str, Any] | None = None,
        config: Config | Mapping[str, Any] | str | Path | None = None,
        model: Any = None,
        num_params: int | None = None,
        memory_limit: int | None = None,
        env: Mapping[str, str] | None = None,
        dashboard: str | bool = "auto",
        yaml_path: str = "nbaccel_config.yaml",
        **overrides: Any,
    ) -> None:
        self._function = function
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self._dashboard = dashboard
        self._env = dict(os.environ if env is None else env)
        resolved = resolve(overrides, env=self._env, config=config)
        self.start: Config = resolved.config
        self.sources: dict[str, str] = dict(resolved.sources)
        self._start_values = flatten(self.start)
        self._gpus = visible_gpu_count(self._env)  # once: NVML is slow
        tpu = detect_tpu(Path("/"), self._env)
        self._machine = Machine(self._gpus, tpu.chips, bool(tpu.pjrt_device))
        self._num_params = count_parameters(model) if model is not None else num_params
        self._given_limit = memory_limit
        self._limits: dict[bool, tuple[int, str] | None] = {}  # read once per device kind
        self._config: Config | None = self.start
        self._launchable = False
        self.problems: dict[str, str] = {}  # field -> message shown ("" : not one field's)
        self.run: Run | None = None
        self.rows = {opt.name: cw.make_row(opt, self._start_values[opt.name]) for opt in options()}
        self.inputs = {name: row.input for name, row in self.rows.items()}
        self.messages = {name: row.message for name, row in self.rows.items()}
        self._build(yaml_path)
        for row in self.rows.values():
            row.input.observe(self._refresh, names="value")
        self._refresh()

    # ----- public API -------------------------------------------------------------
    @property
    def config(self) -> Config:
        """The Config the panel shows now; ConfigError, listing the problems, while invalid."""
        if self._config is None:
            raise ConfigError(
                "The config panel has invalid values; fix the fields marked there: "
                + " | ".join(self.problems.values())
            )
        return self._config

    @property
    def changed(self) -> dict[str, Any]:
        """``{field: value}`` for the applicable fields set here to other than their start."""
        values, _ = self._read_all()
        return {
            name: value
            for name, value in values.items()
            if value != self._start_values[name] and applies(option(name).path, values)
        }

    def launch(self, function: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Run:
        """Start ``function(*args, **kwargs)`` (default: the panel's) with the panel's config,
        without blocking; the Run is kept in ``panel.run``."""
        if function is None:
            function, args, kwargs = self._function, self._args, self._kwargs
        if function is None:
            raise TypeError(
                "This panel has no function to launch: create it as ConfigPanel(train, "
                "args=(...)), call panel.launch(train, ...), or run "
                "notebook_launcher(train, config=panel.config) in the next cell."
            )
        config = self.config
        import nbaccel  # looked up at call time (a test may replace nbaccel.launch)

        # Every field passed explicitly: a value reset to its default here must not be
        # overridden by a file or NBACCEL_* variable that set it otherwise.
        run = nbaccel.launch(
            function, args=args, kwargs=kwargs, config=flatten(config), dashboard=self._dashboard
        )
        self.run = run
        run.subscribe(self._on_event)
        self._show_run(run)  # it may have ended before the subscription
        return run

    @property
    def widget(self) -> Any:
        """The ipywidgets container (display it, or embed it in another layout)."""
        return self._widget

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self._widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython import display as ipython_display

        show: Any = ipython_display.display  # untyped
        show(self._widget)

    # ----- layout -----------------------------------------------------------------
    def _build(self, yaml_path: str) -> None:
        title = widgets.HTML(
            "<b>nbaccel config</b> <span style='color:#777'>(defaults &lt; files &lt; "
            "NBACCEL_* env &lt; code &lt; this panel)</span>"
        )
        self.group_boxes, self.section_boxes = cw.group_boxes(self.rows)
        self.show_all = _with_class(
            widgets.Checkbox(
                value=False,
                description="show settings for other machines",
                indent=False,
                layout=widgets.Layout(width="auto"),
            ),
            "nbaccel-panel-show-all",
        )
        self.hidden_note = _with_class(widgets.HTML(), "nbaccel-panel-hidden-note")
        self.show_all.observe(self._refresh, names="value")
        children: list[Any] = [title, *self.group_boxes.values()]
        children.append(widgets.HBox([self.show_all, self.hidden_note]))
        self.memory = _with_class(widgets.HTML(), "nbaccel-panel-memory")
        self.launch_button = _button("Launch", "nbaccel-panel-launch", "play", "success")
        self.stop_button = _button("Stop", "nbaccel-panel-stop", "stop", "danger")
        self.stop_button.disabled = True
        self.command_button = _button("Show launch command", "nbaccel-panel-command", "terminal")
        self.save_button = _button("Save as YAML", "nbaccel-panel-save", "save")
        self.path_text = _with_class(
            widgets.Text(value=yaml_path, description="YAML path"),
            "nbaccel-panel-yaml-path",
        )
        self.command_text = _with_class(
            widgets.Textarea(layout=widgets.Layout(width="100%", display="none"), rows=2),
            "nbaccel-panel-command-text",
        )
        self.status = _with_class(widgets.HTML(), "nbaccel-panel-status")
        self.output = _with_class(widgets.Output(), "nbaccel-panel-output")
        self.launch_button.on_click(self._on_launch)
        self.stop_button.on_click(lambda _: self.run.stop() if self.run is not None else None)
        self.save_button.on_click(self._on_save)
        self.command_button.on_click(self._on_command)
        buttons = widgets.HBox([self.launch_button, self.stop_button, self.command_button])
        saving = widgets.HBox([self.path_text, self.save_button])
        children += [self.memory, buttons, saving, self.command_text, self.status, self.output]
        self._widget = _with_class(widgets.VBox(children), "nbaccel-config-panel")

    # ----- checking ---------------------------------------------------------------
    def _read_all(self) -> tuple[dict[str, Any], dict[str, str]]:
        """Each field's value (hidden ones: their default) and the text that does not parse."""
        raw: dict[str, Any] = {}
        problems: dict[str, str] = {}
        for name, row in self.rows.items():
            try:
                raw[name] = cw.read_input(row.option, row.input)
            except ConfigError as error:
                problems[name] = str(error)
                raw[name] = self._start_values[name]
        values = {
            opt.name: raw[opt.name] if applies(opt.path, raw) else opt.default for opt in options()
        }
        return values, problems

    def _refresh(self, change: Any = None) -> None:
        values, problems = self._read_all()
        config, general = cw.validate(values, problems)
        machine: dict[str, str] = {}
        if config is not None:
            try:
                plan_world_size(config, self._env, self._gpus)
            except ConfigError as error:  # valid, but not here: Save and the command still work
                machine[error.field or ""] = f"On this machine: {error}"
        hidden_here: list[str] = []  # applies, but cannot matter on this machine
        for name, row in self.rows.items():
            shown = applies(row.option.path, values)
            if (
                shown
                and not self.show_all.value
                and not matters_here(row.option, self._machine, values)
            ):
                shown = False
                hidden_here.append(name)
            row.box.layout.display = None if shown else "none"
            text = problems.get(name) or machine.get(name)
            if text and not shown:
                general.append(text)
            row.message.value = cw.problem_html(text) if text and shown else ""
            row.message.layout.display = None if text and shown else "none"
            is_changed = shown and values[name] != self._start_values[name]
            row.source.value = cw.source_html(
                self.sources[name], self._start_values[name], is_changed
            )
            (row.box.add_class if is_changed else row.box.remove_class)("nbaccel-panel-changed")
        for section, box in self.section_boxes.items():
            box.layout.display = None if applies(f"{section}.", values) else "none"
        cw.show_groups(self.group_boxes, self.rows)
        self.hidden_note.value = cw.hidden_note(hidden_here, self._machine)
        general += [text for name, text in machine.items() if name not in self.rows]
        self._config = config
        self.problems = {n: problems[n] for n in self.rows if n in problems} | machine
        if general:
            self.problems[""] = " | ".join(general)
        self._launchable = config is not None and not machine and self._function is not None
        self.memory.value = cw.memory_report(
            config, self._num_params, gpus=self._gpus, limit=self._memory_limit
        )
        self.save_button.disabled = config is None
        self.command_button.disabled = config is None
        self._update_launch_button()
        if config is not None:
            flags = launch_flags(config)
            self.command_text.value = f"nbaccel launch {flags + ' ' if flags else ''}SCRIPT.py"
        notes = [cw.problem_html(text) for text in general]
        if self._function is None:
            notes.append(
                "<span style='color:#777'>No function given: launch with "
                "<code>notebook_launcher(train, config=panel.config)</code> in the next cell, "
                "or create the panel as <code>ConfigPanel(train, args=(...))</code>.</span>"
            )
        self._set_status("<br>".join(notes))

    def _memory_limit(self, config: Config, on_gpu: bool) -> tuple[int, str] | None:
        if self._given_limit is not None:
            return self._given_limit, "(the panel's memory_limit)"
        if config.strategy == "xla":
            return None  # TPU memory is read inside the workers, not from the kernel
        if on_gpu not in self._limits:
            self._limits[on_gpu] = cw.device_memory_limit(on_gpu)
        return self._limits[on_gpu]

    # ----- buttons and the run ----------------------------------------------------
    def _update_launch_button(self) -> None:
        running = self.run is not None and not self.run.state.done
        self.launch_button.disabled = not self._launchable or running
        self.stop_button.disabled = not running

    def _set_status(self, text: str) -> None:
        self.status.value = "<br>".join(part for part in (self._run_line(), text) if part)

    def _run_line(self) -> str:
        run = self.run
        if run is None:
            return ""
        state = run.state.value
        error = f": {html.escape(str(run.error).splitlines()[0])}" if run.error else ""
        return f"Run <code>{run.run_id}</code> {state}{error} (<code>{run.run_dir}</code>)"

    def _on_launch(self, _: Any) -> None:
        with self.output:
            try:
                self.launch()
            except Exception as error:  # noqa: BLE001 - shown in the panel, not lost in a log
                self._set_status(cw.problem_html(f"Launch failed: {error}"))

    def _on_event(self, event: Event) -> None:
        if isinstance(event, RunEnded) and self.run is not None:  # on the run's pump thread
            self._show_run(self.run)

    def _show_run(self, run: Run) -> None:
        if run is not self.run:
            return
        self._update_launch_button()
        colour = {RunState.SUCCEEDED: "#2e7d32", RunState.FAILED: "#c62828"}.get(run.state, "")
        line = self._run_line()
        self.status.value = f'<span style="color:{colour}">{line}</span>' if colour else line

    def _on_save(self, _: Any) -> None:
        path = Path(self.path_text.value.strip() or "nbaccel_config.yaml").expanduser()
        try:
            written = save(self.config, path)
        except (OSError, ConfigError) as error:
            self._set_status(cw.problem_html(f"Could not save {path}: {error}"))
            return
        self._set_status(f"Saved <code>{html.escape(str(written.resolve()))}</code>")

    def _on_command(self, _: Any) -> None:
        shown = self.command_text.layout.display != "none"
        self.command_text.layout.display = "none" if shown else None
        self.command_button.description = "Show launch command" if shown else "Hide command"


def _button(description: str, dom_class: str, icon: str, style: str = "") -> Any:
    return _with_class(
        widgets.Button(description=description, icon=icon, button_style=style), dom_class
    )


def _with_class(widget: Any, dom_class: str) -> Any:
    widget.add_class(dom_class)
    return widget
