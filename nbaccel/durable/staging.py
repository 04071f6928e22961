"""Where a run's checkpoints are written first, and where they are copied to.

Every save is written on the local disk first (fast, atomic), under
``runs_dir/checkpoints/``. A ``checkpoint_dir`` there (the default,
``runs_dir/checkpoints/<the function's name>``) is the checkpoint root itself. Any other
``checkpoint_dir`` (a folder such as Colab's mounted Drive, or a URL) is a durable place:
saves go to a local staging root named after it, and a ``DurableCopier`` copies each one
there in the background. The kernel (to find what to resume) and the ranks (to save) read
the same answer from here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from nbaccel.durable.places import is_url, local_path

HOME = "checkpoints"


def checkpoint_places(place: str, runs_dir: str | Path) -> tuple[Path, str | None]:
    """``(local root saves are written to, durable place they are copied to or None)``.

    >>> root, durable = checkpoint_places("gs://bucket/ckpt", "/work/nbaccel_runs")
    >>> root.parent, durable
    (PosixPath('/work/nbaccel_runs/checkpoints'), 'gs://bucket/ckpt')
    >>> checkpoint_places("/work/nbaccel_runs/checkpoints/train", "/work/nbaccel_runs")
    (PosixPath('/work/nbaccel_runs/checkpoints/train'), None)
    """
    home = Path(runs_dir).expanduser().absolute() / HOME
    if not place:
        return home / "default", None
    if not is_url(place):
        path = local_path(place).absolute()
        if path.is_relative_to(home):
            return path, None
        place = str(path)
    digest = hashlib.sha256(place.encode()).hexdigest()[:12]
    return home / f"staging-{digest}", place


def default_place(runs_dir: str | Path, function_name: str) -> str:
    """``checkpoint_dir`` when none is given: one root per training function.

    >>> default_place("/work/nbaccel_runs", "train")
    '/work/nbaccel_runs/checkpoints/train'
    """
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in function_name) or "train"
    return str(Path(runs_dir).expanduser().absolute() / HOME / name.lstrip("."))
