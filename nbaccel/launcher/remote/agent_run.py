"""One host's share of a several-machine launch, run by torch elastic (``agent_main.py``).

``run_host`` hands torch elastic (``elastic_launch``: ``LocalElasticAgent``; the static
rendezvous, or c10d's where elastic restarts workers) this host's workers: ``nproc`` forks of
the agent running ``agent_worker.run_elastic_worker``. Node 0 hosts the rendezvous store on
a port it picks, listening at host0's address only (``rendezvous_listener``); every node
joins it at ``host0:port``. torch is imported here, in the agent: never in the kernel.

A one-machine run (one node on a loopback address: ``hosts_launch.place_here``) listens on
loopback only, as every one-machine run does. elastic's c10d TCPStores would listen on every
interface (and its forked workers would inherit them), so there the rendezvous keeps its
state in a file store in the agent's private folder (torch's own c10d backend, its
``store_type=file``: no other node has to reach it), and the workers' store is not the
agent's but rank 0's, on MASTER_ADDR (``agent_worker._start_distributed``).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

from nbaccel.launcher.remote.store_socket import listen_where_reached
from nbaccel.launcher.run_folder import private_folder
from nbaccel.launcher.sharing.memfd import NoSharedMemory, new_fd
from nbaccel.launcher.sharing.packing import close_fds
from nbaccel.launcher.sharing.segments import Segment, pwrite_all

MONITOR_INTERVAL = 0.02  # seconds between torch elastic's looks at this host's workers
RESOLVE_TIMEOUT = 5.0  # a rendezvous address that takes longer to resolve fails the launch
# How long a host waits for the first host's rendezvous to accept a connection. The first
# host listens moments after it names its port (the kernel relays it only then): measured
# well under a second; anything much longer is a firewall or an address that leads elsewhere.
REACH_TIMEOUT = 30.0


class JobNotFormed(Exception):
    """The machines of a launch cannot all meet (a job launched from each machine's cell
    whose machines did not, or an address that does not resolve): the agent says why as it
    is, without a traceback."""


class AddressNotResolved(JobNotFormed):
    """A rendezvous address does not resolve on this host."""


class RendezvousUnreachable(JobNotFormed):
    """The first host's rendezvous does not accept this host's connections."""


def check_reaches(host: str, port: int) -> None:
    """Return once the first host's rendezvous at ``host:port`` accepts a TCP connection
    (closed at once: torch's store counts no such connection as a worker), retrying while
    it is refused (not listening yet); fail after REACH_TIMEOUT, naming where and why,
    instead of torch's store client retrying until the join timeout (15 minutes)."""
    deadline = time.monotonic() + REACH_TIMEOUT
    pause, why = 0.01, "no attempt"
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=min(left, 5.0)):
                return
        except OSError as error:
            why = error.strerror or str(error) or type(error).__name__
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))  # backoff, bounded
        pause = min(pause * 2, 0.5)
    raise RendezvousUnreachable(
        f"the first host's rendezvous at {host}:{port} did not accept a connection from "
        f"{socket.gethostname()} within {REACH_TIMEOUT:g} s (last: {why}). Every host must "
        "reach the first host at that address and port (a free port, chosen per launch): "
        "open the ports between the hosts in their firewall, or name the first host by an "
        'address the others reach (with hosts="slurm", its NodeAddr).'
    )


def check_resolves(start: dict[str, Any], resolve: Any = socket.getaddrinfo) -> None:
    """Fail at once, naming the address, if this host cannot resolve its own rendezvous
    address or the first host's: c10d would retry it for minutes ("The IPv6 network
    addresses of (n1, ...) cannot be retrieved"). Each lookup is bounded by RESOLVE_TIMEOUT.

    >>> check_resolves({"local_addr": "127.0.0.1", "endpoint_host": "localhost"})
    """
    roles = (
        ("this host's own", start.get("local_addr")),
        ("the first host's", start["endpoint_host"]),
    )
    for role, address in roles:
        if not address:
            continue  # None: elastic takes this host's name, as torchrun does
        error = _resolution_error(resolve, address)
        if error is not None:
            raise AddressNotResolved(
                f"{address!r}, {role} rendezvous address, does not resolve on "
                f"{socket.gethostname()} ({error}). torch elastic binds and connects there. "
                "Name each host as every host resolves it: an IP address, or a name in DNS "
                "or /etc/hosts on every host (an alias of ~/.ssh/config is not); with "
                'hosts="slurm", give the node a NodeAddr that resolves on every node.'
            )


def _resolution_error(resolve: Any, address: str) -> str | None:
    """Why ``address`` does not resolve (None: it does), asked in a thread that is left
    behind if the resolver hangs."""
    said: list[str | None] = []

    def look_up() -> None:
        try:
            resolve(address, None)
            said.append(None)
        except OSError as error:
            said.append(str(error))

    lookup = threading.Thread(target=look_up, name="nbaccel-resolve", daemon=True)
    lookup.start()
    lookup.join(RESOLVE_TIMEOUT)
    return said[0] if said else f"no answer within {RESOLVE_TIMEOUT:g} s"


def _not_formed(start: dict[str, Any], error: BaseException) -> str:
    where = f"{start['endpoint_host']}:{start['endpoint_port']}"
    role = "served by this machine" if start["node_rank"] == 0 else "of machine 0"
    return (
        f"the machines of the job did not all meet within {start['join_timeout']} s at "
        f"{where} (the rendezvous {role}; this is node_rank {start['node_rank']} of "
        f"{start['nnodes']}): {str(error).strip()} Run the same cell on every machine with "
        "the same num_nodes, master_addr (machine 0's address) and use_port, each with its "
        "own node_rank; check that the other machines reach machine 0 on that port "
        "(firewall), or raise rdzv_timeout."
    )


def versions() -> dict[str, str]:
    """What this agent runs, for its first message; importing torch here, so that a launch
    finds it imported. Plain strings: ``torch.__version__`` is a ``TorchVersion``, and the
    kernel reading one would import torch (it refuses to: ``nbaccel.unpickling``)."""
    import torch

    return {
        "python": sys.version.split()[0],
        "nbaccel": metadata.version("nbaccel"),
        "torch": str(torch.__version__),
        "hostname": socket.gethostname(),
    }


def rendezvous_listener(start: dict[str, Any]) -> socket.socket:
    """Node 0's socket for the rendezvous store, on a free port, listening at the address of
    ``endpoint_host`` (the name every host was given for node 0), not on every interface:
    ``run_host`` hands it to the store (``store_socket``)."""
    return listen_where_reached(start["endpoint_host"], 0, machines=start["nnodes"])


def on_loopback_only(start: dict[str, Any]) -> bool:
    """Whether the launch is one node at a loopback address: nothing outside this machine
    takes part, so nothing of it need listen beyond loopback.

    >>> on_loopback_only({"nnodes": 1, "local_addr": "127.0.0.1"})
    True
    >>> on_loopback_only({"nnodes": 2, "local_addr": "127.0.0.1"})
    False
    >>> on_loopback_only({"nnodes": 1, "local_addr": "gpu-node-7"})
    False
    """
    if start["nnodes"] != 1:
        return False
    try:
        return ipaddress.ip_address(start["local_addr"]).is_loopback
    except ValueError:  # a host name: a host of hosts=, reached by name
        return False


def run_host(
    start: dict[str, Any],
    worker_address: str,
    stop_fd: int,
    listener: socket.socket | None = None,
) -> tuple[bool, dict[int, int]]:
    """Run this host's workers to the end: (all succeeded, exit statuses elastic knows by
    global rank: minus the signal that ended a worker). Which global ranks live here is
    elastic's choice (the rendezvous orders the hosts, and may order them differently after
    a restart), so the caller learns the rest from the workers' own hello.

    ``start["max_restarts"]``: how often elastic restarts every host's workers after one
    fails (elastic's own restart: stop all, rendezvous again, start all). ``stop_fd``: the
    read end of the agent's stop pipe, which workers check before running anything.
    ``listener``: node 0's ``rendezvous_listener``, where the rendezvous store listens."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from nbaccel.launcher.remote.agent_worker import run_elastic_worker

    if not on_loopback_only(start):
        check_resolves(start)
        # hosts=: node 0 listens as the kernel relays its port. (A job's machines, each
        # launched from its own cell, may wait for machine 0 as long as join_timeout says.)
        if start["node_rank"] != 0 and "job" not in start:
            check_reaches(start["endpoint_host"], int(start["endpoint_port"]))
    os.environ.update(start["env"])
    if os.path.isdir(start["cwd"]):
        os.chdir(start["cwd"])
    run_dir = Path(start["run_dir"])  # the kernel's path, on this host
    private_folder(run_dir.parent)
    private_folder(run_dir)
    payload_fd = _payload_file(start["payload"])
    # The payload's large buffers, received once for this host: one segment each, which
    # every worker forked below maps (sharing.segments).
    data_fds = [_segment(data) for data in start.get("data", ())]
    # elastic keeps a folder of per-worker error files; ours, removed at the end.
    elastic_dir = tempfile.mkdtemp(prefix="nbaccel-elastic-")
    rdzv_configs: dict[str, Any] = {"join_timeout": start["join_timeout"]}
    backend = start.get("rendezvous", "c10d")
    if on_loopback_only(start):  # one node: c10d's file store, whatever was asked (no order
        # of machines to keep; torch's static rendezvous has no file store)
        backend = "c10d"
        endpoint = os.path.join(elastic_dir, "rendezvous")
        rdzv_configs["store_type"] = "file"
    else:
        endpoint = f"{start['endpoint_host']}:{start['endpoint_port']}"
        rdzv_configs["is_host"] = start["node_rank"] == 0
    # torch's switch: c10d's rendezvous shares no TCPStore of the agent's with the workers (on
    # a free port, it would listen on every interface); rank 0 of each attempt serves theirs
    # at its MASTER_ADDR (agent_worker). The static rendezvous always shares its own store.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # elastic would take SIGTERM over as its agent's death (workers SIGTERMed, killed 30 s
    # later, the launch failed): the agent answers it by saving (agent_main), so elastic is
    # left the other signals (its LaunchConfig field, where this torch has it).
    keep_sigterm: dict[str, Any] = {"signals_to_handle": "SIGINT,SIGHUP,SIGQUIT"}
    if "signals_to_handle" not in getattr(LaunchConfig, "__dataclass_fields__", {}):
        keep_sigterm = {}
    if backend == "static":
        # Launches without restarts: torch's static rendezvous, where node_rank (not the
        # order of arrival) places the machine. A job whose machines each launch from their
        # own kernel, or the hosts of hosts= (their order in the list).
        rdzv_configs = {"rank": start["node_rank"], "timeout": start["join_timeout"]}
    config = LaunchConfig(
        min_nodes=start["nnodes"],
        max_nodes=start["nnodes"],
        nproc_per_node=start["nproc"],
        run_id=start.get("job", start["run"]),  # the same on every machine of the job
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=int(start.get("max_restarts", 0)),
        # elastic's workers wait, after the function returns, until the agent's monitor has
        # read every return value (its _poll, once an interval). With 0.1 s a warm 2-host
        # launch's end took 0.095-0.10 s, with 0.02 s 0.08 s (multi_host_launch.py).
        monitor_interval=MONITOR_INTERVAL,
        start_method="fork",
        local_addr=start["local_addr"],  # None: this host's name, as torchrun
        logs_specs=DefaultLogsSpecs(log_dir=elastic_dir, redirects=Std.NONE, tee=Std.NONE),
        **keep_sigterm,
    )
    served = None
    try:
        if listener is not None and rdzv_configs.get("store_type") != "file":
            # The rendezvous store, on node 0's listener before elastic asks for it: elastic's
            # store of that port is this one's server (multi-tenant: store_socket), which
            # lives while one of them holds it: this one, until the launch ends.
            served = _serve_store(start, listener)
        values = elastic_launch(config, run_elastic_worker)(
            worker_address,
            payload_fd,
            start["run"],
            start["run_dir"],
            stop_fd,
            bool(start.get("share_rank0", False)),
            start.get("memory_host"),
            tuple(data_fds),
        )
        return True, {int(rank): 0 for rank in values}
    except ChildFailedError as error:
        return False, {int(rank): failure.exitcode for rank, failure in error.failures.items()}
    except DistError as error:  # the static rendezvous: machine 0's store, or reaching it
        if "job" not in start:  # hosts=: the kernel names the host and shows the traceback
            raise
        raise JobNotFormed(_not_formed(start, error)) from error
    finally:
        del served
        os.close(payload_fd)
        close_fds(data_fds)
        shutil.rmtree(elastic_dir, ignore_errors=True)


def _payload_file(payload: bytes) -> int:
    """A file holding ``payload`` for elastic's forked workers: a memfd, or a temporary file
    where this host's Python can make none (``memfd``)."""
    try:
        fd = new_fd("nbaccel-payload")
    except NoSharedMemory:
        fd = os.dup((file := tempfile.TemporaryFile()).fileno())
        file.close()
    try:
        pwrite_all(fd, memoryview(payload), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _segment(data: bytes) -> int:
    """A memfd holding ``data`` (elastic forks the workers: they inherit it)."""
    segment, _ = Segment.write([memoryview(data)])
    return segment.fd


def _serve_store(start: dict[str, Any], listener: socket.socket) -> object:
    """A multi-tenant store served on ``listener`` (taken over: closed with the store)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    served: object = TCPStore(
        start["endpoint_host"],
        start["endpoint_port"],
        is_master=True,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
        wait_for_workers=False,
        timeout=timedelta(seconds=start["join_timeout"]),
    )
    return served
