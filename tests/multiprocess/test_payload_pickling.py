"""Real launches of what users write at the top of a cell, with the newest cloudpickle and
the oldest one pyproject.toml allows: the cell's lines in a worker's traceback, and
compiled classes (safetensors' ``safe_open``) that must travel by reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLDEST_DIR = Path(os.environ.get("TEST_CLOUDPICKLE_OLDEST_DIR", ROOT / ".venv/cloudpickle-oldest"))
OLDEST = (ROOT / "requirements/cloudpickle-oldest.txt").read_text().split("==")[-1].strip()

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(params=["newest", "oldest"])
def cloudpickle_env(request: pytest.FixtureRequest) -> tuple[dict[str, str], str]:
    """The environment for a `python -` driver (its helper and workers inherit it) and the
    cloudpickle version it must see."""
    if request.param == "newest":
        import cloudpickle

        return dict(os.environ), cloudpickle.__version__
    if not (OLDEST_DIR / "cloudpickle").is_dir():
        message = f"cloudpickle {OLDEST} is not installed in {OLDEST_DIR} (make installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    path = os.pathsep.join(p for p in (str(OLDEST_DIR), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}, OLDEST


def run_driver(code: str, tmp_path: Path, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-"],
        input=textwrap.dedent(code),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    return result.stdout + result.stderr


CELL_ERROR = """
import linecache, cloudpickle, nbaccel
print("CLOUDPICKLE", cloudpickle.__version__)
CELL = "/tmp/ipykernel_31337/1618033988.py"   # a notebook cell: its source is only in linecache
SOURCE = '''
def train(width):
    import torch
    model = torch.nn.Linear(width, 1)
    loss = model(torch.randn(8, width + 1)).pow(2).mean()
    return loss.item()
'''
linecache.cache[CELL] = (len(SOURCE), None, SOURCE.splitlines(True), CELL)
exec(compile(SOURCE, CELL, "exec"))
try:
    nbaccel.notebook_launcher(train, args=(2,), num_processes=2, runs_dir="runs")
except RuntimeError as error:
    print("CAUSE", error.__cause__)
"""


def test_worker_tracebacks_show_the_cell_lines(
    tmp_path: Path, cloudpickle_env: tuple[dict[str, str], str]
) -> None:
    env, version = cloudpickle_env
    out = run_driver(CELL_ERROR, tmp_path, env)
    assert f"CLOUDPICKLE {version}\n" in out, out
    cause = out.split("CAUSE", 1)[-1]
    assert 'File "/tmp/ipykernel_31337/1618033988.py", line 5, in train' in cause, out
    assert "loss = model(torch.randn(8, width + 1)).pow(2).mean()" in cause, out


SAFE_OPEN = """
from safetensors import safe_open            # at the top of a cell, as users write it
import cloudpickle, nbaccel, torch
from safetensors.torch import save_file
print("CLOUDPICKLE", cloudpickle.__version__)
save_file({"weight": torch.arange(4.0)}, "w.safetensors")

def read_weights(path):
    import torch.distributed as dist
    with safe_open(path, framework="pt") as f:
        return dist.get_rank(), f.get_tensor("weight").sum().item()

print("RESULTS", nbaccel.launch(read_weights, args=("w.safetensors",), num_processes=2,
                                runs_dir="runs").results(timeout=120))
"""


def test_safe_open_from_the_top_of_a_cell_works_in_the_workers(
    tmp_path: Path, cloudpickle_env: tuple[dict[str, str], str]
) -> None:
    env, version = cloudpickle_env
    out = run_driver(SAFE_OPEN, tmp_path, env)
    assert f"CLOUDPICKLE {version}\n" in out, out
    assert "RESULTS {0: (0, 6.0), 1: (1, 6.0)}" in out, out
