"""Many copies to a target that fails and stalls at seeded random writes: whenever LATEST is
there, it names a complete, verified state with the local source's bytes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from nbaccel.durable import DurableCopier, fetch, newest_complete
from tests.unit.durable.conftest import FlakyFileSystem, make_state, tree_bytes

WAIT = 60.0
SUBMISSIONS = 36


@pytest.mark.parametrize("seed", [1, 2])
def test_latest_always_names_a_complete_copy_of_the_source(
    tmp_path: Path, flaky: type[FlakyFileSystem], seed: int
) -> None:
    rng = random.Random(seed)
    troubles: list[str] = []

    def plan(op: str, path: str) -> str:
        # Writes of files, manifests and LATEST alike; a stall outlasts the copier's timeout.
        draw = rng.random()
        what = "stall" if draw < 0.03 else "fail" if draw < 0.18 else "ok"
        if what != "ok":
            troubles.append(f"{what} {op} {path}")
        return what

    flaky.plan = staticmethod(plan)
    local = tmp_path / "local"
    warnings: list[str] = []
    copier = DurableCopier(
        "flaky://ckpt", keep=2, warn=warnings.append, retries=1, retry_wait=0, timeout=0.4
    )
    sources: dict[str, Path] = {}
    last_steps, seen_latest, given_up_before = -1, 0, 0
    for index in range(SUBMISSIONS):
        name = f"state-{index:09d}-{rng.randrange(16**6):06x}"
        sources[name] = make_state(local, name, 100 * index, seed=rng.randrange(200))
        if index % 6 == 5:
            # The stalled writes land now (old files in pruned folders among them), not
            # while anything is read; the copy below prunes what they brought back.
            flaky.release_stalls()
        copier.submit(local, name)
        assert copier.wait(timeout=WAIT)
        point = newest_complete("flaky://ckpt")
        if "/ckpt/LATEST" in flaky.store:
            assert point is not None, troubles[-5:]
            seen_latest += 1
            fetched = fetch(point, tmp_path / "fetched" / str(index))
            assert tree_bytes(fetched) == tree_bytes(sources[point.name])
            assert point.completed_steps >= last_steps  # LATEST never goes back
            last_steps = point.completed_steps
        else:
            assert point is None
        # A copy that succeeded leaves the newest two states (stalled writes are held).
        if copier.failures == given_up_before:
            states = {p.split("/")[2] for p in flaky.store if p.startswith("/ckpt/state-")}
            assert len(states) <= 2, sorted(states)
        given_up_before = copier.failures
    flaky.release_stalls()
    copier.close()
    assert seen_latest > SUBMISSIONS // 2  # the run copied most states, not none
    assert any(t.startswith("fail") for t in troubles)
    assert len(warnings) <= copier.failures
    assert (copier.failures == 0) == (not warnings)
