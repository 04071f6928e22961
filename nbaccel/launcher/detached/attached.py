"""``AttachedRun``: a detached run seen from a kernel, live or after it ended.

It is a ``Run`` (the dashboard, the text printer and every ``Run`` method work on it), whose
events come from the run's supervisor over the attach channel (``attach_server.py``): what
happened so far, then live. When the supervisor is gone (the run ended while no kernel
watched, or it was killed) everything is read back from ``run_dir``: ``events.jsonl``, the
rank logs, ``result-rank<N>.pkl`` and ``error.pkl``. Results stay readable after a restart.
"""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
from pathlib import Path
from typing import Any

from nbaccel import unpickling
from nbaccel.config.schema import Config, from_flat
from nbaccel.errors import HelperError, RunCancelled
from nbaccel.events import (
    Event,
    LogLine,
    Metric,
    RankExited,
    RunEnded,
    RunStarted,
    RunState,
    StepBreakdown,
    WorkerStarted,
)
from nbaccel.frames import FrameDecoder
from nbaccel.launcher import control
from nbaccel.launcher.run import Run

SUPERVISOR_RECORD = "supervisor.json"
# The supervisor's handshake, one line on its stdout: ready, or the error its start raised.
READY = "NBACCEL-READY"
FAILED = "NBACCEL-FAILED"
ERROR_FILE = "error.pkl"
CONNECT_TIMEOUT = 10.0


class AttachedRun(Run):
    """A detached run, found again from its ``run_dir`` (``nbaccel.attach``)."""

    def __init__(self, run_dir: Path) -> None:
        record = read_record(run_dir)
        super().__init__(run_dir.name, run_dir, read_config(run_dir), record["world_size"])
        self._record_info = record
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self.xla_device = record.get("xla_device")
        self.supervisor_pid: int = record["pid"]
        self.gpus: int = record.get("gpus", 0)  # what a dashboard reads memory from

    # ----- Run's public API, served from the supervisor or the files ---------------
    @property
    def exit_code(self) -> int | None:
        if not self._state.done:
            return None
        if self._state in (RunState.SUCCEEDED, RunState.STOPPED):
            return 0
        if self._state is RunState.CANCELLED:
            return 130
        failed = [code for code in self._exits.values() if code != 0]
        status = failed[0] if failed else 1
        return 128 - status if status < 0 else status

    @property
    def worker_pids(self) -> dict[int, int]:
        return dict(self._pids)

    def results(self, timeout: float | None = None) -> dict[int, Any]:
        self.wait(timeout)
        return {rank: self._value(rank, None) for rank in range(self.world_size)}

    def stop(
        self, timeout: float | None = None, *, save: bool = False, why: str | None = None
    ) -> RunState:
        """Stop every worker of the run, wherever it was launched from (``save=True``: each
        rank saves at a step they agree on first, as ``Run.stop`` says)."""
        if timeout is None:
            timeout = 10.0 + (self.config.checkpoint.grace if save else 0.0)
        if not self._done.is_set():
            try:
                with _connect(self._record_info["address"]) as conn:
                    conn.sendall(b"save-stop\n" if save else b"stop\n")
                    conn.settimeout(timeout)
                    while conn.recv(4096):  # the supervisor answers once every worker is gone
                        pass
            except OSError:
                pass  # the supervisor is gone already: the follower sees its end
        return self.wait(timeout)

    def stacks(self, timeout: float = 10.0) -> dict[int, str]:
        """Where every rank is now (``Run.stacks``), asked of the run's supervisor."""
        if self._done.is_set():
            return super().stacks()  # raises: the run has ended
        try:
            with _connect(self._record_info["address"]) as conn:
                conn.sendall(b"stacks\n")
                conn.settimeout(timeout)
                decoder = FrameDecoder()
                answers: list[Any] = []
                while not answers and (data := conn.recv(1 << 16)):
                    answers += decoder.feed(data)
        except OSError as error:
            raise RuntimeError(
                f"the supervisor of run {self.run_id} did not answer ({error}): the run has "
                "ended, or its supervisor is gone. Its logs are in run.logs(rank)."
            ) from None
        answer = answers[0] if answers and isinstance(answers[0], dict) else {}
        if "error" in answer or "stacks" not in answer:
            raise RuntimeError(answer.get("error", f"run {self.run_id} sent no stacks"))
        return dict(answer["stacks"])

    def __repr__(self) -> str:
        return super().__repr__().replace("nbaccel.Run", "nbaccel.Run (detached)")

    # ----- following ----------------------------------------------------------------
    def connect(self) -> None:
        """Replay what happened, then go live (called once the display has subscribed)."""
        try:
            conn = _connect(self._record_info["address"])
            conn.sendall(b"follow\n")
        except OSError:
            self._replay_files()
            return
        self._state = RunState.RUNNING
        threading.Thread(target=self._follow, args=(conn,), daemon=True).start()

    def _follow(self, conn: socket.socket) -> None:
        decoder = FrameDecoder()
        with conn:
            conn.settimeout(None)
            while not self._done.is_set():
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    break
                for message in decoder.feed(data):
                    if isinstance(message, dict):  # else unreadable: the files tell the end
                        self._take(message["event"])
        if not self._done.is_set():  # the supervisor died without reporting the end
            self._replay_files(after_live=True)

    def _take(self, event: Event) -> None:
        if isinstance(event, WorkerStarted):
            self._pids[event.rank] = event.pid
        elif isinstance(event, RankExited):
            self._exits[event.rank] = event.exitcode
        elif isinstance(event, Metric) and event.rank == 0:
            with self._records_lock:
                self._metrics.append({**event.values, "step": event.step})
                self._metrics_seen += 1
        if isinstance(event, RunEnded):
            self._state, self._error = event.state, event.error
            self._emit(event)
            self._done.set()
            self._gone.set()  # a detached run keeps no workers: its end is theirs
            return
        self._emit(event)

    def _replay_files(self, *, after_live: bool = False) -> None:
        """The supervisor is gone: what the run folder says happened."""
        records = _read_events(self.run_dir / "events.jsonl")
        if not after_live:
            self._emit(RunStarted(self.run_id, self.world_size, str(self.run_dir), time.time()))
            for record in records:
                if record.get("event") == "metric":
                    self._take(
                        Metric(record["rank"], record["step"], record["values"], record["time"])
                    )
                elif record.get("event") == "exited":
                    self._take(RankExited(record["rank"], record["exitcode"], record["time"]))
                elif record.get("event") == "step_breakdown":
                    fields = ("rank", "steps", "phases", "samples", "tokens", "peak_memory")
                    window = {field: record[field] for field in fields}
                    compiling = record.get("compile_seconds", 0.0)  # absent in older runs
                    self._take(
                        StepBreakdown(**window, time=record["time"], compile_seconds=compiling)
                    )
            for rank in range(self.world_size):
                for line in self.logs(rank).splitlines():
                    self._emit(LogLine(rank, line, False, False, time.time()))
        ended = [r for r in records if r.get("event") == "ended"]
        if ended:
            state, error = RunState(ended[-1]["state"]), _read_error(self.run_dir)
        else:
            state = RunState.FAILED
            error = HelperError(
                f"the supervisor of run {self.run_id} (pid {self.supervisor_pid}) ended "
                "before the run did: it was killed, or the machine restarted. Its workers "
                f"died with it; what they wrote is in {self.run_dir}."
            )
        started = self._record_info.get("started", time.time())
        elapsed = (ended[-1]["time"] if ended else time.time()) - started
        self._take(RunEnded(state, error, elapsed, time.time()))

    def _value(self, rank: int, timeout: float | None) -> Any:
        state = self.wait(timeout)
        if state is RunState.FAILED:
            assert self._error is not None
            raise self._error.with_traceback(None)
        if state is RunState.CANCELLED:
            raise RunCancelled(
                f"run {self.run_id} was stopped before it finished; it has no result."
            )
        if state is RunState.STOPPED:
            return None  # saved and stopped: the checkpoint is the result (resume="auto")
        if rank not in self._results_cache:
            path = self.run_dir / f"result-rank{rank}.pkl"
            self._results_cache[rank] = pickle.loads(path.read_bytes()) if path.exists() else None
        return self._results_cache[rank]


def read_record(run_dir: Path) -> dict[str, Any]:
    """A detached run's ``supervisor.json``; a clear error for any other folder."""
    path = run_dir / SUPERVISOR_RECORD
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{run_dir} is not a detached run's folder (it has no {SUPERVISOR_RECORD}): only "
            "runs launched with detach=True can be attached. nbaccel.runs() lists them."
        ) from None
    return record


def read_config(run_dir: Path) -> Config:
    """The resolved config a run was launched with (``run_dir/config.json``)."""
    nested = json.loads((run_dir / "config.json").read_text())["config"]
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{leaf}": leaf_value for leaf, leaf_value in value.items()})
        else:
            flat[key] = value
    return from_flat(flat)


def write_error(run_dir: Path, error: BaseException | None) -> None:
    """Keep a failed run's error for kernels that attach after it ended."""
    from nbaccel.launcher.run_folder import private_file

    if error is not None:
        with private_file(run_dir / ERROR_FILE, "wb") as file:
            file.write(pickle.dumps(error))


def _read_error(run_dir: Path) -> BaseException | None:
    path = run_dir / ERROR_FILE
    if not path.exists():
        return None
    try:  # this user's own 0600 file, read without importing (the supervisor may have)
        error: BaseException = unpickling.loads(path.read_bytes())
    except unpickling.ImportRefused as refused:
        return HelperError(
            f"the run failed with a {refused.module}.{refused.name}, which this kernel "
            f"cannot rebuild without importing {refused.module!r}; the traceback is in the "
            f"ranks' logs in {run_dir}."
        )
    return error


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a killed supervisor: everything before it stands
    return records


def _connect(address: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT)
    try:
        conn.connect(address)
        # Abstract names are listed in /proc/net/unix: once a supervisor has gone, another
        # user could bind its name. Only this user's supervisor is believed (and unpickled).
        if not control.same_user(conn):
            raise ConnectionRefusedError(f"{address[1:]} is served by another user")
    except OSError:
        conn.close()
        raise
    return conn
