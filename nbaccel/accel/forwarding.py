"""How the ``Accelerator`` facade exposes its parts' members: by name, with the part's own
signature and docstring, so each member is documented once, next to its code."""

from __future__ import annotations

import functools
from typing import Any


def part_member(part: str, owner: type, name: str) -> Any:
    """A member of the facade that its part ``self.<part>`` (of class ``owner``) implements:
    the same name, signature and docstring.

    >>> class Part:
    ...     def twice(self, x: int) -> int:
    ...         "Two times x."
    ...         return 2 * x
    >>> class Facade:
    ...     twice = part_member("_part", Part, "twice")
    ...     def __init__(self) -> None:
    ...         self._part = Part()
    >>> Facade().twice(4), Facade.twice.__doc__
    (8, 'Two times x.')
    """
    member = getattr(owner, name)
    if isinstance(member, property):
        return property(lambda self: getattr(getattr(self, part), name), doc=member.__doc__)

    @functools.wraps(member)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, part), name)(*args, **kwargs)

    return forward


def option(path: str, doc: str) -> property:
    """A read-only view of a nested attribute (``"options.dataloader.non_blocking"``)."""
    return property(lambda self: functools.reduce(getattr, path.split("."), self), doc=doc)


def settable(path: str, doc: str) -> property:
    """Like ``option``, and assignable: setting it sets the nested attribute."""
    *owner, name = path.split(".")

    def set_value(self: Any, value: Any) -> None:
        setattr(functools.reduce(getattr, owner, self), name, value)

    return property(
        lambda self: getattr(functools.reduce(getattr, owner, self), name, None), set_value, doc=doc
    )
