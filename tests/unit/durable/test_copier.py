"""The background copies: round trips, copies cut short, warnings, pruning, coalescing."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from nbaccel.durable import DurableCopier, fetch, newest_complete
from tests.unit.durable.conftest import FlakyFileSystem, make_state, tree_bytes

WAIT = 30.0  # every wait is bounded; a healthy copy takes milliseconds


def copy_now(copier: DurableCopier, local: Path, name: str) -> None:
    copier.submit(local, name)
    assert copier.wait(timeout=WAIT)


@pytest.mark.parametrize("kind", ["folder", "file-url", "memory"])
def test_a_copy_round_trips(tmp_path: Path, memory_url: str, kind: str) -> None:
    target = {
        "folder": str(tmp_path / "drive" / "ckpt"),
        "file-url": (tmp_path / "drive" / "ckpt").as_uri(),
        "memory": memory_url,
    }[kind]
    local = tmp_path / "local"
    source = make_state(local, "state-000000100-ab12cd", 100, seed=3)
    warnings: list[str] = []
    copier = DurableCopier(target, keep=2, warn=warnings.append, retry_wait=0.0)
    copy_now(copier, local, source.name)
    copier.close()
    assert (warnings, copier.failures, copier.copied) == ([], 0, 1)
    point = newest_complete(target)
    assert point is not None
    assert (point.location, point.name, point.completed_steps) == (target, source.name, 100)
    assert (point.world_size, point.saved_at) == (2, 1100.0)
    fetched = fetch(point, tmp_path / "fetched")
    assert tree_bytes(fetched) == tree_bytes(source)
    if kind == "memory":
        assert fetched == tmp_path / "fetched" / source.name
        stamp = (fetched / "model_0.pt").stat().st_mtime_ns
        assert fetch(point, tmp_path / "fetched") == fetched  # already complete: a no-op
        assert (fetched / "model_0.pt").stat().st_mtime_ns == stamp
        assert sorted(p.name for p in (tmp_path / "fetched").iterdir()) == [source.name]
    else:
        assert fetched == tmp_path / "drive" / "ckpt" / source.name  # the folder itself
        assert not list(fetched.parent.rglob(".*tmp-*"))  # no temporary file left behind


def test_fetch_replaces_an_incomplete_copy_and_refuses_damaged_bytes(
    tmp_path: Path, memory_url: str
) -> None:
    local = tmp_path / "local"
    make_state(local, "state-1", 10)
    copier = DurableCopier(memory_url, keep=2, warn=print, retry_wait=0.0)
    copy_now(copier, local, "state-1")
    copier.close()
    point = newest_complete(memory_url)
    assert point is not None
    (tmp_path / "into" / "state-1").mkdir(parents=True)
    (tmp_path / "into" / "state-1" / "model_0.pt").write_bytes(b"half")
    assert tree_bytes(fetch(point, tmp_path / "into")) == tree_bytes(local / "state-1")
    fs, root = fsspec.core.url_to_fs(memory_url)
    fs.pipe_file(f"{root}/state-1/model_0.pt", b"x" * 3000)  # same size, other bytes
    with pytest.raises(OSError, match="the durable copy is damaged"):
        fetch(point, tmp_path / "again")
    assert not (tmp_path / "again" / "state-1").exists()
    assert list((tmp_path / "again").iterdir()) == []  # the partial folder went too


def test_a_copy_cut_short_before_latest_leaves_the_previous_latest(
    tmp_path: Path, flaky: type[FlakyFileSystem]
) -> None:
    local = tmp_path / "local"
    warnings: list[str] = []
    copier = DurableCopier("flaky://ckpt", keep=5, warn=warnings.append, retries=2, retry_wait=0)
    make_state(local, "state-1", 10)
    copy_now(copier, local, "state-1")
    # The second state's files all arrive, but its manifest never does.
    flaky.plan = staticmethod(lambda op, path: "fail" if "state-2/MANIFEST" in path else "ok")
    make_state(local, "state-2", 20)
    copy_now(copier, local, "state-2")
    assert flaky.store["/ckpt/state-2/model_0.pt"].size == 3000
    assert flaky.store["/ckpt/LATEST"].getvalue() == b"state-1\n"
    point = newest_complete("flaky://ckpt")
    assert point is not None and point.name == "state-1"
    assert copier.failures == 1 and len(warnings) == 1
    # Verified but LATEST refused: still the previous one.
    flaky.plan = staticmethod(lambda op, path: "fail" if "LATEST" in path else "ok")
    make_state(local, "state-3", 30)
    copy_now(copier, local, "state-3")
    assert newest_complete("flaky://ckpt").name == "state-1"  # type: ignore[union-attr]
    # A stalled upload is given up after the timeout; LATEST does not move either.
    stalling = DurableCopier("flaky://ckpt", keep=5, warn=warnings.append, retries=0, timeout=0.5)
    flaky.plan = staticmethod(lambda op, path: "stall" if "state-4/model" in path else "ok")
    make_state(local, "state-4", 40)
    copy_now(stalling, local, "state-4")
    assert flaky.stalled.is_set() and stalling.failures == 1
    assert "did not finish within 0.5 s" in warnings[-1]
    flaky.release_stalls()
    assert newest_complete("flaky://ckpt").name == "state-1"  # type: ignore[union-attr]
    flaky.plan = staticmethod(lambda op, path: "ok")
    copy_now(stalling, local, "state-4")
    assert newest_complete("flaky://ckpt").name == "state-4"  # type: ignore[union-attr]
    copier.close()
    stalling.close()


def test_a_stalled_latest_write_is_never_overtaken(
    tmp_path: Path, flaky: type[FlakyFileSystem]
) -> None:
    # An abandoned write of LATEST may still land: a newer LATEST written meanwhile would be
    # overwritten by the older name, so none is written until the stalled one has finished.
    local = tmp_path / "local"
    warnings: list[str] = []
    copier = DurableCopier(
        "flaky://ckpt", keep=3, warn=warnings.append, retries=1, retry_wait=0, timeout=0.5
    )
    make_state(local, "state-1", 10)
    copy_now(copier, local, "state-1")
    stall_once = iter(["stall"])
    flaky.plan = staticmethod(
        lambda op, path: next(stall_once, "ok") if path.endswith("/LATEST") else "ok"
    )
    make_state(local, "state-2", 20)
    copy_now(copier, local, "state-2")  # tried twice: stalled, then refused to overtake
    make_state(local, "state-3", 30)
    copy_now(copier, local, "state-3")
    assert copier.failures == 2 and len(warnings) == 1
    assert "an earlier write of LATEST" in warnings[0]
    assert newest_complete("flaky://ckpt").name == "state-1"  # type: ignore[union-attr]
    flaky.release_stalls()  # the stalled write lands: state-2, complete and verified
    assert newest_complete("flaky://ckpt").name == "state-2"  # type: ignore[union-attr]
    copy_now(copier, local, "state-3")
    assert newest_complete("flaky://ckpt").name == "state-3"  # type: ignore[union-attr]
    assert copier.failures == 2 and len(warnings) == 1
    copier.close()


def test_warn_is_called_once_per_failing_streak(
    tmp_path: Path, flaky: type[FlakyFileSystem]
) -> None:
    local = tmp_path / "local"
    warnings: list[str] = []
    copier = DurableCopier("flaky://ckpt", keep=2, warn=warnings.append, retries=3, retry_wait=0)
    attempts: list[str] = []

    def refuse(op: str, path: str) -> str:
        attempts.append(path)
        return "fail"

    flaky.plan = staticmethod(refuse)
    for step in (1, 2, 3):
        make_state(local, f"state-{step}", step)
        copy_now(copier, local, f"state-{step}")
    assert len(attempts) == 3 * 4  # each copy tried 1 + 3 times, failing at its first upload
    assert copier.failures == 3 and len(warnings) == 1
    (message,) = warnings
    assert "flaky://ckpt" in message and "state-1" in message and "OSError: flaky" in message
    assert "Training goes on" in message and str(local) in message
    assert "the next save tries the durable copy again" in message
    flaky.plan = staticmethod(lambda op, path: "ok")
    make_state(local, "state-4", 4)
    copy_now(copier, local, "state-4")
    assert copier.failures == 3 and len(warnings) == 1
    flaky.plan = staticmethod(refuse)
    make_state(local, "state-5", 5)
    copy_now(copier, local, "state-5")
    assert copier.failures == 4 and len(warnings) == 2  # a new streak is told again
    copier.close()


def test_keep_two_leaves_the_two_newest_states(tmp_path: Path, memory_url: str) -> None:
    local = tmp_path / "local"
    copier = DurableCopier(memory_url, keep=2, warn=print, retry_wait=0)
    fs, root = fsspec.core.url_to_fs(memory_url)
    for step in range(1, 6):
        make_state(local, f"state-{step:09d}-x", step * 100)
        copy_now(copier, local, f"state-{step:09d}-x")
    # A copy given up long ago (no manifest) is pruned as well.
    fs.pipe_file(f"{root}/state-000000000-junk/model_0.pt", b"partial")
    make_state(local, "state-000000006-x", 600)
    copy_now(copier, local, "state-000000006-x")
    copier.close()
    states = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if "state-" in p)
    assert states == ["state-000000005-x", "state-000000006-x"]
    assert newest_complete(memory_url).completed_steps == 600  # type: ignore[union-attr]


def test_the_newest_submission_wins_while_a_copy_is_in_progress(
    tmp_path: Path, flaky: type[FlakyFileSystem]
) -> None:
    local = tmp_path / "local"
    copier = DurableCopier("flaky://ckpt", keep=10, warn=print, retry_wait=0, timeout=WAIT)
    flaky.plan = staticmethod(lambda op, path: "stall" if "state-1/meta" in path else "ok")
    for step in (1, 2, 3):
        make_state(local, f"state-{step}", step)
    copier.submit(local, "state-1")
    assert flaky.stalled.wait(timeout=WAIT)  # state-1's copy is in progress, held
    copier.submit(local, "state-2")
    copier.submit(local, "state-3")
    assert not copier.wait(timeout=0)
    flaky.release_stalls()
    assert copier.wait(timeout=WAIT)
    copier.close()
    names = {path.split("/")[2] for path in flaky.store if path.startswith("/ckpt/state-")}
    assert names == {"state-1", "state-3"}  # state-2 was replaced before its turn
    assert newest_complete("flaky://ckpt").name == "state-3"  # type: ignore[union-attr]
    assert copier.copied == 2 and copier.failures == 0


def test_a_closed_copier_takes_nothing_and_bad_settings_are_refused(tmp_path: Path) -> None:
    copier = DurableCopier(str(tmp_path / "t"), keep=1, warn=print)
    copier.close()
    make_state(tmp_path / "local", "state-1", 1)
    copier.submit(tmp_path / "local", "state-1")
    assert copier.wait(timeout=0) and not (tmp_path / "t").exists()
    with pytest.raises(ValueError, match="keep=0"):
        DurableCopier(str(tmp_path), keep=0, warn=print)
