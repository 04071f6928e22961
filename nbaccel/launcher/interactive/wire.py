"""The connection between the kernel and an interactive worker: frames and a handshake.

A stream socket carries values of any size (a seqpacket message is capped), so each frame is
an 8-byte length and that many bytes. A frame is always read and written whole by a thread
that no signal interrupts, or the stream would lose its place (``workers.py``, ``serve.py``).

On one machine the connection is an abstract Unix socket whose peer must be this user
(``control.same_user``); on several (``hosts=``) it is TCP to the kernel's address facing
the hosts. On a Unix socket a frame may carry fds (the shared-memory segments of a value's
large buffers: ``sharing``), sent with its header's first bytes. Either way, before
anything is unpickled on either side, each side proves that it knows the launch's secret
(sent to the workers inside the payload, over SSH): an HMAC of the other side's fresh
nonce. Stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
from collections.abc import Sequence

_LENGTH = struct.Struct("!Q")
_MAX_FDS = 64  # segments a frame may carry: a value's buffers go into one
# The mark (``output.mark_line``) a rank puts in its output after each command's (``serve``):
# the kernel's relay then knows that the command's output has all been shown.
_DONE = "done "


def done_mark(seq: int) -> str:
    """The text of the mark that ends command ``seq``'s output.

    >>> done_mark(7), done_seq(done_mark(7)), done_seq("other")
    ('done 7', 7, None)
    """
    return f"{_DONE}{seq}"


def done_seq(mark: str) -> int | None:
    """The command whose output a mark ends; None for another mark."""
    number = mark.removeprefix(_DONE)
    return int(number) if mark.startswith(_DONE) and number.isdigit() else None


def send_frame(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """Send one frame (blocking); ``fds`` (shared-memory segments) go with its first bytes,
    on a Unix socket only."""
    head = _LENGTH.pack(len(data))
    if fds:
        sent = socket.send_fds(sock, [head], list(fds))
        sock.sendall(head[sent:] + data)
    else:
        sock.sendall(head + data)


def recv_frame(sock: socket.socket) -> bytes | None:
    """Read one whole frame; None when the other side closed (between frames or inside one).

    >>> a, b = socket.socketpair()
    >>> send_frame(a, b"hello"); a.close()
    >>> recv_frame(b), recv_frame(b)
    (b'hello', None)
    """
    frame, fds = recv_frame_fds(sock)
    for fd in fds:  # a caller that reads no fds takes none
        os.close(fd)
    return frame


def recv_frame_fds(sock: socket.socket) -> tuple[bytes | None, list[int]]:
    """Read one whole frame and the fds sent with it (the caller closes them).

    >>> a, b = socket.socketpair(socket.AF_UNIX)
    >>> r, w = os.pipe()
    >>> send_frame(a, b"with a pipe", [w]); os.close(w)
    >>> frame, fds = recv_frame_fds(b)
    >>> os.write(fds[0], b"!"), os.read(r, 1), frame
    (1, b'!', b'with a pipe')
    """
    fds: list[int] = []
    head = b""
    while len(head) < _LENGTH.size:  # the fds come with the header's first bytes
        if sock.family == socket.AF_UNIX:
            chunk, more, _flags, _addr = socket.recv_fds(sock, _LENGTH.size - len(head), _MAX_FDS)
            fds += more
        else:
            chunk = sock.recv(_LENGTH.size - len(head))
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        head += chunk
    frame = _read_exactly(sock, _LENGTH.unpack(head)[0])
    if frame is None:
        for fd in fds:
            os.close(fd)
        return None, []
    return frame, fds


def connect(address: str) -> socket.socket:
    """A connection to the kernel at ``address``: ``tcp:HOST:PORT`` or an abstract name."""
    if address.startswith("tcp:"):
        host, port = address[4:].rsplit(":", 1)
        return socket.create_connection((host.strip("[]"), int(port)), timeout=60)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return sock


def _mac(token: str, side: bytes, nonce: bytes) -> bytes:
    return hmac.new(bytes.fromhex(token), side + nonce, hashlib.sha256).digest()


def kernel_handshake(sock: socket.socket, token: str) -> bool:
    """The kernel's side: whether the peer knows ``token`` (it then knows the kernel does).

    >>> kernel, worker = socket.socketpair()
    >>> import threading
    >>> said = {}  # each side's answer, printed once both are in (the threads race to print)
    >>> t = threading.Thread(target=lambda: said.update(worker=worker_handshake(worker, "ab")))
    >>> t.start(); said["kernel"] = kernel_handshake(kernel, "ab"); t.join()
    >>> said["kernel"], said["worker"]
    (True, True)
    """
    nonce = secrets.token_bytes(32)
    send_frame(sock, nonce)
    answer = recv_frame(sock)
    if answer is None or len(answer) != 64:
        return False
    if not hmac.compare_digest(answer[:32], _mac(token, b"worker", nonce)):
        return False
    send_frame(sock, _mac(token, b"kernel", answer[32:]))
    return True


def worker_handshake(sock: socket.socket, token: str) -> bool:
    """The worker's side: whether the peer is the kernel that holds ``token``."""
    challenge = recv_frame(sock)
    if challenge is None or len(challenge) != 32:
        return False
    nonce = secrets.token_bytes(32)
    send_frame(sock, _mac(token, b"worker", challenge) + nonce)
    answer = recv_frame(sock)
    return answer is not None and hmac.compare_digest(answer, _mac(token, b"kernel", nonce))


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
