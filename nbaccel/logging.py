"""``get_logger``: a logger for distributed runs, as in Hugging Face ``accelerate.logging``.

Records are logged on the main process only unless a call says ``main_process_only=False``;
``in_order=True`` makes every process log, one after the other in rank order. Messages are
prefixed with ``[RANK n]``, as Accelerate's are.

Unlike Accelerate's, it works before anything else exists: Accelerate raises unless a
``PartialState`` or ``Accelerator`` was created first. Here the rank is read without
building one, from the nbaccel launch this worker belongs to, an initialised
torch.distributed group, or torchrun's ``RANK`` / ``WORLD_SIZE`` (else: one process). Building
a ``PartialState`` would initialise the process group as a side effect of a log call, and
import torch in a notebook kernel that only wanted to log; so this module imports no torch,
and ``in_order`` alone builds one (it needs barriers between the ranks).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

from nbaccel.context import active_session

__all__ = ["MultiProcessAdapter", "get_logger"]


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes, without importing torch."""
    session = active_session()
    if session is not None:
        return session.context.rank, session.context.world_size
    dist = sys.modules.get("torch.distributed")  # a group only exists if this was imported
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun and the like
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


class MultiProcessAdapter(logging.LoggerAdapter[logging.Logger]):
    """A logger whose calls take ``main_process_only=`` (default True) and ``in_order=``.

    >>> import logging, sys
    >>> plain = logging.getLogger("example")
    >>> plain.setLevel("INFO"); plain.addHandler(logging.StreamHandler(sys.stdout))
    >>> logger = get_logger("example")
    >>> logger.info("loaded %d rows", 3)
    [RANK 0] loaded 3 rows
    >>> plain.handlers.clear()
    """

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        msg, kwargs = super().process(msg, kwargs)
        # The caller's file and line in the record, not this module's.
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {_rank_and_world()[0]}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Log ``msg`` on the main process (``main_process_only=True``), on every process
        (``False``), or on every process in rank order (``in_order=True``, which all
        processes must call; ``main_process_only`` is then ignored)."""
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, options = self.process(msg, kwargs)
        rank, world = _rank_and_world()
        if in_order and world > 1:
            self._log_in_order(level, msg, args, options)
        elif in_order or not main_process_only or rank == 0:
            self.logger.log(level, msg, *args, **options)

    def _log_in_order(
        self, level: int, msg: Any, args: tuple[Any, ...], kwargs: MutableMapping[str, Any]
    ) -> None:
        from nbaccel.accel.partial_state import PartialState  # imports torch: only here

        state = PartialState()
        kwargs["stacklevel"] = int(kwargs.get("stacklevel", 1)) + 1  # one frame deeper
        for turn in range(state.num_processes):
            if turn == state.process_index:
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    @functools.lru_cache(None)  # noqa: B019 - one entry per distinct warning, for the process
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning``, emitted once per distinct message and arguments."""
        # One frame deeper than a plain warning(): the record names warning_once's caller.
        self.warning(*args, **{"stacklevel": 3, **kwargs})


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A ``logging.getLogger(name)`` that logs on the main process unless told otherwise.

    ``log_level`` (default: the ``ACCELERATE_LOG_LEVEL`` variable, read only, if set) sets
    the level of this logger and, as in Accelerate, of the root logger.

    >>> logger = get_logger(__name__)
    >>> logger.info("on rank 0 only")
    >>> logger.info("on every rank", main_process_only=False)
    """
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
