"""``AutoSave``: one Accelerator's periodic saves, save-and-stop, and resume.

The prepared DataLoader calls ``boundary()`` each time the loop asks it for the next batch:
the previous iteration is over (optimizer, scheduler, ``zero_grad``, logging) and the next
batch not yet drawn, so model, optimizer, RNG and the loader's position all describe the
same moment. A boundary within gradient accumulation (no optimizer step since the last
one) is skipped. At the boundaries ``StepAgreement`` picks, the ranks save (``checkpoint_every``)
or save and stop (a stop request on any rank), all at the same step.

The resume (``resume`` in the config, resolved by the launch to a checkpoint folder or
URL, or ``"never"``) is restored at the first use of what was prepared: the first batch
request, ``completed_steps``, a forward pass, ``backward``; so the loop written as
``while acc.completed_steps < total: for batch in loader: ...`` goes on unchanged.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nbaccel.accel.autosave.agreement import StepAgreement
from nbaccel.accel.autosave.stop_requests import StopRequests
from nbaccel.accel.checkpoints import checkpoint
from nbaccel.accel.checkpoints.background_save import BackgroundWrite, take_snapshot
from nbaccel.config import cadence as cadences
from nbaccel.config.schema import Config
from nbaccel.context import active_session
from nbaccel.errors import ANOTHER_RANK, TrainingStopped
from nbaccel.events import CheckpointSaved, Metric

METRICS_FILE = "metrics.jsonl"


class AutoSave:
    """Periodic saves and stops for one Accelerator (``checkpoints``: its ``Checkpoints``)."""

    def __init__(self, config: Config, checkpoints: Any) -> None:
        self.config, self.checkpoints = config, checkpoints
        self.gradients = checkpoints.gradients
        self.strategy = checkpoints.prepared.strategy
        self.rank, self.world_size = self.strategy.state.rank, self.strategy.state.world_size
        self.session = active_session()
        self.cadence = cadences.effective(config)
        self.agreement = StepAgreement(self._sum_over_ranks, self.world_size, self.cadence)
        self.requests = StopRequests()
        self.local_root, self.durable_target = _places(config, self.session)
        self._durable: Any = None
        self._writes: BackgroundWrite | None = None
        self._last_boundary_steps = -1
        self._saved_steps = -1
        self._armed = False
        self.pending_resume = None if config.resume == "never" else config.resume
        self.saves: list[int] = []  # the steps this rank saved at (the same on every rank)
        self._hooks: list[Any] = []  # forward pre-hooks that restore before a first forward
        if self.session is not None:
            self.session.at_function_end.append(self.finish)

    def watch_models(self, models: list[Any]) -> None:
        """A resume is restored before the first forward pass of a prepared model too."""
        if self.pending_resume is None:
            return
        for model in models[len(self._hooks) :]:
            self._hooks.append(
                model.register_forward_pre_hook(lambda *_: self.restore_if_pending())
            )

    def completed(self, counter: str) -> int:
        """``completed_steps`` or ``completed_epochs``, restored first if a resume waits."""
        self.restore_if_pending()
        if self.pending_resume is not None:  # nothing prepared yet: what the checkpoint says
            return int(self._pending_progress().get(counter, 0))
        return int(getattr(self.gradients, counter))

    def _pending_progress(self) -> dict[str, Any]:
        source = self.pending_resume
        if source is None:
            return {}
        from nbaccel.durable import is_url, newest_complete

        if is_url(source):
            point = newest_complete(source)
            return {"completed_steps": point.completed_steps} if point else {}
        folder = checkpoint.find_checkpoint(Path(source))
        progress: dict[str, Any] = json.loads((folder / "meta.json").read_text())["progress"]
        return progress

    # -- the loop's boundaries ----------------------------------------------------------------
    def boundary(self, starting: bool = False) -> None:
        """The loop asks for its next batch (``starting``: a pass begins): restore, then
        check, and save or stop where the ranks agreed."""
        self.restore_if_pending()
        if starting:
            return  # the batch requests check; the previous pass's last one already did
        steps = self.gradients.completed_steps
        if steps == self._last_boundary_steps:
            return  # no optimizer step since the last boundary: within accumulation
        self._last_boundary_steps = steps
        if not self._armed:  # from now on a SIGTERM is answered by saving, not by dying
            self.requests.install(restartable=self.config.max_restarts > 0)
            self._armed = True
        decision = self.agreement.at_step(steps, stop_asked=self.requests.requested)
        if decision is None:
            return
        if decision.save:
            self.save(steps, stopping=decision.stop)
        if decision.stop:
            self.stop(steps)

    def save(self, steps: int, *, stopping: bool) -> None:
        """Save at ``steps`` (every rank calls it at the same step)."""
        if steps == self._saved_steps:
            return  # saved at this very step already
        self._wait_for_writes()  # one save in flight at most: memory for one snapshot
        name = self._name(steps)
        stateful = self.checkpoints.stateful()
        progress = self.checkpoints.progress()
        started = time.monotonic()
        if self._background_possible(stateful):
            snapshot = take_snapshot(
                stateful,
                rank=self.rank,
                world_size=self.world_size,
                progress=progress,
                metrics=self._metric_history() if self.rank == 0 else None,
            )
            staging = self.local_root / f".partial-{name}"
            self._clear_stale(keep=staging)
            staging.mkdir(parents=True, exist_ok=True)
            self._extra_files(staging)  # compiled artifacts: read from torch in this thread
            self._writes = BackgroundWrite(
                self.local_root,
                name,
                snapshot,
                rank=self.rank,
                world_size=self.world_size,
                keep=self.config.checkpoint.keep,
                deadline=time.monotonic() + self.config.checkpoint.grace,
                on_published=lambda final: self._published(final, steps, started, stopping),
            )
        else:
            final = checkpoint.save_state(
                self.local_root,
                stateful,
                rank=self.rank,
                world_size=self.world_size,
                progress=progress,
                name=name,
                keep=self.config.checkpoint.keep,
                extra_files=lambda staging: self._extra_files(staging, with_metrics=True),
            )
            if self.rank == 0:
                self._published(final, steps, started, stopping)
        self._saved_steps = steps
        self.saves.append(steps)
        self.agreement.saved(steps)

    def stop(self, steps: int) -> None:
        """Every rank saved at ``steps``: wait for the writes, then end the function."""
        self.finish(raise_errors=True)
        self.strategy.barrier()  # every rank's part is on disk
        why = self.requests.why or ANOTHER_RANK
        raise TrainingStopped(steps, str(self.durable_target or self.local_root), why)

    def finish(self, raise_errors: bool = False) -> None:
        """The function returned (or stops): let the last save and its copy finish."""
        self._wait_for_writes(raise_errors)
        if self._durable is not None:
            self._durable.wait(timeout=self.config.checkpoint.grace)
        self.requests.uninstall()

    # -- resuming --------------------------------------------------------------------------------
    def restore_if_pending(self) -> None:
        """Load the checkpoint the launch chose, once, when something was prepared."""
        if self.pending_resume is None or not self.checkpoints.prepared.models:
            return
        source, self.pending_resume = self.pending_resume, None
        for hook in self._hooks:
            hook.remove()
        folder = self._local_copy(source)
        self.checkpoints.load_folder(folder)
        steps = self.gradients.completed_steps
        self.agreement.restart_from(steps)
        self._saved_steps = self._last_boundary_steps = steps
        self._replay_metrics(checkpoint.find_checkpoint(folder))
        if self.rank == 0:
            print(f"nbaccel: resumed at step {steps:,} from {source}", file=sys.stderr, flush=True)

    def _local_copy(self, source: str) -> Path:
        """A local folder to load ``source`` from: itself, or the durable copy fetched."""
        from nbaccel.durable import fetch, is_url, newest_complete

        if not is_url(source):
            return Path(source)
        point = newest_complete(source)
        if point is None:
            raise FileNotFoundError(f"resume: {source} holds no complete checkpoint any more.")
        into = self.local_root / ".fetched"
        if self.session is None or self.session.context.local_rank == 0:
            fetch(point, into)
        self.strategy.barrier()  # the copy is whole before anyone reads
        return into / point.name

    def _replay_metrics(self, folder: Path) -> None:
        """Send the saved curve again, so the dashboard's curve goes on where it was."""
        if self.rank != 0 or self.session is None:
            return
        history = folder / METRICS_FILE
        if not history.exists():
            return
        entries = [json.loads(line) for line in history.read_text().splitlines()]
        for step, values, when in entries:
            self.session.events.send_batched(Metric(0, int(step), values, float(when)))
        last = max((int(step) for step, _, _ in entries), default=-1)
        self.session.metric_steps = max(self.session.metric_steps, last + 1)
        self.session.metric_history.extend(entries)

    # -- helpers -----------------------------------------------------------------------------
    def _sum_over_ranks(self, values: list[int]) -> list[int]:
        if self.world_size == 1:
            return values
        device = self.strategy.state.device
        summed = self.strategy.reduce(torch.tensor(values, device=device), "sum")
        return [int(v) for v in summed.tolist()]

    def _name(self, steps: int) -> str:
        run = self.session.context.run_id[-6:] if self.session is not None else "local"
        return f"{steps:09d}-{run}"

    def _background_possible(self, stateful: checkpoint.Stateful) -> bool:
        one_machine = self.session is None or (
            self.session.context.local_world_size == self.world_size
        )
        return (
            stateful.layout == "plain"
            and stateful.device is None
            and not self.checkpoints.save_hooks
            and one_machine
        )

    def _metric_history(self) -> bytes:
        history = self.session.metric_history if self.session is not None else []
        return "".join(json.dumps(entry) + "\n" for entry in history).encode()

    def _clear_stale(self, keep: Path) -> None:
        if self.rank == 0 and self.local_root.is_dir():
            for stale in self.local_root.glob(".partial-*"):  # a save that was killed
                if stale != keep:
                    shutil.rmtree(stale, ignore_errors=True)

    def _extra_files(self, staging: Path, *, with_metrics: bool = False) -> None:
        if self.rank == 0 and with_metrics:
            (staging / METRICS_FILE).write_bytes(self._metric_history())
        extras = getattr(self.session, "checkpoint_extras", None)
        if extras is not None:
            extras(staging, self.rank)

    def _published(self, final: Path, steps: int, started: float, stopping: bool) -> None:
        seconds = time.monotonic() - started
        if self.durable_target is not None:
            if self._durable is None:
                from nbaccel.durable import DurableCopier

                self._durable = DurableCopier(
                    self.durable_target, keep=self.config.checkpoint.keep, warn=_warn
                )
            self._durable.submit(self.local_root, final.name)
        if self.session is not None:
            where = self.durable_target or str(self.local_root)
            self.session.events.send(
                CheckpointSaved(0, steps, where, final.name, stopping, seconds, time.time())
            )

    def _wait_for_writes(self, raise_errors: bool = False) -> None:
        writes, self._writes = self._writes, None
        if writes is None:
            return
        if not writes.join(timeout=self.config.checkpoint.grace):
            writes.error = TimeoutError(f"checkpoint {writes.name} was not written in time")
        if writes.error is not None:
            _warn(f"nbaccel: checkpoint {writes.name} failed: {writes.error}")
            if raise_errors:
                raise writes.error


def _places(config: Config, session: Any) -> tuple[Path, str | None]:
    """Where checkpoints are written locally, and the durable place they are copied to."""
    from nbaccel.durable.staging import checkpoint_places

    run_dir = session.context.run_dir if session is not None else ""
    runs = Path(run_dir).parent if run_dir else Path(config.runs_dir)
    return checkpoint_places(config.checkpoint.dir, runs)


def _warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
