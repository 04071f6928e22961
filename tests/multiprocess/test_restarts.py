"""Elastic restarts on one machine, for real (issue 15, point 4): ``max_restarts=1`` runs the
workers under torch elastic, which restarts every worker after rank 1 is SIGKILLed once;
a function that resumes with ``load_state`` from its latest checkpoint finishes with the
parameters of a run that was never interrupted. Restarts used up, and a stop during a
restartable run, end everything as without restarts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import nbaccel
from nbaccel.events import Event, RunRestarted
from nbaccel.launcher.printer import TextPrinter

pytestmark = pytest.mark.timeout(300)

STEPS, SAVE_EVERY, KILL_AT = 24, 5, 12  # rank 1 dies 2 steps after the step-10 checkpoint
RUN_TIMEOUT_S = 180.0
GONE_WITHIN_S = 25.0  # issue 15's goal is 5 s


def train_with_checkpoints(folder: str, kill_at: int | None) -> dict[str, Any]:
    """A few dozen DDP steps on random data; ``save_state`` every few steps, and on start
    ``load_state`` from the newest checkpoint when there is one. ``kill_at``: rank 1
    SIGKILLs itself after that step, in the first attempt only."""
    import torch

    from nbaccel import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    # Momentum: the optimizer's state must come back too, not only the weights.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    saved = sorted(Path(folder).glob("step-*"))
    step = 0
    if saved:
        accelerator.load_state(saved[-1])
        step = int(saved[-1].name.split("-")[1])
    resumed_from = step
    rank = accelerator.process_index
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "none")
    while step < STEPS:
        # The data depends on the step and rank only, not on the RNG's state: the resumed
        # run sees what the uninterrupted one saw (the RNG itself is restored as well).
        batch = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=batch)
        y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(16, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % SAVE_EVERY == 0:
            accelerator.save_state(f"{folder}/step-{step:04d}")
        if step == kill_at and rank == 1 and attempt == "0":
            print(f"rank 1 dies after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    weights = accelerator.unwrap_model(model).state_dict()
    return {
        "weights": {name: tensor.detach().clone() for name, tensor in weights.items()},
        "attempt": attempt,
        "resumed_from": resumed_from,
    }


def launch(function: Any, *args: Any, tmp_path: Path, **settings: Any) -> nbaccel.Run:
    return nbaccel.launch(
        function,
        args=args,
        num_processes=2,
        use_cpu=True,
        dashboard=False,
        runs_dir=str(tmp_path / "runs"),
        **settings,
    )


def test_a_rank_killed_once_is_restarted_and_resumes_to_the_uninterrupted_parameters(
    tmp_path: Path,
) -> None:
    plain = launch(train_with_checkpoints, str(tmp_path / "plain"), None, tmp_path=tmp_path)
    assert plain.wait(RUN_TIMEOUT_S) is nbaccel.RunState.SUCCEEDED, plain.error
    expected = plain.result()
    assert expected["attempt"] == "none"  # the helper's workers: no elastic, no restart

    seen: list[Event] = []
    text = io.StringIO()
    folder = tmp_path / "restarted"
    with contextlib.redirect_stdout(text):  # the text display prints to stdout
        run = launch(
            train_with_checkpoints, str(folder), KILL_AT, tmp_path=tmp_path, max_restarts=1
        )
        run.subscribe(seen.append)
        run.subscribe(TextPrinter(text, None, announce_end=False))
        state = run.wait(RUN_TIMEOUT_S)
    assert state is nbaccel.RunState.SUCCEEDED, run.error
    results = run.results()
    for rank, value in results.items():
        assert value["attempt"] == "1", rank  # every rank's value is the second attempt's
        assert value["resumed_from"] == 10  # the newest checkpoint before rank 1 died
        # Exactly equal: on CPU the same steps on the same data, reduced by gloo in the same
        # order from the same restored state (weights, momentum, RNG), give the same bits.
        # A tolerance would hide a resumed run that skipped or repeated a step.
        assert value["weights"].keys() == expected["weights"].keys()
        for name, tensor in value["weights"].items():
            assert tensor.equal(expected["weights"][name]), (rank, name)
    restarts = [e for e in seen if isinstance(e, RunRestarted)]
    if restarts:  # subscribed after the start: seen unless the events came before that
        [restart] = restarts
        assert (restart.attempt, restart.rank, restart.reason) == (1, 1, "killed by SIGKILL")
    records = [json.loads(line) for line in (run.run_dir / "events.jsonl").open()]
    restarted = [r for r in records if r["event"] == "restarted"]
    assert [(r["attempt"], r["rank"], r["reason"]) for r in restarted] == [
        (1, 1, "killed by SIGKILL")
    ]
    line = "nbaccel: rank 1 failed (killed by SIGKILL); restarting the workers (attempt 2 of 2)"
    assert text.getvalue().count(line) >= 1
    assert "rank 1 dies after step 12" in run.logs(1)  # the rank's log spans both attempts


class BadShardError(Exception):
    pass


def always_fails() -> None:
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 1:
        raise BadShardError(
            f"shard 3 is corrupt (attempt {os.environ['TORCHELASTIC_RESTART_COUNT']})"
        )
    dist.barrier()


def test_a_rank_that_always_fails_uses_up_the_restarts_and_ends_the_run(
    tmp_path: Path,
) -> None:
    with pytest.raises(BadShardError) as caught:
        nbaccel.notebook_launcher(
            always_fails,
            num_processes=2,
            max_restarts=1,
            use_cpu=True,
            runs_dir=str(tmp_path / "runs"),
        )
    assert str(caught.value) == (
        "[rank 1 in attempt 2 of 2, after 1 restart] shard 3 is corrupt (attempt 1)"
    )
    [run_dir] = [p.parent for p in (tmp_path / "runs").glob("*/config.json")]
    records = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    assert [r["attempt"] for r in records if r["event"] == "restarted"] == [1]
    assert records[-1] == {**records[-1], "event": "ended", "state": "failed"}


def sleeps() -> None:
    print("ready", flush=True)
    time.sleep(600)


def test_stop_ends_a_restartable_run_at_once(tmp_path: Path) -> None:
    run = launch(sleeps, tmp_path=tmp_path, max_restarts=3, log_ranks="all")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while sum("ready" in run.logs(r) for r in (0, 1)) < 2:
        assert not run.state.done, run.error
        assert time.monotonic() < deadline, "the ranks did not start"
        with contextlib.suppress(TimeoutError):
            run.wait(0.1)  # returns early if the run ends
    workers = [psutil.Process(pid) for pid in run.worker_pids.values()]
    agent = workers[0].parent()
    assert agent is not None
    processes = [*workers, agent]
    assert run.stop(timeout=GONE_WITHIN_S) is nbaccel.RunState.CANCELLED
    _, alive = psutil.wait_procs(processes, timeout=GONE_WITHIN_S)
    assert not alive, f"left running after stop: {alive}"
    records = [json.loads(line) for line in (run.run_dir / "events.jsonl").open()]
    assert not [r for r in records if r["event"] == "restarted"]  # a stop is no failure
