"""``gpu_ids`` reaches the workers: each one's ``CUDA_VISIBLE_DEVICES`` lists the GPUs chosen,
counted among those the kernel's own ``CUDA_VISIBLE_DEVICES`` leaves visible. On CPU through
a CPU run (which counts no GPU but still narrows what the workers see); with CUDA, on the
GPUs themselves (``-m cuda``)."""

from __future__ import annotations

import os
from typing import Any

import pytest

import nbaccel
from nbaccel.hardware.devices import visible_device_entries, visible_gpu_count


def what_the_worker_sees() -> dict[str, Any]:
    return {
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "local_rank": int(os.environ["LOCAL_RANK"]),
    }


@pytest.mark.timeout(240)
def test_the_workers_env_lists_the_chosen_gpus_among_the_kernels(
    runs_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    run = nbaccel.launch(
        what_the_worker_sees, num_processes=2, use_cpu=True, gpu_ids=[1, 0], runs_dir=runs_dir
    )
    results = run.results(200)
    assert results == {r: {"visible": "6,5", "local_rank": r} for r in range(2)}
    assert run.config.gpu_ids == "1,0"


def on_the_chosen_gpu() -> dict[str, Any]:
    import torch

    value = (torch.ones(2, device="cuda") * 3).sum().item()  # the GPU computes
    return {
        "visible": os.environ["CUDA_VISIBLE_DEVICES"],
        "count": torch.cuda.device_count(),
        "device": torch.cuda.current_device(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "value": value,
        "uuid": str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid),
    }


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_each_rank_runs_on_its_gpu_of_gpu_ids(runs_dir: str) -> None:
    gpus = visible_gpu_count(os.environ)
    chosen = list(reversed(range(gpus)))[:2]  # the last GPUs first: not the default order
    entries = visible_device_entries(os.environ)
    expected = ",".join(entries[i] if entries is not None else str(i) for i in chosen)
    results = nbaccel.launch(
        on_the_chosen_gpu, gpu_ids=",".join(map(str, chosen)), runs_dir=runs_dir
    ).results(240)
    assert sorted(results) == list(range(len(chosen)))  # the default: one process per id
    for rank, seen in results.items():
        assert seen["visible"] == expected
        assert seen["count"] == len(chosen)  # the other GPUs are hidden from the worker
        assert seen["device"] == seen["local_rank"] == rank  # rank r: the r-th listed GPU
        assert seen["value"] == 6.0
    if len(chosen) == 2:  # two different physical GPUs
        assert results[0]["uuid"] != results[1]["uuid"]
    with pytest.raises(nbaccel.ConfigError, match=f"names GPU {gpus}, but {gpus} GPU"):
        nbaccel.launch(on_the_chosen_gpu, gpu_ids=str(gpus), runs_dir=runs_dir)
