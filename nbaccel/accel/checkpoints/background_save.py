"""Periodic saves that the training step does not wait for.

At the step every rank agreed on, each rank takes a **snapshot** in the training thread:
rank 0 copies the state dicts (models, optimizers, schedulers, scaler, registered objects;
tensors cloned to the CPU, since training goes on changing them in place) and the
dataloader positions; every rank its RNG states. A thread per rank then writes its files
into ``root/.partial-<name>`` and leaves a ``done-<rank>`` mark; rank 0's thread waits for
every rank's mark (bounded by ``deadline``), then publishes as ``save_state`` does (fsync,
rename, ``LATEST`` last) and keeps the newest ``keep``. The threads never call a collective,
so they cannot interleave with the training thread's.

Only where every rank shares the folder (one machine) and the layout is whole state dicts;
the sharded layouts and XLA save in the training thread (``checkpoint.save_state``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from nbaccel.accel.checkpoints import checkpoint
from nbaccel.accel.checkpoints.checkpoint_files import fsync_file, publish

MARK_POLL = 0.05  # rank 0's thread looks for the other ranks' marks this often


@dataclass
class Snapshot:
    """One rank's part of a checkpoint, in CPU memory: ``files`` by name, and ``meta`` on rank 0."""

    files: dict[str, Any] = field(default_factory=dict)  # state dicts, or bytes as they are
    meta: dict[str, Any] | None = None


def take_snapshot(
    objects: checkpoint.Stateful,
    *,
    rank: int,
    world_size: int,
    progress: dict[str, int],
    metrics: bytes | None = None,
) -> Snapshot:
    """What this rank writes, copied now so that training may go on at once (``metrics``:
    rank 0's logged curve, saved beside the state)."""
    snap = Snapshot()
    if rank == 0:
        for i, model in enumerate(objects.models):
            snap.files[f"model_{i}.pt"] = _copied(model.state_dict())
        for i, optimizer in enumerate(objects.optimizers):
            snap.files[f"optimizer_{i}.pt"] = _copied(optimizer.state_dict())
        for i, scheduler in enumerate(objects.schedulers):
            snap.files[f"scheduler_{i}.pt"] = _copied(scheduler.state_dict())
        if objects.scaler is not None:
            snap.files["scaler.pt"] = _copied(objects.scaler.state_dict())
        for i, obj in enumerate(objects.custom):
            snap.files[f"custom_{i}.pt"] = _copied(obj.state_dict())
        snap.meta = checkpoint.meta(objects, world_size, progress)
        if metrics is not None:
            snap.files["metrics.jsonl"] = metrics
    snap.files[f"random_states_{rank}.pt"] = checkpoint.rng_states()
    return snap


def _copied(state: Any) -> Any:
    # A clone, not a view: the optimizer's next step changes parameters and moments in place.
    return tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), state)


class BackgroundWrite:
    """Writes one rank's snapshot in a thread; on rank 0 also waits for the others and
    publishes. ``join`` waits; ``error`` is what went wrong (None: written, or still going).

    ``on_published(final)`` runs in rank 0's thread once ``LATEST`` names the new state.
    """

    def __init__(
        self,
        root: Path,
        name: str,
        snapshot: Snapshot,
        *,
        rank: int,
        world_size: int,
        keep: int,
        deadline: float,
        on_published: Callable[[Path], None] = lambda final: None,
    ) -> None:
        self.root, self.name, self.rank = root, name, rank
        self.staging = root / f".partial-{name}"
        self.final = root / f"state-{name}"
        self._snapshot, self._world, self._keep = snapshot, world_size, keep
        self._deadline, self._on_published = deadline, on_published
        self.error: BaseException | None = None
        self.published = False
        self._thread = threading.Thread(target=self._run, name=f"nbaccel-save-{name}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for this rank's part (rank 0: the publish); True when it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self.staging.mkdir(parents=True, exist_ok=True)
            for name, state in self._snapshot.files.items():
                if isinstance(state, bytes):
                    (self.staging / name).write_bytes(state)
                else:
                    torch.save(state, self.staging / name)
                fsync_file(self.staging / name)
            if self._snapshot.meta is not None:
                (self.staging / "meta.json").write_text(json.dumps(self._snapshot.meta))
            self._snapshot = Snapshot()  # the copies are on disk: free their memory now
            (self.staging / f"done-{self.rank}").touch()
            if self.rank == 0:
                self._publish()
        except BaseException as error:  # noqa: BLE001 - reported by the caller, training goes on
            self.error = error

    def _publish(self) -> None:
        marks = [self.staging / f"done-{r}" for r in range(self._world)]
        while not all(m.exists() for m in marks):
            if time.monotonic() > self._deadline:
                missing = [r for r, m in enumerate(marks) if not m.exists()]
                raise TimeoutError(
                    f"ranks {missing} did not write their part of checkpoint {self.name} in "
                    "time; LATEST still names the previous checkpoint."
                )
            time.sleep(MARK_POLL)
        for mark in marks:
            mark.unlink()
        publish(self.root, self.staging, self.final, checkpoint.LATEST)
        checkpoint.prune(self.root, self._keep, self.final)
        self.published = True
        self._on_published(self.final)
