"""A launch's error leaves with none of nbaccel's frames, as a worker's error does (issue 39,
item 18): its message says what is wrong; a SerializationError used to show ~12 frames of
nbaccel and its pickler. Causes keep their frames outside nbaccel (the user's own code); an
exception nbaccel did not mean to raise (a bug) keeps every frame."""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

import nbaccel
from nbaccel.errors import hidden_frames

PACKAGE = str(Path(nbaccel.__file__).parent)
# Python 3.10 re-raises the traceback a with statement saved, not the exception's own.
needs_311 = pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.11+ (see above)")


def nbaccel_frames(error: BaseException | None) -> list[str]:
    """nbaccel's frames in ``error``'s traceback and in those of the exceptions it shows."""
    found = []
    while error is not None:
        found += [
            f"{frame.filename}:{frame.lineno} {frame.name}"
            for frame in traceback.extract_tb(error.__traceback__)
            if frame.filename.startswith(PACKAGE)
        ]
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return found


def uses_a_lock() -> Callable[[], None]:
    """A function sent by value (a cell's function is too) that holds a lock in a closure."""
    lock = threading.Lock()

    def train() -> None:
        with lock:
            pass

    return train


class Unsendable:
    def __reduce__(self) -> tuple[object, ...]:
        raise ValueError("this object refuses to be pickled")


@needs_311
def test_a_serialization_error_shows_the_users_frames_only(tmp_path: Path) -> None:
    with pytest.raises(nbaccel.SerializationError) as caught:
        nbaccel.notebook_launcher(uses_a_lock(), num_processes=2, runs_dir=str(tmp_path))
    assert nbaccel_frames(caught.value) == []
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [frame.name for frame in frames] == [
        "test_a_serialization_error_shows_the_users_frames_only"
    ]
    assert "'lock'" in str(caught.value)  # the message names what could not be sent


@needs_311
def test_a_cause_in_the_users_code_keeps_its_frame(tmp_path: Path) -> None:
    with pytest.raises(nbaccel.SerializationError) as caught:
        nbaccel.launch(print, args=(Unsendable(),), num_processes=1, runs_dir=str(tmp_path))
    assert nbaccel_frames(caught.value) == []
    causes = []
    error: BaseException | None = caught.value.__cause__
    while error is not None:
        causes += [frame.name for frame in traceback.extract_tb(error.__traceback__)]
        error = error.__cause__ or error.__context__
    assert "__reduce__" in causes  # where the user's object refused


@needs_311
def test_a_config_error_from_launch_shows_no_nbaccel_frame(tmp_path: Path) -> None:
    with pytest.raises(nbaccel.ConfigError) as caught:
        nbaccel.launch(print, num_processes=2, runs_dir=str(tmp_path), collective_timeout=-1)
    assert nbaccel_frames(caught.value) == []


def test_a_bug_keeps_every_frame() -> None:
    def entry() -> None:
        with hidden_frames():
            {}["missing"]  # what a bug in nbaccel would raise

    with pytest.raises(KeyError) as caught:
        entry()
    assert [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)][-1] == (
        "entry"
    )


@needs_311
@pytest.mark.parametrize(
    ("function", "args"),
    [("not a function", ()), (lambda lr: None, 0.1), (lambda lr: None, ())],
    ids=["not-callable", "args-not-a-tuple", "missing-argument"],
)
def test_a_bad_call_shows_the_users_frames_only(function: object, args: object) -> None:
    # A TypeError for the call's own arguments showed 3-4 of nbaccel's frames: it is said
    # on purpose (CallError, still a TypeError), so it leaves as the other launch errors do.
    with pytest.raises(TypeError) as caught:
        nbaccel.notebook_launcher(function, args=args, num_processes=2)  # type: ignore[arg-type]
    assert isinstance(caught.value, nbaccel.errors.CallError)
    assert nbaccel_frames(caught.value) == []
