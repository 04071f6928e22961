"""Which modules the helper may preload: installed libraries only, never the user's code."""

from __future__ import annotations

from pathlib import Path

from nbaccel.launcher.local.preloading.preload_choice import (
    PreloadChoice,
    editable_packages,
    site_roots,
)

ROOT = "/venv/lib/python3.11/site-packages"


def choice(**kwargs: object) -> PreloadChoice:
    return PreloadChoice(roots=(ROOT,), editable=frozenset({"mypkg"}), **kwargs)  # type: ignore[arg-type]


def test_installed_libraries_qualify_and_their_submodules_too() -> None:
    c = choice()
    assert c.qualifies("transformers", f"{ROOT}/transformers/__init__.py")
    assert c.qualifies("transformers.models.bert", f"{ROOT}/transformers/models/bert/x.py")


def test_the_notebooks_folder_other_path_entries_and_builtins_never_qualify(tmp_path: Path) -> None:
    c = choice()
    assert not c.qualifies("mymodel", str(tmp_path / "mymodel.py"))  # beside the notebook
    assert not c.qualifies("lib", "/home/me/src/lib/__init__.py")  # a sys.path entry
    assert not c.qualifies("sys", None)  # built in: nothing to import
    # A folder whose name merely starts like a root is not inside it.
    assert not c.qualifies("x", f"{ROOT}-old/x.py")


def test_editable_installs_never_qualify_even_inside_site_packages() -> None:
    assert not choice().qualifies("mypkg.core", f"{ROOT}/mypkg/core.py")


def test_kernel_machinery_test_runners_and_nbaccel_never_qualify() -> None:
    c = choice()
    names = ("ipykernel.kernelapp", "zmq", "IPython", "pytest", "nbaccel.launcher", "debugpy")
    plugins = ("pytest_timeout", "anyio.pytest_plugin", "pydantic_pytest_plugin")
    for name in names + plugins:
        assert not c.qualifies(name, f"{ROOT}/{name.replace('.', '/')}.py"), name


def test_a_refused_library_and_its_submodules_are_never_chosen_again() -> None:
    c = choice()
    modules = [("thready", f"{ROOT}/thready/__init__.py"), ("thready.sub", f"{ROOT}/thready/s.py")]
    assert c.choose_files(modules) == ["thready", "thready.sub"]
    c.refuse("thready")
    assert c.choose_files(modules) == []
    assert choice(refused=["thready"]).choose_files(modules) == []


def test_choose_reads_module_objects_and_puts_parents_first() -> None:
    class Module:
        def __init__(self, file: str | None) -> None:
            self.__file__ = file

    modules = {
        "b.sub": Module(f"{ROOT}/b/sub.py"),
        "b": Module(f"{ROOT}/b/__init__.py"),
        "local": Module("/tmp/local.py"),
        "nofile": Module(None),
    }
    assert choice().choose(modules) == ["b", "b.sub"]  # type: ignore[arg-type]


def test_this_interpreters_roots_hold_its_installed_packages() -> None:
    import psutil  # installed with nbaccel

    c = PreloadChoice()
    assert c.qualifies("psutil", psutil.__file__)
    assert not c.qualifies("test_preload_choice", __file__)
    assert all(Path(root).is_absolute() for root in site_roots())


def test_editable_packages_reads_pep_660_records() -> None:
    # The test venv installs this checkout in editable mode (make's --editable .).
    assert "nbaccel" in editable_packages()
