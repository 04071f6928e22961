"""Interactive workers (``nbaccel.Workers``): real 2-rank CPU/gloo process groups that keep
their state between calls, fail and get interrupted without being lost, and leave nothing."""

from __future__ import annotations

import gc
import linecache
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import nbaccel
from nbaccel.launcher.interactive import ending as ending_module

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def workers(runs_dir: str) -> Iterator[nbaccel.Workers]:
    with nbaccel.Workers(num_processes=2, runs_dir=runs_dir) as started:
        yield started


@pytest.fixture
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ending_module, "INTERRUPT_GRACE", 1.0)


def rank_and_pid() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), os.getpid()


def wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def gone(pids: dict[int, int]) -> bool:
    return not any(psutil.pid_exists(pid) for pid in pids.values())


def test_state_stays_on_the_same_processes_between_calls(workers: nbaccel.Workers) -> None:
    first = workers.run(rank_and_pid)
    assert first == {rank: (rank, pid) for rank, pid in workers.pids.items()}
    workers.run_cell("import torch\nmodel = torch.nn.Linear(2, 1)\nsteps = 0\n", "<cell 1>")
    shown = workers.run_cell(
        "import torch.distributed as dist\nsteps += 1\n"
        "weight = model.weight.detach().clone()\ndist.all_reduce(weight)\nsteps",
        "<cell 2>",
    )
    assert shown == {0: "1", 1: "1"}  # the last expression's repr, on every rank
    assert workers.run(rank_and_pid) == first  # the same pids: nothing was started again


def test_push_and_pull_move_values_in_and_out(workers: nbaccel.Workers) -> None:
    workers.push(lr=0.5, names=["a", "b"])
    workers.run_cell("import torch.distributed as dist\nlr = lr * (dist.get_rank() + 1)", "<c>")
    assert workers.pull("lr") == {0: 0.5, 1: 1.0}
    assert workers.pull("names") == {0: ["a", "b"], 1: ["a", "b"]}
    with pytest.raises(NameError, match=r"\[rank 0\] 'missing' not defined"):
        workers.pull("missing")
    workers.run_cell("import torch\nt = torch.arange(3)", "<c>")
    tensors = workers.pull("t")  # a tensor comes back as a tensor, as launch's results do
    assert [t.tolist() for t in tensors.values()] == [[0, 1, 2], [0, 1, 2]]


def test_logs_hold_what_the_ranks_printed_and_nothing_else(
    workers: nbaccel.Workers, capsys: pytest.CaptureFixture[str]
) -> None:
    for index in range(3):
        workers.run_cell(
            f"import torch.distributed as dist\nprint('cell {index}', dist.get_rank())", "<c>"
        )
    workers.run(print, "from run")
    workers.push(x=1)  # calls that print nothing end their output too
    assert workers.pull("x") == {0: 1, 1: 1}
    workers.run_cell("print('no newline', end='')", "<c>")
    # The call returned once its output was shown: rank 0's, a line it did not end included.
    shown = capsys.readouterr().out
    assert shown.endswith("from run\nno newline\n"), repr(shown)
    for rank in (0, 1):
        printed = "".join(f"cell {index} {rank}\n" for index in range(3)) + "from run\nno newline"
        assert (workers.run_dir / f"rank{rank}.log").read_text() == printed
        assert workers.logs(rank) == printed + "\n"


def test_free_memory_collects_garbage_and_reports_memory(workers: nbaccel.Workers) -> None:
    cell = (
        "import builtins\nbuiltins.collected = False\n"
        "class Cycle:\n    def __del__(self):\n        builtins.collected = True\n"
        "c = Cycle()\nc.me = c\ndel c\n"  # only the cycle collector frees it
    )
    workers.run_cell("import gc\ngc.disable()\n" + cell, "<cycle>")
    assert workers.run_cell("collected", "<c>") == {0: "False", 1: "False"}
    memory = workers.free_memory()
    assert workers.run_cell("collected", "<c>") == {0: "True", 1: "True"}
    assert sorted(memory) == [0, 1] and all(m["rss"] > 10 << 20 for m in memory.values())
    workers.run_cell("gc.enable()", "<c>")


def test_a_failing_rank_is_named_and_the_workers_stay_usable(workers: nbaccel.Workers) -> None:
    pids = workers.pids
    code = "import torch.distributed as dist\nif dist.get_rank() == 1:\n"
    code += "    raise KeyError('shard 7')\n"
    with pytest.raises(KeyError, match=r"\[rank 1\] shard 7") as raised:
        workers.run_cell(code, "<failing cell>")
    remote = str(raised.value.__cause__)
    assert 'File "<failing cell>", line 3' in remote and "raise KeyError('shard 7')" in remote
    assert workers.run(rank_and_pid) == {rank: (rank, pid) for rank, pid in pids.items()}


def test_a_rank_left_in_a_collective_ends_the_group_and_says_restart(
    workers: nbaccel.Workers, short_grace: None
) -> None:
    pids = workers.pids
    code = (
        "import torch.distributed as dist\nif dist.get_rank() == 1:\n    raise ValueError('no')\n"
        "dist.barrier()\n"  # rank 0 waits in C++ for a rank that never comes
    )
    with pytest.raises(nbaccel.WorkersEnded, match=r"rank\(s\) 0 did not stop.*restart\(\)") as e:
        workers.run_cell(code, "<cell>")
    assert isinstance(e.value.__cause__, ValueError)  # the failure that caused it
    wait_for(lambda: gone(pids), 30, "the stuck workers to end")
    with pytest.raises(nbaccel.WorkersEnded, match=r"workers.restart\(\)"):
        workers.run(rank_and_pid)
    workers.restart()
    assert sorted(workers.run(rank_and_pid)) == [0, 1]


def cell_function(source: str, filename: str, name: str = "fails") -> Callable[[], Any]:
    """A function defined as a notebook cell defines it: its lines only in linecache."""
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]  # type: ignore[no-any-return]


def test_a_cell_functions_lines_show_in_the_error_also_after_restart(
    workers: nbaccel.Workers,
) -> None:
    fails = cell_function("def fails():\n    raise OSError('from the cell')\n", "<cell 42>")
    for _ in range(2):  # a restarted group is sent the cell's lines again
        with pytest.raises(OSError, match=r"\[rank 0\] from the cell") as raised:
            workers.run(fails)
        assert "raise OSError('from the cell')" in str(raised.value.__cause__)
        workers.restart()


def test_a_rank_that_dies_ends_the_group_and_says_why(workers: nbaccel.Workers) -> None:
    pids = workers.pids
    code = "import os, torch.distributed as dist\nif dist.get_rank() == 1:\n    os._exit(3)\n"
    with pytest.raises(nbaccel.WorkersEnded, match=r"rank 1 exited with code 3.*restart\(\)"):
        workers.run_cell(code + "print('before the barrier')\ndist.barrier()\n", "<dies>")
    assert "before the barrier" in workers.logs(0)  # the ended group's logs stay readable
    wait_for(lambda: gone(pids), 30, "the rest of the group to end")
    workers.restart()
    assert sorted(workers.run(rank_and_pid)) == [0, 1]


def test_a_cell_function_run_on_the_workers_sees_their_namespace(
    workers: nbaccel.Workers,
) -> None:
    workers.run_cell("import torch\nmodel = torch.nn.Linear(3, 1)\nscale = 2", "<build>")
    source = "scale = 1000\ndef evaluate():\n    return model.in_features * scale\n"
    # The kernel has no model, and its scale differs.
    evaluate = cell_function(source, "<cell 7>", "evaluate")
    assert workers.run(evaluate) == {0: 6, 1: 6}  # the ranks' model and scale


def said(error: BaseException) -> str:
    """An error's message and its notes (Python 3.10 has no notes: nbaccel adds them to it)."""
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


def test_a_name_the_kernel_has_and_the_ranks_lack_is_explained(workers: nbaccel.Workers) -> None:
    kernel: dict[str, Any] = {"__name__": "__main__", "lr": 0.1}
    with pytest.raises(NameError, match=r"\[rank 0\] name 'lr' is not defined") as raised:
        workers.run_cell("print(lr)", "<c>", kernel_names=kernel)
    notes = said(raised.value)
    assert "'lr' is defined in this kernel, but not on the ranks" in notes
    assert "workers.push(lr=lr)" in notes
    with pytest.raises(NameError) as raised:  # nowhere to be found: nothing to add
        workers.run_cell("print(nowhere)", "<c>", kernel_names=kernel)
    assert "defined in this kernel" not in said(raised.value)
    # A function the ranks hold took the kernel's globals when it was sent, not later.
    exec("def helper():\n    return later\ndef step():\n    return helper()\n", kernel)
    workers.push(helper=kernel["helper"])
    kernel["later"] = 1
    with pytest.raises(NameError, match="'later' is not defined") as raised:
        workers.run(kernel["step"])
    assert "it was not when the function was sent" in said(raised.value)


def test_ranks_to_show_that_the_workers_lack_are_refused_before_the_call(
    workers: nbaccel.Workers, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    with pytest.raises(ValueError, match=r"names rank 5, but these workers have ranks 0 and 1"):
        workers.run_cell(f"open({str(ran)!r}, 'w')", "<c>", show_ranks=frozenset({5}))
    assert not ran.exists()


def test_restart_starts_afresh_with_the_same_config(workers: nbaccel.Workers) -> None:
    before = workers.pids
    workers.push(kept=1)
    workers.restart()
    assert set(workers.pids.values()).isdisjoint(before.values())
    wait_for(lambda: gone(before), 30, "the old workers to end")
    with pytest.raises(NameError, match="'kept' not defined"):
        workers.pull("kept")
    assert workers.world_size == 2


def test_an_interrupt_stops_the_code_not_the_workers(
    workers: nbaccel.Workers, tmp_path: Path
) -> None:
    pids = workers.pids
    started = tmp_path / "started"
    code = f"import time, pathlib\npathlib.Path({str(started)!r}).touch()\ntime.sleep(600)\n"

    def interrupt_when_started() -> None:
        wait_for(started.exists, 60, "the cell to start")
        os.kill(os.getpid(), signal.SIGINT)  # what the kernel's interrupt button does

    thread = threading.Thread(target=interrupt_when_started)
    thread.start()
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        workers.run_cell(code, "<long cell>")
    thread.join()
    assert time.monotonic() - began < 30  # not the cell's 600 s
    assert workers.run(rank_and_pid) == {rank: (rank, pid) for rank, pid in pids.items()}


def test_a_persistent_dataloader_outlives_an_interrupt(
    workers: nbaccel.Workers, tmp_path: Path
) -> None:
    workers.run_cell(
        "from torch.utils.data import DataLoader\n"
        "loader = DataLoader(list(range(1000)), num_workers=1, persistent_workers=True)\n"
        "batches = iter(loader)\nfirst = next(batches).item()\n",
        "<loader>",
    )
    started = tmp_path / "started"
    code = f"import time, pathlib\npathlib.Path({str(started)!r}).touch()\ntime.sleep(600)\n"

    def interrupt_when_started() -> None:
        wait_for(started.exists, 60, "the cell to start")
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt_when_started)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        workers.run_cell(code, "<long cell>")
    thread.join()
    # The DataLoader's worker took no interrupt: the same iterator goes on.
    assert workers.run_cell("next(batches).item()", "<next>") == {0: "1", 1: "1"}


def test_an_interrupt_that_a_rank_cannot_take_ends_the_group(
    workers: nbaccel.Workers, tmp_path: Path, short_grace: None
) -> None:
    pids = workers.pids
    started = tmp_path / "started"
    code = (
        "import time, pathlib, torch.distributed as dist\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        "if dist.get_rank() == 1:\n    time.sleep(600)\n"
        "dist.barrier()\n"
    )

    def interrupt_when_started() -> None:
        wait_for(started.exists, 60, "the cell to start")
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt_when_started)
    thread.start()
    with pytest.raises(nbaccel.WorkersEnded, match=r"rank\(s\) 0 did not stop.*interrupt"):
        workers.run_cell(code, "<stuck cell>")
    thread.join()
    wait_for(lambda: gone(pids), 30, "the stuck workers to end")
    # Every later call says what ended them, and how to go on.
    with pytest.raises(nbaccel.WorkersEnded, match=r"ended after the interrupt.*nbaccel\.Workers"):
        workers.run(rank_and_pid)
    workers.close()
    with pytest.raises(nbaccel.WorkersEnded, match=r"ended after the interrupt"):
        workers.push(x=1)  # closing what had ended changes nothing


def test_close_and_twenty_calls_leave_nothing(runs_dir: str) -> None:
    me = psutil.Process()
    nbaccel.notebook_launcher(int, num_processes=2, runs_dir=runs_dir)  # the helper is up
    fds, threads = me.num_fds(), threading.active_count()
    with nbaccel.Workers(num_processes=2, runs_dir=runs_dir) as workers:
        pids = workers.pids
        workers.run(int)
        during = me.num_fds(), threading.active_count()
        for index in range(20):
            if index % 5 == 4:
                with pytest.raises(ZeroDivisionError):
                    workers.run_cell("1 / 0", f"<cell {index}>")
            else:
                workers.run_cell(f"x = {index}", f"<cell {index}>")
        assert (me.num_fds(), threading.active_count()) == during
        assert workers.run(rank_and_pid) == {rank: (rank, pid) for rank, pid in pids.items()}
    wait_for(lambda: gone(pids), 30, "the workers to end")
    wait_for(lambda: threading.active_count() == threads, 10, "the run's threads to end")
    assert me.num_fds() == fds


def test_workers_dropped_without_close_end(runs_dir: str) -> None:
    workers = nbaccel.Workers(num_processes=2, runs_dir=runs_dir)
    pids = workers.pids
    del workers  # a setup cell run again: the old object goes, and its processes with it
    gc.collect()
    wait_for(lambda: gone(pids), 30, "the dropped workers to end")


def test_workers_end_when_their_kernel_dies_and_it_stays_torch_free(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, nbaccel
        workers = nbaccel.Workers(num_processes=2, runs_dir=sys.argv[1])
        workers.run_cell("import torch\\nx = torch.ones(2)\\nx", "<cell>")
        try:
            workers.run_cell("x.foo()", "<cell>")
        except AttributeError:
            pass
        assert "torch" not in sys.modules, "the kernel imported torch"
        print(*workers.pids.values(), flush=True)
        sys.stdin.read()  # until killed
        """
    )
    kernel = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "runs")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert kernel.stdout is not None
        line = kernel.stdout.readline()
        while line.startswith("nbaccel: "):  # what the start said it waited for (the helper)
            line = kernel.stdout.readline()
        pids = dict(enumerate(map(int, line.split())))
        assert len(pids) == 2 and not gone(pids)
        kernel.kill()  # no clean-up of its own runs: as a dying kernel
        kernel.wait(30)
        wait_for(lambda: gone(pids), 30, "the workers to end with their kernel")
    finally:
        kernel.kill()
        kernel.wait(30)


def test_refused_settings_fail_before_anything_starts(runs_dir: str) -> None:
    for refused in ({"detach": True}, {"max_restarts": 1}):
        with pytest.raises(nbaccel.ConfigError, match=r"is not supported by nbaccel\.Workers"):
            nbaccel.Workers(num_processes=2, runs_dir=runs_dir, **refused)
    assert not Path(runs_dir).exists()  # no run was started: its folder comes first
