"""Where interactive workers connect, and how the kernel takes each rank's connection.

``listen`` opens the kernel's end before the workers start: an abstract Unix socket on one
machine, TCP on the kernel's address facing the hosts on several (``hosts=``).
``accept_ranks`` takes one connection per rank, each checked (``wire``'s handshake on the
launch's secret; this user's, on a Unix socket) before anything from it is unpickled.
"""

from __future__ import annotations

import pickle
import socket
import time
from typing import Any

from nbaccel import unpickling
from nbaccel.errors import WorkersEnded
from nbaccel.launcher.control import same_user
from nbaccel.launcher.interactive.wire import kernel_handshake, recv_frame
from nbaccel.launcher.run import Run

START_TIMEOUT = 300.0  # a cold start imports torch and may load CUDA: minutes on a slow disk


def accept_ranks(
    listener: socket.socket, run: Run, token: str
) -> tuple[dict[int, socket.socket], dict[int, int]]:
    """Each rank's connection, checked (the launch's secret, this user on a Unix socket),
    by rank. A peer that fails the check is closed, and the wait goes on."""
    conns: dict[int, socket.socket] = {}
    pids: dict[int, int] = {}
    deadline = time.monotonic() + START_TIMEOUT
    listener.settimeout(0.25)
    try:
        while len(conns) < run.world_size:
            if run.processes_ended:
                run.result()  # raises the run's error (a rank that failed to start)
                raise WorkersEnded("the workers ended before they all connected.")
            if time.monotonic() > deadline:
                raise WorkersEnded(
                    f"only {len(conns)} of {run.world_size} workers connected within "
                    f"{START_TIMEOUT:g} s; see their logs in {run.run_dir}."
                )
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            hello = _greet(conn, token)
            if hello is None:
                conn.close()  # not one of ours: another user, or a stranger
                continue
            conn.settimeout(None)
            conns[hello["rank"]] = conn
            pids[hello["rank"]] = hello["pid"]
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise
    return conns, pids


def _greet(conn: socket.socket, token: str) -> dict[str, Any] | None:
    """A worker's hello once it proved it knows ``token``; None for any other peer."""
    conn.settimeout(10)
    try:
        if conn.family == socket.AF_UNIX and not same_user(conn):
            return None
        if not kernel_handshake(conn, token):
            return None
        hello = recv_frame(conn)
        message = unpickling.loads(hello) if hello is not None else None
    except (OSError, pickle.UnpicklingError):
        return None
    return message if isinstance(message, dict) else None
