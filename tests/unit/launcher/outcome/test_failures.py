"""Blame the rank that failed on its own, and rebuild the error the user expects."""

from __future__ import annotations

import dataclasses
import pickle
import signal
from pathlib import Path

import pytest

from nbaccel.errors import CollectiveTimeout, RemoteTraceback, WorkerError, describe_exit
from nbaccel.events import WorkerFailed
from nbaccel.launcher.outcome.arbiter import ARBITRATION_SECONDS, PEER_PATIENCE_SECONDS, Arbiter
from nbaccel.launcher.outcome.failures import Failure, build_error, choose_culprit


class CellError(Exception):
    """Stands in for an exception class defined in a notebook cell."""


def report(
    error: BaseException, rank: int = 1, cause: str = "error", module: str | None = None
) -> WorkerFailed:
    type_name = f"{module or type(error).__module__}.{type(error).__qualname__}"
    return WorkerFailed(
        rank=rank,
        type=type_name,
        message=str(error),
        traceback=f'  File "cell-3", line 4, in train\n    raise {type(error).__name__}\n',
        exception=pickle.dumps(error),
        cause=cause,
        time=0.0,
    )


def test_own_error_beats_earlier_peer_failures() -> None:
    peer = Failure(rank=0, cause="peer", time=1.0)
    timeout = Failure(rank=2, cause="timeout", time=1.5)
    own = Failure(rank=1, cause="error", time=2.0)
    assert choose_culprit([peer, timeout, own]) is own
    assert choose_culprit([timeout, peer]) is timeout


def test_earliest_own_failure_wins() -> None:
    late = Failure(rank=0, cause="error", time=5.0)
    killed = Failure(rank=3, cause="exit", time=4.0, exitcode=-9)
    assert choose_culprit([late, killed]) is killed


def test_original_exception_type_comes_back_with_rank_and_traceback() -> None:
    error = build_error(
        Failure(1, "error", 0.0, report=report(CellError("bad batch"))),
        world_size=2,
        collective_timeout=30,
    )
    assert type(error) is CellError
    assert str(error) == "[rank 1] bad batch"
    assert error.rank == 1  # type: ignore[attr-defined]
    assert isinstance(error.__cause__, RemoteTraceback)
    assert "Traceback from rank 1" in str(error.__cause__)
    assert 'File "cell-3", line 4, in train' in str(error.__cause__)
    assert any("rank 1 of 2" in note for note in getattr(error, "__notes__", ["rank 1 of 2"]))


def test_exception_from_an_unloaded_module_becomes_worker_error() -> None:
    # An error from a library the kernel has not loaded (torch, say) must not import it into
    # the kernel: it is described, not unpickled. (Not torch itself here: other tests in this
    # process may have imported it.)
    rep = report(RuntimeError("gloo exploded"), module="never_loaded_lib.distributed")
    rep = dataclasses.replace(rep, type="never_loaded_lib.distributed.DistBackendError")
    error = build_error(Failure(0, "error", 0.0, report=rep), world_size=2, collective_timeout=1)
    assert type(error) is WorkerError
    assert error.rank == 0
    assert error.exc_type == "never_loaded_lib.distributed.DistBackendError"
    assert "rank 0 raised never_loaded_lib.distributed.DistBackendError: gloo exploded" in str(
        error
    )


def test_unpicklable_exception_becomes_worker_error() -> None:
    rep = dataclasses.replace(report(ValueError("x")), exception=None)
    error = build_error(Failure(1, "error", 0.0, report=rep), world_size=2, collective_timeout=1)
    assert type(error) is WorkerError and "builtins.ValueError: x" in str(error)


@pytest.mark.parametrize("base", [SystemExit(4), KeyboardInterrupt()])
def test_base_exceptions_are_never_reraised_in_the_parent(base: BaseException) -> None:
    error = build_error(
        Failure(1, "error", 0.0, report=report(base)), world_size=2, collective_timeout=1
    )
    assert type(error) is WorkerError
    if isinstance(base, SystemExit):
        assert str(error) == "rank 1 called sys.exit(4)"


def test_timeout_names_the_stuck_ranks_and_shows_their_stacks() -> None:
    rep = report(RuntimeError("Timed out waiting 3000ms"), rank=0, cause="timeout")
    error = build_error(
        Failure(0, "timeout", 0.0, report=rep),
        world_size=3,
        collective_timeout=3,
        stuck_ranks=[1, 2],
        stuck_logs={1: 'File "cell", line 9 in train', 2: "sleep"},
    )
    assert isinstance(error, CollectiveTimeout)
    assert error.stuck_ranks == (1, 2)
    assert "rank(s) 1, 2 never joined it" in str(error)
    assert 'File "cell", line 9 in train' in str(error)


def test_timeout_without_stuck_ranks_reports_a_mismatch() -> None:
    rep = report(RuntimeError("Timed out"), rank=0, cause="timeout")
    error = build_error(Failure(0, "timeout", 0.0, report=rep), world_size=2, collective_timeout=3)
    assert "different collectives" in str(error)


def test_deaths_by_signal_and_exit_code() -> None:
    killed = build_error(
        Failure(1, "exit", 0.0, exitcode=-signal.SIGKILL), world_size=2, collective_timeout=1
    )
    assert isinstance(killed, WorkerError) and killed.signal_name == "SIGKILL"
    assert "out-of-memory" in str(killed)
    segv = describe_exit(0, -signal.SIGSEGV)
    assert "SIGSEGV" in str(segv) and "run.logs(0)" in str(segv)
    code = describe_exit(1, 3)
    assert code.exitcode == 3 and "exited with code 3" in str(code)


def test_an_exit_names_the_rank_log_in_the_run_folder_and_carries_run_dir() -> None:
    # notebook_launcher's caller has no Run: "see run.logs(1)" is nothing they can type.
    run_dir = Path("/tmp/runs/20261129-070000-abcdef")
    for status in (3, -signal.SIGSEGV, -signal.SIGABRT):
        error = build_error(
            Failure(1, "exit", 0.0, exitcode=status),
            world_size=2,
            collective_timeout=1,
            run_dir=run_dir,
        )
        assert isinstance(error, WorkerError) and error.run_dir == run_dir
        text = str(error)
        assert f"print(open('{run_dir}/rank1.log').read())" in text, text
        assert "see run.logs" not in text and "of run.logs" not in text
    raised = build_error(
        Failure(1, "error", 0.0, report=report(CellError("bad batch"))),
        world_size=2,
        collective_timeout=1,
        run_dir=run_dir,
    )
    assert type(raised) is CellError and raised.run_dir == run_dir  # type: ignore[attr-defined]
    # A rank's own exception keeps its message; its traceback from the rank ends by saying
    # where the rank's whole output is.
    remote = str(raised.__cause__).rstrip()
    assert remote.endswith(
        f"Rank 1's whole output: print(open('{run_dir}/rank1.log').read())"
        " in a cell, or run.logs(1) on a Run from nbaccel.launch"
    ), remote


def test_launcher_side_error_is_passed_through() -> None:
    boom = RuntimeError("helper died")
    assert (
        build_error(Failure(0, "error", 0.0, error=boom), world_size=2, collective_timeout=1)
        is boom
    )


def test_arbiter_schedules_hang_dumps_then_stops_and_ignores_collateral() -> None:
    from nbaccel.launcher.outcome.arbiter import Arbiter

    arbiter = Arbiter()
    arbiter.fail(Failure(0, "timeout", 1.0), now=100.0)
    assert arbiter.next_deadline() == 100.5
    signals = arbiter.due(now=100.5, live=[0, 1, 2], everyone_exited=False)
    assert signals == [(signal.SIGUSR2, [1, 2])] and arbiter.stuck == [1, 2]
    arbiter.fail(Failure(1, "error", 2.0), now=100.6)  # after the decision: collateral
    assert arbiter.culprit is not None and arbiter.culprit.rank == 0
    assert arbiter.due(now=101.0, live=[1], everyone_exited=False) == [(signal.SIGTERM, None)]
    assert arbiter.due(now=102.0, live=[1], everyone_exited=False) == [(signal.SIGKILL, None)]
    assert arbiter.next_deadline() is None


def test_arbiter_stop_and_early_decision_when_everyone_exited() -> None:
    from nbaccel.launcher.outcome.arbiter import Arbiter

    stopped = Arbiter()
    stopped.cancel(now=0.0)
    stopped.fail(Failure(0, "error", 0.1), now=0.1)  # KeyboardInterrupt reports: ignored
    assert stopped.failures == [] and stopped.due(0.0, [0, 1], False) == [(signal.SIGINT, None)]
    assert stopped.due(0.5, [], True) == []  # nobody left to signal
    early = Arbiter()
    early.fail(Failure(1, "error", 0.0), now=0.0)
    assert early.due(now=0.01, live=[], everyone_exited=True) == []
    assert early.culprit is not None and early.culprit.rank == 1


def test_arbiter_waits_for_the_peer_a_connection_error_points_at() -> None:
    # The first launch of a kernel: rank 0's "closed by peer" arrives at once, rank 1's exit
    # status only when the helper reaps it (seconds later when it is busy). Rank 1 is blamed.
    a = Arbiter()
    a.fail(Failure(0, "peer", 1.0), now=0.0)
    assert a.due(now=ARBITRATION_SECONDS + 0.1, live=[0, 1], everyone_exited=False) == []
    assert a.culprit is None
    a.fail(Failure(1, "exit", 3.0, exitcode=-9), now=3.0)
    assert a.next_deadline() == pytest.approx(3.0 + ARBITRATION_SECONDS)
    a.due(now=3.0 + ARBITRATION_SECONDS, live=[0], everyone_exited=False)
    assert a.culprit is not None and a.culprit.rank == 1


def test_arbiter_blames_the_peer_report_when_nobody_else_reports() -> None:
    a = Arbiter()
    a.fail(Failure(0, "peer", 1.0), now=0.0)
    assert a.next_deadline() == pytest.approx(PEER_PATIENCE_SECONDS)
    signals = a.due(now=PEER_PATIENCE_SECONDS, live=[0, 1], everyone_exited=False)
    assert a.culprit is not None and a.culprit.rank == 0
    assert signals == [(signal.SIGTERM, None)]


def test_on_several_machines_the_failing_rank_is_named_with_its_host() -> None:
    raised = build_error(
        Failure(3, "error", 0.0, report=report(CellError("bad batch"))),
        world_size=4,
        collective_timeout=30,
        host="node2",
    )
    assert str(raised) == "[rank 3 on host node2] bad batch"
    assert "Traceback from rank 3 on host node2" in str(raised.__cause__)
    assert any("rank 3 of 4 on host node2" in note for note in raised.__notes__)
    killed = build_error(
        Failure(2, "exit", 0.0, exitcode=-signal.SIGKILL),
        world_size=4,
        collective_timeout=1,
        host="node2",
    )
    assert str(killed).startswith("rank 2 was killed by SIGKILL") and "host node2" in str(killed)


def test_q_in_pdb_on_a_rank_is_named_as_such() -> None:
    import bdb

    from nbaccel.errors import DebuggerQuit

    quit_report = report(bdb.BdbQuit("/nb/train.py:12"), rank=1)
    error = build_error(
        Failure(1, "error", 0.0, report=quit_report),
        world_size=2,
        collective_timeout=60,
        host="node2",
    )
    assert isinstance(error, DebuggerQuit) and isinstance(error, WorkerError)
    assert str(error).startswith(
        "quit in the debugger on rank 1 on host node2 (at /nb/train.py:12): every rank was "
        "stopped, so the run has no result."
    )
    assert error.rank == 1 and error.where == "/nb/train.py:12"
    assert isinstance(error.__cause__, RemoteTraceback)
