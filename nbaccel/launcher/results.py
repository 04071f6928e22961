"""The ranks' returned values, as the kernel holds them until asked (``Run.result``).

A rank on this machine writes its value's large buffers into its *result box*, an empty memfd
the kernel made and handed it with its other fds (``sharing``): the pump maps the box when
the value's message comes and closes it (no fd outlives the run; the pages live as long as
the map). ``run.result()`` unpickles the value from its small pickle and that map, only when
asked (a tensor imports torch then, because the user asked for it). The run folder keeps
each value as a plain pickle, buffers put back in place without unpickling anything here.

``RankPipes`` is the rest the kernel keeps of a rank: its output and event pipes, which the
pump thread (``pump.py``) alone reads, and what the pump learned of the rank, its value
among it. ``Run`` holds one per rank of this machine, by global rank.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbaccel.frames import FrameDecoder
from nbaccel.launcher.output import OutputReader
from nbaccel.launcher.run_folder import private_file
from nbaccel.launcher.sharing.memfd import NoSharedMemory, new_fd
from nbaccel.launcher.sharing.packing import Packed, close_fds, inline_chunks, unpack_mapped
from nbaccel.launcher.sharing.segments import map_private


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
    stopped: bool = False  # ended on a stop request after every rank saved (RankStopped)
    trained: bool = False  # keep_workers: its function returned, its output is all in
    attempt: int = 0  # torch elastic's restart count of the rank's latest worker


class ResultBoxes:
    """Each rank's result box, from its making to its value (or the run's end)."""

    def __init__(self) -> None:
        self._boxes: dict[int, int] = {}

    def make(self, rank: int) -> int | None:
        """An empty memfd for ``rank``'s value (the kernel's fd: the worker gets its own);
        None where this process can make no shared memory (``memfd``, which says so once):
        the value then comes back inside its pickle."""
        try:
            box = new_fd("nbaccel-result")
        except NoSharedMemory:
            return None
        self._boxes[rank] = box
        return box

    def take(self, rank: int, refs: tuple[tuple[int, int, int], ...]) -> memoryview | None:
        """``rank``'s value came: its box mapped if the value left buffers there (else None),
        and closed."""
        box = self._boxes.pop(rank, None)
        if box is None:
            return None
        try:
            return map_private(box) if refs else None
        finally:
            os.close(box)

    def close(self) -> None:
        """The run ended: the boxes of ranks that sent no value go."""
        close_fds(self._boxes)
        self._boxes.clear()


def keep_in_folder(path: Path, value: Packed, box: memoryview | None = None) -> None:
    """``value`` as a plain pickle at ``path`` (its buffers put back in place)."""
    with private_file(path, "wb") as file:
        for chunk in inline_chunks(value, [box] if box is not None else []):
            file.write(chunk)


def load_value(value: bytes | None, refs: tuple[tuple[int, int, int], ...], box: Any) -> Any:
    """A rank's value from its pickle (None: it returned nothing we kept) and its mapped box."""
    packed = Packed(value or pickle.dumps(None), refs)
    return unpack_mapped(packed, [box] if box is not None else [])
