"""``Accelerator(...)``'s arguments, plugins and kwargs handlers applied to the launch's Config.

``apply_accelerator_arguments`` is the one place where Accelerate's ways of configuring a run
(``fsdp_plugin=``, ``deepspeed_plugin=``, ``kwargs_handlers=[...]``, ``project_config=``,
``gradient_accumulation_plugin=``, ``dynamo_plugin=`` and the plain arguments) meet the
launch's resolved ``Config``. It returns ``AcceleratorOptions``: the Config with all of them
applied, each changed value's source (shown like ``nbaccel config show``), and the keywords
that are no config field (DDP's, the loss scaler's, autocast's, ...). Pure: it reads no
environment and changes none of its arguments. Torch-free, like all of ``nbaccel.config``.

Precedence, as Accelerate 1.15 decides it (``Accelerator.__init__`` and the plugins'
``__post_init__``), with the launch config in the place of Accelerate's environment variables:

1. The launch config is the base.
2. ``Accelerator`` arguments (``mixed_precision=``, ``gradient_accumulation_steps=``, ``cpu=``,
   ``log_with=``, ``project_dir=``, ``dynamo_backend=``) win over it. One deviation: Accelerate
   reads ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` over its ``gradient_accumulation_steps=``
   argument; nbaccel lets the argument win, as it does for every other argument.
3. ``project_config.project_dir`` wins over ``project_dir=`` (Accelerate fills the
   configuration's directory from the argument only when it has none).
4. ``gradient_accumulation_plugin`` sets ``gradient_accumulation_steps`` (its ``num_steps``;
   None is 1) and ``sync_each_batch``; with ``gradient_accumulation_steps`` other than 1 as
   well it is an error. ``dynamo_plugin`` with ``dynamo_backend=``: an error; its fields set
   ``dynamo_backend`` and the ``dynamo`` section, each left at None keeps the launch's.
   ``InitProcessGroupKwargs.timeout`` sets ``collective_timeout``.
5. ``fsdp_plugin`` / ``deepspeed_plugin`` select their strategy whatever the launch said, and
   fill the config as ``nbaccel.config.accelerate.plugins`` describes (set on the plugin:
   wins; unset:
   the launch's value if the launch chose it, else Accelerate's default). A DeepSpeed
   plugin's ``gradient_accumulation_steps`` and ``gradient_clipping`` win over everything
   (Accelerate: "Using DeepSpeed's value").

Refused, with the reason: both plugins at once (Accelerate silently keeps DeepSpeed), more
than one DeepSpeed plugin (nbaccel builds one engine and cannot switch between several), two
handlers of one kind, unknown handler types, a plugin that would move a TPU (``xla``) launch
to another strategy inside the worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbaccel.config.accelerate.configs import (
    DataLoaderConfiguration,
    ProjectConfiguration,
    resolve_dataloader,
    resolve_project,
    resolve_rng_types,
)
from nbaccel.config.accelerate.fsdp_plugin import FullStateDictPlacement
from nbaccel.config.accelerate.kwargs_handlers import (
    GradientAccumulationPlugin,
    KwargsHandler,
    ProfileKwargs,
    TorchDynamoPlugin,
    collect_handlers,
    foreign_type,
)
from nbaccel.config.accelerate.plugins import (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    PluginSettings,
    plugin_settings,
)
from nbaccel.config.deepspeed.settings import deepspeed_config
from nbaccel.config.resolve import Resolved
from nbaccel.config.schema import Config, check_names, flatten
from nbaccel.errors import ConfigError

__all__ = [
    "AcceleratorOptions",
    "DataLoaderConfiguration",
    "ProjectConfiguration",
    "apply_accelerator_arguments",
]

ARGUMENT = "Accelerator argument"
# Accelerate's argument names that differ from the config field they set.
_RENAMED = {"cpu": "use_cpu"}


@dataclass(frozen=True)
class AcceleratorOptions:
    """Everything an ``Accelerator`` was configured with, resolved.

    ``config``: the launch's Config with every argument, plugin and handler applied;
    ``sources``: each field's source by flat name (``resolved`` pairs them for
    ``format_sources``). The rest are keywords for the torch objects the worker builds.
    """

    config: Config
    sources: Mapping[str, str]
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallel(...)
    ddp_comm_hook: str = "no"  # a DDPCommunicationHookType value
    ddp_comm_wrapper: str = "no"
    ddp_comm_state_option: dict[str, Any] = field(default_factory=dict)
    grad_scaler_kwargs: dict[str, Any] = field(default_factory=dict)  # GradScaler(...)
    init_process_group_kwargs: dict[str, Any] = field(default_factory=dict)
    autocast_kwargs: dict[str, Any] = field(default_factory=dict)  # torch.autocast(...)
    profile_kwargs: ProfileKwargs | None = None
    compile_kwargs: dict[str, Any] = field(default_factory=dict)  # torch.compile(...)
    adjust_scheduler: bool = True  # GradientAccumulationPlugin's, for the scheduler
    sync_with_dataloader: bool = True
    project: ProjectConfiguration = field(default_factory=ProjectConfiguration)
    dataloader: DataLoaderConfiguration = field(default_factory=DataLoaderConfiguration)
    rng_types: tuple[str, ...] = ("generator",)
    deepspeed_config: dict[str, Any] | None = None  # DeepSpeedPlugin(hf_ds_config={...})
    # FSDP's get_state_dict: the plugin's FullStateDictConfig (CPU, rank 0 only by default)
    full_state_dict: FullStateDictPlacement = field(default_factory=FullStateDictPlacement)

    @property
    def resolved(self) -> Resolved:
        return Resolved(self.config, self.sources)


def apply_accelerator_arguments(
    launch: Config | Resolved,
    *,
    deepspeed_plugin: DeepSpeedPlugin | Mapping[str, DeepSpeedPlugin] | None = None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    kwargs_handlers: Iterable[KwargsHandler] | None = (),
    project_config: ProjectConfiguration | None = None,
    dataloader_config: DataLoaderConfiguration | None = None,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
    dynamo_plugin: TorchDynamoPlugin | None = None,
    deepspeed_plugins: DeepSpeedPlugin | Mapping[str, DeepSpeedPlugin] | None = None,
    rng_types: Iterable[Any] | None = None,
    split_batches: bool | None = None,
    even_batches: bool | None = None,
    **explicit: Any,
) -> AcceleratorOptions:
    """Apply ``Accelerator(...)``'s arguments to the launch config (see the module's rules).

    ``explicit``: Accelerate's own config arguments (``mixed_precision``, ``cpu``, ...) or
    any config field by its flat name; None means "not given".

    >>> from nbaccel.config.accelerate.kwargs_handlers import DistributedDataParallelKwargs
    >>> options = apply_accelerator_arguments(
    ...     Config(mixed_precision="bf16"),
    ...     fsdp_plugin=FullyShardedDataParallelPlugin(reshard_after_forward=False),
    ...     kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    ... )
    >>> options.config.strategy, options.config.fsdp.sharding_strategy, options.ddp_kwargs
    ('fsdp', 'SHARD_GRAD_OP', {'find_unused_parameters': True})
    >>> options.sources["fsdp_sharding_strategy"]
    'plugin: FullyShardedDataParallelPlugin'
    """
    _check_types(
        (project_config, ProjectConfiguration, "project_config"),
        (dataloader_config, DataLoaderConfiguration, "dataloader_config"),
        (dynamo_plugin, TorchDynamoPlugin, "dynamo_plugin"),
    )
    base, sources = _launch(launch)
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}

    def put(name: str, value: Any, label: str) -> None:
        values[name], labels[name] = value, label

    for name, value in _explicit_values(explicit).items():
        put(name, value, ARGUMENT)
    project = resolve_project(project_config, explicit.get("project_dir"))
    if project_config is not None and project_config.project_dir is not None:
        put("project_dir", os.fspath(project_config.project_dir), "ProjectConfiguration")
    accumulation = _accumulation(gradient_accumulation_plugin, explicit)
    for name, value in accumulation.items():
        put(name, value, "plugin: GradientAccumulationPlugin")
    if dynamo_plugin is not None:
        if explicit.get("dynamo_backend") is not None:
            raise ValueError(
                "You cannot pass both dynamo_plugin and dynamo_backend (as in Accelerate): "
                "give the backend in TorchDynamoPlugin(backend=...)."
            )
        for name, value in _dynamo_values(dynamo_plugin).items():
            put(name, value, "plugin: TorchDynamoPlugin")
    handlers = collect_handlers(kwargs_handlers)
    init_kwargs = _kwargs(handlers.init)
    if "timeout" in init_kwargs:
        seconds = init_kwargs["timeout"].total_seconds()
        put("collective_timeout", float(seconds), "kwargs handler: InitProcessGroupKwargs")
    plugin = _one_plugin(deepspeed_plugin, deepspeed_plugins, fsdp_plugin)
    settings = None if plugin is None else _apply_plugin(plugin, base, sources, values, put)
    given_ds = None if settings is None else settings.deepspeed_config
    config = _replace(base, values, labels)
    if isinstance(plugin, DeepSpeedPlugin):
        deepspeed_config(config, given_ds)  # a bad DeepSpeed config fails here, not in prepare
    project.set_directories(config.project_dir or None)
    for name, label in labels.items():
        sources[name] = label
    ddp = handlers.ddp
    return AcceleratorOptions(
        config=config,
        sources=sources,
        ddp_kwargs=ddp.to_kwargs() if ddp is not None else {},
        ddp_comm_hook=ddp.comm_hook.value if ddp is not None else "no",
        ddp_comm_wrapper=ddp.comm_wrapper.value if ddp is not None else "no",
        ddp_comm_state_option=dict(ddp.comm_state_option) if ddp is not None else {},
        grad_scaler_kwargs=_kwargs(handlers.scaler),
        init_process_group_kwargs=init_kwargs,
        autocast_kwargs=_kwargs(handlers.autocast),
        profile_kwargs=handlers.profile,
        compile_kwargs=_compile_kwargs(config, dynamo_plugin),
        adjust_scheduler=_ga(gradient_accumulation_plugin, "adjust_scheduler"),
        sync_with_dataloader=_ga(gradient_accumulation_plugin, "sync_with_dataloader"),
        project=project,
        dataloader=resolve_dataloader(dataloader_config, split_batches, even_batches),
        rng_types=resolve_rng_types(rng_types),
        deepspeed_config=given_ds,
        full_state_dict=FullStateDictPlacement() if settings is None else settings.full_state_dict,
    )


def _launch(launch: Config | Resolved) -> tuple[Config, dict[str, str]]:
    if isinstance(launch, Resolved):
        return launch.config, dict(launch.sources)
    default = flatten(Config())
    flat = flatten(launch)
    return launch, {k: "default" if flat[k] == default[k] else "launch config" for k in flat}


def _check_types(*given: tuple[object, type, str]) -> None:
    for value, wanted, argument in given:
        if value is not None and not isinstance(value, wanted):
            raise TypeError(foreign_type(argument, value, wanted.__name__))


def _explicit_values(explicit: Mapping[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, value in explicit.items():
        if value is None:
            continue
        name = _RENAMED.get(name, name)
        if name == "log_with":
            items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
            value = tuple(str(getattr(item, "value", item)) for item in items)
        elif name == "project_dir":
            value = os.fspath(value)
        elif name in ("mixed_precision", "dynamo_backend"):
            value = str(getattr(value, "value", value)).lower()
        values[name] = value
    check_names(values, "Accelerator argument")
    return values


def _dynamo_values(plugin: TorchDynamoPlugin) -> dict[str, Any]:
    fields = {
        "dynamo_backend": plugin.backend,
        "dynamo_mode": plugin.mode,
        "dynamo_use_fullgraph": plugin.fullgraph,
        "dynamo_use_dynamic": plugin.dynamic,
        "dynamo_use_regional_compilation": plugin.use_regional_compilation,
    }
    return {name: value for name, value in fields.items() if value is not None}


def _compile_kwargs(config: Config, plugin: TorchDynamoPlugin | None) -> dict[str, Any]:
    """``torch.compile`` keywords besides the backend, those away from their defaults (as
    Accelerate's ``TorchDynamoPlugin.to_kwargs()``); regional compilation is the worker's."""
    dynamo = config.dynamo
    kwargs: dict[str, Any] = {}
    if dynamo.mode != "default":
        kwargs["mode"] = dynamo.mode
    if dynamo.use_fullgraph:
        kwargs["fullgraph"] = True
    if dynamo.use_dynamic is not None:
        kwargs["dynamic"] = dynamo.use_dynamic
    if plugin is not None and plugin.options is not None:
        kwargs["options"] = plugin.options
    if plugin is not None and plugin.disable:
        kwargs["disable"] = True
    return kwargs


def _accumulation(
    plugin: GradientAccumulationPlugin | None, explicit: Mapping[str, Any]
) -> dict[str, Any]:
    if plugin is None:
        return {}
    if not isinstance(plugin, GradientAccumulationPlugin):
        wanted = "GradientAccumulationPlugin"
        raise TypeError(foreign_type("gradient_accumulation_plugin", plugin, wanted))
    if explicit.get("gradient_accumulation_steps") not in (None, 1):
        raise ValueError(
            "You can only pass one of gradient_accumulation_steps and "
            "gradient_accumulation_plugin (as in Accelerate): give the steps as "
            "GradientAccumulationPlugin(num_steps=...)."
        )
    return {
        "gradient_accumulation_steps": plugin.num_steps if plugin.num_steps is not None else 1,
        "sync_each_batch": bool(plugin.sync_each_batch),
    }


def _ga(plugin: GradientAccumulationPlugin | None, name: str) -> bool:
    return True if plugin is None else bool(getattr(plugin, name))


def _kwargs(handler: KwargsHandler | None) -> dict[str, Any]:
    return handler.to_kwargs() if handler is not None else {}


def _one_plugin(
    deepspeed_plugin: Any, deepspeed_plugins: Any, fsdp_plugin: Any
) -> FullyShardedDataParallelPlugin | DeepSpeedPlugin | None:
    if deepspeed_plugin is not None and deepspeed_plugins is not None:
        raise ValueError(
            "You cannot pass both deepspeed_plugin and deepspeed_plugins (as in Accelerate)."
        )
    ds = deepspeed_plugin if deepspeed_plugin is not None else deepspeed_plugins
    if isinstance(ds, Mapping):
        if len(ds) != 1:
            raise NotImplementedError(
                f"deepspeed_plugins with {len(ds)} entries ({', '.join(map(str, ds))}): nbaccel "
                "builds one DeepSpeed engine per Accelerator and cannot select between plugins "
                "(no select_deepspeed_plugin). Pass the one plugin this run trains with."
            )
        ds = next(iter(ds.values()))
    if ds is not None and not isinstance(ds, DeepSpeedPlugin):
        raise TypeError(foreign_type("deepspeed_plugin", ds, "DeepSpeedPlugin"))
    if fsdp_plugin is not None and not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
        raise TypeError(foreign_type("fsdp_plugin", fsdp_plugin, "FullyShardedDataParallelPlugin"))
    if ds is not None and fsdp_plugin is not None:
        raise ValueError(
            "Both a DeepSpeed and an FSDP plugin were given; a run uses one of them (Accelerate "
            "would silently use DeepSpeed). Pass one."
        )
    plugin: FullyShardedDataParallelPlugin | DeepSpeedPlugin | None = ds or fsdp_plugin
    return plugin


def _apply_plugin(
    plugin: FullyShardedDataParallelPlugin | DeepSpeedPlugin,
    base: Config,
    sources: Mapping[str, str],
    values: dict[str, Any],
    put: Callable[[str, Any, str], None],
) -> PluginSettings:
    settings = plugin_settings(plugin, base, lambda name: sources.get(name, "default") != "default")
    label = f"plugin: {settings.name}"
    wanted = settings.values["strategy"]
    if base.strategy == "xla" or values.get("strategy", wanted) != wanted:
        said = values.get("strategy", base.strategy)
        raise ConfigError(
            f"{settings.name} selects strategy={wanted!r}, but this run has strategy={said!r}"
            + (
                " (TPUs, decided when the processes started)"
                if said == "xla"
                else " (an Accelerator argument)"
            )
            + f". Launch with strategy={wanted!r}, or leave the plugin out.",
            field="strategy",
        )
    flat = flatten(base)
    for name, value in settings.values.items():
        if name in settings.defaulted:
            # Accelerate's default stands in for an unset launch value, never for an argument.
            if name not in values and value != flat[name]:
                put(name, value, f"{label} (Accelerate's default)")
        else:
            put(name, value, label)
    return settings


def _replace(base: Config, values: Mapping[str, Any], labels: Mapping[str, str]) -> Config:
    try:
        return base.replace(**values)
    except ConfigError as error:
        label = labels.get(error.field or "")
        where = f" (from {label})" if label else ""
        raise ConfigError(f"{error}{where}", field=error.field) from None
