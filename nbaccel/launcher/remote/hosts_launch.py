"""Start a planned launch on several hosts: a ``Run`` fed by one agent per host.

The kernel side of ``hosts=[...]``: the run folder, ``config.json`` and the display are
made as for one machine (``api.start_planned``); the workers come from ``RemoteHosts``
instead of the helper, and rank 0's rendezvous is torch elastic's on the first host.

A one-machine launch with ``max_restarts`` goes the same way (``place_here``): one agent on
this machine, started without SSH, so torch elastic restarts its workers; its rendezvous is
on 127.0.0.1 and its workers' gloo/NCCL sockets on the loopback interface.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence

from nbaccel.config.accelerate.compat import accelerate_env
from nbaccel.config.schema import Config, worker_threads
from nbaccel.context import ProcessContext
from nbaccel.errors import ConfigError
from nbaccel.hardware.devices import loopback_interface
from nbaccel.launcher.checks import check_gpus_suffice
from nbaccel.launcher.planned import Display, HostPlacement, JobMachine, Planned, shown
from nbaccel.launcher.remote.agent_link import AGENTS
from nbaccel.launcher.remote.elastic import DEFAULT_MULTINODE_PORT
from nbaccel.launcher.remote.hosts import processes_per_host, read_hosts
from nbaccel.launcher.remote.preflight import local_versions
from nbaccel.launcher.remote.remote_hosts import RemoteHosts
from nbaccel.launcher.remote.slurm_nodes import node_addresses
from nbaccel.launcher.remote_shell import RemoteShell
from nbaccel.launcher.run import Run
from nbaccel.launcher.run_folder import make_run_dir, write_config
from nbaccel.launcher.sharing.memfd import take_notice as shared_memory_notice

# Per host, to connect and read its versions (an SSH connection, then Python's start).
PREFLIGHT_TIMEOUT = 30.0


def start_on_hosts(planned: Planned, *, show: Display) -> Run:
    """Start ``planned`` with ``shares[i]`` processes on ``hosts[i]``; the run, started."""
    assert planned.placement is not None
    config, placement = planned.resolved.config, planned.placement
    run_dir = make_run_dir(config.runs_dir, planned.run_id)
    shell, local, job = placement.shell, placement.shell.kind == "local", placement.job
    starter = RemoteHosts(
        placement.hosts,
        placement.shares,
        shell,
        run_dir,
        local=local,
        job=job,
        addresses=placement.addresses,
    )
    try:
        if local and job is None:
            env = local_worker_env(config, planned)
        else:  # a machine of a job: its workers reach the other machines, not only loopback
            env = remote_worker_env(config)
        starter.configure(
            {
                "run": planned.run_id,
                "env": env,
                "cwd": planned.cwd,
                "run_dir": str(run_dir),
                "join_timeout": max(1, round(config.rdzv_timeout)),
                "max_restarts": config.max_restarts,
            }
        )
        write_config(run_dir, planned.resolved)
        ranks = placement.ranks()
        run = Run(planned.run_id, run_dir, config, planned.world_size, ranks=ranks)
        run._keep = planned.keep
        shown(show(run, planned.gpus))
        payload = planned.payload
        told = shared_memory_notice()  # where this kernel lacks os.memfd_create, once
        run.notices = ([told] if told else []) + list(payload.notices)
        with tempfile.TemporaryFile() as payload_file:
            payload_file.write(payload.data)
            payload_file.flush()
            requests = [{"context": _context(planned, r)} for r in ranks]
            data_fds = payload.data_fds
            try:  # each agent receives the segments' bytes once and shares them on its host
                run.start(starter, requests, payload_file.fileno(), None, data_fds)
            finally:
                payload.close()
    except BaseException:
        starter.close()
        raise
    return run


def remote_worker_env(config: Config) -> dict[str, str]:
    """What a remote host's workers get on top of their host's own environment.

    Not the kernel's environment: paths, devices and interfaces differ between machines.
    Only what the launch itself decides: Accelerate's variables and unbuffered output.

    >>> remote_worker_env(Config())["PYTHONUNBUFFERED"]
    '1'
    """
    return {**accelerate_env(config, on_cpu=config.use_cpu), "PYTHONUNBUFFERED": "1"}


def local_worker_env(config: Config, planned: Planned) -> dict[str, str]:
    """What the workers of a one-machine agent get on top of the kernel's environment (the
    agent inherits it): what ``api.worker_env`` gives the helper's workers, but the
    torch.distributed variables, which elastic sets. gloo and NCCL bind to the loopback
    interface: nothing of a one-machine run listens on the machine's network addresses."""
    env = accelerate_env(config, on_cpu=not planned.gpus)
    if config.gpu_ids != "all":  # the GPUs chosen (api.plan put them in the plan's env)
        env["CUDA_VISIBLE_DEVICES"] = planned.env["CUDA_VISIBLE_DEVICES"]
    inherited = planned.env.get("OMP_NUM_THREADS")
    env["OMP_NUM_THREADS"] = worker_threads(config, planned.world_size, inherited)
    env["PYTHONUNBUFFERED"] = "1"
    loopback = loopback_interface()
    if loopback is not None:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = loopback
    if planned.env.get("MPLBACKEND", "").startswith("module://"):
        env["MPLBACKEND"] = "Agg"  # the notebook's inline backend needs a kernel
    return env


def place_here(config: Config, world_size: int, *, xla: bool) -> HostPlacement:
    """A one-machine launch with ``max_restarts``: its ``world_size`` workers under one
    nbaccel agent on this machine, whose torch elastic restarts them after a failure."""
    why = "restarts the workers through torch elastic, which cannot restart them"
    _check_elastic_fits(config, xla, "max_restarts", f"max_restarts={config.max_restarts}", why)
    return HostPlacement(("127.0.0.1",), (world_size,), RemoteShell("local"))


def place_machine_of_job(
    config: Config, gpus: int, env: Mapping[str, str], source: str
) -> HostPlacement:
    """This machine's share of a job whose every machine runs the same cell (Accelerate's
    ``num_nodes=N, node_rank=R``; ``num_machines``/``machine_rank``): one agent here, whose
    torch elastic meets the other machines' in the static rendezvous at main_process_ip:
    main_process_port (machine 0 serves it), where machine_rank decides the ranks.
    ``source``: where num_machines came from, for the errors."""
    why = "joins the machines of a job through torch elastic, which would not start them"
    asked = f"num_machines={config.num_machines} (from {source})"
    _check_elastic_fits(config, False, "num_machines", asked, why)
    per_machine = config.processes_per_machine(gpus)
    check_gpus_suffice(
        per_machine,
        gpus,
        env,
        asked=f"num_processes={config.num_processes} over num_machines={config.num_machines}",
        most=gpus * config.num_machines,
        gpu_ids=config.gpu_ids,
    )
    port = config.main_process_port or DEFAULT_MULTINODE_PORT
    job = JobMachine(config.num_machines, config.machine_rank, config.main_process_ip, port)
    return HostPlacement((socket.gethostname(),), (per_machine,), RemoteShell("local"), job=job)


def _check_elastic_fits(config: Config, xla: bool, field: str, asked: str, why: str) -> None:
    clash = (
        ("detach", config.detach, "a detached run's supervisor starts its workers itself"),
        ("strategy", xla, "torch_xla starts its workers itself"),
    )
    for name, present, where in clash:
        if present:
            raise ConfigError(
                f"{asked} {why}, but {name}={getattr(config, name)!r} asks for a launch "
                f"where {where}. Drop one of the two settings (a run resumes with "
                "Accelerator.load_state in a new launch).",
                field=field,
            )


def _context(planned: Planned, rank: int) -> ProcessContext:
    # Only the rank is read on this side; elastic gives each worker its real identity.
    return ProcessContext(
        rank=rank,
        local_rank=rank,
        world_size=planned.world_size,
        local_world_size=planned.world_size,
        node_rank=0,
        master_addr="",
        master_port=0,
        run_id=planned.run_id,
    )


def place_on_hosts(config: Config, env: Mapping[str, str]) -> HostPlacement:
    """Read ``config.hosts``, split ``num_processes`` over them, and check every host can
    run this launch (reachable, same nbaccel and torch): a ConfigError before anything
    starts. ``hosts=("slurm",)`` runs through ``srun`` inside the allocation, its rendezvous
    at the nodes' NodeAddr (``slurm_nodes``)."""
    named: str | Sequence[str] = config.hosts
    if len(config.hosts) == 1 and (config.hosts[0] == "slurm" or os.path.isfile(config.hosts[0])):
        named = config.hosts[0]  # one entry: the allocation, or a hostfile's path
    hosts = read_hosts(named, env)
    shares = processes_per_host(hosts, config.num_processes)
    shell = RemoteShell(
        "srun" if named == "slurm" else "ssh",
        tuple(shlex.split(config.ssh_options)),
        python=config.remote_python or sys.executable,
    )
    names = [host.name for host in hosts]
    # Slurm's node names need not resolve; its NodeAddr do (checked here: before any step).
    addresses = tuple(node_addresses(names, env)) if named == "slurm" else None
    # A host whose agent is kept from an earlier launch passed its check then. The others'
    # agents start now, their first step the check; they import torch while the launch goes on.
    unchecked = [name for name in names if not AGENTS.has_idle(shell, name)]
    AGENTS.start_checked(
        shell, unchecked, timeout=PREFLIGHT_TIMEOUT, local_versions=local_versions()
    )
    return HostPlacement(tuple(names), tuple(shares), shell, addresses=addresses)
