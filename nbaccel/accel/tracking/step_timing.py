"""``StepTimer``: where each training step's time goes, measured in the worker.

A stopwatch with laps. Every moment of a training loop over a prepared dataloader belongs
to exactly one phase, so the phases of a step add up to the step's time:

- **data**: from the loop asking the prepared loader for a batch until it is handed out
  (loading, collating, the copy to the device);
- **forward**: from the batch handed out until ``accelerator.backward`` (the model's forward
  and the loss: what the loop computes on the batch first);
- **backward**: inside ``accelerator.backward`` until the last gradient is computed;
- **communication**: the rest of ``accelerator.backward`` under DDP / FSDP: waiting for the
  gradient reduction (all-reduce, reduce-scatter) that the last gradients started, and
  writing the reduced gradients back. Reductions of earlier buckets overlap the computation
  and cost no wall time of their own, so they are not counted twice. FSDP on CPU processes
  reduce-scatters inside backward, blocking: those calls count too (``TimedReduceScatter``
  in ``strategies/fully_sharded``); FSDP's all-gathers of parameters stay in the forward
  and backward they serve;
- **optimizer**: inside the prepared optimizer's ``step`` / ``zero_grad`` and clipping;
- **other**: everything else in the loop (logging, the scheduler, the user's code).

A step ends when the loop asks a prepared loader for the next batch, if it trained (ran
``backward`` or an optimizer step). Iterations that did not train (an evaluation loop over
another prepared loader) are dropped, and so is the time between passes over a loader.

Why not DDP's communication hooks: a Python hook replaces the reducer's built-in all-reduce,
which divides the gradients in C++ (a multiplication by 1/N while copying into the bucket);
a hook doing it in Python rounds differently for world sizes that are no power of two and
under ``join_uneven_inputs``, and costs a Python call per bucket. Instead an autograd final
callback, queued from a pre-hook on the loss's node before DDP's and FSDP's own callbacks,
marks the end of the computation; what remains of ``backward`` is the wait for the
reduction. A user's communication hook is never touched.

On CUDA the laps are ``torch.cuda.Event`` pairs on the current stream (the GPU's timeline,
not the CPU's, which runs ahead); they are read a step or more later, once ``query()`` says
the last one completed, so no step waits for the GPU. There each phase also gets its peak
memory without touching any counter the user reads: the allocator's peak
(``torch.cuda.max_memory_allocated``) is never reset, so a script that prints it still reads
its run's peak. Each rise of that peak is credited to the phase during which it rose; a phase
that raised no peak gets the bytes held at its edges (a lower bound). The figures sent are the
highest seen per phase since the timer started, so the phase shown with the highest figure is
where the run's peak was reached.

Steps are summed per window (every ``interval`` = 0.5 s, and when a pass ends) into one
``step_breakdown`` message to the launcher (``nbaccel.metrics.report_step_breakdown``).
The marks cost about 55 us of CPU a step per rank in a 2-process DDP loop on CPU, 0.6 % of
its 9 ms step (``benchmarks/step_overhead.py``, docs/benchmarks.md): each runs right after
the model's compute, with cold caches, so each does as little as it can.
Outside a launched worker the timer is off and costs one attribute test per mark; in one,
``accelerator.strategy.step_timer.enabled = False`` turns it off.

>>> ticks = iter(range(100))  # a clock that advances 1 s per reading
>>> timer = StepTimer(enabled=True, send=print, interval=60, clock=ticks.__next__)
>>> loader = object()
>>> timer.begin_data(loader)             # the loop asks for a batch
>>> timer.end_data(torch.zeros(4, 3))    # handed out after 1 s: 4 samples
>>> previous = timer.enter(BACKWARD)     # forward: 1 s
>>> timer.leave(previous)                # backward: 1 s
>>> timer.begin_data(loader)             # other: 1 s; the step ends, data again
>>> timer.loop_ended(loader)             # the pass ends: the window is sent
{'steps': 1, 'phases': {'data': 1.0, 'forward': 1.0, 'backward': 1.0, 'other': 1.0}, \
'samples': 4, 'tokens': None, 'peak_memory': None}
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nbaccel.accel.nested.batches import batch_len

DATA, FORWARD, BACKWARD = "data", "forward", "backward"
COMMUNICATION, OPTIMIZER, OTHER = "communication", "optimizer", "other"
PHASES = (DATA, FORWARD, BACKWARD, COMMUNICATION, OPTIMIZER, OTHER)
_CALLS = (BACKWARD, COMMUNICATION, OPTIMIZER)  # phases of a call: nesting returns to them
_SEQUENCES = (tuple, list)
INTERVAL = 0.5  # seconds per window: the dashboard redraws at 2-4 Hz
Lap = tuple[str, Any, Any, int]  # CUDA: phase, start event, end event, peak memory


class StepTimer:
    """The laps of this process's training steps, summed and sent per window.

    ``send`` gets each window as a dict (``report_step_breakdown``); ``clock`` is
    ``time.perf_counter`` on CPU. ``device`` (a CUDA device) switches to CUDA events;
    ``cuda`` stands in for ``torch.cuda`` there (tests give a fake one).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        send: Callable[[dict[str, Any]], None],
        distributed: bool = False,
        device: torch.device | None = None,
        interval: float = INTERVAL,
        clock: Callable[[], float] = time.perf_counter,
        cuda: Any = None,
    ) -> None:
        self.enabled = enabled
        self.distributed = distributed  # whether backward waits for a gradient reduction
        self._send = send
        self._interval = interval
        self._clock = clock
        on_cuda = device is not None and device.type == "cuda"
        self._events = CudaMarks(device, cuda) if on_cuda and device is not None else None
        self._phase: str | None = None  # None: no training loop is running
        self._since: Any = None
        # The step in progress: seconds per phase (CPU), or its laps (CUDA: read later).
        self._seconds: dict[str, float] = {}
        self._laps: list[Lap] = []
        self._trained = False  # the step in progress ran backward or an optimizer step
        self._opener: object | None = None  # the loader that began the step in progress
        self._samples = 0
        self._tokens: int | None = None
        self._pending: deque[tuple[list[Lap], int, int | None]] = deque()  # CUDA: unread
        self._window = _Window()
        self._window_started = clock()
        # The reduction watch's hook (one dict for every step) and the engine's queue.
        self._loss_hooks: dict[int, Callable[[torch.Tensor], torch.Tensor | None]] = {
            0: self._queue_mark
        }
        engine: Any = torch.autograd.Variable._execution_engine
        self._queue_callback: Callable[[Callable[[], None]], None] = engine.queue_callback

    # -- marks (the prepared loader, backward, optimizer) --------------------------------
    def begin_data(self, loader: object) -> None:
        """The loop asks ``loader`` for a batch: the step in progress ends if it trained."""
        if not self.enabled:
            return
        if self._phase is None and not self._window.steps:
            self._window_started = self._wall()  # a window spans steps, not the set-up before
        now = self._switch(DATA)
        if self._trained:
            self._close_step(now)
        elif self._opener is loader:
            self._drop_step()  # an iteration that did not train (evaluation)
        if not (self._seconds or self._laps):  # else a second loader of the same step (zip)
            self._opener = loader

    def end_data(self, batch: Any) -> None:
        """A batch is handed out: count its samples (and tokens); the forward begins."""
        if not self.enabled or self._phase is None:
            return
        self._switch(FORWARD)
        # Every mark runs right after the model's compute, with cold caches: the common
        # batch, a tuple or list of tensors, is counted without batch_len's calls and the
        # Mapping check (measured in a 2-process DDP loop: 13 -> 7 us a batch).
        first = batch[0] if type(batch) in _SEQUENCES and batch else None
        if type(first) is torch.Tensor and first.dim():
            self._samples += first.shape[0]
            return
        self._samples += batch_len(batch)
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if isinstance(ids, torch.Tensor):  # padding included: no device sync to count it
            self._tokens = (self._tokens or 0) + ids.numel()

    def enter(self, phase: str) -> str | None:
        """A timed call (backward, optimizer) begins; returns what ``leave`` restores."""
        if not self.enabled or self._phase is None:
            return None
        previous = self._phase
        self._switch(phase)
        self._trained = True
        return previous

    def leave(self, previous: str | None) -> None:
        """The call ``enter`` began is over: back to the enclosing call, else ``other``."""
        if previous is not None and self._phase is not None:
            self._switch(previous if previous in _CALLS else OTHER)

    def watch_reduction(self, loss: torch.Tensor) -> None:
        """In ``backward`` under DDP/FSDP: mark where the gradient computation ends."""
        node = loss.grad_fn
        if self._phase is None or node is None:
            return
        # A pre-hook on the loss's node: it runs first in backward, and queues the mark. It
        # goes with the graph; a second backward through it marks again. It is registered
        # as ``Tensor.register_hook`` does, with one hook dict kept for every step (lent to
        # the loss for the call): ``node.register_prehook`` builds a dict and a
        # ``RemovableHandle`` per call, 33 us of CPU in a 2-process DDP step against ~11
        # (a tensor hook: ~60). A loss with hooks of its own keeps them: the public way then.
        # Private torch API, used by Tensor.register_hook itself; checked, not assumed.
        if getattr(loss, "_backward_hooks", ()) is None and hasattr(node, "_register_hook_dict"):
            loss._backward_hooks = self._loss_hooks
            try:
                node._register_hook_dict(loss)
            finally:
                loss._backward_hooks = None  # a later hook of the user's gets its own dict
        else:
            node.register_prehook(self._queue_mark)

    def _queue_mark(self, _grad: Any) -> None:
        # Final callbacks run in the order queued: this one (queued as backward starts)
        # before those of DDP's reducer and FSDP, which wait for the reduction.
        self._queue_callback(self._reduction_waited)

    def _reduction_waited(self) -> None:
        if self._phase == BACKWARD:
            self._switch(COMMUNICATION)

    def loop_ended(self, loader: object) -> None:
        """A pass over a prepared loader ended (exhausted or left): send what is measured."""
        if not self.enabled or self._phase is None:
            return
        now = self._switch(None)
        if self._trained:
            self._close_step(now)
        self._drop_step()
        self._opener = None
        if self._events is not None and self._pending:
            # Once per pass, not per step: wait for its last step, so the pass is all sent.
            self._pending[-1][0][-1][2].synchronize()
        self._flush(force=True)

    # -- internals -----------------------------------------------------------------------
    def _switch(self, phase: str | None) -> Any:
        marks, ending = self._events, self._phase
        if marks is None:  # CPU: the lap is known at once (a dict update: the hot path)
            now: Any = self._clock()
            if ending is not None:
                seconds = self._seconds
                seconds[ending] = seconds.get(ending, 0.0) + (now - self._since)
        else:
            now = marks.mark()
            peak = marks.phase_peak()  # also where a loop's first phase starts counting
            if ending is not None:
                self._laps.append((ending, self._since, now, peak))
        self._phase, self._since = phase, now
        return now

    def _drop_step(self) -> None:
        self._seconds.clear()
        self._laps.clear()
        self._samples, self._tokens, self._trained = 0, None, False

    def _wall(self) -> float:
        return self._clock() if self._events is None else time.perf_counter()

    def _close_step(self, now: Any) -> None:
        # The step's laps are handed over, not copied: a new dict or list takes them next.
        if self._events is None:
            self._window.add_step(self._seconds, self._samples, self._tokens)
            self._seconds = {}
        else:
            self._pending.append((self._laps, self._samples, self._tokens))
            self._laps = []
        self._samples, self._tokens, self._trained = 0, None, False
        if self._events is not None or now - self._window_started >= self._interval:
            self._flush(force=False)

    def _flush(self, *, force: bool) -> None:
        """Add the readable steps to the window; send it when due (or ``force``)."""
        marks = self._events
        while marks is not None and self._pending:
            laps, samples, tokens = self._pending[0]
            if not marks.ready(laps[-1][2]):
                break  # the GPU is not there yet: read it at a later step
            self._pending.popleft()
            seconds: dict[str, float] = {}
            for phase, start, end, peak in laps:
                seconds[phase] = seconds.get(phase, 0.0) + marks.seconds(start, end)
                self._window.add_peak(phase, peak)
            self._window.add_step(seconds, samples, tokens)
        now = self._wall()
        if self._window.steps and (force or now - self._window_started >= self._interval):
            self._send(self._window.message())
            self._window = _Window(self._window.peaks)  # peaks are the run's so far
            self._window_started = now
        if marks is not None:
            marks.recycle(self._pending)


class _Window:
    """Steps held until the window is sent, then summed: a step closes in one append (its
    marks run with cold caches; the sum of a window's steps runs in one warm loop)."""

    def __init__(self, peaks: dict[str, int] | None = None) -> None:
        self.steps = 0
        self._held: list[tuple[dict[str, float], int, int | None]] = []
        self.peaks = dict(peaks) if peaks is not None else None

    def add_peak(self, phase: str, peak: int) -> None:
        self.peaks = self.peaks if self.peaks is not None else {}
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)

    def add_step(self, seconds: dict[str, float], samples: int, tokens: int | None) -> None:
        """Hold a step's seconds per phase (the dict is kept: the caller takes a new one)."""
        self._held.append((seconds, samples, tokens))
        self.steps += 1

    def message(self) -> dict[str, Any]:
        phases: dict[str, float] = {}
        samples, total_tokens = 0, None
        for seconds, step_samples, tokens in self._held:
            for phase, value in seconds.items():
                phases[phase] = phases.get(phase, 0.0) + value
            samples += step_samples
            if tokens is not None:
                total_tokens = (total_tokens or 0) + tokens
        return {
            "steps": self.steps,
            "phases": phases,
            "samples": samples,
            "tokens": total_tokens,
            "peak_memory": dict(self.peaks) if self.peaks is not None else None,
        }


class CudaMarks:
    """CUDA events as lap marks, from a pool, read once complete; peak memory per phase.

    ``cuda`` is ``torch.cuda`` (or a stand-in with ``Event``, ``current_stream`` and
    ``memory_stats_as_nested_dict``). The allocator's peak counter is only read, never reset:
    it is the user's (``torch.cuda.max_memory_allocated``).
    """

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device = device
        self._cuda: Any = cuda if cuda is not None else torch.cuda
        self._free: list[Any] = []
        self._used: list[Any] = []  # read already: back to the pool at the next recycle
        self._peak, self._held = self._allocated()  # as the phase in progress began

    def mark(self) -> Any:
        new_event: Any = self._cuda.Event
        event = self._free.pop() if self._free else new_event(enable_timing=True)
        event.record(self._cuda.current_stream(self.device))
        return event

    def phase_peak(self) -> int:
        """The peak bytes of the phase that ends now, as far as the allocator tells.

        If the allocator's peak rose since the phase began, it rose in this phase: that peak
        is the phase's. Otherwise the phase's own peak is unknown but no higher than an
        earlier phase's; the bytes held as it began or ends are its lower bound. A peak
        lower than before means the user reset the counter during this phase: what it
        reached since is this phase's too.
        """
        peak, held = self._allocated()
        if peak > self._peak:
            phase = peak
        elif peak < self._peak:
            phase = max(peak, self._held)
        else:
            phase = max(held, self._held)
        self._peak, self._held = peak, held
        return phase

    def _allocated(self) -> tuple[int, int]:
        # One call for both figures (max_memory_allocated and memory_allocated each flatten
        # the allocator's whole statistics); kept on the CPU as allocations are made: no
        # device sync. Empty before CUDA is initialised.
        stats = self._cuda.memory_stats_as_nested_dict(self.device)
        counts = stats.get("allocated_bytes", {}).get("all", {})
        return int(counts.get("peak", 0)), int(counts.get("current", 0))

    @staticmethod
    def ready(event: Any) -> bool:
        return bool(event.query())

    def seconds(self, start: Any, end: Any) -> float:
        self._used.append(start)
        return float(start.elapsed_time(end)) / 1000.0

    def recycle(self, pending: deque[tuple[list[Lap], int, int | None]]) -> None:
        # A step's last end mark is the next step's first start mark: keep unread ones.
        unread = {id(mark) for laps, _, _ in pending for lap in laps for mark in lap[1:3]}
        self._free += [event for event in self._used if id(event) not in unread]
        self._used.clear()


def disabled_timer() -> StepTimer:
    """A timer that measures nothing (outside a launched worker, or switched off).

    >>> disabled_timer().enabled
    False
    """
    return StepTimer(enabled=False, send=lambda _message: None)
