"""Shared test settings: tests marked ``cuda`` run only where a GPU is visible."""

from __future__ import annotations

import os

import pytest

from nbaccel.devices import visible_gpu_count


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if visible_gpu_count(os.environ) > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
