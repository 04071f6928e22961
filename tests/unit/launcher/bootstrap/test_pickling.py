"""What the workers receive: code with its real file and lines, compiled classes by
reference, and no open file or socket (refused, naming the variable)."""

from __future__ import annotations

import io
import linecache
import pickle
import socket
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.config.schema import Config
from nbaccel.errors import SerializationError
from nbaccel.launcher.bootstrap import pickling
from nbaccel.launcher.bootstrap.payload import build_payload

CELL = "/tmp/ipykernel_4242/2718281828.py"  # as ipykernel names a cell: not on disk
CELL_SOURCE = """\
import math

def train(batch):
    scale = lambda x: x * math.pi
    def inner(values):
        loss = sum(scale(v) for v in values) / len(missing_name)
        return loss
    return inner(batch)
"""


@pytest.fixture
def cell() -> Iterator[dict[str, Any]]:
    """A function defined in a 'notebook cell': its source only in linecache, its module
    __main__ (so cloudpickle ships it by value)."""
    lines = CELL_SOURCE.splitlines(keepends=True)
    linecache.cache[CELL] = (len(CELL_SOURCE), None, lines, CELL)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(CELL_SOURCE, CELL, "exec"), namespace)
    yield namespace
    linecache.cache.pop(CELL, None)


def code_objects(code: Any) -> list[Any]:
    found = [code]
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            found += code_objects(const)
    return found


def test_shipped_code_keeps_its_file_name_and_lines(cell: dict[str, Any]) -> None:
    original = cell["train"]
    restored = pickle.loads(pickling.dumps(original))
    assert restored is not original  # by value, as a cell's function must travel
    before = [(c.co_name, c.co_filename, c.co_firstlineno) for c in code_objects(original.__code__)]
    after = [(c.co_name, c.co_filename, c.co_firstlineno) for c in code_objects(restored.__code__)]
    assert after == before
    assert {name for name, _, _ in after} == {"train", "<lambda>", "inner", "<genexpr>"}
    assert all(filename == CELL for _, filename, _ in after)


def test_a_worker_traceback_shows_the_cell_line(cell: dict[str, Any]) -> None:
    restored = pickle.loads(pickling.dumps(cell["train"]))
    lines = linecache.cache.pop(CELL)[2]  # a worker starts without the kernel's linecache
    linecache.cache[CELL] = (0, None, lines, CELL)  # ... and installs the payload's sources
    with pytest.raises(NameError) as caught:
        restored([1.0, 2.0])
    text = "".join(traceback.format_exception(caught.value))
    assert f'File "{CELL}", line 6, in inner' in text
    assert "loss = sum(scale(v) for v in values) / len(missing_name)" in text


def test_compiled_classes_claiming_builtins_travel_by_reference() -> None:
    safetensors = pytest.importorskip("safetensors")
    safe_open = safetensors.safe_open
    assert safe_open.__module__ == "builtins"  # the PyO3 class that cloudpickle copied
    assert pickle.loads(pickling.dumps(safe_open)) is safe_open
    assert hasattr(pickle.loads(pickling.dumps(safe_open)), "__enter__")


def test_a_cell_function_using_safe_open_works_after_the_trip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.ones(2)}, str(path))
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(
        "from safetensors import safe_open\n"
        "def keys(path):\n"
        "    with safe_open(path, framework='pt') as f:\n"
        "        return list(f.keys())\n",
        namespace,
    )
    restored = pickle.loads(pickling.dumps(namespace["keys"]))
    assert restored(str(path)) == ["weight"]


def test_classes_defined_in_a_cell_still_travel_by_value() -> None:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec("class Scaler:\n    def __call__(self, x):\n        return 2 * x\n", namespace)
    data = pickling.dumps(namespace["Scaler"])
    assert b"_make_skeleton_class" in data  # cloudpickle's by-value class constructor
    assert pickle.loads(data)()(21) == 42


@pytest.fixture
def handles(tmp_path: Path) -> Iterator[dict[str, Any]]:
    path = tmp_path / "data.txt"
    path.write_text("rows")
    with open(path) as text, open(path, "rb") as binary, socket.socket() as sock:
        yield {"text file": text, "binary file": binary, "socket": sock}


def test_open_files_and_sockets_are_refused(handles: dict[str, Any]) -> None:
    for what, handle in handles.items():
        with pytest.raises(pickling.CannotTravel, match="cannot travel to the workers"):
            pickling.dumps([handle])
        with pytest.raises(SerializationError, match=r"args\[0\] is an open") as caught:
            build_payload(print, (handle,), {}, Config())
        fix = "connect inside the function" if what == "socket" else "open it inside"
        assert fix in str(caught.value)
    # In-memory buffers are plain data: they travel.
    assert pickle.loads(pickling.dumps(io.BytesIO(b"x"))).getvalue() == b"x"


def test_handles_are_named_in_keywords_closures_and_globals(
    handles: dict[str, Any], nothing_started: Path
) -> None:
    log = handles["text file"]

    def uses_closure() -> str:
        return log.read()

    with pytest.raises(SerializationError, match="keyword argument 'file' is an open file"):
        nbaccel.launch(print, kwargs={"file": log}, runs_dir=str(nothing_started))
    with pytest.raises(SerializationError, match="the closure variable 'log' is an open file"):
        nbaccel.launch(uses_closure, runs_dir=str(nothing_started))
    namespace: dict[str, Any] = {"__name__": "__main__", "LOG": log}
    exec("def uses_global():\n    return LOG.read()\n", namespace)
    with pytest.raises(SerializationError, match="the global variable 'LOG' is an open file"):
        nbaccel.launch(namespace["uses_global"], runs_dir=str(nothing_started))
