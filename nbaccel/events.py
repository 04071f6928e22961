"""The events from workers to the parent, and the events that subscribers receive.

Workers write the dataclasses below (``WorkerMessage``), framed by ``nbaccel.frames``, to a
pipe that only their parent holds (inherited, never a listening socket: nothing else can
connect or inject). The parent takes each by its type, sets its rank from the pipe, and
passes it on with the events it makes itself (log lines, exits, the end) to the text
printer, the dashboard and ``Run``. Plain data, stdlib only.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The signals a run gives a meaning to (parent and workers agree on them here):
# SIGTERM and SIGUSR1 to a rank, the kernel, a detached run's supervisor or an agent ask
# every rank to save at the same step and stop (what Slurm's --signal, a spot notice or a
# k8s preStop hook send); SIGUSR2 makes a rank write every thread's stack to its log (the
# hang report, run.stacks() for a rank that does not answer): not SIGUSR1, which schedulers
# send to ask for a save.
SAVE_AND_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STACK_DUMP_SIGNAL = signal.SIGUSR2


class RunState(enum.Enum):
    """Lifecycle of a run: PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED | STOPPED
    (every rank saved at the same step on a stop request and ended: resumable)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"

    @property
    def done(self) -> bool:
        return self is not RunState.PENDING and self is not RunState.RUNNING


@dataclass(frozen=True)
class RunStarted:
    run_id: str
    world_size: int
    run_dir: str
    time: float


@dataclass(frozen=True)
class WorkerStarted:
    """A worker process is up (before the function runs): its pid, for memory readings.

    ``host``: where it runs on a several-machine launch (the name the launch was given);
    None on this machine. A pid on another host means nothing here. The worker sends it
    without a host; the parent fills it in.
    """

    rank: int
    pid: int
    time: float
    host: str | None = None
    attempt: int = 0  # torch elastic's restart count (max_restarts): 0 for the first workers


@dataclass(frozen=True)
class ModelPrepared:
    """Rank 0 prepared a model of ``num_params`` parameters (the dashboard's memory estimate)."""

    rank: int
    num_params: int
    time: float


@dataclass(frozen=True)
class SettingsApplied:
    """Rank 0's Accelerator changed settings from the launch's config (a plugin, a kwargs
    handler, its own arguments): ``{flat name: value}`` and each one's source."""

    rank: int
    values: dict[str, Any]
    sources: dict[str, str]
    time: float


@dataclass(frozen=True)
class LogLine:
    """One line of a rank's output.

    ``replace``: it overwrites the rank's previous line (a ``\\r`` redraw, e.g. tqdm).
    ``partial``: it ended with ``\\r``, so the next line of this rank may overwrite it.
    """

    rank: int
    text: str
    replace: bool
    partial: bool
    time: float


@dataclass(frozen=True)
class OutputMark:
    """A mark a rank put in its output (``launcher.output.mark_line``; parent-made): all it
    wrote before came first. Interactive workers mark the end of each command's output. Marks
    are nbaccel's: no log, line or display holds them."""

    rank: int
    text: str
    time: float


@dataclass(frozen=True)
class Metric:
    rank: int
    step: int
    values: Mapping[str, float]
    time: float


@dataclass(frozen=True)
class DeviceMemory:
    """A rank's device memory as its worker read it (XLA: ``xm.get_memory_info``), in bytes.

    ``device``: the worker's device name (e.g. ``xla:0``); ``peak``/``limit`` None when unknown.
    """

    rank: int
    device: str
    used: int
    peak: int | None
    limit: int | None
    time: float


@dataclass(frozen=True)
class StepBreakdown:
    """A rank's training steps over one window (about 0.5 s): where their time went.

    ``phases``: seconds per phase (data, forward, backward, communication, optimizer,
    other; see ``nbaccel.accel.tracking.step_timing``), summed over the ``steps``; together they are
    the steps' time. ``samples``/``tokens``: what the steps took (``tokens``: positions of
    ``input_ids``, None without them). ``peak_memory``: bytes per phase where the device
    reports it (CUDA), else None. ``compile_seconds``: the seconds the rank had spent in
    torch.compile when it sent the window, since it started (the compile happens inside the
    first steps' phases); 0.0 without a compile, and in events written before it existed.
    """

    rank: int
    steps: int
    phases: Mapping[str, float]
    samples: int
    tokens: int | None
    peak_memory: Mapping[str, int] | None
    time: float
    compile_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        """The steps' time: the sum of the phases."""
        return sum(self.phases.values())


@dataclass(frozen=True)
class CheckpointSaved:
    """Rank 0 published a checkpoint (``LATEST`` names it): periodic, or before a stop.
    ``location``: the checkpoint folder or the durable URL it is copied to; ``seconds``:
    from the agreed step to the publish."""

    rank: int
    completed_steps: int
    location: str
    name: str
    stopping: bool
    seconds: float
    time: float


@dataclass(frozen=True)
class RankStopped:
    """A rank ended on a stop request after every rank saved at ``completed_steps``
    (worker -> parent, instead of ``ResultReady``)."""

    rank: int
    completed_steps: int
    checkpoint_dir: str
    why: str
    time: float


@dataclass(frozen=True)
class RankExited:
    """A worker process ended: exit code, or minus the signal number that killed it."""

    rank: int
    exitcode: int
    time: float


@dataclass(frozen=True)
class RunRestarted:
    """torch elastic restarted every worker after a failure (``max_restarts``).

    ``attempt``: the attempt now starting, counted from 0 (the first restart starts attempt
    1), of ``max_restarts + 1`` at most. ``rank``/``host``: who failed (None when unknown);
    ``reason``: how, in a few words (``killed by SIGKILL``, ``raised ValueError: ...``).
    """

    attempt: int
    max_restarts: int
    rank: int | None
    host: str | None
    reason: str
    time: float


@dataclass(frozen=True)
class RunEnded:
    state: RunState
    error: BaseException | None
    elapsed: float
    time: float


@dataclass(frozen=True)
class ResultReady:
    """A rank's function returned (worker -> parent only): its value, pickled, for
    ``Run.result``/``results`` (unpickled there, only when asked). ``buffers``: where the
    pickle's out-of-band buffers lie in the rank's result box (segment, offset, length)."""

    rank: int
    value: bytes
    buffers: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class Rank0Value:
    """Rank 0's value, pickled, read from the job's store by this machine's first worker
    (worker -> parent only). Sent where rank 0 runs on another machine: a job whose
    machines each launch from their own cell (``num_nodes=``, ``node_rank=``), each of
    which returns rank 0's value as Accelerate users expect of a launch."""

    rank: int
    value: bytes


@dataclass(frozen=True)
class WorkerFailed:
    """A rank's function raised or called ``sys.exit`` (worker -> parent only): what the
    parent needs to raise it (``launcher.failures.build_error``).

    ``type``: the exception's qualified name; ``exception``: it pickled, or None when it
    cannot be; ``cause``: 'error' (its own), 'timeout' or 'peer' (caused by another rank).
    """

    rank: int
    type: str
    message: str
    traceback: str
    exception: bytes | None
    cause: str
    time: float


@dataclass(frozen=True)
class ModulesImported:
    """The modules rank 0 imported while it ran, as (name, file) pairs (worker -> parent
    only): the parent picks the installed libraries among them for the helper to preload
    before the next launch (``launcher.local.preloading.preload_choice``). Plain strings:
    nothing the parent unpickles imports anything."""

    rank: int
    modules: tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class Notice:
    """Something the launcher tells about a launch (parent only), shown as ``nbaccel: text``:
    e.g. a library the helper would not preload, and why."""

    text: str
    time: float


@dataclass(frozen=True)
class Waiting:
    """What a launch's workers wait for before they start, said while it lasts (parent
    only; ``starter.py``'s ``waiting`` message): the helper still importing torch (a first
    launch), libraries the helper imports for this launch first. The dashboard's state says
    ``starting: text`` until a worker starts; the text output prints it once."""

    text: str
    time: float


@dataclass(frozen=True)
class StallWarning:
    """No rank printed, logged a metric or finished a step for ``seconds`` (the launch's
    ``stall_warning``): where each rank is now, read from its stack (parent-made, once per
    stall; the run goes on). ``stacks``: ``{rank: text}`` as ``Run.stacks`` gives them;
    ``waits_in``: ``{rank: the collective its main thread waits in, or None}``.

    >>> warning = StallWarning(120.0, {1: "rank 1: in train (t.py:3)"}, {1: "barrier"}, 0.0)
    >>> warning.waits_in[1]
    'barrier'
    """

    seconds: float
    stacks: Mapping[int, str]
    waits_in: Mapping[int, str | None]
    time: float


# What a worker sends on its event pipe: these dataclasses, pickled, and nothing else. The
# parent takes each by its type (``launcher.pump``) and sets ``rank`` from the pipe it came
# on, so no worker can speak for another rank.
WorkerMessage = (
    WorkerStarted
    | ModelPrepared
    | SettingsApplied
    | Metric
    | DeviceMemory
    | StepBreakdown
    | ResultReady
    | Rank0Value
    | WorkerFailed
    | ModulesImported
    | CheckpointSaved
    | RankStopped
)


Event = (
    RunStarted
    | WorkerStarted
    | ModelPrepared
    | SettingsApplied
    | LogLine
    | OutputMark
    | Metric
    | DeviceMemory
    | StepBreakdown
    | RankExited
    | RunRestarted
    | RunEnded
    | Notice
    | Waiting
    | StallWarning
    | CheckpointSaved
    | RankStopped
)
