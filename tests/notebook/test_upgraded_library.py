"""``pip install`` of a newer version, in a real kernel, of a library the kernel imported:
the helper is replaced right after that cell (before any launch), the next launch's workers
run the new version, and its output says that the kernel itself still runs the old one.

The library is a tiny distribution installed by pip from a local folder (``--no-index``)
into a private user site-packages folder (``PYTHONUSERBASE``, on the kernel's path through
``PYTHONPATH``), which nbaccel counts as installed like any site-packages folder.
"""

from __future__ import annotations

import ast
import json
import site
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient, KernelManager

pytestmark = pytest.mark.timeout(400)

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "tinylib"
version = "{version}"

[tool.setuptools]
packages = ["tinylib"]
"""


def install_command(folder: Path, source: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
        "--no-build-isolation", "--upgrade", "--target", str(folder), str(source),
    ]  # fmt: skip


def source_of(root: Path, version: str) -> Path:
    source = root / f"tinylib-{version}"
    (source / "tinylib").mkdir(parents=True)
    (source / "pyproject.toml").write_text(PYPROJECT.format(version=version))
    (source / "tinylib" / "__init__.py").write_text(f"VERSION = {version!r}\n")
    return source


@pytest.fixture
def kernel_with_tinylib(
    kernel_dirs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[BlockingKernelClient, Path]]:
    """A kernel whose user site-packages holds tinylib 1; its client and that folder."""
    base = tmp_path / "userbase"
    folder = base / Path(site.getusersitepackages()).relative_to(site.getuserbase())
    folder.mkdir(parents=True)
    subprocess.run(install_command(folder, source_of(tmp_path, "1")), check=True)
    monkeypatch.setenv("PYTHONUSERBASE", str(base))
    monkeypatch.setenv("PYTHONPATH", str(folder))  # the kernel's, the helper's, the workers'
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        yield kc, folder
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def run(kc: BlockingKernelClient, code: str, **expressions: str) -> tuple[dict[str, Any], str]:
    """Run ``code``: the JSON values of ``expressions``, and what the cell printed."""
    printed: list[str] = []

    def keep(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])

    wrapped = {name: f"__import__('json').dumps({expr})" for name, expr in expressions.items()}
    reply = kc.execute_interactive(code, user_expressions=wrapped, timeout=300, output_hook=keep)
    content = reply["content"]
    assert content["status"] == "ok", "\n".join(content.get("traceback", []))
    values = {
        name: json.loads(ast.literal_eval(value["data"]["text/plain"]))
        for name, value in content["user_expressions"].items()
    }
    return values, "".join(printed)


def test_an_upgrade_of_a_library_the_kernel_imported_reaches_the_workers(
    kernel_with_tinylib: tuple[BlockingKernelClient, Path], tmp_path: Path
) -> None:
    kc, folder = kernel_with_tinylib
    runs = str(tmp_path / "runs")
    run(
        kc,
        "import nbaccel, tinylib\n"
        "from nbaccel.launcher.local import helper as helper_module\n"
        "def version():\n"
        "    import tinylib\n"
        "    return tinylib.VERSION\n"
        "def launch():\n"
        f"    run = nbaccel.launch(version, num_processes=2, runs_dir={runs!r}, dashboard='text')\n"
        "    return sorted(run.results(timeout=240).values())\n",
    )
    before, _ = run(
        kc,
        "BEFORE = launch()\nOLD = helper_module.shared_helper()\nOLD.wait_preloaded(60)",
        before="BEFORE",
        old="OLD.pid",
    )
    assert before["before"] == ["1", "1"]
    # The upgrade cell: the kernel checks after it, and replaces the helper there and then.
    command = install_command(folder, source_of(tmp_path, "2"))
    run(kc, f"import subprocess\nsubprocess.run({command!r}, check=True)")
    now, _ = run(kc, "", helper="helper_module.current_helper().pid", retired="not OLD.usable")
    assert now["retired"] is True and now["helper"] != before["old"]
    after, printed = run(kc, "AFTER = launch()", after="AFTER", kernel="tinylib.VERSION")
    assert after["after"] == ["2", "2"]  # what a fresh interpreter imports
    assert after["kernel"] == "1"  # the kernel's own copy cannot be replaced
    assert printed.count("nbaccel: reloaded: tinylib (changed on disk)") == 1
    assert "this process (the kernel) still runs the tinylib it imported before" in printed
    again, printed = run(kc, "AGAIN = launch()", again="AGAIN")
    assert again["again"] == ["2", "2"] and "reloaded" not in printed
