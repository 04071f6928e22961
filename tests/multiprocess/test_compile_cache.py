"""torch.compile's caches in the project's folder, artifacts that outlive the machine, and the
compile time the step-time breakdown carries: real launches through nbaccel (1 process, CPU).

Each launch's worker is a fresh process forked from the helper (torch imported already), as
a relaunch or a resumed run on a new machine is. The function calls what the worker's
start-up will (``use_project_caches``, ``load_artifacts``) itself. Compiling is slow on a
small machine: the model is tiny; assertions use torch's cache counters, never timings.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.events import StepBreakdown
from nbaccel.step_board import StepBoard

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # each compiles: ~10-25 s here


def tiny_step(layers: int = 1, width: int = 8) -> None:
    """Compile a small MLP and run one forward and backward (both graphs compiled)."""
    import torch

    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))
    compiled = torch.compile(model)
    compiled(torch.randn(4, width)).sum().backward()


def cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    wanted = ("fxgraph_cache_hit", "fxgraph_cache_miss")
    found = {name: counters["inductor"][name] for name in wanted}
    for name in ("autograd_cache_hit", "autograd_cache_miss"):
        found[name] = counters["aot_autograd"][name]
    return found


def compile_in_the_project_folder() -> dict[str, Any]:
    import os

    from nbaccel.context import active_session
    from nbaccel.launcher.bootstrap import compile_cache

    session = active_session()
    assert session is not None
    before = compile_cache.compile_seconds()
    folder = compile_cache.use_project_caches(session.config)
    tiny_step()
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    inductor = folder / "inductor"
    return {
        "folder": str(folder),
        "inductor": cache_dir(),
        "triton": os.environ["TRITON_CACHE_DIR"],
        "headers": codecache._HEADER_DIR,
        "fxgraph": sum(1 for p in (inductor / "fxgraph").rglob("*") if p.is_file()),
        "aotautograd": sum(1 for p in (inductor / "aotautograd").rglob("*") if p.is_file()),
        "counters": cache_counters(),
        "before": before,
        "after": compile_cache.compile_seconds(),
    }


def test_a_compile_keeps_its_caches_in_dynamo_cache_dir(runs_dir: str, tmp_path: Path) -> None:
    chosen = tmp_path / "compile cache"  # a space, as in Drive's "My Drive"
    seen = nbaccel.notebook_launcher(
        compile_in_the_project_folder,
        num_processes=1,
        runs_dir=runs_dir,
        dynamo_cache_dir=str(chosen),
        dashboard=False,
    )
    assert seen["folder"] == str(chosen)
    # Every folder Inductor, AOTAutograd, Triton and the C++ headers use is in it (through a
    # link without the space: Inductor's C++ commands would split the path there), none
    # under /tmp's default (torchinductor_<user>), though torch was imported before.
    for name, inside in (("inductor", "inductor"), ("triton", "triton")):
        assert " " not in seen[name], seen
        assert os.path.realpath(seen[name]) == os.path.realpath(chosen / inside), seen
    assert seen["headers"] == os.path.join(seen["inductor"], "precompiled_headers")
    # ... and the compile wrote its entries there: forward and backward graphs, missed.
    assert seen["counters"]["fxgraph_cache_miss"] >= 2, seen
    assert seen["fxgraph"] >= 2 and seen["aotautograd"] >= 1, seen
    assert chosen.stat().st_mode & 0o777 == 0o700


def test_compile_seconds_counts_the_compile(runs_dir: str, tmp_path: Path) -> None:
    plain = tmp_path / "cc"
    seen = nbaccel.notebook_launcher(
        compile_in_the_project_folder,
        num_processes=1,
        runs_dir=runs_dir,
        dynamo_cache_dir=str(plain),
        dashboard=False,
    )
    assert seen["before"] == 0.0  # torch._dynamo not imported yet: not imported to ask
    assert seen["after"] > 0.0
    assert seen["inductor"] == str(plain / "inductor")  # a plain path is used as it is


def compile_and_save(folder: str) -> dict[str, Any]:
    from nbaccel.context import active_session
    from nbaccel.launcher.bootstrap import compile_cache

    session = active_session()
    assert session is not None
    compile_cache.use_project_caches(session.config)
    nothing = compile_cache.save_artifacts(Path(folder), 0)  # nothing compiled yet
    tiny_step()
    saved = compile_cache.save_artifacts(Path(folder), 0)
    return {"nothing": nothing, "saved": str(saved), "counters": cache_counters()}


def load_and_compile(folder: str, broken: str) -> dict[str, Any]:
    import torch

    from nbaccel.context import active_session
    from nbaccel.launcher.bootstrap import compile_cache

    session = active_session()
    assert session is not None
    compile_cache.use_project_caches(session.config)
    # Damaged files are skipped with one line each, the run going on: one that is no
    # artifacts file at all, then one whose bytes torch cannot read (its checksum fails).
    damaged = Path(broken) / "compile" / "rank0.bin"
    damaged.parent.mkdir(parents=True)
    python = "{}.{}".format(*sys.version_info[:2])
    header = json.dumps({"torch": torch.__version__, "python": python}).encode() + b"\n"
    said: list[tuple[bool, str]] = []
    for content in (b"\x00not ours", compile_cache.MAGIC + header + b"\x00" * 64):
        damaged.write_bytes(content)
        with contextlib.redirect_stderr(io.StringIO()) as err:
            loaded = compile_cache.load_artifacts(Path(broken), 0)
        said.append((loaded, err.getvalue()))
    # Rank 1 of a bigger run than the one that saved: it takes rank 0's artifacts.
    loaded = compile_cache.load_artifacts(Path(folder), 1)
    tiny_step()
    return {"said": said, "loaded": loaded, "counters": cache_counters()}


def test_artifacts_saved_in_one_process_serve_a_fresh_one_with_an_empty_cache(
    runs_dir: str, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "checkpoint"
    first = nbaccel.notebook_launcher(
        compile_and_save,
        (str(checkpoint),),
        num_processes=1,
        runs_dir=runs_dir,
        dynamo_cache_dir=str(tmp_path / "machine1"),
        dashboard=False,
    )
    assert first["nothing"] is None
    assert first["saved"] == str(checkpoint / "compile" / "rank0.bin")
    assert first["counters"]["fxgraph_cache_miss"] >= 2
    # The machine is lost: a new, empty cache folder; only the checkpoint's file is left.
    second = nbaccel.notebook_launcher(
        load_and_compile,
        (str(checkpoint), str(tmp_path / "broken")),
        num_processes=1,
        runs_dir=runs_dir,
        dynamo_cache_dir=str(tmp_path / "machine2"),
        dashboard=False,
    )
    damaged = tmp_path / "broken" / "compile" / "rank0.bin"
    skipped = f"nbaccel: compile artifacts {damaged} skipped:"
    assert second["said"] == [
        (False, f"{skipped} not an nbaccel compile-artifacts file\n"),
        (False, f"{skipped} torch could not read it\n"),
    ]
    assert second["loaded"] is True
    counters = second["counters"]
    # Served from the artifacts: every graph a cache hit, none compiled anew.
    assert counters["fxgraph_cache_hit"] >= 2 and counters["fxgraph_cache_miss"] == 0, counters
    assert counters["autograd_cache_hit"] >= 1 and counters["autograd_cache_miss"] == 0, counters


def train_compiled() -> float:
    """A few steps of a compiled model through the Accelerator (dynamo_backend from the
    launch): its step timer sends the windows, with the compile seconds."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel.context import active_session
    from nbaccel.launcher.bootstrap import compile_cache

    session = active_session()
    assert session is not None
    compile_cache.use_project_caches(session.config)
    acc = nbaccel.Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for (batch,) in loader:
        acc.backward(model(batch).sum())
        optimizer.step()
        optimizer.zero_grad()
    return compile_cache.compile_seconds()


def test_the_step_time_line_says_how_long_compiling_took(runs_dir: str, tmp_path: Path) -> None:
    run = nbaccel.launch(
        train_compiled,
        num_processes=1,
        runs_dir=runs_dir,
        dashboard=False,
        dynamo_backend="inductor",
        dynamo_cache_dir=str(tmp_path / "cc"),
    )
    compiled = run.result()
    assert compiled > 0
    with open(Path(run.run_dir) / "events.jsonl") as lines:
        records = [r for r in map(json.loads, lines) if r.get("event") == "step_breakdown"]
    # The windows the step timer sent carry the compile so far; the last has all of it.
    assert records and records[-1]["compile_seconds"] == pytest.approx(compiled)
    board = StepBoard()
    for record in records:
        del record["event"]
        board.add(StepBreakdown(**record))
    assert board.summary().endswith(f"; compile {compiled:.1f} s")


def measure(load_from: str | None, save_to: str | None) -> dict[str, Any]:
    """One 8-layer MLP's compile (forward and backward) in this fresh process."""
    import time

    from nbaccel.context import active_session
    from nbaccel.launcher.bootstrap import compile_cache

    session = active_session()
    assert session is not None
    compile_cache.use_project_caches(session.config)
    loaded = compile_cache.load_artifacts(Path(load_from), 0) if load_from else False
    started = time.perf_counter()
    tiny_step(layers=8, width=256)
    wall = time.perf_counter() - started
    if save_to:
        compile_cache.save_artifacts(Path(save_to), 0)
    return {
        "wall": wall,
        "compile": compile_cache.compile_seconds(),
        "loaded": loaded,
        "counters": cache_counters(),
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_measure_cold_warm_and_machine_lost(runs_dir: str, tmp_path: Path) -> None:
    """Prints (with -s) the three compile times of an 8-layer MLP; asserts only counters."""

    def launch(cache: str, load_from: str | None = None, save_to: str | None = None) -> Any:
        return nbaccel.notebook_launcher(
            measure,
            (load_from, save_to),
            num_processes=1,
            runs_dir=runs_dir,
            dynamo_cache_dir=cache,
            dashboard=False,
        )

    checkpoint = str(tmp_path / "checkpoint")
    cold = launch(str(tmp_path / "first"), save_to=checkpoint)
    warm = launch(str(tmp_path / "first"))
    lost = launch(str(tmp_path / "new machine"), load_from=checkpoint)
    for name, seen in (("cold", cold), ("warm", warm), ("machine lost + artifacts", lost)):
        print(f"{name}: first call {seen['wall']:.1f} s, compile_seconds {seen['compile']:.1f}")
    assert cold["counters"]["fxgraph_cache_miss"] >= 2
    assert warm["counters"]["fxgraph_cache_miss"] == 0
    assert lost["loaded"] and lost["counters"]["fxgraph_cache_miss"] == 0
