"""``nbaccel.sweep(..., detach=True)``: a sweep that outlives the kernel.

The kernel checks everything as for any sweep, writes the sweep (the training function and
what it took from the kernel, pickled as a launch's payload is; the configs, or where the
Optuna study is stored; the launch settings) to a private file, and starts a supervisor of
its own, in a session of its own (``python -m nbaccel.sweeps.supervisor``), which runs the
sweep's loop: its trials are launches of that process. After every change the supervisor
writes the sweep's state to ``runs_dir/sweeps/<sweep id>/sweep.json`` (atomically);
``AttachedSweep`` reads it, from this kernel or any later one (``nbaccel.attach(sweep_id)``),
and ``follow`` reads it again as it changes, for a kernel's sweep board to show it live.
Stopping is a file the supervisor looks for (``stop``, ``stop-<trial>``), so it needs no
connection and works from any kernel of the same user.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from nbaccel.launcher.bootstrap.pickling import dumps
from nbaccel.sweeps.packing import Slot
from nbaccel.sweeps.trials import SHOWN_WAIT, Sweep, Trial

HANDSHAKE_SECONDS = 120.0  # the supervisor imports nbaccel and its helper starts
STATE = "sweep.json"
READY = "ready"


def sweeps_dir(runs_dir: str | os.PathLike[str]) -> Path:
    return Path(runs_dir).expanduser().resolve() / "sweeps"


def start_detached(plan: dict[str, Any], runs_dir: str, sweep_id: str) -> AttachedSweep:
    """Start the supervisor for ``plan`` (what ``supervisor.run_plan`` reads) and return
    the sweep it runs, once it said it is ready."""
    folder = sweeps_dir(runs_dir) / sweep_id
    folder.mkdir(parents=True, mode=0o700, exist_ok=True)  # a sweep run again: same folder
    fd, plan_file = tempfile.mkstemp(prefix="nbaccel-sweep-", dir=folder)  # 0600
    with os.fdopen(fd, "wb") as file:
        file.write(dumps(plan))
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "nbaccel.sweeps.supervisor", plan_file],
        cwd=os.getcwd(),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the kernel's interrupt and death must not reach it
    )
    assert supervisor.stdout is not None
    said = _first_line(supervisor, HANDSHAKE_SECONDS)
    if said != READY:
        supervisor.kill()
        raise RuntimeError(
            f"the sweep's supervisor did not start: {said or 'it said nothing'}; see "
            f"{folder / 'supervisor.log'}"
        )
    supervisor.stdout.close()
    return AttachedSweep(folder)


def _first_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    import selectors

    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        data = b""
        while b"\n" not in data and time.monotonic() < deadline:
            if not selector.select(max(0.0, deadline - time.monotonic())):
                break
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").strip().splitlines()[-1] if data.strip() else ""


def write_state(
    folder: Path, sweep: Sweep, pid: int, *, capacity: int = 1, total: int | None = None
) -> None:
    """The sweep as it stands, for ``AttachedSweep`` (written whole, then renamed);
    ``capacity``: trials at once, ``total``: trials to run (for a board)."""
    state = {
        "sweep_id": sweep.sweep_id,
        "pid": pid,
        "capacity": capacity,
        "total": total,
        "metric": sweep.metric,
        "mode": sweep.mode,
        "done": sweep.done,
        "error": repr(sweep.error) if sweep.error is not None else "",
        "trials": [
            {
                "number": t.number,
                "config": t.config,
                "state": t.state,
                "error": t.error,
                "seconds": t.seconds,
                "slot_at": [t.slot.index, list(t.slot.devices)] if t.slot is not None else None,
                "run_dir": t.run_dir,
                "metrics": t.metrics,
            }
            for t in list(sweep.trials)
        ],
    }
    partial = folder / f".{STATE}.partial"
    partial.write_text(json.dumps(state, default=repr))
    os.replace(partial, folder / STATE)


class AttachedSweep(Sweep):
    """A detached sweep, read from its folder: ``table``, ``best``, ``trials`` as of the
    last read (each access reads again), ``wait()``, ``stop()``, ``stop_trial(n)``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        state = self._read()
        super().__init__([], state["metric"], state["mode"], state["sweep_id"])
        self.pid: int = state["pid"]
        self.capacity: int = state.get("capacity", 1)
        self.total: int | None = state.get("total")
        self.board: Any = None  # the sweep board this kernel shows for it, if any
        self._load(state)

    def _read(self) -> dict[str, Any]:
        self._seen = self._version()  # before reading: a write in between is read next time
        loaded: dict[str, Any] = json.loads((self.folder / STATE).read_text())
        return loaded

    def _version(self) -> tuple[int, int, int] | None:
        """Which write of the state file is there (each is a new file renamed into place)."""
        try:
            status = (self.folder / STATE).stat()
        except OSError:
            return None
        return status.st_ino, status.st_mtime_ns, status.st_size

    def _reread(self) -> bool:
        """Read the state again if the supervisor has written it since (True then); else
        only look whether the supervisor is still there (a gone one ends the sweep)."""
        if self._version() not in (None, self._seen):
            self._load(self._read())
            return True
        if not self._done.is_set() and not self._supervisor_alive():
            self._done.set()
        return False

    def _load(self, state: dict[str, Any]) -> None:
        trials = []
        for record in state["trials"]:
            trial = Trial(record["number"], record["config"], state=record["state"])
            trial.error, trial.run_dir = record["error"], record["run_dir"]
            if record.get("slot_at") is not None:
                index, devices = record["slot_at"]
                trial.slot = Slot(index, tuple(devices))
            trial.metrics = {
                k: [(s, v) for s, v in points] for k, points in record["metrics"].items()
            }
            if record["seconds"] is not None:
                trial.started, trial.ended = 0.0, float(record["seconds"])
            trials.append(trial)
        self.trials = trials
        if state["done"] or not self._supervisor_alive():
            self._done.set()

    def refresh(self) -> AttachedSweep:
        """The sweep's state as last written (``table`` and ``best`` read it again)."""
        self._reread()
        return self

    def rows(self) -> list[dict[str, Any]]:
        self.refresh()
        return super().rows()

    def _supervisor_alive(self) -> bool:
        try:
            process = psutil.Process(self.pid)
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    @property
    def done(self) -> bool:
        self._reread()
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> AttachedSweep:
        """Block until every trial has ended (the supervisor wrote so, or is gone)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"sweep {self.sweep_id} still runs after {timeout} s")
            self._done.wait(0.2)  # the state file is written by another process: read again
        if self.board is not None:  # its follower's last call: the board's summary is out
            self._shown.wait(SHOWN_WAIT)
        return self

    def stop(self) -> None:
        """Stop every running trial and start no more."""
        (self.folder / "stop").touch()
        try:
            os.kill(self.pid, signal.SIGUSR1)  # wakes the supervisor to look now
        except OSError:
            pass

    def stop_trial(self, number: int) -> None:
        (self.folder / f"stop-{number}").touch()
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except OSError:
            pass

    def __repr__(self) -> str:
        return (
            super().__repr__().replace("nbaccel.Sweep", f"nbaccel.Sweep (detached {self.sweep_id})")
        )


def follow(
    sweep: AttachedSweep, watch: Callable[[Sweep], None], every: float = 0.5
) -> threading.Thread:
    """A thread that calls ``watch`` with the sweep as it stands, then again whenever the
    supervisor rewrites its state (looked at every ``every`` s), as the scheduler calls a
    board after each change; the last call once the sweep is done (or its supervisor gone)."""

    def run() -> None:
        try:
            watch(sweep)
            while not sweep._done.is_set():
                time.sleep(every)  # another process writes the file: looked at, not waited on
                if sweep._reread() or sweep._done.is_set():
                    watch(sweep)
        finally:
            sweep._shown.set()

    thread = threading.Thread(target=run, name=f"nbaccel-follow-{sweep.sweep_id}", daemon=True)
    thread.start()
    return thread


def show_attached(sweep: AttachedSweep, dashboard: str | bool) -> AttachedSweep:
    """In a Jupyter kernel (``dashboard`` as a launch takes it), the detached sweep's board,
    kept current from its state file (``follow``); its buttons stop trials as
    ``stop_trial``/``stop`` do. Elsewhere nothing is shown."""
    from nbaccel.ui.choose import wants_widgets

    if wants_widgets(dashboard):
        from nbaccel.ui.sweep_board import SweepBoard  # ipywidgets: only now

        board = SweepBoard(sweep, sweep.capacity, blocking=False, total=sweep.total)
        sweep.board = board
        follow(sweep, board)
    return sweep


def find_sweep(runs_dir: str | os.PathLike[str], sweep_id: str) -> AttachedSweep:
    """The detached sweep ``sweep_id`` (or ``"latest"``) under ``runs_dir``."""
    root = sweeps_dir(runs_dir)
    names = (
        sorted(p.name for p in root.glob("sweep-*") if (p / STATE).is_file())
        if root.is_dir()
        else []
    )
    if sweep_id == "latest":
        if not names:
            raise ValueError(f"no detached sweep under {root}: start one with detach=True.")
        sweep_id = names[-1]
    if sweep_id not in names:
        raise ValueError(f"no detached sweep {sweep_id!r} under {root} (found: {names[-5:]})")
    return AttachedSweep(root / sweep_id)
