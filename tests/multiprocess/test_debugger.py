"""The debugger on real 2-rank launches: ``breakpoint()`` on a rank, typed into from the
thread that waits for the run (a scripted ``input`` here; a real kernel's input box in
tests/notebook/test_debugger_in_kernel.py), ``q``, two ranks at once, ``post_mortem=True``,
the skips, ``run.stacks()``, the stall warning, and a run that never stops paying nothing."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.events import Event, Notice, StallWarning
from nbaccel.launcher.debug.console import DebugConsole

pytestmark = pytest.mark.timeout(180)


class Typist:
    """Types ``lines`` into every pdb prompt of ``run``, and keeps what was shown."""

    def __init__(self, run: nbaccel.Run, lines: list[str]) -> None:
        self.lines, self.shown, self.prompts = list(lines), [], []  # type: ignore[var-annotated]
        self.prompted_at: list[float] = []
        console = DebugConsole(  # what run.wait() serves stops with
            run._debug,  # type: ignore[arg-type]
            prompt=self._prompt,
            write=self.shown.append,
            can_type=lambda: None,
        )
        if run._console is not None:
            console.quit_ends = run._console.quit_ends
        run._console = console

    def _prompt(self, prompt: str) -> str:
        self.prompts.append(prompt)
        self.prompted_at.append(time.monotonic())
        if not self.lines:
            raise AssertionError(f"pdb asked for more than was typed; shown:\n{self.text}")
        line = self.lines.pop(0)
        self.shown.append(f"{prompt}{line}\n")
        return line

    @property
    def text(self) -> str:
        return "".join(self.shown)


def stop_on_rank_1(n: int) -> float:
    import torch
    import torch.distributed as dist

    x = n * 2
    if dist.get_rank() == 1:
        breakpoint()
        y = x + 1
        x = y - 1
    total = torch.tensor([float(x)])
    dist.all_reduce(total)
    return float(total.item())


def test_a_breakpoint_on_rank_1_is_typed_into_and_c_finishes(runs_dir: str) -> None:
    run = nbaccel.launch(stop_on_rank_1, args=(21,), num_processes=2, runs_dir=runs_dir)
    typist = Typist(run, ["p x", "l", "w", "n", "p y", "c"])
    assert run.result(timeout=120) == 84.0
    text = typist.text
    assert "--- pdb on rank 1 (" in text and "stopped by breakpoint()" in text
    assert set(typist.prompts) == {f"[rank 1 on {os.uname().nodename}] (Pdb) "}
    assert "(Pdb) p x\n42\n" in text
    assert "->\t        y = x + 1" in text  # l marks the line pdb stopped at
    assert "helper_main" not in text and "worker_bootstrap" not in text  # w: user frames
    assert "(Pdb) p y\n43\n" in text  # after n
    assert "--- rank 1 runs on ---" in text


def stop_everywhere() -> int:
    import torch.distributed as dist

    rank = dist.get_rank()
    breakpoint()
    dist.barrier()
    return rank


def test_two_ranks_that_stop_at_once_are_debugged_one_after_the_other(runs_dir: str) -> None:
    run = nbaccel.launch(stop_everywhere, num_processes=2, runs_dir=runs_dir)
    typist = Typist(run, ["p rank", "c", "p rank", "c"])
    assert run.results(timeout=120) == {0: 0, 1: 1}
    text = typist.text
    sessions = [text.index(f"--- pdb on rank {r} (") for r in (0, 1)]
    first, second = sorted(range(2), key=lambda r: sessions[r])
    assert text.index(f"(Pdb) p rank\n{first}\n") < sessions[second]
    assert f"(Pdb) p rank\n{second}\n" in text[sessions[second] :]


def test_q_ends_the_run_with_every_rank_stopped(runs_dir: str) -> None:
    run = nbaccel.launch(stop_on_rank_1, args=(1,), num_processes=2, runs_dir=runs_dir)
    Typist(run, ["q"])
    with pytest.raises(nbaccel.DebuggerQuit, match=r"quit in the debugger on rank 1 \(at .*"):
        run.result(timeout=120)
    assert run.state is nbaccel.RunState.FAILED
    assert {r.rank: r.exitcode is not None for r in run._ranks.values()} == {0: True, 1: True}
    assert "every rank was stopped" in str(run.error)


def fail_on_rank_1() -> None:
    import torch
    import torch.distributed as dist

    weights = torch.arange(3.0)
    if dist.get_rank() == 1:
        loss = weights.sum() * 0  # noqa: F841 - read in pdb
        raise ValueError("the loss is zero")
    dist.all_reduce(weights)


def test_post_mortem_opens_pdb_at_the_failing_frame_before_the_run_ends(runs_dir: str) -> None:
    run = nbaccel.launch(fail_on_rank_1, num_processes=2, runs_dir=runs_dir, post_mortem=True)
    typist = Typist(run, ["p weights", "p loss", "c"])
    with pytest.raises(ValueError, match=r"\[rank 1\] the loss is zero"):
        run.result(timeout=120)
    text = typist.text
    assert "stopped by an exception (post-mortem)" in text
    assert "ValueError: the loss is zero" in text
    assert "(Pdb) p weights\ntensor([0., 1., 2.])\n" in text
    assert "(Pdb) p loss\ntensor(0.)\n" in text


def test_nobody_to_type_skips_the_breakpoint_and_says_so_once(runs_dir: str) -> None:
    events: list[Event] = []
    run = nbaccel.launch(stop_on_rank_1, args=(5,), num_processes=2, runs_dir=runs_dir)
    run.subscribe(events.append)
    run._console = DebugConsole(run._debug, can_type=lambda: "nobody is at this terminal")  # type: ignore[arg-type]
    assert run.result(timeout=120) == 20.0  # the breakpoint was skipped: the code ran on
    assert "skipped: nobody is at this terminal" in run.logs(1)
    notices = [e.text for e in events if isinstance(e, Notice)]
    assert sum("skipped: nobody is at this terminal" in text for text in notices) == 1


def test_debugger_false_and_pythonbreakpoint_0_turn_it_off(
    runs_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = nbaccel.launch(
        stop_on_rank_1, args=(5,), num_processes=2, runs_dir=runs_dir, debugger=False
    )
    Typist(run, [])  # would fail the test if a prompt came
    assert run.result(timeout=120) == 20.0
    assert "skipped: the launch has debugger=False" in run.logs(1)
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")  # the workers take the kernel's environment
    run = nbaccel.launch(stop_on_rank_1, args=(5,), num_processes=2, runs_dir=runs_dir)
    Typist(run, [])
    assert run.result(timeout=120) == 20.0
    assert "skipped" not in run.logs(1)  # Python's meaning of 0: off, silently


def wait_in_all_reduce(flag_file: str) -> None:
    import pathlib
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        while not pathlib.Path(flag_file).exists():  # until the test has read the stacks
            time.sleep(0.01)
    dist.all_reduce(torch.ones(1))


def test_stacks_of_a_running_launch_name_the_function_and_the_collective(
    runs_dir: str, tmp_path: Path
) -> None:
    flag = tmp_path / "release"
    run = nbaccel.launch(wait_in_all_reduce, args=(str(flag),), num_processes=2, runs_dir=runs_dir)
    try:
        deadline = time.monotonic() + 120
        while not (
            "waiting in all_reduce" in (stacks := run.stacks())[0]
            and "rank 1: in wait_in_all_reduce (" in stacks[1]
        ):
            assert time.monotonic() < deadline, stacks
        assert stacks[0].splitlines()[0].startswith("rank 0: in wait_in_all_reduce (")
        assert "Thread MainThread (main):" in stacks[0]
        assert stacks[1].startswith("rank 1: in wait_in_all_reduce (")
        assert ", in wait_in_all_reduce\n" in stacks[1]  # its frame, in its stack
        assert run.state is nbaccel.RunState.RUNNING  # nothing was stopped
    finally:
        flag.touch()
    run.wait(120)
    assert run.state is nbaccel.RunState.SUCCEEDED
    with pytest.raises(RuntimeError, match="has ended"):
        run.stacks()


def quiet_for_a_while(seconds: float) -> int:
    import time

    import torch.distributed as dist

    print("started", flush=True)
    if dist.get_rank() == 0:
        time.sleep(seconds)  # a planted stall: no output, no metric, no step
    dist.barrier()
    return 1


def test_a_stall_shows_every_ranks_stack_once_and_the_run_goes_on(runs_dir: str) -> None:
    events: list[Event] = []
    run = nbaccel.launch(
        quiet_for_a_while, args=(5.0,), num_processes=2, runs_dir=runs_dir, stall_warning=2.0
    )
    run.subscribe(events.append)
    assert run.result(timeout=120) == 1
    stalls = [e for e in events if isinstance(e, StallWarning)]
    assert len(stalls) == 1, stalls  # once per stall
    [stall] = stalls
    assert stall.seconds >= 2.0
    assert stall.waits_in == {0: None, 1: "barrier"}
    assert "in quiet_for_a_while" in stall.stacks[0] and "time.sleep(seconds)" in stall.stacks[0]
    assert "waiting in barrier" in stall.stacks[1]


def idle_channel_costs_nothing(seconds: float) -> dict[str, Any]:
    import sys
    import threading
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))
    [channel] = [t for t in threading.enumerate() if t.name == "nbaccel-debug"]
    with open(f"/proc/self/task/{channel.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return {"ticks": int(fields[11]) + int(fields[12]), "tracing": sys.gettrace() is not None}


def test_a_run_that_never_stops_pays_nothing_for_the_channel(runs_dir: str) -> None:
    # The rank's channel thread sleeps in recv the whole run: no CPU time, no tracing. The
    # step rate itself is benchmarks/debugger.py's (a benchmark, not a timed test).
    value = nbaccel.notebook_launcher(
        idle_channel_costs_nothing, args=(1.0,), num_processes=1, runs_dir=runs_dir
    )
    assert value == {"ticks": 0, "tracing": False}


CELL_THAT_FAILS = """
import torch.distributed as dist
model = {"weight": 3}
rank = dist.get_rank()
if rank == 1:
    secret = rank * 7
    raise ValueError("bad batch")
"""


def test_interactive_workers_post_mortem_then_answer_and_breakpoints_in_a_cell(
    runs_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbaccel.launcher.interactive.workers as workers_module

    monkeypatch.setattr(workers_module, "nobody_to_type", lambda: None)  # a scripted typist
    with nbaccel.Workers(num_processes=2, runs_dir=runs_dir, dashboard="text") as workers:
        with pytest.raises(ValueError, match="bad batch"):
            workers.run_cell(CELL_THAT_FAILS, "<nbaccel cell 1>")
        typist = Typist(workers._run, ["p secret", "p model", "c"])  # type: ignore[arg-type]
        workers.debug()  # the rank the failed call named: rank 1
        text = typist.text
        assert "--- pdb on rank 1 (" in text and "(post-mortem) at <nbaccel cell 1>:7" in text
        assert "(Pdb) p secret\n7\n" in text and "(Pdb) p model\n{'weight': 3}\n" in text
        assert workers.pull("rank") == {0: 0, 1: 1}  # the workers answer after
        typist = Typist(workers._run, ["p rank", "c"])  # type: ignore[arg-type]
        cell = "import torch\nif rank == 0:\n    breakpoint()\nt = torch.ones(1)\n"
        cell += "dist.all_reduce(t)\nt.item()"
        assert workers.run_cell(cell, "<nbaccel cell 2>") == {0: "2.0", 1: "2.0"}
        assert "q ends the call" in typist.text and "(Pdb) p rank\n0\n" in typist.text
        with pytest.raises(ValueError, match="has raised nothing since the workers started"):
            workers.debug(rank=0)  # rank 0 never raised
        assert workers.pull("rank") == {0: 0, 1: 1}


def test_a_peer_that_times_out_while_a_rank_is_in_pdb_says_why_and_the_fix(
    runs_dir: str,
) -> None:
    run = nbaccel.launch(
        stop_on_rank_1, args=(1,), num_processes=2, runs_dir=runs_dir, collective_timeout=2.0
    )
    typist = Typist(run, [])
    left: list[str] = []

    def look_and_never_type(prompt: str) -> str:
        # A user who looks at rank 1 far longer than collective_timeout and types nothing:
        # this prompt returns only if the console abandons it (in Python code, as ipykernel's
        # input() waits, so that the abandonment lands).
        typist.prompts.append(prompt)
        deadline = time.monotonic() + 100
        try:
            while time.monotonic() < deadline:
                threading.Event().wait(0.02)
        except BaseException as error:
            left.append(type(error).__name__)
            raise
        left.append("the prompt was never closed")
        return "c"

    run._console._reader._prompt = look_and_never_type  # type: ignore[union-attr]
    started = time.monotonic()
    with pytest.raises(nbaccel.CollectiveTimeout) as raised:
        run.result(timeout=120)
    assert time.monotonic() - started < 60, "the cell waited at a dead rank's prompt"
    assert left == ["PromptGone"]  # closed by the console, not answered
    assert "--- rank 1 was interrupted" in typist.text or "--- rank 1 has ended" in typist.text
    assert raised.value.stuck_ranks == (1,)
    assert "rank(s) 1 were stopped in the debugger" in str(raised.value)
    assert "raise collective_timeout" in str(raised.value)


def test_the_kernel_stays_free_of_torch_through_stacks_and_a_session(tmp_path: Path) -> None:
    from tests.multiprocess.conftest import run_script

    done = run_script(
        """
        import sys
        import nbaccel
        from nbaccel.launcher.debug.console import DebugConsole

        def train():
            import torch
            import torch.distributed as dist
            weights = torch.ones(2)
            if dist.get_rank() == 1:
                breakpoint()
            dist.all_reduce(weights)
            return 1

        run = nbaccel.launch(train, num_processes=2, dashboard=False)
        lines = ["p weights", "w", "c"]
        shown = []
        run._console = DebugConsole(
            run._debug, prompt=lambda p: lines.pop(0), write=shown.append, can_type=lambda: None
        )
        while not run.stacks()[1].startswith("rank 1: in train") and not run.state.done:
            pass
        assert run.result(timeout=120) == 1
        print("pdb ran:", lines == [] and "tensor([1., 1.])" in "".join(shown))
        print("torch imported:", "torch" in sys.modules)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "pdb ran: True" in done.stdout  # every line typed, p weights answered
    assert "torch imported: False" in done.stdout


def test_no_stall_warning_while_a_rank_is_in_pdb(runs_dir: str) -> None:
    import threading

    events: list[Event] = []
    run = nbaccel.launch(
        stop_on_rank_1, args=(1,), num_processes=2, runs_dir=runs_dir, stall_warning=1.0
    )
    run.subscribe(events.append)
    typist = Typist(run, ["p x", "c"])
    typed = typist._prompt

    def look_a_while(prompt: str) -> str:
        threading.Event().wait(3.0)  # the scenario: a user reads for three stall periods
        return typed(prompt)

    run._console._prompt = look_a_while  # type: ignore[union-attr]
    assert run.result(timeout=120) == 4.0
    assert "(Pdb) p x\n2\n" in typist.text
    assert not [e for e in events if isinstance(e, StallWarning)]


def two_threads_stop_together() -> list[str]:
    import threading

    barrier = threading.Barrier(2, timeout=60)
    came_back: list[str] = []

    def stop(name: str) -> None:
        who = name  # noqa: F841 - read in pdb
        barrier.wait()  # both threads stop at once
        breakpoint()
        came_back.append(name)

    threads = [threading.Thread(target=stop, args=(name,)) for name in ("A", "B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return sorted(came_back)


def test_two_threads_of_one_rank_that_stop_at_once_get_a_session_each(runs_dir: str) -> None:
    # One pdb at a time in a rank: the second thread waits for the first's session, and the
    # lines typed reach the thread whose prompt they answer (they shared one input before).
    run = nbaccel.launch(two_threads_stop_together, num_processes=1, runs_dir=runs_dir)
    typist = Typist(run, ["p who", "c", "p who", "c"])
    try:
        assert run.result(timeout=90) == ["A", "B"], typist.text
    finally:
        run.stop()
    text = typist.text
    assert text.count("--- pdb on rank 0 (") == 2
    first, second = text.split("--- pdb on rank 0 (")[1:]
    answers = {first.split("(Pdb) p who\n")[1][:3], second.split("(Pdb) p who\n")[1][:3]}
    assert answers == {"'A'", "'B'"}  # each session read its own thread's local


def busy_in_c_with_children(flags: str) -> dict[str, Any]:
    import ctypes
    import pathlib
    import subprocess
    import sys
    import time

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    # DataLoader workers started fresh (spawn), as a tool or wandb-core is: SIGUSR1 ends them.
    loader = DataLoader(
        TensorDataset(torch.arange(8.0)),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="spawn",
    )
    batches = iter(loader)
    next(batches)
    workers = batches._workers  # type: ignore[attr-defined]
    tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pathlib.Path(flags, "busy").touch()
    # Holds the GIL in C (a PyDLL call keeps it) for up to 8 s: the rank's channel thread
    # cannot answer run.stacks(), which falls back to faulthandler's dump (SIGUSR1).
    ctypes.PyDLL(None).sleep(8)
    deadline = time.monotonic() + 60
    while not pathlib.Path(flags, "looked").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the test has read the stacks
    alive = {"tool": tool.poll(), "loader workers": [w.exitcode for w in workers]}
    tool.kill()
    tool.wait()
    del batches
    return alive


def test_stacks_of_a_rank_busy_in_c_end_none_of_its_children(runs_dir: str, tmp_path: Path) -> None:
    run = nbaccel.launch(
        busy_in_c_with_children, args=(str(tmp_path),), num_processes=1, runs_dir=runs_dir
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "busy").exists():
            assert time.monotonic() < deadline and not run.state.done, run.logs(0)
            time.sleep(0.01)
        stacks = run.stacks(timeout=0.5)
        (tmp_path / "looked").touch()
        assert "faulthandler's dump" in stacks[0] and "busy_in_c_with_children" in stacks[0]
        # exit codes of None: every child the rank started lives after the dump
        assert run.result(timeout=120) == {"tool": None, "loader workers": [None, None]}
    finally:
        (tmp_path / "looked").touch()
        run.stop()


def test_after_q_with_two_ranks_stopped_the_next_call_stops_and_warns_of_stalls(
    runs_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Interactive workers keep one run across calls: what q set in one call (no more
    # sessions, the other stopped rank's stop and its silencing of the stall warning) ends
    # with that call.
    import nbaccel.launcher.interactive.workers as workers_module

    monkeypatch.setattr(workers_module, "nobody_to_type", lambda: None)  # a scripted typist
    with nbaccel.Workers(
        num_processes=2, runs_dir=runs_dir, dashboard="text", stall_warning=1.0
    ) as workers:
        Typist(workers._run, ["q"])  # type: ignore[arg-type]
        with pytest.raises(nbaccel.DebuggerQuit):
            workers.run_cell("breakpoint()\nstopped = 1\n", "<nbaccel cell 1>")
        events: list[Event] = []
        workers._run.subscribe(events.append)  # type: ignore[union-attr]
        typist = Typist(workers._run, ["p 6 * 7", "c"])  # type: ignore[arg-type]
        cell = "import time\nif rank == 0:\n    breakpoint()\n    time.sleep(3)\n"
        workers.run_cell("import torch.distributed as dist\nrank = dist.get_rank()\n", "<c2>")
        workers.run_cell(cell, "<nbaccel cell 3>")
        assert "(Pdb) p 6 * 7\n42\n" in typist.text
        assert [e for e in events if isinstance(e, StallWarning)]  # 3 s quiet: warned
