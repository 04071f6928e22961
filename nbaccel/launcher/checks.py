"""What a launch checks before anything exists: no process, folder, pipe or port yet.

Each check raises with what is wrong, why it matters and the fix, naming the field or
argument. ``api.start`` calls them in order; the config's own types and bounds were
already checked by ``resolve``. Stdlib only: this runs in the kernel.
"""

from __future__ import annotations

import inspect
import ipaddress
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nbaccel.config.resolve import Resolved
from nbaccel.config.schema import OVERSUBSCRIBE_FACTOR, Config, shown_ranks
from nbaccel.errors import CallError, ConfigError
from nbaccel.hardware.xla_plan import XlaPlan


def check_call(function: Any, args: Any, kwargs: Mapping[str, Any] | None) -> None:
    """The function and its arguments, as given in the call."""
    if not callable(function):
        raise CallError(
            f"nbaccel needs a function to run in each worker, got {type(function).__name__} "
            f"{function!r}. Pass the function itself: notebook_launcher(train), not train()."
        )
    if not isinstance(args, (tuple, list)):
        raise CallError(
            f"args must be a tuple or list of positional arguments, got {type(args).__name__}. "
            "For one argument write args=(value,)."
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise CallError(f"kwargs must be a mapping, got {type(kwargs).__name__}.")
    check_signature(function, tuple(args), dict(kwargs or {}))


def check_signature(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """Fail here, not in every worker, when ``function(*args, **kwargs)`` cannot bind.

    >>> def train(lr, epochs=1): ...
    >>> check_signature(train, (), {})
    Traceback (most recent call last):
    ...
    nbaccel.errors.CallError: train(lr, epochs=1) cannot be called with 0 positional argument(s): missing a required argument: 'lr'. Pass arguments that match its parameters (args=(value,) for one positional argument).
    """  # noqa: E501
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # some builtins have no signature to check against: the worker will tell
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        name = getattr(function, "__qualname__", repr(function))
        bare = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        given = f"{len(args)} positional argument(s)"
        if kwargs:
            given += " and keyword(s) " + ", ".join(map(repr, kwargs))
        raise CallError(
            f"{name}{bare} cannot be called with {given}: {error}. Pass arguments that "
            "match its parameters (args=(value,) for one positional argument)."
        ) from None


def check_one_machine(resolved: Resolved) -> None:
    """``launch``/``notebook_launcher`` on this machine alone: every socket on loopback."""
    config, sources = resolved.config, resolved.sources
    if not _is_loopback(config.main_process_ip):
        raise ConfigError(
            f"main_process_ip={config.main_process_ip!r} (from "
            f"{sources['main_process_ip']}): a one-machine run keeps every socket on loopback "
            "(127.0.0.1) so that nothing faces the network; the address of machine 0 is only "
            "used with num_machines > 1. Remove main_process_ip, or set it to 127.0.0.1.",
            field="main_process_ip",
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_log_ranks(config: Config, world_size: int) -> None:
    """``log_ranks`` may only name ranks this run has."""
    ranks = shown_ranks(config.log_ranks)
    missing = sorted(r for r in ranks or () if r >= world_size)
    if missing:
        raise ConfigError(
            f"log_ranks={config.log_ranks!r} names rank {missing[0]}, but this run has "
            f"{world_size} process(es) (ranks 0-{world_size - 1}), so that output would never "
            f"show. Use ranks below {world_size}, or 'all'.",
            field="log_ranks",
        )


def check_gpus_suffice(
    processes: int,
    gpus: int,
    env: Mapping[str, str],
    *,
    asked: str,
    most: int,
    gpu_ids: str = "all",
) -> None:
    """Refuse more processes on this machine than it has visible GPUs (none: CPU processes),
    or than ``gpu_ids`` names. ``asked`` says how the setting reads, ``most`` the largest
    ``num_processes`` that fits.

    >>> check_gpus_suffice(3, 2, {}, asked="num_processes=3", most=2)
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: num_processes=3 asks for 3 process(es) on this machine, but only 2 GPU(s) are visible (CUDA_VISIBLE_DEVICES=unset). Use num_processes<=2, or use_cpu=True to run CPU processes instead.
    """  # noqa: E501
    if gpus and processes > gpus and gpu_ids != "all":
        raise ConfigError(
            f"{asked} asks for {processes} process(es) on this machine, but gpu_ids="
            f"{gpu_ids!r} names {gpus} GPU(s), one for each process. Use num_processes<="
            f"{most}, name more GPUs in gpu_ids, or use_cpu=True to run CPU processes instead.",
            field="num_processes",
        )
    if gpus and processes > gpus:
        raise ConfigError(
            f"{asked} asks for {processes} process(es) on this machine, but only {gpus} GPU(s) are "
            f"visible (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}). Use "
            f"num_processes<={most}, or use_cpu=True to run CPU processes instead.",
            field="num_processes",
        )


def check_oversubscription(config: Config, world_size: int, cores: int) -> None:
    """Refuse far more CPU processes than cores, unless ``allow_oversubscribe``.

    >>> check_oversubscription(Config(num_processes=40), 40, cores=2)
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: num_processes=40 CPU processes on 2 core(s) is more than 8 per core: each process would get a sliver of a core (and its own copy of the model in memory). Use fewer processes, or pass allow_oversubscribe=True if you mean it.
    """  # noqa: E501
    limit = OVERSUBSCRIBE_FACTOR * cores
    if world_size > limit and not config.allow_oversubscribe:
        raise ConfigError(
            f"num_processes={world_size} CPU processes on {cores} core(s) is more than "
            f"{OVERSUBSCRIBE_FACTOR} per core: each process would get a sliver of a core (and "
            "its own copy of the model in memory). Use fewer processes, or pass "
            "allow_oversubscribe=True if you mean it.",
            field="num_processes",
        )


def check_project_dir(config: Config) -> None:
    """A ``project_dir`` the workers will write into must be a writable folder (or be
    creatable in one): checked here, where the error names the field."""
    if not config.project_dir:
        return
    path = Path(config.project_dir).expanduser().absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if existing == path and not path.is_dir():
        why = "it is a file, not a folder"
    elif not existing.is_dir():
        why = f"{existing} is a file, so no folder can be created under it"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable for this user"
    else:
        return
    raise ConfigError(
        f"project_dir={config.project_dir!r} cannot hold the run's trackers and checkpoints: "
        f"{why}. Choose a folder you can write to.",
        field="project_dir",
    )


def refuse_unsupported(config: Config, xla: XlaPlan | None, who: str = "nbaccel.Workers") -> None:
    """What interactive workers do not serve (``who``: ``nbaccel.Workers``, or a launch's
    ``keep_workers=True``), refused before anything starts."""
    if xla is not None:
        raise ConfigError(
            f"{who} does not run on torch_xla yet (its ranks can be threads of one process, "
            "which an interrupt cannot reach one by one). Use nbaccel.launch on TPU without "
            "it, or use_cpu=True for CPU workers.",
            field="strategy",
        )
    for key, value in (
        ("detach", config.detach),
        ("max_restarts", config.max_restarts),
        ("num_machines", config.num_machines > 1),
    ):
        if value:
            raise ConfigError(
                f"{key}= is not supported by {who} (interactive workers live and die with "
                "this kernel, in one process group that is not restarted; a job whose "
                "machines each launch from their own kernel has no one kernel to serve). Use "
                f"nbaccel.launch without {'it' if who == 'nbaccel.Workers' else who} for it, "
                "or hosts=[...] to run the workers on several machines.",
                field=key,
            )
