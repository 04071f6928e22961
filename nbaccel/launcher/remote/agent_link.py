"""The kernel's side of one nbaccel agent, and the pool that keeps agents between launches.

An ``AgentLink`` is one agent process (``python -c AGENT_BOOT``: preflight's probe, then
``nbaccel.launcher.remote.agent_main``, run on its host through ``ssh`` or ``srun``) with its
channel. Its stdout starts with the probe's line (``probe``); then frames, which go to
whichever launch holds the link (``hold``). Frames go out on its stdin. The agent's own
output (stderr) is copied into that launch's ``agent-<i>-<host>.log``.

``AgentPool.start_checked`` starts the agents of the hosts a launch needs as its preflight:
the probe rides on the agent's own SSH connection, and the agent goes on to import torch
while the kernel judges the answers. An agent serves launch after launch. ``AGENTS`` keeps
the idle ones, per host and way of reaching it, as the kernel keeps its local helper: a
warm relaunch on several machines needs no new SSH connection, no preflight and no
``import torch`` on any host. An agent leaves when the kernel does (its stdin closes), when
its launch SIGKILLs its host, or when it breaks; the pool hands out only agents that said
they stay. Stdlib only: the kernel runs this.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from nbaccel.frames import FrameDecoder, UnreadableFrame, encode_frame
from nbaccel.launcher.remote.preflight import (
    AGENT_BOOT,
    PROBE_MARK,
    HostInfo,
    ProbeAnswer,
    no_answer,
    no_command,
    preflight,
)
from nbaccel.launcher.remote_shell import RemoteShell
from nbaccel.launcher.run_folder import private_file

AGENT_ARGV = ("-c", AGENT_BOOT)
AGENT_EXIT_TIMEOUT = 10.0  # after its stdin closes, an agent kills its workers and leaves
READ_SIZE = 1 << 16
EARLY_OUTPUT = 1 << 16  # what is kept of an agent's output before a launch holds it

# A holder's callbacks: one message of the agent; the agent's end (``how_it_ended``).
OnMessage = Callable[[dict[str, Any]], None]
OnEnd = Callable[[str], None]


class AgentLink:
    """One agent process on ``host``, started with ``argv``, and its channel. ``via``: what
    ``argv`` runs on this machine: ``ssh`` or ``srun`` (whose exit code is the agent's
    unless the connection failed), or ``local`` (the agent itself)."""

    def __init__(self, host: str, argv: Sequence[str], *, via: str = "local") -> None:
        self.host = host
        self.via = via
        self.stays = False  # its last launch ended with "done" and it waits for the next
        # Between a launch's "done" and the next "start": anything it says then belongs to no
        # launch (the agent says "done" last; this guards the next launch all the same).
        self._between = False
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # frames from the pump and the reader, whole
        self._on_message: OnMessage | None = None
        self._on_end: OnEnd | None = None
        self._log: IO[bytes] | None = None  # its holder's agent log
        self._early = bytearray()  # its output before any launch held it (the probe's)
        self._answer: subprocess.CompletedProcess[str] | None = None
        self._answered = threading.Event()  # the probe's line came, or the agent ended
        self._said = b""  # its stdout up to the probe's line
        # Its channel reached its end (under the lock: the reader and hold() agree on which
        # of them tells the holder), and the holder has been told.
        self._gone = False
        self._ended = threading.Event()
        self._process = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # the kernel's interrupt goes through Stop
        )
        self._stderr = threading.Thread(target=self._copy_stderr, daemon=True)
        self._stdout = threading.Thread(target=self._read_frames, daemon=True)
        self._stderr.start()
        self._stdout.start()

    @property
    def pid(self) -> int:
        """The local process: ``ssh`` or ``srun`` (the agent itself on this machine)."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._gone

    def probe(self, timeout: float) -> subprocess.CompletedProcess[str] | None:
        """What the agent's first step said (preflight's probe), as a command's result:
        exit code 0 and the line once it came, else the agent's end (its exit code and
        output); None if neither came within ``timeout``."""
        self._answered.wait(timeout)
        return self._answer

    def early_output(self) -> str:
        with self._lock:
            return self._early.decode(errors="replace")

    def wait_ended(self, timeout: float) -> bool:
        """Wait until this link knows its agent is gone (and has told its holder, if any);
        whether it is."""
        return self._ended.wait(timeout)

    def reads_on_this_thread(self) -> bool:
        """Whether the caller is this agent's reader (a callback of its message)."""
        return threading.current_thread() is self._stdout

    def hold(self, on_message: OnMessage, on_end: OnEnd, log_path: Path) -> None:
        """Give this agent's messages, end and output to one launch from now on."""
        log = private_file(log_path, "wb")
        with self._lock:
            log.write(self._early)
            log.flush()
            self._early.clear()
            previous, self._log = self._log, log
            self._on_message, self._on_end = on_message, on_end
            self.stays = False
            gone = self._gone
        if previous is not None:
            previous.close()
        if gone:  # it left before this launch held it: the launch hears so
            on_end(how_it_ended(self.via, self._process.wait(), self.pid))

    def release(self) -> None:
        """The launch is over: its callbacks hear nothing more (its log stays open until
        the next launch, for the agent's last lines)."""
        with self._lock:
            self._on_message = self._on_end = None

    def send(self, message: dict[str, Any]) -> None:
        stdin = self._process.stdin
        assert stdin is not None
        with self._send_lock:
            if message.get("op") == "start":
                self._between = False
            try:
                stdin.write(encode_frame(message))
                stdin.flush()
            except (OSError, ValueError):
                pass  # the agent is gone; the reader reports why

    def close(self, *, kill: bool = False) -> None:
        """Close the agent's stdin (it stops its workers and leaves) and wait for it;
        ``kill``: end the local ``ssh``/``srun`` (or agent) at once instead, as for an
        agent whose host failed its check (it leaves once its channel is gone)."""
        _close_quietly(self._process.stdin)
        if kill:
            self._process.kill()
        try:
            self._process.wait(timeout=AGENT_EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        for reader in (self._stdout, self._stderr):  # each reads to the agent's end
            if reader is not threading.current_thread():
                reader.join(timeout=AGENT_EXIT_TIMEOUT)
        _close_quietly(self._process.stdout)  # else the fd stays open until collected
        _close_quietly(self._process.stderr)
        with self._lock:
            log, self._log = self._log, None
        if log is not None:
            log.close()

    def _read_frames(self) -> None:
        stdout = self._process.stdout
        assert stdout is not None
        decoder = FrameDecoder()
        data = self._read_probe(stdout)
        while data is not None:
            for message in decoder.feed(data):
                if isinstance(message, UnreadableFrame):  # its launch ends, saying why
                    message = {"op": "failed", "error": message.reason}
                if self._between:
                    continue
                if message["op"] == "done":  # set before the holder hears it, and so
                    # before the next launch can send its start
                    self.stays, self._between = bool(message.get("stays")), True
                    with self._lock:  # what it wrote before "done" is this launch's
                        self._drain_stderr()
                with self._lock:
                    deliver = self._on_message
                if deliver is not None:
                    deliver(message)
            data = _read(stdout) or None
        code = self._process.wait()
        self._stderr.join(timeout=AGENT_EXIT_TIMEOUT)  # its last words are in the log first
        if self._answer is None:  # it ended before its probe's line: its output says why
            self._answer = subprocess.CompletedProcess(
                self._process.args, code, self._said.decode(errors="replace"), self.early_output()
            )
            self._answered.set()
        with self._lock:
            self.stays, self._gone = False, True
            on_end = self._on_end
        if on_end is not None:
            on_end(how_it_ended(self.via, code, self.pid))
        self._ended.set()

    def _read_probe(self, stdout: IO[bytes]) -> bytes | None:
        """Read up to the probe's line (a login banner may come first); the frames' bytes
        read after it, or None at the agent's end."""
        while data := _read(stdout):
            self._said += data
            mark = self._said.find(PROBE_MARK.encode())
            end = self._said.find(b"\n", mark)
            if mark != -1 and end != -1:
                said, rest = self._said[: end + 1], self._said[end + 1 :]
                self._answer = subprocess.CompletedProcess(
                    self._process.args, 0, said.decode(errors="replace"), ""
                )
                self._answered.set()
                return rest
        return None

    def _copy_stderr(self) -> None:
        """Copy the agent's output into its holder's log until the agent ends. Reads happen
        under the lock, non-blocking, so that a "done" can drain the rest first."""
        stderr = self._process.stderr
        assert stderr is not None
        os.set_blocking(stderr.fileno(), False)
        poller = select.poll()
        poller.register(stderr.fileno(), select.POLLIN)
        open_ = True
        while open_:
            poller.poll()
            with self._lock:
                open_ = self._drain_stderr()

    def _drain_stderr(self) -> bool:
        """Under the lock: what is in the agent's stderr pipe now, into the log; False at
        its end."""
        stderr = self._process.stderr
        assert stderr is not None
        while True:
            try:
                data = os.read(stderr.fileno(), READ_SIZE)
            except BlockingIOError:
                return True
            except (OSError, ValueError):
                return False
            if not data:
                return False
            if self._log is not None:
                self._log.write(data)
                self._log.flush()
            else:
                self._early += data
                del self._early[:-EARLY_OUTPUT]


class AgentPool:
    """Idle agents by (way of reaching the host, host): a resource cache, like a connection
    pool, holding no configuration. ``take`` gives an idle one or starts a new one:
    ``shell.python`` with ``agent_argv`` on the host."""

    def __init__(self, agent_argv: Sequence[str] = AGENT_ARGV) -> None:
        self._agent_argv = tuple(agent_argv)
        self._lock = threading.Lock()
        self._idle: dict[tuple[RemoteShell, str], list[AgentLink]] = {}

    def has_idle(self, shell: RemoteShell, host: str) -> bool:
        """Whether ``take`` would reuse an agent (one that passed its preflight then)."""
        with self._lock:
            return any(link.alive for link in self._idle.get((shell, host), ()))

    def start_checked(
        self,
        shell: RemoteShell,
        hosts: Sequence[str],
        *,
        timeout: float,
        local_versions: Mapping[str, str],
    ) -> dict[str, HostInfo]:
        """Start an agent on each of ``hosts`` and check them all at once (preflight, on the
        agents' own connections): they go into the pool for the launch to take; what each
        host has. If any host fails, every agent started here is ended and ONE ConfigError
        names every failing host (``preflight``)."""
        links: dict[str, AgentLink] = {}
        missing: dict[str, ProbeAnswer] = {}
        for host in dict.fromkeys(hosts):
            try:
                links[host] = self._start(shell, host)
            except FileNotFoundError:  # no ssh (or srun) here
                missing[host] = no_command(shell, host)

        def ask(host: str) -> ProbeAnswer:
            link = links.get(host)
            if link is None:
                return missing[host]
            answer = link.probe(timeout)
            return answer or no_answer(shell, host, timeout, link.early_output())

        try:
            found = preflight(
                shell, list(links) + list(missing), ask, local_versions=local_versions
            )
        except BaseException:
            for link in links.values():
                link.close(kill=True)
            raise
        with self._lock:
            for host, link in links.items():
                self._idle.setdefault((shell, host), []).append(link)
        return found

    def take(self, shell: RemoteShell, host: str) -> AgentLink:
        with self._lock:
            idle = self._idle.get((shell, host), [])
            while idle:
                link = idle.pop()
                if link.alive:
                    return link
                link.close()  # it left while idle: reap it
        return self._start(shell, host)

    def _start(self, shell: RemoteShell, host: str) -> AgentLink:
        argv = shell.argv(host, [shell.python, *self._agent_argv])
        return AgentLink(host, argv, via=shell.kind)

    def give_back(self, shell: RemoteShell, link: AgentLink) -> None:
        """Keep ``link`` for the next launch if its agent said it stays; else end it."""
        link.release()
        if not (link.stays and link.alive):
            link.close()
            return
        with self._lock:
            self._idle.setdefault((shell, link.host), []).append(link)

    def close_all(self) -> None:
        """End every idle agent (tests; the kernel's exit ends them too)."""
        with self._lock:
            links = [link for idle in self._idle.values() for link in idle]
            self._idle.clear()
        for link in links:
            link.close()

    def idle_links(self) -> list[AgentLink]:
        """The idle agents' links (their ``pid``: the local ``ssh``/``srun``)."""
        with self._lock:
            return [link for idle in self._idle.values() for link in idle if link.alive]


# The kernel's agents, kept between its launches (see the module's docstring).
AGENTS = AgentPool()


def how_it_ended(via: str, code: int, pid: int) -> str:
    """An agent's end in words, from the exit code of its command on this machine (``via``:
    ``AgentLink``'s): a signal or ssh's own 255 is the connection's end, not the agent's.

    >>> how_it_ended("ssh", 3, 41)
    'the agent exited with code 3'
    >>> print(how_it_ended("ssh", -9, 41))
    the connection to the agent's host was lost: its ssh client (pid 41, on this machine) was ...
    >>> print(how_it_ended("ssh", 255, 41))
    the connection to the agent's host was lost (ssh exited with code 255: the network, the ...
    >>> how_it_ended("local", -15, 41)
    'the agent was killed by SIGTERM'
    """
    if code >= 0 and not (via == "ssh" and code == 255):
        return f"the agent exited with code {code}"
    if code >= 0:
        return (
            "the connection to the agent's host was lost (ssh exited with code 255: the "
            "network, the host or its sshd went away)"
        )
    try:
        killed = f"killed by {signal.Signals(-code).name}"
    except ValueError:
        killed = f"killed by signal {-code}"
    if via == "local":
        return f"the agent was {killed}"
    return (
        f"the connection to the agent's host was lost: its {via} client (pid {pid}, on this "
        f"machine) was {killed}, and the agent there stops its workers as its channel closes"
    )


def _read(stream: IO[bytes]) -> bytes:
    try:
        return os.read(stream.fileno(), READ_SIZE)
    except (OSError, ValueError):
        return b""


def _close_quietly(stream: IO[bytes] | None) -> None:
    if stream is not None:
        try:
            stream.close()
        except OSError:
            pass
