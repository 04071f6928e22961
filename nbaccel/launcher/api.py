"""``start``: from a function in a cell to N running workers (what ``nbaccel.launch`` and
``nbaccel.notebook_launcher`` call once they have chosen how the run is shown).

Everything that can be wrong with the input is checked here, before any process, folder,
pipe or port exists: the function, the arguments, every config value, the device count,
and whether the function and its arguments can be pickled.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nbaccel.config.accelerate.launcher_keywords import from_accelerate_keywords, processes_in_total
from nbaccel.config.deepspeed.settings import deepspeed_config
from nbaccel.config.resolve import ConfigSource, Resolved, resolve
from nbaccel.config.schema import Config, usable_cpu_cores
from nbaccel.errors import ConfigError
from nbaccel.hardware.devices import (
    GpuChoice,
    choose_gpus,
    detect_tpu,
    loopback_interface,
    visible_gpu_count,
)
from nbaccel.hardware.xla_plan import XlaPlan, plan_xla, uses_xla
from nbaccel.launcher import checks
from nbaccel.launcher.bootstrap.payload import build_payload
from nbaccel.launcher.bootstrap.pickling import cell_globals
from nbaccel.launcher.control import listen
from nbaccel.launcher.detached.start import start_detached
from nbaccel.launcher.local.start import start_planned
from nbaccel.launcher.long_runs.settle import settle
from nbaccel.launcher.outcome.kept import release_kept, remember_kept
from nbaccel.launcher.planned import Display, Keeper, KeptEnd, Planned
from nbaccel.launcher.remote.hosts_launch import (
    place_here,
    place_machine_of_job,
    place_on_hosts,
    start_on_hosts,
)
from nbaccel.launcher.run import Run


def start(
    function: Callable[..., Any],
    args: tuple[Any, ...] | list[Any],
    num_processes: int | None,
    kwargs: Mapping[str, Any] | None,
    config: ConfigSource,
    overrides: Mapping[str, Any],
    *,
    show: Display,
    keep: Keeper | None = None,
) -> Run:
    """Check everything, then start ``function(*args, **kwargs)`` on every worker.

    ``show(run, gpus)`` subscribes what displays the run (the widget dashboard or text,
    chosen above the launcher by ``nbaccel.launch``) before its workers start. With
    ``detach=True`` the workers run under a supervisor of their own (``detached.py``) and
    the returned run is attached to it. ``keep``: what keeps the workers of a
    ``keep_workers`` launch (``planned.Keeper``; without it such a launch is refused).
    """
    planned = plan(function, args, num_processes, kwargs, config, overrides, keep)
    if planned.keep is not None and keep is not None:
        made = dataclasses.replace(planned.keep, make=keep.make)
        planned = dataclasses.replace(planned, keep=made)
    if planned.keep is not None:
        release_kept("a new keep_workers launch")
    run = start_plan(planned, show=show)
    if planned.keep is not None:
        remember_kept(run)
    # A cell's function took the kernel's globals as they were: a NameError from a rank for
    # a name defined since says so (Run._value).
    if (names := cell_globals(function)) is not None:
        run.kernel_names = names
    return run


def start_plan(planned: Planned, *, show: Display) -> Run:
    """Start a planned launch: on several machines, detached, or here. The kept workers'
    listener (``keep_workers``) is closed if the start fails, else by their group."""
    try:
        if planned.placement is not None:
            return start_on_hosts(planned, show=show)
        if planned.resolved.config.detach:
            return start_detached(planned, show=show)
        return start_planned(planned, show=show)
    except BaseException:
        if planned.keep is not None:
            planned.keep.listener.close()
        raise


def plan(
    function: Callable[..., Any],
    args: tuple[Any, ...] | list[Any],
    num_processes: int | None,
    kwargs: Mapping[str, Any] | None,
    config: ConfigSource,
    overrides: Mapping[str, Any],
    keeper: Keeper | None = None,
) -> Planned:
    """Everything about a launch but its processes, checked: an error here leaves nothing.
    ``keeper``: what keeps the workers of a ``keep_workers`` launch (``start``'s ``keep``)."""
    # Everything that can be wrong is found before any process, folder, pipe or port exists.
    checks.check_call(function, args, kwargs)
    explicit = from_accelerate_keywords(overrides)  # use_port=, num_nodes=, ... as Accelerate's
    if num_processes is not None:  # per machine where num_nodes= says so, as Accelerate's
        explicit["num_processes"] = processes_in_total(num_processes, overrides)
    if isinstance(explicit.get("hosts"), (str, list)):  # hosts="hostfile" or a list
        hosts = explicit["hosts"]
        explicit["hosts"] = (hosts,) if isinstance(hosts, str) else tuple(hosts)
    resolved = resolve(explicit, env=os.environ, config=config)
    resolved, resume_notes = settle(resolved, function)
    placement, xla, chosen = None, None, GpuChoice(0)
    if resolved.config.hosts:  # several machines from here: every host checked over SSH
        placement = place_on_hosts(resolved.config, os.environ)
        world_size = sum(placement.shares)
    elif resolved.config.num_machines > 1:  # this machine's share: each machine runs the cell
        chosen = _choose_gpus(resolved, cpu=resolved.config.use_cpu)
        placement = place_machine_of_job(
            resolved.config, chosen.count, os.environ, resolved.sources["num_machines"]
        )
        world_size = resolved.config.total_processes(chosen.count)
    else:
        checks.check_one_machine(resolved)
        xla = plan_xla_launch(resolved.config, os.environ)
        # Counted once: NVML is slow. A torch_xla launch runs on TPU (or XLA's CPU device).
        chosen = _choose_gpus(resolved, cpu=resolved.config.use_cpu or xla is not None)
        world_size = (
            xla.world_size if xla else _gpu_world_size(resolved.config, os.environ, chosen.count)
        )
        if resolved.config.max_restarts:  # torch elastic restarts them: its agent, here
            placement = place_here(resolved.config, world_size, xla=xla is not None)
    checks.check_log_ranks(resolved.config, world_size)
    checks.check_project_dir(resolved.config)
    keep = None
    if resolved.config.keep_workers:  # the last check, then the one thing made here
        checks.refuse_unsupported(resolved.config, xla, "keep_workers=True")
        if keeper is None:
            raise ConfigError(
                "keep_workers=True keeps the workers for the kernel that launched them: use "
                "nbaccel.launch or nbaccel.notebook_launcher (a terminal's launch ends with "
                "its workers).",
                field="keep_workers",
            )
        token = secrets.token_hex(32)
        facing = placement.first_address if placement is not None else None
        listener, address = listen(facing if resolved.config.hosts else None, token)
        keep = KeptEnd(listener, address, token, chosen.count)
    try:
        # Workers the kernel starts itself wait while it checks data kept from an earlier
        # launch (a detached run's supervisor, torch_xla's and other machines' do not).
        payload = build_payload(
            function,
            tuple(args),
            kwargs or {},
            resolved.config,
            settle_later=placement is None and xla is None and not resolved.config.detach,
            notices=resume_notes,
            keep=(keeper.serve, keep.address, keep.token) if keeper and keep else None,
        )
    except BaseException:
        if keep is not None:
            keep.listener.close()
        raise
    return Planned(
        run_id=time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3),
        resolved=resolved,
        xla=xla,
        gpus=chosen.count,
        world_size=world_size,
        payload=payload,
        env=dict(os.environ) | chosen.worker_env(),  # gpu_ids: the workers see only those
        cwd=os.getcwd(),
        placement=placement,
        keep=keep,
    )


def _choose_gpus(resolved: Resolved, *, cpu: bool) -> GpuChoice:
    """The GPUs this machine's workers use (``gpu_ids``, checked against what is visible)."""
    visible = None if cpu else visible_gpu_count(os.environ)
    source = resolved.sources["gpu_ids"]
    return choose_gpus(resolved.config.gpu_ids, os.environ, visible=visible, source=source)


def warm_planning() -> None:
    """Do, once and with no side effect, what only a process's first launch does: import
    NVML's bindings (~15 ms), fill the schema's type-hint caches, read the loopback interface,
    find the temporary folder (the payload's file: its first call probes the folder, ~0.4 ms).

    The prewarm calls it once the helper is ready, so a kernel's first launch costs what a
    later one does (issue 16). It plans a default launch with an empty environment: no file
    is read, nothing is written, and a problem in the user's settings is left for the launch
    that reports it (this runs on a background thread that has nobody to tell).

    >>> warm_planning()
    """
    config = resolve({}, env={}, use_default_file=False).config
    plan_world_size(config, {})
    build_payload(_do_nothing, (), {}, config)
    loopback_interface()
    tempfile.gettempdir()


def _do_nothing() -> None:
    """The function ``warm_planning`` pickles: a module-level function, as small as one gets."""


def plan_xla_launch(
    config: Config, env: Mapping[str, str], root: Path = Path("/")
) -> XlaPlan | None:
    """How torch_xla runs this launch (checked: versions, topology, kernel state), or None
    when it does not go through torch_xla (no TPU, no ``PJRT_DEVICE``, strategy not xla)."""
    tpu = detect_tpu(root, env)
    return plan_xla(config, tpu, env) if uses_xla(config, tpu) else None


def check_environment(config: Config, gpus: int, installed: Callable[[str], bool]) -> None:
    """Settings this machine cannot honour: an error now instead of a crash in a worker."""
    if config.strategy == "deepspeed":
        if not installed("deepspeed"):
            raise ConfigError(
                "strategy='deepspeed' needs the deepspeed package: pip install deepspeed "
                "(it runs on CUDA GPUs). On CPU use strategy='fsdp'.",
                field="strategy",
            )
        if not gpus:
            raise ConfigError(
                "strategy='deepspeed' runs on CUDA GPUs and none is visible. Use "
                "strategy='fsdp' (sharding that runs on CPU too).",
                field="strategy",
            )
        deepspeed_config(config)  # reads and checks the DeepSpeed config: refused before launch


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None  # looks, never imports


def plan_world_size(config: Config, env: Mapping[str, str], visible: int | None = None) -> int:
    """Worker count for this machine, checked against the TPU or GPUs that are visible.
    ``visible``: the GPUs ``env`` leaves visible, when already counted (NVML is slow)."""
    xla = plan_xla_launch(config, env)
    if xla is not None:
        return xla.world_size
    if config.use_cpu:
        visible = None
    elif visible is None:
        visible = visible_gpu_count(env)
    return _gpu_world_size(config, env, choose_gpus(config.gpu_ids, env, visible=visible).count)


def _gpu_world_size(config: Config, env: Mapping[str, str], gpus: int) -> int:
    """Worker count for this machine, where the run's processes use ``gpus`` GPUs."""
    check_environment(config, gpus, _installed)
    if config.num_processes is None:
        return max(gpus, 1)
    if not gpus:
        checks.check_oversubscription(config, config.num_processes, usable_cpu_cores())
    checks.check_gpus_suffice(
        config.num_processes,
        gpus,
        env,
        asked=f"num_processes={config.num_processes}",
        most=gpus,
        gpu_ids=config.gpu_ids,
    )
    return config.num_processes
