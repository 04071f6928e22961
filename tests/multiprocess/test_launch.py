"""What a user does: launch a function on 2 ranks and get values, output, metrics back."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

import nbaccel
from tests.multiprocess.conftest import run_script

pytestmark = pytest.mark.timeout(180)


def all_reduce_rank_sum(offset: int) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(value)
    return float(value.item())


def test_returns_rank0_value_and_every_result(runs_dir: str) -> None:
    assert (
        nbaccel.notebook_launcher(
            all_reduce_rank_sum, args=(1,), num_processes=2, runs_dir=runs_dir
        )
        == 3.0
    )
    run = nbaccel.launch(all_reduce_rank_sum, args=(10,), num_processes=2, runs_dir=runs_dir)
    assert run.results(timeout=60) == {0: 21.0, 1: 21.0}
    assert run.state is nbaccel.RunState.SUCCEEDED
    files = sorted(p.name for p in run.run_dir.iterdir())
    assert files == [
        "config.json",
        "events.jsonl",
        "rank0.log",
        "rank1.log",
        "result-rank0.pkl",
        "result-rank1.pkl",
    ]
    assert (
        json.loads((run.run_dir / "config.json").read_text())["sources"]["num_processes"]
        == "argument"
    )


def test_cell_function_with_closure_and_globals_from_python_stdin(tmp_path: Path) -> None:
    result = run_script(
        """
        import nbaccel, sys
        OFFSET = 100                       # a "notebook global"
        def make_train(scale):
            def train(x):
                import torch, torch.distributed as dist
                t = torch.tensor([float(x * scale + OFFSET + dist.get_rank())])
                dist.all_reduce(t)
                return t.item()
            return train
        print("RESULT", nbaccel.notebook_launcher(make_train(3), args=(2,), num_processes=2))
        print("TORCH_IN_PARENT", "torch" in sys.modules)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "RESULT 213.0" in result.stdout  # (6 + 100) + (6 + 100 + 1)
    assert "TORCH_IN_PARENT False" in result.stdout


def describe_worker() -> dict:
    import torch
    import torch.distributed as dist

    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "ACCELERATE_USE_CPU",
        "ACCELERATE_MIXED_PRECISION",
        "OMP_NUM_THREADS",
    )
    return {
        "env": {k: os.environ.get(k) for k in keys},
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend(),
        "rank": dist.get_rank(),
        "threads": torch.get_num_threads(),
        "session_leader": os.getsid(0) == os.getpid(),
        "ctx": nbaccel.active_session().context.rank,  # type: ignore[union-attr]
        "mp": nbaccel.active_session().config.mixed_precision,  # type: ignore[union-attr]
    }


def test_worker_environment_and_untouched_parent(runs_dir: str) -> None:
    environ_before = dict(os.environ)
    handlers_before = {
        s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)
    }
    results = nbaccel.launch(
        describe_worker, num_processes=2, mixed_precision="bf16", runs_dir=runs_dir
    ).results(60)
    for rank, info in results.items():
        env = info["env"]
        assert (
            env["RANK"] == env["LOCAL_RANK"] == str(rank) == str(info["rank"]) == str(info["ctx"])
        )
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] != "29500" and int(env["MASTER_PORT"]) > 0
        assert env["ACCELERATE_USE_CPU"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
        assert info["initialized"] and info["backend"] == "gloo" and info["mp"] == "bf16"
        assert info["threads"] == int(env["OMP_NUM_THREADS"])
        assert info["session_leader"]
    assert results[0]["env"]["MASTER_PORT"] == results[1]["env"]["MASTER_PORT"]
    assert dict(os.environ) == environ_before
    assert {s: signal.getsignal(s) for s in handlers_before} == handlers_before


def user_initialises() -> float:
    import torch
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo")  # from the env, as torchrun-style scripts do
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def test_function_may_initialise_the_group_itself(runs_dir: str) -> None:
    assert (
        nbaccel.notebook_launcher(
            user_initialises, num_processes=2, init_process_group=False, runs_dir=runs_dir
        )
        == 2.0
    )


def noisy(steps: int) -> str:
    import ctypes
    import subprocess
    import sys

    import torch.distributed as dist
    from tqdm import tqdm

    rank = dist.get_rank()
    print(f"python stdout from {rank}")
    print(f"python stderr from {rank}", file=sys.stderr)
    os.write(1, f"raw fd write from {rank}\n".encode())
    ctypes.CDLL(None).printf(b"C printf from %d\n", rank)  # buffered in C: flushed at exit
    subprocess.run(["echo", f"child process of {rank}"], check=True)
    for _ in tqdm(range(steps), file=sys.stdout, mininterval=0, ascii=True):
        pass
    return "ok"


def test_output_is_captured_per_rank_at_fd_level(
    runs_dir: str, capfd: pytest.CaptureFixture[str]
) -> None:
    run = nbaccel.launch(noisy, args=(4,), num_processes=2, runs_dir=runs_dir)
    assert run.result(60) == "ok"
    for rank in (0, 1):
        log = run.logs(rank)
        for expected in (
            "python stdout from",
            "python stderr from",
            "raw fd write from",
            "C printf from",
            "child process of",
        ):
            assert f"{expected} {rank}" in log, (expected, log)
        assert "4/4" in log and log.count("4/4") == 1  # the \r redraws collapse into one line
        assert (run.run_dir / f"rank{rank}.log").read_bytes().count(b"\r") >= 4
    printed = capfd.readouterr().out
    assert "python stdout from 0" in printed and "from 1" not in printed  # rank 0 only by default


def test_log_ranks_all_labels_other_ranks(runs_dir: str, capfd: pytest.CaptureFixture[str]) -> None:
    nbaccel.notebook_launcher(noisy, args=(1,), num_processes=2, log_ranks="all", runs_dir=runs_dir)
    printed = capfd.readouterr().out
    assert "[rank 1] python stdout from 1" in printed
    assert "\npython stdout from 0" in "\n" + printed


def train_with_metrics(steps: int) -> int:
    import torch.distributed as dist

    for step in range(steps):
        nbaccel.log_metrics({"loss": 1.0 / (step + 1), "rank": dist.get_rank()})
    nbaccel.log_metrics({"final": 1.0}, step=100)
    return steps


def test_metrics_reach_the_run(runs_dir: str) -> None:
    run = nbaccel.launch(train_with_metrics, args=(3,), num_processes=2, runs_dir=runs_dir)
    run.wait(60)
    assert run.metrics == [
        {"loss": 1.0, "rank": 0.0, "step": 0},
        {"loss": 0.5, "rank": 0.0, "step": 1},
        {"loss": 1 / 3, "rank": 0.0, "step": 2},
        {"final": 1.0, "step": 100},
    ]
    records = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]
    metric_ranks = sorted({r["rank"] for r in records if r["event"] == "metric"})
    assert metric_ranks == [0, 1]
    assert records[-1]["event"] == "ended" and records[-1]["state"] == "succeeded"


def test_accelerate_code_runs_unchanged(runs_dir: str) -> None:
    pytest.importorskip("accelerate")

    def accelerate_view() -> tuple:
        from accelerate import Accelerator

        accelerator = Accelerator()
        # The code's own argument must survive the launch's default accumulation (1):
        # Accelerate reads ACCELERATE_GRADIENT_ACCUMULATION_STEPS over its argument.
        asked = Accelerator(gradient_accumulation_steps=4)
        return (
            accelerator.num_processes,
            accelerator.distributed_type.value,
            accelerator.mixed_precision,
            accelerator.process_index,
            asked.gradient_accumulation_steps,
        )

    results = nbaccel.launch(
        accelerate_view, num_processes=2, mixed_precision="bf16", runs_dir=runs_dir
    ).results(120)
    assert results == {0: (2, "MULTI_CPU", "bf16", 0, 4), 1: (2, "MULTI_CPU", "bf16", 1, 4)}

    def fsdp_env() -> tuple:
        return os.environ["ACCELERATE_USE_FSDP"], os.environ["FSDP_SHARDING_STRATEGY"]

    # What `accelerate launch` would export. (Accelerate applies FSDP on GPUs only; on CPU
    # its state stays MULTI_CPU: see test_cuda.py for the GPU check.)
    fsdp = nbaccel.launch(fsdp_env, num_processes=2, strategy="fsdp", runs_dir=runs_dir)
    assert fsdp.result(120) == ("true", "FULL_SHARD")


def test_parent_that_used_torch_threads_and_its_own_group(tmp_path: Path) -> None:
    result = run_script(
        """
        import threading, tempfile, os
        import torch, torch.distributed as dist
        torch.set_num_threads(2)
        a = torch.randn(1500, 1500); (a @ a).sum()         # OpenMP threads started in the parent
        stop = threading.Event(); threading.Thread(target=stop.wait, daemon=True).start()
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # the parent's own group
        import nbaccel
        def train():
            import torch, torch.distributed as dist
            x = torch.randn(800, 800)
            y = (x @ x).sum()                               # a large op in the worker
            t = torch.ones(1); dist.all_reduce(t)
            return dist.get_world_size(), t.item()
        print("RESULT", nbaccel.notebook_launcher(train, num_processes=2))
        print("PARENT_WORLD", dist.get_world_size())
        stop.set()
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "RESULT (2, 2.0)" in result.stdout
    assert "PARENT_WORLD 1" in result.stdout


def test_state_while_running_and_stop(runs_dir: str) -> None:
    def forever() -> None:
        import time

        while True:
            time.sleep(0.05)

    run = nbaccel.launch(forever, num_processes=2, runs_dir=runs_dir)
    assert run.state is nbaccel.RunState.RUNNING
    with pytest.raises(TimeoutError):
        run.wait(timeout=0.2)
    assert run.stop() is nbaccel.RunState.CANCELLED
    with pytest.raises(nbaccel.RunCancelled):
        run.result()
    exits = [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]
    assert sorted(e["rank"] for e in exits if e["event"] == "exited") == [0, 1]


def test_helper_death_fails_the_run_and_the_next_launch_recovers(runs_dir: str) -> None:
    from nbaccel.launcher.local.helper import shared_helper

    def wait_forever() -> None:
        import time

        while True:
            time.sleep(0.05)

    run = nbaccel.launch(wait_forever, num_processes=2, runs_dir=runs_dir)
    os.kill(shared_helper().pid, signal.SIGKILL)
    assert run.wait(timeout=30) is nbaccel.RunState.FAILED
    assert isinstance(run.error, nbaccel.HelperError)
    assert (
        nbaccel.notebook_launcher(
            all_reduce_rank_sum, args=(0,), num_processes=2, runs_dir=runs_dir
        )
        == 1.0
    )


def test_a_crash_inside_the_helper_reaches_the_cell_with_its_traceback(runs_dir: str) -> None:
    from nbaccel.launcher.local.helper import shared_helper

    def wait_forever() -> None:
        import time

        while True:
            time.sleep(0.05)

    run = nbaccel.launch(wait_forever, num_processes=2, runs_dir=runs_dir)
    # A request without its run id stands in for a bug: a KeyError in the helper's loop.
    shared_helper()._send({"op": "signal", "signal": int(signal.SIGTERM)})
    assert run.wait(timeout=30) is nbaccel.RunState.FAILED
    assert isinstance(run.error, nbaccel.HelperError)
    message = str(run.error)
    assert "bug in nbaccel" in message and "KeyError: 'run'" in message, message
    assert (
        nbaccel.notebook_launcher(
            all_reduce_rank_sum, args=(0,), num_processes=2, runs_dir=runs_dir
        )
        == 1.0
    )


def what_the_worker_got() -> tuple:
    import torch.distributed as dist

    session = nbaccel.active_session()
    assert session is not None
    return (
        dist.get_world_size(),
        session.config.mixed_precision,
        os.environ["ACCELERATE_MIXED_PRECISION"],
        session.config.gradient_accumulation_steps,
    )


def test_config_file_and_config_object_use_the_same_resolution(
    tmp_path: Path, runs_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nbaccel.config.files import save

    path = save(nbaccel.Config(num_processes=2, mixed_precision="bf16"), tmp_path / "run.yaml")
    monkeypatch.setenv("NBACCEL_GRADIENT_ACCUMULATION_STEPS", "3")  # env fills what is unset
    from_file = nbaccel.notebook_launcher(what_the_worker_got, config=str(path), runs_dir=runs_dir)
    assert from_file == (2, "bf16", "bf16", 3)
    from_object = nbaccel.notebook_launcher(
        what_the_worker_got,
        config=nbaccel.Config(num_processes=2, mixed_precision="fp16"),
        runs_dir=runs_dir,
    )
    assert from_object == (2, "fp16", "fp16", 3)
    # Keyword arguments beat the file.
    assert (
        nbaccel.notebook_launcher(
            what_the_worker_got, config=path, mixed_precision="no", runs_dir=runs_dir
        )[1]
        == "no"
    )


def own_pid() -> int:
    import os

    return os.getpid()


def test_workers_report_their_pids_when_they_start(runs_dir: str) -> None:
    # The dashboard reads each worker's memory by pid (psutil), so the pids must be right.
    run = nbaccel.launch(own_pid, num_processes=2, runs_dir=runs_dir)
    assert run.worker_pids == {} or set(run.worker_pids) <= {0, 1}
    assert run.results(timeout=60) == run.worker_pids
    assert len(set(run.worker_pids.values())) == 2


def log_many(count: int) -> int:
    for step in range(count):
        nbaccel.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    return count


def test_many_metrics_stay_out_of_the_kernel_memory_yet_all_come_back(runs_dir: str) -> None:
    run = nbaccel.launch(
        log_many, args=(1000,), num_processes=2, metrics_in_memory=100, runs_dir=runs_dir
    )
    assert run.result(timeout=120) == 1000
    metrics = run.metrics
    assert [m["step"] for m in metrics] == list(range(1000))
    assert metrics[-1] == {"loss": 1.0 / 1000, "step": 999}
    assert len(run._metrics) == 100  # the window: the rest is read from events.jsonl


def test_a_cell_written_for_accelerates_notebook_launcher_runs_unchanged(runs_dir: str) -> None:
    """Every keyword of accelerate.notebook_launcher, as an Accelerate user writes them."""
    with socket.socket() as probe:  # a port free now; the launch binds it itself
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    value = nbaccel.notebook_launcher(
        describe_worker,
        (),
        2,
        mixed_precision="bf16",
        use_port=str(port),
        master_addr="127.0.0.1",
        node_rank=0,
        num_nodes=1,
        rdzv_backend="static",
        rdzv_endpoint="",
        rdzv_conf=None,
        rdzv_id="none",
        max_restarts=0,
        monitor_interval=0.1,
        log_line_prefix_template=None,
        runs_dir=runs_dir,
        dashboard=False,
    )
    assert value["env"]["MASTER_PORT"] == str(port)
    assert value["env"]["WORLD_SIZE"] == "2" and value["mp"] == "bf16"


def wait_long() -> None:
    import time

    time.sleep(120)


def test_the_display_finishes_showing_while_the_ranks_start_and_a_failure_there_stops_them(
    runs_dir: str,
) -> None:
    # The widget dashboard subscribes before the workers start and builds its widgets once
    # they are started (nbaccel.launcher.planned.Display); if that fails, nothing is left.
    from nbaccel.launcher.api import start

    seen: dict[str, object] = {}

    def show(run: nbaccel.Run, gpus: int) -> Callable[[], None]:
        seen["run"] = run

        def rest() -> None:
            seen["state then"] = run.state
            raise RuntimeError("the frontend went away")

        return rest

    with pytest.raises(RuntimeError, match="frontend went away"):
        start(wait_long, (), 2, None, None, {"runs_dir": runs_dir}, show=show)
    run = seen["run"]
    assert isinstance(run, nbaccel.Run)
    assert seen["state then"] is nbaccel.RunState.RUNNING  # the workers had been started
    run.wait(timeout=60)  # stopped, not left to sleep for 120 s
    assert run.state is nbaccel.RunState.CANCELLED
