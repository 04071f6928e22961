"""Files of a checkpoint: written durably, and named only inside their own folder.

Durability: ``rename`` and ``os.replace`` are atomic, but without ``fsync`` a power loss may
keep the new name and lose the data behind it (the kernel writes dirty pages and directory
entries back in any order). So ``publish`` flushes every file and folder of the new state
before the rename, the rename before ``LATEST`` can name it, and ``LATEST`` itself: after a
power loss ``LATEST`` names either the previous state or the new one, each complete.

Confinement: a checkpoint may come from elsewhere, and the names stored in it (``LATEST``'s
content, the data files DCP's metadata lists) are data. ``inside`` refuses a name that is
absolute, climbs with ``..`` or leads out through a symlink, so loading reads nothing
outside the checkpoint folder. Files keep the user's umask: nothing here changes modes.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "fsync_file", "fsync_tree", "inside", "publish", "write_durably"]


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to the disk (opening read-only suffices for ``fsync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (files created, renamed or removed in it) to the disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(top: Path) -> None:
    """fsync every file under ``top``, then every folder, innermost first, ``top`` last."""
    for folder, _subfolders, files in os.walk(top, topdown=False):
        for name in files:
            fsync_file(Path(folder, name))
        fsync_dir(Path(folder))


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it before returning."""
    with open(path, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def publish(root: Path, staging: Path, final: Path, pointer: str) -> None:
    """Rename the finished ``staging`` folder to ``final`` and point ``root/pointer`` at it.

    Each step is durable before the next one starts, so a power loss at any moment leaves
    ``pointer`` naming a complete folder. ``staging`` must no longer be written to.
    """
    fsync_tree(staging)  # the data, and every folder's entries, before the state gets its name
    os.rename(staging, final)
    fsync_dir(root)  # the new name exists on disk before anything points at it
    temporary = root / f".{pointer}.{final.name}"
    write_durably(temporary, f"{final.name}\n".encode())
    os.replace(temporary, root / pointer)  # the commit point
    fsync_dir(root)  # the commit itself survives a power loss


def inside(base: Path, name: str, *, what: str) -> Path:
    """``base / name``, refused with ValueError unless it lies inside ``base``.

    ``what`` says where the name came from (``"ckpt/LATEST"``). Symlinks are followed, so a
    link inside the folder that leads out is refused as well; ``base`` itself may be a link.
    """
    if not name or "\0" in name:
        problem = "is empty or not a file name"
    elif os.path.isabs(name):
        problem = "is an absolute path"
    elif ".." in Path(name).parts:
        problem = "climbs out of the folder with '..'"
    else:
        real_base = base.resolve()
        target = (base / name).resolve()
        if target == real_base or real_base in target.parents:
            return base / name
        problem = f"leads out of the folder through a symlink (to {target})"
    raise ValueError(
        f"load_state: {what} names {name!r}, which {problem}. Everything a checkpoint refers "
        f"to must lie inside its own folder ({base}), so that a damaged or tampered "
        "checkpoint cannot make load_state read files elsewhere; nothing was loaded. Load "
        "only checkpoints you trust, restore this one from its original copy, or save again."
    )
