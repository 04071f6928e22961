"""A state folder's MANIFEST.json: every file's relative path, size and sha256.

The manifest is written after a state's files are uploaded and before LATEST names it, so
that a reader of a URL, where a folder cannot be renamed into place, can tell a complete
copy (every listed file there with its size) from one cut short. It is computed from the
local files, never from what the remote says it holds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST = "MANIFEST.json"
LATEST = "LATEST"

# path -> (size, sha256 hex)
Files = dict[str, tuple[int, str]]


def size_and_sha256(path: Path) -> tuple[int, str]:
    """The file's size and sha256, read in chunks (checkpoints are large)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def safe_relative(rel: str) -> bool:
    """Whether ``rel`` stays inside its folder: relative, '/'-separated, no '..'."""
    parts = PurePosixPath(rel).parts
    return (
        bool(rel)
        and not rel.startswith("/")
        and "\\" not in rel
        and "\x00" not in rel
        and ".." not in parts
        and ":" not in (parts[0] if parts else "")
    )


def build(folder: Path) -> Files:
    """The manifest of a local state folder (a manifest already there is not listed).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "meta.json").write_text("{}")
    >>> build(folder)["meta.json"][0]
    2
    """
    files: Files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel != MANIFEST:
            files[rel] = size_and_sha256(path)
    return files


def encode(name: str, files: Files) -> bytes:
    """The manifest's bytes: the same files always give the same bytes."""
    body = {
        "format": 1,
        "name": name,
        "files": {rel: {"size": size, "sha256": sha} for rel, (size, sha) in files.items()},
    }
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def decode(data: bytes, where: str) -> Files:
    """The files a manifest lists; ValueError (naming ``where``) when it is damaged."""
    try:
        body: Any = json.loads(data)
        listed = body["files"]
        files: Files = {}
        for rel, entry in listed.items():
            size, sha = entry["size"], entry["sha256"]
            if not (isinstance(size, int) and size >= 0 and isinstance(sha, str)):
                raise TypeError(rel)
            files[str(rel)] = (size, sha)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{where} is damaged ({error!r})") from error
    outside = sorted(rel for rel in files if not safe_relative(rel))
    if outside:
        raise ValueError(f"{where} lists paths outside its folder: {outside[:3]}")
    return files


def problems(expected: Files, found: dict[str, int]) -> list[str]:
    """What differs between a manifest and a listing of sizes: empty when it matches (files
    the manifest does not list are allowed)."""
    wrong = []
    for rel, (size, _) in sorted(expected.items()):
        if rel not in found:
            wrong.append(f"{rel} is missing")
        elif found[rel] != size:
            wrong.append(f"{rel} has {found[rel]} bytes, not {size}")
    return wrong
