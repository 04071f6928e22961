"""``nbaccel.save_due()``: periodic saves and save-and-stop for a loop without the Accelerator.

A plain torch loop (its own DDP, its own ``torch.save``) calls it once per step on every
rank; it answers, the same on every rank, whether to save now (``checkpoint_every``) and
whether to stop after saving (SIGTERM/SIGUSR1 to any rank, ``max_duration``, Save & stop).
The agreement is the Accelerator's (``agreement.py``): one small all-reduce every ~0.2 s of
steps. A run whose function returns after a stop was answered ends ``stopped``.

    for step in range(start, total):
        train_one_step()
        due = nbaccel.save_due()
        if due.save:
            save_my_checkpoint(due.checkpoint_dir, step)
        if due.stop:
            break
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbaccel.accel.autosave.agreement import StepAgreement
from nbaccel.accel.autosave.stop_requests import StopRequests
from nbaccel.config import cadence
from nbaccel.context import active_session
from nbaccel.errors import ANOTHER_RANK


@dataclass(frozen=True)
class SaveDue:
    """What ``save_due`` answers: save now, stop after it, at which call (``step``: calls
    so far, counted from 1), and where the launch puts checkpoints.

    >>> due = SaveDue(save=False, stop=False, step=3, checkpoint_dir="")
    >>> bool(due)
    False
    """

    save: bool
    stop: bool
    step: int
    checkpoint_dir: str

    def __bool__(self) -> bool:
        return self.save or self.stop


class _LoopState:
    """One worker's count of steps, its stop requests and its agreement (kept on its
    ``WorkerSession``: per launch, never in a global)."""

    def __init__(self, config: Any, world_size: int) -> None:
        self.steps = 0
        self.requests = StopRequests()
        self.requests.install(restartable=config.max_restarts > 0)
        self.agreement = StepAgreement(_sum_over_ranks, world_size, cadence.effective(config))


def save_due() -> SaveDue:
    """Call once per step on every rank; see the module's docstring. Outside a launched
    worker nothing is ever due (the same loop runs anywhere).

    >>> save_due()
    SaveDue(save=False, stop=False, step=0, checkpoint_dir='')
    """
    session = active_session()
    if session is None:
        return SaveDue(False, False, 0, "")
    state = getattr(session, "loop_state", None)
    if state is None:
        state = _LoopState(session.config, session.context.world_size)
        session.loop_state = state
    state.steps += 1
    decision = state.agreement.at_step(state.steps, stop_asked=state.requests.requested)
    where = session.config.checkpoint.dir
    if decision is None:
        return SaveDue(False, False, state.steps, where)
    if decision.save:
        state.agreement.saved(state.steps)
    if decision.stop:
        why = state.requests.why or ANOTHER_RANK
        session.stop_agreed = (state.steps, where, why)
        state.requests.uninstall()
    return SaveDue(decision.save, decision.stop, state.steps, where)


def _sum_over_ranks(values: list[int]) -> list[int]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    summed = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(summed)
    return [int(v) for v in summed.tolist()]
