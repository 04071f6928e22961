"""The Accelerator without nbaccel's launcher (torchrun, a plain script), and torch.compile."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import nbaccel

SCRIPT = textwrap.dedent(
    """
    import atexit
    import torch
    import torch.distributed as dist
    import nbaccel

    # Registered before the Accelerator's own handler, so it runs after it (LIFO).
    atexit.register(lambda: print(f"group alive at exit: {dist.is_initialized()}", flush=True))

    acc = nbaccel.Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.ones(2, 3)).sum())
            optimizer.step()
            optimizer.zero_grad()
    total = acc.reduce(torch.tensor([1.0]))
    print(f"rank={acc.process_index} world={acc.num_processes} type={acc.distributed_type.value}"
          f" mp={acc.mixed_precision} sum={total.item():.0f} model={type(model).__name__}")
    """
)


def run(args: list[str], tmp_path: Path, env: dict[str, str]) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, *args, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(240)
def test_under_torchrun_it_uses_the_torch_distributed_environment(tmp_path: Path) -> None:
    out = run(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        tmp_path,
        {"ACCELERATE_MIXED_PRECISION": "bf16", "OMP_NUM_THREADS": "1"},
    )
    for rank in (0, 1):
        assert (
            f"rank={rank} world=2 type=MULTI_CPU mp=bf16 sum=2 model=DistributedDataParallel" in out
        )
    # The group the Accelerator created is destroyed before interpreter teardown, where a
    # live gloo group can abort the process (seen in CI as SIGABRT on one rank).
    assert out.count("group alive at exit: False") == 2, out


@pytest.mark.timeout(120)
def test_as_a_plain_script_it_is_one_process(tmp_path: Path) -> None:
    out = run([], tmp_path, {"NBACCEL_MIXED_PRECISION": "fp16"})
    assert "rank=0 world=1 type=NO mp=fp16 sum=1 model=Linear" in out


def compiled_matches_eager() -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    model.load_state_dict(eager.state_dict())
    acc = nbaccel.Accelerator()  # dynamo_backend comes from the launch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    x = torch.randn(4, 8)
    inner = model.module if hasattr(model, "module") else model
    return {
        "compiled": type(inner).__name__,
        "difference": float((model(x) - eager(x)).abs().max()),
        "unwrapped": type(acc.unwrap_model(model, keep_torch_compile=False)).__name__,
        "kept": type(acc.unwrap_model(model)).__name__,
        "ddp": type(model).__name__,
    }


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_dynamo_backend_inductor_compiles_the_model_in_prepare(runs_dir: str) -> None:
    result = nbaccel.notebook_launcher(
        compiled_matches_eager,
        num_processes=2,
        runs_dir=runs_dir,
        dynamo_backend="inductor",
    )
    assert result["ddp"] == "DistributedDataParallel"  # DDP(torch.compile(model))
    assert result["compiled"] == "OptimizedModule"
    assert result["unwrapped"] == "Sequential"
    assert result["kept"] == "OptimizedModule"  # Accelerate's default keeps the compiled model
    assert result["difference"] < 1e-5
