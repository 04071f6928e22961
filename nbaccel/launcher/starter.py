"""What a ``Run`` needs from whatever starts its workers: the launcher interface.

Three implementations: the helper process on this machine
(``helper_process.HelperProcess``: a fork per rank, or one torch_xla supervisor for every
rank) and one agent per host on several machines (``remote_hosts.RemoteHosts``). A new way
to start workers is a new class with these methods; ``Run`` and its pump stay as they are.
Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

# A message about a run's workers, on the starter's thread: {"op": "exited", "rank",
# "status"} (status: exit code, or minus the signal), {"op": "spawn_failed", "rank",
# "error"} or {"op": "helper_died", "error"} (every rank is gone). Where workers are
# restarted (torch elastic's max_restarts, remote_hosts.py): {"op": "worker_ended", "rank",
# "attempt", "status"} (one worker of an attempt ended; status None when unknown) and
# {"op": "restarted", "attempt"} (attempt N started, N >= 1; its workers follow). Any starter
# may say what the workers wait for before they start: {"op": "waiting", "text"} (the
# helper's torch import, libraries it imports first), shown until a worker starts.
StarterListener = Callable[[dict[str, Any]], None]


class WorkerStarter(Protocol):
    def subscribe(self, run_id: str, listener: StarterListener) -> None:
        """Send the run's messages to ``listener`` from now on."""

    def unsubscribe(self, run_id: str) -> None:
        """The run is over: no more messages, and what was kept for it may go."""

    def spawn(self, request: dict[str, Any], fds: list[int]) -> None:
        """Start one rank (``request["rank"]``) on ``fds``: payload, log and event pipes (and
        rank 0's rendezvous socket on one machine). The caller closes its ``fds`` after."""

    def signal(
        self, run_id: str, signum: int, ranks: list[int] | None = None, *, group: bool = True
    ) -> None:
        """Send ``signum`` to the run's live workers (all, or ``ranks``) and their children;
        ``group=False``: to the workers only (a stack dump must end none of their children)."""

    def host_of(self, rank: int) -> str | None:
        """The host a rank runs on, where there are several (None: this machine)."""

    def offer_modules(self, modules: list[tuple[str, str | None]]) -> None:
        """What rank 0 imported, (name, file): libraries to have ready for the next launch
        (the helper preloads them; other starters may ignore it)."""
