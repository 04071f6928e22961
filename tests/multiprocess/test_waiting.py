"""A launch says what its workers wait for while they wait (issue 39, item 19): a cold start
said "running · 0:00 … 0:02" while the helper still imported torch, and a launch straight
after one whose rank 0 imported a library waited for the helper's import of it unsaid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multiprocess.conftest import run_script

pytestmark = pytest.mark.timeout(240)

SCRIPT = """
import json, nbaccel

def imports_idna():
    import idna  # installed, imported by no one else here (torch imports tqdm): preloaded next
    return 1

def plain():
    return 2

first = nbaccel.launch(imports_idna, num_processes=2, dashboard="text")
first.wait(180)
print("FIRST ENDED", flush=True)
second = nbaccel.launch(plain, num_processes=2, dashboard="text")  # straight after it
second.wait(180)
print("RUNS " + json.dumps([str(first.run_dir), str(second.run_dir)]), flush=True)
"""


def waits(run_dir: str) -> list[str]:
    events = [
        json.loads(line) for line in (Path(run_dir) / "events.jsonl").read_text().splitlines()
    ]
    return [event["for"] for event in events if event["event"] == "waiting"]


def test_a_cold_start_and_a_preload_say_what_the_launch_waits_for(tmp_path: Path) -> None:
    result = run_script(SCRIPT, tmp_path, timeout=230)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("FIRST ENDED", 1)
    assert "nbaccel: starting: the helper imports torch (the first launch only" in first
    assert "nbaccel: starting: the helper imports idna" in second, second
    assert "the helper imports torch" not in second  # the helper is ready: nothing to wait for
    runs = json.loads(second.split("RUNS ", 1)[1])
    assert waits(runs[0])[0].startswith("the helper imports torch")
    assert any("idna" in text for text in waits(runs[1]))


def test_a_launch_after_the_helper_died_says_a_new_one_imports_torch(runs_dir: str) -> None:
    import os
    import signal
    import time

    import nbaccel
    from nbaccel.launcher.local.helper import shared_helper

    helper = shared_helper()
    assert helper.wait_ready(120)
    os.kill(helper.pid, signal.SIGKILL)  # as the out-of-memory killer would
    deadline = time.monotonic() + 30
    while helper.alive:  # its reader sees the socket close (bounded)
        assert time.monotonic() < deadline, "the helper's end was never noticed"
        time.sleep(0.01)
    run = nbaccel.launch(print, num_processes=1, runs_dir=runs_dir, dashboard=False)
    assert run.wait(120) is nbaccel.RunState.SUCCEEDED
    assert waits(str(run.run_dir))[0] == "a new helper imports torch (the last one exited)"
