"""Start the helper process at ``import nbaccel`` in a Jupyter kernel, before any launch.

The first launch of a kernel used to pay for the helper's start: a fresh interpreter that
imports torch (1-3 s). A notebook user imports nbaccel seconds before launching, so the
helper can be started then, in the background: the first launch finds it ready (with
spares forked and the Accelerator preloaded) and costs what a later one does.

While the kernel imports (``ImportWatch``, a finder that finds nothing) and after every cell
it runs, the helper is offered the installed libraries the kernel has imported by then
(``helper.offer_libraries``): it imports them in the background, a step behind the kernel,
so the launch after an import cell finds them loaded. After each cell it also checks that
what the helper preloaded is still what is installed (``helper.renew_if_changed``).

Only in a kernel: a plain script launches right after its imports, has nothing to gain and
should not get a process it did not ask for. ``NBACCEL_PREWARM=0`` turns it off (the one
environment variable read at import; the name lives in ``nbaccel.env_names``).
Whether this runs in a kernel is decided above the launcher (``nbaccel/__init__.py`` asks
``nbaccel.ui.kernel``); this module only reads the variable and starts the helper.

>>> prewarm_wanted({}, in_kernel=False)
False
>>> prewarm_wanted({"NBACCEL_PREWARM": "0"}, in_kernel=True)
False
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Mapping
from importlib.machinery import ModuleSpec

from nbaccel.env_names import PREWARM_VAR
from nbaccel.launcher.local.helper import (
    HELPER_START_TIMEOUT_S,
    current_helper,
    offer_libraries,
    renew_if_changed,
    shared_helper,
)

# The words nbaccel's boolean options take (nbaccel.config.field_values.parse_text).
_ON = frozenset({"", "1", "true", "yes", "on", "y"})
_OFF = frozenset({"0", "false", "no", "off", "n"})


def prewarm_wanted(env: Mapping[str, str], *, in_kernel: bool) -> bool:
    """Whether to start the helper now: in a kernel, unless ``NBACCEL_PREWARM`` says no.

    A value that is not a boolean warns and counts as no (nothing is started on a value
    nobody can read).

    >>> prewarm_wanted({}, in_kernel=True)
    True
    >>> prewarm_wanted({"NBACCEL_PREWARM": "off"}, in_kernel=True)
    False
    """
    if not in_kernel:
        return False
    value = env.get(PREWARM_VAR, "").strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        warnings.warn(
            f"{PREWARM_VAR}={env[PREWARM_VAR]!r} is not a boolean (1/0, true/false, yes/no), "
            "so the helper process is not started at import: the first launch starts it. "
            f"Set {PREWARM_VAR}=1 or 0.",
            RuntimeWarning,
            stacklevel=2,
        )
    return False


def prewarm(env: Mapping[str, str], *, in_kernel: bool) -> threading.Thread | None:
    """Start the helper in the background if ``prewarm_wanted``; the starting thread or None.

    What ``import nbaccel`` calls, with ``in_kernel`` from ``nbaccel.ui.kernel.in_kernel()``.
    A driver that is not a kernel (``benchmarks/launch_latency.py``) calls it with
    ``in_kernel=True`` to get exactly what a kernel gets. The helper is the one every
    launch of this process uses (``nbaccel.launcher.local.helper.shared_helper``); it exits with
    this process, launched or not.

    Once the helper is ready, the thread warms this process's side of a launch too
    (``nbaccel.launcher.api.warm_planning``): the first launch then finds both sides as a
    later one does.
    """
    if not prewarm_wanted(env, in_kernel=in_kernel):
        return None
    thread = threading.Thread(target=_warm_up, name="nbaccel-prewarm", daemon=True)
    thread.start()
    watch_cells()  # here, on the kernel's main thread, where IPython runs its callbacks
    return thread


def _warm_up() -> None:
    try:
        helper = shared_helper()  # one Popen: the helper imports torch in its own process
        helper.wait_ready(HELPER_START_TIMEOUT_S)
        # Then warm this side. Only through a module the kernel's ``import nbaccel`` has
        # finished: importing on this thread could race that import (module locks taken in
        # two orders), and importing the launch path here, before the helper starts, was
        # measured to delay its start by ~0.1 s. By "ready" the import is long done.
        api = sys.modules.get("nbaccel.launcher.api")
        warm_planning = getattr(api, "warm_planning", None)
        if warm_planning is not None:
            warm_planning()
        watch = ImportWatch.install()
        threading.Thread(
            target=follow_imports, args=(watch,), name="nbaccel-imports", daemon=True
        ).start()
    except Exception:  # noqa: BLE001 - nobody to report to: the first launch starts the
        pass  # helper again and raises the reason there, and plans with the user's settings


def watch_cells() -> bool:
    """Offer the helper the kernel's libraries after each cell (IPython's ``post_run_cell``);
    whether there was a kernel's shell to watch. Registered once per shell; a shell without
    IPython's event hooks is left alone (the launch offers them all the same)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    events = getattr(shell, "events", None)
    if events is None:
        return False
    try:
        if _after_cell not in events.callbacks.get("post_run_cell", []):
            events.register("post_run_cell", _after_cell)
    except Exception:  # noqa: BLE001 - an optimisation must never break import nbaccel
        return False
    return True


def _after_cell(*_: object) -> None:
    try:
        # A cell may have run ``pip install``: a helper holding what it replaced is replaced
        # now (a few stat calls when nothing changed), so the next launch finds a new one.
        renew_if_changed()
        helper = current_helper()
        if helper is not None:
            offer_libraries(helper)
    except Exception:  # noqa: BLE001 - an offer is an optimisation: the launch offers again
        pass


# How long the offers wait for more of an import under way: one offer per batch of modules.
OFFER_EVERY_S = 0.05


class ImportWatch:
    """A finder first on ``sys.meta_path`` that finds nothing: it only notes that the kernel
    is importing something new (modules already imported never reach a finder)."""

    def __init__(self) -> None:
        self.importing = threading.Event()

    @classmethod
    def install(cls) -> ImportWatch:
        for finder in sys.meta_path:
            if isinstance(finder, cls):
                return finder
        watch = cls()
        sys.meta_path.insert(0, watch)
        return watch

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        self.importing.set()
        return None


def follow_imports(watch: ImportWatch) -> None:
    """Offer the helper what the kernel imports, in batches, for as long as the kernel runs
    (on the prewarm's thread)."""
    while True:
        watch.importing.wait()
        time.sleep(OFFER_EVERY_S)
        watch.importing.clear()
        _after_cell()
