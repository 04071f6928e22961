"""``import nbaccel`` in a real ipykernel starts the helper before any launch.

Each test starts a kernel with jupyter_client, imports nbaccel in it and looks at the
kernel's children with psutil (every wait bounded): the helper (``python -m
nbaccel.launcher.local.helper_main``) appears without a launch, the first launch's workers are
its children (same pid: no second helper), a launch in the importing cell itself waits for
the start in progress instead of making a second helper, the helper and its spares go
when a kernel that never launched shuts down, and with ``NBACCEL_PREWARM=0`` nothing is
started until the first launch.
"""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client import BlockingKernelClient, KernelManager

pytestmark = pytest.mark.timeout(300)

KERNEL_NAME = "python3"
HELPER_MODULE = "nbaccel.launcher.local.helper_main"
APPEAR_TIMEOUT_S = 60.0  # a thread's Popen: milliseconds; the margin is for a loaded machine
EXIT_TIMEOUT_S = 60.0  # the helper may be mid-`import torch` when its kernel goes

# Returns each rank's parent: the process that forked it.
PARENTS = """
def parent_pid():
    import os

    return os.getppid()
"""


# Launches a worker that reports whether the helper had imported WARM_LATER before forking
# it, every QUIET_S seconds (the pause a user makes between cells: the helper warms up in
# such a pause), until it has or WARM_TIMEOUT_S pass.
QUIET_S = 0.5
WARM_TIMEOUT_S = 60.0
WARMED = """
import time as _time
def warmed():
    import sys

    return "nbaccel.accel" in sys.modules and "torch._dynamo" in sys.modules
_deadline = _time.monotonic() + {timeout}
while not (WARMED := nbaccel.launch(warmed, num_processes=1, runs_dir={runs!r},
                                   dashboard="text").results(timeout=240)[0]):
    if _time.monotonic() > _deadline:
        break
    _time.sleep({quiet})
"""


def launch_cell(runs: Path) -> str:
    return (
        f"PARENTS = nbaccel.launch(parent_pid, num_processes=2, runs_dir={str(runs)!r}, "
        "dashboard='text').results(timeout=240)"
    )


@pytest.fixture
def start_kernel(
    kernel_dirs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str | None], tuple[KernelManager, BlockingKernelClient]]]:
    """Start a kernel with NBACCEL_PREWARM set to a value (or unset); shut down after."""
    started: list[tuple[KernelManager, BlockingKernelClient]] = []

    def start(prewarm: str | None) -> tuple[KernelManager, BlockingKernelClient]:
        if prewarm is None:
            monkeypatch.delenv("NBACCEL_PREWARM", raising=False)
        else:
            monkeypatch.setenv("NBACCEL_PREWARM", prewarm)
        km = KernelManager(kernel_name=KERNEL_NAME)
        km.start_kernel(cwd=str(tmp_path))
        kc = km.client()
        started.append((km, kc))
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        return km, kc

    yield start
    for km, kc in started:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def run(kc: BlockingKernelClient, code: str, **expressions: str) -> dict[str, Any]:
    """Run ``code``; the values of ``expressions`` (JSON-encoded in the kernel) by name."""
    wrapped = {name: f"__import__('json').dumps({expr})" for name, expr in expressions.items()}
    reply = kc.execute_interactive(code, user_expressions=wrapped, timeout=240)
    content = reply["content"]
    assert content["status"] == "ok", "\n".join(content.get("traceback", []))
    values = content["user_expressions"]
    for name, value in values.items():
        assert value["status"] == "ok", f"{name}: {value}"
    # text/plain is the repr of the JSON string
    return {
        name: json.loads(ast.literal_eval(value["data"]["text/plain"]))
        for name, value in values.items()
    }


def helpers_of(pid: int) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(pid).children():
        try:
            # Its module until it runs, then the name it gives itself (process_names).
            if HELPER_MODULE in child.cmdline() or child.name() == "nbaccel helper":
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def named_for(kernel_pid: int) -> dict[int, tuple[str, str]]:
    """{pid: (comm, command line)} of every process named as serving ``kernel_pid``."""
    found = {}
    for process in psutil.process_iter():
        try:
            cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")[0]
            comm = Path(f"/proc/{process.pid}/comm").read_text().strip()
        except OSError:
            continue  # gone, or not ours to read
        if cmdline.decode(errors="replace").endswith(f"for pid {kernel_pid})"):
            found[process.pid] = (comm, cmdline.decode())
    return found


def wait_for_helper(kernel_pid: int) -> psutil.Process:
    """The kernel's helper, once it is there (bounded wait)."""
    deadline = time.monotonic() + APPEAR_TIMEOUT_S
    while not (found := helpers_of(kernel_pid)):
        assert time.monotonic() < deadline, f"no helper under the kernel after {APPEAR_TIMEOUT_S} s"
        time.sleep(0.05)  # polling psutil; the bound above is the wait
    assert len(found) == 1, f"more than one helper: {[p.cmdline() for p in found]}"
    return found[0]


def test_import_starts_the_helper_and_the_first_launch_uses_it(
    start_kernel: Callable[[str | None], tuple[KernelManager, BlockingKernelClient]],
    tmp_path: Path,
) -> None:
    _, kc = start_kernel(None)
    kernel_pid = run(kc, "import os, nbaccel", pid="os.getpid()")["pid"]
    helper = wait_for_helper(kernel_pid)  # before any launch

    values = run(kc, PARENTS + launch_cell(tmp_path / "runs"), parents="PARENTS")
    assert values["parents"] == {"0": helper.pid, "1": helper.pid}
    assert [p.pid for p in helpers_of(kernel_pid)] == [helper.pid]

    # Once quiet, the helper imports the Accelerator and torch._dynamo for later workers.
    run(kc, WARMED.format(runs=str(tmp_path / "runs"), quiet=QUIET_S, timeout=WARM_TIMEOUT_S))
    assert run(kc, "", warmed="WARMED")["warmed"] is True


def test_import_leaves_a_helper_a_base_and_two_spares_each_named_for_what_it_is(
    start_kernel: Callable[[str | None], tuple[KernelManager, BlockingKernelClient]],
) -> None:
    # What `import nbaccel` leaves running (issue 39, item 20): in ps, top and nvidia-smi a
    # spare must not look like a stray worker, nor the base (its parent is init) a leak.
    _, kc = start_kernel(None)
    kernel_pid = run(kc, "import os, nbaccel", pid="os.getpid()")["pid"]
    helper = wait_for_helper(kernel_pid)
    want = {
        "nbaccel helper": f"nbaccel helper (for pid {kernel_pid})",
        "nbaccel base": f"nbaccel base (next helper for pid {kernel_pid})",
        "nbaccel spare": f"nbaccel spare (for pid {kernel_pid})",
    }
    expected = ["nbaccel base", "nbaccel helper", "nbaccel spare", "nbaccel spare"]

    def settled() -> dict[int, tuple[str, str]] | None:
        # One snapshot judged whole: once the helper has preloaded the Accelerator it replaces
        # its spares with ones that have it, so for a moment a third spare (new, or an old one
        # on its way out) is named; a later look must not be compared with an earlier one.
        found = named_for(kernel_pid)
        children = {p.pid for p in helper.children()}
        named_spares = {pid for pid, (comm, _) in found.items() if comm == "nbaccel spare"}
        ready = sorted(comm for comm, _ in found.values()) == expected and named_spares <= children
        return found if ready else None

    deadline = time.monotonic() + APPEAR_TIMEOUT_S
    while (found := settled()) is None:
        assert time.monotonic() < deadline, f"after {APPEAR_TIMEOUT_S} s: {named_for(kernel_pid)}"
        time.sleep(0.05)  # polling psutil; the bound above is the wait
    assert all(cmdline == want[comm] for comm, cmdline in found.values()), found
    assert found[helper.pid][0] == "nbaccel helper"


def test_a_launch_in_the_importing_cell_waits_for_that_helper(
    start_kernel: Callable[[str | None], tuple[KernelManager, BlockingKernelClient]],
    tmp_path: Path,
) -> None:
    _, kc = start_kernel(None)
    code = "import os, nbaccel\n" + PARENTS + launch_cell(tmp_path / "runs")
    values = run(kc, code, pid="os.getpid()", parents="PARENTS")
    (helper,) = helpers_of(values["pid"])
    assert values["parents"] == {"0": helper.pid, "1": helper.pid}


def test_a_launch_at_import_says_it_waits_for_the_helpers_torch_import(
    start_kernel: Callable[[str | None], tuple[KernelManager, BlockingKernelClient]],
    tmp_path: Path,
) -> None:
    # The cell used to say nothing for the seconds the helper imports torch (issue 39,
    # item 19); in text, as in the dashboard's header, it says what the launch waits for.
    _, kc = start_kernel(None)
    code = "import os, nbaccel\n" + PARENTS + launch_cell(tmp_path / "runs")
    said: list[str] = []

    def keep(message: dict[str, Any]) -> None:
        if message["msg_type"] == "stream":
            said.append(message["content"]["text"])

    reply = kc.execute_interactive(code, output_hook=keep, timeout=240)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = "".join(said)
    assert "nbaccel: starting: the helper imports torch (the first launch only" in text, text


def test_a_kernel_that_never_launches_leaves_nothing_behind(
    start_kernel: Callable[[str | None], tuple[KernelManager, BlockingKernelClient]],
) -> None:
    km, kc = start_kernel(None)
    kernel_pid = run(kc, "import os, nbaccel", pid="os.getpid()")["pid"]
    helper = wait_for_helper(kernel_pid)
    tree = [helper, *helper.children(recursive=True)]  # spares, if forked by now
    km.shutdown_kernel(now=False)
    _, alive = psutil.wait_procs(tree, timeout=EXIT_TIMEOUT_S)
    assert not alive, f"left behind: {[p.pid for p in alive]}"


def test_nbaccel_prewarm_0_starts_nothing_until_the_first_launch(
    start_kernel: Callable[[str | None], tuple[KernelManager, BlockingKernelClient]],
    tmp_path: Path,
) -> None:
    _, kc = start_kernel("0")
    # The decision is made inside the import: no thread and no child by its end, none later.
    values = run(
        kc,
        "import os, threading, psutil, nbaccel",
        pid="os.getpid()",
        threads="[t.name for t in threading.enumerate()]",
        children="[p.pid for p in psutil.Process().children()]",
    )
    assert "nbaccel-prewarm" not in values["threads"]
    assert values["children"] == []

    parents = run(kc, PARENTS + launch_cell(tmp_path / "runs"), parents="PARENTS")["parents"]
    (helper,) = helpers_of(values["pid"])  # started by the launch
    assert parents == {"0": helper.pid, "1": helper.pid}
