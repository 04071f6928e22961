"""The ssh and srun command lines, and how a probe's result is read (no host is contacted)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nbaccel.errors import ConfigError
from nbaccel.launcher.remote.preflight import (
    AGENT_BOOT,
    PROBE,
    HostFailure,
    HostInfo,
    classify_probe,
    local_versions,
    no_answer,
    no_command,
    preflight,
)
from nbaccel.launcher.remote_shell import RemoteShell

SSH = RemoteShell("ssh", python="/venv/bin/python")
SRUN = RemoteShell("srun", python="/venv/bin/python")
HERE = {"python": "3.11.2", "nbaccel": "0.1.0", "torch": "2.5.1+cpu"}


def test_ssh_argv_is_batch_mode_without_a_pty_and_the_users_options_first() -> None:
    shell = RemoteShell("ssh", ("-F", "my config", "-o", "ConnectTimeout=30"))
    assert shell.argv("alice@node1", ["/venv/bin/python", "-c", "print('hi there')"]) == [
        "ssh",
        "-F",
        "my config",
        "-o",
        "ConnectTimeout=30",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
        "-o",
        "ForwardX11=no",
        "-T",
        "alice@node1",
        "--",
        "/venv/bin/python -c 'print('\"'\"'hi there'\"'\"')'",
    ]


def test_ssh_never_turns_host_key_checking_off() -> None:
    argv = " ".join(RemoteShell("ssh").argv("node1", ["true"]))
    assert "StrictHostKeyChecking" not in argv and "UserKnownHostsFile" not in argv


def test_the_remote_shell_splits_the_command_back_into_its_arguments() -> None:
    remote = ["/path with space/python", "-c", "import sys; print(sys.argv)", "$HOME", "a'b"]
    assert shlex.split(SSH.argv("node1", remote)[-1]) == remote


def test_srun_argv_is_one_overlapping_step_on_the_node_with_the_users_options_last() -> None:
    shell = RemoteShell("srun", ("--gres=gpu:4",))
    assert shell.argv("gpu01", ["/venv/bin/python", "-c", "print(1)"]) == [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        "--overlap",
        "--kill-on-bad-exit=1",
        "--cpu-bind=none",
        "--mpi=none",
        "--input=all",
        "--unbuffered",  # else slurmstepd holds the agent's frames until a newline
        "--nodelist=gpu01",
        "--gres=gpu:4",
        "/venv/bin/python",
        "-c",
        "print(1)",
    ]


def test_argv_refuses_option_like_hosts_and_empty_commands() -> None:
    with pytest.raises(ConfigError, match="option"):
        SSH.argv("-oProxyCommand=evil", ["true"])
    with pytest.raises(ValueError, match="empty"):
        SRUN.argv("node1", [])


def test_the_default_interpreter_is_the_kernels() -> None:
    assert RemoteShell("ssh").python == sys.executable


# --- the probe -----------------------------------------------------------------------------


def test_the_probe_runs_here_and_reports_without_importing_torch() -> None:
    code = f"import sys; exec({PROBE!r}); print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    probe_line, torch_imported = result.stdout.splitlines()
    found = json.loads(probe_line)
    assert found["nbaccel"] == local_versions()["nbaccel"]
    assert found["torch"] == local_versions()["torch"]
    assert found["python"] == local_versions()["python"]
    assert found["cpus"] >= 1 and found["gpus"] >= 0
    assert torch_imported == "False"
    assert "\n" not in PROBE


def test_the_agents_first_words_are_the_probes_and_it_leaves_where_nbaccel_is_missing(
    tmp_path: Path,
) -> None:
    # An interpreter without nbaccel (nor torch): -I leaves out site-packages and the
    # current folder, so the probe finds neither, says so, and no agent starts.
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", AGENT_BOOT],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["nbaccel_probe"] == 1 and found["nbaccel"] is None and found["torch"] is None
    assert "\n" not in AGENT_BOOT and "nbaccel.launcher.remote.agent_main" in AGENT_BOOT


# --- reading a probe's result --------------------------------------------------------------


def completed(code: int, stdout: str = "", stderr: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["ssh"], code, stdout, stderr)


def probe_line(**changes: object) -> str:
    found = {
        "nbaccel_probe": 1,
        "python": "3.11.9",
        "nbaccel": "0.1.0",
        "torch": "2.5.1+cu121",
        "hostname": "node1.cluster",
        "cpus": 64,
        "gpus": 8,
    }
    found.update(changes)
    return json.dumps(found) + "\n"


def test_a_good_probe_gives_the_hosts_facts_even_after_a_login_banner() -> None:
    result = completed(0, "Welcome to node1!\n" + probe_line())
    assert classify_probe(SSH, "node1", result, HERE) == HostInfo(
        "node1", "node1.cluster", "3.11.9", "0.1.0", "2.5.1+cu121", 64, 8
    )


@pytest.mark.parametrize(
    ("shell", "code", "stderr", "reason", "fix"),
    [
        (
            SSH,
            255,
            "ssh: connect to host node2 port 22: Connection refused\r\n",
            "unreachable",
            "runs an SSH server",
        ),
        (SSH, 255, "ssh: connect to host node2 port 22: Connection timed out", "unreachable", ""),
        (SSH, 255, "ssh: connect to host node2 port 22: No route to host", "unreachable", ""),
        (
            SSH,
            255,
            "ssh: Could not resolve hostname node2: Name or service not known",
            "unknown host name",
            "~/.ssh/config",
        ),
        (
            SSH,
            255,
            "alice@node2: Permission denied (publickey).",
            "authentication refused",
            "ssh-copy-id node2",
        ),
        (
            SSH,
            255,
            "No ED25519 host key is known for node2 and you have requested strict checking.\n"
            "Host key verification failed.",
            "host key is not trusted",
            "known_hosts",
        ),
        (
            SSH,
            255,
            "@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\n"
            "Host key verification failed.",
            "host key is not trusted",
            "ssh node2",
        ),
        (SSH, 255, "kex_exchange_identification: read: Connection reset", "ssh failed", ""),
        (
            SSH,
            127,
            "bash: line 1: /venv/bin/python: No such file or directory",
            "interpreter /venv/bin/python is missing",
            "remote_python=",
        ),
        (
            SRUN,
            2,
            "slurmstepd: error: execve(): /venv/bin/python: No such file or directory\n"
            "srun: error: node2: task 0: Exited with exit code 2",
            "interpreter /venv/bin/python is missing",
            "remote_python=",
        ),
        (
            SRUN,
            1,
            "srun: error: Unable to create step for job 42: Invalid node name specified",
            "srun could not start a step",
            "squeue",
        ),
        (SSH, 1, "SyntaxError: invalid syntax", "exit code 1", "Python >= 3.10"),
        (SSH, 0, "", "printed no result", ""),
    ],
)
def test_each_failure_is_told_apart_with_its_fix(
    shell: RemoteShell, code: int, stderr: str, reason: str, fix: str
) -> None:
    failure = classify_probe(shell, "node2", completed(code, "", stderr), HERE)
    assert isinstance(failure, HostFailure)
    assert reason in failure.reason
    assert fix in failure.fix
    described = failure.describe()
    assert described.startswith("node2: ")
    if stderr:
        assert stderr.replace("\r", "").strip().splitlines()[-1] in described


def test_missing_packages_name_the_interpreter_and_the_kernels_versions() -> None:
    failure = classify_probe(SSH, "node2", completed(0, probe_line(nbaccel=None)), HERE)
    assert isinstance(failure, HostFailure)
    assert failure.reason == "nbaccel is not installed for /venv/bin/python there"
    assert "nbaccel==0.1.0" in failure.fix
    both = classify_probe(SSH, "node2", completed(0, probe_line(nbaccel=None, torch=None)), HERE)
    assert isinstance(both, HostFailure)
    assert "nbaccel and torch are not installed" in both.reason
    assert "torch==2.5.1 " in both.fix  # the public version: the host picks its own build


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"nbaccel": "0.2.0"}, "nbaccel 0.2.0 there, 0.1.0 here"),
        ({"torch": "2.6.0+cu124"}, "torch 2.6.0+cu124 there, 2.5.1+cpu here"),
        ({"python": "3.12.1"}, "Python 3.12.1 there, 3.11.2 here"),
    ],
)
def test_different_versions_name_both(changes: dict[str, str], named: str) -> None:
    failure = classify_probe(SSH, "node2", completed(0, probe_line(**changes)), HERE)
    assert isinstance(failure, HostFailure)
    assert failure.reason.startswith("different versions")
    assert named in failure.reason


def test_a_cuda_build_on_the_host_matches_a_cpu_build_in_the_kernel() -> None:
    info = classify_probe(SSH, "node1", completed(0, probe_line(torch="2.5.1+cu121")), HERE)
    assert isinstance(info, HostInfo)


def test_preflight_raises_one_error_naming_every_failing_host() -> None:
    answers = {
        "good": completed(0, probe_line()),
        "down": completed(255, "", "ssh: connect to host down port 22: Connection refused"),
        "old": completed(0, probe_line(nbaccel="0.0.9")),
    }
    with pytest.raises(ConfigError) as caught:
        preflight(SSH, list(answers), answers.__getitem__, local_versions=HERE)
    message = str(caught.value)
    assert message.startswith("2 of 3 hosts cannot run nbaccel, so nothing was started")
    assert "- down: unreachable" in message and "Connection refused" in message
    assert "- old: different versions: nbaccel 0.0.9 there, 0.1.0 here" in message
    assert "- good" not in message
    assert caught.value.field == "hosts"
    del answers["down"], answers["old"]
    assert list(preflight(SSH, ["good"], answers.__getitem__, local_versions=HERE)) == ["good"]


def test_a_host_that_does_not_answer_in_time_is_named() -> None:
    def hang(host: str) -> HostFailure:
        return no_answer(SSH, host, 3.0, "debug1: Connecting...\n")

    with pytest.raises(ConfigError) as caught:
        preflight(SSH, ["slow"], hang, local_versions=HERE)
    message = str(caught.value)
    assert "- slow: no answer within 3 s" in message
    assert "ssh -o BatchMode=yes slow true" in message
    assert "debug1: Connecting..." in message


def test_a_missing_ssh_command_is_said() -> None:
    with pytest.raises(ConfigError, match="the ssh command is not installed") as caught:
        preflight(SSH, ["node1"], lambda host: no_command(SSH, host), local_versions=HERE)
    assert "openssh-client" in str(caught.value)


def test_a_local_shell_runs_the_command_itself() -> None:
    # A one-machine launch with max_restarts: the agent runs here, no ssh, no shell quoting.
    argv = ["/opt/python", "-m", "nbaccel.launcher.remote.agent_main"]
    assert RemoteShell("local", ("-F", "ignored")).argv("127.0.0.1", argv) == argv
