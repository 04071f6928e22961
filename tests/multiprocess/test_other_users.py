"""What another local user can and cannot do. Permission bits do not stop root, so as root
(CI) the other user's side runs as 'nobody' through util-linux's setpriv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbaccel.launcher import control
from nbaccel.launcher.xla.supervisor import Handout

pytestmark = pytest.mark.timeout(120)


def as_another_user() -> list[str]:
    """The command prefix that runs a program as the 'nobody' user (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a program as another user (CI runs as root)")
    if shutil.which("setpriv") is None:
        pytest.skip("needs util-linux's setpriv")
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temp folder other users can search (pytest's tmp_path is private to its owner)."""
    # Under /tmp itself: a test run's own TMPDIR may be private (CI's is 0700).
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-perm-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    for path in folder.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)
    shutil.rmtree(folder)


NOT_WRITABLE = """
import nbaccel, sys
def train():
    return 1
try:
    nbaccel.launch(train, runs_dir=sys.argv[1] + "/runs", **eval(sys.argv[2]))
except nbaccel.ConfigError as error:
    print("REFUSED", error.field, error)
"""


@pytest.mark.parametrize("field", ["runs_dir", "project_dir"])
def test_folders_this_user_cannot_write_are_refused(shared_tmp: Path, field: str) -> None:
    prefix = as_another_user()
    locked = shared_tmp / "locked"
    locked.mkdir(mode=0o555)
    locked.chmod(0o555)
    home = shared_tmp / "home"
    home.mkdir()
    home.chmod(0o777)
    target = str(locked) if field == "runs_dir" else str(home)
    extra = {} if field == "runs_dir" else {"project_dir": str(locked / "project")}
    env = {**os.environ, "NBACCEL_HOME": str(home), "HF_HOME": str(home), "HOME": str(home)}
    result = subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(NOT_WRITABLE), target, repr(extra)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=home,
    )
    assert f"REFUSED {field}" in result.stdout, result.stdout + result.stderr
    assert list(locked.iterdir()) == []
    assert not (home / "runs").exists()


ASK_FOR_RANK_0 = """
import socket, sys
from nbaccel.launcher import control
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect("\\0" + sys.argv[1])
try:
    control.send(conn, {"rank": 0})
    message, fds = control.receive(conn)
except OSError:  # closed on us
    message, fds = None, []
print("GOT", message, len(fds))
"""


def test_the_xla_handout_serves_only_this_user(shared_tmp: Path) -> None:
    # torch_xla's workers fetch their rank's payload and pipes from the supervisor over an
    # abstract Unix socket, whose name any local user can read in /proc/net/unix.
    prefix = as_another_user()
    read_end, write_end = os.pipe()
    payload = shared_tmp / "payload"
    payload.write_bytes(b"the user's function and data")
    with open(payload, "rb") as payload_file:
        handout = Handout(
            [{"secret": "rank 0's request"}], payload_file.fileno(), [(write_end, write_end)]
        )
        try:
            name = handout.address[1:]
            stranger = subprocess.run(
                [*prefix, sys.executable, "-c", textwrap.dedent(ASK_FOR_RANK_0), name],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
                cwd=shared_tmp,
            )
            assert "GOT None 0" in stranger.stdout, stranger.stdout + stranger.stderr
            assert handout.connected == set()
            # The same user (a torch_xla worker) still gets it.
            with socket_to(handout.address) as conn:
                control.send(conn, {"rank": 0})
                message, fds = control.receive(conn)
                for fd in fds:
                    os.close(fd)
            assert message == {"secret": "rank 0's request"} and len(fds) == 3
        finally:
            handout.close()
            os.close(read_end)
            os.close(write_end)


def socket_to(address: str):  # type: ignore[no-untyped-def]
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(30)
    conn.connect(address)
    return conn


ATTACH_AS_STRANGER = """
import socket, sys
for request in (b"follow\\n", b"stop\\n"):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    conn.connect("\\0" + sys.argv[1])
    try:
        conn.sendall(request)
        got = conn.recv(1 << 16)
    except OSError:  # closed on us
        got = b""
    print("GOT", len(got))
"""


class FakeRun:
    """Just what the attach server uses of a Run."""

    def __init__(self) -> None:
        self.subscribers: list = []
        self.stops = 0

    def subscribe(self, subscriber) -> None:  # type: ignore[no-untyped-def]
        self.subscribers.append(subscriber)

    def stop(self) -> None:
        self.stops += 1


def test_a_detached_runs_attach_channel_serves_only_this_user(shared_tmp: Path) -> None:
    # The supervisor's abstract socket name is listed in /proc/net/unix for every user.
    from nbaccel.events import Metric
    from nbaccel.frames import FrameDecoder
    from nbaccel.launcher.detached.attach_server import AttachServer

    prefix = as_another_user()
    server, run = AttachServer(), FakeRun()
    server.show(run, 0)  # type: ignore[arg-type]
    run.subscribers[0](Metric(0, 7, {"loss": 0.5}, 0.0))
    try:
        stranger = subprocess.run(
            [
                *prefix,
                sys.executable,
                "-c",
                textwrap.dedent(ATTACH_AS_STRANGER),
                server.address[1:],
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=shared_tmp,
        )
        assert stranger.stdout.split("\n")[:2] == ["GOT 0", "GOT 0"], (
            stranger.stdout + stranger.stderr
        )
        assert run.stops == 0
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mine:  # this user is served
            mine.settimeout(30)
            mine.connect(server.address)
            mine.sendall(b"follow\n")
            [message] = FrameDecoder().feed(mine.recv(1 << 16))
        assert message == {"event": Metric(0, 7, {"loss": 0.5}, 0.0)}
    finally:
        server.close()
