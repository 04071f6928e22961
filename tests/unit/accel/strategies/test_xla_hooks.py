"""The XLA parts of the Accelerator that need several replicas, with a fake torch_xla.

torch_xla's CPU device cannot run cross-replica collectives (pytorch/xla#9089), so the
multi-replica logic is checked here against fakes: the optimizer's gradient all-reduce and
graph cut, and the collectives of ``XlaRuntime`` as rank 0 of 2 (the fake rank 1 holds each
value + 10). The real device runs in tests/xla.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nbaccel.accel.optim import AcceleratedOptimizer, GradientState
from nbaccel.accel.state import DistributedType, ProcessState


class FakeXla:
    """Just enough of torch_xla for ``XlaDataParallel`` with 2 data-parallel replicas."""

    REDUCE_SUM = "sum"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def sync(self) -> None:
        self.calls.append("sync")

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self.calls.append("all_gather")
        return torch.cat([tensor, tensor + 10], dim=dim)

    def all_reduce(self, op: str, tensor: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.calls.append(f"all_reduce {op} {scale}")
        return (tensor + tensor + 10) * scale

    def rendezvous(self, tag: str, payload: bytes = b"") -> list[bytes]:
        self.calls.append(f"rendezvous {tag}")
        other = pickle.dumps(["from rank 1"]) if payload else b""
        return [payload, other]

    def reduce_gradients(self, optimizer: Any) -> None:
        self.calls.append("reduce_gradients")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeXla:
    xla = FakeXla()
    root = types.ModuleType("torch_xla")
    core = types.ModuleType("torch_xla.core")
    runtime = types.ModuleType("torch_xla.runtime")
    root.sync = xla.sync  # type: ignore[attr-defined]
    runtime.is_spmd = lambda: False  # type: ignore[attr-defined]
    root.core, root.runtime, core.xla_model = core, runtime, xla  # type: ignore[attr-defined]
    modules = {"torch_xla": root, "torch_xla.core": core, "torch_xla.runtime": runtime}
    for name, module in {**modules, "torch_xla.core.xla_model": xla}.items():
        monkeypatch.setitem(sys.modules, name, module)
    return xla


def runtime(rank: int = 0) -> Any:
    from nbaccel.accel.strategies.xla import XlaDataParallel
    from nbaccel.config.schema import Config

    state = ProcessState(rank, rank, 2, 2, torch.device("cpu"), DistributedType.XLA, "")
    return XlaDataParallel(state, Config())


def test_gather_and_reduce_use_xla_collectives_between_graph_cuts(fake: FakeXla) -> None:
    xla = runtime()
    gathered = xla.gather({"a": torch.tensor([1.0, 2.0]), "n": torch.tensor(3.0)})
    assert gathered["a"].tolist() == [1.0, 2.0, 11.0, 12.0]
    assert gathered["n"].tolist() == [3.0, 13.0]  # 0-d tensors gather as 1-d
    assert fake.calls == ["sync", "all_gather", "all_gather", "sync"]
    fake.calls.clear()
    assert xla.reduce(torch.tensor([2.0]), "mean").tolist() == [7.0]  # (2 + 12) / 2
    assert fake.calls == ["sync", "all_reduce sum 0.5", "sync"]
    assert xla.reduce(torch.tensor([2.0]), "sum", scale=2.0).tolist() == [28.0]


def test_objects_padding_and_barrier_go_through_rendezvous(fake: FakeXla) -> None:
    xla = runtime()
    assert xla.share_object({"seed": 7}) == {"seed": 7}  # rank 0's, on every rank
    assert xla.gather_object(["from rank 0"]) == ["from rank 0", "from rank 1"]
    padded = xla.pad_across_processes(torch.ones(2), 0, -1, False)
    assert padded.tolist() == [1.0, 1.0] + [-1.0] * 10  # rank 1's size is 2 + 10
    fake.calls.clear()
    xla.barrier()
    assert fake.calls == ["sync", "rendezvous nbaccel.wait_for_everyone"]


def test_optimizer_all_reduces_once_per_real_step_and_cuts_the_graph(fake: FakeXla) -> None:
    xla = runtime()
    hooks = xla.optimizer_hooks()
    assert hooks["reduce"] == fake.reduce_gradients
    model = torch.nn.Linear(2, 1)
    gradients = GradientState(accumulation_steps=2)
    opt = AcceleratedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), gradients, None, **hooks
    )
    model(torch.ones(1, 2)).sum().backward()
    gradients.sync_gradients = False  # an accumulation micro-step: nothing crosses replicas
    opt.step()
    assert fake.calls == []
    gradients.sync_gradients = True
    opt.reduce_gradients()  # clipping reduces first ...
    opt.step()  # ... and the step does not reduce again
    assert fake.calls == ["reduce_gradients", "sync"]
    fake.calls.clear()
    with xla_loader_running(xla):
        opt.step()  # torch_xla's loader cuts the graph at the next batch: no second cut
    assert fake.calls == ["reduce_gradients"]


@contextlib.contextmanager
def xla_loader_running(xla: Any) -> Iterator[None]:
    xla._loaders_syncing += 1
    try:
        yield
    finally:
        xla._loaders_syncing -= 1
