"""Real-browser tests: JupyterLab on 127.0.0.1, opened in Debian's headless chromium by Playwright.

One JupyterLab server per session, started by ``sys.executable`` (the venv's) in a private
temp folder: its root dir (where the tests write their notebooks), Jupyter config, data,
runtime and IPython dirs, the kernels' TMPDIR, lab settings and workspaces. It listens on
127.0.0.1 only, on a free port, with a random token; the announcements plugin (news and
update checks, which would fetch from the network and pop a notification) is disabled.
At the end the server is shut down through its API, every process it started (kernels,
nbaccel's helper and workers) must be gone, its port closed, and the temp folder is removed.

The browser is ``/usr/bin/chromium`` (``.ci/install-browser`` installs it from Debian);
Playwright never downloads one. Without it the tests skip, or fail under ``CI=true``.

One browser and one browser context per session (JupyterLab's scripts come from its cache
after the first test); each test opens its notebook in a page of its own and a fresh
workspace (``/lab/workspaces/<id>/tree/...?reset``), waits for the kernel to be idle, gives
every wait a deadline, and shuts its kernel down at the end.
Screenshots and, on failure, the page's console log go to ``browser-artifacts/<test>/`` in
the repository (``BROWSER_TEST_ARTIFACTS`` overrides the folder), which outlives the CI
run's temp dir. (Not ``NBACCEL_*`` names: nbaccel rejects unknown variables of its own.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nbformat
import psutil
import pytest

if TYPE_CHECKING:  # imported in the fixtures: without Playwright the tests skip
    from playwright.sync_api import Browser, BrowserContext, Locator, Page

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("BROWSER_TEST_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(os.environ.get("BROWSER_TEST_ARTIFACTS", REPO / "browser-artifacts"))
# Flags that work for Debian's chromium as root in a container (FACTS.md); the last one keeps
# a small /dev/shm (Docker's 64 MB) from crashing the renderer.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
REQUIRED_MODULES = ("playwright", "jupyterlab", "ipywidgets", "nbformat")
ANNOUNCEMENTS_PLUGIN = "@jupyterlab/apputils-extension:announcements"
KERNEL_NAME = "python3"
SERVER_START_S = 90.0
SERVER_STOP_S = 20.0
PROCESS_EXIT_S = 15.0
DEFAULT_WAIT_MS = 30_000


def wait_until(
    condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.2
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Lab:
    """A running JupyterLab server: its URL, token, root dir and REST API."""

    base: Path
    root: Path
    token: str
    process: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0
    url: str = ""

    def api(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}{path.lstrip('/')}",
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no server log)"

    def workspace_url(self, notebook: str) -> str:
        """The notebook in a fresh workspace, so no earlier layout or open tab is restored."""
        workspace = f"nbaccel-test-{uuid.uuid4().hex[:12]}"
        return f"{self.url}lab/workspaces/{workspace}/tree/{notebook}?reset&token={self.token}"

    def kernel_state(self, notebook: str) -> str | None:
        """The execution state of the kernel of ``notebook``'s session (None: no session)."""
        for session in self.api("GET", "api/sessions"):
            if session.get("path") == notebook and session.get("kernel"):
                return str(session["kernel"].get("execution_state"))
        return None

    def write_notebook(self, name: str, sources: list[str]) -> str:
        """Write a notebook of code cells into the server's root dir; returns its path there."""
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {
            "name": KERNEL_NAME,
            "display_name": "Python 3 (ipykernel)",
            "language": "python",
        }
        nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
        nbformat.validate(nb)
        nbformat.write(nb, self.root / name)
        return name


def _start_lab(base: Path) -> Lab:
    root, config = base / "root", base / "config"
    dirs = {
        "JUPYTER_CONFIG_DIR": config,
        "JUPYTER_DATA_DIR": base / "data",
        "JUPYTER_RUNTIME_DIR": base / "runtime",
        "IPYTHONDIR": base / "ipython",
        "JUPYTERLAB_SETTINGS_DIR": base / "lab-settings",
        "JUPYTERLAB_WORKSPACES_DIR": base / "lab-workspaces",
        "TMPDIR": base / "tmp",
    }
    for path in (root, *dirs.values()):
        path.mkdir(parents=True, exist_ok=True)
    (config / "labconfig").mkdir()
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {ANNOUNCEMENTS_PLUGIN: True}})
    )
    env = {**os.environ, **{name: str(path) for name, path in dirs.items()}}
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("MPLBACKEND", None)  # the kernel would hand an inline backend to its children
    env.pop("JUPYTER_TOKEN", None)
    token = secrets.token_hex(24)
    log_path = base / "jupyterlab.log"
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--allow-root",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={_free_port()}",
        "--ServerApp.port_retries=50",  # the real port is read back from the runtime file
        f"--ServerApp.root_dir={root}",
        f"--IdentityProvider.token={token}",
        "--ServerApp.terminals_enabled=False",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a last-resort killpg reaches all
        )
    lab = Lab(base=base, root=root, token=token, process=process, log_path=log_path)
    runtime = dirs["JUPYTER_RUNTIME_DIR"]

    def server_info() -> dict[str, Any] | None:
        if process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {process.returncode}:\n{lab.log_tail()}")
        info_file = runtime / f"jpserver-{process.pid}.json"
        if not info_file.exists():
            return None
        try:
            return dict(json.loads(info_file.read_text()))
        except ValueError:  # being written
            return None

    try:
        info = wait_until(server_info, SERVER_START_S, "JupyterLab's runtime file")
        lab.port = int(info["port"])
        lab.url = f"http://127.0.0.1:{lab.port}/"

        def ready() -> bool:
            try:
                lab.api("GET", "api/status", timeout=5)
                return True
            except (OSError, urllib.error.URLError):
                return False

        wait_until(ready, SERVER_START_S, "JupyterLab's API")
    except BaseException:
        _stop_lab(lab)
        raise
    return lab


def _stop_lab(lab: Lab) -> list[str]:
    """Shut the server down, sweep every process it started; returns what was left behind."""
    try:
        tree = _descendants([psutil.Process(lab.process.pid)])
    except psutil.NoSuchProcess:
        tree = []
    if lab.process.poll() is None and lab.url:
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
            lab.api("POST", "api/shutdown", timeout=10)  # shuts every kernel down, then exits
    try:
        lab.process.wait(SERVER_STOP_S)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(lab.process.pid, sig)
            try:
                lab.process.wait(5)
                break
            except subprocess.TimeoutExpired:
                continue
    # Also whatever left the tree (re-parented) but still works in the server's temp dir.
    tree += [proc for proc in psutil.process_iter() if _works_in(proc, lab.base)]
    port_left = bool(lab.port) and _port_open(lab.port)
    return _reap(tree, also=[f"port {lab.port} still open"] if port_left else [])


def _descendants(procs: list[psutil.Process]) -> list[psutil.Process]:
    found: list[psutil.Process] = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            found += proc.children(recursive=True)
    return found


def _works_in(proc: psutil.Process, folder: Path) -> bool:
    try:
        return proc.pid != os.getpid() and Path(proc.cwd()).is_relative_to(folder)
    except (psutil.Error, OSError):
        return False


def _reap(procs: list[psutil.Process], also: Sequence[str] = ()) -> list[str]:
    """Wait for ``procs`` to exit; kill and name those that do not."""
    leftovers = list(also)
    _, alive = psutil.wait_procs(list(dict.fromkeys(procs)), timeout=PROCESS_EXIT_S)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            leftovers.append(f"pid {proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    return leftovers


@pytest.fixture(scope="session")
def chromium_executable() -> Path:
    """Debian's chromium, and the Python packages: missing ones skip, or fail under CI."""
    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    message = f"missing {', '.join(missing)}: pip install -e '.[dev]'" if missing else ""
    if not message and not os.access(CHROMIUM, os.X_OK):
        message = f"{CHROMIUM} not found: run .ci/install-browser (Debian's chromium)"
    if message and os.environ.get("CI"):
        pytest.fail(message)
    elif message:
        pytest.skip(message)
    return CHROMIUM


@pytest.fixture(scope="session")
def artifacts_root() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / ".gitignore").write_text("*\n")  # a generated folder that ignores itself
    return ARTIFACTS


@pytest.fixture(scope="session")
def lab(chromium_executable: Path, artifacts_root: Path) -> Iterator[Lab]:
    base = Path(tempfile.mkdtemp(prefix="nbaccel-browser-"))
    lab = None
    try:
        lab = _start_lab(base)
        yield lab
    finally:
        leftovers = _stop_lab(lab) if lab is not None else []
        with contextlib.suppress(OSError):
            shutil.copyfile(base / "jupyterlab.log", artifacts_root / "jupyterlab.log")
        shutil.rmtree(base, ignore_errors=True)
        if base.exists():
            leftovers.append(f"temp dir {base} not removed")
    assert not leftovers, "JupyterLab left behind: " + "; ".join(leftovers)


@pytest.fixture(scope="session")
def browser(chromium_executable: Path) -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    before = {proc.pid for proc in psutil.Process().children()}
    with sync_playwright() as playwright:
        drivers = [proc for proc in psutil.Process().children() if proc.pid not in before]
        browser = playwright.chromium.launch(
            executable_path=str(chromium_executable),
            args=CHROMIUM_FLAGS,
            headless=True,
            timeout=60_000,
        )
        try:
            yield browser
        finally:
            driver_and_browser = [*drivers, *_descendants(drivers)]
            browser.close()
    leftovers = _reap(driver_and_browser)  # Playwright's driver and every chromium process
    assert not leftovers, "the browser left behind: " + "; ".join(leftovers)


_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


@dataclass
class LabPage:
    """A browser page on a JupyterLab notebook, with deadline-bound waits."""

    lab: Lab
    page: Page
    artifacts: Path
    console: list[str] = field(default_factory=list)
    notebook: str = ""
    marks: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, what: str) -> None:
        """Note when a phase was reached (``timings.txt`` in the artifacts: slow CI runs)."""
        self.marks.append((what, time.monotonic()))

    def screenshot(self, name: str, part: Locator | None = None) -> Path:
        """The page (or only ``part``, scrolled into view) as ``<artifacts>/<name>.png``."""
        path = self.artifacts / f"{name}.png"
        if part is None:
            self.page.screenshot(path=str(path), full_page=True, timeout=DEFAULT_WAIT_MS)
        else:
            part.screenshot(path=str(path), timeout=DEFAULT_WAIT_MS)
        return path

    def open(self, notebook: str, timeout: float = 60.0) -> None:
        """Open ``notebook`` in a fresh workspace and wait until its kernel is idle."""
        self.notebook = notebook
        self.mark("open")
        self.page.goto(
            self.lab.workspace_url(notebook),
            wait_until="domcontentloaded",
            timeout=timeout * 1000,
        )
        self.panel.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=timeout * 1000)
        self.panel.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]').wait_for(
            timeout=timeout * 1000
        )
        wait_until(
            lambda: self.lab.kernel_state(notebook) == "idle", timeout, "the kernel to be idle"
        )
        self.mark("kernel idle")

    @property
    def panel(self) -> Locator:
        return self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")

    def cell(self, index: int) -> Locator:
        return self.panel.locator(".jp-Notebook .jp-Cell").nth(index)

    def run_all(self) -> None:
        """Run every cell: the menu's Run ▸ Run All Cells."""
        self.page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
        self.page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()
        self.mark("run all")

    def cell_error(self, index: int) -> str | None:
        """The traceback a cell showed, if any (so that a test fails at once, not at a wait)."""
        outputs = self.cell(index).locator(
            '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
        )
        for text in outputs.all_inner_texts():
            if "Traceback" in text or "Error" in text:
                return str(text)
        return None

    def wait_for_output(self, index: int, part: Locator, timeout: float) -> None:
        """Wait until ``part`` is visible in cell ``index``; fail at once if the cell raised."""

        def shown() -> bool:
            error = self.cell_error(index)
            if error is not None:
                raise AssertionError(f"cell {index} raised:\n{error}")
            return part.is_visible()

        wait_until(shown, timeout, f"{part} in the output of cell {index}")

    def body_text(self) -> str:
        return str(self.panel.inner_text(timeout=DEFAULT_WAIT_MS))


@pytest.fixture(scope="session")
def browser_context(browser: Browser) -> Iterator[BrowserContext]:
    """One context for all tests: JupyterLab's scripts load from its cache after the first
    test. Each test still opens its notebook in a page of its own and a fresh workspace."""
    context = browser.new_context(viewport={"width": 1400, "height": 1800})
    context.set_default_timeout(DEFAULT_WAIT_MS)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture
def lab_page(
    request: pytest.FixtureRequest, lab: Lab, browser_context: BrowserContext, artifacts_root: Path
) -> Iterator[LabPage]:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    artifacts = artifacts_root / name
    shutil.rmtree(artifacts, ignore_errors=True)
    artifacts.mkdir(parents=True)
    page = browser_context.new_page()
    lab_page = LabPage(lab=lab, page=page, artifacts=artifacts)
    page.on("console", lambda msg: lab_page.console.append(f"[{msg.type}] {msg.text}"))
    page.on("pageerror", lambda exc: lab_page.console.append(f"[pageerror] {exc}"))
    try:
        yield lab_page
    finally:
        if lab_page.marks:
            start = lab_page.marks[0][1]
            lines = [f"{at - start:6.1f} s  {what}" for what, at in lab_page.marks]
            (artifacts / "timings.txt").write_text("\n".join(lines) + "\n")
        reports = request.node.stash.get(_REPORTS, {})
        if any(report.failed for report in reports.values()):
            with contextlib.suppress(Exception):
                lab_page.screenshot("failure")
            (artifacts / "console.txt").write_text("\n".join(lab_page.console) + "\n")
        # Shut the notebook's kernel down now, so the next test starts from a quiet server.
        with contextlib.suppress(Exception):
            for session in lab.api("GET", "api/sessions"):
                lab.api("DELETE", f"api/sessions/{session['id']}")
        page.close()
