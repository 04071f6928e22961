"""A real nbaccel agent (``python -c AGENT_BOOT``) during its start-up, on this machine.

Its ``import torch`` takes 1-3.5 s here (longer on a slow host); a kernel that ends it
meanwhile (a host that failed its check, a killed kernel, a dropped connection) closes its
channel, and the agent must leave at once, not once the import is over. The import is made
to hang here (a stand-in ``torch`` package first on ``PYTHONPATH`` that says when it starts,
then waits), so an agent that waits for it would never leave.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import psutil

from nbaccel.launcher.remote.preflight import AGENT_BOOT

TIMEOUT_S = 30.0
# Measured: 0.002-0.007 s from the channel's end to the agent's exit (2-core machine, loaded).
LEAVES_WITHIN_S = 1.0

HANGING_TORCH = """
import os, threading
os.write(2, b"importing torch\\n")
threading.Event().wait(600)  # an import that does not end while the test runs
"""


def test_an_agent_whose_channel_closes_while_it_imports_torch_leaves_at_once(
    tmp_path: Path,
) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(HANGING_TORCH)
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT_BOOT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        start_new_session=True,
    )
    try:
        assert agent.stderr is not None and agent.stdin is not None
        said = b""
        deadline = time.monotonic() + TIMEOUT_S
        while b"importing torch\n" not in said:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([agent.stderr], [], [], left)[0], said
            chunk = os.read(agent.stderr.fileno(), 1 << 16)
            assert chunk, f"the agent ended before importing torch: {said!r}"
            said += chunk
        process = psutil.Process(agent.pid)
        assert process.children() == []  # nothing of it but itself to leave behind
        closed = time.monotonic()
        agent.stdin.close()  # the kernel's end of the channel
        code = agent.wait(timeout=TIMEOUT_S)
        took = time.monotonic() - closed
        assert took < LEAVES_WITHIN_S, f"the agent took {took:.2f} s to leave"
        assert code == 1  # it stopped its (no) workers and left: nothing of the import ran on
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for stream in (agent.stdout, agent.stderr):
            if stream is not None:
                stream.close()
