"""The per-run folder (``runs_dir/<run id>``) and the files nbaccel writes in it.

Logs, events, pickled results and the resolved config can hold secrets (tokens in a
config, data in a traceback), so the folder is the owner's alone (0700) and every file
nbaccel writes there is 0600, whatever the umask, as Jupyter's runtime folder is. The
user's own outputs (checkpoints, trackers' files under ``project_dir``) keep the umask.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from nbaccel.config.files import as_nested
from nbaccel.config.resolve import Resolved
from nbaccel.errors import ConfigError


def make_run_dir(runs_dir: str, run_id: str) -> Path:
    """Create ``runs_dir/run_id`` readable by the owner only (logs, results and config can
    hold secrets, as Jupyter's runtime folder can), or say why it cannot be created.
    ``runs_dir`` too, if nbaccel creates it (``private_folder``)."""
    run_dir = Path(runs_dir).expanduser().resolve() / run_id
    try:
        private_folder(run_dir.parent)
        run_dir.mkdir(mode=0o700)
    except OSError as error:
        raise ConfigError(
            f"runs_dir={runs_dir!r} cannot hold this run's folder: {error.strerror or error} "
            f"({error.filename or run_dir}). Set runs_dir to a folder you can write to.",
            field="runs_dir",
        ) from None
    run_dir.chmod(0o700)  # mkdir's mode is filtered by the umask; this is not
    return run_dir


def private_folder(path: Path) -> None:
    """Create the folder ``path`` (and its parents) if it is missing, the folder itself
    owner-only (0700, whatever the umask): a runs_dir lists its runs' ids. A folder that
    exists keeps its mode (a runs_dir shared on purpose stays shared).

    >>> import stat, tempfile
    >>> runs = Path(tempfile.mkdtemp()) / "nbaccel_runs"
    >>> private_folder(runs)
    >>> oct(stat.S_IMODE(runs.stat().st_mode))
    '0o700'
    """
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        return  # another launch made it at the same moment
    path.chmod(0o700)  # mkdir's mode is filtered by the umask; this is not


def private_file(path: Path, mode: str = "w") -> IO[Any]:
    """Open a new file in a run folder that only its owner can read (0600, whatever the
    umask); ``mode`` as for ``open`` ("w", "wb", "a")."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    buffering = 0 if "b" in mode else -1
    return os.fdopen(fd, mode, buffering=buffering)


def write_config(run_dir: Path, resolved: Resolved) -> None:
    """``config.json``: the run's resolved config and where each value came from."""
    record = {"config": as_nested(resolved.config), "sources": dict(resolved.sources)}
    with private_file(run_dir / "config.json") as file:
        file.write(json.dumps(record, indent=2) + "\n")


def read_metrics(events: Path, *, rank: int, limit: int | None = None) -> list[dict[str, Any]]:
    """A rank's metric records from a run's ``events.jsonl``, in order: the logged values
    plus ``step`` (the first ``limit`` of them)."""
    found: list[dict[str, Any]] = []
    with open(events) as lines:
        for line in lines:
            if limit is not None and len(found) >= limit:
                break
            if '"metric"' not in line:
                continue  # most lines are not metrics: skip parsing them
            record = json.loads(line)
            if record.get("event") == "metric" and record.get("rank") == rank:
                found.append({**record["values"], "step": record["step"]})
    return found
