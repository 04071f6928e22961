"""Before anything starts on other hosts: can every one of them run nbaccel?

A small probe runs on every host at once, through the same
:class:`~nbaccel.launcher.remote_shell.RemoteShell` that starts the agents: it is the
agent's own first step (:data:`AGENT_BOOT`), so the check costs no SSH connection of its
own. :func:`preflight` reads every host's answer and checks: reachable, logged in without a
password, host key trusted, the Python interpreter present, nbaccel and torch installed, at
the kernel's versions. Every host that fails is named in ONE error with its reason, the fix
and the last lines of its stderr. Stdlib only: this runs in the kernel, which never imports
torch.
"""

from __future__ import annotations

import json
import platform
import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata

from nbaccel.errors import ConfigError
from nbaccel.launcher.remote_shell import RemoteShell

# Printed by the probe on its JSON line, so that a login banner on stdout is told apart.
PROBE_MARK = "nbaccel_probe"

_PROBE_SOURCE = f"""
import json, os, socket, sys
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
try:
    cpus = len(os.sched_getaffinity(0))
except (AttributeError, OSError):
    cpus = os.cpu_count() or 0
try:
    gpus = len(os.listdir("/proc/driver/nvidia/gpus"))
except OSError:
    gpus = 0
found = {{"{PROBE_MARK}": 1, "python": "%d.%d.%d" % sys.version_info[:3],
    "nbaccel": version("nbaccel"), "torch": version("torch"),
    "hostname": socket.gethostname(), "cpus": cpus, "gpus": gpus}}
print(json.dumps(found), flush=True)
"""
# One line, so that any login shell (sh, bash, zsh, csh, fish) passes it through unchanged.
# It reads package metadata only: importing torch would take seconds on every host.
PROBE = f"exec({_PROBE_SOURCE!r})"

# The agent's command (``python -c AGENT_BOOT``): the probe's line first, then, where nbaccel
# and torch are installed, the agent itself (its frames follow on stdout). The kernel judges
# the line while the agent goes on to import torch, and ends an agent whose host fails.
_THEN_THE_AGENT = """
if found["nbaccel"] and found["torch"]:
    import runpy
    runpy.run_module("nbaccel.launcher.remote.agent_main", run_name="__main__", alter_sys=True)
"""
AGENT_BOOT = f"{PROBE}; exec({_THEN_THE_AGENT!r})"  # the probe leaves ``found`` behind

_STDERR_LINES = 5


@dataclass(frozen=True)
class HostInfo:
    """What the probe found on one host (versions are ``None`` where not installed).

    >>> HostInfo("node1", "node1.cluster", "3.11.2", "0.1.0", "2.5.1", 64, 8).gpus
    8
    """

    host: str
    hostname: str
    python: str
    nbaccel: str | None
    torch: str | None
    cpus: int
    gpus: int


@dataclass(frozen=True)
class HostFailure:
    """Why one host cannot run nbaccel: ``reason`` in a few words, ``fix`` what to do."""

    host: str
    reason: str
    fix: str
    stderr: str = ""

    def describe(self) -> str:
        """One entry of the preflight error.

        >>> print(HostFailure("node2", "unreachable", "Check it is up.", "refused").describe())
        node2: unreachable. Check it is up.
            refused
        """
        lines = [f"{self.host}: {self.reason}. {self.fix}"]
        lines += [f"    {line}" for line in _last_lines(self.stderr)]
        return "\n".join(lines)


def local_versions() -> dict[str, str]:
    """The kernel's own Python, nbaccel and torch versions, read from package metadata
    (torch is never imported: that takes seconds). A package not installed is left out.

    >>> sorted(local_versions())
    ['nbaccel', 'python', 'torch']
    """
    found = {"python": platform.python_version()}
    for name in ("nbaccel", "torch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


# What one host's probe said: its command's result (exit code, stdout, stderr; exit code 0
# once the probe's line is in), or a failure found before any result (no_answer, no_command).
ProbeAnswer = subprocess.CompletedProcess[str] | HostFailure


def preflight(
    shell: RemoteShell,
    hosts: Sequence[str],
    ask: Callable[[str], ProbeAnswer],
    *,
    local_versions: Mapping[str, str],
) -> dict[str, HostInfo]:
    """Every host's answer (``ask(host)``, all hosts at once, one thread each) judged: what
    each has, or ONE :class:`ConfigError` naming every host that cannot run nbaccel, why,
    and the fix.

    >>> preflight(RemoteShell("ssh"), [], lambda host: no_command(RemoteShell("ssh"), host),
    ...           local_versions={})
    {}
    """
    if not hosts:
        return {}

    def judge(host: str) -> HostInfo | HostFailure:
        answer = ask(host)
        if isinstance(answer, HostFailure):
            return answer
        return classify_probe(shell, host, answer, local_versions)

    with ThreadPoolExecutor(max_workers=len(hosts), thread_name_prefix="nbaccel-probe") as pool:
        outcomes = list(pool.map(judge, hosts))
    failures = [o for o in outcomes if isinstance(o, HostFailure)]
    if failures:
        raise ConfigError(_failure_message(shell, failures, len(hosts)), field="hosts")
    return {info.host: info for info in outcomes if isinstance(info, HostInfo)}


def no_answer(shell: RemoteShell, host: str, timeout: float, stderr: str) -> HostFailure:
    """The probe said nothing within ``timeout``."""
    return HostFailure(
        host,
        f"no answer within {timeout:g} s",
        f"Something on the way hangs: a firewall that drops packets, a slow login "
        f"shell or home folder, or a busy host. Check by hand with "
        f"`{_manual_check(shell, host)}`, or allow more time.",
        stderr,
    )


def no_command(shell: RemoteShell, host: str) -> HostFailure:
    """``ssh`` or ``srun`` is not installed on this machine."""
    return HostFailure(
        host,
        f"the {shell.kind} command is not installed on this machine",
        "Install OpenSSH's client (apt-get install openssh-client)"
        if shell.kind == "ssh"
        else "Run the kernel on a node of the Slurm allocation, where srun is installed.",
    )


def classify_probe(
    shell: RemoteShell,
    host: str,
    result: subprocess.CompletedProcess[str],
    local_versions: Mapping[str, str],
) -> HostInfo | HostFailure:
    """Read one probe's exit code, stdout and stderr: the host's :class:`HostInfo`, or a
    :class:`HostFailure` that says what went wrong there and the fix.

    >>> failed = subprocess.CompletedProcess(
    ...     ["ssh"], 255, "", "ssh: connect to host node2 port 22: Connection refused\\n")
    >>> classify_probe(RemoteShell("ssh"), "node2", failed, {}).reason
    'unreachable (ssh could not connect)'
    """
    code, stdout, stderr = result.returncode, result.stdout or "", result.stderr or ""
    found = _parse_probe(stdout) if code == 0 else None
    if found is not None:
        return _check_versions(shell, host, found, local_versions)
    if shell.kind == "ssh" and code == 255:
        return _ssh_failure(shell, host, stderr)
    if shell.kind == "srun" and "srun: error:" in stderr and "execve" not in stderr:
        return HostFailure(
            host,
            "srun could not start a step there",
            "Check that the host is a node of this allocation (squeue --me shows its "
            'nodes) and that the job is still running; hosts="slurm" takes the nodes from '
            "SLURM_JOB_NODELIST.",
            stderr,
        )
    if code in (126, 127) or ("No such file or directory" in stderr and shell.python in stderr):
        return HostFailure(
            host,
            f"the Python interpreter {shell.python} is missing there",
            f"Install the same environment on {host} at the same path, or give its path "
            "with remote_python='/path/to/python' (every host uses that path).",
            stderr,
        )
    if code == 0:
        return HostFailure(
            host,
            "the probe printed no result",
            f"{shell.python} ran but printed no nbaccel probe line; check that it is a "
            "Python interpreter (python --version on the host).",
            stdout + stderr,
        )
    return HostFailure(
        host,
        f"the probe failed with exit code {code}",
        f"Run `{shell.python} -c 'import importlib.metadata'` on {host} to see why; nbaccel "
        "needs Python >= 3.10 there.",
        stderr,
    )


def _parse_probe(stdout: str) -> dict[str, object] | None:
    for line in reversed(stdout.splitlines()):
        if PROBE_MARK not in line:
            continue
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and found.get(PROBE_MARK) == 1:
            return found
    return None


def _check_versions(
    shell: RemoteShell, host: str, found: Mapping[str, object], local: Mapping[str, str]
) -> HostInfo | HostFailure:
    info = HostInfo(
        host=host,
        hostname=str(found.get("hostname") or host),
        python=str(found.get("python") or ""),
        nbaccel=_text(found.get("nbaccel")),
        torch=_text(found.get("torch")),
        cpus=_count(found.get("cpus")),
        gpus=_count(found.get("gpus")),
    )
    missing = [name for name in ("nbaccel", "torch") if getattr(info, name) is None]
    if missing:
        pins = " ".join(f"{name}=={_public(local[name])}" for name in missing if name in local)
        return HostFailure(
            host,
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
            f"for {shell.python} there",
            f"Install {pins or ' '.join(missing)} into that interpreter on {host} "
            f"({shell.python} -m pip install ...), or point remote_python at the environment "
            "that has them.",
        )
    wrong = []
    if "python" in local and _minor(info.python) != _minor(local["python"]):
        wrong.append(
            f"Python {info.python} there, {local['python']} here (the function travels as "
            "bytecode, which runs only on the same Python major.minor)"
        )
    if "nbaccel" in local and info.nbaccel != local["nbaccel"]:
        wrong.append(f"nbaccel {info.nbaccel} there, {local['nbaccel']} here")
    # A CPU build in the kernel may drive CUDA builds on the hosts: compare without +cu121.
    if "torch" in local and _public(info.torch) != _public(local["torch"]):
        wrong.append(f"torch {info.torch} there, {local['torch']} here")
    if wrong:
        return HostFailure(
            host,
            "different versions: " + "; ".join(wrong),
            "Install the kernel's versions on that host (or the host's in the kernel), so "
            "that every process runs the same code.",
        )
    return info


def _ssh_failure(shell: RemoteShell, host: str, stderr: str) -> HostFailure:
    check = f"Check by hand with `{_manual_check(shell, host)}`."
    if "Host key verification failed" in stderr or "IDENTIFICATION HAS CHANGED" in stderr:
        return HostFailure(
            host,
            "its host key is not trusted",
            f"ssh knows no (or another) host key for {host} in known_hosts, and nbaccel never "
            f"accepts one blindly. Connect once by hand (`ssh {host}`) and check the "
            "fingerprint, or add its key with ssh-keyscan to ~/.ssh/known_hosts. " + check,
            stderr,
        )
    if "Permission denied" in stderr or "Too many authentication failures" in stderr:
        return HostFailure(
            host,
            "authentication refused",
            f"ssh must log in without a password: add your public key to "
            f"~/.ssh/authorized_keys on {host} (ssh-copy-id {host}), or name the key with "
            "ssh_options=('-i', '/path/to/key') or an IdentityFile in ~/.ssh/config. " + check,
            stderr,
        )
    if "Could not resolve hostname" in stderr:
        return HostFailure(
            host,
            "unknown host name",
            f"No address is known for {host}: check the spelling, or add a Host entry for it "
            "in ~/.ssh/config (or pass ssh_options=('-F', 'file')). " + check,
            stderr,
        )
    unreachable = ("Connection refused", "timed out", "No route to host", "unreachable")
    if any(text in stderr for text in unreachable):
        return HostFailure(
            host,
            "unreachable (ssh could not connect)",
            f"Check that {host} is up and runs an SSH server, and the port: a Port in "
            "~/.ssh/config or ssh_options=('-p', '2222'). " + check,
            stderr,
        )
    return HostFailure(host, "ssh failed (exit code 255)", check, stderr)


def _failure_message(shell: RemoteShell, failures: Sequence[HostFailure], total: int) -> str:
    head = (
        f"{len(failures)} of {total} host{'s' if total != 1 else ''} cannot run nbaccel, so "
        f"nothing was started (checked through {shell.kind}, with {shell.python}):"
    )
    return "\n".join([head, *(f"- {failure.describe()}" for failure in failures)])


def _manual_check(shell: RemoteShell, host: str) -> str:
    if shell.kind == "srun":
        return shlex.join(["srun", f"--nodelist={host}", "--nodes=1", "--overlap", "hostname"])
    return shlex.join(["ssh", *shell.options, "-o", "BatchMode=yes", host, "true"])


def _last_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-_STDERR_LINES:]


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _public(version: str | None) -> str | None:
    return version.split("+", 1)[0] if version else version
