"""Reading a DCP checkpoint without running code from it.

torch's ``FileSystemReader.read_metadata`` loads ``.metadata`` with plain ``pickle.load``,
and DCP's ``DefaultLoadPlanner.load_bytes`` loads every non-tensor entry (optimizer
hyperparameters, parameter names) with ``torch.load(weights_only=False)``: a tampered
checkpoint would run its code on every rank. ``SafeReader`` unpickles the metadata with an
allowlist of the classes DCP metadata is made of and checks that every data file it names
lies inside the folder; ``SafePlanner`` loads the non-tensor entries with
``weights_only=True``. Tensors DCP already reads with ``weights_only=True``.

Pass both to ``dcp.load`` (``storage_reader=``, ``planner=``), so DCP never unpickles on its
own. The reader keeps the metadata it checked: DCP's own read then returns the same object
instead of reading a file that may have changed since.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from nbaccel.accel.checkpoints.checkpoint_files import inside

__all__ = ["SafePlanner", "SafeReader", "check_entries"]

# Every global a DCP ``.metadata`` pickle refers to, as recorded by ``find_class`` while
# loading the metadata of FSDP2 (1 and 2 ranks, AdamW) and plain-module saves under torch
# 2.13. Dtypes (``torch.float32``) are admitted separately; layouts come through
# ``torch.serialization._get_layout``, a lookup by name; a ``PosixPath`` (``pathlib._local``
# on Python 3.13) is ``StorageMeta.checkpoint_id`` when the save was given a Path.
_METADATA_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals DCP metadata holds.

    A pickle runs code only through the globals it names (``os.system``, ``builtins.exec``
    called by ``REDUCE``); refusing every other name in ``find_class`` refuses all of them
    before anything is called.
    """

    def __init__(self, stream: Any, path: Path) -> None:
        super().__init__(stream)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ValueError(
            f"load_state: the sharded checkpoint's metadata ({self._path}) refers to "
            f"{module}.{name}, which DCP metadata never holds. Unpickling it would run code "
            "from the file, so it was refused and nothing was loaded. The file was damaged or "
            "tampered with: load only checkpoints you trust, or save the state again."
        )


class SafeReader(FileSystemReader):
    """DCP's file system reader, unpickling ``.metadata`` through an allowlist."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._checked: dict[int | None, Metadata] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._checked = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # ``rank``: DCP falls back to a rank's own ``__<rank>.metadata`` (saves without
        # collectives) when the global file cannot be read; that one is read safely too.
        rank: int | None = kwargs.get("rank")
        if rank not in self._checked:
            self._checked[rank] = self._read(rank)
        metadata = self._checked[rank]
        assert metadata.storage_meta is not None  # set by _read
        metadata.storage_meta.load_id = self.load_id  # as DCP's reader: this load's id
        return metadata

    def _read(self, rank: int | None) -> Metadata:
        folder = Path(self.path)
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = inside(folder, name, what=f"the sharded checkpoint {folder}")
        with open(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream, path).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as error:
                raise ValueError(
                    f"load_state: {path} is not readable DCP metadata ({error}): the file is "
                    "truncated or damaged. Restore the checkpoint from its original copy or "
                    "save the state again."
                ) from error
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise ValueError(
                f"load_state: {path} holds a {type(metadata).__name__}, not DCP metadata with "
                "its list of data files. Restore the checkpoint from its original copy or "
                "save the state again."
            )
        # Every data file must lie in this folder (DCP joins the folder and the stored name,
        # so an absolute name or '..' would read anywhere).
        names = {getattr(info, "relative_path", None) for info in metadata.storage_data.values()}
        for relative in names:
            where = f"the sharded checkpoint's metadata ({path})"
            inside(folder, relative if isinstance(relative, str) else "", what=where)
        if metadata.storage_meta is None:  # as DCP's own reader: older saves have none
            metadata.storage_meta = StorageMeta()
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor entries load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = _load_entry(fqn, value)
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        # The entry's place in the nested state dict: DCP planned the read from that dict,
        # so every container on the way exists.
        *parents, last = self.mappings[fqn]
        container: Any = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = loaded


class _EntryChecker(SafePlanner):
    """Loads each non-tensor entry (with ``weights_only``) and keeps nothing."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_entry(read_item.dest_index.fqn, value)


def check_entries(reader: SafeReader, metadata: Metadata) -> None:
    """Load every non-tensor entry once before ``dcp.load`` runs. DCP fills the live
    parameters as it reads, so a tampered entry found midway would leave them half loaded:
    found here, it is refused while nothing has changed. The entries are small (optimizer
    hyperparameters, names)."""
    entries = [
        fqn
        for fqn, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, BytesStorageMetadata)
    ]
    if not entries:
        return
    none = torch.Size((0,))
    items = [
        ReadItem(
            type=LoadItemType.BYTE_IO,
            dest_index=MetadataIndex(fqn),
            dest_offsets=none,
            storage_index=MetadataIndex(fqn),
            storage_offsets=none,
            lengths=none,
        )
        for fqn in entries
    ]
    reader.set_up_storage_reader(metadata, is_coordinator=False)
    reader.read_data(LoadPlan(items), _EntryChecker()).wait()


def _load_entry(fqn: str, value: io.BytesIO) -> Any:
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message is a page of advice; its "Unsupported global" line says what.
        lines = str(error).splitlines()
        what = next((line for line in lines if "global" in line), lines[0] if lines else "")
        what = what.split(". Please")[0].strip()
        raise ValueError(
            f"load_state: the sharded checkpoint's entry {fqn!r} holds something "
            f"weights_only loading refuses ({what}). Loading it fully could run code from "
            "the file, so it was refused and nothing was loaded. Load only checkpoints you "
            "trust, or save the state again."
        ) from error
