"""A detached run's supervisor: ``python -m nbaccel.launcher.detached.supervisor_main PLAN_FILE``.

Started by ``detached.start_detached`` in a session of its own, so that neither the
kernel's interrupt nor its death reaches it. It reads the checked launch (``Planned``, a
0600 file it deletes at once), starts the workers through its own helper exactly as a
kernel does, and serves the attach channel (``attach_server.py``). It still ends every
worker on Stop, on a failing rank, when ``max_duration`` passes and on SIGTERM, and leaves
once the run has ended: its helper, and with it every worker, dies with it.

Handshake: one line on stdout, ``NBACCEL-READY`` or ``NBACCEL-FAILED <hex pickle of the
error>``; then stdout and stderr go to ``run_dir/supervisor.log``.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

from nbaccel.events import SAVE_AND_STOP_SIGNALS, RunEnded
from nbaccel.launcher.detached.attach_server import AttachServer
from nbaccel.launcher.detached.attached import FAILED, READY, SUPERVISOR_RECORD, write_error
from nbaccel.launcher.local.start import start_planned
from nbaccel.launcher.planned import Planned
from nbaccel.launcher.run import Run
from nbaccel.launcher.run_folder import private_file


def main(plan_file: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only Stop, SIGTERM or max_duration end it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with open(plan_file, "rb") as file:
            planned: Planned = pickle.load(file)  # written 0600 by this user's kernel
    finally:
        os.unlink(plan_file)
    server = AttachServer()
    try:
        # Values travel on to a kernel that attaches: whole, not in this process's memory.
        run = start_planned(planned, show=server.show, result_boxes=False)
    except BaseException as error:  # noqa: BLE001 - the kernel raises it
        server.close()
        print(f"{FAILED} {pickle.dumps(error).hex()}", flush=True)
        return 1
    record = {
        "pid": os.getpid(),
        "address": server.address,
        "started": time.time(),
        "world_size": run.world_size,
        "gpus": planned.gpus,
        "xla_device": run.xla_device,
    }
    with private_file(run.run_dir / SUPERVISOR_RECORD) as record_file:
        record_file.write(json.dumps(record) + "\n")
    print(READY, flush=True)
    redirect_output(run.run_dir / "supervisor.log")
    sigterm, wake = threading.Event(), threading.Event()
    run.subscribe(lambda event: wake.set() if isinstance(event, RunEnded) else None)

    def on_sigterm(_signum: int, _frame: object) -> None:
        sigterm.set()
        wake.set()

    for signum in SAVE_AND_STOP_SIGNALS:  # a scheduler's notice: save, then end
        signal.signal(signum, on_sigterm)
    _supervise(run, planned.resolved.config.max_duration, sigterm, wake)
    # Before the channel closes: a kernel that attaches later reads the error from here.
    write_error(run.run_dir, run.error)
    server.close()
    return 0


def _supervise(
    run: Run, max_duration: float | None, sigterm: threading.Event, wake: threading.Event
) -> None:
    """Wait for the end; on SIGTERM/SIGUSR1 or once ``max_duration`` has passed, every rank
    saves at a step they agree on and the run stops (``Run.stop(save=True)``)."""
    if not run.state.done and not wake.wait(timeout=max_duration):
        print(f"nbaccel: max_duration={max_duration:g} s passed: saving and stopping", flush=True)
    elif sigterm.is_set():
        print("nbaccel: asked to stop: saving and stopping the run", flush=True)
    why = "SIGTERM or SIGUSR1 to the supervisor" if sigterm.is_set() else "max_duration"
    try:
        run.stop(save=True, why=why)
    except TimeoutError:
        run.stop(timeout=60)


def redirect_output(log: Path) -> None:
    """The kernel stops reading the handshake pipe: later output goes to a private file
    (a detached sweep's supervisor does the same)."""
    with private_file(log, "ab") as file:
        for fd in (1, 2):
            os.dup2(file.fileno(), fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
