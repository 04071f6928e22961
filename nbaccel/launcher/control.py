"""Messages between the parent and the helper process, with file descriptors attached.

A ``SOCK_SEQPACKET`` socketpair keeps message boundaries, and ``SCM_RIGHTS`` carries the
pipes and the pre-bound port of each worker. The pair is private to the two processes:
no path or port that another user could connect to. Stdlib only (the helper runs it too).
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
from collections.abc import Callable
from typing import Any

MAX_MESSAGE = 1 << 20
MAX_FDS = 64  # a torch_xla supervisor gets two pipes per rank (TPU v3-8: 17 fds)


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """Return (parent end, helper end); both close on exec unless passed on purpose."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(
    sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()
) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_MESSAGE:
        raise ValueError(
            f"control message of {len(data)} bytes exceeds {MAX_MESSAGE}; the environment "
            "passed to workers is unusually large"
        )
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def receive(
    sock: socket.socket, loads: Callable[[bytes], Any] = pickle.loads
) -> tuple[dict[str, Any] | None, list[int]]:
    """Next message and its fds; (None, []) when the other side has closed. The kernel reads
    with ``loads=unpickling.loads`` (it never imports what a message names)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    if not data:
        for fd in fds:
            _close_quietly(fd)
        return None, []
    message: dict[str, Any] = loads(data)
    return message, fds


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def same_user(conn: socket.socket) -> bool:
    """Whether the peer of a Unix socket runs as this user. An abstract socket has no file
    permissions and its name is listed in /proc/net/unix for every local user, so anyone
    could connect: what it serves (a rank's payload, a detached run's events) goes only to
    this user's processes."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    uid: int = struct.unpack("3i", creds)[1]
    return uid == os.getuid()
