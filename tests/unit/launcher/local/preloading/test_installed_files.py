"""What the helper noted of the installed files it loaded, and the parent's check before a
launch that they are still on disk as they were (``installed_files``)."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from nbaccel.launcher.local.preloading import installed_files
from nbaccel.launcher.local.preloading.installed_files import InstalledCheck, LoadedFiles


@pytest.fixture
def site_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "site-packages"
    (folder / "tinylib").mkdir(parents=True)
    (folder / "tinylib" / "__init__.py").write_text("VERSION = '1'\n")
    return folder


def module(name: str, file: Path | None) -> types.ModuleType:
    made = types.ModuleType(name)
    if file is not None:
        made.__file__ = str(file)
    return made


def loaded(site_dir: Path, tmp_path: Path) -> tuple[LoadedFiles, dict[str, types.ModuleType]]:
    (tmp_path / "mine.py").write_text("")
    modules = {
        "tinylib": module("tinylib", site_dir / "tinylib" / "__init__.py"),
        "mine": module("mine", tmp_path / "mine.py"),  # beside the notebook: not installed
        "nbaccel.accel": module("nbaccel.accel", site_dir / "nbaccel" / "accel.py"),
        "builtin_like": module("builtin_like", None),
    }
    return LoadedFiles(roots=(str(site_dir),), modules=modules), modules


def test_the_helper_notes_installed_files_once_each(site_dir: Path, tmp_path: Path) -> None:
    files, modules = loaded(site_dir, tmp_path)
    noted = files.since_last()
    init = str(site_dir / "tinylib" / "__init__.py")
    assert noted == {init: ("tinylib", installed_files.file_stat(init))}
    assert files.since_last() == {}  # each module once
    (site_dir / "tinylib" / "extra.py").write_text("")
    modules["tinylib.extra"] = module("tinylib.extra", site_dir / "tinylib" / "extra.py")
    assert list(files.since_last()) == [str(site_dir / "tinylib" / "extra.py")]


def test_a_file_loaded_while_site_packages_changed_is_noted_unknown(
    site_dir: Path, tmp_path: Path
) -> None:
    files, _ = loaded(site_dir, tmp_path)
    files.begin()
    (site_dir / "other-1.dist-info").mkdir()  # an install, meanwhile
    assert set(files.since_last().values()) == {("tinylib", None)}


def count_stats(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = installed_files.file_stat

    def counted(path: str) -> installed_files.FileStat | None:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(installed_files, "file_stat", counted)
    return seen


def upgrade(site_dir: Path) -> None:
    """What pip does: the old files go, new ones (new inodes) come, the dist-info changes."""
    init = site_dir / "tinylib" / "__init__.py"
    init.unlink()
    init.write_text("VERSION = '2'\n")
    (site_dir / "tinylib-2.dist-info").mkdir()


def test_nothing_changed_costs_a_stat_per_site_folder(
    site_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, _ = loaded(site_dir, tmp_path)
    check = InstalledCheck(roots=(str(site_dir),))
    check.note(files.since_last())
    seen = count_stats(monkeypatch)
    assert not check.changed()
    assert seen == [str(site_dir)]


def test_an_upgrade_is_named_and_an_unrelated_install_is_not(
    site_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, _ = loaded(site_dir, tmp_path)
    check = InstalledCheck(roots=(str(site_dir),))
    check.note(files.since_last())
    (site_dir / "unrelated").mkdir()  # another distribution installed
    assert not check.changed()
    seen = count_stats(monkeypatch)
    assert not check.changed() and seen == [str(site_dir)]  # cheap again after that
    upgrade(site_dir)
    found = check.changed()
    assert found.files == {str(site_dir / "tinylib" / "__init__.py"): "tinylib"}
    assert found.notice(held=()) == "reloaded: tinylib (changed on disk)"
    kernel_note = found.notice(held={"tinylib"})
    assert kernel_note.startswith("reloaded: tinylib (changed on disk); this process (the kernel)")


def test_a_file_changed_before_its_note_arrived_is_seen(site_dir: Path, tmp_path: Path) -> None:
    files, _ = loaded(site_dir, tmp_path)
    check = InstalledCheck(roots=(str(site_dir),))
    noted = files.since_last()
    upgrade(site_dir)
    assert not check.changed()  # nothing noted yet: the launch found nothing to check...
    check.note(noted)  # ...and the note, arriving after, is compared with the disk at once
    assert check.changed().files == {str(site_dir / "tinylib" / "__init__.py"): "tinylib"}


def test_a_successor_keeps_only_its_files_and_the_folders_as_last_checked(
    site_dir: Path, tmp_path: Path
) -> None:
    (site_dir / "other.py").write_text("")
    files, modules = loaded(site_dir, tmp_path)
    modules["other"] = module("other", site_dir / "other.py")
    check = InstalledCheck(roots=(str(site_dir),))
    check.note(files.since_last())
    upgrade(site_dir)
    assert check.changed().paths == {str(site_dir / "tinylib" / "__init__.py")}
    kept = check.keeping({str(site_dir / "other.py")})
    assert kept.paths() == {str(site_dir / "other.py")}
    assert not kept.changed()
    os.utime(site_dir / "other.py", ns=(0, 0))  # edited in place...
    (site_dir / "x").mkdir()  # ...by an install
    assert kept.changed().files == {str(site_dir / "other.py"): "other"}
