"""The helper's start at ``import nbaccel``: when it happens (kernel or not, NBACCEL_PREWARM),
the lock a launch waits on, and how the helper serves requests in the middle of its
background imports. No helper process is started here (tests/notebook/test_prewarm.py
starts real ones in a real kernel)."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbaccel.config.resolve import resolve
from nbaccel.env_names import PREWARM_VAR
from nbaccel.errors import HelperError
from nbaccel.launcher import control, prewarm
from nbaccel.launcher.local import helper
from nbaccel.launcher.local.helper_main import Helper
from nbaccel.launcher.local.successor import ParentWatch


@pytest.mark.parametrize("value", [None, "", "1", "true", "YES", " on "])
def test_in_a_kernel_the_helper_is_prewarmed_unless_turned_off(value: str | None) -> None:
    env = {} if value is None else {PREWARM_VAR: value}
    assert prewarm.prewarm_wanted(env, in_kernel=True)


@pytest.mark.parametrize("value", ["0", "false", "No", "off", "n"])
def test_nbaccel_prewarm_0_turns_it_off(value: str) -> None:
    assert not prewarm.prewarm_wanted({PREWARM_VAR: value}, in_kernel=True)


@pytest.mark.parametrize("value", [None, "1"])
def test_never_outside_a_kernel(value: str | None) -> None:
    env = {} if value is None else {PREWARM_VAR: value}
    assert not prewarm.prewarm_wanted(env, in_kernel=False)


def test_an_unreadable_value_warns_naming_it_and_starts_nothing() -> None:
    with pytest.warns(RuntimeWarning, match=r"NBACCEL_PREWARM='maybe' is not a boolean"):
        assert not prewarm.prewarm_wanted({PREWARM_VAR: "maybe"}, in_kernel=True)


def test_prewarm_not_wanted_starts_no_thread_and_no_process(nothing_started: Path) -> None:
    before = set(threading.enumerate())
    assert prewarm.prewarm({PREWARM_VAR: "0"}, in_kernel=True) is None
    assert prewarm.prewarm({}, in_kernel=False) is None
    assert set(threading.enumerate()) == before


def test_the_variable_is_not_taken_for_an_unknown_config_option() -> None:
    # Every NBACCEL_* name that is no option is refused by resolve(); this one is known.
    resolved = resolve({}, env={PREWARM_VAR: "0"}, use_default_file=False)
    assert resolved.sources["num_processes"] == "default"


@pytest.fixture
def shared_lock_held() -> Iterator[None]:
    """Another thread is in the middle of starting the shared helper."""
    assert helper._shared_lock.acquire(timeout=10)
    try:
        yield
    finally:
        helper._shared_lock.release()


def test_a_launch_waits_for_a_start_in_progress_then_fails_clearly(
    shared_lock_held: None,
) -> None:
    with pytest.raises(HelperError, match=r"still being started by another thread after 0 s"):
        helper.shared_helper(timeout=0.05)


# A stand-in for a Jupyter kernel: an IPython module whose shell is a ZMQInteractiveShell,
# which is all nbaccel.ui.kernel.in_kernel looks at.
_FAKE_KERNEL = """
import sys, types
class ZMQInteractiveShell: pass
shell = ZMQInteractiveShell()
sys.modules["IPython"] = types.SimpleNamespace(get_ipython=lambda: shell)
"""
_REPORT = """
import json, sys, threading, psutil, nbaccel.ui.kernel
watched = ("nbaccel.launching", "nbaccel.config.schema", "yaml")
print(json.dumps({
    "loaded": sorted(m for m in watched if m in sys.modules),
    "launch": nbaccel.launch.__module__,
    "in_kernel": nbaccel.ui.kernel.in_kernel(),
    "threads": [t.name for t in threading.enumerate()],
    "children": [p.pid for p in psutil.Process().children(recursive=True)],
}))
"""


def _import_nbaccel(*, kernel: bool, prewarm_value: str | None) -> dict[str, Any]:
    """``import nbaccel`` in a fresh interpreter (in a stand-in kernel or a plain script)
    and what it started: the prewarm decides at import, in that interpreter's one import."""
    code = (_FAKE_KERNEL if kernel else "") + "import nbaccel\n" + _REPORT
    env = {k: v for k, v in os.environ.items() if k != PREWARM_VAR}
    if prewarm_value is not None:
        env[PREWARM_VAR] = prewarm_value
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    assert report["in_kernel"] is kernel  # the stand-in is taken for a kernel
    return report


def test_import_nbaccel_in_a_script_starts_nothing() -> None:
    report = _import_nbaccel(kernel=False, prewarm_value="1")
    assert "nbaccel-prewarm" not in report["threads"]
    assert report["children"] == []


def test_import_nbaccel_in_a_kernel_with_nbaccel_prewarm_0_starts_nothing() -> None:
    # The decision is made in the import itself: nothing started by then, nothing later.
    report = _import_nbaccel(kernel=True, prewarm_value="0")
    assert "nbaccel-prewarm" not in report["threads"]
    assert report["children"] == []


@pytest.mark.parametrize(("kernel", "prewarm_value"), [(False, "1"), (True, "0"), (True, "1")])
def test_import_nbaccel_loads_the_launch_path_only_where_it_prewarms(
    kernel: bool, prewarm_value: str
) -> None:
    # The helper's and every worker's interpreter import the package first: what it loads
    # delays their import torch. A kernel that prewarms is about to launch: it loads the
    # launch path at once, while the helper imports torch. Either way the names work.
    report = _import_nbaccel(kernel=kernel, prewarm_value=prewarm_value)
    prewarmed = kernel and prewarm_value == "1"
    assert report["loaded"] == (
        ["nbaccel.config.schema", "nbaccel.launching", "yaml"] if prewarmed else []
    )
    assert report["launch"] == "nbaccel.launching"


@pytest.fixture
def idle_helper() -> Iterator[tuple[Helper, socket.socket]]:
    """A Helper (the helper process's loop state) in this process, driven by hand: the
    parent end of its control socket, no spares, no workers, as if mid-import."""
    parent_end, helper_end = control.socket_pair()
    state = Helper(helper_end, ParentWatch(os.getppid(), child=True))
    state.in_tick = True
    try:
        yield state, parent_end
    finally:
        parent_end.close()
        helper_end.close()
        os.close(state.wake_read)
        os.close(state.wake_write)


def test_mid_import_a_spawn_without_a_spare_waits_for_the_import_with_its_fds(
    idle_helper: tuple[Helper, socket.socket],
) -> None:
    state, parent = idle_helper
    read_end, write_end = os.pipe()
    try:
        message = {"op": "spawn", "run": "r1", "rank": 0, "processes": 2}
        control.send(parent, message, [read_end])
        state.serve_mid_import()
        assert [m["run"] for m, _ in state.deferred] == ["r1"]
        ((_, fds),) = state.deferred
        assert len(fds) == 1
        os.fstat(fds[0])  # still open: it goes to the worker once a spare can be forked
        assert not state.workers and not state.spares
    finally:
        for fd in (read_end, write_end, *(fd for _, fds in state.deferred for fd in fds)):
            os.close(fd)


def test_mid_import_a_stop_drops_the_waiting_spawns_it_is_about_and_reports_them(
    idle_helper: tuple[Helper, socket.socket],
) -> None:
    state, parent = idle_helper
    read_end, write_end = os.pipe()
    control.send(parent, {"op": "spawn", "run": "r1", "rank": 0, "processes": 2}, [write_end])
    control.send(parent, {"op": "spawn", "run": "r2", "rank": 0, "processes": 2})
    control.send(parent, {"op": "signal", "run": "r1", "signal": 2, "ranks": None})
    os.close(write_end)
    for _ in range(3):
        state.serve_mid_import()
    # The stop is answered at once (a launch may wait seconds for a preload): the spawn it
    # is about never starts, is reported gone by that signal, and its fds are closed.
    assert [(m["op"], m["run"]) for m, _ in state.deferred] == [("spawn", "r2")]
    exited, _ = control.receive(parent)
    assert exited == {"op": "exited", "run": "r1", "rank": 0, "status": -2}
    assert os.read(read_end, 1) == b""  # the worker's pipe: closed in the helper too
    os.close(read_end)


def test_mid_import_a_request_is_served_as_it_arrives_not_at_the_next_tick(
    idle_helper: tuple[Helper, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    from nbaccel.launcher.local import warm_up

    state, parent = idle_helper
    state.in_tick = False
    monkeypatch.setattr(warm_up, "TICK_SECONDS", 60.0)  # no tick within this test
    with state.serving_meanwhile():
        control.send(parent, {"op": "spawn", "run": "r1", "rank": 0, "processes": 2})
        deadline = time.monotonic() + 10.0
        while not state.deferred and time.monotonic() < deadline:
            pass  # Python bytecodes, as an import runs them: SIGIO's handler runs between
    assert [m["run"] for m, _ in state.deferred] == ["r1"]
    # Afterwards the socket is quiet again: a message raises no signal.
    control.send(parent, {"op": "signal", "run": "r1", "signal": 2, "ranks": None})
    assert len(state.deferred) == 1


def test_the_prewarm_thread_warms_this_side_once_the_helper_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nbaccel.launcher import api

    calls: list[str] = []

    class Started:
        def wait_ready(self, timeout: float) -> bool:
            calls.append("ready")
            return True

    def start() -> Started:
        calls.append("helper")
        return Started()

    monkeypatch.setattr(prewarm, "shared_helper", start)
    monkeypatch.setattr(api, "warm_planning", lambda: calls.append("planning"))
    # Then it follows the kernel's imports on a thread of its own (not in this test process).
    monkeypatch.setattr(prewarm.ImportWatch, "install", lambda: calls.append("watch"))
    monkeypatch.setattr(prewarm, "follow_imports", lambda watch: calls.append("follow"))
    thread = prewarm.prewarm({}, in_kernel=True)
    assert thread is not None
    thread.join(timeout=30)
    assert not thread.is_alive()
    deadline = time.monotonic() + 30
    while "follow" not in calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == ["helper", "ready", "planning", "watch", "follow"]


def test_the_prewarm_module_imports_nothing_of_the_launch_path() -> None:
    # nbaccel/__init__ starts the helper before importing the rest, which starts it ~0.1 s
    # sooner (measured: importing nbaccel.launcher.api first took the prewarm's import
    # from ~50 to ~150 ms). The prewarm module's own imports must stay this light.
    tree = ast.parse(Path(prewarm.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported == {
        "__future__",
        "collections.abc",
        "importlib.machinery",  # stdlib, already imported by every interpreter
        "sys",
        "threading",
        "time",
        "warnings",
        "nbaccel.env_names",
        "nbaccel.launcher.local.helper",
    }


_PLAN_AND_REPORT_IMPORTS = """
import json, sys
import nbaccel
from nbaccel.launcher import api
if sys.argv[1] == "warm":
    api.warm_planning()
before = set(sys.modules)
api.plan(print, ("x",), 2, None, None, {})
print(json.dumps(sorted(set(sys.modules) - before)))
"""


@pytest.mark.parametrize("warm", [False, True])
def test_after_warm_planning_a_first_plan_imports_nothing(warm: bool) -> None:
    # What a kernel's first launch did on its own (NVML's bindings, ctypes: ~15-25 ms of the
    # 1.3x over a later launch measured in benchmarks/launch_latency.py) the prewarm has
    # done; a fresh interpreter, since this one has planned launches already.
    env = {**os.environ, PREWARM_VAR: "0"}
    done = subprocess.run(
        [sys.executable, "-c", _PLAN_AND_REPORT_IMPORTS, "warm" if warm else "cold"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout.splitlines()[-1])
    if warm:
        assert imported == []
    else:
        assert imported, "a cold first plan imports something: else this test shows nothing"


def test_an_offer_of_modules_already_imported_is_answered_at_once(
    idle_helper: tuple[Helper, socket.socket],
) -> None:
    # Nothing to import, so no launch waits and no preload round will report it: the
    # helper says at once that it has dealt with them (the kernel's wait_preloaded).
    state, parent = idle_helper
    state.in_tick = False
    state.handle({"op": "preload", "modules": ["os", "json"]}, [])
    assert not state.preloader.wanted
    parent.settimeout(10.0)  # bounded: before, no answer came
    report, _ = control.receive(parent)
    assert report["op"] == "preloaded" and report["asked"] == 2
