"""Start a planned launch's workers on this machine, through the helper.

``api.start`` plans a launch in the kernel and calls ``start_planned`` for one machine; a
detached run's supervisor calls it in its own process. The rendezvous port is bound here and
its listening socket handed to rank 0, so no other process can take it.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

from nbaccel.config.accelerate.compat import accelerate_env
from nbaccel.config.resolve import Resolved
from nbaccel.config.schema import Config, worker_threads
from nbaccel.context import ProcessContext
from nbaccel.errors import ConfigError
from nbaccel.hardware.devices import loopback_interface
from nbaccel.hardware.xla_plan import xla_worker_env
from nbaccel.launcher.local.helper import (
    held_helper,
    offer_libraries,
    shared_helper,
    take_notices,
)
from nbaccel.launcher.planned import Display, Planned, shown
from nbaccel.launcher.run import Run
from nbaccel.launcher.run_folder import make_run_dir, write_config
from nbaccel.launcher.sharing.memfd import take_notice as shared_memory_notice


def start_planned(planned: Planned, *, show: Display, result_boxes: bool = True) -> Run:
    """Start a planned launch's workers in this process's helper; ``show`` sees the run.
    ``result_boxes``: values come back with their large buffers in shared memory (a
    detached run's supervisor, which sends values on to a kernel, takes them whole)."""
    resolved, xla, gpus, run_id = planned.resolved, planned.xla, planned.gpus, planned.run_id
    # Bind the rendezvous port here and hand the listening socket to rank 0: the port is
    # held from the moment it is chosen, so no other process can take it.
    listener = _rendezvous_listener(resolved)
    try:
        run_dir = make_run_dir(resolved.config.runs_dir, run_id)
    except BaseException:
        listener.close()
        raise
    payload = planned.payload
    with tempfile.TemporaryFile() as payload_file, listener:
        helper = shared_helper()  # started on first use; it imports torch while we go on
        helper.preload_wanted = resolved.config.preload_libraries
        offer_libraries(helper)  # for the next launch: the helper is busy with this one
        write_config(run_dir, resolved)
        run = Run(run_id, run_dir, resolved.config, planned.world_size, xla=xla)
        run._keep = planned.keep
        show_rest = show(run, gpus)  # subscribed now; the rest while the ranks start
        payload_file.write(payload.data)
        payload_file.flush()
        port = listener.getsockname()[1]
        requests = [
            {
                "context": context,
                "env": worker_env(context, resolved.config, planned.env, on_cpu=not gpus)
                | (xla_worker_env(xla) if xla else {}),
                "cwd": planned.cwd,
            }
            for context in _contexts(run_id, planned.world_size, port, run_dir)
        ]
        # torch_xla's rank 0 serves its own store on MASTER_PORT: the port is released for it
        # when this block ends, just before its workers start (they take seconds to import).
        data_fds = payload.data_fds
        # The helper again, held: the same one, or its replacement if it retired meanwhile
        # (a library it preloaded was unsafe); one that retires from now on serves this run.
        try:
            with held_helper() as held:
                if held is not helper:
                    held.preload_wanted = resolved.config.preload_libraries
                    offer_libraries(held)
                # How this process makes shared memory, where it is not os.memfd_create: said
                # by the first launch (not by a payload built to warm up, api.warm_planning).
                told = shared_memory_notice()
                run.notices = take_notices() + ([told] if told else []) + list(payload.notices)
                run.start(
                    held,
                    requests,
                    payload_file.fileno(),
                    listener.fileno(),
                    data_fds,
                    result_boxes=result_boxes,
                )
            try:
                payload.settle(planned.world_size)  # the workers wait for it, started meanwhile
                shown(show_rest)  # the dashboard's widgets, while the ranks start
            except BaseException:
                # Unanswered, the workers stop with an error that cannot say why; this one
                # does: it is raised here, once they are down. A display that failed to
                # show leaves no workers behind either.
                with contextlib.suppress(Exception):
                    run.stop()
                raise
        finally:
            payload.close()  # every worker holds the segments now
    return run


def _rendezvous_listener(resolved: Resolved) -> socket.socket:
    """A listening socket on loopback: ``main_process_port`` if set, else a free port."""
    port = resolved.config.main_process_port or 0
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
    except OSError as error:
        listener.close()
        raise ConfigError(
            f"main_process_port={port} (from {resolved.sources['main_process_port']}) cannot "
            f"be used on 127.0.0.1: {error.strerror or error}. Another process holds it: "
            "choose another port, or leave main_process_port unset for a free one.",
            field="main_process_port",
        ) from None
    return listener


def worker_env(
    context: ProcessContext, config: Config, base: Mapping[str, str], *, on_cpu: bool
) -> dict[str, str]:
    """One worker's environment: the parent's, plus torch.distributed and Accelerate variables."""
    env = dict(base)
    env.update(context.torch_env())
    # What Hugging Face Accelerate reads, so code written for it runs unchanged.
    env.update(accelerate_env(config, on_cpu=on_cpu))
    # Threads are sized once per worker (torch.set_num_threads reads this in the worker).
    inherited = env.get("OMP_NUM_THREADS")
    env["OMP_NUM_THREADS"] = worker_threads(config, context.local_world_size, inherited)
    env["PYTHONUNBUFFERED"] = "1"
    # gloo (and NCCL's bootstrap) bind to whatever the host name resolves to, a LAN address
    # on many machines, and their ports take no authentication. One machine needs nothing
    # but loopback: pin both to it, whatever the kernel's environment says.
    loopback = loopback_interface()
    if loopback is not None:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = loopback
    if env.get("MPLBACKEND", "").startswith("module://"):
        env["MPLBACKEND"] = "Agg"  # the notebook's inline backend needs a kernel
    return env


def _contexts(run_id: str, world_size: int, port: int, run_dir: Path) -> list[ProcessContext]:
    return [
        ProcessContext(
            rank=rank,
            local_rank=rank,
            world_size=world_size,
            local_world_size=world_size,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
            run_id=run_id,
            run_dir=str(run_dir),
        )
        for rank in range(world_size)
    ]
