"""PartialState, nbaccel.utils and nbaccel.logging on 2 real CPU/gloo ranks launched by nbaccel.

One launch runs the whole tour (each launch costs a second or two); every rank returns what it
saw, and ordering across ranks is read from a file both ranks append to, where only the
barriers under test decide the order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import nbaccel
from tests.multiprocess.conftest import run_script

pytestmark = pytest.mark.timeout(240)


def process_level_tour(folder: str) -> dict[str, Any]:
    import logging

    import torch

    from nbaccel import AcceleratorState, PartialState, find_executable_batch_size
    from nbaccel.logging import get_logger
    from nbaccel.utils import (
        broadcast,
        broadcast_object_list,
        gather,
        gather_object,
        reduce,
        set_seed,
        synchronize_rng_states,
        wait_for_everyone,
    )

    shared = Path(folder)
    out: dict[str, Any] = {}
    state = PartialState()
    rank = state.process_index
    out["who"] = (rank, state.num_processes, state.distributed_type.value, state.backend)
    out["last"] = state.is_last_process
    out["accelerator_state"] = AcceleratorState().mixed_precision

    with state.split_between_processes(list(range(5)), apply_padding=True) as mine:
        out["split_list"] = mine
    with state.split_between_processes(torch.arange(5), apply_padding=True) as rows:
        out["gathered_split"] = gather(rows).tolist()
    with state.split_between_processes({"a": [1, 2, 3]}) as part:
        out["split_dict"] = part

    ran: list[str] = []
    state.on_process(1)(lambda: ran.append("on_process(1)"))()
    state.on_process(process_index=0)(lambda: ran.append("process_index=0"))()
    state.on_last_process(lambda: ran.append("last"))()
    state.on_main_process(lambda: ran.append("main"))()
    out["ran"] = ran

    order = shared / "first.txt"
    # Rank 1 may only open the file once rank 0 has left the block.
    with state.main_process_first(), order.open("a") as file:
        file.write(f"{rank} in\n")
        file.write(f"{rank} out\n")
    wait_for_everyone()
    out["main_first_order"] = order.read_text().splitlines()

    out["gather_object"] = gather_object([rank])
    out["gather_object_dicts"] = gather_object({"rank": rank})
    out["broadcast_object_list"] = broadcast_object_list([rank, f"from {rank}"], from_process=1)
    out["broadcast"] = broadcast(torch.tensor([float(rank)]), from_process=1).tolist()
    out["reduce"] = [reduce(torch.tensor([rank + 1.0]), kind).item() for kind in ("mean", "max")]

    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if rank == 1 and batch_size > 50:  # only rank 1 runs out of memory
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ...")
        return batch_size

    out["batch_size"] = train()
    out["tried"] = tried

    set_seed(0, device_specific=True)
    out["device_specific_draw"] = torch.rand(1).item()
    synchronize_rng_states(["torch"])
    out["synchronized_draw"] = torch.rand(1).item()

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    plain = logging.getLogger("tour")
    plain.setLevel(logging.INFO)
    plain.addHandler(Keep())
    plain.addHandler(logging.FileHandler(shared / "in_order.log"))
    logger = get_logger("tour")
    logger.info("main only")
    logger.info("everyone", main_process_only=False)
    logger.info("in turn", in_order=True)
    wait_for_everyone()
    out["logged"] = messages
    out["in_order_file"] = [
        line for line in (shared / "in_order.log").read_text().splitlines() if "in turn" in line
    ]
    return out


def test_process_level_api_on_two_ranks(runs_dir: str, tmp_path: Path) -> None:
    run = nbaccel.launch(
        process_level_tour,
        args=(str(tmp_path),),
        num_processes=2,
        mixed_precision="bf16",
        runs_dir=runs_dir,
    )
    zero, one = run.results(timeout=180).values()
    assert zero["who"] == (0, 2, "MULTI_CPU", "gloo") and one["who"] == (1, 2, "MULTI_CPU", "gloo")
    assert (zero["last"], one["last"]) == (False, True)
    assert zero["accelerator_state"] == one["accelerator_state"] == "bf16"

    # split: rank 0 takes the extra item; padding repeats the last one
    assert (zero["split_list"], one["split_list"]) == ([0, 1, 2], [3, 4, 4])
    assert zero["gathered_split"] == one["gathered_split"] == [0, 1, 2, 3, 4, 4]
    assert (zero["split_dict"], one["split_dict"]) == ({"a": [1, 2]}, {"a": [3]})

    assert zero["ran"] == ["process_index=0", "main"]
    assert one["ran"] == ["on_process(1)", "last"]
    assert zero["main_first_order"] == ["0 in", "0 out", "1 in", "1 out"]

    for seen in (zero, one):
        assert seen["gather_object"] == [0, 1]
        assert seen["gather_object_dicts"] == [{"rank": 0}, {"rank": 1}]
        assert seen["broadcast_object_list"] == [1, "from 1"]
        assert seen["broadcast"] == [1.0]
        assert seen["reduce"] == [1.5, 2.0]
        # Every rank settles on the size that fitted everywhere, trying the same sizes.
        assert seen["batch_size"] == 46
        assert seen["tried"] == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46]

    assert zero["device_specific_draw"] != one["device_specific_draw"]
    assert zero["synchronized_draw"] == one["synchronized_draw"]

    assert zero["logged"] == ["[RANK 0] main only", "[RANK 0] everyone", "[RANK 0] in turn"]
    assert one["logged"] == ["[RANK 1] everyone", "[RANK 1] in turn"]
    assert zero["in_order_file"] == ["[RANK 0] in turn", "[RANK 1] in turn"]


def test_the_facades_keep_torch_out_of_a_kernel(tmp_path: Path) -> None:
    # A notebook kernel may log and ask for packages before launching: no torch for that.
    code = """
        import sys
        import nbaccel.logging, nbaccel.utils
        from nbaccel.utils import is_wandb_available, is_torch_xla_available
        nbaccel.logging.get_logger("kernel").warning("logged", in_order=True)
        assert isinstance(is_wandb_available(), bool) and isinstance(is_torch_xla_available(), bool)
        print("TORCH_MODULES", [m for m in sys.modules if m == "torch" or m.startswith("torch.")])
        """
    result = run_script(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "TORCH_MODULES []" in result.stdout
    assert "[RANK 0] logged" in result.stderr
