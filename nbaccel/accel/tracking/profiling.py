"""``Accelerator.profile``: ``torch.profiler`` set up from Accelerate's ``ProfileKwargs``.

The settings object is read by field name, so Accelerate's own ``ProfileKwargs`` and nbaccel's
(``nbaccel.utils.ProfileKwargs``) both work, and so does any object with some of the fields
(missing ones take ``ProfileKwargs``' defaults):

- ``activities``: names among ``"cpu"``, ``"cuda"``, ``"xpu"``, ``"mtia"``, ``"hpu"`` (or
  ``torch.profiler.ProfilerActivity`` members); ``None`` lets torch choose (CPU, plus the GPU
  when there is one);
- ``schedule_option``: keywords for ``torch.profiler.schedule`` (``wait``, ``warmup``,
  ``active``, ``repeat``, ``skip_first``); call ``prof.step()`` once per iteration;
- ``on_trace_ready``, ``record_shapes``, ``profile_memory``, ``with_stack``, ``with_flops``,
  ``with_modules``: passed to ``torch.profiler.profile`` as they are;
- ``output_trace_dir``: after the block, each process writes its Chrome trace to
  ``<dir>/profile_<process_index>.json`` (Accelerate's file name), then all processes wait for
  each other, as in Accelerate. Traces open in ``chrome://tracing`` or Perfetto.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity

TRACE_FILE = "profile_{process_index}.json"  # Accelerate's PROFILE_PATTERN_NAME


def profiler_activities() -> dict[str, ProfilerActivity]:
    """The activity names this torch build and machine can profile, as ProfileKwargs names them.

    >>> profiler_activities()["cpu"]
    <ProfilerActivity.CPU: 0>
    """
    found = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}
    # Accelerate offers these only where the device is present; so do we (the enum members
    # exist in builds without the device, and profiling them there fails obscurely).
    for name in ("xpu", "mtia", "hpu"):
        member = getattr(ProfilerActivity, name.upper(), None)
        device_module = getattr(torch, name, None)
        available = getattr(device_module, "is_available", None)
        if member is not None and callable(available) and available():
            found[name] = member
    return found


def build_profiler(settings: Any = None) -> torch.profiler.profile:
    """A ``torch.profiler.profile`` configured from a ``ProfileKwargs``-like ``settings``.

    >>> prof = build_profiler(None)
    >>> type(prof).__name__
    'profile'
    """
    activities = _activities(_field(settings, "activities", None))
    schedule_option = _field(settings, "schedule_option", None)
    schedule = None if schedule_option is None else torch.profiler.schedule(**schedule_option)
    return torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        on_trace_ready=_field(settings, "on_trace_ready", None),
        record_shapes=bool(_field(settings, "record_shapes", False)),
        profile_memory=bool(_field(settings, "profile_memory", False)),
        with_stack=bool(_field(settings, "with_stack", False)),
        with_flops=bool(_field(settings, "with_flops", False)),
        with_modules=bool(_field(settings, "with_modules", False)),
    )


@contextlib.contextmanager
def profile(
    settings: Any,
    *,
    process_index: int,
    wait_for_everyone: Callable[[], None],
) -> Iterator[torch.profiler.profile]:
    """Profile the block; yields the profiler (``prof.step()``, ``prof.key_averages()``).

    ``settings`` is the ``profile_handler`` argument, else the Accelerator's ``ProfileKwargs``
    from ``kwargs_handlers``, else ``None`` (defaults). With ``output_trace_dir`` the trace is
    exported after the block and the processes meet at ``wait_for_everyone``; if the block
    raises, nothing is exported and nobody waits (as in Accelerate).

    >>> import tempfile, types
    >>> folder = tempfile.mkdtemp()
    >>> settings = types.SimpleNamespace(activities=["cpu"], output_trace_dir=folder)
    >>> with profile(settings, process_index=0, wait_for_everyone=lambda: None) as prof:
    ...     _ = torch.ones(8, 8) @ torch.ones(8, 8)
    >>> os.listdir(folder)
    ['profile_0.json']
    >>> any(event.key == "aten::matmul" for event in prof.key_averages())
    True
    """
    with build_profiler(settings) as profiler:
        yield profiler
    output_trace_dir = _field(settings, "output_trace_dir", None)
    if output_trace_dir is None:
        return
    os.makedirs(output_trace_dir, exist_ok=True)
    trace = os.path.join(output_trace_dir, TRACE_FILE.format(process_index=process_index))
    profiler.export_chrome_trace(trace)
    wait_for_everyone()


def _field(settings: Any, name: str, default: Any) -> Any:
    return default if settings is None else getattr(settings, name, default)


def _activities(names: Any) -> list[ProfilerActivity] | None:
    if names is None:
        return None
    known = profiler_activities()
    chosen: list[ProfilerActivity] = []
    for name in names:
        if isinstance(name, ProfilerActivity):
            chosen.append(name)
        elif str(name).lower() in known:
            chosen.append(known[str(name).lower()])
        else:
            raise ValueError(
                f"ProfileKwargs(activities=...) got {name!r}, which this machine cannot profile. "
                f"Choose among {sorted(known)} (devices that are absent are not offered)."
            )
    return chosen
