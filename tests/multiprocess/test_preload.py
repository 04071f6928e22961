"""The helper preloads the installed libraries the kernel imported, checked, for the next
launch; the user's own modules stay fresh (each test drives its own ``python -``, so it has
its own helper)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multiprocess.conftest import run_script

# The driver's "installed libraries": a folder of stand-ins that counts as site-packages
# (PreloadChoice's roots) and is on the helper's path (PYTHONPATH, which it inherits).
STAND_INS = {
    "thready.py": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    ),
    "cudaish.py": "import torch\ntorch.cuda.is_initialized = lambda: True  # says it did\n",
    "handlery.py": "import signal\nsignal.signal(signal.SIGUSR2, lambda *a: None)\n",
    "quiet_lib.py": "VALUE = 'from the helper'\n",
    "worker_lib.py": "VALUE = 'only the workers import it'\n",
}

DRIVER_HEAD = """
import json, os, sys, time
sys.path.insert(0, {site!r})
os.environ["PYTHONPATH"] = {site!r}  # the helper, started below, inherits it
import nbaccel
from nbaccel.launcher.local import helper as helper_module
from nbaccel.launcher.local.preloading.preload_choice import PreloadChoice

helper_module.CHOICE = PreloadChoice(roots=[{site!r}])

def launch(fn, *args):
    return nbaccel.notebook_launcher(fn, args=args, num_processes=2, dashboard=False,
                                     runs_dir={runs!r})

def already(name):
    import sys
    return name in sys.modules

def preloaded(timeout=60):
    # The helper once it has dealt with every library offered so far (or was retired).
    helper = helper_module.shared_helper()
    if not helper.wait_preloaded(timeout) and helper.usable:
        raise TimeoutError("the helper never reported its preload")
    return helper
"""


def drive(
    tmp_path: Path, body: str, timeout: float = 240, stand_ins: dict[str, str] | None = None
) -> tuple[dict[str, object], str]:
    site = tmp_path / "site-packages"
    site.mkdir(exist_ok=True)
    for name, code in {**STAND_INS, **(stand_ins or {})}.items():
        (site / name).write_text(code)
    head = DRIVER_HEAD.format(site=str(site), runs=str(tmp_path / "runs"))
    done = run_script(head + body, tmp_path, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    return json.loads(last), done.stdout


def test_a_library_the_kernel_imported_is_in_the_launchs_workers(tmp_path: Path) -> None:
    result, _ = drive(
        tmp_path,
        """
import quiet_lib
first = launch(already, "quiet_lib")
preloaded()
second = launch(already, "quiet_lib")
print(json.dumps({"first": first, "second": second}))
""",
    )
    # The launch offered it before asking for workers: the helper imported it first (the
    # workers would have, each on its own), then forked them; the same for later launches.
    assert result == {"first": True, "second": True}


def test_launches_back_to_back_from_a_script_find_its_libraries_and_their_workers(
    tmp_path: Path,
) -> None:
    # A sweep in a plain script: launch after launch, never a pause for the helper to be
    # idle in. The script's own libraries are in every launch's workers; what the first
    # launch's workers imported (rank 0 tells) is in the second's.
    result, _ = drive(
        tmp_path,
        """
import quiet_lib

def both():
    import sys
    had = ["quiet_lib" in sys.modules, "worker_lib" in sys.modules]
    import worker_lib
    return had

print(json.dumps([launch(both) for _ in range(3)]))
""",
    )
    assert result == [[True, False], [True, True], [True, True]]


def test_a_library_imported_later_is_preloaded_for_the_launch_that_offers_it(
    tmp_path: Path,
) -> None:
    result, _ = drive(
        tmp_path,
        """
before = launch(already, "quiet_lib")   # the helper exists, quiet_lib is not imported
import quiet_lib                         # now the kernel has it
offered = launch(already, "quiet_lib")   # this launch offers it, and waits for it
preloaded()
after = launch(already, "quiet_lib")
print(json.dumps({"before": before, "offered": offered, "after": after}))
""",
    )
    assert result == {"before": False, "offered": True, "after": True}


def test_what_the_last_launchs_workers_imported_is_preloaded_too(tmp_path: Path) -> None:
    result, _ = drive(
        tmp_path,
        """
def uses_it():
    import quiet_lib
    return quiet_lib.VALUE

launch(uses_it)      # the kernel never imports quiet_lib; rank 0 reports that it did
preloaded()
print(json.dumps({"next": launch(already, "quiet_lib"), "kernel": "quiet_lib" in sys.modules}))
""",
    )
    assert result == {"next": True, "kernel": False}


@pytest.mark.parametrize(
    ("stand_in", "why"),
    [("thready", "it started a thread at import"), ("cudaish", "it initialised CUDA at import")],
)
def test_a_library_unsafe_to_fork_with_is_refused_named_and_the_helper_replaced(
    tmp_path: Path, stand_in: str, why: str
) -> None:
    result, out = drive(
        tmp_path,
        f"""
import {stand_in}
old = helper_module.shared_helper()
launch(already, "x")                      # offers {stand_in}; the helper refuses it
old.wait_preloaded(60)                    # returns once it is retired (bounded)
replaced = not old.usable
second = launch(already, "{stand_in}")    # another helper, which never imports it
new = helper_module.shared_helper()
third = launch(already, "{stand_in}")     # never offered again: CHOICE refuses it
print(json.dumps({{"replaced": replaced, "pids": [old.pid, new.pid], "old_alive": old.alive,
                  "second": second, "third": third}}))
""",
    )
    assert result["replaced"] is True
    old_pid, new_pid = result["pids"]  # type: ignore[misc]
    assert old_pid != new_pid
    assert result["old_alive"] is False  # the retired helper was closed, not left behind
    assert result["second"] is False and result["third"] is False
    # The launch after the refusal says so in its text output, once.
    assert out.count(f"nbaccel: not preloaded: {stand_in} ({why})") == 1


def test_a_library_that_installs_a_signal_handler_is_refused_and_the_helper_kept(
    tmp_path: Path,
) -> None:
    result, out = drive(
        tmp_path,
        """
import handlery
launch(already, "x")
old = preloaded()
print(json.dumps({"usable": old.usable, "next": launch(already, "handlery"),
                  "same": helper_module.shared_helper().pid == old.pid}))
""",
    )
    assert result == {"usable": True, "next": False, "same": True}
    assert "nbaccel: not preloaded: handlery (it installed a signal handler at import)" in out


def test_a_module_beside_the_notebook_is_never_preloaded_and_an_edit_shows(
    tmp_path: Path,
) -> None:
    (tmp_path / "mymodel.py").write_text("VALUE = 1\n")
    result, _ = drive(
        tmp_path,
        """
import mymodel, quiet_lib

def value():
    import sys
    had = "mymodel" in sys.modules
    import mymodel
    return had, mymodel.VALUE

first = launch(value)
preloaded()
open("mymodel.py", "w").write("VALUE = 2\\n")
second = launch(value)
chosen = helper_module.CHOICE.choose(sys.modules)
print(json.dumps({"first": first, "second": second, "offered": "mymodel" in chosen,
                  "quiet_lib": "quiet_lib" in chosen}))
""",
    )
    assert result == {
        "first": [False, 1],
        "second": [False, 2],
        "offered": False,
        "quiet_lib": True,
    }


def test_spares_are_replaced_when_the_preload_set_grows_and_twenty_relaunches_leak_nothing(
    tmp_path: Path,
) -> None:
    result, _ = drive(
        tmp_path,
        """
import psutil, threading

def spares(other_than=frozenset(), timeout=30):
    # The helper's idle children once it has forked some (one per idle turn; bounded).
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {p.pid for p in psutil.Process(helper.pid).children()} - set(other_than)
        if found:
            return found
        time.sleep(0.02)
    return set()

launch(already, "x")
helper = preloaded()            # the first warm-up (the Accelerator's imports) is over
spares_before = spares()
import quiet_lib                # the preload set grows
launch(already, "x")
preloaded()
spares_after = spares(other_than=spares_before)
me = psutil.Process()
fds, threads = me.num_fds(), threading.active_count()
values = [launch(already, "quiet_lib") for _ in range(20)]
children = psutil.Process(helper.pid).children(recursive=True)
print(json.dumps({
    "replaced": bool(spares_before) and bool(spares_after)
                and not spares_before & {p.pid for p in psutil.Process(helper.pid).children()},
    "all_preloaded": all(values), "fds": me.num_fds() - fds,
    "threads": threading.active_count() - threads, "same_helper": helper.usable,
    "only_spares": all(c.ppid() == helper.pid for c in children), "children": len(children),
}))
""",
        timeout=400,
    )
    assert result["replaced"] is True
    assert result["all_preloaded"] is True
    assert result["fds"] == 0 and result["threads"] == 0
    assert result["same_helper"] is True
    assert result["only_spares"] is True and result["children"] <= 16  # type: ignore[operator]


def test_a_helper_made_unsafe_starts_its_spares_from_a_fresh_interpreter(tmp_path: Path) -> None:
    # A launch already on its way to a helper that a preloaded library made unsafe to fork
    # still gets workers: spares exec'd from a clean interpreter (exec_spare.py), not forks.
    result, _ = drive(
        tmp_path,
        """
import socket, psutil
from nbaccel.launcher import control
from nbaccel.launcher.local.helper_main import Helper
from nbaccel.launcher.local.successor import ParentWatch

# What HelperProcess gives the helper: the package's folder on PYTHONPATH.
root = os.path.dirname(os.path.dirname(nbaccel.__file__))
os.environ["PYTHONPATH"] = os.pathsep.join([root, os.environ["PYTHONPATH"]])
ours, theirs = control.socket_pair()
helper = Helper(theirs, ParentWatch(os.getpid(), child=False))
helper.preloader.unsafe = "preloading thready: it started a thread at import"
pid = helper.fork_spare()
spare = psutil.Process(pid)
deadline = time.monotonic() + 60  # until the spawned child has exec'd (bounded)
# Until it has exec'd: its module on the command line, or the name it gives itself then.
EXECED = ("nbaccel.launcher.local.exec_spare", "nbaccel spare (fresh interpreter)")
while not any(name in " ".join(cmdline := spare.cmdline()) for name in EXECED):
    if time.monotonic() > deadline:
        break
    time.sleep(0.01)
alive = spare.is_running() and spare.status() != psutil.STATUS_ZOMBIE
for _, channel in helper.spares:
    channel.close()              # a retired spare: EOF on its socket, and it leaves
code = spare.wait(120)
print(json.dumps({"exec": any(name in " ".join(cmdline) for name in EXECED), "alive": alive,
                  "code": code}))
""",
    )
    assert result["exec"] is True and result["alive"] is True
    assert result["code"] == 0


def test_pyarrow_pandas_and_datasets_are_preloaded_without_their_jemalloc_thread(
    tmp_path: Path,
) -> None:
    # pyarrow's jemalloc starts a background thread at load, which made the helper refuse
    # it (and pandas and datasets, which import it): every launch of a data notebook paid
    # their imports. The helper runs jemalloc without that thread (JE_ARROW_MALLOC_CONF).
    script = """
import json, sys
import pyarrow, pandas, datasets, nbaccel
from nbaccel.launcher.local import helper as helper_module

def found():
    import os, sys
    threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip()
                     for t in os.listdir("/proc/self/task"))
    return [m for m in ("pyarrow", "pandas", "datasets") if m in sys.modules], threads

runs = {"runs_dir": "runs", "dashboard": False, "num_processes": 1}
nbaccel.notebook_launcher(found, **runs)
helper = helper_module.shared_helper()
helper.wait_preloaded(120)
libraries, threads = nbaccel.notebook_launcher(found, **runs)
print(json.dumps({"libraries": libraries, "threads": threads,
                  "notices": helper_module.take_notices()}))
"""
    done = run_script(script, tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["libraries"] == ["pyarrow", "pandas", "datasets"]  # preloaded, all three
    assert not any("pyarrow" in notice for notice in result["notices"]), result["notices"]
    assert "jemalloc_bg_thd" not in result["threads"]
