"""Every module another process starts by name (``python -m``, ``runpy``) or that nbaccel
loads by name (the package's lazy table) exists where the name says: moving a module without
its name breaks the helper, an agent or a detached run's supervisor only at run time. Names
in docstrings and messages are held to the same (a module, or a module's attribute)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "nbaccel"
DOTTED = re.compile(r"nbaccel\.(launcher|accel|config|ui|cli|utils)(\.[a-z_]+)*")
# What other processes start by name: the helper, an agent, a supervisor, a worker's script.
STARTED_BY_NAME = {
    "nbaccel.launcher.local.helper_main",
    "nbaccel.launcher.remote.agent_main",
    "nbaccel.launcher.detached.supervisor_main",
    "nbaccel.launcher.bootstrap.script",
}


def named_modules() -> set[str]:
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= {match[0] for match in DOTTED.finditer(node.value)}
    return found


def test_the_entry_points_are_found_in_the_source() -> None:
    assert named_modules() >= STARTED_BY_NAME


def resolves(name: str) -> bool:
    """``name`` is a module, or an attribute of one (``module.function``)."""
    try:
        if importlib.util.find_spec(name) is not None:
            return True
    except ModuleNotFoundError:
        pass
    parent, _, attribute = name.rpartition(".")
    try:
        return hasattr(importlib.import_module(parent), attribute)
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("name", sorted(named_modules()))
def test_every_module_named_in_a_string_exists(name: str) -> None:
    assert resolves(name), f"{name} is named but does not exist"
