"""debug_launcher, and the rank-dependent nbaccel.utils names (save, tqdm,
extract_model_from_parallel), on 2 real CPU/gloo ranks: one launch, through debug_launcher
itself, in which every rank returns what it saw."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import nbaccel
from tests.multiprocess.conftest import run_script

pytestmark = pytest.mark.timeout(240)


def utils_tour(folder: str) -> dict[str, Any]:
    import torch

    from nbaccel import Accelerator
    from nbaccel.utils import extract_model_from_parallel, save, tqdm, wait_for_everyone

    accelerator = Accelerator()
    rank = accelerator.process_index
    out: dict[str, Any] = {
        "who": (rank, accelerator.num_processes, accelerator.distributed_type.value),
        "device": accelerator.device.type,
        "mixed_precision": accelerator.mixed_precision,
    }

    shared = Path(folder)
    save({"rank": rank}, shared / f"from_rank_{rank}.bin")  # every rank calls it, one writes
    save({"rank": rank}, shared / f"each_node_{rank}.bin", save_on_each_node=True)
    wait_for_everyone()
    out["saved"] = sorted(path.name for path in shared.glob("*.bin"))

    out["bar_disabled"] = tqdm(range(2)).disable
    out["bar_everywhere_disabled"] = tqdm(range(2), main_process_only=False).disable

    model = torch.nn.Linear(3, 1)
    prepared = accelerator.prepare(model)
    out["wrapped_in"] = type(prepared).__name__
    out["extracted_is_model"] = extract_model_from_parallel(prepared) is model
    out["same_as_unwrap_model"] = extract_model_from_parallel(prepared) is (
        accelerator.unwrap_model(prepared)
    )
    return out


def test_debug_launcher_runs_cpu_processes_with_the_utils(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the run folders (runs_dir's default is relative)
    monkeypatch.setenv("NBACCEL_MIXED_PRECISION", "bf16")  # debug_launcher's "no" overrides it
    shared = tmp_path / "shared"
    shared.mkdir()
    zero = nbaccel.debug_launcher(utils_tour, args=(str(shared),))  # num_processes=2 default
    assert zero["who"] == (0, 2, "MULTI_CPU")
    assert zero["device"] == "cpu" and zero["mixed_precision"] == "no"
    # Only the main process wrote; one machine, so save_on_each_node writes once too.
    assert zero["saved"] == ["each_node_0.bin", "from_rank_0.bin"]
    assert (zero["bar_disabled"], zero["bar_everywhere_disabled"]) == (False, False)
    assert zero["wrapped_in"] == "DistributedDataParallel"
    assert zero["extracted_is_model"] and zero["same_as_unwrap_model"]


def test_the_other_rank_sees_its_bar_disabled(tmp_path: Path, runs_dir: str) -> None:
    # debug_launcher returns rank 0's value; launch() with its settings shows rank 1's.
    shared = tmp_path / "shared"
    shared.mkdir()
    run = nbaccel.launch(
        utils_tour,
        args=(str(shared),),
        num_processes=2,
        use_cpu=True,
        mixed_precision="no",
        runs_dir=runs_dir,
    )
    one = run.results(timeout=180)[1]
    assert one["who"] == (1, 2, "MULTI_CPU")
    assert (one["bar_disabled"], one["bar_everywhere_disabled"]) == (True, False)
    assert one["saved"] == ["each_node_0.bin", "from_rank_0.bin"]
    assert one["extracted_is_model"] and one["same_as_unwrap_model"]


def test_a_kernel_writes_the_basic_config_without_torch(tmp_path: Path) -> None:
    # Notebooks call write_basic_config (and import the enums and placeholders) before
    # launching: none of that may load torch into the kernel.
    code = f"""
        import sys
        from nbaccel import debug_launcher
        from nbaccel.utils import DummyOptim, LoggerType, PrecisionType, write_basic_config
        path = write_basic_config(PrecisionType.BF16, save_location={str(tmp_path / "c.yaml")!r})
        print("WROTE", path.name, LoggerType.WANDB, DummyOptim([]).lr)
        print("TORCH_MODULES", [m for m in sys.modules if m == "torch" or m.startswith("torch.")])
        """
    result = run_script(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "WROTE c.yaml wandb 0.001" in result.stdout
    assert "TORCH_MODULES []" in result.stdout
