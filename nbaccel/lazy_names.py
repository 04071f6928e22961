"""Names whose module imports torch, served to a kernel without importing it until used.

The first lines of a notebook written for Accelerate (``from nbaccel import Accelerator``,
``from nbaccel.utils import set_seed``) run in the kernel, which nbaccel keeps free of torch
(~1-3 s to import, and CUDA state the workers should not inherit). ``load`` gives the real
object when its module is already imported, or torch is (nothing left to save: a worker, a
kernel that imported torch itself), and otherwise a *stand-in* that imports the module the
first time it is used and behaves as the real object from then on:

- calling it (``Accelerator(...)``, ``set_seed(0)``) calls the real one;
- ``isinstance(x, Accelerator)`` and ``issubclass`` ask the real class, and answer False
  without importing anything while its module is not loaded (nothing can be an instance);
- ``class MyAcc(Accelerator)`` subclasses the real class (``__mro_entries__``, PEP 560);
- attributes (``Accelerator.prepare``, ``DistributedType.MULTI_GPU``), ``dir``, the
  docstring, ``help()`` and IPython's ``Accelerator?`` show the real object's;
- pickled (cloudpickle sends a notebook function with the globals it uses), it travels as a
  reference to the real object, by module and name: a worker unpickles the real class, and
  nothing of the stand-in remains on its hot path.

The names nbaccel serves this way are those of its own modules that import torch
(``TORCH_MODULES``); every other name is loaded as it is. Plain Python, stdlib only.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing
from typing import Any

# Modules of nbaccel that import torch (nbaccel.accel's package imports it for all below it).
TORCH_MODULES = (
    "nbaccel.accel",
    "nbaccel.utils.memory",
    "nbaccel.utils.modeling",
    "nbaccel.utils.operations",
    "nbaccel.utils.progress",
    "nbaccel.utils.random",
    "nbaccel.utils.saving",
)

# One stand-in per served name, so that two imports of a name give the same object.
_stand_ins: dict[tuple[str, str, str], StandIn] = {}


def load(module: str, name: str, *, package: str) -> Any:
    """``name`` from ``module``, as the package ``package`` (``"nbaccel"``) serves it: the real
    object, or a stand-in while importing ``module`` would import torch into this process.

    >>> load("nbaccel.config.schema", "Config", package="nbaccel").__name__
    'Config'
    """
    if _cheap(module):
        return getattr(importlib.import_module(module), name)
    key = (package, module, name)
    if key not in _stand_ins:
        # A class per stand-in, holding its target: its docstring is the real object's.
        namespace = {"__slots__": (), "__doc__": _RealDoc(), "_target": (module, name)}
        kind = type(name, (StandIn,), namespace)
        kind.__module__ = package  # help() says "Accelerator in module nbaccel"
        _stand_ins[key] = kind()
    return _stand_ins[key]


def load_real(module: str, name: str) -> Any:
    """The real object (what a pickled stand-in becomes when it is unpickled)."""
    return getattr(importlib.import_module(module), name)


def _cheap(module: str) -> bool:
    """Whether importing ``module`` costs no torch import: already imported, torch already
    loaded here, or a module that does not import torch."""
    return (
        module in sys.modules
        or "torch" in sys.modules
        or not any(module == m or module.startswith(m + ".") for m in TORCH_MODULES)
    )


class _RealDoc:
    """``__doc__`` of a stand-in and of its class: the real object's (imports its module).

    Both give the same text, so pydoc finds no docstring of the stand-in's own, and
    ``help(stand_in)`` documents ``__origin__``, the real object, in full.
    """

    def __get__(self, instance: StandIn | None, owner: type[StandIn]) -> str | None:
        return typing.cast("str | None", load_real(*owner._target).__doc__)


class StandIn:
    """Stands for an object whose module imports torch, until the object is used."""

    __slots__ = ()
    _target: tuple[str, str]  # (module, name), set on the class of each stand-in by ``load``

    def _real(self) -> Any:
        return load_real(*self._target)

    def _loaded(self) -> Any | None:
        """The real object if its module is imported already, else None (imports nothing)."""
        module = sys.modules.get(self._target[0])
        return getattr(module, self._target[1], None) if module is not None else None

    # -- using it: the real object -------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Dunder and IPython's probes (_repr_html_, _ipython_display_, ...) are asked of any
        # object shown or pickled: answering them must not import torch. The dunders a class
        # is read through are served below.
        if name.startswith(("__", "_repr_", "_ipython_")):
            raise AttributeError(name)
        return getattr(self._real(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real(), name, value)  # monkeypatching a class in a cell patches it

    def __delattr__(self, name: str) -> None:
        delattr(self._real(), name)

    def __dir__(self) -> list[str]:
        return dir(self._real())

    def __getitem__(self, key: Any) -> Any:
        return self._real()[key]  # DistributedType["NO"], a generic's Class[...]

    def __iter__(self) -> Any:
        return iter(self._real())  # the members of an enum

    def __len__(self) -> int:
        return len(self._real())

    def __contains__(self, item: Any) -> bool:
        return item in self._real()

    def __or__(self, other: Any) -> Any:
        return typing.Union[self, other]  # noqa: UP007 - an annotation ``Accelerator | None``

    def __ror__(self, other: Any) -> Any:
        return typing.Union[other, self]  # noqa: UP007

    # -- classes: isinstance, issubclass, subclassing ------------------------------------
    def __instancecheck__(self, instance: Any) -> bool:
        real = self._loaded()  # not loaded: nothing can be an instance of it yet
        return real is not None and isinstance(instance, real)

    def __subclasscheck__(self, subclass: Any) -> bool:
        real = self._loaded()
        return real is not None and issubclass(subclass, real)

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self._real(),)  # ``class MyAcc(Accelerator)`` derives from the real class

    # -- reading it: names, help(), IPython's ``?`` --------------------------------------
    @property
    def __name__(self) -> str:
        return self._target[1]

    @property
    def __origin__(self) -> Any:
        return self._real()  # what pydoc documents for an object without a docstring of its own

    @property
    def __wrapped__(self) -> Any:
        return self._real()  # inspect.signature and IPython's ? unwrap to it

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._real())

    @property
    def __mro__(self) -> tuple[type, ...]:
        return typing.cast("tuple[type, ...]", self._real().__mro__)

    @property
    def __bases__(self) -> tuple[type, ...]:
        return typing.cast("tuple[type, ...]", self._real().__bases__)

    def __repr__(self) -> str:
        real = self._loaded()
        if real is not None:
            return repr(real)
        module, name = self._target
        return f"<{type(self).__module__}.{name}: loads {module} (and torch) on first use>"

    # -- pickling and copying: the real object, by reference -----------------------------
    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return load_real, self._target

    def __copy__(self) -> StandIn:
        return self  # as a class or function is copied: itself

    def __deepcopy__(self, memo: dict[int, Any]) -> StandIn:
        return self
