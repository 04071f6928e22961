"""Every example notebook in notebooks/ runs headless, and its widgets show what they should.

Each notebook runs in a fresh kernel, in a temporary copy of the notebooks folder (its cwd,
so ``nbaccel_runs/`` lands there), through nbclient with widget state stored, as a saved
notebook keeps it. Notebooks whose metadata says ``nbaccel.requires`` is "gpu" or "tpu" are
skipped here. Cells tagged ``raises-exception`` must raise (they demonstrate a failure);
every other cell must not.

Then each notebook's own check reads what the widgets received: the stored widget state
(found from a cell's displayed dashboard through its children, by the ``nbaccel-*`` CSS
classes the dashboard gives its parts: header, log, errors, curve, memory), every widget
update that reached the frontend while the cell ran (to count the loss curve's PNG frames),
the static summary left in the cell's outputs, and the cells' ordinary results.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import html
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
ACCELERATORS = {"gpu", "tpu"}
CELL_TIMEOUT = 300
PNG = b"\x89PNG\r\n\x1a\n"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _requirements(nb: Any) -> set[str]:
    required = nb.metadata.get("nbaccel", {}).get("requires", [])
    return {required} if isinstance(required, str) else set(required)


def _params() -> list[Any]:
    params = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        needs = _requirements(nbformat.read(path, as_version=4)) & ACCELERATORS
        marks = [pytest.mark.skip(reason=f"needs {', '.join(sorted(needs))}")] if needs else []
        params.append(pytest.param(path.name, marks=marks, id=path.stem))
    return params


def test_notebooks_folder_has_examples() -> None:
    names = {path.stem for path in NOTEBOOKS.glob("*.ipynb")}
    assert names >= {
        "01_quickstart_cpu",
        "02_config_panel",
        "03_precision_and_sharding",
        "04_resume_from_checkpoint",
        "05_accelerate_code_unchanged",
        "06_colab_tpu",
        "07_long_runs",
        "08_interactive",
        "09_debugging",
        "10_survive_the_machine",
        "11_after_training",
        "12_sweeps",
    }, names


def test_committed_notebooks_have_no_outputs() -> None:
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert "widgets" not in nb.metadata, f"{path.name}: saved widget state"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs, f"{path.name}: cell {cell.id} has saved outputs"
                assert cell.execution_count is None, f"{path.name}: cell {cell.id} was run"


def test_tpu_notebook_is_marked_and_says_what_it_needs() -> None:
    nb = nbformat.read(NOTEBOOKS / "06_colab_tpu.ipynb", as_version=4)
    assert _requirements(nb) == {"tpu"}  # so the run test skips it
    code = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    prose = "".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")
    assert "pip install" in code[0] and "!nbaccel env" in code
    assert any(
        'notebook_launcher(train, num_processes=None, mixed_precision="bf16")' in c for c in code
    )
    assert any('strategy="fsdp"' in c for c in code)  # FSDPv2: SPMD in one process
    assert "cuda" not in "".join(code).lower()
    for said in ("v5e", "torch_xla 2.9", "Python 3.13", "Kaggle", "torch_xla 2.8", "SPMD"):
        assert said in prose, said
    assert "do not touch the XLA device" in prose


def test_binder_installs_the_torch_ci_tests() -> None:
    """Binder's image: the CPU wheel of the torch CI pins, and nbaccel's notebook extra."""

    def lines(path: Path) -> list[str]:
        text = path.read_text().splitlines()
        return [line.split("#")[0].strip() for line in text if line.split("#")[0].strip()]

    locked = lines(ROOT / "requirements/ci.txt")
    (ci_torch,) = [line for line in locked if line.startswith("torch==")]
    version = ci_torch.split("==")[1].split("+")[0]  # the lock pins the local CPU build
    binder = lines(ROOT / "binder/requirements.txt")
    assert f"torch=={version}+cpu" in binder, binder
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in binder, binder
    assert "-e .[notebook]" in binder, binder
    assert (ROOT / "binder/runtime.txt").read_text().strip().startswith("python-3.")


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Update:
    """One widget message the frontend received: its cell, widget, changed traits, buffers."""

    cell: int
    model_id: str
    names: frozenset[str]
    buffers: dict[str, str]  # trait -> sha256 of its bytes (PNG frames)


@dataclass
class Restart:
    """What the harness saw when it restarted the kernel before a ``restart-kernel-before``
    cell: the old kernel's pid, and the detached supervisors it had started."""

    old_kernel: int
    supervisors: list[psutil.Process]
    old_kernel_gone: bool
    supervisors_alive: bool


def _recording_client(updates: list[Update], restarts: list[Restart]) -> type[NotebookClient]:
    class RecordingClient(NotebookClient):  # type: ignore[misc]
        async def async_execute_cell(
            self, cell: Any, cell_index: int, *args: Any, **kwargs: Any
        ) -> Any:
            if "restart-kernel-before" in cell.metadata.get("tags", []):
                await self._restart_kernel()
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

        async def _restart_kernel(self) -> None:
            """Kill the kernel as Kernel -> Restart does (its process group, SIGKILL)."""
            old = psutil.Process(self.km.provisioner.pid)
            supervisors = [
                child
                for child in old.children()
                if "nbaccel.launcher.detached.supervisor_main" in " ".join(child.cmdline())
            ]
            await self.km.restart_kernel(now=True)
            await self.kc.wait_for_ready(timeout=self.startup_timeout)
            gone = not old.is_running() or old.status() == psutil.STATUS_ZOMBIE
            alive = all(p.is_running() for p in supervisors)
            restarts.append(Restart(old.pid, supervisors, gone, alive))

        def handle_comm_msg(self, outs: Any, msg: dict[str, Any], cell_index: int) -> None:
            data = msg["content"].get("data", {})
            if "state" in data:
                paths = data.get("buffer_paths") or []
                buffers = {
                    path[0]: hashlib.sha256(bytes(buffer)).hexdigest()
                    for path, buffer in zip(paths, msg.get("buffers") or [], strict=False)
                }
                comm_id = msg["content"]["comm_id"]
                updates.append(Update(cell_index, comm_id, frozenset(data["state"]), buffers))
            super().handle_comm_msg(outs, msg, cell_index)

    return RecordingClient


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", _params())
def test_example_notebook_runs(name: str, cells: Any, kernel_dirs: Path, tmp_path: Path) -> None:
    folder = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, folder)
    nb = nbformat.read(folder / name, as_version=4)
    if name == "07_long_runs.ipynb":
        _another_notebooks_run(folder)  # notebook 07's clean-up must leave it
    kernel_tmp = kernel_dirs / "tmp"
    before = set(kernel_tmp.iterdir())
    updates: list[Update] = []
    restarts: list[Restart] = []
    # allow_errors=False: nbclient raises CellExecutionError at the first unexpected error.
    cells.execute(
        nb,
        folder,
        timeout=CELL_TIMEOUT,
        allow_errors=False,
        client_class=_recording_client(updates, restarts),
    )
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "raises-exception" in cell.metadata.get("tags", []):
            assert cells.errors(cell), f"cell {cell.id} should demonstrate an error, raised none"
        else:
            cells.assert_ok(cell)
    # What a notebook writes stays in its run folder or in a temp folder it removes.
    assert {p.name for p in folder.iterdir() if p.suffix != ".ipynb"} <= {"nbaccel_runs"}
    left = [p.name for p in set(kernel_tmp.iterdir()) - before if p.name.startswith("nbaccel-")]
    assert not left, f"{name} left temp folders behind: {left}"
    check = CONTENT_CHECKS.get(name)
    if check is not None:
        check(Widgets(nb, updates, restarts, stored=name not in CLOSED_WIDGETS), cells, folder)


# --------------------------------------------------------------------------- reading widgets


class Widgets:
    """A run notebook's stored widget state and the updates received, read per cell."""

    def __init__(
        self, nb: Any, updates: list[Update], restarts: list[Restart], *, stored: bool = True
    ) -> None:
        self.nb = nb
        self.restarts = restarts
        self.updates = updates
        saved = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
        assert saved or not stored, "no widget state stored: did the cells block until the end?"
        self.state: dict[str, dict[str, Any]] = saved

    def cell_index(self, cell_id: str) -> int:
        return next(i for i, cell in enumerate(self.nb.cells) if cell.get("id") == cell_id)

    def _shown(self, outputs: list[Any]) -> Iterator[str]:
        """Model ids of the widgets displayed in these outputs, and of all their descendants
        (children, and what Output widgets among them display)."""
        pending = [
            out.data[WIDGET_VIEW]["model_id"]
            for out in outputs
            if out.get("output_type") == "display_data" and WIDGET_VIEW in out.get("data", {})
        ]
        seen: set[str] = set()
        while pending:
            model_id = pending.pop()
            if model_id in seen or model_id not in self.state:
                continue
            seen.add(model_id)
            yield model_id
            state = self.state[model_id]["state"]
            pending += [child.removeprefix("IPY_MODEL_") for child in state.get("children", [])]
            pending += list(self._shown(state.get("outputs", [])))

    def dashboards(self, cell_id: str) -> list[dict[str, str]]:
        """Each dashboard shown by a cell (in its outputs or inside a displayed panel):
        ``{part class: model id}``, parts named by their CSS class without ``nbaccel-``."""
        cell = next(c for c in self.nb.cells if c.get("id") == cell_id)
        found = []
        for model_id in self._shown(cell.outputs):
            if "nbaccel-dashboard" not in self.classes(model_id):
                continue
            parts = {}
            for part in self._shown([_view(model_id)]):
                for cls in self.classes(part):
                    if cls.startswith("nbaccel-"):
                        parts[cls.removeprefix("nbaccel-")] = part
            found.append(parts)
        return found

    def dashboard(self, cell_id: str) -> dict[str, str]:
        shown = self.dashboards(cell_id)
        assert len(shown) == 1, f"cell {cell_id} shows {len(shown)} dashboards"
        return shown[0]

    def classes(self, model_id: str) -> list[str]:
        return list(self.state[model_id]["state"].get("_dom_classes", []))

    def value(self, model_id: str) -> Any:
        return self.state[model_id]["state"].get("value")

    def text(self, model_id: str) -> str:
        """An HTML widget's value as the reader sees it: tags dropped, entities decoded."""
        raw = re.sub(r"<br\s*/?>", "\n", str(self.value(model_id) or ""))
        return html.unescape(re.sub(r"<[^>]+>", "", raw))

    def png(self, model_id: str) -> bytes:
        """The bytes an Image widget holds in the stored state."""
        buffers = self.state[model_id].get("buffers", [])
        data = next((b["data"] for b in buffers if b["path"] == ["value"]), "")
        return base64.b64decode(data)

    def frames(self, model_id: str, cell_id: str) -> list[str]:
        """The distinct PNGs an Image widget received while the cell ran, in order."""
        index = self.cell_index(cell_id)
        frames: list[str] = []
        for update in self.updates:
            digest = update.buffers.get("value")
            ours = update.cell == index and update.model_id == model_id
            if ours and digest and (not frames or frames[-1] != digest):
                frames.append(digest)
        return frames


def _view(model_id: str) -> Any:
    view = {"output_type": "display_data", "data": {WIDGET_VIEW: {"model_id": model_id}}}
    return nbformat.from_dict(view)


def _summary(cell: Any) -> tuple[str, bytes]:
    """The static summary a finished dashboard leaves in its cell: text, and a PNG."""
    texts, images = [], []
    for out in cell.outputs:
        data = out.get("data", {})
        if out.get("output_type") != "display_data" or WIDGET_VIEW in data:
            continue
        if "image/png" in data:
            images.append(base64.b64decode(data["image/png"]))
        elif data.get("text/plain", "").startswith("nbaccel run "):
            texts.append(data["text/plain"])
    assert len(texts) == 1, f"cell {cell.id}: {len(texts)} summary texts"
    return texts[0], images[0] if images else b""


def _log_lines(widgets: Widgets, dashboard: dict[str, str]) -> list[str]:
    return [line for line in widgets.text(dashboard["log"]).split("\n") if line.strip()]


def _memory_mib(widgets: Widgets, dashboard: dict[str, str]) -> dict[str, float]:
    """Peak memory per device from the dashboard's memory text, in MiB. (The current value
    reads "n/a" when the last sample came after the workers exited.)"""
    units = {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}
    found = {}
    for line in widgets.text(dashboard["memory-text"]).split("\n"):
        reading = r"\s*(.+?): (?:n/a|[\d.]+ \w+) (?:now|last) · ([\d.]+) (KiB|MiB|GiB) peak"
        match = re.match(reading, line)
        if match:
            found[match.group(1)] = float(match.group(2)) * units[match.group(3)]
    return found


def _assert_live_dashboard(
    widgets: Widgets,
    cell: Any,
    *,
    state: str = "succeeded",
    min_frames: int = 2,
    memory: bool = True,
) -> dict[str, str]:
    """A finished dashboard that received what a live run sends: header, frames, memory,
    and the summary left in the cell. ``memory=False`` for runs shorter than the memory
    sampler's 1-s interval, which may end before the first reading."""
    dashboard = widgets.dashboard(cell.id)
    header = widgets.text(dashboard["header"])
    assert header.startswith(state) and "2 processes" in header, header
    frames = widgets.frames(dashboard["curve"], cell.id)
    assert len(frames) >= min_frames, f"cell {cell.id}: {len(frames)} curve frames"
    assert widgets.png(dashboard["curve"]).startswith(PNG)
    text, image = _summary(cell)
    assert f": {state}" in text, text
    assert image.startswith(PNG), f"cell {cell.id}: no summary image"
    if memory:
        assert widgets.png(dashboard["memory"]).startswith(PNG)
        peaks = _memory_mib(widgets, dashboard)
        assert set(peaks) == {"rank 0 (cpu)", "rank 1 (cpu)"}, peaks
        assert all(mib > 50 for mib in peaks.values()), peaks  # a worker with torch loaded
        assert "memory rank 1 (cpu)" in text, text
    return dashboard


# --------------------------------------------------------------------------- per notebook


def _check_quickstart(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    # The blocking launch returned rank 0's dict, and training found y = 2x - 1.
    launch = cells.cell(nb, "launch")
    result = ast.literal_eval(cells.result(launch))
    assert result["weight"] == pytest.approx(2.0, abs=0.05), result
    assert result["bias"] == pytest.approx(-1.0, abs=0.05), result
    assert result["final_loss"] < 0.01, result
    assert not cells.stream(launch), "the dashboard should replace the text output"

    dashboard = _assert_live_dashboard(widgets, launch, min_frames=3)
    header = widgets.text(dashboard["header"])
    assert "step 120/120" in header and "steps/s" in header, header
    log = _log_lines(widgets, dashboard)
    assert log[0] == "rank 0 of 2: 256 samples", log
    assert log[-1].startswith("rank 0 done: weight 2.0"), log
    bars = [line for line in log if line.startswith("training:")]
    assert len(bars) == 1 and "120/120" in bars[0], log  # the \r redraws became one line
    assert not any(line.startswith("rank 1") for line in log), log
    # Ended: Stop is greyed out and says so, and the note on how to stop a blocking call
    # (the kernel's interrupt) went with the run.
    stop = widgets.state[dashboard["stop"]]["state"]
    assert stop["description"] == "Ended" and stop["disabled"], stop
    assert not widgets.text(dashboard["stop-note"]), widgets.text(dashboard["stop-note"])
    text, _ = _summary(launch)
    assert "loss: last" in text and "step 120/120" in text, text
    assert "\n  rank 0 done: weight 2.0" in text, text  # rank 0's last lines stay saved

    run = cells.cell(nb, "launch-run")
    assert cells.result(run) == "<RunState.SUCCEEDED: 'succeeded'>"
    assert cells.stream(run).startswith("<nbaccel.Run ")
    run_dashboard = _assert_live_dashboard(widgets, run)
    assert not widgets.text(run_dashboard["stop-note"]), "launch() has a working Stop button"

    metrics = ast.literal_eval(cells.result(cells.cell(nb, "metrics")))
    assert [m["step"] for m in metrics] == [97, 98, 99], metrics
    assert all(m["loss"] > 0 for m in metrics), metrics
    assert "100 records" in cells.stream(cells.cell(nb, "metrics"))

    logs = cells.cell(nb, "logs")
    assert "rank 1 of 2: 256 samples" in cells.stream(logs)
    files = ast.literal_eval(cells.result(logs))
    assert {"rank0.log", "rank1.log", "events.jsonl"} <= set(files), files

    failure = cells.cell(nb, "failure")
    [error] = cells.errors(failure)
    assert error.ename == "RuntimeError", error.evalue
    assert error.evalue.startswith("[rank 1] "), error.evalue
    assert "shapes cannot be multiplied" in error.evalue
    text = cells.strip_ansi("\n".join(error.traceback))
    assert "Traceback from rank 1" in text, text
    remote = text[text.index("Traceback from rank 1") :].split("direct cause")[0]
    assert "loss = model(torch.randn(8, features)).pow(2).mean()" in remote, text
    # A run this short (< dashboard_after) may end before its widgets: its summary says it.
    summary, _ = _summary(failure)
    assert "failed" in summary.splitlines()[0], summary
    assert "error: RuntimeError: [rank 1] " in summary and "cannot be multiplied" in summary
    for failed in widgets.dashboards("failure"):  # the widgets, if it ran longer
        assert widgets.text(failed["header"]).startswith("failed")
        shown_error = widgets.text(failed["errors"])
        assert "rank 1 failed" in shown_error, shown_error
        assert "loss = model(torch.randn(8, features)).pow(2).mean()" in shown_error, shown_error

    plain = cells.cell(nb, "text")
    assert not widgets.dashboards("text"), "dashboard=False showed widgets"
    screen = cells.screen_lines(cells.stream(plain))
    assert "rank 0 of 2: 256 samples" in screen, screen
    assert "[rank 1] rank 1 of 2: 256 samples" in screen, screen
    assert any(line.startswith("training: 100%") and "20/20" in line for line in screen), screen

    assert cells.result(cells.cell(nb, "torch-free")) == "False"
    # runs_dir defaults to the cwd (a run folder holds its config.json; caches sit beside)
    assert len(list((folder / "nbaccel_runs").glob("*/config.json"))) == 4


def _check_config_panel(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    panel_ids = list(widgets._shown(cells.cell(nb, "panel").outputs))
    by_class = {cls: mid for mid in panel_ids for cls in widgets.classes(mid)}
    assert "nbaccel-config-panel" in by_class, "the panel was not displayed"
    # The panel shows the final choice: FSDP full shard, bf16, and its memory estimate.
    assert "2.01 MiB per device" in widgets.text(by_class["nbaccel-panel-memory"])
    assert "succeeded" in widgets.text(by_class["nbaccel-panel-status"])

    choose = cells.stream(cells.cell(nb, "choose"))
    assert "'strategy': 'fsdp'" in choose and "'mixed_precision': 'bf16'" in choose, choose
    assert "estimate: 2.01 MiB per device: parameters 0.50, gradients 0.50" in choose, choose
    invalid = cells.stream(cells.cell(nb, "invalid"))
    assert "HYBRID_SHARD" in invalid and "Launch disabled: True" in invalid, invalid
    assert "after the fix: no problems | Launch disabled: False" in invalid, invalid

    # The Launch button's dashboard lives in the panel (its Output widget), not the cell.
    launch = cells.cell(nb, "launch")
    assert ast.literal_eval(cells.result(launch))["strategy"] == "FSDP"
    [inside] = widgets.dashboards("panel")
    header = widgets.text(inside["header"])
    assert header.startswith("succeeded") and "fsdp · bf16" in header, header
    assert widgets.frames(inside["curve"], "launch"), "no curve frame reached the panel"
    assert set(_memory_mib(widgets, inside)) == {"rank 0 (cpu)", "rank 1 (cpu)"}

    blocking = cells.cell(nb, "blocking")
    report = ast.literal_eval(cells.result(blocking))
    assert report["strategy"] == "FSDP" and report["precision"] == "bf16", report
    _assert_live_dashboard(widgets, blocking, min_frames=1, memory=False)  # a 1-s run

    save = cells.stream(cells.cell(nb, "save"))
    assert "mixed_precision: bf16" in save, save
    assert "the file gives the panel's config: True" in save, save
    command = cells.stream(cells.cell(nb, "command"))
    assert command.startswith("nbaccel launch --num_processes 2"), command
    assert "--strategy fsdp" in command and "--mixed_precision bf16" in command, command


def _check_precision_and_sharding(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    comparison = ast.literal_eval(cells.result(cells.cell(nb, "compare")))
    assert set(comparison) == {"DDP", "ZeRO-1", "FSDP full shard"}, comparison
    for name, parts in comparison.items():
        for part, ratio in parts.items():
            assert ratio == pytest.approx(1.0, abs=0.02), (name, part, ratio)
    table = cells.stream(cells.cell(nb, "compare"))
    losses = {
        line.split()[0]: float(line.split()[-1])
        for line in table.splitlines()
        if line.startswith(("DDP", "ZeRO-1", "FSDP"))
    }
    assert len(set(losses.values())) == 1, f"sharding changed the training: {losses}"
    precision = cells.stream(cells.cell(nb, "launch-bf16"))
    fp32 = r"DDP +computes in torch.float32 +parameters: Parameter torch.float32"
    bf16 = r"DDP, bf16 +computes in torch.bfloat16 +parameters: Parameter torch.float32"
    assert re.search(fp32, precision) and re.search(bf16, precision), precision
    for cell_id, label in (
        ("launch-ddp", "ddp · fp32"),
        ("launch-bf16", "ddp · bf16"),
        ("launch-zero1", "ddp · fp32"),
        ("launch-fsdp", "fsdp · fp32"),
    ):
        # The first launch starts the helper and lasts long enough for memory readings.
        first = cell_id == "launch-ddp"
        cell = cells.cell(nb, cell_id)
        dashboard = _assert_live_dashboard(widgets, cell, min_frames=1, memory=first)
        assert label in widgets.text(dashboard["header"]), widgets.text(dashboard["header"])
        assert "step 39" in widgets.text(dashboard["log"])


def _check_resume(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    reference = ast.literal_eval(cells.result(cells.cell(nb, "reference")))
    resumed = ast.literal_eval(cells.result(cells.cell(nb, "resume")))
    assert reference == resumed and reference["step"] == 40, (reference, resumed)
    interrupt = cells.cell(nb, "interrupt")
    assert cells.result(interrupt) == "<RunState.CANCELLED: 'cancelled'>"
    stopped = widgets.dashboard("interrupt")
    assert widgets.text(stopped["header"]).startswith("cancelled")
    assert "step 20: checkpoint saved" in widgets.text(stopped["log"])
    assert "step 30" not in widgets.text(stopped["log"])
    resume_log = widgets.text(widgets.dashboard("resume")["log"])
    assert re.search(r"resumed from \S+checkpoint at step 20", resume_log), resume_log
    compare = cells.stream(cells.cell(nb, "compare"))
    assert "steps 21-40 logged after the resume" in compare, compare
    assert "identical losses: True | identical weights: True" in compare, compare


def _check_accelerate(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    launch = cells.cell(nb, "launch")
    report = ast.literal_eval(cells.result(launch))
    assert report["distributed_type"] == "DistributedType.MULTI_CPU", report
    assert report["num_processes"] == 2 and report["batches_per_rank"] == 16, report
    assert report["mixed_precision"] == "bf16" and report["computed_in"] == "torch.bfloat16"
    assert report["gradient_accumulation_steps"] == 2, report
    assert report["final_loss"] < 0.5, report
    dashboard = widgets.dashboard("launch")
    log = _log_lines(widgets, dashboard)
    assert [line for line in log if line.startswith("epoch 2: loss")], log
    bars = [line for line in log if line.startswith("epoch 2:") and "16/16" in line]
    assert len(bars) == 1, log
    assert set(_memory_mib(widgets, dashboard)) == {"rank 0 (cpu)", "rank 1 (cpu)"}
    text, _ = _summary(launch)
    assert ": succeeded" in text, text


def _check_long_runs(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    launched = cells.stream(cells.cell(nb, "launch")) + cells.result(cells.cell(nb, "launch"))
    run_id = re.search(r"<nbaccel.Run \(detached\) (\S+) ", launched)
    assert run_id, launched
    # The harness killed kernel A; the run's supervisor lived on, and kernel B found it.
    [restart] = widgets.restarts
    assert restart.old_kernel_gone and len(restart.supervisors) == 1, restart
    assert restart.supervisors_alive, "the detached run died with its kernel"
    attached = cells.result(cells.cell(nb, "attach"))
    assert f"<nbaccel.Run (detached) {run_id[1]} " in attached, attached
    result = ast.literal_eval(cells.result(cells.cell(nb, "result")))
    assert result["steps"] == 40 and result["final_loss"] < 50, result
    # Kernel B's dashboard replayed the curve and followed the run to its end.
    dashboard = widgets.dashboard("attach")
    header = widgets.text(dashboard["header"])
    assert header.startswith("succeeded") and "2 processes" in header, header
    frames = widgets.frames(dashboard["curve"], "attach") + widgets.frames(
        dashboard["curve"], "result"
    )
    assert frames and widgets.png(dashboard["curve"]).startswith(PNG), "no curve in kernel B"
    _, alive = psutil.wait_procs(restart.supervisors, timeout=30)
    assert not alive, "the supervisor stayed after its run ended"
    listed = cells.result(cells.cell(nb, "runs"))
    assert run_id[1] in listed and "succeeded" in listed, listed
    assert f"pruned 1 run folder(s): {run_id[1]}" in cells.result(cells.cell(nb, "prune"))
    assert not (folder / "nbaccel_runs" / "07_long_runs" / run_id[1]).exists()
    # The notebook pruned its own runs_dir: another notebook's finished run is still there.
    assert (folder / "nbaccel_runs" / OTHER_RUN / "config.json").exists()


OTHER_RUN = "20260101-000000-a0a0a0"


def _another_notebooks_run(folder: Path) -> None:
    """A finished run of another notebook in the default runs_dir, as run_listing reads it."""
    run_dir = folder / "nbaccel_runs" / OTHER_RUN
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    ended = {"time": 1767225600.0, "event": "ended", "state": "succeeded"}
    (run_dir / "events.jsonl").write_text(json.dumps(ended) + "\n")


def _check_interactive(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    built = _log_lines(widgets, widgets.dashboard("build"))
    assert any(re.match(r"built on rank 0 \(pid \d+\): \d+ parameters", x) for x in built), built
    assert set(_memory_mib(widgets, widgets.dashboard("build"))) == {"rank 0 (cpu)", "rank 1 (cpu)"}
    train = cells.cell(nb, "train")
    assert cells.result(train) == "True", "the training cell ran in another process"
    # A call that ends within dashboard_after (0.25 s; 3 tiny epochs can, on a quiet
    # machine) leaves its summary alone, no widgets: what it printed and its curve are there.
    for dashboard in widgets.dashboards("train"):
        assert "trained 3 epochs: loss" in "\n".join(_log_lines(widgets, dashboard))
        assert widgets.frames(dashboard["curve"], "train"), "no loss curve while training"
    text, png = _summary(train)
    assert "succeeded" in text and "loss" in text and png.startswith(PNG), text
    assert "trained 3 epochs: loss" in text, text
    evaluated = float(cells.result(cells.cell(nb, "eval")))
    train_on = cells.cell(nb, "train-on")
    log, _ = _summary(train_on)
    for dashboard in widgets.dashboards("train-on"):
        log += "\n".join(_log_lines(widgets, dashboard))
    assert "lr 0.003" in log, log
    after = float(cells.result(train_on))
    assert after < evaluated, (evaluated, after)  # training went on from where it was
    pulled = ast.literal_eval(cells.result(cells.cell(nb, "pull")))
    assert set(pulled) == {0, 1} and pulled[0][0] == pulled[1][0] == 6 * 14, pulled


def _check_debugging(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    # Headless (nbclient sends no input_request): the breakpoint is skipped, said, and the
    # run goes on to its value.
    stopped = cells.cell(nb, "breakpoint")
    assert cells.result(stopped) == "84.0"
    log = "\n".join(_log_lines(widgets, widgets.dashboard("breakpoint")))
    assert "rank 1: a debugger stop at " in log, log
    assert "was skipped: this notebook runs without a frontend that takes input" in log, log
    # The saved summary lists it as a note of the run, not under rank 0's lines (issue 39).
    summary, _ = _summary(stopped)
    notes = [line for line in summary.splitlines() if line.startswith("note: rank 1: ")]
    assert notes and "a debugger stop at " in notes[0], summary
    under_rank_0 = summary.split("rank 0's last ", 1)[1] if "rank 0's last " in summary else ""
    assert "debugger stop" not in under_rank_0, summary  # rank 1's own line may be shown
    printed = cells.stream(cells.cell(nb, "stacks"))
    assert re.search(r"^rank 0: in uneven \(.*\), waiting in all_reduce$", printed, re.M), printed
    assert "Thread MainThread (main):" in printed and "time.sleep(seconds)" in printed, printed
    assert cells.result(cells.cell(nb, "stacks-end")) == "{0: 0, 1: 1}"
    stall = widgets.dashboard("stall")
    shown = widgets.text(stall["stacks"])
    assert "No rank printed, logged a metric or finished a step for 3 s" in shown, shown
    assert "rank 0: in quiet (" in shown and "waiting in barrier" in shown, shown
    assert cells.result(cells.cell(nb, "stall")) == "'done'"  # the run went on
    assert widgets.state[stall["stacks-button"]]["state"]["disabled"]  # a blocking cell


def _check_survive_the_machine(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    # run.stop(save=True): every rank saved at one step, the run is stopped (not failed).
    stop = cells.stream(cells.cell(nb, "stop"))
    found = re.fullmatch(r"RunState.STOPPED at step (\d+)\n", stop)
    assert found, stop
    saved = int(found[1])
    assert 0 < saved < 400, saved  # stopped while stepping, not after the loop ended
    stopped, _ = _summary(cells.cell(nb, "launch"))
    assert ": stopped · " in stopped.splitlines()[0], stopped
    assert f"saved at step {saved:,} in " in stopped, stopped
    assert "launch again with resume='auto' to go on" in stopped, stopped
    assert widgets.text(widgets.dashboard("launch")["header"]).startswith("stopped")
    # The same launch with resume="auto" went on from exactly the saved step to the end.
    resume = cells.cell(nb, "resume")
    result = ast.literal_eval(cells.result(resume))
    assert result["first_step"] == saved and result["completed_steps"] == 400, (saved, result)
    dashboard = _assert_live_dashboard(widgets, resume, min_frames=1, memory=False)
    text, _ = _summary(resume)
    assert f"resuming at step {saved:,} from " in text, text
    assert f"nbaccel: resuming at step {saved:,} from " in widgets.text(dashboard["log"])
    printed = cells.stream(resume)
    assert f"stopped at step {saved}, resumed at step {saved}, finished at step 400" in printed
    curve = re.search(r"the loss curve goes on from step (\d+)", printed)
    assert curve and int(curve[1]) <= saved, printed  # the curve came back with the checkpoint
    # The durable copy (a folder outside runs_dir/checkpoints): the 2 newest periodic saves
    # of the resumed run, each verified against its manifest, LATEST naming the newest.
    listed = ast.literal_eval(cells.result(cells.cell(nb, "files")))
    durable = folder / "nbaccel_runs" / "10_survive_the_machine" / "my_drive"
    assert sorted(p.name for p in durable.iterdir()) == listed, listed
    assert listed[0] == "LATEST" and [int(name.split("-")[1]) for name in listed[1:]] == [
        200,
        300,
    ], listed
    assert (durable / "LATEST").read_text().strip() == listed[-1]
    assert all((durable / name / "MANIFEST.json").is_file() for name in listed[1:])


def _check_after_training(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    # The launch ended succeeded, and its ranks were kept: the panel under its dashboard
    # (released by the last cell: its line says so, its button is greyed out).
    launch = cells.cell(nb, "launch")
    assert cells.result(launch).startswith("<nbaccel.Workers alive world_size=2 "), launch
    text, _ = _summary(launch)
    assert ": succeeded" in text and "trained 1 epoch(s): loss" in text, text
    for dashboard in widgets.dashboards("launch"):
        assert widgets.text(dashboard["header"]).startswith("succeeded")
    shown = list(widgets._shown(launch.outputs))
    [panel] = [mid for mid in shown if "nbaccel-kept-workers" in widgets.classes(mid)]
    children = widgets.state[panel]["state"]["children"]
    button, label = (child.removeprefix("IPY_MODEL_") for child in children)
    assert widgets.state[button]["state"]["disabled"], "Release still enabled after close()"
    released = widgets.text(label)
    assert re.fullmatch(r"the workers of run \S+ are released", released), released
    # Evaluated on the kept ranks (a %%nbaccel cell), the model in the kernel, map in order.
    before = float(cells.result(cells.cell(nb, "eval")))
    assert 0.6 < before < 1.0, before
    loaded = cells.stream(cells.cell(nb, "load"))
    assert re.fullmatch(r"\d+ tensors, [\d,]+ numbers in the kernel\n", loaded), loaded
    mapped = cells.stream(cells.cell(nb, "map"))
    assert "512 predictions in order" in mapped, mapped
    assert f"held-out accuracy: {before:.3f}" in mapped, (before, mapped)  # as the ranks said
    plot = cells.cell(nb, "plot")
    [figure] = [out.data["image/png"] for out in plot.outputs if "image/png" in out.get("data", {})]
    assert base64.b64decode(figure).startswith(PNG)
    # More training on the same workers, shown as a launch; the held-out accuracy went up.
    more = cells.cell(nb, "train-more")
    after = float(cells.result(more))
    assert after > before, (before, after)
    printed = cells.stream(more)
    assert f"held-out accuracy: {before:.3f} before, {after:.3f} after 3 more epochs" in printed
    launched = widgets.dashboards("train-more")
    assert launched, "workers.launch showed no dashboard"
    log = "\n".join(line for d in launched for line in _log_lines(widgets, d))
    summaries = [out.data.get("text/plain", "") for out in more.outputs if "data" in out]
    log += "\n".join(text for text in summaries if text.startswith("nbaccel run "))
    assert "trained 3 epoch(s): loss" in log, log
    assert any(widgets.frames(d["curve"], "train-more") for d in launched), "no loss curve"
    assert cells.result(cells.cell(nb, "close")).startswith("[")


def _sweep_summary(cell: Any) -> tuple[str, str, bytes]:
    """What a finished sweep board leaves in its cell: its text, its HTML table, its PNG."""
    texts, tables, images = [], [], []
    for out in cell.outputs:
        data = out.get("data", {})
        if out.get("output_type") != "display_data":
            continue
        if "nbaccel-sweep-summary" in data.get("text/html", ""):
            texts.append(data["text/plain"])
            tables.append(data["text/html"])
        elif data.get("text/plain", "").startswith("nbaccel sweep: ") and "image/png" in data:
            images.append(base64.b64decode(data["image/png"]))
    assert len(texts) == 1 and len(images) == 1, f"cell {cell.id}: {len(texts)}, {len(images)}"
    return texts[0], tables[0], images[0]


def _check_sweeps(widgets: Widgets, cells: Any, folder: Path) -> None:
    nb = widgets.nb
    # Each sweep's board was live while its cell ran (its curves drawn at least once), then
    # left its summary: a line, the table (a row per trial, the best one marked), the curves.
    for cell_id, trials in (("grid", 8), ("failing", 3), ("study", 8)):
        index = widgets.cell_index(cell_id)
        frames = {u.buffers["value"] for u in widgets.updates if u.cell == index and u.buffers}
        assert frames, f"cell {cell_id}: the board drew no curves"
        text, table, image = _sweep_summary(cells.cell(nb, cell_id))
        assert text.startswith(f"nbaccel sweep: {trials} trials: "), text
        assert table.count(" data-trial=") == trials, table
        assert table.count("nbaccel-sweep-best") == 1 and image.startswith(PNG), cell_id
    # The grid: 8 trials on the two CPU slots, all succeeded; the best is the table's lowest.
    grid = cells.cell(nb, "grid")
    assert cells.result(grid) == "<nbaccel.Sweep 8 trials: 8 succeeded>"
    assert re.fullmatch(r"8 trials in [\d.]+ s\n", cells.stream(grid)), cells.stream(grid)
    best = ast.literal_eval(cells.result(cells.cell(nb, "best")))
    text, _, _ = _sweep_summary(grid)
    assert f"best trial {best['trial']}: loss " in text, (best, text)
    assert Path(best["run_dir"]).parent == folder / "nbaccel_runs", best
    # The typo failed its own trial only.
    failing = cells.cell(nb, "failing")
    said = cells.stream(failing)
    assert said == "trial 1: ValueError: [rank 0] unknown optimizer 'sdg': 'sgd' or 'adam'\n"
    text, table, _ = _sweep_summary(failing)
    assert "3 trials: 2 succeeded, 1 failed" in text, text
    assert "data-state='failed'" in table, table
    # The study: 8 trials, the hopeless one (and maybe others) pruned, told to Optuna.
    study = cells.cell(nb, "study")
    states = ast.literal_eval(cells.stream(study, "stdout").strip())
    assert len(states) == 8 and states[:2] == ["succeeded", "succeeded"], states
    assert "pruned" in states and set(states) <= {"succeeded", "pruned"}, states
    text, _, _ = _sweep_summary(study)
    assert f"{states.count('pruned')} pruned" in text, text
    found = re.fullmatch(
        r"best: trial (\d+), loss ([\d.]+)\n", cells.stream(cells.cell(nb, "study-best"))
    )
    assert found and f"best trial {found[1]}: loss " in text, (found, text)
    plot = cells.cell(nb, "plot")
    [figure] = [out.data["image/png"] for out in plot.outputs if "image/png" in out.get("data", {})]
    assert base64.b64decode(figure).startswith(PNG)


CONTENT_CHECKS = {
    "01_quickstart_cpu.ipynb": _check_quickstart,
    "02_config_panel.ipynb": _check_config_panel,
    "03_precision_and_sharding.ipynb": _check_precision_and_sharding,
    "04_resume_from_checkpoint.ipynb": _check_resume,
    "05_accelerate_code_unchanged.ipynb": _check_accelerate,
    "07_long_runs.ipynb": _check_long_runs,
    "08_interactive.ipynb": _check_interactive,
    "09_debugging.ipynb": _check_debugging,
    "10_survive_the_machine.ipynb": _check_survive_the_machine,
    "11_after_training.ipynb": _check_after_training,
    "12_sweeps.ipynb": _check_sweeps,
}
# Notebooks whose widgets all close once their cells end (a sweep's board leaves its static
# summary in its place): no widget state is stored; their checks read the updates received.
CLOSED_WIDGETS = {"12_sweeps.ipynb"}
