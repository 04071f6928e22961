"""Bringing a durable state back to this machine's disk, to load from."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from nbaccel.durable import manifest
from nbaccel.durable.places import is_local_file_url, is_url, local_path, open_place
from nbaccel.durable.points import CheckpointPoint


def _already_here(folder: Path, listed: bytes, expected: manifest.Files) -> bool:
    # An earlier fetch renamed its folder into place only once every file had been checked
    # (sha256 included), so the same manifest and the sizes are enough: no re-hashing GBs.
    try:
        if (folder / manifest.MANIFEST).read_bytes() != listed:
            return False
    except (FileNotFoundError, NotADirectoryError):
        return False
    sizes = {rel: (folder / rel).stat().st_size for rel in expected if (folder / rel).is_file()}
    return not manifest.problems(expected, sizes)


def fetch(point: CheckpointPoint, into: Path) -> Path:
    """A local state folder to load ``point`` from.

    For a local point (a plain path or ``file://``) that is the state folder itself. For a
    URL, every file its MANIFEST.json lists is downloaded into a temporary folder next to
    ``into/<name>``, each checked against its size and sha256, and the folder is renamed
    to ``into/<name>`` once complete (a fetch cut short leaves no folder that looks whole).
    Fetching again a copy already complete there downloads nothing.

    >>> import json, tempfile
    >>> from pathlib import Path
    >>> from nbaccel.durable import DurableCopier, newest_complete
    >>> root = Path(tempfile.mkdtemp())
    >>> (root / "state-1").mkdir()
    >>> meta = {"format": 1, "world_size": 1, "progress": {"completed_steps": 7},
    ...         "saved_at": 0.0}
    >>> _ = (root / "state-1" / "meta.json").write_text(json.dumps(meta))
    >>> copier = DurableCopier("memory://doctest-fetch", keep=2, warn=print)
    >>> copier.submit(root, "state-1")
    >>> copier.wait(timeout=60)
    True
    >>> copier.close()
    >>> point = newest_complete("memory://doctest-fetch")
    >>> folder = fetch(point, root / "fetched")
    >>> json.loads((folder / "meta.json").read_text())["progress"]["completed_steps"]
    7
    """
    if not is_url(point.location) or is_local_file_url(point.location):
        return local_path(point.location) / point.name
    store = open_place(point.location)
    listed = store.read_bytes(f"{point.name}/{manifest.MANIFEST}")
    expected = manifest.decode(listed, f"{point.where}/{manifest.MANIFEST}")
    into = Path(into)
    folder = into / point.name
    if _already_here(folder, listed, expected):
        return folder
    into.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{point.name}.partial-", dir=into))
    try:
        for rel, wanted in sorted(expected.items()):
            target = partial / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            store.get_file(f"{point.name}/{rel}", target)
            got = manifest.size_and_sha256(target)
            if got != wanted:
                raise OSError(
                    f"{point.where}/{rel} arrived with {got[0]} bytes and sha256 {got[1][:12]}"
                    f"..., but its manifest says {wanted[0]} bytes and {wanted[1][:12]}...: "
                    f"the durable copy is damaged; fetch an older state or resume locally"
                )
        (partial / manifest.MANIFEST).write_bytes(listed)
        if folder.exists():
            shutil.rmtree(folder)  # an incomplete or different copy of the same name
        os.replace(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return folder
