"""Checkpoint hardening, in this process (world size 1): loading runs no code from the files,
every name a checkpoint holds stays inside its folder, and save_state fsyncs everything before
LATEST moves.

``strategy="fsdp"`` with one process trains unsharded but keeps FSDP's sharded layout, so its
checkpoints go through torch.distributed.checkpoint (DCP) without a process group: the real
``.metadata`` and ``.distcp`` files, tampered with below.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

import nbaccel
from nbaccel import Accelerator
from nbaccel.accel.checkpoints.checkpoint import find_checkpoint

Run = tuple[Accelerator, torch.nn.Module, Any]


def run(strategy: str = "no") -> Run:
    if strategy == "fsdp":
        with pytest.warns(UserWarning, match="nothing to shard"):
            acc = Accelerator(config=nbaccel.Config(strategy="fsdp"))
    else:
        acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, _ = acc.prepare(model, optimizer, scheduler)
    return acc, model, optimizer


def train(r: Run, steps: int, scale: float = 1.0) -> list[float]:
    acc, model, optimizer = r
    losses = []
    for i in range(steps):
        x = torch.linspace(-1.0, 1.0, 12).reshape(4, 3) * (i + 1) * scale
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = weights(model)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"{name} was changed by a refused load"


def saved_then_moved_on(tmp_path: Path, strategy: str) -> tuple[Run, Path, dict[str, Any]]:
    """A run that saved a checkpoint and then trained on, and its weights after that."""
    r = run(strategy)
    train(r, 2)
    checkpoint = tmp_path / "ckpt"
    r[0].save_state(checkpoint)
    train(r, 1, scale=3.0)
    return r, checkpoint, weights(r[1])


def rewrite_metadata(sharded: Path, change: Callable[[Metadata], None]) -> None:
    # Only the test reads its own file with plain pickle, as an attacker would write it.
    metadata = pickle.loads((sharded / ".metadata").read_bytes())
    change(metadata)
    (sharded / ".metadata").write_bytes(pickle.dumps(metadata))


class RunsCode:
    """Unpickling this calls ``function(argument)``: what a tampered pickle does."""

    def __init__(self, function: Callable[[str], Any], argument: str) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return self.function, (self.argument,)


def code_creating(marker: Path, how: str) -> RunsCode:
    if how == "os.system":
        return RunsCode(os.system, f"touch {marker}")
    return RunsCode(exec, f"open({str(marker)!r}, 'w').close()")


# -- no code runs from a checkpoint ------------------------------------------------------------
@pytest.mark.parametrize("how", ["os.system", "exec"])
def test_tampered_dcp_metadata_is_refused_before_its_code_runs(tmp_path: Path, how: str) -> None:
    r, checkpoint, before = saved_then_moved_on(tmp_path, "fsdp")
    marker = tmp_path / "code-ran"
    sharded = find_checkpoint(checkpoint) / "sharded"

    def add_code(metadata: Metadata) -> None:  # in a field loading does not otherwise use
        assert metadata.storage_meta is not None
        metadata.storage_meta.modules.append(code_creating(marker, how))  # type: ignore[arg-type]

    rewrite_metadata(sharded, add_code)
    name = r"posix\.system" if how == "os.system" else r"builtins\.exec"
    refused = rf"refers to {name}, which DCP metadata never holds.*would run code.*trust"
    with pytest.raises(ValueError, match=refused):
        r[0].load_state(checkpoint)
    assert not marker.exists(), "unpickling the metadata ran the code in it"
    assert_unchanged(r[1], before)


def test_a_tampered_non_tensor_entry_is_loaded_with_weights_only(tmp_path: Path) -> None:
    # DCP stores optimizer hyperparameters as torch.save'd bytes and its default planner loads
    # them with weights_only=False.
    r, checkpoint, _ = saved_then_moved_on(tmp_path, "fsdp")
    marker = tmp_path / "code-ran"
    sharded = find_checkpoint(checkpoint) / "sharded"
    payload = io.BytesIO()
    torch.save(code_creating(marker, "exec"), payload)
    (sharded / "extra.distcp").write_bytes(payload.getvalue())

    def point_lr_at_the_payload(metadata: Metadata) -> None:
        index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
        assert isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
        metadata.storage_data[index] = dataclasses.replace(
            metadata.storage_data[index],
            relative_path="extra.distcp",
            offset=0,
            length=len(payload.getvalue()),
        )

    rewrite_metadata(sharded, point_lr_at_the_payload)
    before = {k: v.detach().clone() for k, v in r[1].state_dict().items()}
    with pytest.raises(ValueError, match=r"'optimizer_0\.param_groups\.0\.lr'.*weights_only"):
        r[0].load_state(checkpoint)
    assert not marker.exists(), "loading the entry ran the code in it"
    assert_unchanged(r[1], before)  # refused before DCP wrote any tensor into the model


def test_a_genuine_sharded_checkpoint_loads_safely_and_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saving = run("fsdp")
    train(saving, 2)
    checkpoint = tmp_path / "ckpt"
    saving[0].save_state(checkpoint)
    expected_losses = train(saving, 2)
    expected = weights(saving[1])

    resumed = run("fsdp")
    train(resumed, 1, scale=3.0)  # different weights and momentum: a load that did nothing shows
    unsafe: list[Any] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("weights_only", True):
            unsafe.append(args)
        return real_load(*args, **kwargs)

    def plain_unpickling(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the checkpoint was unpickled with plain pickle.load")

    monkeypatch.setattr(torch, "load", spy)
    monkeypatch.setattr(pickle, "load", plain_unpickling)  # what DCP's own reader calls
    resumed[0].load_state(checkpoint)
    monkeypatch.undo()
    assert unsafe == [], "DCP loaded entries with weights_only=False"
    assert train(resumed, 2) == expected_losses
    assert_unchanged(resumed[1], expected)  # i.e. identical to the saving run's weights


# -- names stay inside the checkpoint folder -----------------------------------------------------
@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("parent", r"climbs out of the folder with '\.\.'"),
        ("absolute", r"is an absolute path"),
        ("symlink", r"leads out of the folder through a symlink"),
    ],
)
def test_a_data_file_outside_the_sharded_folder_is_refused(
    tmp_path: Path, where: str, error: str
) -> None:
    r, checkpoint, before = saved_then_moved_on(tmp_path, "fsdp")
    sharded = find_checkpoint(checkpoint) / "sharded"
    data = sharded / "__0_0.distcp"
    outside = tmp_path / "outside.distcp"
    shutil.copy(data, outside)  # a genuine file: only its place is wrong
    if where == "symlink":
        data.unlink()
        data.symlink_to(outside)
    else:
        name = "../../../outside.distcp" if where == "parent" else str(outside)
        assert where == "absolute" or (sharded / name).resolve() == outside

        def move(metadata: Metadata) -> None:
            for index, info in metadata.storage_data.items():
                metadata.storage_data[index] = dataclasses.replace(info, relative_path=name)

        rewrite_metadata(sharded, move)
    with pytest.raises(ValueError, match=rf"sharded checkpoint's metadata.*{error}.*nothing"):
        r[0].load_state(checkpoint)
    assert_unchanged(r[1], before)


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("../elsewhere", r"names '\.\./elsewhere', which climbs out of the folder"),
        ("absolute", r"which is an absolute path"),
        ("state-link", r"'state-link', which leads out of the folder through a symlink"),
        ("sub/state-x", r"must name a state-\* folder directly inside"),
        ("elsewhere", r"must name a state-\* folder directly inside"),
    ],
)
def test_latest_must_name_a_state_folder_directly_inside_the_checkpoint(
    tmp_path: Path, case: str, error: str
) -> None:
    r, checkpoint, before = saved_then_moved_on(tmp_path, "no")
    state = find_checkpoint(checkpoint)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(state, elsewhere)  # a whole, loadable state: only its place is wrong
    name = str(elsewhere) if case == "absolute" else case
    if case == "state-link":
        (checkpoint / case).symlink_to(elsewhere, target_is_directory=True)
    elif case != "../elsewhere" and case != "absolute":
        shutil.copytree(state, checkpoint / case)
    (checkpoint / "LATEST").write_text(name + "\n")
    with pytest.raises(ValueError, match=rf"LATEST.*{error}"):
        r[0].load_state(checkpoint)
    assert_unchanged(r[1], before)


# -- durability ------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["no", "fsdp"])
def test_save_state_fsyncs_every_file_and_folder_before_latest_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    r = run(strategy)
    train(r, 1)
    checkpoint = tmp_path / "ckpt"
    events: list[tuple[str, Any]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)  # files are named by inode: a rename keeps it
        events.append(("fsync", (st.st_dev, st.st_ino)))
        real_fsync(fd)

    def rename(src: Any, dst: Any, **kwargs: Any) -> None:
        events.append(("rename", Path(dst).name))
        real_rename(src, dst, **kwargs)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        events.append(("replace", Path(dst).name))
        real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    old_umask = os.umask(0o027)
    try:
        final = r[0].save_state(checkpoint)
    finally:
        os.umask(old_umask)
        monkeypatch.undo()

    def inode(path: Path) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_dev, st.st_ino

    commit = events.index(("replace", "LATEST"))
    synced = {key for kind, key in events[:commit] if kind == "fsync"}
    everything = [final, *final.rglob("*")]
    assert any(p.name == ".metadata" for p in everything) == (strategy == "fsdp")
    not_synced = [str(p.relative_to(checkpoint)) for p in everything if inode(p) not in synced]
    assert not_synced == [], "not fsynced before LATEST was replaced"
    # The state folder's new name is durable before LATEST can name it, LATEST's content is
    # on the disk before it replaces the old pointer, and the replacement itself is synced.
    renamed = events.index(("rename", final.name))
    assert renamed < commit
    assert ("fsync", inode(checkpoint)) in events[renamed:commit]
    assert ("fsync", inode(checkpoint / "LATEST")) in events[renamed:commit]
    assert ("fsync", inode(checkpoint)) in events[commit + 1 :]
    # Checkpoints keep the user's umask: nothing chmods them.
    for path in everything:
        expected = 0o750 if path.is_dir() else 0o640
        assert path.stat().st_mode & 0o777 == expected, path
