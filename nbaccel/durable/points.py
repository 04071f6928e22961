"""Finding the newest complete checkpoint state in a root, and choosing among roots."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nbaccel.durable import manifest
from nbaccel.durable.places import is_url, open_place


@dataclass(frozen=True)
class CheckpointPoint:
    """One complete state found in a checkpoint root.

    ``location`` is the root (a local path or a URL, as given), ``name`` the ``state-...``
    folder in it; the rest comes from the state's ``meta.json``.
    """

    location: str
    name: str
    completed_steps: int
    saved_at: float
    world_size: int

    @property
    def where(self) -> str:
        """The state folder's own path or URL."""
        return f"{self.location.rstrip('/')}/{self.name}"

    def describe(self, now: float | None = None) -> str:
        """One line for the user: which step, where, and how long ago it was saved.

        >>> point = CheckpointPoint("gs://b/ckpt", "state-x", 1200, 1000.0, 8)
        >>> point.describe(now=1000.0 + 12 * 60)
        'step 1,200 from gs://b/ckpt/state-x (saved 12 min ago)'
        >>> point.describe(now=1000.0 + 3 * 86400)
        'step 1,200 from gs://b/ckpt/state-x (saved 3 days ago)'
        """
        age = (time.time() if now is None else now) - self.saved_at
        return f"step {self.completed_steps:,} from {self.where} (saved {_ago(age)})"


def _ago(seconds: float) -> str:
    # A clock a little behind the saver's (another machine) gives a small negative age.
    if seconds < 60:
        return "just now"
    minutes = seconds / 60
    if minutes < 120:
        return f"{int(minutes)} min ago"
    hours = minutes / 60
    if hours < 48:
        return f"{int(hours)} h ago"
    return f"{int(hours / 24)} days ago"


def state_name(text: str, location: str) -> str:
    """The state folder LATEST names; ValueError with the fix when it names anything else.

    >>> state_name("state-000001200-ab12cd\\n", "/ckpt")
    'state-000001200-ab12cd'
    >>> state_name("../elsewhere", "/ckpt")
    Traceback (most recent call last):
    ...
    ValueError: /ckpt/LATEST reads '../elsewhere', which names no state-... folder inside /ckpt...
    """
    name = text.strip()
    if (
        not name.startswith("state-")
        or any(bad in name for bad in ("/", "\\", "\x00", "\n", ".."))
        or name != name.strip()
    ):
        where = f"{location.rstrip('/')}/{manifest.LATEST}"
        raise ValueError(
            f"{where} reads {text[:200]!r}, which names no state-... folder inside "
            f"{location}. It should hold one line such as 'state-000001200-ab12cd', the name "
            f"of a folder next to it: write the name of the newest complete state folder into "
            f"it, or delete it to start from scratch."
        )
    return name


def _point(location: str, name: str, meta: Any) -> CheckpointPoint | None:
    try:
        steps = meta["progress"]["completed_steps"]
        saved_at = meta["saved_at"]
        world_size = meta["world_size"]
    except (KeyError, TypeError):
        return None
    numbers_ok = (
        isinstance(steps, int)
        and isinstance(world_size, int)
        and isinstance(saved_at, (int, float))
        and not isinstance(steps, bool)
    )
    if not numbers_ok:
        return None
    return CheckpointPoint(location, name, steps, float(saved_at), world_size)


def newest_complete(location: str) -> CheckpointPoint | None:
    """The state LATEST names in ``location`` (a local folder or a URL), when it is complete.

    A local root is written atomically (the state folder renamed into place, then LATEST
    replaced), so its state needs only a readable ``meta.json``; if it holds a MANIFEST.json
    (a durable copy kept in a folder) that is checked too. A URL's state (``file://``
    included) must have its MANIFEST.json, and every file listed there present with its
    size: that is how a copy cut short is told from a complete one. None when the root is
    missing or empty, has no LATEST, or LATEST names a state missing or incomplete (an
    older state is not looked for: LATEST is only moved once a state is complete).
    ValueError when LATEST itself is damaged (names a path outside the root).

    >>> import json, tempfile
    >>> from pathlib import Path
    >>> root = Path(tempfile.mkdtemp())
    >>> print(newest_complete(str(root / "missing")))
    None
    >>> (root / "state-1").mkdir()
    >>> meta = {"format": 1, "world_size": 2, "progress": {"completed_steps": 40},
    ...         "saved_at": 1.0}
    >>> _ = (root / "state-1" / "meta.json").write_text(json.dumps(meta))
    >>> _ = (root / "LATEST").write_text("state-1\\n")
    >>> newest_complete(str(root)).completed_steps
    40
    """
    store = open_place(location)
    try:
        latest = store.read_bytes(manifest.LATEST)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    name = state_name(latest.decode("utf-8", errors="replace"), location)
    try:
        listed = store.read_bytes(f"{name}/{manifest.MANIFEST}")
    except (FileNotFoundError, NotADirectoryError):
        if is_url(location):
            return None  # not copied whole yet (or cut short): the manifest comes last
    else:
        try:
            expected = manifest.decode(listed, f"{location}/{name}/{manifest.MANIFEST}")
        except ValueError:
            return None
        if manifest.problems(expected, store.sizes(name)):
            return None
    try:
        meta = json.loads(store.read_bytes(f"{name}/meta.json"))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return _point(location, name, meta)


def newest_of(points: Iterable[CheckpointPoint | None]) -> CheckpointPoint | None:
    """The point furthest on: the most completed steps, then the latest ``saved_at``.

    >>> local = CheckpointPoint("/ckpt", "state-a", 100, 50.0, 1)
    >>> durable = CheckpointPoint("gs://b/ckpt", "state-a", 100, 40.0, 1)
    >>> newest_of([None, durable, local]).location
    '/ckpt'
    >>> print(newest_of([None]))
    None
    """
    found = [point for point in points if point is not None]
    if not found:
        return None
    return max(found, key=lambda point: (point.completed_steps, point.saved_at))
