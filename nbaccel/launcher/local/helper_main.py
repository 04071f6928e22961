"""The helper process: a clean interpreter with torch preloaded that forks workers on request.

Started by the parent (``python -m nbaccel.launcher.local.helper_main FD``) on the first launch and
kept for later ones, so a launch costs a fork instead of an ``import torch``. Between
launches it forks idle *spares* (as many as the largest recent launch), each waiting on
its own socket, so a launch does not even wait for ``fork`` (several ms under a sandbox or
with a large address space): the request and its fds go straight to a spare. The helper
never runs a torch op, starts a thread or touches CUDA (a forked child of a process that
has would hang or fail). It is single-threaded: one ``select`` loop over the control socket
and a SIGCHLD wake-up pipe. It sits in its own session, ignores the kernel's interrupts,
is a child subreaper (orphaned grandchildren come back to it and are killed), and exits,
killing every worker, when the parent closes the socket or dies.

Before "ready" it imports only what a worker needs to start (PRELOAD); the rest (WARM_LATER:
the Accelerator, torch._dynamo) is imported once it is idle, in the background of its own
loop: a timer signal serves requests in the middle of those imports (handing them to spares
forked before, never forking mid-import), so a launch never waits for them. The same way,
when idle, it imports the installed libraries the kernel asks it to preload (``preload``:
what the kernel and the last launch's workers imported), checking after each that it can
still fork (``preload.import_checked``), then replaces its spares with ones that have them;
a launch that comes while some are still to be imported waits for them (``warm_up``). It
tells the kernel which installed files it loaded (``installed_files``), and right after
"ready" forks a *base* that becomes its successor if the kernel retires it (``successor``).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

from nbaccel.launcher import control
from nbaccel.launcher.bootstrap.prctl import set_child_subreaper, set_parent_death_signal
from nbaccel.launcher.bootstrap.process_names import helper_title, name_process, spare_title
from nbaccel.launcher.local.child_processes import (
    MAX_SPARES,
    drain,
    first_spares,
    frozen_imports,
    next_exit,
    signal_group,
    spares_held_for,
)
from nbaccel.launcher.local.exec_spare import start_exec_spare
from nbaccel.launcher.local.orphans import Orphans
from nbaccel.launcher.local.preloading.installed_files import LoadedFiles
from nbaccel.launcher.local.preloading.preload import Preloader
from nbaccel.launcher.local.successor import (
    Become,
    ParentWatch,
    kill_descendants,
    leave_old_helper,
)
from nbaccel.launcher.local.warm_up import PARENT_POLL_SECONDS, WarmUp, _ParentGone

# What a worker needs to start: before "ready", so nothing else delays a first launch that
# comes right away (measured with -X importtime: torch; torch.distributed, cloudpickle,
# psutil ~0.02 s; the worker module and the nbaccel package ~0.2 s). None of these runs a
# torch op or starts a thread at import, which forking requires.
PRELOAD = (
    "torch",
    "torch.distributed",
    "cloudpickle",
    "psutil",
    "nbaccel.launcher.local.worker",
)
# Quiet time (no request, no worker exit, no worker alive) before WARM_LATER is imported.
WARM_UP_AFTER_QUIET_SECONDS = 0.3
# What _hand_to_spare returns for a request put in Helper.deferred (no child has pid 0).
DEFERRED = 0


class Helper(WarmUp):
    def __init__(
        self, sock: socket.socket, parent: ParentWatch, files: LoadedFiles | None = None
    ) -> None:
        self.sock = sock
        self.parent = parent
        self.files = LoadedFiles() if files is None else files  # what it tells the kernel
        self.base: tuple[int, socket.socket] | None = None  # until it succeeds us
        self.preloading = False
        self.workers: dict[int, tuple[str, int]] = {}  # pid -> (run id, rank)
        self.spares: list[tuple[int, socket.socket]] = []  # (pid, our end of its socket)
        # Spares forked before the last imports: still handed out when no newer one is left
        # (a launch never waits for a fork because of a preload), retired once enough newer
        # ones are forked; then the kernel hears the report that was held for it.
        self.stale: set[int] = set()
        self.held_report: dict[str, Any] | None = None
        self.wanted_spares = 0
        self.sized = False  # wanted_spares set for a first launch (at the first idle turn)
        self.warmed = False
        # Requests read mid-import that no spare could take (forking then is unsafe): served
        # in order as soon as the import is done, with every message that came after them.
        self.deferred: list[tuple[dict[str, Any], list[int]]] = []
        self.in_tick = False
        self.last_activity = 0.0  # time.monotonic() of the last request read or worker exit
        self.orphans = Orphans(signal_group)  # what exited workers left behind
        # The libraries the kernel asked to preload, and whether forking is still safe.
        self.preloader = Preloader()
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd fires
        try:
            self._serve()
        except _ParentGone:
            pass

    def _serve(self) -> None:
        while self.parent.alive():
            self._serve_deferred()
            # Make spares only when idle, one per turn, so requests are never kept waiting.
            idle = self.fresh_spares() >= self.wanted_spares or self.preloader.unsafe is not None
            if idle and (self.stale or self.held_report):
                self.retire_stale()
            # Warm up with no worker alive (it would take their CPU), after a quiet moment:
            # launches in a loop come back to back and would use up the spares mid-import.
            quiet_for = time.monotonic() - self.last_activity
            to_import = not self.warmed or self.preloader.wanted
            warm_soon = idle and to_import and not self.workers
            warm_now = warm_soon and quiet_for >= WARM_UP_AFTER_QUIET_SECONDS
            timeout = PARENT_POLL_SECONDS if idle and not warm_now else 0.0
            if warm_soon and not warm_now:
                timeout = WARM_UP_AFTER_QUIET_SECONDS - quiet_for
            held = spares_held_for(
                missing=not idle, workers_alive=bool(self.workers), quiet_for=quiet_for
            )
            if held:
                timeout = held  # requests and exits are served meanwhile
            ready = self._wait(timeout)
            if not ready:
                self.tell_loaded()  # what it imported at its start, or a worker's lazy import
            if not ready and not self.sized:
                self.sized = True
                self.wanted_spares = max(self.wanted_spares, first_spares())
                continue
            if not ready and not idle and not held:
                self.fork_spare()
                continue
            if not ready and warm_now:
                self.warm_up()
                continue
            if self.wake_read in ready:
                while drain(self.wake_read):
                    pass
                self.reap()
            if self.sock in ready:
                message, fds = control.receive(self.sock)
                if message is None:
                    return
                if message["op"] != "preload":  # offers come while the kernel imports
                    self.last_activity = time.monotonic()
                self.handle(message, fds)

    def _wait(self, timeout: float) -> list[Any]:
        """Wait for the control socket or the wake-up pipe, at most ``timeout`` s and no
        later than the next orphan is due to be killed; then kill the orphans that are due."""
        kill_at = self.orphans.due()
        if kill_at is not None:
            timeout = max(0.0, min(timeout, kill_at - time.monotonic()))
        waitables: list[Any] = [self.sock, self.wake_read]
        ready, _, _ = select.select(waitables, [], [], timeout)
        self.orphans.kill_due(time.monotonic())
        return ready

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        if message["op"] == "spawn":
            self.spawn(message, fds)
        elif message["op"] == "preload":
            self.preloader.ask(message["modules"])
            if not self.preloader.pending and not self.preloading and self.held_report is None:
                self.reply(self.preloader.progress())  # all imported already: nothing to wait
        elif message["op"] == "signal":
            self.signal(message)
        elif message["op"] == "succeed":
            self.hand_over(message, fds)

    def spawn(self, message: dict[str, Any], fds: list[int]) -> None:
        # Processes this launch asks us for: its world size, or 1 for a torch_xla supervisor.
        processes = message.get("processes", message["context"].world_size)
        self.wanted_spares = min(MAX_SPARES, max(self.wanted_spares, processes))
        if self.preloader.wanted and not self.in_tick and not self.preloading:
            self.preload_first(message, fds)  # it is served from ``deferred`` after
            return
        pid = self._hand_to_spare(message, fds)
        if pid == DEFERRED:
            return  # its fds stay open with it
        for fd in fds:
            os.close(fd)
        if pid is None and self.preloader.unsafe is not None:
            error = (
                f"the nbaccel helper stopped forking workers after {self.preloader.unsafe}; launch "
                "again: the next launch starts a fresh helper that does not preload it"
            )
            self.reply({**_ids(message), "op": "spawn_failed", "error": error})
            return
        if pid is None:
            error = "fork failed: the helper could not start a worker (out of memory or pids?)"
            self.reply({**_ids(message), "op": "spawn_failed", "error": error})
            return
        self.workers[pid] = (message["run"], message["rank"])

    def _hand_to_spare(self, message: dict[str, Any], fds: list[int]) -> int | None:
        """Send the request to an idle spare (forking one if none is left); its pid or None.

        Mid-import (``in_tick``) no fork: a spare that turns out dead defers the request."""
        while True:
            if not self.spares and self.in_tick:
                self.deferred.append((message, fds))
                return DEFERRED
            if not self.spares and self.fork_spare(fds_to_close=fds) is None:
                return None
            fresh = [i for i, (pid, _) in enumerate(self.spares) if pid not in self.stale]
            pid, channel = self.spares.pop(fresh[-1] if fresh else -1)
            try:
                control.send(channel, message, fds)
                return pid
            except OSError:
                continue  # that spare died; its exit is reaped as an unknown child
            finally:
                channel.close()

    def fork_spare(self, fds_to_close: list[int] | tuple[int, ...] = ()) -> int | None:
        """Fork an idle child that waits for one spawn request, then becomes that worker."""
        if self.preloader.unsafe is not None:
            return self.exec_spare()  # a preloaded library made forking unsafe
        ours, theirs = control.socket_pair()
        helper_pid = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return None
        if pid == 0:  # the spare; never returns
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGIO, signal.SIG_DFL)  # ignored here after an import
                for fd in fds_to_close:
                    os.close(fd)
                ours.close()
                self.close_in_child()
                name_process(spare_title(self.parent.pid))  # not a stray worker in ps
                set_parent_death_signal(signal.SIGKILL)
                message, fds = control.receive(theirs)
                if message is not None:
                    theirs.close()
                    from nbaccel.launcher.local.worker import run_worker

                    run_worker(message, fds, helper_pid=helper_pid)
            finally:
                os._exit(0)
        theirs.close()
        self.spares.append((pid, ours))
        return pid

    def exec_spare(self) -> int | None:
        """A spare in a fresh interpreter (``exec_spare.py``): slower, never unsafe."""
        started = start_exec_spare()
        if started is not None:
            self.spares.append(started)
        return started[0] if started is not None else None

    def reap(self, *, known_only: bool = False) -> None:
        """Collect exited children and report workers' exits; ``known_only``: workers and
        spares only, not orphans (mid-import, where the import may wait for a child)."""
        while True:
            pid, status = next_exit(self.known_children() if known_only else None)
            if pid == 0:
                return
            owner = self.workers.pop(pid, None)
            if owner is None:  # a spare that died, or an orphaned grandchild (we are subreaper)
                self.stale.discard(pid)
                for spare in [s for s in self.spares if s[0] == pid]:
                    spare[1].close()
                    self.spares.remove(spare)
                orphan_of = self.orphans.forget(pid)
                if orphan_of is not None:  # what it started is ours now, and ends with its run
                    self.orphans.adopt_new_children(orphan_of, self.known_children())
                continue
            self.last_activity = time.monotonic()
            # The worker led its own process group: take down what it left (DataLoader workers).
            signal_group(pid, signal.SIGKILL)
            run_id, rank = owner
            status_code = os.waitstatus_to_exitcode(status)
            # The exit first (the run names its first failing rank by it), then the scan.
            self.reply({"op": "exited", "run": run_id, "rank": rank, "status": status_code})
            # Its children that left its group are ours now: they end when the run ends.
            self.orphans.adopt_new_children(run_id, self.known_children())
            if not any(run == run_id for run, _ in self.workers.values()):
                self.orphans.end_run(run_id, time.monotonic())

    def known_children(self) -> set[int]:
        """Children that are not orphans: workers and spares (the base is no child of ours)."""
        return set(self.workers) | {pid for pid, _ in self.spares}

    def close_in_child(self) -> None:
        """In a forked child: close what only the helper may hold (the kernel's socket, our
        wake-up pipe, spares' sockets, the fds of requests waiting)."""
        for fd in (self.wake_read, self.wake_write):
            os.close(fd)
        for waiting in self.deferred:
            for fd in waiting[1]:
                os.close(fd)
        for other in (self.sock, *(channel for _, channel in self.spares)):
            other.close()
        if self.base is not None:
            self.base[1].close()  # or the base would not see EOF when we retire it

    def become(self) -> Become:
        """What our base runs when it succeeds us: it serves the kernel as we did."""
        files = self.files

        def become(message: dict[str, Any], fds: list[int]) -> int:
            sock, parent = leave_old_helper(message, fds)
            if not parent.alive():
                return 0
            files.begin()  # what it loads from now on is read from the disk as it is now
            name_process(helper_title(parent.pid))
            successor = Helper(sock, parent, files)
            successor.wanted_spares = min(MAX_SPARES, int(message.get("spares", 0)))
            return serve_as_helper(successor)

        return become

    def reply(self, message: dict[str, Any]) -> None:
        try:
            control.send(self.sock, message)
        except OSError:
            pass  # the parent is gone; serve() notices and shuts down

    def shutdown(self) -> None:
        """Kill every worker group and every remaining descendant, then reap them; our base
        reads EOF and exits (our successor, if it became one, is no descendant of ours)."""
        for pid in list(self.workers):
            signal_group(pid, signal.SIGKILL)
        for pid, channel in self.spares:
            channel.close()
            signal_group(pid, signal.SIGKILL)
        if self.base is not None:
            self.base[1].close()  # it reads EOF, and exits
        kill_descendants()


def _ids(message: dict[str, Any]) -> dict[str, Any]:
    return {"run": message["run"], "rank": message["rank"]}


def _exit_on_sigterm(*_: object) -> None:
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    sock, parent_pid = socket.socket(fileno=int(argv[1])), int(argv[2])
    name_process(helper_title(parent_pid))  # before torch: its successor names itself too
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are the kernel's, not ours
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    files = LoadedFiles()  # site-packages as they are before we import from them
    try:
        with frozen_imports():
            for module in PRELOAD:
                __import__(module)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises HelperError
        control.send(sock, {"op": "failed", "error": traceback.format_exc()})
        return 1
    return serve_as_helper(Helper(sock, ParentWatch(parent_pid, child=True), files))


def serve_as_helper(helper: Helper) -> int:
    """Say "ready", fork the base (``successor``), become a child subreaper (after: the base
    must not come back to us), serve until the kernel goes, then end every worker."""
    try:
        control.send(helper.sock, {"op": "ready", "pid": os.getpid(), "python": sys.version})
    except OSError:
        return 0  # the parent left while we imported (a kernel that exited before launching)
    try:
        helper.fork_base()
        set_child_subreaper()
        helper.serve()
    except BaseException:  # noqa: BLE001 - a bug here: the parent's HelperError shows it
        # Our stderr is /dev/null (a kernel has no terminal): the socket is the only way out.
        helper.reply({"op": "crashed", "error": traceback.format_exc()})
        return 1
    finally:
        helper.shutdown()
    return 0


if __name__ == "__main__":
    # Every worker is reaped by now; skip the interpreter's teardown of torch (0.5-0.7 s of
    # CPU measured by benchmarks/interrupt_latency.py) that nothing needs.
    os._exit(main(sys.argv))
