"""Every CPU notebook runs in the environment Binder builds from ``binder/`` alone.

A new user's notebook 08 failed with ``ModuleNotFoundError: transformers``: the developer's
venv (the lock) holds every package a notebook imports, so the notebook tests could not see
that neither the README's install nor ``binder/requirements.txt`` brought it. Here a fresh
venv is made from ``binder/requirements.txt`` and nothing else, and each notebook not marked
for a GPU or TPU is executed on a kernel of that venv, its ``raises-exception`` cells
excepted. What the notebooks show is asserted by ``tests/notebook/test_example_notebooks.py``;
this test is about what they need.

One line of the file is left out here: the extra index of PyTorch's CPU wheels, which CI
cannot reach (it reaches PyPI only). The same ``torch==X+cpu`` build comes from this
machine's find-links, as ``.ci/pip-install`` passes them on.
"""

from __future__ import annotations

import json
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
BINDER = REPO / "binder" / "requirements.txt"
NOTEBOOKS = REPO / "notebooks"
KERNEL = "nbaccel-binder"
ACCELERATORS = {"gpu", "tpu"}


@dataclass(frozen=True)
class BinderVenv:
    python: Path
    jupyter: Path  # a JUPYTER_PATH entry holding the venv's kernelspec


def needs(path: Path) -> set[str]:
    required = json.loads(path.read_text())["metadata"].get("nbaccel", {}).get("requires", [])
    return {required} if isinstance(required, str) else set(required)


CPU_NOTEBOOKS = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if not needs(p) & ACCELERATORS]


@pytest.fixture(scope="module")
def binder(tmp_path_factory: pytest.TempPathFactory) -> BinderVenv:
    root = tmp_path_factory.mktemp("binder")
    requirements = root / "requirements.txt"
    lines = BINDER.read_text().splitlines()
    requirements.write_text("\n".join(x for x in lines if "extra-index-url" not in x) + "\n")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=root)
    # repo2docker installs the file from the repository's root: `-e .` is the checkout.
    run([REPO / ".ci" / "pip-install", venv, "--requirement", requirements], cwd=REPO)
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "check"], cwd=root)
    jupyter = root / "jupyter"
    run([python, "-m", "ipykernel", "install", "--prefix", jupyter, "--name", KERNEL], cwd=root)
    return BinderVenv(python, jupyter / "share" / "jupyter")


@pytest.fixture
def jupyter_env(binder: BinderVenv, tmp_path: Path) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(binder.jupyter))
        patch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
        patch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
        patch.setenv("TMPDIR", str(tmp_path))
        patch.delenv("MPLBACKEND", raising=False)
        patch.delenv("PYTHONPATH", raising=False)
        yield


def test_every_notebook_import_is_in_the_binder_file() -> None:
    """A quick check of the same promise, without a venv: every top-level module a CPU
    notebook imports is the standard library's, nbaccel's own, or named in binder/."""
    binder = BINDER.read_text().lower()
    provided = {"nbaccel", "torch", "ipywidgets", "matplotlib", "tqdm"}  # -e .[notebook]
    for path in CPU_NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            for line in cell.source.splitlines():
                words = line.split()
                if len(words) < 2 or words[0] not in ("import", "from"):
                    continue
                module = words[1].split(".")[0].rstrip(",")
                if module in sys.stdlib_module_names or module in provided:
                    continue
                assert f"\n{module}" in binder, f"{path.name} imports {module}: not in {BINDER}"


@pytest.mark.timeout(900)
@pytest.mark.usefixtures("jupyter_env")
@pytest.mark.parametrize("path", CPU_NOTEBOOKS, ids=[p.stem for p in CPU_NOTEBOOKS])
def test_the_notebook_runs_in_the_binder_environment(path: Path, tmp_path: Path) -> None:
    shutil.copy(path, tmp_path)
    nb = nbformat.read(tmp_path / path.name, as_version=4)
    client = NotebookClient(
        nb, kernel_name=KERNEL, timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError at the first cell not tagged raises-exception
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.get("execution_count") is not None, f"{path.name}: a cell did not run"
