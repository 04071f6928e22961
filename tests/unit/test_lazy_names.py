"""Stand-ins for the names whose module imports torch (``nbaccel/lazy_names.py``): each one
behaves as the real object once used, and travels as it. This test process has torch loaded
already, where ``load`` gives the real objects, so stand-ins are made here on purpose; the
kernel's side (torch left out until a name is used) is
tests/multiprocess/test_lazy_accelerate_names.py."""

from __future__ import annotations

import copy
import pickle
import pydoc
import typing
from typing import Any

import cloudpickle
import pytest

import nbaccel
import nbaccel.utils
from nbaccel import lazy_names
from nbaccel.accel import Accelerator as RealAccelerator
from nbaccel.accel.partial_state import PartialState as RealPartialState
from nbaccel.utils.random import set_seed as real_set_seed


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Makes stand-ins as a torch-free kernel gets them (here torch is loaded already)."""
    monkeypatch.setattr(lazy_names, "_cheap", lambda module: False)
    monkeypatch.setattr(lazy_names, "_stand_ins", {})

    def make(module: str, name: str, package: str = "nbaccel") -> Any:
        value = lazy_names.load(module, name, package=package)
        assert isinstance(value, lazy_names.StandIn)
        return value

    return make


def test_where_importing_costs_nothing_the_real_object_is_served() -> None:
    # torch is loaded in this process: nothing is left to save.
    assert nbaccel.Accelerator is RealAccelerator
    assert nbaccel.utils.set_seed is real_set_seed
    assert lazy_names.load("nbaccel.config.schema", "Config", package="nbaccel") is nbaccel.Config


def test_one_stand_in_per_name(stand_in: Any) -> None:
    assert stand_in("nbaccel.accel", "Accelerator") is stand_in("nbaccel.accel", "Accelerator")


def test_calling_it_calls_the_real_one(stand_in: Any) -> None:
    seed = stand_in("nbaccel.utils.random", "set_seed", "nbaccel.utils")
    seed(3)
    import random

    state = random.random()
    real_set_seed(3)
    assert random.random() == state
    accelerator = stand_in("nbaccel.accel", "Accelerator")(cpu=True)
    assert type(accelerator) is RealAccelerator


def test_isinstance_issubclass_and_subclassing(stand_in: Any) -> None:
    Accelerator = stand_in("nbaccel.accel", "Accelerator")
    PartialState = stand_in("nbaccel.accel.partial_state", "PartialState")

    class MyAcc(Accelerator):  # type: ignore[misc,valid-type]
        def hello(self) -> str:
            return f"rank {self.process_index}"

    assert MyAcc.__mro__[1] is RealAccelerator
    assert issubclass(MyAcc, Accelerator) and issubclass(RealAccelerator, Accelerator)
    assert not issubclass(int, Accelerator)
    mine = MyAcc(cpu=True)
    assert isinstance(mine, Accelerator) and isinstance(mine, RealAccelerator)
    assert mine.hello() == "rank 0"
    assert isinstance(RealPartialState(), PartialState)
    assert not isinstance(3, Accelerator)


def test_attributes_help_and_the_docstring_are_the_real_ones(stand_in: Any) -> None:
    Accelerator = stand_in("nbaccel.accel", "Accelerator")
    assert Accelerator.prepare is RealAccelerator.prepare
    assert Accelerator.__doc__ == RealAccelerator.__doc__
    assert Accelerator.__name__ == "Accelerator"
    assert "prepare" in dir(Accelerator)
    text = pydoc.render_doc(Accelerator, renderer=pydoc.plaintext)
    real = pydoc.render_doc(RealAccelerator, renderer=pydoc.plaintext)
    assert text.splitlines()[0] == "Python Library Documentation: Accelerator in module nbaccel"
    assert text.splitlines()[1:] == real.splitlines()[1:]  # the whole class, methods included
    seed = stand_in("nbaccel.utils.random", "set_seed", "nbaccel.utils")
    assert "set_seed(seed: 'int'" in pydoc.render_doc(seed, renderer=pydoc.plaintext)
    import inspect

    assert inspect.signature(seed) == inspect.signature(real_set_seed)


def test_an_enum_iterates_and_indexes(stand_in: Any) -> None:
    from nbaccel.config.accelerate.enums import LoggerType as Real

    LoggerType = stand_in("nbaccel.config.accelerate.enums", "LoggerType")
    assert list(LoggerType) == list(Real) and len(LoggerType) == len(Real)
    assert LoggerType["WANDB"] is Real.WANDB and LoggerType.WANDB is Real.WANDB
    assert Real.WANDB in LoggerType


def test_it_travels_as_the_real_object(stand_in: Any) -> None:
    Accelerator = stand_in("nbaccel.accel", "Accelerator")
    seed = stand_in("nbaccel.utils.random", "set_seed", "nbaccel.utils")
    assert pickle.loads(pickle.dumps(Accelerator)) is RealAccelerator
    payload = cloudpickle.dumps(lambda: (Accelerator, seed))  # a cell's function, by value
    assert cloudpickle.loads(payload)() == (RealAccelerator, real_set_seed)
    assert b"Accelerator" in payload and b"load_real" in payload  # by reference, by name
    assert copy.copy(Accelerator) is Accelerator and copy.deepcopy(Accelerator) is Accelerator


def test_annotations_and_monkeypatching(stand_in: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    Accelerator = stand_in("nbaccel.accel", "Accelerator")
    optional = Accelerator | None
    assert typing.get_args(optional) == (Accelerator, type(None))
    monkeypatch.setattr(Accelerator, "greeting", "hi", raising=False)
    assert RealAccelerator.greeting == "hi"  # type: ignore[attr-defined]


def test_probes_of_displays_and_protocols_are_not_forwarded(stand_in: Any) -> None:
    Accelerator = stand_in("nbaccel.accel", "Accelerator")
    for probe in ("_repr_html_", "_ipython_display_", "__typing_subst__", "__getstate__x"):
        assert getattr(Accelerator, probe, None) is None
    assert repr(Accelerator) == repr(RealAccelerator)  # loaded here: says what it is
