"""How the user's function and arguments are pickled for the workers: cloudpickle, with
three corrections of nbaccel's own (a ``reducer_override`` on a ``cloudpickle.Pickler``).

1. **Code keeps its file name and lines.** cloudpickle 3.1.3 rewrites every shipped code
   object's ``co_filename`` to ``<dynamic-code>``, so a worker's traceback lost the cell's
   source lines (the payload carries the cell sources for linecache, looked up by file
   name). Code objects travel as ``marshal`` bytes instead: exact, nested code included.
   Parent and workers run the same interpreter, which is what marshal's format assumes.
2. **Compiled classes that claim to live in ``builtins``** (PyO3 classes such as
   safetensors' ``safe_open``) are not in ``builtins``; cloudpickle then copies them by
   value, as a class without their methods. They travel by reference to the module that
   really holds them. Fork-based launchers never pickle them, so users do not expect this.
3. **Open files and sockets are refused**, naming the variable (``payload._explain``):
   cloudpickle would ship a read-mode file's contents as a copy, and each worker is a
   separate process that cannot share the handle. In-memory buffers travel as they are.
4. **A model wrapped in ``DistributedDataParallel`` travels as the module it wraps**: the
   wrapper holds the ranks' process group, so a rank's returned DDP model could not be
   unpickled in the kernel ("Default process group has not been initialized").
"""

from __future__ import annotations

import builtins
import importlib
import io
import marshal
import pickle
import socket
import sys
import types
from collections.abc import Callable
from typing import Any

import cloudpickle

from nbaccel.launcher.sharing.tensors import reduce_tensor

PROTOCOL = 5


class CannotTravel(TypeError):
    """An object that cannot be used in another process (an open file, a socket)."""


def dumps(obj: Any, buffer_callback: Callable[[pickle.PickleBuffer], bool] | None = None) -> bytes:
    """Pickle ``obj`` as the workers will receive it (``pickle.loads`` reads it back).

    ``buffer_callback``: protocol 5's (a buffer it returns False for stays out of the
    pickle: ``sharing.packing.split``); with one, CPU tensors hand out their storage too
    (``sharing.tensors``).

    >>> import pickle
    >>> def add(a, b):
    ...     return a + b
    >>> restored = pickle.loads(dumps(add))
    >>> restored(2, 3), restored.__code__.co_filename == add.__code__.co_filename
    (5, True)
    """
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=PROTOCOL, buffer_callback=buffer_callback).dump(obj)
    return buffer.getvalue()


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    def __init__(
        self,
        file: io.BytesIO,
        protocol: int,
        buffer_callback: Callable[[pickle.PickleBuffer], bool] | None,
    ) -> None:
        super().__init__(file, protocol=protocol, buffer_callback=buffer_callback)
        self._out_of_band = buffer_callback is not None

    def reducer_override(self, obj: Any) -> Any:
        if self._out_of_band:
            reduced = reduce_tensor(obj)
            if reduced is not None:
                return reduced
        if isinstance(obj, types.CodeType):
            return _code_from_marshal, (marshal.dumps(obj),)
        if isinstance(obj, type):
            home = _real_home(obj)
            if home is not None:
                return import_attribute, (home, obj.__qualname__)
        elif _is_handle(obj):
            raise CannotTravel(_handle_message(obj))
        elif _is_ddp(obj):
            return _same, (obj.module,)
        return super().reducer_override(obj)


def _is_ddp(obj: Any) -> bool:
    """Whether ``obj`` is a DistributedDataParallel wrapper (torch is not imported here)."""
    torch = sys.modules.get("torch")
    parallel = getattr(getattr(torch, "nn", None), "parallel", None)
    wrapper = getattr(parallel, "DistributedDataParallel", None)
    return wrapper is not None and isinstance(obj, wrapper)


def _same(obj: Any) -> Any:
    return obj


def _code_from_marshal(data: bytes) -> types.CodeType:
    code = marshal.loads(data)
    assert isinstance(code, types.CodeType)
    return code


def import_attribute(module: str, qualname: str) -> Any:
    """``module.qualname`` (dotted), imported: how a class travels by reference.

    >>> import_attribute("collections", "OrderedDict.fromkeys").__name__
    'fromkeys'
    """
    return _follow(vars(importlib.import_module(module)), qualname)


def _real_home(cls: type) -> str | None:
    """The module that holds ``cls`` when it claims ``builtins`` but is not there."""
    if cls.__module__ != "builtins" or getattr(builtins, cls.__qualname__, None) is cls:
        return None
    holders = []
    for module_name, module in list(sys.modules.items()):
        # The module's own namespace only: getattr could run a lazy module's __getattr__.
        namespace = getattr(module, "__dict__", None)
        if module_name == "__main__" or not isinstance(namespace, dict):
            continue
        try:
            if _follow(namespace, cls.__qualname__) is cls:
                holders.append(module_name)
        except (KeyError, AttributeError):
            continue
    if not holders:
        return None
    # Prefer a public module ("safetensors" over "safetensors._safetensors_rust"), then the
    # shortest name: the one users import from, and the likeliest to import in the workers.
    return min(holders, key=lambda m: (any(p.startswith("_") for p in m.split(".")), len(m), m))


def _follow(namespace: dict[str, Any], qualname: str) -> Any:
    first, *rest = qualname.split(".")
    value = namespace[first]
    for part in rest:
        value = getattr(value, part)
    return value


def _is_handle(obj: Any) -> bool:
    if isinstance(obj, (io.BytesIO, io.StringIO)):
        return False  # in-memory: a copy is what the user gets anyway
    return isinstance(obj, (io.IOBase, socket.socket))


def _handle_message(obj: Any) -> str:
    if isinstance(obj, socket.socket):
        what = f"an open socket ({obj!r:.80})"
        fix = "pass its address and connect inside the function"
    else:
        name = getattr(obj, "name", None)
        what = f"an open file ({name!r})" if name is not None else "an open file"
        fix = "pass its path and open it inside the function"
    return (
        f"{what} cannot travel to the workers: each is a separate process, which cannot use "
        f"this process's handle; {fix}"
    )


def cell_globals(function: object) -> dict[str, Any] | None:
    """The globals of a function defined in a cell (module ``__main__``), which travels by
    value and takes them along as they are when it is sent; None for anything else.

    >>> exec("def f(): pass", kernel := {"__name__": "__main__"})
    >>> cell_globals(kernel["f"]) is kernel, cell_globals(len)
    (True, None)
    """
    if isinstance(function, types.FunctionType) and function.__module__ == "__main__":
        return function.__globals__
    return None
