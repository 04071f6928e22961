"""Start a run's workers on several hosts: one nbaccel agent per host, over SSH (or srun).

``RemoteHosts`` is the ``WorkerStarter`` of a several-machine launch. It takes each host's
agent (``agent_link``: an idle one kept from an earlier launch, else a new one, whose SSH
connection and remote ``import torch`` then overlap with the rest of the launch) as soon as
it is made. When ``Run.start`` has asked for every rank, it sends node 0 its share; node 0
picks the rendezvous port and says which, then every other host gets its share with
``host0:port``. torch elastic does the rest. At the run's end the agents go back to the
pool (``AGENTS``) for the next launch; a one-machine agent (``local=True``) is ended.

Everything comes back on the agents' stdout: each rank's output and events are written
into that rank's pipes, exactly as a local worker writes them, so the pump, the dashboard
and ``events.jsonl`` see one run. With ``max_restarts`` torch elastic restarts every
worker after a failure: a rank's pipes stay open across attempts (the rank's next worker,
on whichever host the new rendezvous puts it, writes into the same pipes), each worker's end
is posted as ``worker_ended`` and each new attempt once as ``restarted``. ``local=True``:
one agent on this machine (a one-machine launch with restarts), whose ranks have no host.

Each rank's debug channel (``launcher.debug``) is relayed the same way, both ways
(``debug_relay``). Nothing listens on the network on the kernel's side, and only the agents
this process started can speak for a rank. Closing an agent's stdin stops its host; the
kernel exiting closes them all. Stdlib only: the kernel runs this.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nbaccel.launcher.bootstrap.payload import for_other_hosts, read_payload
from nbaccel.launcher.planned import JobMachine
from nbaccel.launcher.remote.agent_link import AGENT_ARGV, AGENTS, AgentLink
from nbaccel.launcher.remote.debug_relay import DebugRelay
from nbaccel.launcher.remote_shell import RemoteShell
from nbaccel.launcher.sharing.packing import take_shared
from nbaccel.launcher.starter import StarterListener

STDERR_TAIL_LINES = 20
# After a run's last rank exited, how long its agents may take to say "done" (they say it
# right after): one that does not is ended rather than kept.
DONE_TIMEOUT = 5.0


class RemoteHosts:
    """The agents of one launch, one per host, and the pipes of the ranks they run.

    ``shares[i]``: processes on ``hosts[i]``, reached through ``shell``.
    ``start`` holds what every host gets (run id, payload, env, cwd, run_dir, timeouts).
    """

    def __init__(
        self,
        hosts: Sequence[str],
        shares: Sequence[int],
        shell: RemoteShell,
        run_dir: Path,
        *,
        local: bool = False,
        job: JobMachine | None = None,
        addresses: Sequence[str] | None = None,
    ) -> None:
        self.hosts = list(hosts)
        self.addresses = list(addresses or hosts)  # where each rendezvous binds, is reached
        self.local = local
        self.job = job  # a machine of a job launched from each machine's cell: its agent
        self.attempt = 0  # the latest attempt any agent started (elastic's restart count)
        self.shares = list(shares)
        self.world_size = sum(shares)
        self.run_dir = run_dir
        self.host_of_rank: dict[int, str] = {}
        self._shell = shell
        self._listener: StarterListener | None = None
        self._run_id = ""
        self._lock = threading.Lock()
        self._pipes: dict[int, tuple[int, int]] = {}  # rank -> (log fd, event fd), ours
        self._payload = b""
        self._data: list[bytes] = []  # the payload's shared-memory segments, copied
        self._start: dict[str, Any] = {}
        self._unheard: list[dict[str, Any]] = []  # failures before anyone subscribed
        self._over = [threading.Event() for _ in self.hosts]  # "done", "failed" or gone
        self._sent = [False for _ in self.hosts]  # each agent's start went out
        self._links: list[AgentLink] = []
        self._debug = DebugRelay(self._send_debug)  # the ranks' debug channels
        self._agent_of_rank: dict[int, int] = {}  # whose agent runs the rank now
        self._log_paths = [
            run_dir / f"agent-{index}-{_safe(host)}.log" for index, host in enumerate(self.hosts)
        ]
        try:
            for index, host in enumerate(self.hosts):
                link = self._agent_for(host)
                self._links.append(link)
                link.hold(
                    functools.partial(self._on_message, index),
                    functools.partial(self._host_failed, index),
                    self._log_paths[index],
                )
        except BaseException:
            self.close()
            raise

    def _agent_for(self, host: str) -> AgentLink:
        if self.local:  # the kernel's own environment, as it is now: a new agent each time
            argv = self._shell.argv(host, [self._shell.python, *AGENT_ARGV])
            return AgentLink(host, argv, via=self._shell.kind)
        return AGENTS.take(self._shell, host)

    def configure(self, start: dict[str, Any]) -> None:
        """What every host's start message carries besides its own share (set before spawn)."""
        self._start = dict(start)

    # ----- WorkerStarter ------------------------------------------------------------
    def subscribe(self, run_id: str, listener: StarterListener) -> None:
        with self._lock:
            self._run_id, self._listener = run_id, listener
            unheard, self._unheard = self._unheard, []
        for message in unheard:
            listener({**message, "run": run_id})

    def unsubscribe(self, run_id: str) -> None:
        self._listener = None
        self.close()

    def spawn(self, request: dict[str, Any], fds: list[int]) -> None:
        rank = int(request["rank"])
        fds, data_fds, _ = take_shared(fds, request)
        with self._lock:
            if not self._payload:
                # The payload's buffers, read once out of its shared-memory segments (only
                # those it uses): each agent gets them once and shares them with its
                # host's ranks (agent_run).
                self._payload, self._data = for_other_hosts(read_payload(fds[0]), data_fds)
            self._pipes[rank] = (os.dup(fds[1]), os.dup(fds[2]))
            self._debug.add(rank, os.dup(fds[3]))  # every rank's spawn carries its channel
            complete = len(self._pipes) == self.world_size
        if complete:
            self._debug.start()
            self._send_start(0, None)

    def signal(
        self, run_id: str, signum: int, ranks: list[int] | None = None, *, group: bool = True
    ) -> None:
        message = {"op": "signal", "signal": int(signum), "ranks": ranks, "group": group}
        for index in range(len(self._links)):
            self._send(index, message)

    def offer_modules(self, modules: list[tuple[str, str | None]]) -> None:
        """Agents start their workers through torch elastic, without a helper: nothing to
        preload."""

    def host_of(self, rank: int) -> str | None:
        return None if self.local else self.host_of_rank.get(rank)

    # ----- the agents ---------------------------------------------------------------
    def close(self) -> None:
        """The run is over: each agent that finished its share goes back to the pool (a
        one-machine agent, or one that did not finish, is ended: its stdin closes and it
        stops its host); our pipes close. Once; later calls do nothing."""
        with self._lock:
            links, self._links = self._links, []
            pipes, self._pipes = list(self._pipes.values()), {}
        for index, link in enumerate(links):
            if self._sent[index] and not link.reads_on_this_thread():
                self._over[index].wait(DONE_TIMEOUT)  # it comes right after the last exit
        for link in links:
            if self.local:
                link.release()
                link.close()
            else:  # kept only if its "done" said it stays
                AGENTS.give_back(self._shell, link)
        for log_fd, event_fd in pipes:
            _close_fd(log_fd)
            _close_fd(event_fd)
        self._debug.close()

    def stderr_tail(self, index: int) -> str:
        try:
            lines = self._log_paths[index].read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-STDERR_TAIL_LINES:])

    def _start_message(self, index: int, port: int | None) -> dict[str, Any]:
        return {
            **self._start,
            "op": "start",
            "payload": self._payload,
            "data": self._data,
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
            "local_addr": self.addresses[index],
            "endpoint_host": self.addresses[0],
            "endpoint_port": port,
            "rendezvous": "c10d" if self._start.get("max_restarts") else "static",
        }

    def _send_start(self, index: int, port: int | None) -> None:
        self._sent[index] = True
        self._send(index, self._start_message(index, port))
        if all(self._sent):
            self._data = []  # every host has its copy: the kernel holds none for the run

    def _send(self, index: int, message: dict[str, Any]) -> None:
        with self._lock:
            link = self._links[index] if index < len(self._links) else None
        if link is not None:  # else the run is over: its agents are not its to command
            link.send(message)

    def _on_message(self, index: int, message: dict[str, Any]) -> None:
        """Handle one agent message (on that agent's reader thread)."""
        op = message["op"]
        if op == "worker":  # before any of that worker's bytes
            rank, attempt = int(message["rank"]), int(message["attempt"])
            self.host_of_rank[rank] = self.hosts[index]  # a restart may move a rank
            self._agent_of_rank[rank] = index
            if attempt > self.attempt:
                self.attempt = attempt
                self._post({"op": "restarted", "attempt": attempt})
        elif op == "ended":
            ended = {key: message[key] for key in ("rank", "attempt", "status")}
            self._post({"op": "worker_ended", **ended})
        elif op == "debug":
            self._debug.from_agent(int(message["rank"]), message["data"])
        elif op in ("log", "events"):
            rank = int(message["rank"])
            fds = self._pipes.get(rank)
            if fds is not None:
                _write_all(fds[0] if op == "log" else fds[1], message["data"])
        elif op == "endpoint":
            for other in range(1, len(self.hosts)):
                self._send_start(other, int(message["port"]))
        elif op == "exited":
            rank = int(message["rank"])
            with self._lock:
                fds = self._pipes.pop(rank, None)
            for fd in fds or ():
                _close_fd(fd)  # the rank's pipes reach EOF after its last bytes
            self._post({"op": "exited", "rank": rank, "status": int(message["status"])})
        elif op == "failed":
            self._host_failed(index, message["error"])
        elif op == "done":
            self._over[index].set()

    def _send_debug(self, rank: int, message: dict[str, Any]) -> None:
        """To the agent of the host ``rank`` runs on (not known yet: dropped)."""
        index = self._agent_of_rank.get(rank)
        if index is not None:
            self._send(index, message)

    def _host_failed(self, index: int, reason: str) -> None:
        """An agent broke ("failed") or left before its "done": every rank is lost."""
        if self._over[index].is_set():  # one report per agent: "failed", then its end
            return
        self._over[index].set()
        tail = self.stderr_tail(index)
        where = "on this machine" if self.local else f"on host {self.hosts[index]!r}"
        error = f"the nbaccel agent {where} failed: {reason.strip()}"
        if tail:  # an empty log is no place to look
            error += f"\nIts last output:\n{tail}\nThe whole output is in {self._log_paths[index]}."
        self._post({"op": "helper_died", "error": error}, keep=True)
        # Every rank is lost: the other hosts' workers go now, so that their agents say
        # "done" at once (the run's end waited DONE_TIMEOUT for them, then ended them).
        self.signal(self._run_id, signal.SIGKILL)

    def _post(self, message: dict[str, Any], *, keep: bool = False) -> None:
        """To the run's listener; ``keep``: held for it if it has not subscribed yet."""
        with self._lock:
            listener = self._listener
            if listener is None and keep and not self._run_id:
                self._unheard.append(message)
        if listener is not None:
            listener({**message, "run": self._run_id})


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
