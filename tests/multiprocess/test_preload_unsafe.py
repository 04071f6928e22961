"""Libraries that make the helper unsafe to fork from (they start a thread at import): the
helper is replaced, and no launch fails for it, whichever helper it found or waited on.

Each test drives its own ``python -`` (its own helper), with the stand-ins of
``test_preload`` plus those below as its installed libraries.
"""

from __future__ import annotations

from pathlib import Path

from tests.multiprocess.test_preload import drive

THREAD_AT_IMPORT = (
    "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
)

# Records every replacement the driver's kernel side makes: (old, new) HelperProcess.
RECORD_REPLACEMENTS = """
replacements = []
_replacement = helper_module._replacement
def recording(old, stale):
    new = _replacement(old, stale)
    replacements.append((old, new))
    return new
helper_module._replacement = recording

def wait_until(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("never happened")
        time.sleep(0.01)
"""


def test_a_successors_successor_outlives_the_first_helper_and_serves_the_next_launch(
    tmp_path: Path,
) -> None:
    # Two unrelated libraries that each start a thread: the first helper refuses one and is
    # replaced while a run is still on it; its successor refuses the other and is replaced
    # in turn (it had no run: it is closed at once). The first helper's run then ends, and
    # the first helper with it: the helper that serves the kernel now must be unharmed (it
    # was taken for an orphan of that run and killed: the next launch failed with
    # "HelperError: the nbaccel helper process exited").
    result, out = drive(
        tmp_path,
        RECORD_REPLACEMENTS
        + """
import thready, thready_too
gate = os.path.abspath("gate")

def wait_for_gate(path):
    import os, time
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.exists(path)

first = helper_module.shared_helper()
run = nbaccel.launch(wait_for_gate, args=(gate,), num_processes=2, dashboard=False,
                     runs_dir=os.path.abspath("runs"))
wait_until(lambda: len(replacements) == 2)
middle, last = replacements[0][1], replacements[1][1]
middle._process.wait(60)                  # closed at once: it had no run
open(gate, "w").close()
gated = run.results(timeout=240)
first._process.wait(60)                   # closed once its run ended
try:
    value = launch(already, "x")
except Exception as error:
    value = repr(error)
shared, alive, base = helper_module.shared_helper() is last, last.alive, last._base
helper_module.shutdown_shared_helper()
import psutil
try:
    psutil.Process(base).wait(60)            # no child of ours: it reads EOF, and exits
    base_gone = True
except psutil.NoSuchProcess:
    base_gone = True
except psutil.TimeoutExpired:
    base_gone = False
print(json.dumps({"gated": gated == {0: True, 1: True}, "next": value, "shared": shared,
                  "alive": alive, "base_gone": base_gone,
                  "chain": [first is replacements[0][0], middle is replacements[1][0]]}))
""",
        stand_ins={"thready_too.py": THREAD_AT_IMPORT},
    )
    assert result == {
        "gated": True,
        "next": False,
        "shared": True,
        "alive": True,
        "base_gone": True,
        "chain": [True, True],
    }, out


def test_a_helper_replaced_while_a_launch_starts_on_it_serves_that_launch(
    tmp_path: Path,
) -> None:
    # Between the launch's last look at the shared helper and its request for workers, the
    # helper retires (here forced, as an unsafe preload or a changed file does): it stays
    # until that launch's run ends, and serves it; it was closed under the launch before.
    result, out = drive(
        tmp_path,
        RECORD_REPLACEMENTS
        + """
from nbaccel.launcher.local import start as start_module
launch(already, "x")                      # a helper, ready
offer = start_module.offer_libraries
def offer_then_retire(helper, modules=None):
    offer(helper, modules)
    helper_module._replace(helper)         # replaced and retired, now
start_module.offer_libraries = offer_then_retire
held = start_module.held_helper
def held_then_retire(*args, **kwargs):
    with held(*args, **kwargs) as helper:
        helper_module._replace(helper)     # retired while held by this launch
        yield helper
import contextlib
start_module.held_helper = contextlib.contextmanager(held_then_retire)
try:
    value = launch(already, "x")
except Exception as error:
    value = repr(error)
start_module.offer_libraries, start_module.held_helper = offer, held
retired = replacements[-1][0]
retired._process.wait(60)                 # it goes once the run it served has ended
print(json.dumps({"value": value, "replacements": len(replacements),
                  "retired_alive": retired.alive, "next": launch(already, "x")}))
""",
    )
    assert result == {
        "value": False,
        "replacements": 2,
        "retired_alive": False,
        "next": False,
    }, out


# A library whose import starts a thread (pyarrow), one that imports it (pandas), one that
# imports both, the first directly (datasets), and safe ones beside them (huggingface_hub,
# and transformers, which imports it).
CASCADE = {
    "tharrow.py": THREAD_AT_IMPORT,
    "pandaish.py": "import tharrow\n",
    "dataish.py": "import hubish, tharrow, pandaish\n",
    "hubish.py": "VALUE = 'safe'\n",
    "transformish.py": "import hubish\n",
}


def test_one_import_that_starts_a_thread_retires_one_helper_and_refuses_what_leads_to_it(
    tmp_path: Path,
) -> None:
    # The first helper imports dataish (the names go in order), which loads tharrow, whose
    # thread makes the helper unsafe. Refused with it: what leads to tharrow's import
    # (dataish, and pandaish, which imports it too though dataish had loaded it first);
    # not hubish or transformish, which the replacement preloads. Refusing only dataish
    # retired the next helper at pandaish, and the one after at tharrow.
    result, out = drive(
        tmp_path,
        RECORD_REPLACEMENTS
        + """
import dataish, pandaish, tharrow, hubish, transformish
names = ["dataish", "hubish", "pandaish", "tharrow", "transformish"]

def held():
    import sys
    return {name: name in sys.modules for name in names}

launch(already, "x")                      # offers them: the first helper refuses dataish
def settled():
    helper = helper_module.shared_helper()
    return helper.wait_preloaded(60) and helper.usable
wait_until(settled)                       # a helper that dealt with every offer, usable
print(json.dumps({"replacements": len(replacements), "held": launch(held),
                  "refused": [n for n in names if helper_module.CHOICE.refused(n)]}))
""",
        stand_ins=CASCADE,
    )
    assert result == {
        "replacements": 1,
        "held": {
            "dataish": False,
            "hubish": True,
            "pandaish": False,
            "tharrow": False,
            "transformish": True,
        },
        "refused": ["dataish", "pandaish", "tharrow"],
    }, out
    assert (
        out.count(
            "nbaccel: not preloaded: dataish, pandaish, tharrow (tharrow: it started a thread at "
            "import; the others import it); workers import them themselves"
        )
        == 1
    ), out
