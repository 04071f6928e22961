"""The live dashboard: a run's header, logs, failure, curves and memory as ipywidgets.

Threads (FACTS.md, ipywidgets): the run's pump thread and the memory sampler only put
events on a queue; one UI thread applies them to a ``DashboardModel`` and owns every widget
write. It writes text at most every ``text_interval`` (0.25 s) and PNG frames at most every
``image_interval`` (0.5 s; the first one interval after the start, so a run that ends sooner
draws only its final frames), assigning whole new values (a bounded log tail, never a
growing log; never ``with output:`` from a thread), and only when something changed: a run
that logs every step and prints a tqdm bar costs ~30 messages a second, far below the
server's ~1000/s. When the run ends, the run's pump thread waits (at most ``END_WAIT`` s)
for the final frames and a static summary (a PNG and text, shown with IPython.display into
outputs reserved when the dashboard was shown), so a saved notebook keeps the curves and a
blocking call returns only after they are out. A launch subscribes the dashboard before
its workers start (``build=False``) and shows it once they are started: ``nbaccel.launch``
builds its widgets then (``build_widgets`` and ``ready``); a blocking call keeps their place
(``show(later=True)``) and its UI thread builds them ``live_after`` s into the run, or
never if the run ends first (below). Plots are handed from one dashboard to the next
(``PlotPool``), so a relaunch blits its frames instead of drawing them whole.

While a blocking cell runs, the kernel handles no widget events (a click, a selector
change): Stop, Stacks and the selectors work in the non-blocking ``launch()`` dashboard; in a
blocking call the kernel interrupt stops the run, a stall warning shows the ranks' stacks,
and the UI says so.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from nbaccel.events import Event, RunEnded, RunStarted, WorkerStarted
from nbaccel.ui.dashboard.cell_output import CellOutput
from nbaccel.ui.dashboard.clicks import DashboardClicks
from nbaccel.ui.dashboard.compare import EarlierRuns
from nbaccel.ui.dashboard.images import DashboardImages
from nbaccel.ui.dashboard.memory import MemorySampler
from nbaccel.ui.dashboard.model import DashboardModel, MemoryReading
from nbaccel.ui.dashboard.plot_pool import PlotPool, import_plots_ahead
from nbaccel.ui.dashboard.stacks_panel import StacksPanel
from nbaccel.ui.dashboard.step_panel import StepPanel
from nbaccel.ui.dashboard.text import summary_text
from nbaccel.ui.dashboard.widgets import DashboardWidgets

TEXT_INTERVAL = 0.25  # 4 Hz text: live to the eye; 10 Hz cost ~1 % of a core more
IMAGE_INTERVAL = 0.5  # 2 Hz frames (a blitted frame costs ~5 ms; a full redraw ~40 ms)
IDLE_REFRESH = 1.0  # the header's clock ticks in seconds
# A blocking call's widgets are built once its run has gone on ``live_after`` s (the config's
# ``dashboard_after``, 0.25 s): a run that ends sooner shows only its summary (the cell's
# static text and picture, the log's tail included). Its widgets would be live for less time
# than JupyterLab takes to draw them, and building them (~35 models, a message each) competed
# with the starting ranks for the cores: ~15 ms of a 0.05-0.15 s launch on 2 cores. tqdm's
# ``delay`` and dask's ``ProgressBar(minimum=...)`` wait alike.
END_WAIT = 10.0  # the pump thread waits this long for the final frames and summary


class Dashboard(CellOutput, DashboardWidgets, DashboardClicks, DashboardImages):
    """Widgets for one run, fed with the run's events (it is a run subscriber).

    ``threaded=False`` runs no UI thread: call ``tick(now)`` to apply queued events and
    write what is due at ``now`` (tests drive time this way).

    >>> from nbaccel.events import LogLine, Metric, RunEnded, RunState
    >>> dash = Dashboard(DashboardModel(world_size=2), threaded=False)
    >>> dash(LogLine(0, "epoch 1", False, False, 0.0)); dash(Metric(0, 1, {"loss": 0.5}, 0.0))
    >>> dash(RunEnded(RunState.SUCCEEDED, None, 1.0, 1.0)); dash.tick()
    >>> dash.visible_log, "succeeded" in dash.header.value, dash.summary_text.splitlines()[1]
    (['epoch 1'], True, 'loss: last 0.5 at step 1, min 0.5 at step 1')
    """

    def __init__(
        self,
        model: DashboardModel,
        *,
        stop: Callable[[], None] | None = None,
        save_stop: Callable[[], None] | None = None,
        stacks: Callable[[], dict[int, str]] | None = None,
        blocking: bool = False,
        rank: int = 0,
        sampler: MemorySampler | None = None,
        text_interval: float = TEXT_INTERVAL,
        image_interval: float = IMAGE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        threaded: bool = True,
        plots: PlotPool | None = None,
        build: bool = True,
        live_after: float = 0.0,
    ) -> None:
        self.model = model
        self._stop, self._blocking, self._sampler = stop, blocking, sampler
        self._save_stop = save_stop  # else found with the run, if launched (clicks.py)
        self._stacks_of = stacks  # Run.stacks, where a click reaches the kernel
        self._text_interval, self._image_interval = text_interval, image_interval
        self._clock, self._wall_clock, self._threaded = clock, wall_clock, threaded
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._rank, self._metric = rank, ""
        self._metric_chosen = False  # the user picked a metric: stop preferring "loss"
        self._stopping = self._saving = self._writing = self._ended = self._started = False
        self._closed = self._widgets_closed = False
        self._stop_clicked = False  # Stop's or Save & stop's: one stop is asked, once
        self._next_text = self._next_image = 0.0
        self._dirty_text = self._dirty_images = True
        self._written: dict[str, Any] = {}  # what each part shows, to skip equal writes
        self._plots: Any = None  # nbaccel.ui.dashboard.plots objects, taken on first frame
        self._pool = plots if plots is not None else PlotPool()
        self._curve_xlim: tuple[float, float] | None = None
        self._frames: dict[str, bytes] = {}  # the last PNG of each image part
        self.step_panel = StepPanel()  # the step-time breakdown
        self.stacks_panel = StacksPanel()  # a stall warning's stacks, or the button's
        self._summary_outputs: tuple[Any, Any] | None = None
        self._finished = threading.Event()
        self._wake = threading.Event()  # set by producers when the UI thread should look
        self._armed = False  # the UI thread has a timed wake-up coming for pending work
        self._thread: threading.Thread | None = None
        self.visible_log: list[str] = []
        self.summary_png: bytes | None = None
        self.summary_text = ""
        self.earlier: EarlierRuns | None = None  # the runs picked to overlay, once listed
        # The UI thread starts once the run has started *and* the widgets are ready: a
        # launch builds them while its ranks start (``build=False``, then ``build_widgets``
        # and ``ready``); the lock orders that against the run's events.
        self._ready = self._start_wanted = self._end_seen = False
        self._start_lock = threading.Lock()
        # Shown with its widgets to come (``show(later=True)``): the UI thread builds them
        # ``live_after`` s after the start, unless the run ended before.
        self.live_after, self._build_due = live_after, math.inf
        self.built = False
        if build:
            self.build_widgets()
            self.ready()

    def build_widgets(self) -> None:
        """Make the widgets (~6 ms in a kernel: a message per widget model) and listen to them."""
        choices, can_stop = self.model.log_choices(), self._stop is not None
        can_save = self._find_save_stop()
        DashboardWidgets.__init__(
            self, choices, self._rank, blocking=self._blocking, can_stop=can_stop, can_save=can_save
        )
        self.listen()
        self.built = True

    def ready(self) -> None:
        """The widgets are built (and shown): start the UI thread if the run has started.
        A run that already ended (a quick failure) has its final frames and summary written
        before this returns, as its pump thread would have waited for them."""
        with self._start_lock:
            self._ready = True
            started = self._start_thread_when_due()
            ended = self._end_seen  # after the thread exists: else the pump thread waits
        if started and ended:
            self._finished.wait(END_WAIT)

    # ----- input (any thread) -------------------------------------------------------
    def __call__(self, event: Event) -> None:
        """Subscriber entry: queue the event; at the run's end, wait for the summary.

        The threads start with the run (``RunStarted``), so a launch that fails to start
        leaves none behind.
        """
        if self._closed:
            return  # its cell shows only the summary now: nothing to update
        self._put(event, urgent=isinstance(event, (RunStarted, RunEnded)))
        if isinstance(event, WorkerStarted) and self._sampler is not None:
            self._sampler.worker_started(event.pid)  # its bare RSS, then every worker's
        if isinstance(event, RunStarted) and self._threaded:
            self.start()
        if isinstance(event, RunEnded):
            with self._start_lock:
                self._end_seen, ui_thread = True, self._thread
            if ui_thread not in (None, threading.current_thread()):
                self._finished.wait(END_WAIT)

    def post_memory(self, readings: list[MemoryReading]) -> None:
        """Queue memory readings (the sampler's callback)."""
        self._put(readings)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (its widgets are closed or about to be)."""
        return self._closed

    def close(self) -> None:
        """Close every widget of this dashboard (the static summary stays in its cell), so
        a long-lived kernel does not keep them. From any thread: a running UI thread closes
        them itself, between two writes; the run, if still going, is not affected."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            self._put(("close", None), urgent=True)
        else:
            self._close_now()

    def _close_now(self) -> None:
        if self._widgets_closed:
            return
        self._widgets_closed = True
        if self._sampler is not None:
            self._sampler.stop()
        if self.built:  # not when the run ended before (or failed to start)
            self.close_widgets()
        self._finished.set()  # nobody waits for a summary that will not come

    # ----- the UI thread ------------------------------------------------------------
    def start(self) -> None:
        """Start the memory sampler and the UI thread (``threaded=True``); idempotent.

        The first frame is due one ``image_interval`` after the start: a run that ends
        sooner draws only its final frames (each frame competes with the starting ranks for
        the cores, and the final one is due anyway)."""
        if self._started:
            return
        self._started = True
        self._next_image = self._clock() + self._image_interval
        self._build_due = self._clock() + self.live_after  # if shown later: the run started
        if self._sampler is not None:
            self._sampler.start()
        if self._threaded:
            with self._start_lock:
                self._start_wanted = True
                self._start_thread_when_due()

    def _start_thread_when_due(self) -> bool:
        """Under ``_start_lock``: start the UI thread once the run started and the widgets
        are ready (whichever comes last starts it); whether it runs."""
        if self._thread is None and self._start_wanted and self._ready:
            self._thread = threading.Thread(target=self._loop, name="nbaccel-ui", daemon=True)
            self._thread.start()
        return self._thread is not None

    def flush(self, timeout: float = 10.0) -> None:
        """Apply everything queued and write it now (tests; a notebook's last look)."""
        if self._thread is None or not self._thread.is_alive():
            self.tick(force=True)
            return
        done = threading.Event()
        self._put(done, urgent=True)
        if not done.wait(timeout):
            raise TimeoutError(f"the dashboard did not flush within {timeout} s")

    @property
    def curve_xlim(self) -> tuple[float, float] | None:
        """The curve's x axis now (None before its first frame): what a test checks."""
        return self._curve_xlim

    def wait_finished(self, timeout: float = END_WAIT) -> bool:
        """Wait until the final frames and summary are written; False on timeout."""
        return self._finished.wait(timeout)

    def _put(self, item: Any, *, urgent: bool = False) -> None:
        self._queue.put(item)
        # While armed, the UI thread will wake at its next write slot anyway: waking it per
        # log line would cost a thread switch (and the GIL) per line for nothing.
        if urgent or not self._armed:
            self._wake.set()

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            if self._closed:  # asked while the loop was ending: close here, once
                self._close_now()
        import_plots_ahead()

    def _serve(self) -> None:
        reported = False
        while not self._finished.is_set():
            self._wake.wait(self._wait_time())
            self._wake.clear()
            try:
                self.tick()
            except Exception as error:  # noqa: BLE001 - a broken display must not stop a run
                if not reported:
                    print(f"nbaccel: dashboard update failed: {error!r}", file=sys.__stderr__)
                    reported = True
                if self._ended:
                    self._finished.set()  # never keep the run's pump thread waiting
            self._armed = self._dirty_text or self._dirty_images
            if not self._armed and not self._queue.empty():
                self._wake.set()  # put while we were still armed: take it now

    def _wait_time(self) -> float:
        """Until the next write slot when something waits to be written, else the clock tick."""
        now = self._clock()
        if not self.built:  # shown later: nothing is written before the widgets are due
            return max(0.0, min(self._build_due - now, IDLE_REFRESH))
        if not (self._dirty_text or self._dirty_images):
            return IDLE_REFRESH
        due = min(self._next_text, self._next_image if self._dirty_images else math.inf)
        return max(0.0, due - now)

    def tick(self, now: float | None = None, *, force: bool = False) -> None:
        """Apply queued events; write the parts that are due at ``now`` (all if ``force``).
        Widgets shown later are built here once due; a run that ends before gets only its
        summary."""
        if not self._ready:
            return  # not shown yet: the events wait in the queue
        now = self._clock() if now is None else now
        flushes = self._drain()
        if self._closed:
            self._close_now()
            for done in flushes:
                done.set()
            return
        if not self.built and not self._ended and now >= self._build_due:
            self.build_widgets()  # the run goes on: its widgets are worth their cost now
            self._write_text()
            self._next_text = now + self._text_interval
            self._show_widgets()
        if not self.built:  # shown later, and not yet (or never: the run ended first)
            if self._ended and not self._finished.is_set():
                self._finish()
            for done in flushes:
                done.set()
            return
        force = force or bool(flushes) or self._ended
        if force or now >= self._next_text:
            self._write_text()
            self._next_text = now + self._text_interval
        if force or (self._dirty_images and now >= self._next_image):
            self._write_images()
            self._next_image = now + self._image_interval
        if self._ended and not self._finished.is_set():
            self._finish()
        for done in flushes:
            done.set()

    def _drain(self) -> list[threading.Event]:
        flushes: list[threading.Event] = []
        item = None
        while True:
            if isinstance(item, threading.Event):
                flushes.append(item)
            elif isinstance(item, list):
                self.model.set_memory(item)
                self._dirty_images = True
            elif isinstance(item, tuple):
                kind, value = item
                if kind == "rank":
                    self._rank = value
                elif kind == "metric":
                    self._metric, self._metric_chosen = value, True
                    self._dirty_images = True
                elif kind in ("stop", "save_stop"):
                    self._stopping, self._saving = True, kind == "save_stop"
                elif kind == "stacks":
                    self.stacks_panel.take(value)
                elif kind == "compare" and self.earlier is not None:
                    self.earlier.pick(value)  # reads each newly picked run's events once
                    self._dirty_images = True
                self._dirty_text = True  # ("close", None) only wakes the thread: see tick
            elif item is not None:
                self.step_panel.handle(item)
                self.stacks_panel.handle(item)
                self.model.handle(item)
                self._ended = self._ended or isinstance(item, RunEnded)
                self._dirty_text = self._dirty_images = True
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return flushes

    # ----- writing (UI thread only) -----------------------------------------------
    def _set(self, part: str, widget: Any, name: str, value: Any) -> bool:
        """Assign a widget trait if it changed (each assignment is one message)."""
        if part in self._written and self._written[part] == value:
            return False
        self._written[part] = value
        self._writing = True  # our own writes must not look like the user's choices
        try:
            setattr(widget, name, value)
        finally:
            self._writing = False
        return True

    def _finish(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        self._drain()  # the sampler's last readings
        if self.built:
            self._write_text()
        self._write_images()  # the run is done: the curve fits its steps, the bars its peaks
        parts = (summary_text(self.model), self.step_panel.summary(), self.stacks_panel.summary())
        self.summary_text = "\n".join(part for part in parts if part)  # a stall: saved too
        if self._plots is not None:
            self.summary_png = self._summary_picture(self._plots[0])
            self._pool.give(self._plots[1:])  # the next dashboard blits onto their axes
            self._plots = None
        if self._publish_summary() and self.built:
            self._leave_pictures_to_summary()  # the live cell shows them once
        self._finished.set()
