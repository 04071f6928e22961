"""Serialising the user's function: by value for cells, and naming whatever cannot travel."""

from __future__ import annotations

import linecache
import pickle
import threading

import pytest

from nbaccel.config.schema import Config
from nbaccel.errors import SerializationError
from nbaccel.launcher.bootstrap.payload import build_payload

LOCK = threading.Lock()


def uses_global_lock() -> bool:
    return LOCK.locked()


def test_payload_round_trips_a_closure() -> None:
    factor = 7

    def scaled(x: int) -> int:
        return x * factor

    data = pickle.loads(build_payload(scaled, (3,), {}, Config(num_processes=2)).data)
    function, args, kwargs = pickle.loads(data["function"])
    assert function(*args, **kwargs) == 21
    assert data["config"].num_processes == 2
    assert isinstance(data["sys_path"], list)


def test_unpicklable_closure_variable_is_named() -> None:
    lock = threading.Lock()

    def train() -> None:
        lock.acquire()

    with pytest.raises(SerializationError, match="the closure variable 'lock' \\(a lock\\)"):
        build_payload(train, (), {}, Config())


def test_unpicklable_global_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # Functions of an importable module travel by reference; pretend this one is __main__'s.
    monkeypatch.setattr(uses_global_lock, "__module__", "__main__")
    with pytest.raises(SerializationError, match="the global variable 'LOCK'") as caught:
        build_payload(uses_global_lock, (), {}, Config())
    assert "Create such objects inside the function" in str(caught.value)


def test_unpicklable_argument_is_named() -> None:
    with pytest.raises(SerializationError, match=r"args\[1\] \(a generator\)"):
        build_payload(print, (1, (x for x in [])), {}, Config())
    with pytest.raises(SerializationError, match="keyword argument 'out'"):
        build_payload(print, (), {"out": threading.Lock()}, Config())


def test_cell_sources_travel_for_tracebacks() -> None:
    name = "/tmp/ipykernel_0/1234.py"
    linecache.cache[name] = (20, None, ["def train():\n", "    raise ValueError\n"], name)
    try:
        data = pickle.loads(build_payload(print, (), {}, Config()).data)
    finally:
        del linecache.cache[name]
    assert data["sources"][name] == ["def train():\n", "    raise ValueError\n"]
    assert all(not path.endswith("payload.py") for path in data["sources"])
