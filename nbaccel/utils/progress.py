"""``accelerate.utils.tqdm``: a progress bar shown by one process per machine.

With several processes every rank would draw its own bar over the others'; Accelerate's
wrapper disables the bar on all but each machine's local main process. nbaccel's launcher
shows each rank's output with its rank, and renders ``\\r`` progress lines as one updating
line, so the one bar left reads as in a single-process run.
"""

from __future__ import annotations

from typing import Any

from nbaccel.accel.partial_state import PartialState

__all__ = ["tqdm"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled off the local main process unless
    ``main_process_only=False`` (an explicit ``disable=True`` always wins).

    >>> bar = tqdm(range(3), disable=True)
    >>> list(bar)
    [0, 1, 2]
    """
    if args and isinstance(args[0], bool):
        # Accelerate's wrapper took main_process_only positionally once; a bool there would
        # now be taken as the iterable by tqdm, so it is refused as Accelerate refuses it.
        raise ValueError(
            "tqdm(True, ...) / tqdm(False, ...): a bool as the first argument is not supported "
            "(it was once main_process_only). Pass it by keyword: "
            "tqdm(iterable, main_process_only=False)."
        )
    try:
        from tqdm import auto  # the console bar in workers, the widget in a kernel
    except ImportError as error:
        raise ImportError(
            f"nbaccel.utils.tqdm needs the tqdm package ({error}). Install it with "
            "`pip install tqdm` in the workers' Python."
        ) from error
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = PartialState().local_process_index != 0
    return auto.tqdm(*args, **kwargs, disable=disable)
