"""Finding the newest complete state: what counts as complete, where, and how it reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import fsspec
import pytest

from nbaccel.durable import CheckpointPoint, fetch, is_url, newest_complete, newest_of
from nbaccel.durable.places import check_place
from tests.unit.durable.conftest import make_state


def test_is_url_tells_urls_from_local_paths() -> None:
    for url in ("gs://b/ckpt", "s3://b/c", "hf://datasets/me/x", "memory://x", "file:///tmp/x"):
        assert is_url(url), url
    assert is_url("simplecache::gs://b/ckpt")
    for path in ("/content/drive/MyDrive/ckpt", "rel/dir", "ckpt", "C:\\ckpt", "C://ckpt"):
        assert not is_url(path), path


def test_describe_says_the_step_the_place_and_the_age() -> None:
    point = CheckpointPoint("gs://b/ckpt/", "state-x", 1200, 10_000.0, 8)
    assert point.describe(now=10_000.0 + 12 * 60 + 5) == (
        "step 1,200 from gs://b/ckpt/state-x (saved 12 min ago)"
    )
    assert point.describe(now=10_020.0).endswith("(saved just now)")
    assert point.describe(now=9_990.0).endswith("(saved just now)")  # a clock a bit behind
    assert point.describe(now=10_000.0 + 5 * 3600).endswith("(saved 5 h ago)")
    assert point.describe(now=10_000.0 + 50 * 3600).endswith("(saved 2 days ago)")
    local = CheckpointPoint("/content/drive/ckpt", "state-y", 7, 0.0, 1)
    assert local.describe(now=90.0) == "step 7 from /content/drive/ckpt/state-y (saved 1 min ago)"


def test_a_missing_or_empty_place_has_no_point(tmp_path: Path, memory_url: str) -> None:
    assert newest_complete(str(tmp_path / "missing")) is None
    assert newest_complete(str(tmp_path)) is None
    assert newest_complete(memory_url) is None
    (tmp_path / "a-file").write_text("x")
    assert newest_complete(str(tmp_path / "a-file")) is None


def test_a_local_root_needs_latest_and_the_state_meta(tmp_path: Path) -> None:
    make_state(tmp_path, "state-000000100-aa", 100)
    point = newest_complete(str(tmp_path))
    assert point == CheckpointPoint(str(tmp_path), "state-000000100-aa", 100, 1100.0, 2)
    assert fetch(point, tmp_path / "unused") == tmp_path / "state-000000100-aa"
    assert not (tmp_path / "unused").exists()
    (tmp_path / "LATEST").write_text("state-gone\n")
    assert newest_complete(str(tmp_path)) is None
    (tmp_path / "state-gone").mkdir()
    (tmp_path / "state-gone" / "meta.json").write_text("{not json")
    assert newest_complete(str(tmp_path)) is None
    (tmp_path / "state-gone" / "meta.json").write_text(json.dumps({"format": 1}))
    assert newest_complete(str(tmp_path)) is None


def test_a_url_state_needs_its_manifest_and_every_listed_file(
    tmp_path: Path, memory_url: str
) -> None:
    fs, root = fsspec.core.url_to_fs(memory_url)
    make_state(tmp_path, "state-1", 5)
    fs.put(str(tmp_path / "state-1"), f"{root}/state-1", recursive=True)
    fs.pipe_file(f"{root}/LATEST", b"state-1\n")
    assert newest_complete(memory_url) is None  # no manifest: a copy maybe cut short
    listed = {"meta.json": {"size": (tmp_path / "state-1" / "meta.json").stat().st_size}}
    listed["model_0.pt"] = {"size": 3000}
    listed["extra.pt"] = {"size": 1}
    for entry in listed.values():
        entry["sha256"] = "0" * 64
    fs.pipe_file(f"{root}/state-1/MANIFEST.json", json.dumps({"files": listed}).encode())
    assert newest_complete(memory_url) is None  # extra.pt never arrived
    del listed["extra.pt"]
    listed["model_0.pt"]["size"] = 2999
    fs.pipe_file(f"{root}/state-1/MANIFEST.json", json.dumps({"files": listed}).encode())
    assert newest_complete(memory_url) is None  # a size differs
    listed["model_0.pt"]["size"] = 3000
    fs.pipe_file(f"{root}/state-1/MANIFEST.json", json.dumps({"files": listed}).encode())
    point = newest_complete(memory_url)
    assert point is not None and (point.completed_steps, point.world_size) == (5, 2)
    fs.pipe_file(f"{root}/state-1/MANIFEST.json", b"{damaged")
    assert newest_complete(memory_url) is None


@pytest.mark.parametrize(
    "latest", ["../state-1\n", "/abs/state-1\n", "state-1/../../x\n", "\n", "elsewhere\n"]
)
def test_a_damaged_latest_is_a_value_error_with_the_fix(tmp_path: Path, latest: str) -> None:
    make_state(tmp_path, "state-1", 5)
    (tmp_path / "LATEST").write_text(latest)
    with pytest.raises(ValueError, match="write the name of the newest complete state folder"):
        newest_complete(str(tmp_path))


def test_newest_of_prefers_steps_then_the_latest_save() -> None:
    a = CheckpointPoint("/local", "state-a", 100, 50.0, 1)
    b = CheckpointPoint("gs://b", "state-b", 200, 10.0, 1)
    c = CheckpointPoint("gs://c", "state-c", 200, 20.0, 1)
    assert newest_of([a, None, b, c]) is c
    assert newest_of([b, a]) is b
    assert newest_of([]) is None
    assert newest_of(iter([None, None])) is None


def test_a_missing_filesystem_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(protocol: str) -> None:
        raise ImportError(f"no module for {protocol}")

    monkeypatch.setattr(fsspec, "get_filesystem_class", not_installed)
    with pytest.raises(ImportError, match="pip install fsspec gcsfs"):
        check_place("gs://bucket/ckpt")
    with pytest.raises(ImportError, match="pip install fsspec huggingface_hub"):
        newest_complete("hf://datasets/me/ckpt")
    check_place("/content/drive/ckpt")  # local places need no fsspec filesystem


def test_without_fsspec_a_url_says_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # what a missing package looks like
    with pytest.raises(ImportError, match="pip install fsspec s3fs"):
        newest_complete("s3://bucket/ckpt")
    assert newest_complete("/nowhere/at/all") is None  # a local place never needs it
