"""`nbaccel config` driven through a real pseudo-terminal, as a user at a terminal would."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config

pytestmark = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a POSIX pty")

PROMPT = re.compile(r"\n([\w.]+) \[([^\]\r\n]*)\]: ")  # "mixed_precision [no]: "


class Terminal:
    """The controlling side of a pty: read with deadlines, write lines, never sleep."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""
        self.pos = 0  # everything before it has been matched already

    def _read_more(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([self.fd], [], [], max(left, 0))
        if not ready:
            raise AssertionError(f"timed out; the terminal showed:\n{self.text[self.pos :]}")
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:  # EIO: the child closed its side
            chunk = b""
        if not chunk:
            raise AssertionError(f"the wizard exited; the terminal showed:\n{self.text}")
        self.text += chunk.decode(errors="replace")

    def expect(self, pattern: str | re.Pattern[str], timeout: float = 30) -> re.Match[str]:
        regex = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while not (match := regex.search(self.text, self.pos)):
            self._read_more(deadline)
        self.pos = match.end()
        return match

    def send_line(self, text: str) -> None:
        os.write(self.fd, text.encode() + b"\r")  # Enter, as a terminal sends it

    def rest(self, timeout: float = 30) -> str:
        """Everything until the child closes the terminal."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._read_more(deadline)
        except AssertionError as done:
            if "exited" not in str(done):
                raise
        return self.text[self.pos :]


@pytest.fixture
def wizard(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Terminal, Path]]:
    target = tmp_path / "conf" / "wizard.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_", "ACCELERATE_"))}
    for var in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "HF_HOME"):
        env.pop(var, None)
    env.update(HOME=str(tmp_path / "home"), TERM="dumb")
    controller, child_side = os.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "nbaccel.cli", "config", "--config_file", str(target)],
        stdin=child_side,
        stdout=child_side,
        stderr=child_side,
        env=env,
        cwd=tmp_path,
        start_new_session=True,  # its own session: signals for pytest's terminal miss it
    )
    os.close(child_side)
    try:
        yield process, Terminal(controller), target
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        os.close(controller)


def answer_all(terminal: Terminal, answers: Mapping[str, list[str]]) -> list[str]:
    """Answer each prompt from ``answers`` (Enter when none is left) until the file is saved."""
    queues = {name: list(values) for name, values in answers.items()}
    asked: list[str] = []
    saved = re.compile(r"\nSaved (\S+)")
    while True:
        match = terminal.expect(re.compile(f"{PROMPT.pattern}|{saved.pattern}"))
        if match.group(1) is None:
            return asked
        name = match.group(1)
        asked.append(name)
        queue = queues.get(name, [])
        terminal.send_line(queue.pop(0) if queue else "")


@pytest.mark.timeout(120)
def test_wizard_in_a_terminal_reasks_a_bad_answer_and_writes_the_config(
    wizard: tuple[subprocess.Popen[bytes], Terminal, Path],
) -> None:
    process, terminal, target = wizard
    terminal.expect("num_processes: Worker processes in all, over every machine")  # help first
    terminal.expect("num_processes [none]: ")
    terminal.send_line("zero")
    terminal.expect("num_processes='zero' is not a valid int. Try again")
    asked = answer_all(
        terminal,
        {
            "num_processes": ["2"],
            "use_cpu": ["yes"],
            "mixed_precision": ["fp8", "bf16"],
            "max_grad_norm": ["1.0"],
            "strategy": ["fsdp"],
            "fsdp.sharding_strategy": ["SHARD_GRAD_OP"],
        },
    )
    tail = terminal.rest()
    assert process.wait(timeout=30) == 0, terminal.text
    assert "mixed_precision='fp8' is not one of 'no', 'fp16', 'bf16'" in terminal.text
    assert asked.count("mixed_precision") == 2
    assert "machine_rank" not in asked and not [n for n in asked if n.startswith("deepspeed.")]
    assert "fsdp.cpu_offload" in asked
    assert "nbaccel launch --num_processes 2 --use_cpu true --mixed_precision bf16" in tail
    expected = Config().replace(
        num_processes=2,
        use_cpu=True,
        mixed_precision="bf16",
        max_grad_norm=1.0,
        strategy="fsdp",
        fsdp_sharding_strategy="SHARD_GRAD_OP",
    )
    assert resolve(env={}, config=target, use_default_file=False).config == expected


@pytest.mark.timeout(120)
def test_ctrl_d_in_a_terminal_aborts_without_writing(
    wizard: tuple[subprocess.Popen[bytes], Terminal, Path],
) -> None:
    process, terminal, target = wizard
    terminal.expect("num_processes [none]: ")
    terminal.send_line("3")
    terminal.expect("num_machines [1]: ")
    os.write(terminal.fd, b"\x04")  # Ctrl-D at the start of a line: end of input
    assert "nothing was written" in terminal.rest()
    assert process.wait(timeout=30) == 1
    assert not target.exists() and not target.parent.exists()
