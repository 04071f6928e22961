"""``checkpoint_every``: how often periodic saves happen, parsed once for every face.

A cadence is seconds of wall time (``"600"``, ``"15min"``, ``"2h"``) or optimizer steps
(``"500 steps"``); ``"off"`` saves only on a stop request; ``"auto"`` is 15 minutes when the
run names where checkpoints go (``checkpoint_dir``) or asks to resume, else off, so a plain
launch writes nothing it was not asked for. Plain data, stdlib only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from nbaccel.errors import ConfigError

AUTO_SECONDS = 15 * 60.0  # what users praise in hosted trainers: a save every 15 minutes
_UNITS = {"s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "hr": 3600.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class Cadence:
    """Save every ``seconds`` of training, or every ``steps`` optimizer steps (one is set).

    >>> parse("15min"), parse("500 steps")
    (Cadence(seconds=900.0, steps=None), Cadence(seconds=None, steps=500))
    >>> parse("90").seconds, parse("off")
    (90.0, None)
    """

    seconds: float | None = None
    steps: int | None = None


def parse(text: str) -> Cadence | None:
    """The cadence ``text`` names; None for ``"off"``; ``"auto"`` as 15 minutes (``effective``
    decides whether auto applies). A ConfigError with the accepted forms otherwise."""
    lowered = text.strip().lower()
    if lowered == "off":
        return None
    if lowered == "auto":
        return Cadence(seconds=AUTO_SECONDS)
    match = _PATTERN.match(lowered)
    if match is not None:
        number, unit = float(match.group(1)), match.group(2)
        if unit in ("step", "steps") and number >= 1 and number == int(number):
            return Cadence(steps=int(number))
        if (unit in _UNITS or unit == "") and number > 0:
            return Cadence(seconds=number * _UNITS.get(unit, 1.0))
    raise ConfigError(
        f"checkpoint_every={text!r} is not a cadence. Give seconds ('600'), a duration "
        "('15min', '2h', '30s'), optimizer steps ('500 steps'), 'off' or 'auto'.",
        field="checkpoint_every",
    )


def effective(config: Any) -> Cadence | None:
    """The cadence a run saves at: ``checkpoint_every`` with ``"auto"`` resolved.

    >>> from nbaccel.config import Config
    >>> effective(Config()) is None, effective(Config(resume="auto"))
    (True, Cadence(seconds=900.0, steps=None))
    """
    every = config.checkpoint.every
    if every.strip().lower() == "auto":
        asked = bool(config.checkpoint.dir) or config.resume != "never"
        return Cadence(seconds=AUTO_SECONDS) if asked else None
    return parse(every)
