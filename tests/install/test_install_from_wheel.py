"""A new user's path, from this checkout: build the sdist and the wheel, install the wheel
with its ``notebook`` extra into a fresh venv that already holds the user's own torch, run
the README's first example there, and execute notebook 01 on a kernel of that venv.

Nothing here imports the checkout: the example and the notebook run in a temporary folder,
and both check that ``nbaccel`` came from the fresh venv. The torch is the one the lock pins
(here a CPU build), installed first and on its own, as a user with a CUDA or ROCm build does;
``.ci/pip-install`` installs with uv from its cache (about 20 s for all of it).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.install.commands import run

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
KERNEL = "nbaccel-wheel"
# Installed in a developer's venv, never by `pip install nbaccel[notebook]`.
DEV_ONLY = ("accelerate", "pytest", "jupyterlab", "mypy", "transformers", "wandb")


@dataclass(frozen=True)
class FreshVenv:
    python: Path
    site: Path  # where its packages live: nbaccel must be imported from here
    dist: Path  # the sdist and the wheel
    jupyter: Path  # a JUPYTER_PATH entry holding the venv's kernelspec


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> FreshVenv:
    root = tmp_path_factory.mktemp("install")
    dist = root / "dist"
    # uv builds the sdist, then the wheel from the sdist (as `python -m build` does): a file
    # the sdist forgets fails here.
    uv = Path(sys.executable).parent / "uv"
    run([uv, "build", "--out-dir", dist, REPO], cwd=root)
    [wheel] = dist.glob("nbaccel-*.whl")
    assert len(list(dist.glob("nbaccel-*.tar.gz"))) == 1, sorted(dist.iterdir())

    venv = root / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=root)
    python = venv / "bin" / "python"
    torch = f"torch=={importlib.metadata.version('torch')}"  # the user's own, first
    run([REPO / ".ci" / "pip-install", venv, torch], cwd=REPO)
    run([REPO / ".ci" / "pip-install", venv, f"{wheel}[notebook]"], cwd=REPO)
    run([python, "-m", "pip", "check"], cwd=root)
    jupyter = root / "jupyter"
    run([python, "-m", "ipykernel", "install", "--prefix", jupyter, "--name", KERNEL], cwd=root)
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root))
    return FreshVenv(python, Path(str(site).strip()), dist, jupyter / "share" / "jupyter")


def test_the_wheel_brings_what_the_notebook_extra_promises_and_no_more(venv: FreshVenv) -> None:
    freeze = run([venv.python, "-m", "pip", "freeze"], cwd=venv.dist).lower()
    installed = {re.split(r"[=@ ]", line)[0] for line in freeze.splitlines()}
    for name in ("nbaccel", "torch", "ipywidgets", "matplotlib", "ipykernel", "tqdm"):
        assert name in installed, freeze
    assert not installed & set(DEV_ONLY), freeze
    # The torch installed first was kept: the wheel's `torch>=2.4` did not replace it.
    assert f"torch=={importlib.metadata.version('torch')}" in freeze, freeze


def readme_first_example() -> str:
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_the_readmes_first_example_runs_in_the_fresh_venv(venv: FreshVenv, tmp_path: Path) -> None:
    script = tmp_path / "readme_example.py"
    code = readme_first_example()
    script.write_text(code + "\nimport nbaccel, sys\nprint('from', nbaccel.__file__)\n")
    out = run([venv.python, script], cwd=tmp_path, timeout=180)
    assert f"from {venv.site}" in out, out  # the installed wheel, not the checkout
    # The example prints rank 0's return value, the last loss: training went down from ~8.
    loss = float(re.findall(r"final loss ([\d.e+-]+)", out)[-1])
    assert loss < 1.0, out
    assert (tmp_path / "nbaccel_runs").is_dir()  # the run folder the README mentions


@pytest.fixture
def jupyter_env(venv: FreshVenv, tmp_path: Path) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(venv.jupyter))
        patch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
        patch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
        patch.delenv("MPLBACKEND", raising=False)
        patch.delenv("PYTHONPATH", raising=False)
        yield


@pytest.mark.timeout(400)
@pytest.mark.usefixtures("jupyter_env")
def test_notebook_01_runs_on_a_kernel_of_the_fresh_venv(venv: FreshVenv, tmp_path: Path) -> None:
    shutil.copy(REPO / "notebooks" / "01_quickstart_cpu.ipynb", tmp_path)
    nb = nbformat.read(tmp_path / "01_quickstart_cpu.ipynb", as_version=4)
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "import sys\nprint('from', nbaccel.__file__, 'torch' in sys.modules, sys.executable)"
        )
    )
    client = NotebookClient(
        nb, kernel_name=KERNEL, timeout=240, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises on any error but the cell tagged raises-exception
    last = "".join(out.get("text", "") for out in nb.cells[-1].outputs)
    assert f"from {venv.site}" in last and " False " in last, last  # no torch in the kernel
    assert last.strip().endswith(str(venv.python)), last
    outputs = [
        out["data"]
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out.get("output_type") == "display_data"
        and out.get("data", {}).get("text/plain", "").startswith("nbaccel run ")
    ]
    texts = [data["text/plain"] for data in outputs if "image/png" not in data]
    images = [data for data in outputs if "image/png" in data]
    # The widget dashboard ran (the notebook extra's ipywidgets and matplotlib) and left its
    # summary in each dashboard cell: the blocking launch, the Run, the failing launch; an
    # image with the two trainings' (their loss curves), and with the failing launch's only
    # if it went on past dashboard_after (it ends sooner: its memory is in its text).
    assert len(texts) == 3 and 2 <= len(images) <= 3, (texts, len(images))
    assert "succeeded" in texts[0] and "failed" in texts[2], texts
    assert os.listdir(tmp_path / "nbaccel_runs"), "the runs wrote no folders"
