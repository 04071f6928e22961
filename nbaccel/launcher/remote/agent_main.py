"""The nbaccel agent on one host of a several-machine launch
(``-m nbaccel.launcher.remote.agent_main``).

The kernel starts one per host over SSH (or ``srun``) and talks to it through the
command's stdin and stdout only: nothing of nbaccel listens on the network, and only what
the kernel's channel says is obeyed. Frames both ways are ``frames.encode_frame`` dicts.

An agent serves one launch after another (the kernel keeps it between launches, as it keeps
its local helper: ``agent_link.AgentPool``), so torch is imported and the SSH connection
made once. Each launch gets the agent's own environment and folder back before its ``env``
and ``cwd`` apply, and a fresh socket for its workers.

Kernel -> agent: ``start`` (a launch: payload, this host's share, the rendezvous), then
``signal`` (to some or all ranks of the launch in progress) and ``debug`` (bytes for a
rank's debug channel: ``launcher.debug``). End of stdin means stop: every worker of this
host is killed and the agent leaves, so a kernel that dies, or an SSH connection that
drops, takes every host's processes down, idle agents included.

Agent -> kernel: ``agent`` (ready: pid, versions; once), ``endpoint`` (node 0: the
rendezvous port it picked), ``worker`` (a worker of some attempt said hello: rank, pid,
attempt; before any of its bytes), ``log``/``events``/``debug`` (a rank's raw bytes,
forwarded in order; events and debug frames whole only, so a worker killed mid-frame leaves
nothing half-written for the next attempt's worker of that rank), ``ended`` (one worker
process ended: rank, attempt, exit status, after its last bytes), ``exited`` (a rank's final
exit code, once elastic is done), ``done`` (the launch is over; ``stays``: whether the agent
waits for the next) and ``failed`` (the agent itself broke: its traceback; it leaves).

With ``max_restarts`` (elastic restarts every worker after a failure), any ``signal`` from
the kernel means the run is ending: later workers leave at once (the stop pipe), and a
SIGKILL ends this host outright (the agent leaves too), since elastic would otherwise
restart what it killed.

The workers are torch elastic's (``LocalElasticAgent`` via ``elastic_launch``, static or c10d
rendezvous, fork start method): nbaccel adds no rendezvous of its own. A worker reaches the
agent through a Unix socket in the abstract namespace with a random name, checked with
``SO_PEERCRED`` (``agent_worker.py``). The protocol goes out on a private copy of fd 1;
fd 1 itself then points at fd 2, so a stray print of any library cannot break a frame.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

from nbaccel.events import SAVE_AND_STOP_SIGNALS, STACK_DUMP_SIGNAL
from nbaccel.frames import FrameDecoder, encode_frame
from nbaccel.launcher import control
from nbaccel.launcher.remote.worker_streams import READ_SIZE, everything, read_hello, whole_frames

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

    def __init__(self, channel: Channel, max_restarts: int) -> None:
        self.address = f"\0nbaccel-agent-{secrets.token_hex(8)}"
        self.max_restarts = max_restarts
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.address)
        self._server.listen(64)
        self._channel = channel
        # Reentrant: a send that finds the kernel gone kills the workers, under this lock.
        self._lock = threading.RLock()
        self.pids: dict[int, int] = {}  # rank -> its latest worker's pid
        self._forwarders: dict[int, list[threading.Thread]] = {}
        self._by_pid: dict[int, list[threading.Thread]] = {}  # one worker's forwarders
        self._watchers: list[threading.Thread] = []  # each worker's "ended" reporter
        self._debug: dict[int, socket.socket] = {}  # rank -> its latest worker's debug channel
        # The stop pipe: once written, every worker elastic starts leaves at once.
        self.stop_read, self._stop_write = os.pipe()
        self._stopping = False
        self._finished = False  # the final messages went out (by elastic's end or a kill)
        threading.Thread(target=self._accept, name="nbaccel-agent-accept", daemon=True).start()

    def stop_restarts(self) -> None:
        """The kernel ends the run: no worker elastic restarts from now on runs anything."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                os.write(self._stop_write, b"\0")

    def finish(self, statuses: dict[int, int], otherwise: int, *, stays: bool = True) -> bool:
        """Report every rank's exit (its status in ``statuses``, else ``otherwise``) and
        ``done``, once: False when that was already done (elastic's end and a kill cross).
        ``stays``: whether this agent then waits for the kernel's next launch."""
        with self._lock:
            if self._finished:
                return False
            self._finished = True
        for rank in sorted(set(self.ranks()) | set(statuses)):
            self.wait_forwarded(rank, DRAIN_TIMEOUT)
            status = statuses.get(rank, otherwise)
            self._channel.send({"op": "exited", "rank": rank, "status": status})
        # "done" is this launch's last word: a worker's "ended" sent after it would reach
        # the kernel's next launch on this agent, as the end of a rank it has not started.
        deadline = time.monotonic() + DRAIN_TIMEOUT
        with self._lock:
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher.join(max(0.0, deadline - time.monotonic()))
        self._channel.send({"op": "done", "stays": stays})
        return True

    def close(self) -> None:
        """The launch is over: no more workers connect, and its stop pipe goes."""
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (Linux)
        except OSError:
            pass
        self._server.close()
        os.close(self.stop_read)
        os.close(self._stop_write)

    def signal(self, signum: int, ranks: list[int] | None, group: bool = True) -> None:
        """``signum`` to the ranks' process groups (``group=False``: their pids only: a
        stack dump's SIGUSR2 must end none of the processes a rank started)."""
        with self._lock:
            targets = [pid for rank, pid in self.pids.items() if ranks is None or rank in ranks]
        for pid in targets:
            if group:
                _signal_group(pid, signum)
            else:
                _signal_pid(pid, signum)

    def write_debug(self, rank: int, data: bytes) -> None:
        """The kernel's bytes for a rank's debug channel (none yet, or gone: dropped; the
        kernel's hub then gets no answer and says so)."""
        with self._lock:
            conn = self._debug.get(rank)
        if conn is not None:
            try:
                conn.sendall(data)
            except OSError:
                pass

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
        try:
            self._forward_from(conn)
        finally:
            with self._lock:  # a rank's next channel (a restart) may have replaced it
                self._debug = {r: c for r, c in self._debug.items() if c is not conn}
            conn.close()

    def _forward_from(self, conn: socket.socket) -> None:
        hello, data = read_hello(conn)
        if hello is None:
            return
        rank, pid, attempt = int(hello["rank"]), int(hello["pid"]), int(hello["attempt"])
        op = hello["channel"] if hello["channel"] in ("log", "debug") else "events"
        with self._lock:  # held while sending: "worker" goes before any of its bytes
            if op == "debug":
                self._debug[rank] = conn  # the kernel's frames for the rank go there
            new = pid not in self._by_pid
            self.pids[rank] = pid
            self._forwarders.setdefault(rank, []).append(threading.current_thread())
            self._by_pid.setdefault(pid, []).append(threading.current_thread())
            if new:
                worker = {"op": "worker", "rank": rank, "pid": pid, "attempt": attempt}
                self._channel.send(worker)
        if new:
            watcher = threading.Thread(target=self._watch, args=(rank, pid, attempt), daemon=True)
            with self._lock:
                self._watchers.append(watcher)
            watcher.start()
        whole = everything if op == "log" else whole_frames
        pending = b""
        while True:
            ready, pending = whole(pending + data)
            if ready:
                self._channel.send({"op": op, "rank": rank, "data": ready})
            if not (data := conn.recv(READ_SIZE)):
                return  # an unfinished frame of a killed worker is dropped

    def _watch(self, rank: int, pid: int, attempt: int) -> None:
        """Say when one worker process ends, with its status, after its last bytes."""
        status = _exit_status(pid)
        with self._lock:
            threads = list(self._by_pid.get(pid, ()))
        for thread in threads:
            thread.join(DRAIN_TIMEOUT)
        ended = {"op": "ended", "rank": rank, "pid": pid, "attempt": attempt, "status": status}
        self._channel.send(ended)


def _exit_status(pid: int) -> int | None:
    """A worker's exit status (minus the signal that killed it) once it has ended, read
    without reaping it (WNOWAIT): elastic reaps its own workers. None if elastic was first."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


# The launch in progress, if any: what a signal reaches, and a kill or the kernel's end takes
# down. Set by the reader as a start arrives (a stop right after it is not lost), cleared by
# the launch's end unless the next launch has already replaced it.
_current: WorkerLinks | None = None
_current_lock = threading.Lock()


def _kill_everything_and_leave() -> None:
    links = _current
    if links is not None:
        links.kill_all()
    os._exit(1)


def _follow_kernel(
    channel: Channel, starts: queue.Queue[tuple[dict[str, Any], WorkerLinks]]
) -> None:
    """The only reader of the kernel's channel: queue each ``start``, obey ``signal`` frames
    (for the launch in progress; a late one, between launches, is moot); at end of input
    (the kernel or its connection is gone), stop. If this reader breaks, nothing could stop
    this host any more: it says why and stops too."""
    try:
        _obey(channel, starts)
    except BaseException:  # noqa: BLE001 - the kernel raises it, naming this host
        channel.send({"op": "failed", "error": traceback.format_exc()})
    _kill_everything_and_leave()


def _obey(channel: Channel, starts: queue.Queue[tuple[dict[str, Any], WorkerLinks]]) -> None:
    """``_follow_kernel``'s loop, until the end of the kernel's input."""
    global _current
    while (message := channel.receive()) is not None:
        links = _current
        if message.get("op") == "start":
            links = WorkerLinks(channel, int(message.get("max_restarts", 0)))
            with _current_lock:
                _current = links
            starts.put((message, links))
        elif message.get("op") == "debug" and links is not None:
            links.write_debug(int(message["rank"]), message["data"])
        elif message.get("op") == "signal" and links is not None:
            signum = int(message["signal"])
            if links.max_restarts and signum != STACK_DUMP_SIGNAL:  # a stack dump ends nothing
                links.stop_restarts()
            links.signal(signum, message.get("ranks"), bool(message.get("group", True)))
            # elastic would restart what was killed (its restarts are not the kernel's to
            # take back): end this host's share now, as elastic's end would, and leave.
            killed = links.max_restarts and signum == signal.SIGKILL
            if killed and links.finish({}, -int(signal.SIGKILL), stays=False):
                os._exit(0)


def _serve_one(channel: Channel, start: dict[str, Any], links: WorkerLinks) -> None:
    """Run one launch's share of this host to its end, and report it."""
    global _current
    from nbaccel.launcher.remote.agent_run import rendezvous_listener, run_host

    listener = None
    try:
        if start["endpoint_port"] is None:  # node 0 hosts the rendezvous: its port
            listener = rendezvous_listener(start)
            start["endpoint_port"] = listener.getsockname()[1]
            channel.send({"op": "endpoint", "port": start["endpoint_port"]})
        succeeded, known = run_host(start, links.address, links.stop_read, listener)
        # Workers elastic stopped after another failed are not in its failures.
        stopped = 0 if succeeded else -int(signal.SIGTERM)
        if not links.finish(known, stopped):
            threading.Event().wait()  # a kill is ending this host: it leaves, not us
    except BaseException:
        links.kill_all()  # the agent is breaking (the kernel hears why): nothing stays
        raise
    finally:
        if listener is not None:
            listener.close()  # if no store took it (one machine's file store; a failure)
        with _current_lock:
            if _current is links:
                _current = None
        links.close()


def _as_it_was(env: dict[str, str], cwd: str) -> None:
    """Give the next launch the agent's own environment and folder, not the last one's."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _save_and_stop(signum: int, frame: object) -> None:
    """SIGTERM or SIGUSR1 to the agent (a scheduler's notice for this host): its ranks are
    asked to save at a step every rank agrees on and stop, as a signal to a rank does; the
    launch then ends as ``stopped`` and the agent serves on until the kernel lets it go."""
    with _current_lock:
        links = _current
    if links is not None:
        if links.max_restarts:
            links.stop_restarts()  # a save-and-stop is an end, not a failure to restart
        links.signal(int(signal.SIGUSR1), None, group=False)  # the ranks' save-and-stop


def main() -> int:
    channel = Channel()
    for signum in SAVE_AND_STOP_SIGNALS:
        signal.signal(signum, _save_and_stop)
    try:
        starts: queue.Queue[tuple[dict[str, Any], WorkerLinks]] = queue.Queue()
        # The kernel's channel is read from now on, before torch is imported (1-3 s, longer
        # on a slow host): an agent whose kernel or connection goes meanwhile (a host that
        # failed its check, a killed kernel) leaves at once rather than after the import.
        threading.Thread(
            target=_follow_kernel, args=(channel, starts), name="nbaccel-agent-in", daemon=True
        ).start()
        from nbaccel.launcher.remote.agent_run import versions

        channel.send({"op": "agent", "pid": os.getpid(), **versions()})
        env, cwd = dict(os.environ), os.getcwd()
        while True:  # until the kernel's channel ends (_follow_kernel leaves for us)
            _as_it_was(env, cwd)
            _serve_one(channel, *starts.get())
    except BaseException as error:  # noqa: BLE001 - the kernel raises it, naming this host
        from nbaccel.launcher.remote.agent_run import JobNotFormed

        said = str(error) if isinstance(error, JobNotFormed) else traceback.format_exc()
        channel.send({"op": "failed", "error": said})
        return 1


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())
