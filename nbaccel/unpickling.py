"""Reading what nbaccel's other processes send (workers, agents, the helper, a detached run's
supervisor): unpickled without importing anything.

``pickle.loads`` imports the module of every class a pickle names. One field that holds a
torch object (``torch.__version__`` is a ``TorchVersion``, not a ``str``) imported torch into
the kernel: ~200 MB and a second or more, which nbaccel's parent side never does (DESIGN.md
§2). :func:`loads` finds classes only in modules this process has already imported and
refuses any other with :class:`ImportRefused`, naming it: a new field that carries such an
object fails the tests that launch from a torch-free interpreter, instead of importing torch
quietly in every user's kernel. The wire carries plain data; this holds the rule.

A rank's returned value is not read here: ``Run.result`` unpickles it as it is, so a
returned tensor imports torch in the kernel, because the user asked for that tensor.
Stdlib only.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any


class ImportRefused(pickle.UnpicklingError):
    """A pickle named a class of a module this process has not imported."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name
        super().__init__(
            f"a message from another nbaccel process holds a {module}.{name} object, and "
            f"reading it would import {module!r} here, which nbaccel's parent side never does "
            "(a kernel stays free of torch). This is a bug in nbaccel: messages between its "
            "processes carry plain data (str(torch.__version__), tensor.tolist()); please "
            "report it."
        )


class _LoadedOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module not in sys.modules:
            raise ImportRefused(module, name)
        return super().find_class(module, name)


def loads(data: bytes) -> Any:
    """``pickle.loads``, but a class of a module not imported here is refused, not imported.

    >>> loads(pickle.dumps({"op": "agent", "torch": "2.13.0"}))
    {'op': 'agent', 'torch': '2.13.0'}
    >>> from fractions import Fraction  # imported here: read back as usual
    >>> loads(pickle.dumps(Fraction(1, 3)))
    Fraction(1, 3)
    >>> import types
    >>> sys.modules["elsewhere"] = elsewhere = types.ModuleType("elsewhere")
    >>> class Thing: ...
    >>> Thing.__module__, elsewhere.Thing = "elsewhere", Thing
    >>> data = pickle.dumps(Thing())
    >>> del sys.modules["elsewhere"]  # as torch is, in the kernel
    >>> loads(data)
    Traceback (most recent call last):
    ...
    nbaccel.unpickling.ImportRefused: a message ... holds a elsewhere.Thing object, and ...
    >>> "elsewhere" in sys.modules
    False
    """
    return _LoadedOnly(io.BytesIO(data)).load()
