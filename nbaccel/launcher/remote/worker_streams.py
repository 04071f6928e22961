"""How an agent reads its workers' connections (``agent_main.WorkerLinks``): each opens with
one hello frame (who it is: rank, channel, pid, attempt), then carries the rank's bytes.
Output may be cut anywhere; events and debug frames go on whole only, so that a worker killed
mid-frame leaves nothing half-written for the next attempt's worker of that rank.

>>> from nbaccel.frames import encode_frame
>>> whole, rest = whole_frames(encode_frame({"a": 1}) + b"cut")
>>> len(rest)
3
"""

from __future__ import annotations

import pickle
import socket
from typing import Any

from nbaccel.frames import FRAME_HEADER as HEADER

READ_SIZE = 1 << 16
MAX_HELLO = 1 << 12


def read_hello(conn: socket.socket) -> tuple[dict[str, Any] | None, bytes]:
    """The connection's first frame (who it is), and the raw bytes that came after it."""
    data = b""
    while True:
        if len(data) >= HEADER.size:
            (length,) = HEADER.unpack_from(data)
            if length > MAX_HELLO:
                return None, b""
            if len(data) >= HEADER.size + length:
                end = HEADER.size + length
                return pickle.loads(data[HEADER.size : end]), data[end:]
        chunk = conn.recv(READ_SIZE)
        if not chunk:
            return None, b""
        data += chunk


def whole_frames(data: bytes) -> tuple[bytes, bytes]:
    """``data`` split after its last whole event frame: (whole frames, the rest)."""
    end = 0
    while len(data) - end >= HEADER.size:
        (length,) = HEADER.unpack_from(data, end)
        if len(data) - end - HEADER.size < length:
            break
        end += HEADER.size + length
    return data[:end], data[end:]


def everything(data: bytes) -> tuple[bytes, bytes]:
    return data, b""  # output: any byte boundary will do
