"""The first lines of a notebook written for Accelerate leave the kernel free of torch, and
the names they import work: in the workers as the real objects, in the kernel once used
(subclassing, ``help``, ``isinstance``: torch loads then, since the user asked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiprocess.conftest import run_script

NOTEBOOK = """
import sys

from nbaccel import Accelerator, PartialState, notebook_launcher
from nbaccel.utils import gather_object, set_seed
from nbaccel.logging import get_logger

logger = get_logger(__name__)
print("TOP", "torch" in sys.modules)

import nbaccel, nbaccel.utils
every = [getattr(nbaccel, name) for name in nbaccel.__all__ if name != "ConfigPanel"]
every += [getattr(nbaccel.utils, name) for name in nbaccel.utils.__all__]
print("EVERY NAME", "torch" in sys.modules)
print("ISINSTANCE", isinstance(3, Accelerator), "torch" in sys.modules)
print("REPR", repr(Accelerator))


def train(seed):
    import torch

    set_seed(seed)
    acc = Accelerator()
    logger.info("rank %d ready", acc.process_index, main_process_only=False)
    kind = type(acc)
    return {
        "world": acc.num_processes,
        "state": PartialState().num_processes,
        "class": f"{kind.__module__}.{kind.__qualname__}",
        "real": isinstance(acc, Accelerator) and Accelerator is kind,
        "draws": gather_object([round(torch.rand(1).item(), 6)]),
    }


options = dict(num_processes=2, runs_dir=sys.argv[1] if len(sys.argv) > 1 else "runs",
               dashboard=False)
result = notebook_launcher(train, (7,), **options)
print("RESULT", result)
print("AFTER LAUNCH", "torch" in sys.modules)

import pydoc

text = pydoc.render_doc(Accelerator, renderer=pydoc.plaintext)
print("HELP", "prepare(" in text, "accumulate(" in text, "torch" in sys.modules)
print("DOC", Accelerator.__doc__.splitlines()[0])


class MyAcc(Accelerator):
    def hello(self):
        return f"rank {self.process_index} of {self.num_processes}"


from nbaccel.accel import Accelerator as Real

print("SUBCLASS", MyAcc.__mro__[1] is Real, issubclass(MyAcc, Accelerator))
print("ISINSTANCE NOW", isinstance(Real(cpu=True), Accelerator))


def greet():
    return MyAcc().hello()


print("RESULT2", notebook_launcher(greet, **options))
"""


@pytest.mark.timeout(300)
def test_an_accelerate_notebooks_imports_keep_torch_out_until_used(tmp_path: Path) -> None:
    result = run_script(NOTEBOOK, tmp_path, timeout=280)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "TOP False\n" in out  # the imports of the first cell
    assert "EVERY NAME False\n" in out  # every name of nbaccel and nbaccel.utils
    assert "ISINSTANCE False False\n" in out  # nothing can be an instance yet: not loaded
    assert "REPR <nbaccel.Accelerator: loads nbaccel.accel (and torch) on first use>" in out
    [line] = [line for line in out.splitlines() if line.startswith("RESULT ")]
    summary = eval(line.removeprefix("RESULT "))
    assert summary["world"] == summary["state"] == 2
    assert summary["class"] == "nbaccel.accel.accelerator.Accelerator" and summary["real"]
    assert summary["draws"][0] == summary["draws"][1]  # set_seed(7) on every rank
    assert "AFTER LAUNCH False\n" in out  # a whole launch: the kernel still free of torch
    assert "HELP True True True\n" in out  # help() documents the class (torch loads then)
    assert "DOC Runs one training loop correctly" in out
    assert "SUBCLASS True True\n" in out and "ISINSTANCE NOW True\n" in out
    assert "RESULT2 rank 0 of 2\n" in out  # a cell's subclass runs on the workers
