"""A worker started by torch elastic on a host of a several-machine launch (``agent_main.py``).

torch elastic forks it from the host's agent with the torch.distributed variables set
(RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT: the rendezvous' own
store). It connects twice to the agent's private socket (its output, then its events), each
connection opened with one hello frame naming its rank, and runs the shared bootstrap
(``worker_bootstrap.run_payload``). The process group is started from the environment
elastic set; nothing here chooses an address or a port.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext
from nbaccel.events import EventWriter, encode_frame
from nbaccel.launcher.prctl import flush_c_stdio, set_parent_death_signal
from nbaccel.launcher.worker_bootstrap import capture_output, run_payload


def run_elastic_worker(address: str, payload_fd: int, run_id: str, run_dir: str) -> None:
    """The entry point torch elastic calls in each forked worker (a module-level function)."""
    os.setsid()  # a stop from the agent reaches this worker's children too (DataLoader)
    set_parent_death_signal(signal.SIGKILL)  # the agent gone: so are we
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the agent's stdin is the kernel's control channel, not ours
    os.close(null)
    rank = int(os.environ["RANK"])
    capture_output(_connect(address, rank, "log"))
    events = EventWriter(_connect(address, rank, "events"))
    events.send({"kind": "started", "pid": os.getpid(), "time": time.time()})
    context = ProcessContext(
        rank=rank,
        local_rank=int(os.environ["LOCAL_RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
        node_rank=int(os.environ["GROUP_RANK"]),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        run_id=run_id,
        run_dir=run_dir,
    )
    code = run_payload(
        context, events, os.dup(payload_fd), start=_start_distributed, finish=_finish
    )
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    flush_c_stdio()
    if code:
        # torch elastic records a failure by the exit code; the error itself was sent.
        raise SystemExit(code)
    # Returning (not os._exit) lets elastic collect the return value it waits for; its fork
    # start method ends the process with os._exit, so no interpreter teardown runs.


def _connect(address: str, rank: int, channel: str) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    hello = {"rank": rank, "channel": channel, "pid": os.getpid()}
    sock.sendall(encode_frame(hello))
    return sock.detach()


def _start_distributed(config: Config) -> None:
    if not config.init_process_group:
        return
    import torch

    use_cuda = torch.cuda.is_available() and not config.use_cpu
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=config.collective_timeout))


def _finish() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
