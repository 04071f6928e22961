"""Two "machines" on one: a real OpenSSH server (Debian's openssh-server) listening on
127.0.0.2 and 127.0.0.3 (Linux routes all of 127/8 to the loopback), with a throwaway host
key and user key. Used by the tests' ``ssh_hosts`` fixture (conftest.py) and by
``benchmarks/multi_host_launch.py``; imports nothing of pytest.

Host key checking stays on: the server's known_hosts holds its host key for both addresses,
and an ssh config (passed as ``-F file``, so the user's own ~/.ssh/config plays no part)
says ``StrictHostKeyChecking yes``. Callers run the remote Python by its absolute path
(sys.executable), so sshd needs to pass no environment.

``serve(folder)`` starts the server with its keys and files in ``folder`` and stops it at
the end of the ``with`` block::

    with serve(Path(tempfile.mkdtemp())) as ssh:
        subprocess.run(["ssh", *ssh.ssh_options, ssh.hosts[0], "true"], check=True)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
ADDRESSES = ("127.0.0.2", "127.0.0.3")
START_TIMEOUT = 15.0


@dataclass(frozen=True)
class SshHosts:
    """The running server: its two host addresses, the port both listen on, and the ssh
    options that log in there (``("-F", config)``)."""

    hosts: tuple[str, str]
    port: int
    folder: Path
    user_key: Path
    known_hosts: Path
    ssh_options: tuple[str, ...]

    def options(
        self, *, identity: Path | None = None, known_hosts: Path | None = None
    ) -> tuple[str, ...]:
        """ssh options like ``ssh_options``, with another key or known_hosts file."""
        identity = identity or self.user_key
        known_hosts = known_hosts or self.known_hosts
        path = self.folder / f"ssh_config-{identity.name}-{known_hosts.name}"
        return ("-F", str(write_ssh_config(path, self.port, identity, known_hosts)))


def write_ssh_config(path: Path, port: int, identity: Path, known_hosts: Path) -> Path:
    path.write_text(
        "Host *\n"
        f"  Port {port}\n"
        f"  IdentityFile {identity}\n"
        # Only that key: not the tester's ssh agent, not ~/.ssh/id_*.
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {known_hosts}\n"
        "  GlobalKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking yes\n"
    )
    return path


def free_port_on_both() -> int:
    """A port free on both addresses (one sshd listens on both, with one ssh -p for both)."""
    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind((ADDRESSES[0], 0))
            port = first.getsockname()[1]
            try:
                second.bind((ADDRESSES[1], port))
            except OSError:
                continue
            return int(port)
    raise RuntimeError(f"no port free on both {ADDRESSES} after 50 tries")


def keygen(path: Path) -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
        timeout=30,
    )
    return path


class ServerLog:
    """Drains sshd's stderr (so the pipe never fills) and tells when it listens on both."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.listening = threading.Event()
        self._process = process
        self._thread = threading.Thread(target=self._read, name="sshd-log", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._process.stderr is not None
        waiting = {f"Server listening on {address} " for address in ADDRESSES}
        for line in self._process.stderr:
            self.lines.append(line.rstrip())
            waiting = {w for w in waiting if not line.startswith(w)}
            if not waiting:
                self.listening.set()
        self.listening.set()  # sshd ended: wake the waiter, which then sees it has exited

    def text(self) -> str:
        return "\n".join(self.lines[-30:])


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[SshHosts]:
    """Run sshd on both addresses with keys and files in ``folder`` (left there) until the
    block ends; raises RuntimeError with sshd's log if it does not start listening."""
    host_key, user_key = keygen(folder / "host_key"), keygen(folder / "user_key")
    shutil.copy(f"{user_key}.pub", folder / "authorized_keys")
    port = free_port_on_both()
    public = " ".join((folder / "host_key.pub").read_text().split()[:2])
    known_hosts = folder / "known_hosts"
    known_hosts.write_text("".join(f"[{a}]:{port} {public}\n" for a in ADDRESSES))
    config = folder / "sshd_config"
    config.write_text(
        "".join(f"ListenAddress {a}:{port}\n" for a in ADDRESSES) + f"HostKey {host_key}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        # PAM would want a system account set-up; the tmp folder's modes are not sshd's.
        "UsePAM no\n"
        "StrictModes no\n"
        # The tests run as root in CI; keys only, as a real server would allow.
        "PermitRootLogin prohibit-password\n"
        "PidFile none\n"
        "PrintMotd no\n"
        "LogLevel INFO\n"
    )
    if os.geteuid() == 0:
        # sshd running as root needs its privilege separation folder, which Debian's service
        # start creates (there is no service here).
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    process = subprocess.Popen(
        [SSHD, "-f", str(config), "-D", "-e"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = ServerLog(process)
    try:
        if not log.listening.wait(START_TIMEOUT) or process.poll() is not None:
            raise RuntimeError(
                f"sshd did not start listening on {ADDRESSES} port {port} within "
                f"{START_TIMEOUT:g} s (exit code {process.poll()}):\n{log.text()}"
            )
        options = ("-F", str(write_ssh_config(folder / "ssh_config", port, user_key, known_hosts)))
        yield SshHosts(ADDRESSES, port, folder, user_key, known_hosts, options)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
