"""The debug channels of ranks on other hosts: relayed by their agents.

A ``Run`` gives every rank the one end of a socketpair (``launcher.debug``); for a rank under
an agent, ``RemoteHosts`` keeps that end here. What the run's hub writes into it goes to
the agent of the rank's host as ``{"op": "debug", "rank", "data"}`` (the agent writes it
into the rank's own debug connection); what the agent sends back for the rank is written
into it. One thread reads every rank's end; it ends with the run. Stdlib only.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

SendToAgent = Callable[[int, dict[str, Any]], None]  # (rank, message): to its host's agent


class DebugRelay:
    """The ranks' ends of their debug channels, relayed to and from the agents.

    >>> hub_end, rank_end = socket.socketpair()
    >>> sent = []
    >>> relay = DebugRelay(lambda rank, message: sent.append((rank, message)))
    >>> relay.add(1, rank_end.detach()); relay.start()
    >>> hub_end.sendall(b"frame")
    >>> import time
    >>> while not sent:
    ...     time.sleep(0.01)
    >>> relay.close(); hub_end.close()
    >>> sent
    [(1, {'op': 'debug', 'rank': 1, 'data': b'frame'})]
    """

    def __init__(self, send: SendToAgent) -> None:
        self._send = send
        self._socks: dict[int, socket.socket] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._read, name="nbaccel-debug-relay", daemon=True)
        self._lock = threading.Lock()
        self._closed = False

    def add(self, rank: int, fd: int) -> None:
        """Take ``fd`` (the rank's end of its channel: this relay owns it now)."""
        sock = socket.socket(fileno=fd)
        with self._lock:
            self._socks[rank] = sock
            self._selector.register(sock, selectors.EVENT_READ, rank)

    def start(self) -> None:
        self._thread.start()

    def from_agent(self, rank: int, data: bytes) -> None:
        """The agent's bytes of ``rank``'s channel, for the run's hub."""
        with self._lock:
            sock = self._socks.get(rank)
        if sock is not None:
            try:
                sock.sendall(data)
            except OSError:
                pass  # the run has closed its end: it no longer reads

    def close(self) -> None:
        """The run is over (once; later calls do nothing)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_write, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._selector.close()
        with self._lock:
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _read(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    return
                try:
                    data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:  # the run closed its end
                    with self._lock:
                        self._selector.unregister(key.fileobj)
                    continue
                self._send(key.data, {"op": "debug", "rank": key.data, "data": data})
