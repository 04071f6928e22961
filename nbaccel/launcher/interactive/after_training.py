"""What a notebook does with interactive workers after (and around) training, kernel side:
``launch`` a training function on them with a launch's dashboard, take the model's whole
``state_dict`` into the kernel, ``map`` a function over a dataset with the outputs in the
dataset's order; and ``watch`` them (the kept workers' panel). The ranks' side of
``state_dict`` and ``map`` is ``model_ops.py``.

Torch-free until a value comes: the state dict's tensors and ``map``'s outputs are unpickled
here from the ranks' shared memory (torch is imported then, as for any tensor pulled), and
``map`` joins the ranks' outputs with the library of the outputs' own type.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.errors import RunCancelled
from nbaccel.events import RunState
from nbaccel.launcher.bootstrap.pickling import cell_globals
from nbaccel.launcher.interactive.calls import raise_at_rank_line


class AfterTraining:
    """The half of ``WorkerGroup`` that serves training and its aftermath."""

    _watchers: list[Callable[[Any], None]]
    _busy: threading.Lock

    def _call(self, command: dict[str, Any], *args: Any, **kwargs: Any) -> dict[int, Any]:
        raise NotImplementedError  # WorkerGroup's

    @property
    def memory(self) -> dict[int, dict[str, int]]:
        raise NotImplementedError  # WorkerGroup's

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> WorkersLaunch:
        """Start ``function(*args, **kwargs)`` on every rank as ``nbaccel.launch`` starts a
        run, on these workers, and return at once: shown with a launch's dashboard (live
        curves, memory, step time; Stop interrupts the function, Stacks shows where each
        rank is), each rank's value kept in its namespace as ``result`` (as
        ``keep_workers=True`` leaves it). ``.result()`` waits for rank 0's value. Train,
        evaluate, train more: one group all along. Other calls wait until it has ended.

        >>> import nbaccel
        >>> with nbaccel.Workers(num_processes=2, dashboard="text") as workers:
        ...     first = workers.launch(lambda: 3).result()
        ...     again = workers.pull("result")
        >>> first, again
        (3, {0: 3, 1: 3})
        """
        names = cell_globals(function)
        command = {"op": "run", "keep_as": "result"}
        handle = WorkersLaunch()

        def run() -> None:
            try:
                values = self._call(
                    command, kernel_names=names, sending=(function, args, kwargs), stoppable=True
                )
            except KeyboardInterrupt:
                handle._end(RunState.CANCELLED, None, None)
            except BaseException as error:  # noqa: BLE001 - the handle raises it when asked
                code = getattr(function, "__code__", None)
                try:
                    if code is not None:
                        raise_at_rank_line(error, code.co_filename)  # the user's line last
                    raise error
                except BaseException as shown:  # noqa: BLE001
                    handle._end(RunState.FAILED, None, shown)
            else:
                handle._end(RunState.SUCCEEDED, values, None)

        # The call's display lands in this cell: its thread runs in this cell's context.
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(run,), name="nbaccel-workers-launch")
        thread.daemon = True
        thread.start()
        return handle

    def state_dict(self, name: str | None = None) -> dict[str, Any]:
        """The model's whole state dict, unsharded, as CPU tensors in this process: gathered
        on the ranks (DDP, FSDP2 one tensor at a time, ZeRO, DeepSpeed) and written by rank
        0 into shared memory, which the tensors here view (no pickle of the weights; on
        several machines, a copy inside the reply). ``name``: the model, an expression in
        the ranks' namespace (``"model"``, ``"result['model']"``); by default the first model
        the Accelerator prepared, else the module the function returned."""
        values = self._call({"op": "state_dict", "name": name}, shown=False)
        state: dict[str, Any] = values[min(values)]
        return state

    def map(
        self,
        fn: Callable[[Any], Any] | str,
        dataset: Any,
        batch_size: int = 64,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> Any:
        """``fn(batch)`` over ``dataset``, split across the ranks as a prepared
        ``DataLoader`` splits it, under ``torch.inference_mode`` (a module ``fn`` in eval mode
        meanwhile): the outputs joined in the dataset's order, the last round's padding
        dropped, as one process would give them. ``fn``: a function, or the name of one in
        the ranks' namespace (``"result"``, the model a kept launch returned); ``dataset``:
        an object sent to the ranks (its arrays through shared memory), or a name there.
        Each batch's output: a tensor or array (rows along the first axis), a list (a row
        per sample), or a tuple or dict of them."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: a positive number of samples per batch")
        options = {"batch_size": batch_size, "collate_fn": collate_fn}
        names = cell_globals(fn) if callable(fn) else None
        values = self._call(
            {"op": "map"}, kernel_names=names, sending=(tuple, (fn, dataset), options)
        )
        return in_dataset_order([values[rank] for rank in sorted(values)])

    def read_memory(self) -> dict[int, dict[str, int]]:
        """Each rank's memory read now (``memory``, its device's counters included), by a
        call that runs nothing."""
        self._call({"op": "pull", "names": []}, shown=False)
        return self.memory

    def watch(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(workers)`` after each call and when they end (on the thread that
        made the call): the kept workers' panel shows their memory and state."""
        self._watchers.append(callback)

    def _changed(self) -> None:
        for callback in list(self._watchers):
            try:
                callback(self)
            except Exception as error:  # noqa: BLE001 - a broken panel must not break a call
                print(f"nbaccel: a workers watcher failed: {error!r}", file=sys.__stderr__)


class WorkersLaunch:
    """A ``workers.launch`` in flight: ``result()``, ``results()``, ``wait()``, ``state``."""

    def __init__(self) -> None:
        self.state = RunState.RUNNING
        self.error: BaseException | None = None
        self._values: dict[int, Any] | None = None
        self._done = threading.Event()

    def _end(self, state: RunState, values: dict[int, Any] | None, error: Any) -> None:
        self.state, self._values, self.error = state, values, error
        self._done.set()

    def wait(self, timeout: float | None = None) -> RunState:
        """Block until the function has returned (or failed) on every rank; its state."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"workers.launch still running after {timeout} s")
        return self.state

    def results(self, timeout: float | None = None) -> dict[int, Any]:
        """Every rank's value, ``{rank: value}``; the failure or the stop raised."""
        state = self.wait(timeout)
        if state is RunState.FAILED:
            assert self.error is not None
            raise self.error
        if state is RunState.CANCELLED:
            raise RunCancelled("workers.launch was stopped before it finished; no result.")
        assert self._values is not None
        return self._values

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's value (the lowest rank's), once every rank has returned."""
        values = self.results(timeout)
        return values[min(values)]

    def __repr__(self) -> str:
        return f"<nbaccel.WorkersLaunch {self.state.value}>"


def in_dataset_order(shares: list[dict[str, Any]]) -> Any:
    """The ranks' ``map`` outputs joined in the dataset's order: round by round, rank by
    rank (global batch ``b`` is rank ``b % world``'s), the padding past the dataset's end
    dropped.

    >>> import numpy
    >>> shares = [  # 5 samples, batches of 2 over 2 ranks: [0 1] [2 3] [4 0 (padding)] [1 2]
    ...     {"sizes": [2, 2], "rows": numpy.array([0, 1, 4, 0]), "dataset_size": 5},
    ...     {"sizes": [2, 2], "rows": numpy.array([2, 3, 1, 2]), "dataset_size": 5},
    ... ]
    >>> in_dataset_order(shares).tolist()
    [0, 1, 2, 3, 4]
    """
    per_rank = [_split_rows(share["rows"], share["sizes"]) for share in shares]
    rounds = max(len(batches) for batches in per_rank)
    ordered = [
        batches[step] for step in range(rounds) for batches in per_rank if step < len(batches)
    ]
    return _cut(joined(ordered), shares[0]["dataset_size"])


def _split_rows(rows: Any, sizes: list[int]) -> list[Any]:
    out, start = [], 0
    for size in sizes:
        out.append(_rows(rows, start, start + size))
        start += size
    return out


def _rows(value: Any, start: int, end: int) -> Any:
    if isinstance(value, Mapping):
        return {key: _rows(item, start, end) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_rows(item, start, end) for item in value)
    return value[start:end]


def joined(pieces: list[Any]) -> Any:
    """Batch outputs as one, leaf by leaf: tensors and arrays along their first axis (with
    the library of their own type, already imported where they were made), lists element by
    element; tuples and mappings keep their structure. Each rank joins its own batches with
    it, and the kernel the ranks' shares.

    >>> import numpy
    >>> joined([{"x": numpy.zeros(2), "ids": [0, 1]}, {"x": numpy.ones(1), "ids": [2]}])
    {'x': array([0., 0., 1.]), 'ids': [0, 1, 2]}
    """
    first = pieces[0]
    if isinstance(first, Mapping):
        return {key: joined([p[key] for p in pieces]) for key in first}
    if isinstance(first, tuple):
        return tuple(joined([p[i] for p in pieces]) for i in range(len(first)))
    if isinstance(first, list):
        return [row for piece in pieces for row in piece]
    library = type(first).__module__.split(".")[0]
    if library == "torch":
        return sys.modules["torch"].cat(pieces)
    if library == "numpy":
        return sys.modules["numpy"].concatenate(pieces)
    raise TypeError(
        f"workers.map: fn returned a {type(first).__name__} per batch; return a tensor, an "
        "array or a list with a row per sample (or a tuple or dict of them)."
    )


def _cut(value: Any, total: int) -> Any:
    if isinstance(value, Mapping):
        return {key: _cut(item, total) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_cut(item, total) for item in value)
    return value[:total]
