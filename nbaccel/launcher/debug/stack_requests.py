"""The hub's requests for stacks in flight: each asked of some ranks, done when all answered
or its deadline passed (``DebugHub.request_stacks``). Kept under the hub's lock. Stdlib only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StacksRequest:
    ranks: set[int]
    deadline: float
    done: Callable[[dict[int, dict[str, Any]]], None]
    got: dict[int, dict[str, Any]] = field(default_factory=dict)


class StackRequests:
    """Requests by number (the ``id`` a rank's answer carries).

    >>> requests = StackRequests()
    >>> number, request = requests.add({0, 1}, deadline=5.0, done=print)
    >>> requests.answered(0, {"id": number, "text": "..."}); requests.forget_rank(1)
    >>> [r.got for r in requests.due(now=1.0)]
    [{0: {'id': 1, 'text': '...'}}]
    """

    def __init__(self) -> None:
        self._requests: dict[int, StacksRequest] = {}
        self._ids = itertools.count(1)

    def add(
        self, ranks: set[int], deadline: float, done: Callable[[dict[int, dict[str, Any]]], None]
    ) -> tuple[int, StacksRequest]:
        number = next(self._ids)
        self._requests[number] = request = StacksRequest(ranks, deadline, done)
        return number, request

    def answered(self, rank: int, message: dict[str, Any]) -> None:
        request = self._requests.get(message.get("id"))  # type: ignore[arg-type]
        if request is not None and rank in request.ranks:
            request.got[rank] = message

    def due(self, now: float) -> list[StacksRequest]:
        """The requests answered by every rank asked, or past their deadline (forgotten)."""
        finished = []
        for number, request in list(self._requests.items()):
            if request.ranks <= set(request.got) or now >= request.deadline:
                finished.append(request)
                del self._requests[number]
        return finished

    def deadlines(self) -> list[float]:
        return [r.deadline for r in self._requests.values()]

    def forget_rank(self, rank: int) -> None:
        """The rank's channel closed: no request waits for it any more."""
        for request in self._requests.values():
            request.ranks.discard(rank)

    def take_all(self) -> list[StacksRequest]:
        requests, self._requests = list(self._requests.values()), {}
        return requests
