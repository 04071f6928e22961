"""pdb on a rank, typed into a real ipykernel's input box: jupyter_client sends the cell with
``allow_stdin=True`` and answers each ``input_request`` on the stdin channel, as JupyterLab
does when a user types. A breakpoint on rank 1 of 2 answered and continued; ``q``, which
ends the run with every rank gone; a breakpoint inside a DDP step while the other rank waits
in its all-reduce for 60 s; a post-mortem of interactive workers with ``%nbaccel_debug``,
after which the workers answer."""

from __future__ import annotations

import json
import queue
import socket
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from tests.notebook.conftest import strip_ansi

pytestmark = pytest.mark.timeout(300)


class Session:
    """One cell run with stdin: each prompt answered with the next line (after ``pause``
    seconds for the lines that ask for it); ``interrupt_at``: that prompt gets the kernel
    interrupted instead (■), and no later one is answered; ``hold_at``: that prompt is never
    answered, ``on_hold`` is called as it comes. What the cell printed is kept in order; the
    prompts, and the lines typed, apart (stdin and the cell's output travel on different
    channels: their order between them is not the client's to know)."""

    def __init__(self, km: KernelManager, kc: BlockingKernelClient) -> None:
        self.km, self.kc = km, kc

    def run(
        self,
        code: str,
        lines: list[str],
        *,
        timeout: float = 180,
        pauses: dict[int, float] | None = None,
        interrupt_at: int | None = None,
        hold_at: int | None = None,
        on_hold: Callable[[], object] = lambda: None,
        **expressions: str,
    ) -> tuple[dict[str, Any], str, list[str]]:
        kc, lines, pauses = self.kc, list(lines), pauses or {}
        msg_id = kc.execute(
            textwrap.dedent(code),
            allow_stdin=True,
            stop_on_error=False,
            user_expressions=expressions,
        )
        shown: list[str] = []
        prompts: list[str] = []
        reply: dict[str, Any] | None = None
        deadline = time.monotonic() + timeout
        idle = interrupted = False
        while (reply is None or not idle) and time.monotonic() < deadline:
            for message in self._pending(kc.get_stdin_msg):
                if message["msg_type"] != "input_request":
                    continue
                prompt = message["content"]["prompt"]
                prompts.append(prompt)
                if interrupted:
                    continue  # the interrupt ends the call: a prompt now is closed unanswered
                if interrupt_at == len(prompts) - 1:
                    self.km.interrupt_kernel()  # ■ while pdb waits for a line
                    interrupted = True
                    continue
                if hold_at == len(prompts) - 1:
                    on_hold()  # a user who looks and types nothing
                    continue
                assert lines, f"pdb asked for more than was typed:\n{''.join(shown)}"
                pause = pauses.get(len(prompts) - 1, 0.0)
                if pause:
                    time.sleep(pause)  # the scenario: a user who looks for a while
                kc.input(lines.pop(0))
            for message in self._pending(kc.get_iopub_msg):
                if message["parent_header"].get("msg_id") != msg_id:
                    continue
                content = message["content"]
                if message["msg_type"] == "stream":
                    shown.append(content["text"])
                elif message["msg_type"] == "error":
                    shown.append(strip_ansi("\n".join(content["traceback"])))
                elif message["msg_type"] == "status" and content["execution_state"] == "idle":
                    idle = True
            for message in self._pending(kc.get_shell_msg):
                parent = message["parent_header"].get("msg_id")
                if parent == msg_id and message["msg_type"] == "execute_reply":
                    reply = message["content"]
        assert reply is not None and idle, f"the cell did not end in {timeout} s:\n{shown}"
        return reply, "".join(shown), prompts

    @staticmethod
    def _pending(get: Any) -> list[dict[str, Any]]:
        got = []
        try:
            got.append(get(timeout=0.02))
            while True:
                got.append(get(timeout=0))
        except queue.Empty:
            return got


def value(reply: dict[str, Any], name: str) -> str:
    assert reply["status"] == "ok", reply
    return str(reply["user_expressions"][name]["data"]["text/plain"])


SETUP = """
import json, os, nbaccel

def train(n, pid_dir):
    import torch, torch.distributed as dist
    rank = dist.get_rank()
    with open(os.path.join(pid_dir, f"rank{{rank}}.pid"), "w") as f:
        f.write(str(os.getpid()))
    x = n * 2
    if rank == 1:
        breakpoint()
        y = x + 1
        x = y - 1
    total = torch.tensor([float(x)])
    dist.all_reduce(total)
    return total.item()
"""


@pytest.fixture
def session(kernel: tuple[KernelManager, BlockingKernelClient]) -> Session:
    return Session(*kernel)


def test_breakpoint_on_rank_1_answered_in_the_input_box_then_c(
    session: Session, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    code = SETUP + "VALUE = nbaccel.notebook_launcher(train, args=(21, {pids!r}), "
    code += "num_processes=2, runs_dir={runs!r})\n"
    reply, text, prompts = session.run(
        code.format(pids=str(pids), runs=str(tmp_path / "runs")),
        ["p x", "l", "w", "n", "p y", "c"],
        value="VALUE",
    )
    assert value(reply, "value") == "84.0", text
    host = socket.gethostname()
    assert prompts == [f"[rank 1 on {host}] (Pdb) "] * 6
    assert "--- pdb on rank 1 (" in text and "stopped by breakpoint()" in text
    assert "\n42\n" in text  # p x
    assert "->\t        y = x + 1" in text  # l
    assert "helper_main" not in text  # w shows the user's frames
    assert text.index("\n42\n") < text.index("\n43\n")  # p y, after n
    assert text.rstrip().endswith("--- rank 1 runs on ---")


def test_q_ends_the_run_with_every_rank_gone_and_says_so(session: Session, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    runs = tmp_path / "runs"
    code = SETUP + "nbaccel.notebook_launcher(train, args=(1, {pids!r}), num_processes=2, "
    code += "runs_dir={runs!r})\n"
    reply, text, _ = session.run(code.format(pids=str(pids), runs=str(runs)), ["p x", "q"])
    assert reply["status"] == "error" and reply["ename"] == "DebuggerQuit", text
    assert "quit in the debugger on rank 1" in reply["evalue"]
    assert "every rank was stopped" in reply["evalue"]
    recorded = [int(p.read_text()) for p in sorted(pids.glob("rank*.pid"))]
    assert len(recorded) == 2
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(pid) for pid in recorded) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in recorded if psutil.pid_exists(pid)], "a rank outlived q"
    [run_dir] = [p.parent for p in runs.glob("*/config.json")]  # the run, not caches
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in records if r.get("event") == "exited"} == {0, 1}


def test_an_interrupt_while_in_pdb_ends_the_run_as_an_interrupt_does(
    session: Session, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    code = SETUP + "nbaccel.notebook_launcher(train, args=(1, {pids!r}), num_processes=2, "
    code += "runs_dir={runs!r})\n"
    code = code.format(pids=str(pids), runs=str(tmp_path / "runs"))
    reply, text, _ = session.run(code, ["p x"], interrupt_at=1)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", text
    recorded = [int(p.read_text()) for p in sorted(pids.glob("rank*.pid"))]
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(pid) for pid in recorded) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(recorded) == 2 and not [pid for pid in recorded if psutil.pid_exists(pid)]
    reply, text, _ = session.run("", [], again="nbaccel.notebook_launcher(len, args=([1],))")
    assert value(reply, "again") == "1", text  # the next launch works at once


DDP_STEP = """
import time, nbaccel

def ddp_step():
    import time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    batch = torch.ones(8, 4) * (dist.get_rank() + 1)
    loss = model(batch).pow(2).mean()
    started = time.monotonic()
    if dist.get_rank() == 1:
        breakpoint()  # inside the step: rank 0's backward waits in DDP's all-reduce
    loss.backward()
    waited = time.monotonic() - started
    return [round(p.grad.sum().item(), 4) for p in model.parameters()], waited

RESULTS = nbaccel.launch(ddp_step, num_processes=2, runs_dir={runs!r}).results()
"""


@pytest.mark.slow
def test_a_breakpoint_in_a_ddp_step_waits_60_s_then_continues(
    session: Session, tmp_path: Path
) -> None:
    reply, text, _ = session.run(
        DDP_STEP.format(runs=str(tmp_path / "runs")),
        ["p loss", "c"],
        pauses={1: 60.0},  # the user looks for a minute before c
        timeout=240,
        results="RESULTS",
    )
    results = eval(value(reply, "results"))  # {rank: (grad sums, seconds)}
    (grads0, waited0), (grads1, _) = results[0], results[1]
    assert grads0 == grads1  # DDP averaged the gradients: rank 0 waited for rank 1
    assert waited0 >= 60.0, text  # ... in its backward's all-reduce, a minute, and went on
    assert "tensor(" in text and "--- rank 1 runs on ---" in text  # p loss, then c


WORKERS = """
import nbaccel
%load_ext nbaccel
workers = nbaccel.Workers(num_processes=2, runs_dir={runs!r}, dashboard="text")
"""

FAILING_CELL = """
%%nbaccel
import torch.distributed as dist
rank = dist.get_rank()
if rank == 1:
    secret = rank * 7
    raise ValueError("bad batch")
"""


def test_nbaccel_debug_reads_a_local_of_the_failing_frame_and_the_workers_answer_after(
    session: Session, tmp_path: Path
) -> None:
    reply, text, _ = session.run(WORKERS.format(runs=str(tmp_path / "runs")), [])
    assert reply["status"] == "ok", text
    try:
        reply, text, _ = session.run(FAILING_CELL, [])
        assert reply["status"] == "error" and "bad batch" in reply["evalue"], text
        reply, text, prompts = session.run("%nbaccel_debug", ["p secret", "p rank", "c"])
        assert reply["status"] == "ok", text
        assert "(post-mortem) at <nbaccel cell" in text
        assert "\n7\n1\n" in text  # p secret, p rank
        assert all(p.startswith("[rank 1 on ") for p in prompts)
        reply, text, _ = session.run("", [], ranks="workers.pull('rank')")
        assert value(reply, "ranks") == "{0: 0, 1: 1}", text
    finally:
        session.run("workers.close()", [])


STOPPING_CELL = """
%%nbaccel
import torch.distributed as dist
if dist.get_rank() in {ranks}:
    breakpoint()
reached = dist.get_rank()
"""


@pytest.fixture
def workers(session: Session, tmp_path: Path) -> Iterator[Session]:
    reply, text, _ = session.run(WORKERS.format(runs=str(tmp_path / "runs")), [])
    assert reply["status"] == "ok", text
    try:
        yield session
    finally:
        session.run("workers.close()", [], timeout=60)


def test_q_in_one_workers_call_then_a_breakpoint_in_the_next_call_gets_its_prompt(
    workers: Session,
) -> None:
    reply, text, _ = workers.run(STOPPING_CELL.format(ranks="(0,)"), ["q"], timeout=90)
    assert reply["status"] == "error" and reply["ename"] == "DebuggerQuit", text
    # The workers keep one run across calls: q ended the first call, not the second.
    reply, text, prompts = workers.run(
        STOPPING_CELL.format(ranks="(0,)"), ["p 6 * 7", "c"], timeout=90
    )
    assert reply["status"] == "ok", text
    assert "\n42\n" in text and "--- rank 0 runs on ---" in text
    assert len(prompts) == 2 and prompts[0].startswith("[rank 0 on ")
    reply, text, _ = workers.run("", [], reached="workers.pull('reached')", timeout=60)
    assert value(reply, "reached") == "{0: 0, 1: 1}", text


@pytest.mark.parametrize("stopped", [(0,), (0, 1)], ids=["one rank", "two ranks"])
def test_an_interrupt_at_a_workers_prompt_then_the_next_breakpoint_gets_its_prompt(
    workers: Session, stopped: tuple[int, ...]
) -> None:
    cell = STOPPING_CELL.format(ranks=repr(stopped))
    reply, text, _ = workers.run(cell, [], interrupt_at=0, timeout=90)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", text
    # What the interrupted sessions left behind is not taken for the next ones.
    lines = ["p 6 * 7", "c"] + ["c"] * (len(stopped) - 1)
    reply, text, prompts = workers.run(cell, lines, timeout=90)
    assert reply["status"] == "ok", text
    assert "\n42\n" in text
    assert len(prompts) == len(lines)
    assert {p.split(" on ")[0] for p in prompts} == {f"[rank {r}" for r in stopped}
    assert text.count("runs on ---") == len(stopped)


PEER_FAILS = """
import pathlib, nbaccel

def train(flag):
    import pathlib, time
    import torch.distributed as dist

    if dist.get_rank() == 1:
        breakpoint()
        return 1
    deadline = time.monotonic() + 120
    while not pathlib.Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # until rank 1's prompt waits in the cell
    raise ValueError("rank 0 failed while rank 1 was in pdb")

nbaccel.notebook_launcher(train, args=({flag!r},), num_processes=2, runs_dir={runs!r})
"""


def test_a_peer_failing_while_a_prompt_waits_ends_the_prompt(
    session: Session, tmp_path: Path
) -> None:
    flag = tmp_path / "prompted"
    code = PEER_FAILS.format(flag=str(flag), runs=str(tmp_path / "runs"))
    reply, text, prompts = session.run(code, [], hold_at=0, on_hold=flag.touch, timeout=90)
    assert len(prompts) == 1 and prompts[0].startswith("[rank 1 on "), text
    assert reply["status"] == "error" and reply["ename"] == "ValueError", text
    assert "rank 0 failed while rank 1 was in pdb" in reply["evalue"]
    assert "--- rank 1 was interrupted" in text or "--- rank 1 has ended" in text
    reply, text, _ = session.run("", [], again="nbaccel.notebook_launcher(len, args=([1],))")
    assert value(reply, "again") == "1", text  # the kernel takes the next launch at once


PEER_DIES = """
%%nbaccel
import os, pathlib, time
import torch.distributed as dist
if dist.get_rank() == 1:
    breakpoint()
else:
    deadline = time.monotonic() + 120
    while not pathlib.Path({flag!r}).exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # until rank 1's prompt waits in the cell
    os._exit(3)
"""


def test_a_worker_dying_while_a_workers_prompt_waits_ends_the_prompt(
    workers: Session, tmp_path: Path
) -> None:
    flag = tmp_path / "prompted"
    code = PEER_DIES.format(flag=str(flag))
    reply, text, prompts = workers.run(code, [], hold_at=0, on_hold=flag.touch, timeout=90)
    assert len(prompts) == 1 and prompts[0].startswith("[rank 1 on "), text
    assert reply["status"] == "error" and reply["ename"] == "WorkersEnded", text
    assert "--- rank 1 was interrupted" in text or "--- rank 1 has ended" in text
