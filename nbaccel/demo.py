"""The built-in demo: a small regression model trained with DDP on generated data.

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
    import sys

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from nbaccel.metrics import log_metrics

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)  # the same data and initial weights on every rank
    inputs = torch.randn(samples, 2)
    targets = 3 * inputs[:, :1] - 2 * inputs[:, 1:] + 0.5 + 0.01 * torch.randn(samples, 1)
    dataset = TensorDataset(inputs, targets)
    sampler: DistributedSampler[Any] | None = (
        DistributedSampler(dataset, world_size, rank) if distributed else None
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=sampler is None)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses: list[float] = []
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        batches = _progress(loader, rank, f"epoch {epoch + 1}/{epochs}")
        for features, target in batches:
            loss = torch.nn.functional.mse_loss(model(features), target)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses.append(loss.item())
            log_metrics({"loss": losses[-1]})
            if hasattr(batches, "set_postfix_str"):
                batches.set_postfix_str(f"loss {losses[-1]:.4f}", refresh=False)
        if rank == 0:
            print(f"epoch {epoch + 1}/{epochs} loss {losses[-1]:.4f}", file=sys.stdout, flush=True)
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
