"""Who a worker is (rank, world size, ...) and what it was launched with.

The launcher builds a ``ProcessContext`` per rank and sends it, with the resolved Config,
inside the payload. In the worker, ``active_session()`` returns them together with the
event writer; outside a launched worker it returns None. That one slot is set once per
worker process by the worker's bootstrap and never in the parent. Plain data, stdlib only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from nbaccel.config.schema import Config
from nbaccel.frames import EventWriter
from nbaccel.hardware.xla_plan import XlaPlan


@dataclass(frozen=True)
class ProcessContext:
    """The distributed identity of one worker.

    >>> ctx = ProcessContext(rank=1, local_rank=1, world_size=2, local_world_size=2,
    ...                      node_rank=0, master_addr="127.0.0.1", master_port=29512,
    ...                      run_id="r1")
    >>> ctx.torch_env()["RANK"], ctx.is_main_process
    ('1', False)
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    run_id: str
    # The run's folder on this machine (trackers and checkpoints default under it); empty
    # when the launcher has none (scripts started by torchrun).
    run_dir: str = ""

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def torch_env(self) -> dict[str, str]:
        """The torch.distributed environment variables (what torchrun sets) for this rank."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


@dataclass
class WorkerSession:
    """Everything a running worker knows about its launch."""

    context: ProcessContext
    config: Config
    events: EventWriter
    metric_steps: int = 0
    xla: XlaPlan | None = None  # set when torch_xla started this worker
    # The rank's debug channel (launcher.debug.rank_channel.RankDebugger): interactive
    # workers open post-mortems on it.
    debugger: Any = None
    # [step, values, time] of each metric logged here: checkpoints carry the curve, so a
    # resumed run's dashboard goes on from it.
    metric_history: list[list[Any]] = field(default_factory=list)
    # checkpoint_extras(staging folder, rank): what the bootstrap adds to each checkpoint
    # (torch.compile's artifacts); functions run when the user's function has returned.
    checkpoint_extras: Any = None
    at_function_end: list[Any] = field(default_factory=list)
    # nbaccel.save_due()'s per-launch state, and the stop it agreed (steps, where, why):
    # the function's return then ends the rank as stopped.
    loop_state: Any = None
    stop_agreed: tuple[int, str, str] | None = None
    # The last Accelerator made here, held: kept workers (keep_workers) find the model it
    # prepared once the function has returned (its locals gone).
    accelerator: Any = None


_active: WorkerSession | None = None
# torch_xla runs several devices of one process in threads (TPU v2/v3, the CPU device with
# CPU_NUM_DEVICES > 1): each thread is a rank of its own, so there the slot is per thread.
_per_thread = threading.local()


def activate(session: WorkerSession, *, per_thread: bool = False) -> None:
    """Called once by the worker bootstrap (per thread for threaded XLA devices), before the
    user's function runs."""
    global _active
    if per_thread:
        _per_thread.session = session
    else:
        _active = session


def active_session() -> WorkerSession | None:
    """The launch this process belongs to, or None outside an nbaccel worker.

    >>> active_session() is None
    True
    """
    session: WorkerSession | None = getattr(_per_thread, "session", None)
    return session if session is not None else _active
