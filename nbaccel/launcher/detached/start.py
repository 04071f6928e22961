"""``detach=True``: start a run under a supervisor of its own, and attach to it.

The kernel checks everything as for any launch (``api.plan``), hands the checked launch to
a new supervisor process (``supervisor_main.py``) in a session of its own, waits for its
one-line handshake, and returns an ``AttachedRun`` following it. Restarting or losing the
kernel, or closing the browser, leaves the supervisor and its workers going;
``nbaccel.attach`` finds the run again from ``runs_dir``.
"""

from __future__ import annotations

import os
import pickle
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from nbaccel import unpickling
from nbaccel.errors import HelperError
from nbaccel.launcher.detached.attached import FAILED, READY, AttachedRun
from nbaccel.launcher.planned import Display, Planned, shown

if TYPE_CHECKING:
    from nbaccel.launcher.run import Run

HANDSHAKE_SECONDS = 120.0  # the supervisor starts its helper (an import torch) before "ready"


def start_detached(planned: Planned, *, show: Display) -> Run:
    """Start ``planned`` under its own supervisor; the run returned follows it."""
    run_dir = Path(planned.resolved.config.runs_dir).expanduser().resolve() / planned.run_id
    fd, plan_file = tempfile.mkstemp(prefix="nbaccel-plan-")  # 0600: holds the payload
    with os.fdopen(fd, "wb") as file:
        pickle.dump(planned, file)
    package_root = str(Path(__file__).resolve().parents[3])  # above nbaccel/launcher/detached
    env = dict(planned.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "nbaccel.launcher.detached.supervisor_main", plan_file],
            cwd=planned.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the kernel's interrupt and death must not reach it
            # The payload's shared-memory segments, under the same numbers (the plan names
            # them): the supervisor holds them while its run lasts, whatever the kernel does.
            pass_fds=planned.payload.data_fds,
        )
    except BaseException:
        os.unlink(plan_file)
        raise
    finally:
        planned.payload.close()
    _handshake(supervisor, plan_file)
    # The kernel stays the supervisor's parent: reap it when it leaves, or it lingers as a
    # zombie for as long as the kernel lives.
    threading.Thread(target=supervisor.wait, name="nbaccel-reap-supervisor", daemon=True).start()
    run = AttachedRun(run_dir)
    shown(show(run, planned.gpus))
    run.connect()
    return run


def _handshake(supervisor: subprocess.Popen[bytes], plan_file: str) -> None:
    """Wait for the supervisor's ``NBACCEL-READY``; raise its error if it failed."""
    assert supervisor.stdout is not None
    said = b""
    deadline = time.monotonic() + HANDSHAKE_SECONDS
    with supervisor.stdout, selectors.DefaultSelector() as selector:
        selector.register(supervisor.stdout, selectors.EVENT_READ)
        while b"\n" not in said or not said.rstrip().splitlines()[-1].startswith(b"NBACCEL-"):
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(timeout=left):
                supervisor.kill()
                break
            chunk = os.read(supervisor.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            said += chunk
    last = said.rstrip().splitlines()[-1].decode(errors="replace") if said.strip() else ""
    if last == READY:
        return
    supervisor.wait(timeout=10)
    if os.path.exists(plan_file):
        os.unlink(plan_file)
    if last.startswith(FAILED + " "):
        raise unpickling.loads(bytes.fromhex(last.split(" ", 1)[1]))  # its own checks' error
    raise HelperError(
        f"the detached run's supervisor did not start (exit code {supervisor.returncode}). "
        f"It said:\n{said.decode(errors='replace')[-3000:] or '(nothing)'}"
    )
