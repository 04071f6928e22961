"""Run a torchrun-style script or module as a worker's function (``nbaccel launch``).

The same code serves both paths: on one machine nbaccel's own launcher calls ``run_script``
in each forked worker; across machines torch elastic starts ``python -m
nbaccel.launcher.bootstrap.script ENV_JSON TARGET...`` and ``main`` applies nbaccel's environment
first. Either way the script sees itself as ``__main__`` with its own ``sys.argv``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from typing import NoReturn

from nbaccel.launcher.bootstrap.prctl import flush_c_stdio


def run_script(target: str, is_module: bool, argv: list[str]) -> None:
    """Execute ``target`` (a path, or a module name with ``is_module``) as ``__main__``.

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
    >>> _ = path.write_text("import sys; print('hello', sys.argv[1:])")
    >>> run_script(str(path), False, ["--lr", "3"])
    hello ['--lr', '3']
    """
    if is_module:
        sys.argv = [target, *argv]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py`
        runpy.run_path(target, run_name="__main__")


def main(argv: list[str]) -> NoReturn:
    """Elastic worker entry: ``ENV_JSON (-m MODULE | SCRIPT) [ARGS...]``.

    Leaves with ``os._exit`` after destroying a live process group: a gloo group alive at
    interpreter shutdown aborts the process (SIGABRT) in a good share of runs.
    """
    env = json.loads(argv[0])
    os.environ.update(env)
    os.environ.setdefault("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    is_module = argv[1] == "-m"
    rest = argv[2:] if is_module else argv[1:]
    code = 0
    try:
        run_script(rest[0], is_module, rest[1:])
    except SystemExit as request:
        code = request.code if isinstance(request.code, int) else (0 if request.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed like an uncaught exception, then exit 1
        traceback.print_exc()
        code = 1
    _leave(code)


def _leave(code: int) -> NoReturn:
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    flush_c_stdio()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
