"""After training on GPUs: kept ranks whose model lives on CUDA send its whole state dict
into the kernel as CPU tensors (DDP, and FSDP2 gathered one tensor at a time), and map runs
the batches on each rank's device with the outputs back in order on the CPU.

Runs only where CUDA is present (the ``cuda`` marker); the same code runs on CPU elsewhere
(test_after_training.py)."""

from __future__ import annotations

import os

import pytest

import nbaccel
from nbaccel.hardware.devices import visible_gpu_count
from tests.multiprocess.test_after_training import build_model, digest_of, train

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_kept_gpu_ranks_send_cpu_weights_and_map_in_order(runs_dir: str, strategy: str) -> None:
    import torch

    ranks = min(2, visible_gpu_count(os.environ))
    value = nbaccel.notebook_launcher(
        train, num_processes=ranks, keep_workers=True, strategy=strategy, runs_dir=runs_dir
    )
    workers = nbaccel.last_workers()
    assert workers is not None
    try:
        state = workers.state_dict()
        assert all(t.device.type == "cpu" for t in state.values())
        assert digest_of(state) == value["weights"]
        model = build_model()
        nbaccel.load_into(model, state)
        data = torch.randn(333, 16)
        workers.run_cell(
            "net = accelerator._prepared.models[0]\n"
            "assert next(net.parameters()).device.type == 'cuda'",
            "<c>",
        )
        predicted = workers.map("net", data, batch_size=32)
        assert predicted.device.type == "cpu" and predicted.shape == (333, 3)
        with torch.no_grad():
            torch.testing.assert_close(predicted, model(data), rtol=1e-4, atol=1e-4)
    finally:
        workers.close()
