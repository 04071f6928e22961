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


# Where interactive workers (and a keep_workers launch's ranks) connect back to the kernel:
# an abstract Unix socket, no file to leave behind, checked by uid.
ADDRESS_PREFIX = "\0nbaccel-workers-"


def listen(facing: str | None, token: str) -> tuple[socket.socket, str]:
    """The kernel's end for workers to connect to, listening, and its address: an abstract
    Unix socket here (``facing`` None); on several machines, TCP on this machine's address
    facing the host ``facing`` (a port of the system's choosing)."""
    if facing is None:
        address = ADDRESS_PREFIX + token[:32]
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
    else:
        host = address_facing(facing)
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.bind((host, 0))
        port = listener.getsockname()[1]
        address = f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}"
    listener.listen()
    return listener, address


def address_facing(host: str) -> str:
    """This machine's address on the route to ``host`` (where its workers reach the kernel).

    >>> address_facing("127.0.0.1")
    '127.0.0.1'
    """
    family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)  # a datagram socket sends nothing: this only picks the route
        address: str = probe.getsockname()[0]
    return address
