"""The helper process: a clean interpreter with torch preloaded that forks workers on request.

Started by the parent (``python -m nbaccel.launcher.helper_main FD``) on the first launch and
kept for later ones, so a launch costs a fork instead of an ``import torch``. Between
launches it forks idle *spares* (as many as the largest recent launch), each waiting on
its own socket, so a launch does not even wait for ``fork`` (several ms under a sandbox or
with a large address space): the request and its fds go straight to a spare. The helper
never runs a torch op, starts a thread or touches CUDA (a forked child of a process that
has would hang or fail). It is single-threaded: one ``select`` loop over the control socket
and a SIGCHLD wake-up pipe. It sits in its own session, ignores the kernel's interrupts,
is a child subreaper (orphaned grandchildren come back to it and are killed), and exits,
killing every worker, when the parent closes the socket or dies.
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
from nbaccel.launcher.orphans import Orphans
from nbaccel.launcher.prctl import set_child_subreaper, set_parent_death_signal

# nbaccel.accel (the Accelerator) costs ~0.1 s to import; preloaded, every worker has it free.
# None of these runs a torch op or starts a thread at import, which forking requires.
PRELOAD = (
    "torch",
    "torch.distributed",
    "cloudpickle",
    "psutil",
    "nbaccel.launcher.worker",
    "nbaccel.accel",
)
# Imported once the helper is first idle, not before "ready": DDP's constructor imports
# torch._dynamo lazily, 1.6-2.9 s in every worker of every launch that wraps a model;
# imported here once, forked workers have it for free. Not in PRELOAD, which would delay
# the first launch by as much. Spares forked before it are replaced.
WARM_LATER = ("torch._dynamo",)
PARENT_POLL_SECONDS = 1.0
MAX_SPARES = 16


class Helper:
    def __init__(self, sock: socket.socket, parent_pid: int) -> None:
        self.sock = sock
        self.parent_pid = parent_pid
        self.workers: dict[int, tuple[str, int]] = {}  # pid -> (run id, rank)
        self.spares: list[tuple[int, socket.socket]] = []  # (pid, our end of its socket)
        self.wanted_spares = 0
        self.warmed = False
        self.orphans = Orphans(_signal_group)  # what exited workers left behind
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd fires
        while os.getppid() == self.parent_pid:
            # Make spares only when idle, one per turn, so requests are never kept waiting.
            idle = len(self.spares) >= self.wanted_spares
            timeout = PARENT_POLL_SECONDS if idle else 0.0
            kill_at = self.orphans.due()
            if kill_at is not None:
                timeout = max(0.0, min(timeout, kill_at - time.monotonic()))
            waitables: list[Any] = [self.sock, self.wake_read]
            ready, _, _ = select.select(waitables, [], [], timeout)
            self.orphans.kill_due(time.monotonic())
            if not ready and not idle:
                self.fork_spare()
                continue
            # Warm up only with no worker alive: the import blocks this loop for seconds, and
            # a worker's exit must be reported at once (the first failing rank is named by it).
            if not ready and not self.warmed and not self.workers:
                self.warm_up()
                continue
            if self.wake_read in ready:
                while _drain(self.wake_read):
                    pass
                self.reap()
            if self.sock in ready:
                message, fds = control.receive(self.sock)
                if message is None:
                    return
                self.handle(message, fds)

    def warm_up(self) -> None:
        """Import WARM_LATER (and torch_xla where launches use it), then retire the spares
        forked without them."""
        self.warmed = True
        for module in WARM_LATER + (("torch_xla",) if _xla_machine() else ()):
            env = dict(os.environ)
            try:
                __import__(module)
            except Exception:  # noqa: BLE001 - workers import it themselves and report errors
                pass
            # torch_xla writes PJRT_DEVICE, XLA_FLAGS, ... on import: workers get the
            # launch's environment, never ours, so keep ours as it was.
            os.environ.clear()
            os.environ.update(env)
        for _, channel in self.spares:
            channel.close()  # the spare reads EOF and exits; reap() collects it
        self.spares.clear()

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        if message["op"] == "spawn":
            self.spawn(message, fds)
        elif message["op"] == "signal":
            ranks = message.get("ranks")
            for pid, (run_id, rank) in list(self.workers.items()):
                if run_id == message["run"] and (ranks is None or rank in ranks):
                    _signal_group(pid, message["signal"])

    def spawn(self, message: dict[str, Any], fds: list[int]) -> None:
        # Processes this launch asks us for: its world size, or 1 for a torch_xla supervisor.
        processes = message.get("processes", message["context"].world_size)
        self.wanted_spares = min(MAX_SPARES, max(self.wanted_spares, processes))
        pid = self._hand_to_spare(message, fds)
        for fd in fds:
            os.close(fd)
        if pid is None:
            error = "fork failed: the helper could not start a worker (out of memory or pids?)"
            self.reply({**_ids(message), "op": "spawn_failed", "error": error})
            return
        self.workers[pid] = (message["run"], message["rank"])

    def _hand_to_spare(self, message: dict[str, Any], fds: list[int]) -> int | None:
        """Send the request to an idle spare (forking one if none is left); its pid or None."""
        while True:
            if not self.spares and self.fork_spare(fds_to_close=fds) is None:
                return None
            pid, channel = self.spares.pop()
            try:
                control.send(channel, message, fds)
                return pid
            except OSError:
                continue  # that spare died; its exit is reaped as an unknown child
            finally:
                channel.close()

    def fork_spare(self, fds_to_close: list[int] | tuple[int, ...] = ()) -> int | None:
        """Fork an idle child that waits for one spawn request, then becomes that worker."""
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
                for fd in (self.wake_read, self.wake_write, *fds_to_close):
                    os.close(fd)
                for other in (self.sock, ours, *(channel for _, channel in self.spares)):
                    other.close()
                set_parent_death_signal(signal.SIGKILL)
                message, fds = control.receive(theirs)
                if message is not None:
                    theirs.close()
                    from nbaccel.launcher.worker import run_worker

                    run_worker(message, fds, helper_pid=helper_pid)
            finally:
                os._exit(0)
        theirs.close()
        self.spares.append((pid, ours))
        return pid

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            owner = self.workers.pop(pid, None)
            if owner is None:  # a spare that died, or an orphaned grandchild (we are subreaper)
                for spare in [s for s in self.spares if s[0] == pid]:
                    spare[1].close()
                    self.spares.remove(spare)
                orphan_of = self.orphans.forget(pid)
                if orphan_of is not None:  # what it started is ours now, and ends with its run
                    self.orphans.adopt_new_children(orphan_of, self.known_children())
                continue
            # The worker led its own process group: take down what it left (DataLoader workers).
            _signal_group(pid, signal.SIGKILL)
            run_id, rank = owner
            status_code = os.waitstatus_to_exitcode(status)
            # The exit first (the run names its first failing rank by it), then the scan.
            self.reply({"op": "exited", "run": run_id, "rank": rank, "status": status_code})
            # Its children that left its group are ours now: they end when the run ends.
            self.orphans.adopt_new_children(run_id, self.known_children())
            if not any(run == run_id for run, _ in self.workers.values()):
                self.orphans.end_run(run_id, time.monotonic())

    def known_children(self) -> set[int]:
        """Children that are not orphans: workers and spares."""
        return set(self.workers) | {pid for pid, _ in self.spares}

    def reply(self, message: dict[str, Any]) -> None:
        try:
            control.send(self.sock, message)
        except OSError:
            pass  # the parent is gone; serve() notices and shuts down

    def shutdown(self) -> None:
        """Kill every worker group and every remaining descendant, then reap them."""
        for pid in list(self.workers):
            _signal_group(pid, signal.SIGKILL)
        for pid, channel in self.spares:
            channel.close()
            _signal_group(pid, signal.SIGKILL)
        try:
            import psutil

            for child in psutil.Process().children(recursive=True):
                child.kill()
        except Exception:  # noqa: BLE001 - best effort while exiting
            pass
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break


def _xla_machine() -> bool:
    """Whether launches here go through torch_xla (a TPU, or PJRT_DEVICE set) with a
    torch_xla that can be imported: then each launch's supervisor, forked from us, finds it
    imported (2-4 s saved per launch; the import starts no thread, so forking stays safe)."""
    from pathlib import Path

    from nbaccel.devices import detect_tpu
    from nbaccel.xla_plan import check_versions

    tpu = detect_tpu(Path("/"), os.environ)
    return bool(tpu.chips or os.environ.get("PJRT_DEVICE")) and check_versions() is None


def _ids(message: dict[str, Any]) -> dict[str, Any]:
    return {"run": message["run"], "rank": message["rank"]}


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        try:  # not yet its own group leader (signalled right after fork)
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    except PermissionError:
        pass


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _exit_on_sigterm(*_: object) -> None:
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[1]))
    parent_pid = int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are the kernel's, not ours
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for module in PRELOAD:
            __import__(module)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises HelperError
        control.send(sock, {"op": "failed", "error": traceback.format_exc()})
        return 1
    set_child_subreaper()
    helper = Helper(sock, parent_pid)
    control.send(sock, {"op": "ready", "pid": os.getpid(), "python": sys.version})
    try:
        helper.serve()
    finally:
        helper.shutdown()
    return 0


if __name__ == "__main__":
    # Every worker is reaped by now; skip the interpreter's teardown of torch (0.5-0.7 s of
    # CPU measured by benchmarks/interrupt_latency.py) that nothing needs.
    os._exit(main(sys.argv))
