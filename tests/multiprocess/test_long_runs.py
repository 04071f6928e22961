"""Runs that outlive their machine: periodic saves at an agreed step, save-and-stop on a
signal or a request, and ``resume="auto"`` continuing bit for bit, with real 2-rank runs."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.events import RunState

pytestmark = pytest.mark.timeout(300)


def train(total: int, slow_rank: int = -1, signal_at: int = -1, signum: int = 15) -> dict[str, Any]:
    """A loop written as the docs show: dropout, shuffled uneven data, accumulation, a
    schedule, numpy noise; ``slow_rank`` sleeps 2 ms a step; the last rank sends itself
    ``signum`` once ``signal_at`` optimizer steps are done."""
    import random

    import numpy as np
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    acc = nbaccel.Accelerator(gradient_accumulation_steps=2)
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(90, 8, generator=data), torch.randn(90, 1, generator=data))
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    model, optimizer, schedule, loader = acc.prepare(model, optimizer, schedule, loader)
    first = acc.completed_steps
    signalled = False
    while acc.completed_steps < total:
        for x, y in loader:
            with acc.accumulate(model):
                noise = 1e-3 * (float(np.random.rand()) + random.random())
                loss = torch.nn.functional.mse_loss(model(x), y) + noise
                acc.backward(loss)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
            if acc.sync_gradients:
                acc.log({"loss": loss.item()}, step=acc.completed_steps)
            if acc.process_index == slow_rank:
                time.sleep(0.002)
            last = acc.process_index == acc.num_processes - 1
            if last and not signalled and acc.completed_steps >= signal_at >= 0:
                signalled = True
                os.kill(os.getpid(), signum)
            if acc.completed_steps >= total:
                break
    # FSDP's parameters are shards (DTensors): gathered whole (every rank takes part).
    params = acc.unwrap_model(model).parameters()
    params = [getattr(p, "full_tensor", p.detach)().detach().clone() for p in params]
    return {
        "params": params,
        "first": first,
        "epochs": acc.completed_epochs,
        "saves": list(acc._autosave.saves),
    }


def wait_until_stepping(run: Any, timeout: float = 120) -> None:
    """Until the loop has logged a metric: from then on its ranks answer a stop."""
    deadline = time.monotonic() + timeout
    while not run.metrics:
        assert time.monotonic() < deadline, f"no step logged in {timeout} s"
        assert not run.state.done, f"the run ended first: {run.state}"
        time.sleep(0.05)


def events(run: Any, kind: str) -> list[dict[str, Any]]:
    lines = (Path(run.run_dir) / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == kind]


def same(a: list[Any], b: list[Any]) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def latest_state(root: Path) -> Path:
    return root / (root / "LATEST").read_text().strip()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_one_rank_saves_every_rank_at_one_step_and_resume_continues_exactly(
    tmp_path: Path, runs_dir: str, signum: int
) -> None:
    options = {"num_processes": 2, "dashboard": "text", "runs_dir": runs_dir}
    # Long enough for a stop to be agreed on (ranks compare notes every ~0.2 s of steps).
    reference = nbaccel.launch(train, args=(300,), **options).result(timeout=200)

    checkpoints = tmp_path / "ckpt"
    stopped = nbaccel.launch(
        train, args=(300, 1, 7, int(signum)), checkpoint_dir=str(checkpoints), **options
    )
    assert stopped.wait(200) is RunState.STOPPED
    assert stopped.exit_code == 0 and stopped.result() is None
    step = stopped.saved_step
    assert step is not None and 7 <= step < 300
    # Both ranks stopped at the same step, and exactly one checkpoint was written for it.
    assert sorted((e["rank"], e["step"]) for e in events(stopped, "stopped")) == [
        (0, step),
        (1, step),
    ]
    saved = events(stopped, "checkpoint")
    assert [(e["completed_steps"], e["stopping"]) for e in saved] == [(step, True)]
    meta = json.loads((latest_state(checkpoints) / "meta.json").read_text())
    assert meta["progress"]["completed_steps"] == step

    resumed = nbaccel.launch(
        train, args=(300,), checkpoint_dir=str(checkpoints), resume="auto", **options
    )
    value = resumed.result(timeout=200)
    assert value["first"] == step
    assert same(value["params"], reference["params"])
    assert value["epochs"] == reference["epochs"]
    # The curve goes on: the saved metrics came back first, then the new ones.
    steps = [m["step"] for m in resumed.metrics]
    assert steps == sorted(steps) and steps[0] <= 2 and steps[-1] == 300


def test_fsdp_saves_in_the_loop_at_the_agreed_step_and_resumes_exactly(
    tmp_path: Path, runs_dir: str
) -> None:
    # Sharded state saves through DCP in the training loop (not in the background).
    options = {"num_processes": 2, "dashboard": "text", "runs_dir": runs_dir, "strategy": "fsdp"}
    reference = nbaccel.launch(train, args=(200,), **options).result(timeout=240)
    checkpoints = str(tmp_path / "ckpt")
    first = nbaccel.launch(
        train, args=(200, 1, 30), checkpoint_dir=checkpoints, checkpoint_every="10 steps", **options
    )
    assert first.wait(240) is RunState.STOPPED
    saved = [e["completed_steps"] for e in events(first, "checkpoint")]
    assert saved[:3] == [10, 20, 30] and saved[-1] == first.saved_step
    assert (latest_state(Path(checkpoints)) / "sharded").is_dir()
    resumed = nbaccel.launch(
        train, args=(200,), checkpoint_dir=checkpoints, resume="auto", **options
    )
    value = resumed.result(timeout=240)
    assert value["first"] == first.saved_step
    assert same(value["params"], reference["params"])


def test_periodic_saves_land_on_the_same_step_on_ranks_of_different_speeds(
    tmp_path: Path, runs_dir: str
) -> None:
    checkpoints = tmp_path / "ckpt"
    run = nbaccel.launch(
        train,
        args=(400, 1),  # ~1 s and more: several checks of ~0.2 s each
        num_processes=2,
        dashboard="text",
        runs_dir=runs_dir,
        checkpoint_dir=str(checkpoints),
        checkpoint_every="0.05s",
    )
    results = run.results(timeout=200)
    saves = results[0]["saves"]
    assert len(saves) >= 2 and saves == sorted(saves)
    assert results[1]["saves"] == saves  # the slow rank saved at the very same steps
    published = [e["completed_steps"] for e in events(run, "checkpoint")]
    assert published == saves
    # checkpoint_keep=2: the two newest, each whole (both ranks' RNG states, its own step).
    states = sorted(p for p in checkpoints.glob("state-*"))
    assert len(states) == 2
    for state in states:
        meta = json.loads((state / "meta.json").read_text())
        assert meta["progress"]["completed_steps"] == int(state.name.split("-")[1])
        assert {f.name for f in state.glob("random_states_*.pt")} == {
            "random_states_0.pt",
            "random_states_1.pt",
        }
    assert latest_state(checkpoints).name == states[-1].name
    assert not list(checkpoints.glob(".partial-*"))


def test_run_stop_save_and_max_duration_save_and_stop_a_kernel_bound_run(
    tmp_path: Path, runs_dir: str
) -> None:
    options = {"num_processes": 2, "dashboard": "text", "runs_dir": runs_dir}
    by_hand = nbaccel.launch(train, args=(10**9, 1), checkpoint_dir=str(tmp_path / "a"), **options)
    wait_until_stepping(by_hand)
    assert by_hand.stop(save=True) is RunState.STOPPED
    step = by_hand.saved_step
    assert step is not None and step > 0
    meta = json.loads((latest_state(tmp_path / "a") / "meta.json").read_text())
    assert meta["progress"]["completed_steps"] == step

    timed = nbaccel.launch(
        train, args=(10**9,), checkpoint_dir=str(tmp_path / "b"), max_duration=2.0, **options
    )
    assert timed.wait(120) is RunState.STOPPED and timed.exit_code == 0
    assert (tmp_path / "b" / "LATEST").exists()


def test_two_ranks_saved_one_rank_resumes_at_the_same_step(tmp_path: Path, runs_dir: str) -> None:
    options = {"dashboard": "text", "runs_dir": runs_dir, "checkpoint_dir": str(tmp_path / "c")}
    two = nbaccel.launch(train, args=(300, -1, 5), num_processes=2, **options)
    assert two.wait(200) is RunState.STOPPED
    one = nbaccel.launch(train, args=(300,), num_processes=1, resume="auto", **options)
    value = one.result(timeout=200)
    assert value["first"] == two.saved_step


def test_resume_errors_come_before_any_process(tmp_path: Path, runs_dir: str) -> None:
    with pytest.raises(nbaccel.ConfigError, match="holds no complete checkpoint"):
        nbaccel.launch(train, args=(1,), resume=str(tmp_path / "nothing"), runs_dir=runs_dir)
    assert not Path(runs_dir).exists() or not list(Path(runs_dir).glob("2*"))
    fresh = nbaccel.launch(
        train,
        args=(3,),
        resume="auto",
        checkpoint_dir=str(tmp_path / "empty"),
        dashboard="text",
        runs_dir=runs_dir,
    )
    assert fresh.result(timeout=200)["first"] == 0


def test_sigterm_to_a_detached_runs_supervisor_saves_once_and_ends_stopped(
    tmp_path: Path, runs_dir: str
) -> None:
    import psutil

    run = nbaccel.launch(
        train,
        args=(10**9,),
        num_processes=2,
        detach=True,
        runs_dir=runs_dir,
        dashboard=False,
        checkpoint_dir=str(tmp_path / "d"),
    )
    supervisor = psutil.Process(run.supervisor_pid)  # type: ignore[attr-defined]
    wait_until_stepping(run)
    supervisor.send_signal(signal.SIGTERM)  # what Slurm, a spot notice or k8s would send
    assert run.wait(120) is RunState.STOPPED and run.exit_code == 0
    supervisor.wait(timeout=30)
    stops = [json.loads(line) for line in (Path(run.run_dir) / "events.jsonl").open()]
    steps = {e["step"] for e in stops if e.get("event") == "stopped"}
    assert len(steps) == 1 and (tmp_path / "d" / "LATEST").exists()
    assert nbaccel.runs(runs_dir)[0].state == "stopped"


def nap() -> None:
    time.sleep(600)


def test_save_and_stop_of_a_loop_without_steps_ends_it_at_once(runs_dir: str) -> None:
    run = nbaccel.launch(nap, num_processes=2, dashboard="text", runs_dir=runs_dir)
    deadline = time.monotonic() + 60
    while len(run.worker_pids) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    state = run.stop(save=True, timeout=60)
    # No loop to answer: SIGTERM ends the ranks as it always did, nothing was saved.
    assert state is RunState.CANCELLED and time.monotonic() - started < 30
    assert run.saved_step is None


def plain_loop(total: int, folder: str, signal_at: int = -1) -> dict[str, Any]:
    """A loop with its own DDP and torch.save, asking nbaccel.save_due() each step."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    saved: list[int] = []
    for step in range(1, total + 1):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 1 and step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        due = nbaccel.save_due()
        assert due.step == step
        if due.save:
            saved.append(step)
            if dist.get_rank() == 0:
                torch.save(model.state_dict(), Path(folder) / f"model-{step}.pt")
        if due.stop:
            break
    return {"saved": saved}


def test_a_loop_without_the_accelerator_asks_save_due_and_stops_on_a_signal(
    tmp_path: Path, runs_dir: str
) -> None:
    options = {"num_processes": 2, "dashboard": "text", "runs_dir": runs_dir}
    periodic = nbaccel.launch(
        plain_loop, args=(300, str(tmp_path)), checkpoint_every="50 steps", **options
    )
    results = periodic.results(timeout=200)
    assert results[0]["saved"] == results[1]["saved"] == [50, 100, 150, 200, 250, 300]
    assert (tmp_path / "model-300.pt").exists()

    stopped = nbaccel.launch(plain_loop, args=(10**6, str(tmp_path), 20), **options)
    assert stopped.wait(200) is RunState.STOPPED and stopped.exit_code == 0
    stops = {(e["rank"], e["step"]) for e in events(stopped, "stopped")}
    assert {rank for rank, _ in stops} == {0, 1} and len({s for _, s in stops}) == 1
    assert stopped.saved_step is not None and stopped.saved_step >= 20


def compiled_train(total: int, signal_at: int = -1) -> dict[str, int]:
    """A torch.compile'd model under the Accelerator; the fx graph cache's hits and misses."""
    import torch
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    acc = nbaccel.Accelerator()
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8))
    model, optimizer, loader = acc.prepare(
        model, optimizer, torch.utils.data.DataLoader(data, batch_size=8)
    )
    while acc.completed_steps < total:
        for (x,) in loader:
            acc.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            if acc.completed_steps == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if acc.completed_steps >= total:
                break
    return {
        "hits": counters["inductor"]["fxgraph_cache_hit"],
        "misses": counters["inductor"]["fxgraph_cache_miss"],
    }


@pytest.mark.slow
def test_a_resume_on_a_fresh_cache_folder_compiles_from_the_checkpoints_artifacts(
    tmp_path: Path, runs_dir: str
) -> None:
    options = {"num_processes": 1, "dashboard": "text", "runs_dir": runs_dir}
    checkpoints = str(tmp_path / "ckpt")
    first = nbaccel.launch(
        compiled_train,
        args=(10**6, 3),
        checkpoint_dir=checkpoints,
        dynamo_cache_dir=str(tmp_path / "machine-a"),
        **options,
    )
    assert first.wait(280) is RunState.STOPPED
    assert (latest_state(Path(checkpoints)) / "compile" / "rank0.bin").is_file()
    # The machine is gone: a new, empty cache folder; the artifacts come with the checkpoint.
    second = nbaccel.launch(
        compiled_train,
        args=(first.saved_step + 2,),
        checkpoint_dir=checkpoints,
        resume="auto",
        dynamo_cache_dir=str(tmp_path / "machine-b"),
        **options,
    )
    counts = second.result(timeout=280)
    assert counts["hits"] > 0 and counts["misses"] == 0
    assert "skipped" not in second.logs(0)
