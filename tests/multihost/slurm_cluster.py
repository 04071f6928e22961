"""A real two-node Slurm cluster on one machine: Debian's slurmctld, slurmd and munge
(slurm-wlm 22.05), nodes ``n1`` at 127.0.0.2 and ``n2`` at 127.0.0.3 (Linux routes all of
127/8 to the loopback), one CPU each, in one partition. Used by the tests' ``slurm_cluster``
fixture (conftest.py) and by ``benchmarks/multi_host_launch.py``; imports nothing of pytest.

Everything lives in one folder: slurm.conf, the spool and state folders, the logs, and
munge's throwaway key and socket (its own munged, not the machine's). Every port is picked
free. Nothing is written to /etc: the Slurm commands find the cluster through
``SLURM_CONF`` (``SlurmCluster.env``), which callers put in the environment of the commands
they run (salloc, srun, sinfo).

The node names do not resolve (they are in no /etc/hosts): Slurm reaches each node at its
``NodeAddr``, as a cluster whose names are not in DNS does, and so must nbaccel. That is the
harder case on purpose; a cluster whose names resolve takes the same path.

``serve(folder)`` starts the daemons and waits for both nodes to be idle; the ``with`` block's
end stops them (SIGTERM, then SIGKILL), slurmd's step daemons and their tasks included::

    with serve(Path(tempfile.mkdtemp())) as cluster:
        subprocess.run(["srun", "-N2", "-n2", "hostname"], env=cluster.env(), check=True)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
MUNGED = "/usr/sbin/munged"
NODES = {"n1": "127.0.0.2", "n2": "127.0.0.3"}
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
POLL_INTERVAL = 0.05  # between looks at the daemons' state while they start


@dataclass(frozen=True)
class SlurmCluster:
    """The running cluster: its node names and addresses, its folder (slurm.conf) and its
    daemons' pids."""

    nodes: Mapping[str, str]
    folder: Path
    daemon_pids: frozenset[int]

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with this cluster's SLURM_CONF,
        and without the SLURM_* variables of any allocation it was started from."""
        base = os.environ if base is None else base
        env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *argv: str, timeout: float = 30.0) -> str:
        """A Slurm command's stdout (raises CalledProcessError with its stderr)."""
        done = subprocess.run(
            list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout
        )
        if done.returncode:
            raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
        return done.stdout

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster's jobs but its daemons: srun and salloc (their
        environment names this cluster's slurm.conf, as do the tasks srun starts, and their
        children: agents, workers) and the step daemons (slurmstepd)."""
        found = []
        for process in psutil.process_iter():
            if process.pid in self.daemon_pids:
                continue
            with contextlib.suppress(psutil.Error):
                if process.status() == psutil.STATUS_ZOMBIE:
                    continue
                if process.name() == "slurmstepd":
                    if any(str(f.path).startswith(str(self.folder)) for f in process.open_files()):
                        found.append(process)
                elif process.environ().get("SLURM_CONF") == str(self.conf):
                    found.append(process)
        return found


def installed() -> bool:
    return all(os.access(path, os.X_OK) for path in (SLURMCTLD, SLURMD, MUNGED))


def free_port() -> int:
    """A TCP port free on every address (slurmctld and slurmd listen on all of them)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def write_conf(folder: Path, ctld_port: int, node_ports: Mapping[str, int]) -> Path:
    """slurm.conf for the cluster in ``folder``: every path in it, root runs everything."""
    nodes = "".join(
        f"NodeName={name} NodeAddr={address} Port={node_ports[name]} CPUs=1 State=UNKNOWN\n"
        for name, address in NODES.items()
    )
    conf = folder / "slurm.conf"
    conf.write_text(
        "ClusterName=nbaccel-test\n"
        # slurmctld serves only where its host's own name is SlurmctldHost.
        f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)\n"
        f"SlurmctldPort={ctld_port}\n"
        "SlurmUser=root\n"
        "SlurmdUser=root\n"
        "AuthType=auth/munge\n"
        "CredType=cred/munge\n"
        f"AuthInfo=socket={folder / 'munge.socket'}\n"
        # No cgroups here (a container, often): processes are tracked through /proc, and
        # tasks are not bound to CPUs.
        "ProctrackType=proctrack/linuxproc\n"
        "TaskPlugin=task/none\n"
        "JobAcctGatherType=jobacct_gather/none\n"
        "AccountingStorageType=accounting_storage/none\n"
        "JobCompType=jobcomp/none\n"
        "SwitchType=switch/none\n"
        "MpiDefault=none\n"
        "SelectType=select/cons_tres\n"
        "SelectTypeParameters=CR_CPU\n"
        "ReturnToService=2\n"
        f"StateSaveLocation={folder / 'state'}\n"
        f"SlurmdSpoolDir={folder / 'spool%n'}\n"
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}\n"
        f"SlurmdPidFile={folder / 'slurmd-%n.pid'}\n"
        f"SlurmctldLogFile={folder / 'slurmctld.log'}\n"
        f"SlurmdLogFile={folder / 'slurmd-%n.log'}\n"
        # The daemons would otherwise wait for each other on a failed start for minutes.
        "SlurmctldTimeout=10\n"
        "SlurmdTimeout=30\n"
        "MessageTimeout=10\n"
        # A step's tasks that outlive the kill get 5 s (Slurm's minimum is 1; default 30).
        "KillWait=5\n"
        # No wait between a job's end and a new job on its nodes.
        "CompleteWait=0\n"
        + nodes
        + f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE "
        "State=UP\n"
    )
    return conf


class _Daemons:
    """The cluster's processes, stopped in reverse order of start."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: Mapping[str, str]) -> None:
        with open(self.folder / f"{name}.out", "wb") as log:  # the child keeps its own copy
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
            )
        self.processes.append((name, process))

    def check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {process.returncode} while the test cluster "
                    f"started:\n{self.tail(name)}"
                )

    def tail(self, name: str, lines: int = 30) -> str:
        text = ""
        for path in (self.folder / f"{name}.out", self.folder / f"{name}.log"):
            if path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM each daemon (slurmd ends its steps' slurmstepd), then SIGKILL whatever is
        left of its session: step daemons and tasks included."""
        for _name, process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT)
        for leftover in self._leftovers():
            with contextlib.suppress(psutil.Error):
                leftover.kill()
        psutil.wait_procs(self._leftovers(), timeout=STOP_TIMEOUT)

    def _leftovers(self) -> list[psutil.Process]:
        """This cluster's step daemons (slurmstepd, which outlives slurmd; found by the log
        file in this folder it holds open) and their tasks."""
        cluster = SlurmCluster(dict(NODES), self.folder, frozenset())
        found: list[psutil.Process] = []
        for process in cluster.processes():
            with contextlib.suppress(psutil.Error):
                if process.name() == "slurmstepd":
                    found += [process, *process.children(recursive=True)]
        return found


def _wait_until(what: str, ready: Callable[[], bool], daemons: _Daemons, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        daemons.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test cluster's {what} within {timeout:g} s")
        time.sleep(POLL_INTERVAL)


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[SlurmCluster]:
    """Run munged, slurmctld and one slurmd per node with everything in ``folder`` (left
    there) until the block ends; raises RuntimeError with the daemons' logs if the nodes are
    not idle within START_TIMEOUT."""
    (folder / "state").mkdir()
    key = folder / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    ports = {name: free_port() for name in NODES}
    conf = write_conf(folder, free_port(), ports)
    env = SlurmCluster(dict(NODES), folder, frozenset()).env()
    daemons = _Daemons(folder)
    try:
        daemons.start(
            "munged",
            [
                MUNGED,
                "--foreground",
                "--force",  # root, and a socket folder munged did not make
                f"--socket={folder / 'munge.socket'}",
                f"--key-file={key}",
                f"--log-file={folder / 'munged.log'}",
                f"--pid-file={folder / 'munged.pid'}",
                f"--seed-file={folder / 'munged.seed'}",
            ],
            env,
        )
        _wait_until(
            "munged did not listen",
            lambda: (folder / "munge.socket").exists(),
            daemons,
            START_TIMEOUT,
        )
        # -i: ignore old state; -D: the foreground, so stopping it is ours.
        daemons.start("slurmctld", [SLURMCTLD, "-D", "-i", "-f", str(conf)], env)
        for name in NODES:
            daemons.start(f"slurmd-{name}", [SLURMD, "-D", "-N", name, "-f", str(conf)], env)

        def idle() -> bool:
            done = subprocess.run(
                ["sinfo", "--noheader", "--Node", "--format=%N %t"],
                env=env,
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT,
            )
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            return all(states.get(name) == "idle" for name in NODES)

        try:
            _wait_until("nodes were not idle", idle, daemons, START_TIMEOUT)
        except RuntimeError as error:
            logs = "\n".join(f"--- {n}:\n{daemons.tail(n)}" for n, _ in daemons.processes)
            raise RuntimeError(f"{error}\n{logs}") from None
        yield SlurmCluster(dict(NODES), folder, frozenset(p.pid for _, p in daemons.processes))
    finally:
        daemons.stop()
