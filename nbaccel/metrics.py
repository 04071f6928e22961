"""``log_metrics``: report scalars from worker code to the parent (``run.metrics``, the dashboard).

``Accelerator.log`` calls this; any code running in a launched worker may call it too.
The step-time breakdown travels the same way (``report_step_breakdown``, from the worker's
``StepTimer``), with the seconds spent compiling so far (``compile_seconds``, read from
torch only where it is loaded already); ``nbaccel.step_board`` reads it back in the parent.
Plain data, stdlib only.
"""

from __future__ import annotations

import numbers
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from nbaccel.context import active_session
from nbaccel.events import Metric, ModelPrepared, SettingsApplied, StepBreakdown


def log_metrics(values: Mapping[str, Any], step: int | None = None) -> dict[str, Any]:
    """Send named scalars to the launcher; returns the record as ``run.metrics`` will hold it.

    Values may be Python numbers or anything with ``.item()`` (0-d tensors, numpy scalars).
    Records are batched: they reach the parent within 0.25 s, and before the run's result.
    Without ``step`` the step counts this process's calls. Outside an nbaccel worker the
    record is only returned, so the same code runs under any launcher.

    >>> log_metrics({"loss": 0.5}, step=3)
    {'loss': 0.5, 'step': 3}
    """
    scalars = {str(name): _scalar(name, value) for name, value in values.items()}
    session = active_session()
    if step is None:
        step = session.metric_steps if session else 0
    if session is not None:
        session.metric_steps = step + 1
        rank, now = session.context.rank, time.time()
        if len(session.metric_history) < _HISTORY_LIMIT:
            session.metric_history.append([int(step), scalars, now])
        session.events.send_batched(Metric(rank, int(step), scalars, now))
    return {**scalars, "step": int(step)}


def report_model(num_params: int) -> None:
    """Tell the launcher the size of a prepared model (``Accelerator.prepare`` calls it), so
    the dashboard can show the memory estimate next to the live readings. A no-op outside
    an nbaccel worker.

    >>> report_model(1_000_000)
    """
    session = active_session()
    if session is not None:
        rank = session.context.rank
        session.events.send(ModelPrepared(rank, int(num_params), time.time()))


def report_settings(values: dict[str, Any], sources: dict[str, str]) -> None:
    """Tell the launcher which settings the Accelerator changed from the launch's config
    (plugins, kwargs handlers, its own arguments: only the worker knows them), with each
    one's source, so ``run_dir/accelerator_config.json`` and the dashboard show what really
    runs. A no-op outside an nbaccel worker.

    >>> report_settings({"strategy": "fsdp"}, {"strategy": "plugin: FSDP plugin"})
    """
    session = active_session()
    if session is not None and values:
        rank = session.context.rank
        session.events.send(SettingsApplied(rank, values, sources, time.time()))


def report_step_breakdown(window: Mapping[str, Any]) -> None:
    """Send one window of this process's step-time breakdown (``StepTimer``'s) to the
    launcher: batched like metrics. A no-op outside an nbaccel worker.

    >>> report_step_breakdown({"steps": 1, "phases": {"data": 0.1}, "samples": 8,
    ...                        "tokens": None, "peak_memory": None})
    """
    session = active_session()
    if session is not None:
        window_fields = {name: window[name] for name in _WINDOW_FIELDS}
        rank = session.context.rank
        compiling = compile_seconds()
        session.events.send_batched(
            StepBreakdown(rank, **window_fields, time=time.time(), compile_seconds=compiling)
        )


_WINDOW_FIELDS = ("steps", "phases", "samples", "tokens", "peak_memory")  # StepBreakdown's


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (torch.compile: Dynamo's tracing and
    the backend's compile, forward and backward graphs), from torch's own clock
    (``torch._dynamo.utils.calculate_time_spent``). 0.0 while ``torch._dynamo`` was never
    imported: it is not imported to ask, so this stays stdlib-only where torch is absent.

    ``torch._dynamo.reset()`` zeroes torch's figure; the seconds counted before it are kept,
    so the figure never goes back (what was compiled between the last reading and a reset
    is not seen).

    >>> compile_seconds() >= 0.0
    True
    """
    utils = sys.modules.get("torch._dynamo.utils")
    spent = getattr(utils, "calculate_time_spent", None) if utils is not None else None
    if spent is None:
        return 0.0
    try:
        now = float(spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a torch without this figure: nothing to show
        return 0.0
    with _compile_lock:
        if now < _compile_clock["last"]:  # torch._dynamo.reset() zeroed it
            _compile_clock["before_reset"] += _compile_clock["last"]
        _compile_clock["last"] = now
        return _compile_clock["before_reset"] + now


_HISTORY_LIMIT = 200_000  # metrics a checkpoint carries (~20 MB at most in memory)
_compile_lock = threading.Lock()  # torch_xla's threaded ranks share the process's figure
_compile_clock = {"last": 0.0, "before_reset": 0.0}


def _scalar(name: object, value: Any) -> float:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"log_metrics: {name!r} is {type(value).__name__}, not a number. Log scalars "
            "(floats, ints, 0-d tensors); reduce a tensor with .mean() first."
        )
    return float(value)
