"""The nbaccel agent on one host of a several-machine launch (``-m nbaccel.launcher.agent_main``).

The kernel starts one per host over SSH (or ``srun``) and talks to it through the
command's stdin and stdout only: nothing of nbaccel listens on the network, and only what
the kernel's channel says is obeyed. Frames both ways are ``events.encode_frame`` dicts.

Kernel -> agent: ``start`` (the launch: payload, this host's share, the rendezvous), then
``signal`` (to some or all ranks). End of stdin means stop: every worker of this host is
killed and the agent leaves, so a kernel that dies, or an SSH connection that drops, takes
every host's processes down.

Agent -> kernel: ``agent`` (ready: pid, versions), ``endpoint`` (node 0: the rendezvous port
it picked), ``log``/``events`` (a rank's raw bytes, forwarded in order), ``exited`` (a rank's
exit code, after its last bytes), ``done`` (the agent leaves) and ``failed`` (the agent
itself broke: its traceback).

The workers are torch elastic's (``LocalElasticAgent`` via ``elastic_launch``, c10d
rendezvous, fork start method): nbaccel adds no rendezvous of its own. A worker reaches the
agent through a Unix socket in the abstract namespace with a random name, checked with
``SO_PEERCRED`` (``agent_worker.py``). The protocol goes out on a private copy of fd 1;
fd 1 itself then points at fd 2, so a stray print of any library cannot break a frame.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Any, BinaryIO

from nbaccel.events import FrameDecoder, encode_frame
from nbaccel.launcher import control

READ_SIZE = 1 << 16
HEADER = struct.Struct("<I")  # events.encode_frame's length prefix
MAX_HELLO = 1 << 12
DRAIN_TIMEOUT = 5.0  # after elastic returns, how long a worker's last bytes may take


class Channel:
    """The agent's half of the kernel's channel: frames out on a private fd, in from stdin."""

    def __init__(self) -> None:
        self._out: BinaryIO = os.fdopen(os.dup(1), "wb", buffering=0)
        os.set_inheritable(self._out.fileno(), False)
        os.dup2(2, 1)  # anything printed to stdout from now on goes to stderr
        self._lock = threading.Lock()
        self._decoder = FrameDecoder()
        self._pending: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            try:
                self._out.write(encode_frame(message))
            except OSError:
                _kill_everything_and_leave()  # the kernel's end is gone

    def receive(self) -> dict[str, Any] | None:
        """The next frame from the kernel, or None at end of input."""
        while not self._pending:
            data = os.read(0, READ_SIZE)
            if not data:
                return None
            self._pending += self._decoder.feed(data)
        return self._pending.pop(0)


class WorkerLinks:
    """The private socket the workers connect to, and what each rank's connections carry."""

    def __init__(self, channel: Channel) -> None:
        self.address = f"\0nbaccel-agent-{secrets.token_hex(8)}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.address)
        self._server.listen(64)
        self._channel = channel
        self._lock = threading.Lock()
        self.pids: dict[int, int] = {}  # rank -> worker pid
        self._forwarders: dict[int, list[threading.Thread]] = {}
        threading.Thread(target=self._accept, name="nbaccel-agent-accept", daemon=True).start()

    def signal(self, signum: int, ranks: list[int] | None) -> None:
        with self._lock:
            targets = [pid for rank, pid in self.pids.items() if ranks is None or rank in ranks]
        for pid in targets:
            _signal_group(pid, signum)

    def ranks(self) -> list[int]:
        with self._lock:
            return list(self.pids)

    def kill_all(self) -> None:
        self.signal(signal.SIGKILL, None)

    def wait_forwarded(self, rank: int, timeout: float) -> None:
        """Wait until every byte a rank's worker wrote is forwarded (its sockets hit EOF)."""
        with self._lock:
            threads = list(self._forwarders.get(rank, ()))
        for thread in threads:
            thread.join(timeout)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            if not control.same_user(conn):
                conn.close()
                continue
            threading.Thread(target=self._forward, args=(conn,), daemon=True).start()

    def _forward(self, conn: socket.socket) -> None:
        with conn:
            hello, leftover = _read_hello(conn)
            if hello is None:
                return
            rank, op = int(hello["rank"]), "log" if hello["channel"] == "log" else "events"
            with self._lock:
                self.pids[rank] = int(hello["pid"])
                self._forwarders.setdefault(rank, []).append(threading.current_thread())
            if leftover:
                self._channel.send({"op": op, "rank": rank, "data": leftover})
            while data := conn.recv(READ_SIZE):
                self._channel.send({"op": op, "rank": rank, "data": data})


def _read_hello(conn: socket.socket) -> tuple[dict[str, Any] | None, bytes]:
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


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


_links: WorkerLinks | None = None


def _kill_everything_and_leave() -> None:
    if _links is not None:
        _links.kill_all()
    os._exit(1)


def _follow_kernel(channel: Channel, links: WorkerLinks) -> None:
    """Obey ``signal`` frames; at end of input (the kernel or its connection is gone), stop."""
    while (message := channel.receive()) is not None:
        if message.get("op") == "signal":
            links.signal(int(message["signal"]), message.get("ranks"))
    _kill_everything_and_leave()


def main() -> int:
    global _links
    channel = Channel()
    try:
        from nbaccel.launcher.agent_run import pick_port, run_host, versions

        channel.send({"op": "agent", "pid": os.getpid(), **versions()})
        start = channel.receive()
        if start is None:
            return 0
        links = _links = WorkerLinks(channel)
        if start["endpoint_port"] is None:  # node 0 hosts the rendezvous: pick its port
            start["endpoint_port"] = pick_port(start["local_addr"])
            channel.send({"op": "endpoint", "port": start["endpoint_port"]})
        threading.Thread(
            target=_follow_kernel, args=(channel, links), name="nbaccel-agent-in", daemon=True
        ).start()
        succeeded, known = run_host(start, links.address)
        # Workers elastic stopped after another failed are not in its failures.
        stopped = 0 if succeeded else -int(signal.SIGTERM)
        for rank in sorted(set(links.ranks()) | set(known)):
            links.wait_forwarded(rank, DRAIN_TIMEOUT)
            channel.send({"op": "exited", "rank": rank, "status": known.get(rank, stopped)})
        channel.send({"op": "done"})
        return 0
    except BaseException:  # noqa: BLE001 - the kernel raises it, naming this host
        channel.send({"op": "failed", "error": traceback.format_exc()})
        if _links is not None:
            _links.kill_all()
        return 1


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())
