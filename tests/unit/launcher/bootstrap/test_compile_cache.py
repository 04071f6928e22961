"""Where the compile caches go (``cache_folder``), the artifact files' checks, and
``compile_seconds`` read from torch's clock: no processes, no compile."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest

from nbaccel import metrics
from nbaccel.config.schema import Config
from nbaccel.config.sections import DynamoOptions
from nbaccel.launcher.bootstrap import compile_cache
from nbaccel.launcher.bootstrap.compile_cache import (
    MAGIC,
    cache_folder,
    compile_seconds,
    load_artifacts,
    shell_safe,
)


def test_the_default_is_compile_cache_under_runs_dir_from_the_working_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    folder = cache_folder(Config(runs_dir="my_runs"))
    assert folder == tmp_path / "my_runs" / "compile_cache"
    assert folder.is_absolute() and folder.is_dir()
    assert folder.stat().st_mode & 0o777 == 0o700


def test_the_default_runs_dir_is_used_when_nothing_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cache_folder(Config()) == tmp_path / Config().runs_dir / "compile_cache"


def test_cache_dir_wins_over_runs_dir(tmp_path: Path) -> None:
    chosen = tmp_path / "drive" / "cache"
    config = Config(runs_dir=str(tmp_path / "runs"), dynamo=DynamoOptions(cache_dir=str(chosen)))
    assert cache_folder(config) == chosen
    assert chosen.is_dir() and not (tmp_path / "runs").exists()


def test_a_relative_cache_dir_is_taken_from_the_working_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    folder = cache_folder(Config(dynamo=DynamoOptions(cache_dir="caches/compile")))
    assert folder == tmp_path / "caches" / "compile"


def test_a_home_relative_cache_dir_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_folder(Config(dynamo=DynamoOptions(cache_dir="~/cc"))) == tmp_path / "cc"


def test_an_existing_folder_is_kept_as_it_is(tmp_path: Path) -> None:
    existing = tmp_path / "shared"
    existing.mkdir(mode=0o755)
    existing.chmod(0o755)
    (existing / "kept").write_text("x")
    assert cache_folder(Config(dynamo=DynamoOptions(cache_dir=str(existing)))) == existing
    assert (existing / "kept").read_text() == "x"
    assert existing.stat().st_mode & 0o777 == 0o755  # the user's folder: not ours to chmod


def test_a_plain_path_is_used_as_it_is(tmp_path: Path) -> None:
    assert shell_safe(tmp_path / "cc") == tmp_path / "cc"


def test_a_path_with_spaces_is_reached_through_a_private_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inductor splits its C++ commands on spaces: "My Drive" would break every CPU compile.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    spaced = tmp_path / "My Drive" / "cache"
    spaced.mkdir(parents=True)
    link = shell_safe(spaced)
    assert link is not None and " " not in str(link)
    assert link.parent == tmp_path / "tmp" / f"nbaccel-{os.getuid()}"
    assert link.parent.stat().st_mode & 0o777 == 0o700
    assert os.readlink(link) == str(spaced)
    assert shell_safe(spaced) == link  # the same path each launch: the same cache keys
    assert shell_safe(tmp_path / "My Drive" / "other") != link


def test_links_go_nowhere_but_a_private_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"nbaccel-{os.getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # anyone could plant a link to their own compiled code
    assert shell_safe(tmp_path / "My Drive") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a private folder of this user's" in err


def write_artifacts(folder: Path, rank: int, content: bytes) -> Path:
    path = folder / "compile" / f"rank{rank}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def test_no_file_is_false_and_silent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_artifacts(tmp_path, 0) is False
    assert load_artifacts(tmp_path / "missing", 3) is False
    assert capsys.readouterr().err == ""


def test_a_file_of_something_else_is_skipped_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_artifacts(tmp_path, 0, b"\x00garbage")
    assert load_artifacts(tmp_path, 0) is False
    err = capsys.readouterr().err
    assert (
        err == f"nbaccel: compile artifacts {path} skipped: not an nbaccel compile-artifacts file\n"
    )


def test_a_truncated_file_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_artifacts(tmp_path, 0, MAGIC + b'{"torch": "2')
    assert load_artifacts(tmp_path, 0) is False
    assert "skipped: the file is truncated" in capsys.readouterr().err


def test_an_unreadable_header_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_artifacts(tmp_path, 0, MAGIC + b"{not json\ndata")
    assert load_artifacts(tmp_path, 0) is False
    assert "skipped: its header is unreadable" in capsys.readouterr().err


def test_another_torch_versions_artifacts_are_skipped_with_both_versions_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    python = "{}.{}".format(*sys.version_info[:2])
    header = json.dumps({"torch": "1.0.0", "python": python}).encode()
    write_artifacts(tmp_path, 0, MAGIC + header + b"\n" + b"bytes torch never sees")
    assert load_artifacts(tmp_path, 0) is False
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert (
        f"written by torch 1.0.0 on Python {python}, this is torch {torch.__version__}"
        in (lines[0])
    )


def test_a_rank_without_its_own_file_takes_rank_0s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rank0 = write_artifacts(tmp_path, 0, b"rank 0's")
    assert load_artifacts(tmp_path, 5) is False  # rank 0's file is read (and is no good)
    assert str(rank0) in capsys.readouterr().err
    rank5 = write_artifacts(tmp_path, 5, b"rank 5's")
    assert load_artifacts(tmp_path, 5) is False
    assert str(rank5) in capsys.readouterr().err


def fake_dynamo_utils(monkeypatch: pytest.MonkeyPatch, readings: list[float]) -> None:
    """A stand-in for torch._dynamo.utils whose clock gives ``readings`` in turn."""
    module = types.ModuleType("torch._dynamo.utils")
    values = iter(readings)
    module.calculate_time_spent = lambda: {"total_wall_time": next(values)}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", module)
    monkeypatch.setattr(metrics, "_compile_clock", {"last": 0.0, "before_reset": 0.0})


def test_compile_seconds_is_zero_without_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch._dynamo.utils", raising=False)
    assert compile_seconds() == 0.0
    assert "torch._dynamo.utils" not in sys.modules  # not imported to answer


def test_compile_seconds_reads_torchs_clock_and_survives_a_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3 s compiled, 5 s, then torch._dynamo.reset() (torch's figure back to 0), 2 s more.
    fake_dynamo_utils(monkeypatch, [3.0, 5.0, 0.0, 2.0])
    assert [compile_seconds() for _ in range(4)] == [3.0, 5.0, 5.0, 7.0]


def test_compile_seconds_is_the_same_function_in_both_places() -> None:
    # The worker's API (compile_cache) and what the step-time reports send (metrics).
    assert compile_cache.compile_seconds is metrics.compile_seconds
