"""A library the helper preloaded and that ``pip install`` then upgraded: the next launch's
workers get the version on disk, and the launch says so once.

Each test drives its own ``python -`` (its own helper) with a private user site-packages
folder (``PYTHONUSERBASE``: one of the interpreter's site folders, so nbaccel counts what is
installed there as installed libraries) on the path of the driver, the helper and the
workers. Two versions of a tiny distribution are installed there by pip from local folders
(``--no-index``: no network).
"""

from __future__ import annotations

import json
import signal
import site
from pathlib import Path

import psutil
import pytest

from tests.multiprocess.conftest import run_script

EXIT_TIMEOUT_S = 60.0  # the helper notices its kernel gone within its poll (1 s); margin

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "{version}"

[tool.setuptools]
packages = ["{name}"]
"""

DRIVER_HEAD = """
import json, os, subprocess, sys
site_dir = {site!r}
sys.path.insert(0, site_dir)             # the workers get the driver's sys.path
os.environ["PYTHONPATH"] = site_dir      # the helper, started below, inherits it
import nbaccel
from nbaccel.launcher.local import helper as helper_module

def install(version):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-build-isolation", "--upgrade", "--target", site_dir,
                    {sources!r}[version]], check=True, capture_output=True)

def launch(fn):
    run = nbaccel.launch(fn, num_processes=2, dashboard="text", runs_dir={runs!r})
    values = run.results(timeout=240)
    return [values[rank] for rank in sorted(values)]

def version():
    import tinylib
    return tinylib.VERSION

def preloaded(name, timeout=60):
    # Until the helper has imported ``name`` (its report covers every offer; bounded).
    helper = helper_module.shared_helper()
    if not helper.wait_preloaded(timeout):
        raise TimeoutError("the helper never reported its preload")
    return helper
"""


def distribution(root: Path, version: str) -> str:
    """A source folder of ``tinylib`` at ``version`` (setuptools builds it offline)."""
    source = root / f"tinylib-{version}"
    (source / "tinylib").mkdir(parents=True)
    (source / "pyproject.toml").write_text(PYPROJECT.format(name="tinylib", version=version))
    (source / "tinylib" / "__init__.py").write_text(f"VERSION = {version!r}\n")
    return str(source)


@pytest.fixture
def user_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "userbase"
    monkeypatch.setenv("PYTHONUSERBASE", str(base))
    # The path site derives from PYTHONUSERBASE (lib/pythonX.Y/site-packages on Linux).
    relative = Path(site.getusersitepackages()).relative_to(site.getuserbase())
    folder = base / relative
    folder.mkdir(parents=True)
    return folder


def drive(tmp_path: Path, folder: Path, body: str) -> tuple[dict[str, object], str]:
    sources = {v: distribution(tmp_path / "sources", v) for v in ("1", "2")}
    head = DRIVER_HEAD.format(site=str(folder), sources=sources, runs=str(tmp_path / "runs"))
    done = run_script(head + body, tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def test_an_upgraded_library_the_workers_imported_is_reloaded(
    tmp_path: Path, user_site: Path
) -> None:
    result, out = drive(
        tmp_path,
        user_site,
        """
install("1")
before = launch(version)            # rank 0 imports tinylib: the helper preloads it
old = preloaded("tinylib")
def held():
    import sys
    return "tinylib" in sys.modules
preloaded_then = launch(held)       # forked from a helper that has it
install("2")                        # what `pip install -U tinylib` in the notebook does
after = launch(version)
again = launch(version)
print(json.dumps({"before": before, "held": preloaded_then, "after": after, "again": again,
                  "kernel": "tinylib" in sys.modules, "replaced": not old.usable,
                  "new": helper_module.shared_helper().pid != old.pid}))
""",
    )
    assert result["before"] == ["1", "1"]
    assert result["held"] == [True, True]  # it was preloaded: what could go stale did
    assert result["after"] == ["2", "2"]  # a fresh interpreter's answer (and Accelerate's)
    assert result["again"] == ["2", "2"]
    assert result["kernel"] is False
    assert result["replaced"] is True and result["new"] is True
    assert out.count("nbaccel: reloaded: tinylib (changed on disk)") == 1
    assert "the kernel" not in out.split("reloaded: tinylib")[1].splitlines()[0]


def test_the_replacement_is_forked_with_torch_and_ends_with_its_kernel(
    tmp_path: Path, user_site: Path
) -> None:
    # The stale helper's base (forked before its first preload) becomes the new helper:
    # not a fresh interpreter started by the driver. When the driver is killed, it goes too.
    sources = {v: distribution(tmp_path / "sources", v) for v in ("1", "2")}
    head = DRIVER_HEAD.format(site=str(user_site), sources=sources, runs=str(tmp_path / "runs"))
    body = """
import psutil, signal
install("1")
launch(version)
old = preloaded("tinylib")
install("2")
new = helper_module.shared_helper()
after = launch(version)
# Its own base, forked outside its tree (successor.fork_base), must go with it too.
tree = [new.pid, new._base] + [p.pid for p in psutil.Process(new.pid).children(recursive=True)]
print(json.dumps({"after": after, "forked": psutil.Process(new.pid).ppid() != os.getpid(),
                  "torch": "torch" in sys.modules, "tree": tree}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = run_script(head + body, tmp_path, timeout=400)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["after"] == ["2", "2"]
    assert result["forked"] is True
    assert result["torch"] is False  # nothing of this imported torch into the driver
    tree = [psutil.Process(pid) for pid in result["tree"] if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(tree, timeout=EXIT_TIMEOUT_S)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
