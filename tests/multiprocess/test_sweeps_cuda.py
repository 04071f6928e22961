"""Sweeps on GPUs: each trial's ranks see exactly the GPUs of its slot, no GPU serves two
trials at once, and a freed GPU serves the next trial.

Runs only where CUDA is present (the ``cuda`` marker); the packing itself is tested without
GPUs in tests/unit/sweeps (a simulated 8-GPU box) and on CPU slots in test_sweeps.py."""

from __future__ import annotations

import os
from typing import Any

import pytest

import nbaccel
from nbaccel.hardware.devices import visible_gpu_count

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]


def where(config: dict[str, Any]) -> dict[str, Any]:
    import time

    import torch

    started = time.time()
    torch.ones(1, device="cuda")  # the trial's first CUDA use
    time.sleep(0.5)
    return {
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "count": torch.cuda.device_count(),
        "span": (started, time.time()),
    }


def test_each_trial_sees_only_its_slots_gpus(runs_dir: str) -> None:
    gpus = visible_gpu_count(os.environ)
    sweep = nbaccel.sweep(
        where, [{"n": n} for n in range(2 * gpus)], dashboard="text", runs_dir=runs_dir
    )
    assert [t.state for t in sweep.trials] == ["succeeded"] * (2 * gpus)
    values = [(t.slot, run.result()) for t, run in zip(sweep.trials, sweep.runs, strict=True)]
    for slot, value in values:
        assert slot is not None and value["count"] == 1
        for other, seen in values:  # no two trials on one GPU at the same time
            if other is not slot and other is not None and other.devices == slot.devices:
                a, b = value["span"], seen["span"]
                assert a[1] <= b[0] or b[1] <= a[0] or a == b
    assert len({slot.devices for slot, _ in values}) == gpus  # every GPU served
