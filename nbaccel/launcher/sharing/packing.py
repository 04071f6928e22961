"""What travels: a small pickle and where its large buffers lie in shared memory.

``split`` pickles with protocol 5 and a buffer callback: every buffer of at least
``MIN_OUT_OF_BAND`` bytes (numpy arrays, pandas' blocks, Arrow buffers, CPU tensors
through ``bootstrap.pickling``) is kept out of the pickle. The sender puts those
buffers into segments (``segments.Segment``; in the kernel through ``cache``, so that data
that did not change is not written again) and sends ``Packed``: the pickle and, for each
buffer, which segment of the message holds it and where. The receiver maps each segment
once, copy-on-write, and unpickles with the mapped views as the buffers (``unpack``): an
array arrives as a view of the shared pages, not a copy. A value whose pickling exposes no
buffer travels inside the pickle, exactly as before. So do ``bytes`` and ``bytearray``:
Python's pickler writes them without asking any hook, and each owns its memory, so a rank
would hold a copy anyway (``numpy.frombuffer(data, "u1")`` shares them).

>>> import numpy
>>> packed, segment = pack_fresh(numpy.ones(1 << 18, "f4"), dumps_plain)
>>> len(packed.data) < 200, packed.refs
(True, ((0, 0, 1048576),))
>>> value = unpack(packed, [segment.fd])
>>> segment.close()
>>> float(value.sum()), value.flags.writeable, value.flags.owndata
(262144.0, True, False)
"""

from __future__ import annotations

import os
import pickle
import pickletools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbaccel.launcher.sharing.segments import Segment, aligned, buffer_address, map_private

# Buffers smaller than this travel inside the pickle: a copy of them costs less than a
# mapping (and a small array is often pickled again with changes).
MIN_OUT_OF_BAND = 1 << 20

# How a pickler is called: the object, and the buffer callback (None: every buffer inside).
Dumps = Callable[[Any, "Callable[[pickle.PickleBuffer], bool] | None"], bytes]
# (segment index among the message's segments, offset in it, length): one per buffer, in
# the order the pickle asks for them.
BufferRef = tuple[int, int, int]


@dataclass(frozen=True)
class Packed:
    """A protocol-5 pickle and where each of its out-of-band buffers lies (``refs``, in the
    order the pickle asks for them); without refs everything is inside ``data``."""

    data: bytes
    refs: tuple[BufferRef, ...] = ()

    @property
    def segments(self) -> int:
        """How many segments (fds) must travel with it."""
        return 1 + max((ref[0] for ref in self.refs), default=-1)


def dumps_plain(obj: Any, buffer_callback: Callable[[pickle.PickleBuffer], bool] | None) -> bytes:
    """``pickle.dumps`` with protocol 5, as a ``Dumps`` (for plain data)."""
    return pickle.dumps(obj, protocol=5, buffer_callback=buffer_callback)


@dataclass(frozen=True)
class Split:
    """A pickle, the distinct buffers it kept out (contiguous byte views), and for each
    buffer the pickle asks for, in order, which of them it is (a tensor pickled twice is
    one buffer asked for twice)."""

    data: bytes
    buffers: list[memoryview]
    asked: list[int]

    def refs(self, placed: Sequence[BufferRef]) -> tuple[BufferRef, ...]:
        """The refs of every buffer asked for, from where each distinct one was placed."""
        return tuple(placed[index] for index in self.asked)


def split(obj: Any, dumps: Dumps) -> Split:
    """``obj`` pickled, keeping out every buffer of at least ``MIN_OUT_OF_BAND`` bytes."""
    kept: list[memoryview] = []
    asked: list[int] = []
    seen: dict[tuple[int, int], int] = {}

    def keep_out(buffer: pickle.PickleBuffer) -> bool:
        try:
            raw = buffer.raw()  # a contiguous view, or BufferError
        except BufferError:
            return True  # not contiguous: inside the pickle (numpy copies such arrays too)
        if raw.nbytes < MIN_OUT_OF_BAND:
            return True
        key = (buffer_address(raw), raw.nbytes)
        if key not in seen:
            seen[key] = len(kept)
            kept.append(raw)
        asked.append(seen[key])
        return False

    data = dumps(obj, keep_out)
    return Split(data, kept, asked)


def pack_fresh(obj: Any, dumps: Dumps, into: int | None = None) -> tuple[Packed, Segment | None]:
    """``obj`` packed with its large buffers in one new segment (``into``: an empty memfd
    to use, such as a rank's result box), or everything inside the pickle when no buffer is
    large or the memory cannot be had. The caller sends the segment's fd with the message,
    then closes it."""
    kept = split(obj, dumps)
    if not kept.buffers:
        return Packed(kept.data), None
    try:
        segment, offsets = Segment.write(kept.buffers, into=into)
    except OSError:
        return Packed(dumps(obj, None)), None
    placed = [(0, offset, b.nbytes) for offset, b in zip(offsets, kept.buffers, strict=True)]
    return Packed(kept.data, kept.refs(placed)), segment


def unpack(packed: Packed, fds: Sequence[int], loads: Callable[..., Any] = pickle.loads) -> Any:
    """The object ``packed`` holds, its buffers mapped from the segments ``fds`` (in the
    order of ``packed.refs``' indices). The fds stay the caller's (closing them keeps the
    mapped data)."""
    if not packed.refs:
        return loads(packed.data)
    if len(fds) < packed.segments:
        raise ValueError(
            f"a message needs {packed.segments} shared-memory segments and came with "
            f"{len(fds)} (this is a bug in nbaccel)"
        )
    return unpack_mapped(packed, [map_private(fds[index]) for index in range(packed.segments)])


def unpack_mapped(
    packed: Packed, maps: Sequence[memoryview], loads: Callable[..., Any] = pickle.loads
) -> Any:
    """``unpack`` from segments already mapped (``segments.map_private``)."""
    if not packed.refs:
        return loads(packed.data)
    buffers = [maps[index][offset : offset + length] for index, offset, length in packed.refs]
    return loads(packed.data, buffers=buffers)


def gather(refs: Sequence[BufferRef], fds: Sequence[int]) -> tuple[tuple[BufferRef, ...], bytes]:
    """The bytes of the buffers ``refs`` name, read out of their segments ``fds`` into one
    segment's bytes (each buffer at a page boundary, as ``segments`` lays them out), and
    the refs into it: what crosses to another machine. The segments may hold other
    launches' buffers too (the kernel's cache writes several into one), which stay here.

    >>> import numpy
    >>> packed, segment = pack_fresh([numpy.ones(1 << 18, "f4"), numpy.zeros(1 << 18)], dumps_plain)
    >>> refs, data = gather(packed.refs[1:], [segment.fd])  # only the second buffer
    >>> segment.close()
    >>> refs, len(data) == 8 << 18
    (((0, 0, 2097152),), True)
    """
    places: dict[tuple[int, int, int], int] = {}
    size = 0
    for ref in refs:
        if ref not in places:
            places[ref] = size
            size += aligned(ref[2])
    data = bytearray(size)
    for (index, offset, length), start in places.items():
        view = memoryview(data)[start : start + length]
        done = 0
        while done < length:
            read = os.preadv(fds[index], [view[done:]], offset + done)
            if read == 0:
                raise OSError(f"a shared-memory segment ended early ({offset + done} bytes)")
            done += read
    return tuple((0, places[ref], ref[2]) for ref in refs), bytes(data)


def close_fds(fds: Iterable[int] | Mapping[Any, int]) -> None:
    """Close segment fds (their mappings stay); of a mapping, its values."""
    for fd in fds.values() if isinstance(fds, Mapping) else fds:
        try:
            os.close(fd)
        except OSError:
            pass


def shared_fds(data: int, box: bool) -> dict[str, Any]:
    """What a spawn request says of the fds it carries last: ``data`` segments of the
    payload's buffers, then a rank's result box (an empty memfd the rank writes its value's
    buffers into, which the kernel reads back) when ``box``."""
    return {"shared": {"data": data, "box": box}}


def take_shared(
    fds: Sequence[int], request: dict[str, Any]
) -> tuple[list[int], list[int], int | None]:
    """A spawn's fds split as ``shared_fds`` described them: (the spawn's own fds, the data
    segments' fds, the result box's fd or None).

    >>> take_shared([3, 4, 5, 6, 7], shared_fds(data=2, box=True))
    ([3, 4], [5, 6], 7)
    >>> take_shared([3, 4], {})
    ([3, 4], [], None)
    """
    shared = request.get("shared") or {}
    data, box = int(shared.get("data", 0)), bool(shared.get("box", False))
    own = len(fds) - data - int(box)
    return list(fds[:own]), list(fds[own : own + data]), fds[-1] if box else None


def inline_chunks(packed: Packed, maps: Sequence[memoryview]) -> Iterator[bytes | memoryview]:
    """``packed`` as one plain pickle that any ``pickle.load`` reads (no buffers needed), in
    pieces to write out: each out-of-band buffer put back in place (``BYTEARRAY8``, or
    ``BINBYTES8`` where it was read-only) and the frames dropped (optional in protocol 5,
    and their lengths would no longer hold). The value is never unpickled here, so nothing
    it names is imported (a kernel stays free of torch).

    >>> import numpy
    >>> value = {"a": numpy.arange(1 << 18, dtype="f4"), "b": 1}
    >>> packed, segment = pack_fresh(value, dumps_plain)
    >>> again = pickle.loads(b"".join(inline_chunks(packed, [map_private(segment.fd)])))
    >>> segment.close()
    >>> float(again["a"].sum()) == float(value["a"].sum()), again["b"]
    (True, 1)
    """
    if not packed.refs:
        yield packed.data
        return
    ops = [(op.name, position or 0) for op, _, position in pickletools.genops(packed.data)]
    refs = iter(packed.refs)
    start = 0  # where the bytes not yet yielded begin
    for index, (op, position) in enumerate(ops):
        end = ops[index + 1][1] if index + 1 < len(ops) else len(packed.data)
        if op in ("FRAME", "NEXT_BUFFER", "READONLY_BUFFER"):
            yield packed.data[start:position]
            start = end
        if op == "NEXT_BUFFER":
            segment, offset, length = next(refs)
            read_only = index + 1 < len(ops) and ops[index + 1][0] == "READONLY_BUFFER"
            code = pickle.BINBYTES8 if read_only else pickle.BYTEARRAY8
            yield code + length.to_bytes(8, "little")
            yield maps[segment][offset : offset + length]
    yield packed.data[start:]
