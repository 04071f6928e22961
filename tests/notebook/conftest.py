"""Shared pieces for tests that run real Jupyter kernels (nbclient / jupyter_client).

Every kernel these tests start gets its own TMPDIR, Jupyter runtime dir and IPython dir, so
parallel or repeated runs never share connection files, cell-file names or inductor caches.
The kernel is the venv's own interpreter: jupyter_client swaps the "python" of the native
kernelspec for ``sys.executable``, and tests check that inside the kernel.
"""

from __future__ import annotations

import queue
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client import BlockingKernelClient, KernelManager
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient import NotebookClient
from nbformat import NotebookNode

KERNEL_NAME = "python3"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


@pytest.fixture
def kernel(kernel_dirs: Path, tmp_path: Path) -> Iterator[tuple[KernelManager, Any]]:
    """A python3 kernel started in the test's folder, with its client; shut down after."""
    km = KernelManager(kernel_name=KERNEL_NAME)
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def strip_ansi(text: str) -> str:
    return ANSI_ESCAPE.sub("", text)


@pytest.fixture(scope="session", autouse=True)
def _python3_kernelspec_exists() -> None:
    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        pytest.skip(f"no {KERNEL_NAME!r} kernelspec: install ipykernel in {sys.executable}")


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private TMPDIR / runtime / IPython dir for the kernels of one test module."""
    root = tmp_path_factory.mktemp("kernel")
    values = {
        "TMPDIR": root / "tmp",
        "JUPYTER_RUNTIME_DIR": root / "runtime",
        "IPYTHONDIR": root / "ipython",
    }
    for path in values.values():
        path.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        for name, path in values.items():
            patch.setenv(name, str(path))
        # A kernel started with the inline matplotlib backend would hand it to workers.
        patch.delenv("MPLBACKEND", raising=False)
        yield root


class Cells:
    """Build, run and read notebooks whose cells are addressed by their ``id``."""

    strip_ansi = staticmethod(strip_ansi)

    @staticmethod
    def notebook(cells: Sequence[tuple[str, str] | tuple[str, str, list[str]]]) -> NotebookNode:
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {
            "name": KERNEL_NAME,
            "display_name": "Python 3 (ipykernel)",
            "language": "python",
        }
        for cell_id, source, *tags in cells:
            cell = nbformat.v4.new_code_cell(source)
            cell["id"] = cell_id
            if tags:
                cell.metadata["tags"] = list(tags[0])
            nb.cells.append(cell)
        nbformat.validate(nb)
        return nb

    @staticmethod
    def execute(
        nb: NotebookNode,
        cwd: Path,
        *,
        timeout: int = 240,
        client_class: type[NotebookClient] = NotebookClient,
        **options: Any,
    ) -> NotebookNode:
        client = client_class(
            nb,
            timeout=timeout,
            startup_timeout=120,
            kernel_name=KERNEL_NAME,
            resources={"metadata": {"path": str(cwd)}},
            **options,
        )
        client.execute()
        return nb

    @staticmethod
    def cell(nb: NotebookNode, cell_id: str) -> NotebookNode:
        for cell in nb.cells:
            if cell.get("id") == cell_id:
                return cell
        raise KeyError(f"no cell with id {cell_id!r}")

    @staticmethod
    def errors(cell: NotebookNode) -> list[NotebookNode]:
        return [out for out in cell.get("outputs", []) if out.output_type == "error"]

    @classmethod
    def assert_ok(cls, cell: NotebookNode) -> None:
        """The cell ran and raised nothing (the worker's traceback is shown if it did)."""
        assert cell.get("execution_count") is not None, f"cell {cell.id} did not run"
        errors = cls.errors(cell)
        assert not errors, f"cell {cell.id} raised:\n" + "\n".join(
            strip_ansi("\n".join(e.traceback)) for e in errors
        )

    @staticmethod
    def stream(cell: NotebookNode, name: str | None = None) -> str:
        """All stream text of a cell (stdout and stderr unless ``name`` picks one), raw."""
        return "".join(
            out.text
            for out in cell.get("outputs", [])
            if out.output_type == "stream" and (name is None or out.name == name)
        )

    @staticmethod
    def result(cell: NotebookNode) -> str:
        """The ``text/plain`` of the cell's execute_result."""
        results = [out for out in cell.get("outputs", []) if out.output_type == "execute_result"]
        assert len(results) == 1, f"cell {cell.id} has {len(results)} execute_result outputs"
        return str(results[0].data["text/plain"])

    @staticmethod
    def screen_lines(text: str) -> list[str]:
        """What a terminal or Jupyter shows for ``text``: a ``\\r`` redraws its line."""
        return [line.rsplit("\r", 1)[-1] for line in text.replace("\r\n", "\n").split("\n")]


@pytest.fixture(scope="session")
def cells() -> type[Cells]:
    return Cells


def cell_output(
    kc: BlockingKernelClient, msg_id: str, deadline: float
) -> tuple[str, list[dict[str, Any]], bool]:
    """What the cell ``msg_id`` printed (its stream text), its errors (the iopub contents:
    ename, evalue, traceback), and whether the kernel went idle after it by ``deadline``
    (a ``time.monotonic()`` value)."""
    text: list[str] = []
    errors: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        content = msg["content"]
        if msg["msg_type"] == "stream":
            text.append(content["text"])
        elif msg["msg_type"] == "error":
            errors.append(content)
        elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
            return "".join(text), errors, True
    return "".join(text), errors, False
