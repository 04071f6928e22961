"""After training, on real 2-rank CPU/gloo runs: the workers kept (``keep_workers``), the
model's whole state dict into the kernel, predictions in the dataset's order, more training
on the same group, and every way the kept workers end leaving nothing behind."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.events import RunState
from tests.multiprocess.conftest import run_script
from tests.multiprocess.test_interactive_workers import gone, wait_for

pytestmark = pytest.mark.timeout(300)


def train(steps: int = 5, strategy_note: str = "") -> dict[str, Any]:
    """A small model trained with the Accelerator; returns the rank, its pid and a digest of
    its weights (every rank's are the same under DDP)."""
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        loss = model(torch.randn(8, 16, generator=generator).to(acc.device)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    whole = acc.get_state_dict(model)  # rank 0 has every weight under any strategy
    digest = hashlib.sha256(b"".join(whole[k].cpu().numpy().tobytes() for k in sorted(whole)))
    return {"rank": dist.get_rank(), "pid": os.getpid(), "weights": digest.hexdigest()}


def build_model() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def digest_of(state: dict[str, Any]) -> str:
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


@pytest.fixture
def kept(runs_dir: str) -> Iterator[tuple[Any, nbaccel.Workers]]:
    value = nbaccel.notebook_launcher(
        train, num_processes=2, use_cpu=True, keep_workers=True, runs_dir=runs_dir
    )
    workers = nbaccel.last_workers()
    assert workers is not None
    try:
        yield value, workers
    finally:
        workers.close()


def test_the_ranks_that_trained_serve_the_next_calls_with_what_they_held(
    kept: tuple[Any, nbaccel.Workers],
) -> None:
    value, workers = kept
    assert value["rank"] == 0
    # The same processes: the pid the function saw on rank 0 is the group's rank 0.
    assert workers.pids[0] == value["pid"]
    assert workers.pull("result")[1]["rank"] == 1  # each rank's own value, as `result`

    def evaluate() -> tuple[int, float]:
        import torch
        import torch.distributed as dist

        from nbaccel.context import active_session

        model = active_session().accelerator._prepared.models[0]  # prepared in train()
        total = torch.tensor([model(torch.ones(1, 16)).sum().item()])
        dist.all_reduce(total)  # the process group is there too
        return dist.get_rank(), float(total)

    results = workers.run(evaluate)
    assert results[0][1] == results[1][1]  # one model, all-reduced over the same group


def test_the_weights_reach_the_kernel_through_shared_memory_and_give_rank_0s_outputs(
    kept: tuple[Any, nbaccel.Workers],
) -> None:
    import torch

    value, workers = kept
    state = workers.state_dict()
    assert digest_of(state) == value["weights"]  # rank 0's weights, bit for bit
    # The tensors view the segment rank 0 wrote: mapped here, not unpickled copies.
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert "nbaccel-state" in maps
    model = build_model()
    report = nbaccel.load_into(model, state)
    assert not report.missing_keys and not report.unexpected_keys
    probe = torch.linspace(-1, 1, 32).reshape(2, 16)

    def outputs(probe: Any) -> Any:
        import torch

        from nbaccel.context import active_session

        model = active_session().accelerator._prepared.models[0]
        with torch.no_grad():
            return model(probe)

    assert torch.equal(model(probe).detach(), workers.run(outputs, probe)[0])


def test_map_gives_one_process_outputs_in_the_dataset_order_with_an_uneven_last_batch(
    kept: tuple[Any, nbaccel.Workers],
) -> None:
    import numpy
    import torch

    _, workers = kept
    data = torch.randn(1001, 16)  # 16 batches of 64, the last one short; 2 ranks
    doubled = workers.map(lambda batch: batch * 2, data, batch_size=64)
    assert torch.equal(doubled, data * 2)  # element for element, padding dropped
    nbaccel.load_into(model := build_model(), workers.state_dict())
    with torch.no_grad():
        alone = torch.cat([model(data[i : i + 64]) for i in range(0, 1001, 64)])
    workers.push(net=None)
    workers.run_cell(
        "from nbaccel.context import active_session\n"
        "net = active_session().accelerator._prepared.models[0]",
        "<cell>",
    )
    predicted = workers.map("net", data, batch_size=64)  # a name in the ranks' namespace
    assert predicted.shape == (1001, 3)
    torch.testing.assert_close(predicted, alone, rtol=0, atol=1e-6)
    # Arrays, lists and dicts of them keep their kind and their order.
    rows = numpy.arange(10, dtype="f4").reshape(10, 1)
    out = workers.map(lambda b: {"x": b.numpy(), "ids": b[:, 0].int().tolist()}, rows, 3)
    assert out["ids"] == list(range(10))
    assert numpy.array_equal(out["x"], rows)


def test_release_ends_the_processes_and_every_later_call_says_so(runs_dir: str) -> None:
    run = nbaccel.launch(
        train, num_processes=2, use_cpu=True, keep_workers=True, runs_dir=runs_dir, dashboard="text"
    )
    workers = run.workers  # waits for the function, as run.result() does
    assert run.state is RunState.SUCCEEDED and run.result()["rank"] == 0
    pids = workers.pids
    assert not run.processes_ended and not gone(pids)
    seen: list[bool] = []  # what the kept panel watches: each call, and the end
    workers.watch(lambda group: seen.append(group.alive))
    workers.run(os.getpid)
    workers.close()
    assert seen == [True, False]
    wait_for(lambda: gone(pids), 10, "the kept workers to end")
    assert run.processes_ended and run.kept_error is None
    assert run.state is RunState.SUCCEEDED  # the run's outcome is its training's
    with pytest.raises(nbaccel.WorkersEnded, match=r"workers\.close\(\)"):
        workers.run(os.getpid)


def test_a_kept_rank_that_dies_ends_the_group_naming_it(runs_dir: str) -> None:
    nbaccel.notebook_launcher(
        train, num_processes=2, use_cpu=True, keep_workers=True, runs_dir=runs_dir
    )
    workers = nbaccel.last_workers()
    assert workers is not None
    pids = workers.pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(nbaccel.WorkersEnded, match=r"rank 1.*SIGKILL"):
        workers.run(os.getpid)
    wait_for(lambda: gone(pids), 15, "rank 0 to be ended too")


def test_the_next_keep_workers_launch_releases_the_kept_group_first(runs_dir: str) -> None:
    options = {"num_processes": 2, "use_cpu": True, "keep_workers": True, "runs_dir": runs_dir}
    nbaccel.notebook_launcher(train, **options)
    first = nbaccel.last_workers()
    assert first is not None
    first_pids = first.pids
    nbaccel.notebook_launcher(train, **options)  # the training cell, run again
    second = nbaccel.last_workers()
    assert second is not None and second is not first
    try:
        wait_for(lambda: gone(first_pids), 10, "the first kept group to end")
        assert not first.alive
        assert second.run(lambda: 3) == {0: 3, 1: 3}
    finally:
        second.close()


def test_a_failed_run_keeps_nothing_and_leaves_nothing(runs_dir: str) -> None:
    def fails() -> None:
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("rank 1 broke")

    run = nbaccel.launch(
        fails, num_processes=2, use_cpu=True, keep_workers=True, runs_dir=runs_dir, dashboard="text"
    )
    assert run.wait(60) is RunState.FAILED
    with pytest.raises(nbaccel.WorkersEnded, match="ended failed"):
        run.workers  # noqa: B018
    assert run.processes_ended


def test_workers_launch_trains_on_the_group_keeps_its_value_and_stops_on_request(
    kept: tuple[Any, nbaccel.Workers],
) -> None:
    _, workers = kept

    def train_more(steps: int) -> int:

        for step in range(steps):
            nbaccel.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
            time.sleep(0.005)
        return steps

    handle = workers.launch(train_more, 20)
    assert handle.result(60) == 20
    assert workers.pull("result") == {0: 20, 1: 20}
    handle = workers.launch(train_more, 10**9)
    with pytest.raises(RuntimeError, match="running another call"):
        workers.run(os.getpid)  # one call at a time
    wait_for(lambda: "train_more" in workers.stacks()[0], 30, "the loop to run")
    workers._last_run.signal_workers(signal.SIGINT)  # what the dashboard's Stop sends
    assert handle.wait(30) is RunState.CANCELLED
    with pytest.raises(nbaccel.RunCancelled):
        handle.result()
    assert workers.pull("result") == {0: 20, 1: 20}  # the stopped call set nothing
    assert workers.run(lambda: 1) == {0: 1, 1: 1}  # and the group goes on


def test_fsdp2_weights_are_gathered_whole_into_the_kernel(runs_dir: str) -> None:
    value = nbaccel.notebook_launcher(
        train,
        num_processes=2,
        use_cpu=True,
        keep_workers=True,
        strategy="fsdp",
        runs_dir=runs_dir,
    )
    workers = nbaccel.last_workers()
    assert workers is not None
    try:

        def shard_rows() -> int:
            from nbaccel.context import active_session

            model = active_session().accelerator._prepared.models[0]
            return int(model.state_dict()["0.weight"].to_local().shape[0])

        assert workers.run(shard_rows) == {0: 32, 1: 32}  # sharded on the ranks
        workers.run(count_gathers)
        state = workers.state_dict()
        assert tuple(state["0.weight"].shape) == (64, 16)  # whole in the kernel
        assert digest_of(state) == value["weights"]  # what get_state_dict gathers, exactly
        # Each rank wrote its own rows (2.weight's 3 rows: 2 on rank 0, 1 on rank 1): no
        # weight went through a collective.
        assert workers.run(gathers_counted) == {0: 0, 1: 0}
        # Where a rank cannot open rank 0's segment (another machine), every entry is
        # gathered instead, with the same result.
        workers.run(segment_unreachable_on_rank_1)
        again = workers.state_dict()
        assert digest_of(again) == value["weights"]
        assert workers.run(gathers_counted) == {0: 4, 1: 4}  # 2 weights and 2 biases
    finally:
        workers.close()


@pytest.mark.parametrize(
    "options",
    [{"shard_optimizer_state": True}, {"strategy": "fsdp", "fsdp_cpu_offload": True}],
    ids=["zero1", "fsdp2-cpu-offload"],
)
def test_other_strategies_give_the_same_whole_weights(
    runs_dir: str, options: dict[str, Any]
) -> None:
    # ZeRO-1 shards only the optimizer: the weights are whole on every rank. FSDP2 with its
    # parameters offloaded keeps its shards on the CPU: each rank writes them as they are.
    value = nbaccel.notebook_launcher(
        train, num_processes=2, use_cpu=True, keep_workers=True, runs_dir=runs_dir, **options
    )
    workers = nbaccel.last_workers()
    assert workers is not None
    try:
        workers.run(count_gathers)
        state = workers.state_dict()
        assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert digest_of(state) == value["weights"]
        assert workers.run(gathers_counted) == {0: 0, 1: 0}
    finally:
        workers.close()


def test_a_failed_state_dict_call_leaves_the_next_one_as_the_first(runs_dir: str) -> None:
    # FSDP2, each rank writing its rows: rank 1 fails while writing. Every rank hears of it
    # (no rank left waiting in a collective), the call raises naming rank 1, and the next
    # calls give the same weights as an unbroken one; a bad name fails before any collective.
    value = nbaccel.notebook_launcher(
        train, num_processes=2, use_cpu=True, keep_workers=True, strategy="fsdp",
        runs_dir=runs_dir,
    )  # fmt: skip
    workers = nbaccel.last_workers()
    assert workers is not None
    try:
        workers.run(rank_1_cannot_write)
        with pytest.raises(Exception, match="disk gone on rank 1"):
            workers.state_dict()
        workers.run(rank_1_writes_again)
        with pytest.raises(Exception, match="no_such_model"):
            workers.state_dict("no_such_model")
        for _ in range(2):
            assert digest_of(workers.state_dict()) == value["weights"]
    finally:
        workers.close()


def rank_1_cannot_write() -> None:
    import torch.distributed as dist

    from nbaccel.launcher.interactive import state_export

    original = state_export._copy
    globals()["original_copy"] = original

    def failing(*args: Any) -> None:
        raise OSError("disk gone on rank 1")

    if dist.get_rank() == 1:
        state_export._copy = failing  # type: ignore[assignment]


def rank_1_writes_again() -> None:
    from nbaccel.launcher.interactive import state_export

    state_export._copy = globals()["original_copy"]  # type: ignore[assignment]


def count_gathers() -> None:
    """On a rank: count DTensor.full_tensor calls from now on (``gathers_counted``)."""
    from torch.distributed.tensor import DTensor

    original = DTensor.full_tensor
    calls = [0]

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    DTensor.full_tensor = counted  # type: ignore[method-assign]
    globals()["gather_calls"] = calls


def gathers_counted() -> int:
    calls = globals()["gather_calls"]
    count, calls[0] = calls[0], 0
    return int(count)


def segment_unreachable_on_rank_1() -> None:
    import torch.distributed as dist

    from nbaccel.launcher.interactive import state_export

    if dist.get_rank() == 1:
        state_export._open_segment = lambda pid, fd, token: -1  # type: ignore[assignment]


def test_gather_for_metrics_keeps_the_dataset_order_inside_a_launch(runs_dir: str) -> None:
    def evaluate() -> list[int]:
        import torch
        from torch.utils.data import DataLoader

        from nbaccel import Accelerator

        acc = Accelerator()
        loader = acc.prepare(DataLoader(torch.arange(101), batch_size=8))
        seen: list[int] = []
        for batch in loader:
            seen += acc.gather_for_metrics(batch).tolist()
        return seen

    result = nbaccel.notebook_launcher(evaluate, num_processes=2, use_cpu=True, runs_dir=runs_dir)
    assert result == list(range(101))


def test_the_kernel_stays_free_of_torch_with_kept_workers(tmp_path: Path) -> None:
    done = run_script(
        """
        import sys, nbaccel

        def train():
            import os
            return os.getpid()

        pid = nbaccel.notebook_launcher(train, num_processes=2, use_cpu=True,
                                        keep_workers=True, runs_dir="runs")
        workers = nbaccel.last_workers()
        assert workers.pull("result")[0] == pid
        assert workers.run(lambda: 2) == {0: 2, 1: 2}
        workers.close()
        assert "torch" not in sys.modules, "the kernel imported torch"
        print("ok")
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_a_returned_ddp_model_reaches_the_kernel_unwrapped_and_stays_wrapped_on_the_ranks(
    runs_dir: str,
) -> None:
    def train_and_return_model() -> Any:
        import torch

        from nbaccel import Accelerator

        accelerator = Accelerator()
        model = accelerator.prepare(torch.nn.Linear(4, 1))
        return model  # DistributedDataParallel on 2 ranks

    model = nbaccel.notebook_launcher(
        train_and_return_model, num_processes=2, use_cpu=True, keep_workers=True, runs_dir=runs_dir
    )
    workers = nbaccel.last_workers()
    assert workers is not None
    try:
        assert type(model).__name__ == "Linear"  # the wrapper's process group stays on the ranks
        kinds = workers.run_cell("type(result).__name__, type(accelerator).__name__", "<c>")
        assert kinds == {rank: "('DistributedDataParallel', 'Accelerator')" for rank in (0, 1)}
    finally:
        workers.close()


def test_tied_weights_arrive_once_as_one_tensor_under_both_keys(runs_dir: str) -> None:
    def train_tied() -> None:
        import torch

        from nbaccel import Accelerator

        class Tied(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Embedding(300, 64)
                self.out = torch.nn.Linear(64, 300, bias=False)
                self.out.weight = self.embed.weight  # as language models tie them

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.out(self.embed(x))

        Accelerator().prepare(Tied())

    nbaccel.notebook_launcher(
        train_tied, num_processes=2, use_cpu=True, keep_workers=True, runs_dir=runs_dir
    )
    workers = nbaccel.last_workers()
    assert workers is not None
    try:
        state = workers.state_dict()
        assert state["embed.weight"] is state["out.weight"]
        segment = [line for line in Path("/proc/self/maps").read_text().splitlines()]
        assert any("nbaccel-state" in line for line in segment)
    finally:
        workers.close()
