"""Frames on the private socket between the kernel and an interactive worker. Stdlib only.

A stream socket carries values of any size (a seqpacket message is capped), so each frame is
an 8-byte length and that many bytes. A frame is always read and written whole by a thread
that no signal interrupts, or the stream would lose its place (``workers.py``, ``serve.py``).
"""

from __future__ import annotations

import socket
import struct

_LENGTH = struct.Struct("!Q")
ADDRESS_PREFIX = "\0nbaccel-workers-"  # abstract: no file to leave behind, checked by uid
# The line a rank prints after each command's output (``serve``); the kernel's relay
# swallows it and so knows that the command's output has all been shown.
DONE_MARK = "\x1b[nbaccel-done "


def send_frame(sock: socket.socket, data: bytes) -> None:
    """Send one frame (blocking)."""
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> bytes | None:
    """Read one whole frame; None when the other side closed (between frames or inside one).

    >>> a, b = socket.socketpair()
    >>> send_frame(a, b"hello"); a.close()
    >>> recv_frame(b), recv_frame(b)
    (b'hello', None)
    """
    head = _read_exactly(sock, _LENGTH.size)
    if head is None:
        return None
    return _read_exactly(sock, _LENGTH.unpack(head)[0])


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve_on_rank(address: str, token: str) -> None:
    """What an interactive launch runs on each rank (``serve.serve``, which imports torch):
    named here, in a module the torch-free kernel can import, so it travels by reference."""
    from nbaccel.launcher.interactive.serve import serve

    serve(address, token)
