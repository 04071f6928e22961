"""Every failure ends cleanly, and the error names the rank that failed on its own."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

import nbaccel
from tests.multiprocess.conftest import run_script

pytestmark = pytest.mark.timeout(180)


class BadBatchError(Exception):
    pass


def rank1_fails(mode: str) -> float:
    import sys

    import torch
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 1:
        if mode == "raise":
            raise BadBatchError("batch 7 has NaNs")
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "sigsegv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if mode == "exit3":
            os._exit(3)
        if mode == "sys.exit":
            sys.exit(5)
        if mode == "hang":
            time.sleep(3600)
        if mode == "sleep-outside-collectives":
            raise BadBatchError("rank 1 fails while rank 0 sleeps")
    if mode == "sleep-outside-collectives":
        time.sleep(3600)  # not in a collective: nothing but the launcher can stop it
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    return float(t.item())


def exit_codes(run_dir: Path) -> dict[int, int]:
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    return {e["rank"]: e["exitcode"] for e in events if e["event"] == "exited"}


def failed_run(mode: str, runs_dir: str, **config: object) -> nbaccel.Run:
    run = nbaccel.launch(rank1_fails, args=(mode,), num_processes=2, runs_dir=runs_dir, **config)
    assert run.wait(timeout=60) is nbaccel.RunState.FAILED
    return run


@pytest.mark.parametrize("attempt", range(3))
def test_raise_reports_the_original_type_rank_and_cell_lines(runs_dir: str, attempt: int) -> None:
    with pytest.raises(BadBatchError) as caught:
        nbaccel.notebook_launcher(rank1_fails, args=("raise",), num_processes=2, runs_dir=runs_dir)
    error = caught.value
    assert str(error) == "[rank 1] batch 7 has NaNs"
    assert isinstance(error.__cause__, nbaccel.RemoteTraceback)
    remote = str(error.__cause__)
    assert "Traceback from rank 1" in remote
    assert 'raise BadBatchError("batch 7 has NaNs")' in remote  # the source line itself
    assert "nbaccel/launcher/worker" not in remote  # starts in user code (worker*.py)


def test_other_ranks_are_stopped_within_5_seconds(runs_dir: str) -> None:
    run = nbaccel.launch(
        rank1_fails, args=("sleep-outside-collectives",), num_processes=2, runs_dir=runs_dir
    )
    assert run.wait(timeout=60) is nbaccel.RunState.FAILED
    records = [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]
    exits = {r["rank"]: r["time"] for r in records if r["event"] == "exited"}
    assert exits[0] - exits[1] < 5.0  # rank 0 slept forever: the launcher stopped it
    assert exit_codes(run.run_dir)[0] == -signal.SIGTERM
    assert isinstance(run.error, BadBatchError)


@pytest.mark.parametrize("attempt", range(3))
def test_sigkill_names_the_rank_and_hints_at_memory(runs_dir: str, attempt: int) -> None:
    run = failed_run("sigkill", runs_dir)
    assert isinstance(run.error, nbaccel.WorkerError)
    assert run.error.rank == 1 and run.error.signal_name == "SIGKILL"  # not rank 0's cascade
    assert "out-of-memory" in str(run.error)


def test_sigsegv_names_the_signal_and_logs_the_python_stack(runs_dir: str) -> None:
    run = failed_run("sigsegv", runs_dir)
    assert isinstance(run.error, nbaccel.WorkerError)
    assert run.error.rank == 1 and run.error.signal_name == "SIGSEGV"
    assert "Fatal Python error: Segmentation fault" in run.logs(1)
    assert "rank1_fails" in run.logs(1)


def test_exit_code_is_reported(runs_dir: str) -> None:
    run = failed_run("exit3", runs_dir)
    assert isinstance(run.error, nbaccel.WorkerError)
    assert run.error.rank == 1 and run.error.exitcode == 3
    assert "exited with code 3" in str(run.error)


def exit3_with_output() -> None:
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 1:
        print("rank 1 says why it leaves", flush=True)
        os._exit(3)
    dist.barrier()


def test_notebook_launcher_error_names_the_run_folder_and_how_to_read_the_log(
    runs_dir: str,
) -> None:
    # notebook_launcher's caller has no Run: "see run.logs(1)" told them nothing they could
    # type (issue 39, item 17). The error names the rank's log in the run folder, carries
    # run_dir, and the line it gives reads that log from a cell.
    with pytest.raises(nbaccel.WorkerError) as caught:
        nbaccel.notebook_launcher(exit3_with_output, num_processes=2, runs_dir=runs_dir)
    error = caught.value
    assert error.rank == 1 and error.exitcode == 3
    assert error.run_dir is not None and error.run_dir.parent == Path(runs_dir).resolve()
    log = error.run_dir / "rank1.log"
    assert "see run.logs" not in str(error)
    code = re.search(r"print\(open\((.+?)\)\.read\(\)\)", str(error))
    assert code is not None, str(error)
    assert eval(code.group(1)) == str(log)  # the path, as a Python literal
    assert "rank 1 says why it leaves" in log.read_text()
    assert "run.logs(1) on a Run from nbaccel.launch" in str(error)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 re-raises a with's saved traceback")
def test_a_workers_error_from_notebook_launcher_shows_no_nbaccel_frame(runs_dir: str) -> None:
    import traceback

    with pytest.raises(BadBatchError) as caught:
        nbaccel.notebook_launcher(rank1_fails, args=("raise",), num_processes=2, runs_dir=runs_dir)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [frame.name for frame in frames] == [
        "test_a_workers_error_from_notebook_launcher_shows_no_nbaccel_frame"
    ]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 re-raises a with's saved traceback")
def test_a_runs_error_from_result_shows_no_nbaccel_frame(runs_dir: str) -> None:
    import traceback

    run = failed_run("raise", runs_dir)
    for get in (run.result, run.results):
        with pytest.raises(BadBatchError) as caught:
            get()
        frames = traceback.extract_tb(caught.value.__traceback__)
        assert [frame.name for frame in frames] == [
            "test_a_runs_error_from_result_shows_no_nbaccel_frame"
        ]


def test_launch_error_carries_the_run_folder_too(runs_dir: str) -> None:
    run = failed_run("raise", runs_dir)
    assert isinstance(run.error, BadBatchError)
    assert run.error.run_dir == run.run_dir  # type: ignore[attr-defined]
    with pytest.raises(BadBatchError) as caught:
        run.result()
    assert caught.value.run_dir == run.run_dir  # type: ignore[attr-defined]


def test_sys_exit_in_a_worker_does_not_exit_the_parent(runs_dir: str) -> None:
    run = failed_run("sys.exit", runs_dir)
    assert type(run.error) is nbaccel.WorkerError
    assert str(run.error) == "rank 1 called sys.exit(5)"


def test_hang_in_a_collective_names_the_stuck_rank(runs_dir: str) -> None:
    started = time.monotonic()
    run = failed_run("hang", runs_dir, collective_timeout=2)
    assert time.monotonic() - started < 30
    error = run.error
    assert isinstance(error, nbaccel.CollectiveTimeout)
    assert error.rank == 0 and error.stuck_ranks == (1,)
    assert "rank(s) 1 never joined it" in str(error)
    # Rank 1's stack dump (faulthandler on SIGUSR1: file, line and function, never source
    # text), in its log and carried into the error.
    dump = re.compile(r'File ".*test_failures\.py", line \d+ in rank1_fails')
    assert dump.search(run.logs(1)), run.logs(1)[-2000:]
    assert dump.search(str(error)), str(error)


def test_unpicklable_return_value_is_explained(runs_dir: str) -> None:
    def returns_a_lock() -> object:
        import threading

        return threading.Lock()

    with pytest.raises(TypeError, match=r"value returned on rank \d \(lock\) cannot be pickled"):
        nbaccel.notebook_launcher(returns_a_lock, num_processes=2, runs_dir=runs_dir)


def test_sys_exit_zero_counts_as_success(runs_dir: str) -> None:
    def leaves_early() -> None:
        import sys

        sys.exit(0)

    assert nbaccel.notebook_launcher(leaves_early, num_processes=2, runs_dir=runs_dir) is None


def test_workers_exit_cleanly_without_sigabrt(runs_dir: str) -> None:
    def all_reduce_twice() -> None:
        import torch
        import torch.distributed as dist

        for _ in range(2):
            dist.all_reduce(torch.ones(4))

    for _ in range(15):
        run = nbaccel.launch(all_reduce_twice, num_processes=2, runs_dir=runs_dir)
        assert run.wait(60) is nbaccel.RunState.SUCCEEDED
        assert exit_codes(run.run_dir) == {0: 0, 1: 0}


FIRST_LAUNCH_SIGKILL = """
import nbaccel

def train():
    import os, signal, time, torch, torch.distributed as dist
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 1:
        time.sleep(1.0)  # while the fresh helper warms up
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # rank 0 sees "Connection closed by peer" at once
    time.sleep(60)

try:
    nbaccel.notebook_launcher(train, num_processes=2, runs_dir="runs")
except nbaccel.WorkerError as error:
    print("BLAMED", error.rank, error.signal_name)
except Exception as error:
    print("BLAMED-OTHER", type(error).__name__, str(error).splitlines()[0])
"""


@pytest.mark.parametrize("attempt", range(2))
def test_first_launch_of_a_fresh_helper_blames_the_killed_rank(
    tmp_path: Path, attempt: int
) -> None:
    # A new interpreter means a new helper: its first idle moment used to import
    # torch._dynamo for seconds, so rank 1's exit status came after rank 0's peer error.
    result = run_script(FIRST_LAUNCH_SIGKILL, tmp_path, timeout=150)
    assert "BLAMED 1 SIGKILL" in result.stdout, result.stdout + result.stderr


def test_a_name_defined_after_the_launch_is_explained(runs_dir: str) -> None:
    # A cell's function takes the kernel's globals as they are at the launch: a name the
    # user defines in a later cell reaches no rank, and the error says so.
    cell: dict[str, object] = {"__name__": "__main__"}
    exec("def train():\n    return learning_rate * 2\n", cell)
    run = nbaccel.launch(cell["train"], num_processes=1, runs_dir=runs_dir)
    assert run.wait(timeout=60) is nbaccel.RunState.FAILED
    cell["learning_rate"] = 0.1  # the cell that defines it, run too late
    with pytest.raises(NameError) as caught:
        run.result()
    said = "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
    assert "'learning_rate' is defined in this kernel now, but it was not when" in said
    assert "function was launched" in said
    with pytest.raises(NameError) as again:  # told once, not piled up
        run.result()
    assert len(getattr(again.value, "__notes__", [])) == len(getattr(caught.value, "__notes__", []))
