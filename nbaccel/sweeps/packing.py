"""Which devices each trial of a sweep runs on: slots of ``processes_per_trial`` devices,
packed so that no device serves two trials at once and a device freed by a trial's end
serves the next.

On GPUs a slot is ``processes_per_trial`` GPU ids (the trial's ``gpu_ids``: its ranks see
only those); on a machine without GPUs (or ``use_cpu=True``) a slot is ``processes_per_trial``
CPU cores' worth, as many at once as the cores allow. Plain data, no processes: a simulated
8-GPU box packs as a real one does (``Packer(devices=range(8), per_trial=2)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """Where one trial runs: its GPU ids (``gpu_ids``), or CPU cores (``devices`` empty)."""

    index: int
    devices: tuple[int, ...] = ()

    @property
    def gpu_ids(self) -> str | None:
        """The launch's ``gpu_ids`` for this slot (None on CPU).

        >>> Slot(0, (2, 3)).gpu_ids, Slot(1).gpu_ids
        ('2,3', None)
        """
        return ",".join(map(str, self.devices)) if self.devices else None

    def __str__(self) -> str:
        return f"GPUs {self.gpu_ids}" if self.devices else f"CPU slot {self.index}"


class Packer:
    """Hands out slots and takes them back.

    ``devices``: the GPU ids to pack (empty: CPU slots); ``per_trial``: devices (or processes)
    per trial; ``cpu_slots``: how many CPU trials at once when there are no GPUs;
    ``max_concurrent``: a further cap.

    >>> packer = Packer(devices=range(8), per_trial=3)
    >>> [packer.take().gpu_ids for _ in range(2)], packer.take()  # 8 GPUs hold two trials of 3
    (['0,1,2', '3,4,5'], None)
    >>> first = Packer(devices=range(4), per_trial=2)
    >>> a, b = first.take(), first.take()
    >>> first.give(a); first.take().gpu_ids  # a freed device serves the next trial
    '0,1'
    """

    def __init__(
        self,
        devices: Sequence[int] = (),
        per_trial: int = 1,
        cpu_slots: int = 1,
        max_concurrent: int | None = None,
    ) -> None:
        if per_trial < 1:
            raise ValueError(f"processes_per_trial={per_trial}: at least 1")
        self.per_trial = per_trial
        ids = list(devices)
        if ids:
            if len(set(ids)) != len(ids):
                raise ValueError(f"the devices to pack name one twice: {ids}")
            if len(ids) < per_trial:
                raise ValueError(
                    f"processes_per_trial={per_trial} needs {per_trial} GPUs per trial, and "
                    f"{len(ids)} are visible ({ids}). Lower processes_per_trial, or run the "
                    "trials on CPU processes (use_cpu=True)."
                )
            groups = [tuple(ids[i : i + per_trial]) for i in range(0, len(ids), per_trial)]
            slots = [Slot(i, group) for i, group in enumerate(groups) if len(group) == per_trial]
        else:
            slots = [Slot(i) for i in range(max(1, cpu_slots))]
        if max_concurrent is not None:
            if max_concurrent < 1:
                raise ValueError(f"max_concurrent={max_concurrent}: at least 1")
            slots = slots[:max_concurrent]
        self.slots: tuple[Slot, ...] = tuple(slots)
        self._free = list(self.slots)

    @property
    def capacity(self) -> int:
        """How many trials run at once."""
        return len(self.slots)

    def take(self) -> Slot | None:
        """A free slot (the lowest), or None while every slot is busy."""
        if not self._free:
            return None
        self._free.sort(key=lambda slot: slot.index)
        return self._free.pop(0)

    def give(self, slot: Slot) -> None:
        """A trial on ``slot`` ended: its devices serve the next."""
        if slot in self._free or slot not in self.slots:
            raise ValueError(f"{slot} was not taken")
        self._free.append(slot)


def cpu_slots(cores: int, per_trial: int) -> int:
    """How many CPU trials of ``per_trial`` processes run at once on ``cores`` cores: one
    process per core, at least one trial.

    >>> cpu_slots(2, 1), cpu_slots(2, 2), cpu_slots(16, 3), cpu_slots(1, 4)
    (2, 1, 5, 1)
    """
    return max(1, cores // per_trial)
