"""Shared test settings.

Tests marked ``cuda`` run only where a GPU is visible. Default config files are looked up in
an empty folder, so a developer's own ~/.config/nbaccel or Accelerate default config never
changes what the tests launch. Ctrl-C raises KeyboardInterrupt, as in a kernel or a terminal,
even where the tests were started in the background by a shell without job control (which
starts them with SIGINT ignored, and Python then keeps it so): the tests that interrupt
themselves would wait forever.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import pytest

from nbaccel.hardware.devices import visible_gpu_count

_HOME = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    isolated = tempfile.mkdtemp(prefix="nbaccel-test-home-")
    config.stash[_HOME] = isolated
    os.environ["NBACCEL_HOME"] = isolated
    os.environ["HF_HOME"] = os.path.join(isolated, "huggingface")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(config.stash.get(_HOME, ""), ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if visible_gpu_count(os.environ) > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
