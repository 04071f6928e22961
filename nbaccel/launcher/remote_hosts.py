"""Start a run's workers on several hosts: one nbaccel agent per host, over SSH (or srun).

``RemoteHosts`` is the ``WorkerStarter`` of a several-machine launch. It starts each host's
agent (``python -m nbaccel.launcher.agent_main``) as soon as it is made, so SSH and the
remote ``import torch`` overlap with the rest of the launch. When ``Run.start`` has asked
for every rank, it sends node 0 its share; node 0 picks the rendezvous port and says which,
then every other host gets its share with ``host0:port``. torch elastic does the rest.

Everything comes back on the agents' stdout: each rank's output and events are written
into that rank's pipes, exactly as a local worker writes them, so the pump, the dashboard
and ``events.jsonl`` see one run. With ``max_restarts`` torch elastic restarts every
worker after a failure: a rank's pipes stay open across attempts (the rank's next worker,
on whichever host the new rendezvous puts it, writes into the same pipes), each worker's end
is posted as ``worker_ended`` and each new attempt once as ``restarted``. ``local=True``:
one agent on this machine (a one-machine launch with restarts), whose ranks have no host.

Nothing listens on the network on the kernel's side, and only the agents this process
started can speak for a rank. Closing an agent's stdin stops its host; the kernel exiting
closes them all. Stdlib only: the kernel runs this.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from nbaccel.events import FrameDecoder, encode_frame
from nbaccel.launcher.payload import read_payload
from nbaccel.launcher.planned import JobMachine
from nbaccel.launcher.run_folder import private_file
from nbaccel.launcher.starter import StarterListener

AGENT_ARGV = ("-m", "nbaccel.launcher.agent_main")
AGENT_EXIT_TIMEOUT = 10.0  # after its stdin closes, an agent kills its workers and leaves
STDERR_TAIL_LINES = 20

# How to run a command on a host with stdin/stdout pipes: (host, argv) -> local argv.
CommandFor = Callable[[str, Sequence[str]], list[str]]


class RemoteHosts:
    """The agents of one launch, one per host, and the pipes of the ranks they run.

    ``shares[i]``: processes on ``hosts[i]``. ``python``: the interpreter to run there.
    ``start`` holds what every host gets (run id, payload, env, cwd, run_dir, timeouts).
    """

    def __init__(
        self,
        hosts: Sequence[str],
        shares: Sequence[int],
        command_for: CommandFor,
        python: str,
        run_dir: Path,
        *,
        local: bool = False,
        job: JobMachine | None = None,
    ) -> None:
        self.hosts = list(hosts)
        self.local = local
        self.job = job  # a machine of a job launched from each machine's cell: its agent
        self.attempt = 0  # the latest attempt any agent started (elastic's restart count)
        self.shares = list(shares)
        self.world_size = sum(shares)
        self.run_dir = run_dir
        self.host_of_rank: dict[int, str] = {}
        self._listener: StarterListener | None = None
        self._run_id = ""
        self._lock = threading.Lock()
        self._pipes: dict[int, tuple[int, int]] = {}  # rank -> (log fd, event fd), ours
        self._payload = b""
        self._start: dict[str, Any] = {}
        self._finished: set[int] = set()  # agents that said "done" or "failed"
        self._agents: list[subprocess.Popen[bytes]] = []
        self._readers: list[threading.Thread] = []
        self._stderr_paths: list[Path] = []
        try:
            for index, host in enumerate(self.hosts):
                path = run_dir / f"agent-{index}-{_safe(host)}.log"
                with private_file(path, "wb") as stderr:
                    agent = subprocess.Popen(
                        command_for(host, [python, *AGENT_ARGV]),
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        start_new_session=True,  # the kernel's interrupt goes through Stop
                    )
                self._agents.append(agent)
                self._stderr_paths.append(path)
        except BaseException:
            self.close()
            raise
        self._readers = [
            threading.Thread(
                target=self._read_agent, args=(index,), name=f"nbaccel-agent-{index}", daemon=True
            )
            for index in range(len(self._agents))
        ]
        for reader in self._readers:
            reader.start()

    def configure(self, start: dict[str, Any]) -> None:
        """What every host's start message carries besides its own share (set before spawn)."""
        self._start = dict(start)

    # ----- WorkerStarter ------------------------------------------------------------
    def subscribe(self, run_id: str, listener: StarterListener) -> None:
        self._run_id, self._listener = run_id, listener

    def unsubscribe(self, run_id: str) -> None:
        self._listener = None
        self.close()

    def spawn(self, request: dict[str, Any], fds: list[int]) -> None:
        rank = int(request["rank"])
        with self._lock:
            if not self._payload:
                self._payload = read_payload(fds[0])
            self._pipes[rank] = (os.dup(fds[1]), os.dup(fds[2]))
            complete = len(self._pipes) == self.world_size
        if complete:
            self._send(0, self._start_message(0, None))

    def signal(self, run_id: str, signum: int, ranks: list[int] | None = None) -> None:
        for index in range(len(self._agents)):
            self._send(index, {"op": "signal", "signal": int(signum), "ranks": ranks})

    def host_of(self, rank: int) -> str | None:
        return None if self.local else self.host_of_rank.get(rank)

    # ----- the agents ---------------------------------------------------------------
    def close(self) -> None:
        """Close every agent's stdin (it stops its host), wait for it, close our pipes."""
        for agent in self._agents:
            _close_quietly(agent.stdin)
        for agent in self._agents:
            try:
                agent.wait(timeout=AGENT_EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        for reader in self._readers:  # each reads to its agent's end, then stops
            if reader is not threading.current_thread():
                reader.join(timeout=AGENT_EXIT_TIMEOUT)
        for agent in self._agents:
            _close_quietly(agent.stdout)  # else the fd stays open until garbage collection
        with self._lock:
            pipes, self._pipes = list(self._pipes.values()), {}
        for log_fd, event_fd in pipes:
            _close_fd(log_fd)
            _close_fd(event_fd)

    def stderr_tail(self, index: int) -> str:
        try:
            lines = self._stderr_paths[index].read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-STDERR_TAIL_LINES:])

    def _start_message(self, index: int, port: int | None) -> dict[str, Any]:
        return {
            **self._start,
            "op": "start",
            "payload": self._payload,
            "nproc": self.shares[index],
            # Another machine: its workers report their memory, named after this host.
            "memory_host": None if self.local else self.hosts[index],
            **(_job_rendezvous(self.job) if self.job else self._hosts_rendezvous(index, port)),
        }

    def _hosts_rendezvous(self, index: int, port: int | None) -> dict[str, Any]:
        """The machines of ``hosts=``, met at the first host's agent. Without restarts, in
        torch's static rendezvous: each host's place is its index, known here, so the agents
        connect to one store and go (c10d's join polls once a second: ~1 s a launch). With
        ``max_restarts``, in c10d's, whose rounds let elastic restart every host's workers."""
        return {
            "nnodes": len(self.hosts),
            "node_rank": index,
            "local_addr": self.hosts[index],
            "endpoint_host": self.hosts[0],
            "endpoint_port": port,
            "rendezvous": "c10d" if self._start.get("max_restarts") else "static",
        }

    def _send(self, index: int, message: dict[str, Any]) -> None:
        stdin = self._agents[index].stdin
        try:
            assert stdin is not None
            stdin.write(encode_frame(message))
            stdin.flush()
        except (OSError, ValueError):
            pass  # that agent is gone; its reader reports why

    def _read_agent(self, index: int) -> None:
        agent = self._agents[index]
        assert agent.stdout is not None
        decoder, ended = FrameDecoder(), False
        while not ended and (data := _read(agent.stdout)):
            for message in decoder.feed(data):
                ended = self._on_message(index, message) or ended
        if not ended:  # no "done": the connection or the agent broke
            agent.wait()
            self._host_failed(index, f"the agent exited with code {agent.returncode}")

    def _on_message(self, index: int, message: dict[str, Any]) -> bool:
        """Handle one agent message; True when that agent is finished."""
        op = message["op"]
        if op == "worker":  # before any of that worker's bytes
            rank, attempt = int(message["rank"]), int(message["attempt"])
            self.host_of_rank[rank] = self.hosts[index]  # a restart may move a rank
            if attempt > self.attempt:
                self.attempt = attempt
                self._post({"op": "restarted", "attempt": attempt})
        elif op == "ended":
            ended = {key: message[key] for key in ("rank", "attempt", "status")}
            self._post({"op": "worker_ended", **ended})
        elif op in ("log", "events"):
            rank = int(message["rank"])
            fds = self._pipes.get(rank)
            if fds is not None:
                _write_all(fds[0] if op == "log" else fds[1], message["data"])
        elif op == "endpoint":
            for other in range(1, len(self.hosts)):
                self._send(other, self._start_message(other, int(message["port"])))
        elif op == "exited":
            rank = int(message["rank"])
            with self._lock:
                fds = self._pipes.pop(rank, None)
            for fd in fds or ():
                _close_fd(fd)  # the rank's pipes reach EOF after its last bytes
            self._post({"op": "exited", "rank": rank, "status": int(message["status"])})
        elif op == "failed":
            self._host_failed(index, message["error"])
            return True
        return bool(op == "done")

    def _host_failed(self, index: int, reason: str) -> None:
        if index in self._finished or self._listener is None:
            return
        self._finished.add(index)
        tail = self.stderr_tail(index)
        where = "on this machine" if self.local else f"on host {self.hosts[index]!r}"
        error = (
            f"the nbaccel agent {where} failed: {reason.strip()}"
            + (f"\nIts last output:\n{tail}" if tail else "")
            + f"\nThe whole output is in {self._stderr_paths[index]}."
        )
        self._post({"op": "helper_died", "error": error})

    def _post(self, message: dict[str, Any]) -> None:
        listener = self._listener
        if listener is not None:
            listener({**message, "run": self._run_id})


def _read(stream: IO[bytes]) -> bytes:
    try:
        return os.read(stream.fileno(), 1 << 16)
    except OSError:
        return b""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass  # the run closed that rank's pipe: it no longer reads


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _close_quietly(stream: IO[bytes] | None) -> None:
    if stream is not None:
        try:
            stream.close()
        except OSError:
            pass


def _safe(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in host)


def _job_rendezvous(job: JobMachine) -> dict[str, Any]:
    """One machine of a job whose other machines' kernels start theirs: the static
    rendezvous at the job's address, where machine_rank decides the ranks."""
    return {
        "nnodes": job.machines,
        "node_rank": job.machine_rank,
        "local_addr": None,  # elastic takes this host's name, as torchrun does
        "endpoint_host": job.address,
        "endpoint_port": job.port,
        "rendezvous": "static",
        "job": job.job_id,
        "share_rank0": True,
    }
