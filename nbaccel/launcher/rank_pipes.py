"""``RankPipes``: one rank's output and event pipes, and what the pump learned of the rank.

The pump thread (``pump.py``) alone reads and writes these; ``Run`` holds one per rank of
this machine, by global rank. Stdlib and the launcher's output and frame readers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbaccel.frames import FrameDecoder
from nbaccel.launcher.output import OutputReader


@dataclass
class RankPipes:
    """One rank's output and event pipes, as the pump reads them."""

    rank: int
    log_file: Any
    log_fd: int
    event_fd: int
    output: OutputReader = field(default_factory=OutputReader)  # lines, marks taken out
    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    exitcode: int | None = None
    pid: int | None = None  # reported by the worker when it starts
    result: bytes | None = None
    result_refs: tuple[tuple[int, int, int], ...] = ()  # its buffers in the rank's result box
    result_map: memoryview | None = None  # that box, mapped (sharing.segments.map_private)
    has_result: bool = False
    attempt: int = 0  # torch elastic's restart count of the rank's latest worker
