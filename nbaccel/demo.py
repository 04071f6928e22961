"""The built-in demo: a small regression model trained by the Accelerator on generated data.

It runs in the workers (torch is imported inside the function), downloads nothing, and
prints rank-0 progress with a tqdm bar, so ``nbaccel demo`` shows the whole path: launch,
live output, metrics and the value returned by rank 0.
"""

from __future__ import annotations

from typing import Any


def train_demo(epochs: int = 3, samples: int = 4096, batch_size: int = 64) -> dict[str, Any]:
    """Fit ``y = 3x0 - 2x1 + 0.5`` with a small MLP; returns rank 0's summary.

    >>> summary = train_demo(epochs=1, samples=256)  # doctest: +ELLIPSIS
    epoch 1/1 ...
    >>> summary["world_size"], summary["final_loss"] < summary["first_loss"]
    (1, True)
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel.accel import Accelerator

    acc = Accelerator()  # precision, accumulation, ... from the launch (nbaccel demo --help)
    torch.manual_seed(0)  # the same data and initial weights on every rank
    inputs = torch.randn(samples, 2)
    targets = 3 * inputs[:, :1] - 2 * inputs[:, 1:] + 0.5 + 0.01 * torch.randn(samples, 1)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # DDP with several processes; each rank gets its own shard of every epoch.
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses: list[float] = []
    for epoch in range(epochs):
        batches = _progress(loader, acc.process_index, f"epoch {epoch + 1}/{epochs}")
        for features, target in batches:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(features), target)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            acc.log({"loss": losses[-1]})  # -> run.metrics, the live curve, trackers
            if hasattr(batches, "set_postfix_str"):
                batches.set_postfix_str(f"loss {losses[-1]:.4f}", refresh=False)
        acc.print(f"epoch {epoch + 1}/{epochs} loss {losses[-1]:.4f}", flush=True)
    world_size = acc.num_processes
    return {
        "world_size": world_size,
        "steps": len(losses),
        "first_loss": round(losses[0], 4),
        "final_loss": round(losses[-1], 4),
    }


def _progress(loader: Any, rank: int, label: str) -> Any:
    """A tqdm bar on rank 0 (when tqdm is installed); the plain loader elsewhere."""
    if rank != 0:
        return loader
    try:
        from tqdm import tqdm
    except ImportError:
        return loader
    import sys

    return tqdm(loader, desc=label, file=sys.stderr, mininterval=0.2)
