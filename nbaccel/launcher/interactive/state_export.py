"""``workers.state_dict()`` on the ranks: the model's whole state dict, unsharded, into the
kernel through one shared-memory segment (the kernel's side is ``after_training.py``).

Every rank walks the model's state dict in the same order. Rank 0 makes the segment, sized
for every entry at its place, and writes the entries it holds whole. A sharded entry (an
FSDP2 ``DTensor``) gets there one of two ways:

- **Each rank writes its own rows.** A tensor sharded by rows over every rank (FSDP2's
  ``Shard(0)`` on a one-dimensional mesh) is, in the segment, the ranks' shards one after
  the other: rank r's rows start after the rows of the ranks before it. Where every rank can
  open rank 0's segment (``/proc/<pid>/fd/<fd>``: the same machine, the same user), each
  copies its shard straight to its place, and no collective moves a weight: the whole dict
  costs about one copy of it, shared between the ranks.
- **Gathered.** Otherwise (ranks on other machines, another placement) the entry is made
  whole with ``full_tensor`` (a collective, one tensor at a time) and rank 0 writes it.

So rank 0 holds at most the segment (one full copy), its own shard and one gathered tensor;
the others their shard and one tensor. The reply is a small pickle whose tensors view the
segment (``sharing.tensors.rebuild_tensor``), so the kernel maps it: no copy, no pickle of
the weights. DeepSpeed gathers through its engine (``Accelerator.get_state_dict``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.launcher.sharing import memfd
from nbaccel.launcher.sharing.packing import Packed
from nbaccel.launcher.sharing.segments import Segment, aligned, writable
from nbaccel.launcher.sharing.tensors import rebuild_tensor


@dataclass
class Prepacked:
    """A reply value already packed, its buffers in ``segment`` (``serve`` sends it as is)."""

    packed: Packed
    segment: Segment | None


@dataclass
class _Layout:
    """Where each entry goes: ``places`` key -> (offset, bytes) of its whole tensor; ``tied``
    key -> the key whose tensor it shares; ``size`` the segment's bytes."""

    places: dict[str, tuple[int, int]]
    tied: dict[str, str]
    size: int


class _Placed:
    """A tensor of the segment, pickled as ``rebuild_tensor`` of the buffer at its place."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = str(dtype).removeprefix("torch."), shape

    def __reduce__(self) -> tuple[Any, ...]:
        # A writable stand-in: the buffer travels out of band (the segment at its offset),
        # and a read-only one would make the kernel copy it.
        return rebuild_tensor, (
            pickle.PickleBuffer(bytearray(1)),
            self.dtype,
            self.shape,
            False,
            False,
        )


def export_state(entries: list[tuple[str, Any]], rank: int) -> Prepacked | None:
    """Every rank: each entry to its place in one new segment; rank 0 returns the reply
    (None on the others). Entries that share a tensor (tied weights, such as a language
    model's embedding and output layer) are written once and arrive as one tensor under both
    keys, as ``state_dict`` has them."""
    layout = _layout(entries)
    # Rank 0's segment carries a random token in its name, for the others to check it.
    token = secrets.token_hex(8) if rank == 0 else ""
    fd = memfd.new_fd(f"nbaccel-state-{token}") if rank == 0 else -1
    try:
        if fd != -1:
            os.ftruncate(fd, layout.size)
        direct = _direct_rows(entries, layout, fd, token, rank)
        if direct is None:
            with _target(fd, layout.size, rank) as target:
                state = _write_entries(entries, layout, target, {}, rank)
        else:
            state = _write_own_rows(entries, layout, direct, rank)
        if fd == -1:
            return None
        memfd.seal(fd)
        data = pickle.dumps(state, protocol=5, buffer_callback=lambda buffer: False)
        refs = tuple((0, *layout.places[key]) for key in state if key in layout.places)
        return Prepacked(Packed(data, refs), Segment(fd, layout.size))
    except BaseException:
        if fd != -1:
            os.close(fd)
        raise


def _layout(entries: list[tuple[str, Any]]) -> _Layout:
    """Each tensor's place (the same on every rank: a DTensor counts its whole size)."""
    places: dict[str, tuple[int, int]] = {}
    first_of: dict[tuple[Any, ...], str] = {}  # a tensor's identity -> its first key
    tied: dict[str, str] = {}
    size = 0
    for key, value in entries:
        if not isinstance(value, torch.Tensor) or not value.numel():
            continue  # empty tensors and extra state: inside the pickle
        identity = _identity(value)
        if identity in first_of:
            tied[key] = first_of[identity]
            continue
        first_of[identity] = key
        nbytes = value.numel() * value.element_size()  # a DTensor's: the whole tensor's
        places[key] = (size, nbytes)
        size += aligned(nbytes)
    return _Layout(places, tied, size)


def _direct_rows(
    entries: list[tuple[str, Any]], layout: _Layout, fd: int, token: str, rank: int
) -> tuple[int, dict[str, int]] | None:
    """Where each rank can write its own rows: (this rank's fd of rank 0's segment, the first
    row of its shard of each row-sharded entry); None where the entries are to be gathered.
    A collective when any entry is row-sharded (decided alike on every rank: the
    placements are the same), and its answer is the same on every rank."""
    sharded = {key: value for key, value in entries if key in layout.places and _row_sharded(value)}
    if not sharded:
        return None
    local = {key: int(value.to_local().shape[0]) for key, value in sharded.items()}
    world = dist.get_world_size()
    named: list[Any] = [(os.getpid(), fd, token) if rank == 0 else None]
    dist.broadcast_object_list(named, src=0)
    pid, segment_fd, token = named[0]
    own = fd if rank == 0 else _open_segment(pid, segment_fd, token)
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, (own != -1, local))
    if not all(opened for opened, _ in rows) or any(
        sum(shard[key] for _, shard in rows) != value.shape[0] for key, value in sharded.items()
    ):
        if rank != 0 and own != -1:
            os.close(own)
        return None
    return own, {key: sum(rows[r][1][key] for r in range(rank)) for key in local}


def _row_sharded(value: Any) -> bool:
    """A DTensor sharded by rows over every rank, in rank order (FSDP2's own layout)."""
    mesh = getattr(value, "device_mesh", None)
    placements: tuple[Any, ...] = getattr(value, "placements", ())
    if mesh is None or len(placements) != 1 or not placements[0].is_shard(0):
        return False
    ranks: list[int] = mesh.mesh.flatten().tolist()
    return mesh.ndim == 1 and ranks == list(range(dist.get_world_size()))


def _open_segment(pid: int, fd: int, token: str) -> int:
    """Rank 0's segment opened for writing, or -1 where it cannot be (another machine: the
    same pid there is some other process, so the name's token is checked first)."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if f"nbaccel-state-{token}" not in os.readlink(path):
            return -1
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return -1


def _write_own_rows(
    entries: list[tuple[str, Any]], layout: _Layout, direct: tuple[int, dict[str, int]], rank: int
) -> dict[str, Any]:
    """Each rank writes its rows of the row-sharded entries, rank 0 the rest; every rank
    has unmapped the segment before rank 0 seals it (a writable mapping would refuse it)."""
    own, starts = direct
    failure: BaseException | None = None
    state: dict[str, Any] = {}
    try:
        with _target(own, layout.size, rank) as target:
            dist.barrier()  # rank 0 has prepared the huge pages before anyone writes
            state = _write_entries(entries, layout, target, starts, rank)
    except Exception as error:  # noqa: BLE001 - said to every rank below, not left to hang
        failure = error
    finally:
        if rank != 0:
            os.close(own)
    done: list[Any] = [None] * dist.get_world_size()
    said = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.all_gather_object(done, said)
    if failure is not None:
        raise failure
    failed = [(r, why) for r, why in enumerate(done) if why is not None]
    if failed:
        r, why = failed[0]
        raise RuntimeError(f"rank {r} could not write its rows of the state dict: {why}")
    return state


def _write_entries(
    entries: list[tuple[str, Any]],
    layout: _Layout,
    target: memoryview | None,
    starts: dict[str, int],
    rank: int,
) -> dict[str, Any]:
    """Each entry (every rank, in order): its own rows where ``starts`` has it, else gathered
    and written by rank 0; the state to pickle (rank 0's), in the entries' order."""
    state: dict[str, Any] = {}
    for key, value in entries:
        if key in layout.tied:
            if rank == 0:
                state[key] = state[layout.tied[key]]  # the same object: one tensor in the kernel
            continue
        if key in starts:
            assert target is not None
            offset, nbytes = layout.places[key]
            rows = value.to_local().detach().to("cpu").contiguous()
            start = offset + starts[key] * (nbytes // value.shape[0])
            _copy(target, start, rows)
            if rank == 0:
                state[key] = _Placed(value.dtype, tuple(value.shape))
            del rows
            continue
        whole = _gathered(value)
        if rank != 0:
            continue
        if key not in layout.places:
            state[key] = whole.detach().cpu() if isinstance(whole, torch.Tensor) else whole
            continue
        assert target is not None
        host = whole.detach().to("cpu").contiguous()
        _copy(target, layout.places[key][0], host)
        state[key] = _Placed(host.dtype, tuple(host.shape))
        del whole, host  # one gathered tensor at a time
    return state


def _copy(target: memoryview, offset: int, tensor: torch.Tensor) -> None:
    if tensor.numel():
        data = tensor.view(-1).view(torch.uint8).numpy().data
        target[offset : offset + data.nbytes] = data


@contextlib.contextmanager
def _target(fd: int, size: int, rank: int) -> Iterator[memoryview | None]:
    """The segment mapped for writing where this rank has it (``fd`` set; rank 0 prepares
    its pages), else None."""
    if fd == -1 or size == 0:
        yield memoryview(bytearray()) if fd != -1 else None
        return
    with writable(fd, size, prepare=rank == 0) as target:
        yield target


def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What two state-dict entries that are one tensor share: their storage, place, shape
    and dtype (a DTensor's local shard's)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return (
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(tensor.shape),
        tuple(local.stride()),
        tensor.dtype,
    )


def _gathered(value: Any) -> Any:
    """A sharded tensor made whole (a collective: every rank calls it, in the same order)."""
    full_tensor = getattr(value, "full_tensor", None)  # torch.distributed.tensor.DTensor
    return full_tensor() if callable(full_tensor) else value
