"""A launch checked and ready to start, as plain data.

``api.plan`` makes it in the kernel; ``api.start_planned`` starts its workers there, or a
detached run's supervisor (``supervisor_main.py``) starts them in its own process after
receiving it pickled. Everything the workers need travels inside: the resolved config, the
payload (and the fds of its shared-memory segments), the environment and working folder the
kernel had at launch.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbaccel.config.resolve import Resolved
from nbaccel.hardware.xla_plan import XlaPlan
from nbaccel.launcher.bootstrap.payload import Payload
from nbaccel.launcher.remote_shell import RemoteShell

if TYPE_CHECKING:
    from nbaccel.launcher.run import Run

# What shows a run (the widget dashboard, or text): called once with the run and the number
# of GPUs it uses, before its workers start, to subscribe to it; it may return what is left
# to do once they are started (``shown``): the widget dashboard builds its widgets then,
# while the ranks start. Chosen by the entry points above the launcher.
Display = Callable[["Run", int], "Callable[[], None] | None"]


def shown(rest: Callable[[], None] | None) -> None:
    """Do what a ``Display`` left for later (``shown(show(run, gpus))``: all of it now)."""
    if rest is not None:
        rest()


@dataclass(frozen=True)
class JobMachine:
    """This machine's place in a job whose machines each launch from their own kernel
    (Accelerate's ``num_nodes=``/``node_rank=``; the schema's num_machines/machine_rank):
    torch's static rendezvous at ``address:port``, served by machine 0."""

    machines: int
    machine_rank: int
    address: str
    port: int

    @property
    def job_id(self) -> str:
        """The rendezvous' name: the same in every kernel of the job, as the CLI's."""
        return f"nbaccel-{self.port}"


@dataclass(frozen=True)
class HostPlacement:
    """Where a several-machine launch runs (``hosts``): each host's share of the processes,
    and how a command runs there (ssh or srun, with the Python to run). ``job``: a machine
    of a job launched from each machine's cell, whose one host is this machine.
    ``addresses``: where each host's rendezvous binds and is reached, when not its name (a
    Slurm node's NodeAddr)."""

    hosts: tuple[str, ...]
    shares: tuple[int, ...]
    shell: RemoteShell
    job: JobMachine | None = None
    addresses: tuple[str, ...] | None = None

    @property
    def first_address(self) -> str:
        """Where the first host is reached (its address, else its name)."""
        return (self.addresses or self.hosts)[0]

    def ranks(self) -> range:
        """The global ranks these hosts run: all of the job's, or this machine's share."""
        first = self.job.machine_rank * self.shares[0] if self.job is not None else 0
        return range(first, first + sum(self.shares))


@dataclass(frozen=True)
class Keeper:
    """What keeps a ``keep_workers`` launch's workers, given by the entry point above the
    launcher: ``serve(address, secret, names)``, what each rank runs once its function
    returned (``interactive.on_rank.serve_kept``, sent by reference in the payload), and
    ``make(run, end)``, what then makes the ``nbaccel.Workers`` group in the kernel."""

    serve: Callable[[str, str, Any], None]
    make: Callable[[Run, KeptEnd], Any]


@dataclass(frozen=True)
class KeptEnd:
    """Where the ranks of a ``keep_workers`` launch connect once the function has returned
    on every rank (``interactive.connect``: the kernel's listening socket, the address the
    ranks were given and the launch's secret), and ``make``: what turns the run and this
    into an ``nbaccel.Workers`` group (given by the entry point above the launcher, which
    chooses how the group's calls are shown). Never pickled: a detached run is refused."""

    listener: socket.socket
    address: str
    token: str
    gpus: int  # GPUs the run uses (0: CPU), for the group's displays
    make: Callable[[Run, KeptEnd], Any] | None = None


@dataclass(frozen=True)
class Planned:
    """Everything about a launch but its processes (see ``api.plan``)."""

    run_id: str
    resolved: Resolved
    xla: XlaPlan | None
    gpus: int  # GPUs the run uses (0: CPU or torch_xla)
    world_size: int
    payload: Payload  # what every worker reads: function, args, config, shared buffers
    env: dict[str, str]  # the launching process's environment, the base of each worker's
    cwd: str
    placement: HostPlacement | None = None  # several machines (hosts=...); None: this one
    keep: KeptEnd | None = None  # keep_workers: where the ranks connect after the function
