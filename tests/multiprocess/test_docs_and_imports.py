"""Docstring examples run as written, and the parent side never imports torch."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import nbaccel

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(nbaccel.__path__, "nbaccel.")
    if not m.name.endswith("helper_main")
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples that launch write their run folders here
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0


def test_public_api_has_runnable_examples() -> None:
    for name in (
        "launch",
        "notebook_launcher",
        "Config",
        "Run",
        "log_metrics",
        "resolve",
        "Accelerator",
    ):
        assert ">>>" in (getattr(nbaccel, name).__doc__ or ""), name


def test_importing_and_launching_keep_torch_out_of_the_parent(tmp_path: Path) -> None:
    code = (
        "import sys, nbaccel\n"
        "assert 'torch' not in sys.modules, 'import nbaccel imported torch'\n"
        "def f():\n    return 7\n"
        "assert nbaccel.notebook_launcher(f, num_processes=2) == 7\n"
        "try:\n    nbaccel.notebook_launcher(lambda: 1 / 0, num_processes=2)\n"
        "except ZeroDivisionError:\n    pass\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "print('TORCH_MODULES', bad)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "TORCH_MODULES []" in result.stdout
