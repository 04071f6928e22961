"""``checkpoint_dir`` and ``resume`` made concrete before any process starts.

``checkpoint_dir`` empty becomes ``runs_dir/checkpoints/<the function's name>``, so the same
cell finds its checkpoints again after a kernel restart; a relative folder becomes absolute.
``resume="auto"`` becomes the place holding the newest complete checkpoint (the local root or
its durable copy, whichever is further along), or ``"never"`` when there is none yet; an
explicit folder or URL must hold a complete checkpoint, else the launch fails here with
nothing started. The ranks get the result in their config, and the cell is told in words
("resuming at step 1,200 from gs://... (saved 12 min ago)"). Torch-free: reads ``LATEST`` and
``meta.json`` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbaccel.config.resolve import Resolved
from nbaccel.durable import CheckpointPoint, fetch, is_url, newest_complete, newest_of
from nbaccel.durable.places import local_path
from nbaccel.durable.staging import checkpoint_places, default_place
from nbaccel.errors import ConfigError


def settle(resolved: Resolved, function: Callable[..., Any]) -> tuple[Resolved, list[str]]:
    """``resolved`` with ``checkpoint_dir`` and ``resume`` concrete, and what to tell."""
    config = resolved.config
    place = config.checkpoint.dir
    if not place:
        name = getattr(function, "__name__", "") or type(function).__name__
        place = default_place(config.runs_dir, name)
    elif not is_url(place):
        place = str(local_path(place).absolute())
    resume, notes = config.resume, []
    if resume == "auto":
        root, durable = checkpoint_places(place, config.runs_dir)
        found = newest_of(newest_complete(p) for p in (str(root), durable) if p is not None)
        if found is None:
            resume = "never"
            notes.append(
                f"resume='auto': no complete checkpoint in {durable or root} yet; starting "
                "from the beginning"
            )
        else:
            resume = _here(found, root, config.hosts)
            notes.append(f"resuming at {found.describe()}")
    elif resume != "never":
        found = _explicit(resume)
        resume = _here(found, checkpoint_places(place, config.runs_dir)[0], config.hosts)
        notes.append(f"resuming at {found.describe()}")
    changed = config.replace(checkpoint_dir=place, resume=resume)
    return dataclasses.replace(resolved, config=changed), notes


def _here(found: CheckpointPoint, root: Path, hosts: tuple[str, ...]) -> str:
    """Where the ranks load ``found`` from: a durable copy is fetched to this machine's disk
    now (the ranks are here, and load their compiled artifacts before the function), except
    for ranks on other machines, which fetch it themselves."""
    if not is_url(found.location) or hosts:
        return found.location
    return str(fetch(found, root / ".fetched"))


def _explicit(resume: str) -> CheckpointPoint:
    source = resume if is_url(resume) else str(local_path(resume).absolute())
    try:
        found = newest_complete(source)
    except ValueError as error:  # a damaged LATEST: its message says what and the fix
        raise ConfigError(f"resume={resume!r}: {error}", field="resume") from None
    if found is None:
        raise ConfigError(
            f"resume={resume!r} holds no complete checkpoint (no LATEST naming a whole saved "
            "state). Give the checkpoint folder a run saved into (its checkpoint_dir), "
            "resume='auto' to take the newest one if any, or resume='never'.",
            field="resume",
        )
    return found
