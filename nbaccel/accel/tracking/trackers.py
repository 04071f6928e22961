"""Experiment trackers behind ``Accelerator.log``: TensorBoard, CSV, JSON Lines, W&B, MLflow.

``start_trackers`` checks every requested name and library before it starts any tracker, so a
typo or a missing package fails at once instead of leaving some trackers open. Everything is
written under ``logging_dir``; W&B stays offline and MLflow uses a local store unless the
environment points them elsewhere. A tracker's library is imported only when it starts:
wandb and mlflow take a second or more to import and most runs use neither.

This code runs in a worker process (the Accelerator starts trackers on the main rank), never
in the notebook kernel, so the environment defaults set here do not leak into the user's session.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import difflib
import importlib
import importlib.util
import json
import os
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

import yaml

# Tracker name -> (modules, any one of which is enough; the install command to suggest).
_LIBRARIES: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (
        ("tensorboardX", "tensorboard"),
        "pip install tensorboardX (or 'nbaccel[trackers]')",
    ),
    "csv": ((), ""),
    "jsonl": ((), ""),
    "wandb": (("wandb",), "pip install wandb"),
    "mlflow": (("mlflow",), "pip install mlflow-skinny (or the full mlflow)"),
}


class Tracker(Protocol):
    """One experiment tracker: hyperparameters once, scalars per step, then ``finish``."""

    name: str

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (called once, right after the tracker starts)."""

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Record scalar ``values`` at ``step``."""

    def finish(self) -> None:
        """Flush and close; calling it again does nothing."""


def available_trackers() -> tuple[str, ...]:
    """Names of the trackers whose libraries can be imported in this environment."""
    return tuple(name for name in _LIBRARIES if _installed(name))


def start_trackers(
    names: Sequence[str],
    project_name: str,
    logging_dir: Path,
    config: Mapping[str, Any] | None = None,
    init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Tracker]:
    """Start the named trackers (``"all"``: every available one) and store ``config`` in each.

    ``init_kwargs`` maps a tracker name to extra arguments for its library, e.g.
    ``{"wandb": {"entity": "team"}}`` for ``wandb.init`` (csv and jsonl take none). Raises
    ValueError for an unknown name and ImportError for a missing library before any tracker
    starts; if one fails to start, those already started are finished before the error
    propagates.
    """
    wanted = _resolve(names)
    extra = dict(init_kwargs or {})
    for key in extra:
        _check_known(key, "init_kwargs key")
    missing = [name for name in wanted if not _installed(name)]
    if missing:
        hints = "; ".join(f"{name}: {_LIBRARIES[name][1]}" for name in missing)
        raise ImportError(
            f"Tracker(s) {', '.join(missing)} requested but their library is not installed in "
            f"the worker's Python. Install it ({hints}) or drop the name from log_with."
        )
    started: list[Tracker] = []
    try:
        for name in wanted:
            kwargs = dict(extra.get(name, {}))
            tracker = _FACTORIES[name](project_name, Path(logging_dir), kwargs)
            started.append(tracker)
            if config is not None:
                tracker.store_config(config)
    except BaseException:
        # Finish what did start (a wandb run keeps a service process alive), but let the
        # original error be the one the user sees.
        for tracker in started:
            with contextlib.suppress(Exception):
                tracker.finish()
        raise
    return started


def _resolve(names: Sequence[str]) -> list[str]:
    # A bare string is itself a Sequence[str]; without this "csv" would mean "c", "s", "v".
    requested = [names] if isinstance(names, str) else list(names)
    wanted: list[str] = []
    for raw in requested:
        name = str(raw).strip().lower()
        expanded = available_trackers() if name == "all" else (_check_known(name, "tracker"),)
        wanted += [n for n in expanded if n not in wanted]
    return wanted


def _check_known(name: str, what: str) -> str:
    if name not in _LIBRARIES:
        close = difflib.get_close_matches(name, [*_LIBRARIES, "all"], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown {what} {name!r}.{hint} Valid trackers: {', '.join(_LIBRARIES)}, "
            "or 'all' (every installed one)."
        )
    return name


def _installed(name: str) -> bool:
    modules = _LIBRARIES[name][0]
    return not modules or any(importlib.util.find_spec(module) for module in modules)


def _plain(value: Any) -> Any:
    """A JSON-ready copy of a config value; anything JSON cannot hold becomes its ``str``."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if hasattr(value, "item"):  # numpy scalars and 0-d tensors
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            return _plain(value.item())
    return str(value)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"opt": {"lr": 0.1}}`` -> ``{"opt.lr": "0.1"}``, for trackers that take flat params."""
    flat: dict[str, str] = {}
    for key, value in _plain(config).items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat


class _Base:
    """What every tracker shares: the open handle, and refusing to log once finished."""

    name: str = ""

    def __init__(self, where: Path | str, handle: Any) -> None:
        self.where = where
        self._handle = handle

    def finish(self) -> None:
        """Flush and close; calling it again does nothing."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._close(handle)

    def _close(self, handle: Any) -> None:
        handle.close()

    def _live(self) -> Any:
        if self._handle is None:
            raise RuntimeError(
                f"The {self.name} tracker writing to {self.where} was already finished, so it "
                "cannot log more; call log() before end_training()."
            )
        return self._handle


class _FileTracker(_Base):
    """Shared part of the CSV and JSONL trackers: one append-only file, plus ``config.json``."""

    filename: str = ""

    def __init__(self, project_name: str, logging_dir: Path, kwargs: dict[str, Any]) -> None:
        self.dir = logging_dir / project_name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / self.filename
        # Append, never truncate: re-using a folder must not destroy an earlier run's numbers.
        self._file: TextIO = self.path.open("a", encoding="utf-8", newline="")
        super().__init__(self.path, self._file)

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Write the config to ``config.json`` beside the metrics (non-JSON values as text)."""
        text = json.dumps(_plain(config), indent=2)
        (self.dir / "config.json").write_text(text + "\n", encoding="utf-8")


class CSVTracker(_FileTracker):
    """``metrics.csv`` in long format: one ``step,name,value`` row per scalar.

    Long rather than a column per metric because names are not known up front: a metric first
    logged mid-run would need a new header, i.e. rewriting the file, while a row per scalar
    only appends. ``pandas.read_csv(path).pivot(index="step", columns="name", values="value")``
    gives the wide table.
    """

    name = "csv"
    filename = "metrics.csv"

    def __init__(self, project_name: str, logging_dir: Path, kwargs: dict[str, Any]) -> None:
        super().__init__(project_name, logging_dir, kwargs)
        self._writer = csv.writer(self._file)
        if self._file.tell() == 0:  # an earlier run's file already has its header
            self._writer.writerow(["step", "name", "value"])
            self._file.flush()

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Append one row per value and flush, so a worker that crashes loses nothing logged."""
        file = self._live()
        self._writer.writerows([step, name, value] for name, value in values.items())
        file.flush()


class JSONLTracker(_FileTracker):
    """``metrics.jsonl``: one ``{"step", "time", **values}`` object per ``log`` call."""

    name = "jsonl"
    filename = "metrics.jsonl"

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Append one line and flush, so a worker that crashes loses nothing logged."""
        file = self._live()
        if "step" in values or "time" in values:
            raise ValueError(
                f"jsonl tracker: a metric named 'step' or 'time' (got {sorted(values)}) would "
                "overwrite the record's own field of that name; rename the metric."
            )
        file.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        file.flush()


class TensorBoardTracker(_Base):
    """Event files in ``logging_dir/project_name``, via tensorboardX or torch's writer."""

    name = "tensorboard"

    def __init__(self, project_name: str, logging_dir: Path, kwargs: dict[str, Any]) -> None:
        # tensorboardX is small and enough; torch.utils.tensorboard needs the full tensorboard
        # package, so it is only the fallback for environments that have that anyway.
        found = importlib.util.find_spec("tensorboardX")
        library = importlib.import_module("tensorboardX" if found else "torch.utils.tensorboard")
        # The writer flushes from a thread every flush_secs; the default 120 s is a lot of curve
        # to lose when a worker is killed, and flushing in every log() would fsync every step.
        kwargs.setdefault("flush_secs", 5)
        self.dir = logging_dir / project_name
        super().__init__(self.dir, library.SummaryWriter(str(self.dir), **kwargs))

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Show the config as JSON in TensorBoard's Text tab (tag ``config``)."""
        text = json.dumps(_plain(config), indent=2)
        # The Text tab renders Markdown; a four-space indent makes it a verbatim code block.
        self._live().add_text("config", textwrap.indent(text, "    "), 0)
        # And as Accelerate's TensorBoard tracker keeps it: <run>/<time>/hparams.yml.
        folder = self.dir / str(time.time())
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hparams.yml").write_text(yaml.safe_dump(_plain(config)), encoding="utf-8")

    def log(self, values: Mapping[str, float], step: int) -> None:
        """One scalar event per value; the tag is the metric name."""
        writer = self._live()
        for name, value in values.items():
            writer.add_scalar(name, value, step)


class WandbTracker(_Base):
    """A Weights & Biases run in ``logging_dir/wandb``; offline unless WANDB_MODE says not."""

    name = "wandb"

    def __init__(self, project_name: str, logging_dir: Path, kwargs: dict[str, Any]) -> None:
        # Environment, not wandb.init(mode=...): with only the argument wandb still resolves
        # its server's address, and error reporting phones home. setdefault keeps a user's
        # explicit WANDB_MODE=online; this is a worker process, so the kernel is untouched.
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        self._wandb = importlib.import_module("wandb")
        logging_dir.mkdir(parents=True, exist_ok=True)
        init = {"project": project_name, "dir": str(logging_dir), **kwargs}
        super().__init__(logging_dir, self._wandb.init(**init))

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Add the config to the run's config (nested dicts kept)."""
        self._live().config.update(_plain(config), allow_val_change=True)

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Log the values as one history row at ``step``."""
        self._live().log(dict(values), step=step)

    def _close(self, handle: Any) -> None:
        handle.finish()
        # run.finish() leaves the wandb-core process and its threads running until the
        # interpreter exits; teardown() stops them, unless user code has a run of its own open.
        if self._wandb.run is None:
            self._wandb.teardown()


class MLflowTracker(_Base):
    """An MLflow run in experiment ``project_name``, stored under ``logging_dir``.

    The store is ``init_kwargs["mlflow"]["tracking_uri"]``, else MLFLOW_TRACKING_URI, else a
    local one: ``sqlite:///logging_dir/mlflow.db`` where SQLAlchemy is installed (full mlflow),
    else the file store ``logging_dir/mlruns`` (mlflow-skinny has no database support). Other
    init_kwargs go to ``MlflowClient.create_run`` (``run_name``, ``tags``).
    """

    name = "mlflow"

    def __init__(self, project_name: str, logging_dir: Path, kwargs: dict[str, Any]) -> None:
        # mlflow sends usage telemetry unless told not to, and refuses its (deprecated) file
        # store without this opt-in; a user's own settings of either win.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow = importlib.import_module("mlflow")
        self._entities = importlib.import_module("mlflow.entities")
        validation = importlib.import_module("mlflow.utils.validation")
        self._max_param = int(getattr(validation, "MAX_PARAM_VAL_LENGTH", 500))
        uri = kwargs.pop("tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            logging_dir.mkdir(parents=True, exist_ok=True)
            local = logging_dir.resolve()
            database = all(importlib.util.find_spec(m) for m in ("sqlalchemy", "alembic"))
            uri = f"sqlite:///{local / 'mlflow.db'}" if database else (local / "mlruns").as_uri()
        self._client: Any = mlflow.MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(project_name)
        experiment_id = (
            found.experiment_id if found else self._client.create_experiment(project_name)
        )
        self.run_id: str = self._client.create_run(experiment_id, **kwargs).info.run_id
        super().__init__(uri, self.run_id)

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Log the flattened config as params (``opt.lr``); over-long values are cut short."""
        Param = self._entities.Param
        params = [Param(k, v[: self._max_param]) for k, v in _flatten(config).items()]
        self._client.log_batch(self._live(), params=params)

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Log the values as metrics at ``step`` in one batch."""
        now, Metric = int(time.time() * 1000), self._entities.Metric
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        self._client.log_batch(self._live(), metrics=metrics)

    def _close(self, handle: Any) -> None:
        self._client.set_terminated(handle)


_FACTORIES: dict[str, Callable[[str, Path, dict[str, Any]], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "csv": CSVTracker,
    "jsonl": JSONLTracker,
    "wandb": WandbTracker,
    "mlflow": MLflowTracker,
}
