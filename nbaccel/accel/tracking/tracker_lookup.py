"""``Accelerator.get_tracker(name, unwrap=False)``: one of the started trackers, by name.

As in Accelerate:

- trackers run on the main process only; where none were started (the other ranks, or before
  ``init_trackers``) the answer is a ``BlankTracker`` whose methods do nothing, so code such as
  ``acc.get_tracker("wandb").log(...)`` runs on every rank;
- where trackers were started, an unknown name is a ``ValueError``;
- ``unwrap=True`` gives the tracking library's own object (the ``SummaryWriter``, the wandb
  run, ...), read from the tracker's ``tracker`` attribute, for what nbaccel does not wrap
  (``add_figure``, ``wandb.Table``, ...).

Names are nbaccel's tracker names, which are Accelerate's for the trackers both have:
``tensorboard``, ``wandb``, ``mlflow`` (and nbaccel's ``csv`` and ``jsonl``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class BlankTracker:
    """What ``get_tracker`` returns where no tracker runs: every method does nothing.

    It has the methods of Accelerate's ``GeneralTracker`` (``start``,
    ``store_init_configuration``, ``log``, ``finish``) and of nbaccel's trackers
    (``store_config``). Like Accelerate's blank tracker it has no ``tracker``: code that
    unwraps should run on the main process only.

    >>> BlankTracker().log({"loss": 0.5}, step=3) is None
    True
    """

    main_process_only = True

    def start(self) -> None:
        """Nothing to start."""

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Nothing to store: no tracker runs here."""

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Nothing to store: no tracker runs here."""

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Nothing to log: no tracker runs here."""

    def finish(self) -> None:
        """Nothing to finish."""


def get_tracker(trackers: Sequence[Any], name: str, unwrap: bool = False) -> Any:
    """The tracker called ``name`` among ``trackers`` (the Accelerator's started ones).

    >>> class Csv:
    ...     name, tracker = "csv", "the open file"
    >>> get_tracker([Csv()], "csv", unwrap=True)
    'the open file'
    >>> type(get_tracker([], "wandb")).__name__  # not the main process: nothing started
    'BlankTracker'
    """
    if not trackers:
        return BlankTracker()
    for tracker in trackers:
        if tracker.name == name:
            return _unwrapped(tracker) if unwrap else tracker
    started = ", ".join(repr(t.name) for t in trackers)
    raise ValueError(
        f"get_tracker({name!r}): no tracker of that name was started; the started ones are "
        f"{started}. Add {name!r} to log_with= (and call init_trackers first), or ask for one "
        "of those."
    )


def _unwrapped(tracker: Any) -> Any:
    try:
        return tracker.tracker
    except AttributeError:
        raise NotImplementedError(
            f"get_tracker({tracker.name!r}, unwrap=True): nbaccel's {tracker.name} tracker does "
            "not expose its library's object (no 'tracker' attribute). Use "
            "get_tracker(name) without unwrap to log through nbaccel, or open the library "
            "yourself on the main process."
        ) from None
