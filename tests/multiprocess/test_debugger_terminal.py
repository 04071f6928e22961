"""pdb on a rank from a terminal: ``nbaccel launch script.py`` in a real pseudo-terminal, with
``breakpoint()`` on rank 1, typed into as a user at the terminal would; the same script with
its standard input not a terminal skips the breakpoint and says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.multiprocess.test_cli_config_pty import Terminal

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a POSIX pty"),
    pytest.mark.timeout(180),
]

SCRIPT = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = 20 + dist.get_rank()
if dist.get_rank() == 1:
    breakpoint()
    x = x * 2
total = torch.tensor([float(x)])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} total {total.item():g}", flush=True)
dist.destroy_process_group()
"""


def launch_command(tmp_path: Path) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    runs = str(tmp_path / "runs")
    return [
        sys.executable, "-m", "nbaccel.cli", "launch", "--num_processes", "2", "--use_cpu",
        "--runs_dir", runs, "--log_ranks", "all", str(script),
    ]  # fmt: skip


def test_a_breakpoint_in_a_script_is_typed_into_at_the_terminal(tmp_path: Path) -> None:
    controller, child_side = os.openpty()
    process = subprocess.Popen(
        launch_command(tmp_path),
        stdin=child_side,
        stdout=child_side,
        stderr=child_side,
        cwd=tmp_path,
        start_new_session=True,
    )
    os.close(child_side)
    terminal = Terminal(controller)
    try:
        terminal.expect("--- pdb on rank 1 (", timeout=120)
        terminal.expect("[rank 1 on ")
        terminal.expect("(Pdb) ")
        terminal.send_line("p x")
        terminal.expect("21")
        terminal.expect("(Pdb) ")
        terminal.send_line("c")
        terminal.expect("--- rank 1 runs on ---")
        terminal.expect("total 62")
        assert process.wait(timeout=60) == 0, terminal.text
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(controller)


def test_without_a_terminal_the_breakpoint_is_skipped_and_said(tmp_path: Path) -> None:
    done = subprocess.run(
        launch_command(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "was skipped: standard input is not a terminal" in said, said
    assert "total 62" in said  # the run went on past the breakpoint, to its end
