"""The helper's imports while it serves: the Accelerator's modules once it is idle
(``WARM_LATER``), then the libraries the kernel asked it to preload, each checked; requests
that come meanwhile are served between two bytecodes of the import (``between_bytecodes``).
During WARM_LATER a launch gets a spare forked before it; spares forked before the imports
stay in use until enough newer ones are forked, then retire, and only then is the kernel told
(``preloaded``). A launch that comes while libraries asked for are still to be imported waits
for them instead (``preload_first``): its workers would import them themselves otherwise
(the launching process or the last launch's rank 0 imported them), each on its own, which is
no faster on a loaded machine, and every later launch would start the same way.

After each import the helper tells the kernel which installed files it now holds
(``installed_files``); the *base* it forked after "ready" becomes its successor when the
kernel retires it (``successor``, ``hand_over``).

``WarmUp`` is the helper's (``helper_main.Helper``) part that does this; it names what it
uses of the rest of the helper below.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections import Counter
from typing import Any

from nbaccel.launcher import control
from nbaccel.launcher.bootstrap.process_names import base_title
from nbaccel.launcher.local.between_bytecodes import serving_while
from nbaccel.launcher.local.child_processes import (
    drain,
    frozen_imports,
    signal_group,
    signal_pid,
    xla_machine,
)
from nbaccel.launcher.local.preloading.installed_files import LoadedFiles
from nbaccel.launcher.local.preloading.preload import Preloader, sockets_of
from nbaccel.launcher.local.successor import Become, ParentWatch, fork_base

# Imported once the helper is idle (right after "ready" when nothing is asked), so forked
# workers find them loaded: nbaccel.accel (the Accelerator; 0.5-1.8 s here, most of it
# FSDP's DTensor, imported on its own first) and torch._dynamo (DDP's constructor imports
# it, 0.7-2.9 s in every worker of every launch that wraps a model). In PRELOAD they would
# delay a first launch by as much. Requests are served during each import, spares are
# refilled between two; those forked before the last are replaced at the end, and a
# worker started meanwhile imports what it uses.
WARM_LATER = ("torch.distributed.tensor", "nbaccel.accel", "torch._dynamo")
# How often requests and exits are looked at while WARM_LATER is being imported, and how
# long at most the import waits for a launch's workers to end (WarmUp.serve_mid_import).
TICK_SECONDS = 0.005
MAX_PAUSE_SECONDS = 2.0
PARENT_POLL_SECONDS = 1.0  # how often the helper checks that its parent lives
# Requests answered at once in the middle of an import, before launches that wait: they fork
# nothing, and their order against those launches does not matter (a stop also drops the
# waiting launches of its run: ``helper_main.Helper.signal``).
ANSWERED_MID_IMPORT = frozenset({"signal", "succeed", "preload"})


def package_names(modules: list[str]) -> str:
    """The packages of these modules, as a launch that waits for them is told: those with
    the most modules first (the big import the user knows, not its small dependencies).

    >>> package_names(["PIL", "anyio", "transformers", "transformers.utils", "yaml"])
    'transformers, PIL, anyio and 1 more'
    """
    count = Counter(name.split(".")[0] for name in modules)
    packages = [name for name, _ in count.most_common()]
    return ", ".join(packages[:3]) + (f" and {len(packages) - 3} more" if packages[3:] else "")


class _ParentGone(BaseException):
    """The parent closed the socket or died while a WARM_LATER import was running: unwinds
    out of the import (not an Exception, which warm_up would swallow) to serve()."""


class WarmUp:
    # Of the helper (helper_main.Helper), which defines them.
    sock: socket.socket
    parent: ParentWatch
    files: LoadedFiles
    base: tuple[int, socket.socket] | None  # the base, until it succeeds us
    preloading: bool  # libraries asked for are being imported: launches wait
    preload_names = ""  # their packages, for a launch that waits (``tell_waiting``)
    spares: list[tuple[int, socket.socket]]
    stale: set[int]
    held_report: dict[str, Any] | None
    wanted_spares: int
    warmed: bool
    deferred: list[tuple[dict[str, Any], list[int]]]
    in_tick: bool
    workers: dict[int, tuple[str, int]]
    preloader: Preloader
    wake_read: int

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        raise NotImplementedError

    def reply(self, message: dict[str, Any]) -> None:
        raise NotImplementedError

    def fork_spare(self, fds_to_close: list[int] | tuple[int, ...] = ()) -> int | None:
        raise NotImplementedError

    def reap(self, *, known_only: bool = False) -> None:
        raise NotImplementedError

    def _wait(self, timeout: float) -> list[Any]:
        raise NotImplementedError

    def close_in_child(self) -> None:
        raise NotImplementedError

    def become(self) -> Become:
        raise NotImplementedError

    def signal(self, message: dict[str, Any]) -> None:
        """Signal a run's live workers; its launches still waiting (``deferred``) never
        start: each such rank is reported exited by that signal."""
        ranks = message.get("ranks")

        def chosen(run_id: str, rank: int) -> bool:
            return run_id == message["run"] and (ranks is None or rank in ranks)

        # A stack dump (SIGUSR1) goes to the rank alone: its children would die of it.
        to = signal_group if message.get("group", True) else signal_pid
        for pid, (run_id, rank) in list(self.workers.items()):
            if chosen(run_id, rank):
                to(pid, message["signal"])
        for waiting in [w for w in self.deferred if w[0]["op"] == "spawn"]:
            request, fds = waiting
            if chosen(request["run"], request["rank"]):
                self.deferred.remove(waiting)
                for fd in fds:
                    os.close(fd)
                ids = {"run": request["run"], "rank": request["rank"]}
                self.reply({**ids, "op": "exited", "status": -message["signal"]})

    def warm_up(self) -> None:
        """Import the libraries asked for, then (once) WARM_LATER and torch_xla where launches
        use it, while still serving requests; then retire the spares forked without them.
        The kernel's libraries come first: the next launch is the kernel's, and needs them."""
        loaded = len(sys.modules)
        self.preload()
        first = () if self.warmed else WARM_LATER + (("torch_xla",) if xla_machine() else ())
        self.warmed = True
        for module in first:
            env = dict(os.environ)
            self.files.begin()
            with self.serving_meanwhile(), frozen_imports():
                try:
                    __import__(module)
                except Exception:  # noqa: BLE001 - workers import it themselves and report errors
                    pass
            self.tell_loaded()
            # torch_xla writes PJRT_DEVICE, XLA_FLAGS, ... on import: workers get the
            # launch's environment, never ours, so keep ours as it was.
            os.environ.clear()
            os.environ.update(env)
            # Between two imports no module is half-run: forking is safe again.
            self._serve_deferred()
            while len(self.spares) < self.wanted_spares and self.fork_spare() is not None:
                pass
            self.preload()  # what the kernel offered meanwhile, before the next module
        if self.preloader.unsafe is not None:
            return  # forking is over: the spares forked before the import are all there is
        # Told once the spares have every import: a launch that follows the report gets one
        # (before, while imports were served mid-way or newer spares forked, an older one).
        self.held_report = self.preloader.report
        if len(sys.modules) != loaded:  # the spares lack what was imported: newer ones
            self.stale = {pid for pid, _ in self.spares}

    def preload(self) -> None:
        """Import the libraries asked for (checked), then fork spares that have them before
        serving the launches that waited (spares forked before retire once idle)."""
        if self.preloader.unsafe is not None:
            return  # forking is over, and so is preloading
        loaded = len(sys.modules)
        self.preload_names = package_names(self.preloader.pending)
        self.preloading = True
        try:
            with self.serving_meanwhile(), frozen_imports():
                self.preloader.run(
                    self.reply, self.tell_loaded, self.held_sockets, self.files.begin
                )
        finally:
            self.preloading = False
        if len(sys.modules) != loaded and self.preloader.unsafe is None:
            self.stale |= {pid for pid, _ in self.spares}
            self.held_report = self.preloader.report  # told once the stale spares retire
        while self.fresh_spares() < self.wanted_spares and self.fork_spare() is not None:
            pass
        self._serve_deferred()

    def preload_first(self, message: dict[str, Any], fds: list[int]) -> None:
        """A launch came while libraries asked for are still to be imported: import them,
        then serve it (and what came meanwhile) from spares forked after them."""
        self.deferred.insert(0, (message, fds))
        self.preload_names = package_names(self.preloader.pending)
        self.tell_waiting(message)
        self.preload()

    def tell_waiting(self, message: dict[str, Any]) -> None:
        """Tell the kernel that a launch waits for the libraries being preloaded, and which
        (its ``events.Waiting``: the dashboard and text say so): once, for its first rank."""
        if message["op"] == "spawn" and message["context"].local_rank == 0:
            text = f"the helper imports {self.preload_names} first (once, for later launches too)"
            ids = {"run": message["run"], "rank": message["rank"]}
            self.reply({"op": "waiting", **ids, "text": text})

    def tell_loaded(self) -> None:
        """Tell the kernel the installed files loaded since the last time (few: per import)."""
        found = self.files.since_last()
        if found:
            self.reply({"op": "loaded", "files": found})

    def fork_base(self) -> None:
        """Fork the base, once, right after "ready": what a successor starts from."""
        self.tell_loaded()  # the kernel learns the base's files before it learns of the base
        self.base = fork_base(self.close_in_child, self.become(), base_title(self.parent.pid))
        if self.base is not None:
            self.reply({"op": "base", "pid": self.base[0]})

    def hand_over(self, message: dict[str, Any], fds: list[int]) -> None:
        """The kernel retires us: our base becomes its helper on the socket in ``fds`` (if
        we have none, closing that socket tells the kernel). We fork and import no more;
        runs in flight go on until the kernel closes us."""
        base, self.base = self.base, None
        try:
            if base is not None:
                control.send(base[1], {**message, "spares": self.wanted_spares}, fds)
        except OSError:
            pass  # the base died: the kernel sees its socket close and starts a fresh helper
        finally:
            for fd in fds:
                os.close(fd)
            if base is not None:
                base[1].close()
        self.preloader.pending.clear()
        self.warmed = True
        self.wanted_spares = 0
        self.stale = {pid for pid, _ in self.spares}
        self.retire_stale()

    def fresh_spares(self) -> int:
        return sum(1 for pid, _ in self.spares if pid not in self.stale)

    def retire_stale(self) -> None:
        """Enough spares have every import: the older ones go, and the kernel is told."""
        for pid, channel in [s for s in self.spares if s[0] in self.stale]:
            channel.close()  # the spare reads EOF and exits; reap() collects it
            self.spares.remove((pid, channel))
        self.stale.clear()
        if self.held_report is not None:
            self.reply({**self.held_report, "asked": self.preloader.progress()["asked"]})
            self.held_report = None

    def held_sockets(self) -> frozenset[str]:
        """The sockets that came with requests waiting mid-import (rank 0's rendezvous)."""
        return sockets_of([fd for _, fds in self.deferred for fd in fds])

    def _serve_deferred(self) -> None:
        """Requests read mid-import, served between two imports (forking is safe there);
        not while libraries asked for are imported: launches wait for those."""
        while self.deferred and not self.preloading:
            self.handle(*self.deferred.pop(0))

    def serving_meanwhile(self) -> contextlib.AbstractContextManager[None]:
        """``serve_mid_import`` runs as soon as the kernel writes to the control socket and
        every TICK_SECONDS while the body (an import) runs (``between_bytecodes``)."""
        return serving_while(self.sock.fileno(), self._tick, TICK_SECONDS)

    def _tick(self) -> None:
        self.in_tick = True
        try:
            self.serve_mid_import()
        finally:
            self.in_tick = False

    def serve_mid_import(self) -> None:
        """Requests and exits, from the timer, in the middle of an import.

        A spawn goes to a spare forked before the import (a fork now would copy a half-run
        import into the worker); without a spare, or while libraries asked for are being
        imported, it waits in ``deferred`` for the import's end (during the helper's own
        warm-up, WARM_LATER, it does not wait: that may take seconds, and is no library the
        launch asked for). Stops, offers and a
        ``succeed`` are answered at once (``ANSWERED_MID_IMPORT``). While a launch's workers
        run, stay here up to MAX_PAUSE_SECONDS: the import waits and leaves a short launch
        the CPU; a long run gets the import done in its first seconds, so the next launch
        finds it. Only known children are reaped: the import may be waiting for one of its
        own.
        """
        timeout = 0.0
        resume_at = time.monotonic() + MAX_PAUSE_SECONDS
        while True:
            if not self.parent.alive():
                raise _ParentGone
            ready = self._wait(timeout)
            if self.wake_read in ready:
                while drain(self.wake_read):
                    pass
                self.reap(known_only=True)
            if self.sock in ready:
                message, fds = control.receive(self.sock)
                if message is None:
                    raise _ParentGone
                if message["op"] in ANSWERED_MID_IMPORT:
                    self.handle(message, fds)
                elif self.deferred or self.preloading or not self.spares:
                    self.deferred.append((message, fds))
                    if self.preloading:
                        self.tell_waiting(message)
                else:
                    self.handle(message, fds)
            now = time.monotonic()
            if self.deferred or not self.workers or now >= resume_at:
                return
            timeout = min(PARENT_POLL_SECONDS, resume_at - now)
