"""Docstring examples run as written, and the parent side never imports torch."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nbaccel
from nbaccel.launcher.local.helper import shared_helper

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(nbaccel.__path__, "nbaccel.")
    if not m.name.endswith(("helper_main", "__main__"))  # importing those runs them
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples that launch write their run folders here
    # The examples show a launch as a kernel sees it seconds after `import nbaccel`: the
    # helper up, with nothing left to import first. Else a launch also prints what it waits
    # for ("nbaccel: starting: the helper imports torch ..." or what an earlier example's
    # workers imported), in whichever example came first.
    helper = shared_helper()
    assert helper.wait_ready(120), "the helper did not start"
    assert helper.wait_preloaded(120) or not helper.usable, "the helper's preload never ended"
    monkeypatch.setenv("NBACCEL_PRELOAD_LIBRARIES", "0")
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
        "ConfigPanel",
        "Workers",
        "last_workers",
        "load_into",
    ):
        assert ">>>" in (getattr(nbaccel, name).__doc__ or ""), name


def python_output(code: str, cwd: Path) -> str:
    """Run ``code`` in a fresh interpreter; its stdout (it must succeed)."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_importing_and_launching_keep_torch_out_of_the_parent(tmp_path: Path) -> None:
    code = (
        "import sys, nbaccel\n"
        "assert 'torch' not in sys.modules, 'import nbaccel imported torch'\n"
        "def f():\n    return 7\n"
        "assert nbaccel.notebook_launcher(f, num_processes=2) == 7\n"
        "try:\n    nbaccel.notebook_launcher(lambda: 1 / 0, num_processes=2)\n"
        "except ZeroDivisionError:\n    pass\n"
        # The notebook UI is parent side too: the panel (with its memory estimate) and a
        # launch through the widget dashboard.
        "panel = nbaccel.ConfigPanel(f, num_processes=2, num_params=10**6)\n"
        "assert nbaccel.notebook_launcher(f, num_processes=2, config=panel, dashboard=True) == 7\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "print('TORCH_MODULES', bad)\n"
    )
    assert "TORCH_MODULES []" in python_output(code, tmp_path)


def test_what_the_helper_preloads_never_touches_cuda(tmp_path: Path) -> None:
    # Forked workers cannot use CUDA if the helper initialised it: the helper's imports
    # (PRELOAD, then WARM_LATER when idle) must not call into torch.cuda at all.
    code = (
        "import torch, torch.cuda\n"
        "calls = []\n"
        "for name in ('is_available', '_lazy_init', 'device_count', 'init',\n"
        "             'get_device_properties', 'get_device_capability', 'current_device'):\n"
        "    setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))\n"
        "from nbaccel.launcher.local.helper_main import PRELOAD\n"
        "from nbaccel.launcher.local.warm_up import WARM_LATER\n"
        "for module in PRELOAD + WARM_LATER:\n"
        "    __import__(module)\n"
        "print('CUDA_CALLS', calls)\n"
    )
    assert "CUDA_CALLS []" in python_output(code, tmp_path)


def test_the_accelerator_pages_first_example_runs_as_written(tmp_path: Path) -> None:
    """docs/accelerator.md opens with a whole training loop: it runs, trains and saves."""
    page = Path(__file__).resolve().parents[2] / "docs" / "accelerator.md"
    match = re.search(r"```python\n(.*?)```", page.read_text(), re.DOTALL)
    assert match, "docs/accelerator.md has no ```python block"
    code = match.group(1).replace("nbaccel.notebook_launcher(", "loss = nbaccel.notebook_launcher(")
    out = python_output(code + "print('loss', loss)\n", tmp_path)
    assert float(out.split("loss ")[-1]) < 100, out  # rank 0's return value came back
    assert (tmp_path / "ckpt" / "LATEST").is_file()  # save_state committed a checkpoint
