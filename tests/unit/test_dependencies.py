"""CI installs from a lock: it must pin every dependency pyproject.toml declares, within
the ranges pyproject allows, so that a dependency added or narrowed without re-locking is
caught here rather than on a fresh machine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "ci.txt"
LOCKED_EXTRAS = ("dev", "notebook", "gpu", "trackers")  # xla has its own environment


def locked() -> dict[str, Version]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if match:
            pins[canonicalize_name(match[1])] = Version(match[2])
    return pins


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(text) for text in project["dependencies"]]
    for extra in LOCKED_EXTRAS:
        found += [Requirement(text) for text in project["optional-dependencies"][extra]]
    return found


def test_the_lock_pins_every_declared_dependency_within_its_range() -> None:
    pins = locked()
    assert len(pins) > 50  # a whole environment, not a list of top-level names
    problems = []
    for requirement in declared():
        version = pins.get(canonicalize_name(requirement.name))
        if version is None:
            problems.append(f"{requirement.name} is not in requirements/ci.txt")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name}=={version} is outside {requirement}")
    assert not problems, "re-lock (see the README's command): " + "; ".join(problems)


def test_the_lock_says_how_it_was_made_and_pins_the_cpu_torch() -> None:
    text = LOCK.read_text()
    assert "pip-compile" in text.split("\n\n", 1)[0]  # the command, in the generated header
    assert locked()[canonicalize_name("torch")] == Version("2.13.0+cpu")
    assert "pip-compile" in (ROOT / "docs" / "developing.md").read_text()  # how to refresh it
