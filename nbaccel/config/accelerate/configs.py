"""Accelerate's ``ProjectConfiguration`` and ``DataLoaderConfiguration``, and ``rng_types``.

Same names, fields and defaults as Accelerate 1.15, torch-free. ``ProjectConfiguration``'s
``project_dir`` fills the config's ``project_dir``; the rest (``logging_dir``, checkpoint
naming and pruning, the dataloader settings, the RNGs to synchronise) reach the worker as
they are, resolved by ``nbaccel.config.accelerator_options``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["RNG_TYPES", "DataLoaderConfiguration", "ProjectConfiguration"]

# Accelerate's RNGType values: the generators a prepared dataloader can synchronise.
RNG_TYPES = (
    "torch",
    "cuda",
    "mlu",
    "sdaa",
    "musa",
    "npu",
    "xla",
    "xpu",
    "hpu",
    "neuron",
    "generator",
)


@dataclass
class ProjectConfiguration:
    """Where a project keeps its files, and how ``save_state`` names and prunes checkpoints.

    >>> ProjectConfiguration(project_dir="runs/a").logging_dir
    'runs/a'
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` to it when it has none."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards dataloaders (Accelerate's fields and defaults).

    >>> DataLoaderConfiguration(split_batches=True).even_batches
    True
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


def resolve_project(given: ProjectConfiguration | None, project_dir: Any) -> ProjectConfiguration:
    """A copy of ``given`` (or a new one) whose directory is ``project_dir`` when it has none:
    Accelerate's rule, where the configuration's own directory wins over the argument."""
    project = dataclasses.replace(given) if given is not None else ProjectConfiguration()
    if project.project_dir is None and project_dir is not None:
        project.set_directories(os.fspath(project_dir))
    return project


def resolve_dataloader(
    given: DataLoaderConfiguration | None, split_batches: bool | None, even_batches: bool | None
) -> DataLoaderConfiguration:
    """A copy of ``given`` (or the defaults) with ``split_batches`` / ``even_batches`` passed
    as arguments; one that contradicts ``given`` is an error, not a silent choice."""
    config = dataclasses.replace(given) if given is not None else DataLoaderConfiguration()
    for name, value in (("split_batches", split_batches), ("even_batches", even_batches)):
        if value is None:
            continue
        if given is not None and getattr(given, name) != value:
            raise ValueError(
                f"{name}={value!r} was passed, and dataloader_config has {name}="
                f"{getattr(given, name)!r}. Give it once, in DataLoaderConfiguration."
            )
        setattr(config, name, value)
    return config


def resolve_rng_types(given: Iterable[Any] | None) -> tuple[str, ...]:
    """The names of ``rng_types`` (strings or Accelerate's ``RNGType``); None: ``generator``.

    >>> resolve_rng_types(["torch", "generator"])
    ('torch', 'generator')
    """
    if given is None:
        return ("generator",)
    names = tuple(str(getattr(item, "value", item)) for item in given)
    for name in names:
        if name not in RNG_TYPES:
            raise ValueError(
                f"rng_types entry {name!r} is not one of {', '.join(map(repr, RNG_TYPES))}."
            )
    return names
