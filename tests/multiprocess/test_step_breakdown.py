"""The step-time breakdown of real 2-process DDP and FSDP runs (CPU, gloo) launched by nbaccel.

Each worker times its own training loop with ``perf_counter`` (the reference); the
breakdown the workers sent, as the parent recorded it in ``events.jsonl``, must add up to
that time within 5 % (the goal of issue 16: what is not in a phase is the start of the
pass and the last, empty request), with every phase measured, communication included.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.events import StepBreakdown
from nbaccel.step_board import PHASES, StepBoard

pytestmark = pytest.mark.timeout(240)

BATCHES, BATCH, SEQUENCE = 40, 8, 16  # per rank


def train_tokens() -> dict[str, Any]:
    """A small token model over a prepared loader of ``input_ids`` batches; an evaluation
    pass over a second prepared loader follows (it must not count as training steps)."""
    import time

    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    acc = nbaccel.Accelerator()
    samples = [
        {"input_ids": torch.randint(0, 100, (SEQUENCE,)), "labels": torch.tensor(i % 4)}
        for i in range(BATCHES * BATCH * acc.num_processes)
    ]
    model = nn.Sequential(nn.Embedding(100, 64), nn.Flatten(), nn.Linear(64 * SEQUENCE, 256))
    model.append(nn.ReLU())
    model.append(nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(samples, batch_size=BATCH, shuffle=True)
    evaluation = DataLoader(samples[:64], batch_size=BATCH)
    model, optimizer, loader, evaluation = acc.prepare(model, optimizer, loader, evaluation)
    started = time.perf_counter()
    for batch in loader:
        loss = nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        acc.log({"loss": loss.item()})
    looped = time.perf_counter() - started
    with torch.no_grad():
        for batch in evaluation:
            model(batch["input_ids"])
    return {"seconds": looped, "steps": len(loader)}


def recorded_breakdowns(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "events.jsonl") as lines:
        records = [json.loads(line) for line in lines]
    return [r for r in records if r.get("event") == "step_breakdown"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_phases_add_up_to_each_ranks_step_time_and_all_are_measured(
    strategy: str, runs_dir: str
) -> None:
    seen: list[StepBreakdown] = []
    run = nbaccel.launch(
        train_tokens, num_processes=2, runs_dir=runs_dir, dashboard=False, strategy=strategy
    )
    run.subscribe(lambda event: seen.append(event) if isinstance(event, StepBreakdown) else None)
    results = run.results()  # waits; raises if a rank failed
    windows = recorded_breakdowns(Path(run.run_dir))
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for window in windows:
        by_rank[window["rank"]].append(window)
    assert sorted(by_rank) == [0, 1]
    for rank, mine in by_rank.items():
        phases = {p: sum(w["phases"].get(p, 0.0) for w in mine) for p in PHASES}
        measured = sum(phases.values())
        looped = results[rank]["seconds"]
        assert abs(measured - looped) <= 0.05 * looped, (rank, measured, looped, phases)
        assert all(seconds > 0 for seconds in phases.values()), (rank, phases)
        # Evaluation iterations (no backward) are no training steps.
        assert sum(w["steps"] for w in mine) == results[rank]["steps"] == BATCHES
        assert sum(w["samples"] for w in mine) == BATCHES * BATCH
        assert sum(w["tokens"] for w in mine) == BATCHES * BATCH * SEQUENCE
        assert all(w["peak_memory"] is None for w in mine)  # CPU reports no peak per phase
    # Subscribers get the same windows as events (those after subscribing, at least).
    assert seen and all(event.steps > 0 and event.samples > 0 for event in seen)
    board = StepBoard()
    for event in seen:
        board.add(event)
    samples_per_second, tokens_per_second = board.throughput(whole_run=True)
    assert tokens_per_second == pytest.approx(samples_per_second * SEQUENCE)
    assert "samples/s" in board.summary() and "communication" in board.summary()
