"""``FullyShardedDataParallelPlugin(state_dict_config=FullStateDictConfig(...))`` decides
which ranks ``get_state_dict`` gives the gathered weights to, on 2 CPU processes (gloo).

Accelerate on CPU runs such a program as DDP (it ignores an FSDP plugin there), where every
rank holds the whole model: with ``rank0_only=False`` the program may use the weights on any
rank. nbaccel shards for real, so the reference is the same training unsharded in one
process, as Accelerate's DDP would end it (tolerance: the sharded sums' rounding).
"""

from __future__ import annotations

from typing import Any

import pytest

import nbaccel
from tests.multiprocess.test_sharding import blocks_model

pytestmark = pytest.mark.timeout(240)
TOLERANCE = 1e-6


def state_dict_on_each_rank(rank0_only: bool | None) -> dict[str, Any]:
    """Two SGD steps on the same batch on every rank, then ``get_state_dict`` (``None``:
    the plugin gives no state_dict_config)."""
    import torch
    from torch.distributed.fsdp import FullStateDictConfig

    config = (
        None
        if rank0_only is None
        else FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)
    )
    plugin = nbaccel.FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        state_dict_config=config,
    )
    acc = nbaccel.Accelerator(fsdp_plugin=plugin)
    model = acc.prepare(blocks_model())
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        acc.backward(model(batch).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    sharded = {type(p).__name__ for p in model.parameters()}
    return {"state": acc.get_state_dict(model), "sharded": sharded}


def launch(runs_dir: str, rank0_only: bool | None, processes: int = 2) -> dict[int, Any]:
    run = nbaccel.launch(
        state_dict_on_each_rank,
        args=(rank0_only,),
        num_processes=processes,
        runs_dir=runs_dir,
        dashboard="text",
    )
    run.wait(timeout=180)
    results: dict[int, Any] = run.results()
    return results


def test_rank0_only_false_gives_every_rank_the_whole_state_dict(runs_dir: str) -> None:
    ranks = launch(runs_dir, rank0_only=False)
    assert ranks[0]["sharded"] == ranks[1]["sharded"] == {"DTensor"}  # trained sharded
    unsharded = launch(runs_dir, rank0_only=False, processes=1)[0]["state"]
    for rank in (0, 1):
        state = ranks[rank]["state"]
        assert state.keys() == unsharded.keys()
        for name, tensor in state.items():
            assert type(tensor).__name__ == "Tensor" and str(tensor.device) == "cpu", name
            assert tensor.shape == unsharded[name].shape, name  # whole, not this rank's shard
            assert float((tensor - unsharded[name]).abs().max()) < TOLERANCE, name
    for name, tensor in ranks[0]["state"].items():
        assert bool((tensor == ranks[1]["state"][name]).all()), name  # the same gathered values


@pytest.mark.parametrize("rank0_only", [True, None], ids=["rank0_only=True", "no config"])
def test_by_default_and_with_rank0_only_rank_0_alone_gets_it(
    runs_dir: str, rank0_only: bool | None
) -> None:
    ranks = launch(runs_dir, rank0_only)
    assert ranks[1]["state"] == {}
    assert set(ranks[0]["state"]) == {
        f"{block}.inner.{kind}" for block in range(3) for kind in ("weight", "bias")
    } | {"3.weight", "3.bias"}
