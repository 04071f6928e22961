"""The dashboard's model on several machines (a remote worker's pid is never read here) and
across torch elastic's restarts (the header names the attempt)."""

from __future__ import annotations

from nbaccel.events import WorkerStarted
from nbaccel.ui.dashboard.model import DashboardModel


def test_a_remote_workers_pid_is_not_sampled_on_this_machine() -> None:
    model = DashboardModel(world_size=2)
    model.handle(WorkerStarted(0, 101, 0.0))
    model.handle(WorkerStarted(1, 102, 0.0, host="node2"))
    assert model.pids == {0: 101}  # the memory sampler reads these pids on this machine
    assert model.hosts == {1: "node2"}


def test_the_header_says_which_attempt_runs_after_a_restart() -> None:
    from nbaccel.events import RunRestarted
    from nbaccel.ui.dashboard.text import header_text

    model = DashboardModel(world_size=2)
    model.handle(WorkerStarted(1, 102, 0.0))
    assert "attempt" not in header_text(model.header(now=1.0))  # no restart: not shown
    model.handle(RunRestarted(1, 2, 1, None, "killed by SIGKILL", 1.0))
    model.handle(WorkerStarted(1, 202, 1.0))
    parts = header_text(model.header(now=2.0)).split(" · ")
    assert parts[2] == "attempt 2 of 3"
    assert model.pids == {1: 202}  # the memory sampler follows the new worker


def test_a_launcher_notice_shows_in_the_first_ranks_log() -> None:
    from nbaccel.events import Notice
    from nbaccel.ui.dashboard.model import DashboardModel

    model = DashboardModel(2)
    model.handle(Notice("not preloaded: thready (it started a thread at import)", 0.0))
    assert "nbaccel: not preloaded: thready" in "\n".join(model.tail(0))


def test_a_notice_about_another_rank_is_a_note_of_the_summary_not_rank_0s_line() -> None:
    # The headless breakpoint skip on rank 1 sat under "rank 0's last 1 lines" (issue 39,
    # item 18): a notice is the launcher's, about the run or any rank.
    from nbaccel.events import LogLine, Notice
    from nbaccel.ui.dashboard.text import summary_text

    skipped = "rank 1: a debugger stop at t.py:3 was skipped: nobody can answer"
    model = DashboardModel(world_size=2)
    model.handle(LogLine(0, "epoch 1", False, False, 0.0))
    model.handle(Notice(skipped, 0.0))
    lines = summary_text(model).splitlines()
    assert f"note: {skipped}" in lines
    assert lines[-2:] == ["rank 0's last 1 lines (all of them: run.logs(0)):", "  epoch 1"]
    assert model.tail(0)[-1] == f"nbaccel: {skipped}"  # the live log still shows it there

    quiet = DashboardModel(world_size=2)  # rank 0 printed nothing: no section for it
    quiet.handle(Notice(skipped, 0.0))
    assert "rank 0's last" not in summary_text(quiet)
    assert f"note: {skipped}" in summary_text(quiet).splitlines()


def test_the_header_says_what_the_workers_wait_for_until_one_starts() -> None:
    # "running · 0:02" while the helper still imported torch (issue 39, item 19).
    from nbaccel.events import RunStarted, Waiting
    from nbaccel.ui.dashboard.text import header_html, header_text

    model = DashboardModel(world_size=2)
    model.handle(RunStarted("r1", 2, "/runs/r1", 0.0))
    model.handle(Waiting("the helper imports torch (the first launch only)", 0.1))
    head = model.header(now=2.0)
    assert header_text(head).startswith(
        "starting: the helper imports torch (the first launch only) · 0:02 · 2 processes"
    )
    assert "<b style='color:#e65100'>starting: the helper imports torch" in header_html(
        head, stopping=False
    )
    model.handle(Waiting("the helper imports transformers first", 2.5))
    assert header_text(model.header(now=3.0)).startswith("starting: the helper imports trans")
    model.handle(WorkerStarted(0, 101, 3.5))
    assert header_text(model.header(now=4.0)).startswith("running · 0:04")
