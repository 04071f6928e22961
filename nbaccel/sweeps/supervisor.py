"""The process that runs a detached sweep (``python -m nbaccel.sweeps.supervisor PLAN``).

It reads the sweep the kernel wrote (``detached.start_detached``), says ``ready`` on its
first line, sends its output to ``supervisor.log`` in the sweep's folder, and runs the
sweep's loop as ``nbaccel.sweep`` would in a kernel: its trials are launches of this
process. After each change it writes the sweep's state (``detached.write_state``). A file
``stop`` (or ``stop-<trial>``) in the folder, looked for when SIGUSR1 wakes it and every
second, stops every trial (or one); SIGTERM stops them all.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from nbaccel.launcher.detached.supervisor_main import redirect_output
from nbaccel.sweeps.configs import Configs
from nbaccel.sweeps.detached import READY, write_state
from nbaccel.sweeps.packing import Packer
from nbaccel.sweeps.scheduler import Scheduler
from nbaccel.sweeps.trials import Sweep, Trial


def main(plan_file: str) -> int:
    plan: dict[str, Any] = pickle.loads(Path(plan_file).read_bytes())
    os.unlink(plan_file)  # it held the payload: read once, gone
    folder = Path(plan["folder"])
    study = _study(plan)
    configs = Configs(
        study if study is not None else plan["configs"], plan["space"], plan["n_trials"]
    )
    trials: list[Trial] = []
    if configs.study is None:
        while (asked := configs.next_config()) is not None:
            trials.append(Trial(len(trials), asked[0]))
    sweep = Sweep(trials, plan["metric"], plan["mode"], plan["sweep_id"])
    sweep.study = configs.study
    packer = Packer(plan["devices"], plan["per_trial"], plan["cpu_slots"], plan["max_concurrent"])
    lock = threading.Lock()

    def watch(changed: Sweep) -> None:
        with lock:
            write_state(folder, changed, os.getpid(), capacity=packer.capacity, total=configs.total)

    watch(sweep)
    print(READY, flush=True)
    redirect_output(folder / "supervisor.log")
    wake = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if signum == signal.SIGTERM:  # every trial stopped, as by sweep.stop()
            (folder / "stop").touch()
        wake.set()

    for signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(signum, on_signal)
    threading.Thread(target=_look_for_stops, args=(folder, sweep, wake), daemon=True).start()
    scheduler = Scheduler(
        plan["train"], configs, packer, sweep, plan["options"], plan["trial_timeout"], watch
    )
    try:
        scheduler.run()
    except BaseException as error:  # noqa: BLE001 - said in the state file and the log
        print(f"nbaccel: the sweep ended early: {error!r}", flush=True)
    watch(sweep)
    return 0


def _study(plan: dict[str, Any]) -> Any:
    """The Optuna study, loaded from its storage (the kernel's object cannot travel)."""
    if plan.get("study_name") is None:
        return None
    import optuna

    return optuna.load_study(study_name=plan["study_name"], storage=plan["storage"])


def _look_for_stops(folder: Path, sweep: Sweep, wake: threading.Event) -> None:
    """Each stop file asked for, done once; woken by SIGUSR1, else every second."""
    done: set[str] = set()
    while not sweep.done:
        wake.wait(1.0)
        wake.clear()
        for path in sorted(folder.glob("stop*")):
            if path.name in done:
                continue
            done.add(path.name)
            if path.name == "stop":
                sweep.stop()
            elif path.name.removeprefix("stop-").isdigit():
                sweep.stop_trial(int(path.name.removeprefix("stop-")))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
