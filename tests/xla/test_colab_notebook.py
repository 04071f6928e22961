"""notebooks/06_colab_tpu.ipynb, run on XLA's CPU device instead of a TPU.

CI has no TPU, but the notebook's path is the same on XLA's CPU device: `nbaccel env`, the
data-parallel launch and the FSDPv2 launch. Only the install cell is left out (nbaccel is
installed here from the checkout).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

import nbformat
import pytest

if importlib.util.find_spec("torch_xla") is None:
    pytest.skip("torch_xla is not installed (see requirements/xla.txt)", allow_module_level=True)

from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "06_colab_tpu.ipynb"


@pytest.mark.timeout(400)
def test_the_colab_notebook_runs_on_xlas_cpu_device(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.metadata["nbaccel"]["requires"] == "tpu"
    nb.cells = [c for c in nb.cells if "%pip install" not in c.source]
    with pytest.MonkeyPatch.context() as patch:
        for name in ("TMPDIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
            (tmp_path / name.lower()).mkdir()
            patch.setenv(name, str(tmp_path / name.lower()))
        patch.setenv("PJRT_DEVICE", "CPU")
        patch.setenv("CPU_NUM_DEVICES", "1")
        # `!nbaccel env` runs the console script of this environment.
        patch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        resources = {"metadata": {"path": str(tmp_path)}}
        NotebookClient(nb, timeout=300, kernel_name="python3", resources=resources).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    streams = ["".join(o.get("text", "") for o in c.outputs) for c in code]
    values = [
        ast.literal_eval(o["data"]["text/plain"])
        for c in code
        for o in c.outputs
        if o.output_type == "execute_result"
    ]
    assert any("XLA launch: 1 process × 1 device on CPU" in s for s in streams), streams
    # Both launches (data parallel, then FSDPv2) trained on the XLA device and returned.
    assert [v["device"] for v in values] == ["xla:0", "xla:0"], values
    assert all(v["processes"] == 1 and v["loss"] < 0.6 for v in values), values
    assert sum("final loss" in s for s in streams) == 2, streams  # rank 0's output streamed
