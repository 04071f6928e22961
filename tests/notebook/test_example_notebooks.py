"""Every example notebook in notebooks/ runs headless, top to bottom, without surprises.

Each runs in a fresh kernel, in a temporary copy of the notebooks folder (its cwd, so
``nbaccel_runs/`` lands there). Notebooks whose metadata says ``nbaccel.requires`` is "gpu"
or "tpu" are skipped here. Cells tagged ``raises-exception`` must raise (they demonstrate a
failure); every other cell must not.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path
from typing import Any

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
ACCELERATORS = {"gpu", "tpu"}
CELL_TIMEOUT = 300


def _requirements(nb: Any) -> set[str]:
    required = nb.metadata.get("nbaccel", {}).get("requires", [])
    return {required} if isinstance(required, str) else set(required)


def _params() -> list[Any]:
    params = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        needs = _requirements(nbformat.read(path, as_version=4)) & ACCELERATORS
        marks = [pytest.mark.skip(reason=f"needs {', '.join(sorted(needs))}")] if needs else []
        params.append(pytest.param(path.name, marks=marks, id=path.stem))
    return params


def test_notebooks_folder_has_examples() -> None:
    assert list(NOTEBOOKS.glob("*.ipynb")), f"no notebooks in {NOTEBOOKS}"


def test_committed_notebooks_have_no_outputs() -> None:
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs, f"{path.name}: cell {cell.id} has saved outputs"
                assert cell.execution_count is None, f"{path.name}: cell {cell.id} was run"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", _params())
def test_example_notebook_runs(name: str, cells: Any, kernel_dirs: Path, tmp_path: Path) -> None:
    folder = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, folder)
    nb = nbformat.read(folder / name, as_version=4)
    # allow_errors=False: nbclient raises CellExecutionError at the first unexpected error.
    cells.execute(nb, folder, timeout=CELL_TIMEOUT, allow_errors=False)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "raises-exception" in cell.metadata.get("tags", []):
            assert cells.errors(cell), f"cell {cell.id} should demonstrate an error, raised none"
        else:
            cells.assert_ok(cell)
    check = CONTENT_CHECKS.get(name)
    if check is not None:
        check(nb, cells, folder)


def _check_quickstart(nb: Any, cells: Any, folder: Path) -> None:
    # The blocking launch returned rank 0's dict, and training found y = 2x - 1.
    launch = cells.cell(nb, "launch")
    result = ast.literal_eval(cells.result(launch))
    assert result["weight"] == pytest.approx(2.0, abs=0.05), result
    assert result["bias"] == pytest.approx(-1.0, abs=0.05), result
    assert result["final_loss"] < 0.01, result
    assert "rank 0 of 2: 256 samples" in cells.stream(launch)
    assert "rank 1 of 2" not in cells.stream(launch), "rank 1 shown with the default log_ranks"

    run = cells.cell(nb, "launch-run")
    assert cells.result(run) == "<RunState.SUCCEEDED: 'succeeded'>"
    assert "step  29" in cells.stream(run), "the non-blocking run's output is not in its cell"

    metrics = ast.literal_eval(cells.result(cells.cell(nb, "metrics")))
    assert metrics, "run.metrics is empty"
    assert [m["step"] for m in metrics] == [27, 28, 29], metrics
    assert all(m["loss"] > 0 for m in metrics), metrics
    assert "30 records" in cells.stream(cells.cell(nb, "metrics"))

    logs = cells.cell(nb, "logs")
    assert "rank 1 of 2: 256 samples" in cells.stream(logs)
    files = ast.literal_eval(cells.result(logs))
    assert {"rank0.log", "rank1.log"} <= set(files), files

    [error] = cells.errors(cells.cell(nb, "failure"))
    assert error.ename == "RuntimeError"
    assert error.evalue.startswith("[rank 1] "), error.evalue
    assert "shapes cannot be multiplied" in error.evalue
    text = cells.strip_ansi("\n".join(error.traceback))
    assert "Traceback from rank 1" in text, text
    remote = text[text.index("Traceback from rank 1") :].split("direct cause")[0]
    assert "loss = model(torch.randn(8, features)).pow(2).mean()" in remote, text

    assert cells.result(cells.cell(nb, "torch-free")) == "False"
    assert len(list((folder / "nbaccel_runs").iterdir())) == 3  # runs_dir defaults to the cwd


CONTENT_CHECKS = {"01_quickstart_cpu.ipynb": _check_quickstart}
