"""The package's public names: loaded on first use (``nbaccel/__init__.py``), every one of
``__all__`` must resolve and show in ``dir`` (a notebook's tab completion reads it)."""

from __future__ import annotations

import pytest

import nbaccel


@pytest.mark.parametrize("name", nbaccel.__all__)
def test_every_public_name_resolves_from_the_module_that_defines_it(name: str) -> None:
    value = getattr(nbaccel, name)
    assert getattr(value, "__name__", name) == name  # the object itself, not its module


def test_dir_lists_the_names_not_loaded_yet() -> None:
    assert set(nbaccel.__all__) <= set(dir(nbaccel))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'nbaccel' has no attribute 'lanuch'"):
        nbaccel.lanuch  # noqa: B018 - the typo is the point


def test_dir_shows_no_typing_helpers() -> None:
    # What the package imports for its own annotations is private, not part of its names.
    public = {name for name in dir(nbaccel) if not name.startswith("_")}
    assert not public & {"Any", "TYPE_CHECKING"}
