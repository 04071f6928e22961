"""The layers of DESIGN.md §2, one way down, read from the source with ``ast``.

    entry points   nbaccel (the package and its __main__), nbaccel.launching,
                   nbaccel.detached_runs, nbaccel.cli, nbaccel.ui, demo,
                   and the worker-side facades of Accelerate's modules: nbaccel.utils,
                   nbaccel.logging (they may import nbaccel.accel; nothing imports them)
    sides          nbaccel.launcher (parent)  |  nbaccel.accel (worker): never each other
    base           nbaccel.config, errors, events, frames, unpickling, context, hardware
                   (devices, xla_plan, memory_estimate), env_names, metrics, step_board,
                   lazy_names, durable (checkpoint copies through fsspec): plain data,
                   importing no side and no entry point

Every import counts, also those inside functions (a lazy import is still a dependency).
Besides: the parent side never imports torch at module level, so ``import nbaccel`` and a
launch keep the kernel free of it (tests/multiprocess/test_docs_and_imports.py runs that).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nbaccel"

ENTRY = (
    "nbaccel",
    "nbaccel.__main__",
    "nbaccel.launching",
    "nbaccel.detached_runs",
    "nbaccel.cli",
    "nbaccel.ui",
    "nbaccel.demo",
    "nbaccel.utils",
    "nbaccel.logging",
    "nbaccel.interactive",
    "nbaccel.sweeps",
)
SIDES = ("nbaccel.launcher", "nbaccel.accel")
BASE = (
    "nbaccel.config",
    "nbaccel.errors",
    "nbaccel.events",
    "nbaccel.frames",
    "nbaccel.unpickling",
    "nbaccel.context",
    "nbaccel.hardware",
    "nbaccel.env_names",
    "nbaccel.metrics",
    "nbaccel.step_board",
    "nbaccel.lazy_names",
    "nbaccel.durable",
)
# Worker-side modules of the launcher: they run in the workers (forked from the helper),
# so they may import torch; none of them is imported by the parent side.
WORKER_SIDE_LAUNCHER = (
    "nbaccel.launcher.local.worker",
    "nbaccel.launcher.bootstrap.worker_bootstrap",
    "nbaccel.launcher.remote.agent_main",
    "nbaccel.launcher.remote.agent_run",
    "nbaccel.launcher.remote.agent_worker",
    "nbaccel.launcher.xla.worker",
    "nbaccel.launcher.xla.supervisor",
    "nbaccel.launcher.bootstrap.device_memory",
    "nbaccel.launcher.bootstrap.script",
    "nbaccel.launcher.remote.elastic",
    "nbaccel.launcher.local.helper_main",
    "nbaccel.launcher.interactive.serve",
    "nbaccel.launcher.interactive.model_ops",
    "nbaccel.launcher.interactive.state_export",
)
# The modules behind ``nbaccel.utils`` that run in workers and import torch (the package
# itself loads them lazily; it and nbaccel.utils.availability stay torch-free).
WORKER_SIDE_UTILS = (
    "nbaccel.utils.operations",
    "nbaccel.utils.random",
    "nbaccel.utils.memory",
    "nbaccel.utils.modeling",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def imports(tree: ast.Module, *, top_level_only: bool = False) -> set[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def owning_module(name: str) -> str:
    """The module an imported name lives in ("nbaccel.config.schema.Config" -> its module;
    "nbaccel.log_metrics", taken from the package, -> "nbaccel")."""
    while name not in modules() and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def layer(name: str) -> str:
    name = owning_module(name)
    if name == "nbaccel" or within(name, ENTRY[1:]):
        return "entry"
    if within(name, ("nbaccel.launcher",)):
        return "launcher"
    if within(name, ("nbaccel.accel",)):
        return "accel"
    assert within(name, BASE), f"{name} is in no layer: add it to this test's map"
    return "base"


ALLOWED = {
    "entry": {"entry", "launcher", "accel", "base"},
    "launcher": {"launcher", "base"},
    "accel": {"accel", "base"},
    "base": {"base"},
}


def own_imports(tree: ast.Module) -> set[str]:
    # "nbaccel.config.schema.Config" and "nbaccel.config.schema" both name the module's layer.
    return {name for name in imports(tree) if name.startswith("nbaccel.")}


@pytest.mark.parametrize("name", sorted(modules()))
def test_imports_go_one_way_down(name: str) -> None:
    tree = modules()[name]
    wrong = sorted(
        f"{name} ({layer(name)}) imports {target} ({layer(target)})"
        for target in own_imports(tree)
        if layer(target) not in ALLOWED[layer(name)]
    )
    assert not wrong, wrong


def test_every_module_has_a_layer_and_the_map_names_real_modules() -> None:
    names = set(modules())
    for name in names:
        layer(name)
    for prefix in (*ENTRY, *SIDES, *BASE, *WORKER_SIDE_LAUNCHER, *WORKER_SIDE_UTILS):
        assert any(within(n, (prefix,)) for n in names), f"{prefix} no longer exists"


def test_the_parent_side_never_imports_torch_at_module_level() -> None:
    worker_side = ("nbaccel.accel", *WORKER_SIDE_LAUNCHER, *WORKER_SIDE_UTILS)
    wrong = sorted(
        name
        for name, tree in modules().items()
        if not within(name, worker_side)
        and any(within(i, ("torch", "torch_xla")) for i in imports(tree, top_level_only=True))
    )
    assert not wrong, f"parent-side modules importing torch at import time: {wrong}"


def test_the_layer_check_catches_a_violation() -> None:
    # The launcher reaching up into the UI (as it once did, lazily) must be caught.
    tree = ast.parse("def start():\n    from nbaccel.ui.attach import attach_dashboard\n")
    targets = own_imports(tree)
    assert any(layer(t) not in ALLOWED["launcher"] for t in targets)


# Rooms inside the big packages (each sub-package's __init__ docstring says the same): what
# each sub-package may import of its own package, by room — a sibling sub-package or a
# module at the package's top. The package's top modules may import any of its rooms, as
# long as no circle forms (the test below).
ROOMS: dict[str, dict[str, set[str]]] = {
    "nbaccel.launcher": {
        # Large buffers in shared memory: what the payload, agents and the interactive
        # wire all call, below everything else.
        "sharing": set(),
        # Each rank's debug channel, both ends (the rank's and the kernel's): base only.
        "debug": set(),
        "bootstrap": {"sharing", "debug"},
        "outcome": set(),
        "xla": {"bootstrap", "control", "sharing"},
        "local": {
            "bootstrap",
            "xla",
            "control",
            "planned",
            "run",
            "run_folder",
            "sharing",
            "starter",
        },
        "remote": {
            "sharing",
            "bootstrap",
            "checks",
            "control",
            "planned",
            "remote_shell",
            "run",
            "run_folder",
            "starter",
        },
        "detached": {"local", "control", "planned", "run", "run_folder"},
        # Interactive workers: one long launch (api) serving commands; the worker side
        # reports errors as bootstrap does, the kernel side builds them as outcome does;
        # each command's output ends with output's mark; what they refuse is checks'.
        "interactive": {
            "api",
            "bootstrap",
            "checks",
            "control",
            "debug",
            "outcome",
            "output",
            "planned",
            "printer",
            "pump",
            "run",
            "sharing",
        },
    },
    "nbaccel.accel": {
        "nested": set(),
        "checkpoints": {"nested"},
        "tracking": {"nested", "state"},
        "strategies": {"nested", "checkpoints", "tracking", "state", "precision", "optim"},
        "data": {"nested", "tracking", "strategies", "state", "optim"},
    },
    "nbaccel.config": {
        "accelerate": {"schema", "sections"},
        "deepspeed": {"schema", "sections"},
    },
    "nbaccel.ui": {"dashboard": set(), "panel": set()},
}
MOST_MODULES_AT_A_TOP = 14


def room(package: str, name: str) -> str | None:
    """The room of ``package`` that module ``name`` is in: its sub-package or its module."""
    if not name.startswith(package + "."):
        return None
    return name[len(package) + 1 :].split(".")[0]


def room_arrows(package: str) -> dict[str, set[str]]:
    arrows: dict[str, set[str]] = {}
    for name, tree in modules().items():
        source = room(package, name)
        if source is None:
            continue
        for target in own_imports(tree):
            into = room(package, owning_module(target))
            if into is not None and into != source:
                arrows.setdefault(source, set()).add(into)
    return arrows


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_each_room_imports_only_the_rooms_it_may(package: str) -> None:
    arrows = room_arrows(package)
    wrong = sorted(
        f"{package}.{sub} imports {package}.{target}"
        for sub, allowed in ROOMS[package].items()
        for target in arrows.get(sub, set()) - allowed
    )
    assert not wrong, wrong


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_the_rooms_of_a_package_form_no_circle(package: str) -> None:
    arrows = room_arrows(package)

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in arrows.get(todo.pop(), set()) - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    circles = sorted(r for r in arrows if r in reach(r))
    assert not circles, f"rooms of {package} in a circle: {circles}"


def test_the_package_top_stays_small() -> None:
    # The public faces (launching, interactive, logging...) and the lowest shared modules
    # sit side by side at nbaccel's top: grouped by concern once they pass the limit.
    count = len([p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"])
    assert count <= MOST_MODULES_AT_A_TOP, f"{PACKAGE} holds {count} modules at its top"


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_every_room_is_a_real_sub_package_and_tops_stay_small(package: str) -> None:
    folder = PACKAGE.parent.joinpath(*package.split("."))
    for sub in ROOMS[package]:
        assert (folder / sub / "__init__.py").is_file(), f"{package}.{sub} is gone"
        assert ast.get_docstring(modules()[f"{package}.{sub}"]), f"{package}.{sub}: no docstring"
    for each in [folder, *(p for p in folder.iterdir() if (p / "__init__.py").is_file())]:
        count = len([p for p in each.glob("*.py") if p.name != "__init__.py"])
        assert count <= MOST_MODULES_AT_A_TOP, f"{each} holds {count} modules at its top"


def test_the_room_check_catches_a_wrong_arrow() -> None:
    # bootstrap (what every worker runs first) reaching up into the helper must be caught.
    tree = ast.parse("from nbaccel.launcher.local.helper import shared_helper\n")
    targets = {room("nbaccel.launcher", owning_module(t)) for t in own_imports(tree)}
    assert targets - ROOMS["nbaccel.launcher"]["bootstrap"] == {"local"}


@pytest.mark.parametrize(
    "room", sorted(f"{package}.{sub}" for package, subs in ROOMS.items() for sub in subs)
)
def test_the_modules_inside_a_room_form_no_circle(room: str) -> None:
    # A lazy import counts: a module reaching back to the one that imports it is a circle.
    inside = {name for name in modules() if name.startswith(room + ".")}
    arrows = {
        name: {owning_module(t) for t in own_imports(modules()[name])} & inside - {name}
        for name in inside
    }

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in arrows.get(todo.pop(), set()) - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    circles = sorted(name for name in inside if name in reach(name))
    assert not circles, f"modules of {room} in a circle: {circles}"
