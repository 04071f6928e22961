"""Several machines: torch.distributed.elastic with c10d rendezvous (``nbaccel launch`` only).

Each machine runs ``nbaccel launch --num_machines N --machine_rank R --main_process_ip IP
--main_process_port P --num_processes TOTAL script.py`` (or ``--nproc_per_node``). Machine 0
hosts the rendezvous store; the elastic agent on each machine starts its share of the TOTAL
(``Config.processes_per_machine``) once all N machines have joined, labels
their output by rank, and stops everyone when one fails. torch is imported here, in the
terminal's launcher process: never in a notebook kernel.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from nbaccel.config.accelerate.compat import accelerate_env
from nbaccel.config.schema import Config, worker_threads
from nbaccel.hardware.devices import choose_gpus, visible_gpu_count
from nbaccel.launcher.checks import check_gpus_suffice

DEFAULT_MULTINODE_PORT = 29500


def launch_machines(
    config: Config, target: str, is_module: bool, argv: list[str], run_dir: Path
) -> int:
    """Run the script on this machine's share of the job; returns a shell exit code."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    visible = None if config.use_cpu else visible_gpu_count(os.environ)
    chosen = choose_gpus(config.gpu_ids, os.environ, visible=visible)
    gpus = chosen.count
    per_machine = config.processes_per_machine(gpus)
    asked = f"num_processes={config.num_processes} over num_machines={config.num_machines}"
    most = gpus * config.num_machines
    check_gpus_suffice(
        per_machine, gpus, os.environ, asked=asked, most=most, gpu_ids=config.gpu_ids
    )
    port = config.main_process_port or DEFAULT_MULTINODE_PORT
    endpoint = f"{config.main_process_ip}:{port}"
    launch_config = LaunchConfig(
        min_nodes=config.num_machines,
        max_nodes=config.num_machines,
        nproc_per_node=per_machine,
        run_id=f"nbaccel-{port}",
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={
            "join_timeout": max(1, round(config.rdzv_timeout)),
            "is_host": config.machine_rank == 0,
        },
        max_restarts=config.max_restarts,  # torch elastic restarts every machine's workers
        monitor_interval=0.1,
        start_method="spawn",
        log_line_prefix_template="[rank ${rank}] ",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir), redirects=Std.NONE, tee=Std.ALL),
    )
    worker_env = accelerate_env(config, on_cpu=config.use_cpu or not gpus) | chosen.worker_env()
    inherited = worker_env.get("OMP_NUM_THREADS")
    worker_env["OMP_NUM_THREADS"] = worker_threads(config, per_machine, inherited)
    args = ["-u", "-m", "nbaccel.launcher.bootstrap.script", json.dumps(worker_env)]
    args += ["-m", target] if is_module else [target]
    try:
        elastic_launch(launch_config, sys.executable)(*args, *argv)
    except ChildFailedError as failure:
        rank, first = failure.get_first_failure()
        code = first.exitcode
        how = f"was killed by {first.signal_name()}" if code < 0 else f"exited with code {code}"
        print(f"nbaccel: rank {rank} {how} (first failure; logs in {run_dir}).", file=sys.stderr)
        return 128 - code if code < 0 else code or 1
    except RendezvousError as error:
        print(
            f"nbaccel: the rendezvous at {endpoint} did not complete within "
            f"{config.rdzv_timeout:g} s: not all {config.num_machines} machines joined"
            f"{f' ({error})' if str(error) else ''}. "
            "Check that every machine runs `nbaccel launch` with the same --main_process_ip and "
            "--main_process_port, that machine 0 can be reached on that port, or raise "
            "--rdzv_timeout.",
            file=sys.stderr,
        )
        return 1
    return 0
