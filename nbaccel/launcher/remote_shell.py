"""How the kernel runs a command on another host, with pipes for its stdin and stdout.

Two ways: the system ``ssh`` (batch mode, the user's ``~/.ssh/config`` and known_hosts
decide everything else) or, inside a Slurm allocation, one ``srun`` step per node. A third,
``local``, runs the command on this machine as it is: a one-machine launch with
``max_restarts`` runs its workers under the same agent, torch elastic restarting them.
``nbaccel.launcher.remote.preflight`` checks every host through it before anything starts there.
Stdlib only: this runs in the kernel, which never imports torch.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from nbaccel.errors import ConfigError

# The options nbaccel gives ssh. ssh keeps the FIRST value it reads for each option, so the
# user's own ssh_options come before these and win over them.
# Host keys are never trusted blindly (no StrictHostKeyChecking=no): the user's known_hosts
# decides, and in batch mode an unknown host fails with "Host key verification failed".
SSH_OPTIONS = (
    # Never ask for a password or passphrase: there is nobody to answer in a kernel.
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=10",
    # A dead network or a frozen host ends the channel within ~15 s instead of never, so the
    # kernel hears that the host is gone.
    "-o",
    "ServerAliveInterval=5",
    "-o",
    "ServerAliveCountMax=3",
    # X11 forwarding only slows the login and prints warnings into the channel's stderr.
    "-o",
    "ForwardX11=no",
    # Never a pty: the channel carries the agent's protocol, which a terminal would mangle
    # (echo, CR/LF), and without a pty a closed channel ends the remote command.
    "-T",
)

# The options nbaccel gives srun, one step per node (srun(1)): --overlap lets the step share
# CPUs, memory and GRES with every other step, so the steps on the other nodes, and the
# kernel's own step when Jupyter itself runs under srun, never block it; without --exact a
# step gets all of the node's CPUs of the allocation, and by default all of the job's GPUs
# (GRES) there. --cpu-bind=none keeps the single task, and the workers it starts, from being
# pinned to one core by a cluster's automatic binding. --input=all sends srun's stdin to the
# task (the default, said explicitly). --mpi=none skips PMI set-up the agent does not use.
# --unbuffered: without it slurmstepd holds a task's stdout until a newline (or ~1 KB), and
# the agent's binary frames have none: the first launch hung with every frame held (a real
# slurm-wlm 22.05 cluster). With it stdout is a raw pseudo-terminal, which passed 3 MB of
# random bytes unchanged there; stdin and stderr stay pipes.
SRUN_OPTIONS = (
    "--nodes=1",
    "--ntasks=1",
    "--overlap",
    "--kill-on-bad-exit=1",
    "--cpu-bind=none",
    "--mpi=none",
    "--input=all",
    "--unbuffered",
)


@dataclass(frozen=True)
class RemoteShell:
    """Runs commands on hosts through ``ssh`` or ``srun``; ``options`` are the user's extra
    arguments for that command, ``python`` the interpreter path used on every host.

    >>> shell = RemoteShell("ssh", ("-F", "cluster.conf"), python="/opt/venv/bin/python")
    >>> shell.argv("node1", [shell.python, "-c", "print(1)"])[-3:]
    ['node1', '--', "/opt/venv/bin/python -c 'print(1)'"]
    """

    kind: Literal["ssh", "srun", "local"]
    options: tuple[str, ...] = ()
    python: str = sys.executable

    def argv(self, host: str, remote_argv: Sequence[str]) -> list[str]:
        """The local command line that runs ``remote_argv`` on ``host``.

        ssh: the user's options first (ssh keeps the first value of each option), then
        :data:`SSH_OPTIONS`, the host, ``--`` and the command as one shell-quoted string,
        which the remote login shell splits back into ``remote_argv``.

        srun: :data:`SRUN_OPTIONS` with ``--nodelist=host``, then the user's options (srun
        keeps the last value of each), then ``remote_argv`` as it is: srun runs it without a
        shell. srun forwards its stdin to the task and the task's stdout back; it is meant to
        run inside the allocation (``SLURM_JOB_ID`` set), as with ``hosts="slurm"``.

        local: ``remote_argv`` itself, run on this machine.

        >>> RemoteShell("srun").argv("gpu01", ["python", "-c", "1"])
        ... # doctest: +NORMALIZE_WHITESPACE
        ['srun', '--nodes=1', '--ntasks=1', '--overlap', '--kill-on-bad-exit=1',
         '--cpu-bind=none', '--mpi=none', '--input=all', '--unbuffered', '--nodelist=gpu01',
         'python', '-c', '1']
        """
        if not host or host.startswith("-"):
            raise ConfigError(
                f"{host!r} is not a host name: ssh and srun would read it as an option.",
                field="hosts",
            )
        if not remote_argv:
            raise ValueError("remote_argv is empty: there is no command to run")
        if self.kind == "local":
            return list(remote_argv)  # this machine: no shell, no options
        if self.kind == "ssh":
            return ["ssh", *self.options, *SSH_OPTIONS, host, "--", shlex.join(remote_argv)]
        return ["srun", *SRUN_OPTIONS, f"--nodelist={host}", *self.options, *remote_argv]
