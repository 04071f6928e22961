"""Where a checkpoint root lives: a local folder or an fsspec URL, behind one small interface.

Two kinds of place:

* a plain path (``/content/drive/MyDrive/ckpt``, ``runs/ckpt``) and a ``file://`` URL are
  served by :class:`LocalStore`: pathlib and shutil, each file written to a temporary name
  in its folder, fsynced and renamed into place, so that a reader (or a machine lost half way)
  never sees a file cut short. fsspec is not needed for them.
* any other URL (``gs://``, ``s3://``, ``hf://``, ``memory://``, a chain such as
  ``simplecache::gs://``) is served by :class:`FsspecStore` through fsspec, imported only here
  and only when such a place is used.

Paths inside a place (``rel``) are always ``/``-separated and relative to the root.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

# A scheme of two letters or more, maybe chained with '::': one letter is a Windows drive.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+(::[A-Za-z][A-Za-z0-9+.\-]+)*://")

# The package that brings each common protocol's filesystem, for the ImportError's fix.
_PACKAGES = {
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "s3": "s3fs",
    "s3a": "s3fs",
    "hf": "huggingface_hub",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "sftp": "paramiko",
    "ssh": "paramiko",
}

# Object stores (and fsspec's in-memory filesystem) replace an object whole on each write,
# so LATEST is written directly there; elsewhere (sftp, smb, ...) a write is not atomic, so
# LATEST goes to a temporary name first and is then moved over the old one.
_WHOLE_OBJECT_WRITES = {"gs", "gcs", "s3", "s3a", "hf", "az", "abfs", "abfss", "memory"}


def is_url(place: str) -> bool:
    """Whether ``place`` is a URL (``scheme://...``) rather than a local path.

    ``file://`` counts as a URL (it needs a manifest, as every URL does); a one-letter
    scheme is a Windows drive, not a URL.

    >>> is_url("gs://bucket/ckpt"), is_url("memory://ckpt"), is_url("file:///tmp/ckpt")
    (True, True, True)
    >>> is_url("/content/drive/MyDrive/ckpt"), is_url("runs/ckpt"), is_url("C://ckpt")
    (False, False, False)
    """
    return _URL.match(place) is not None


def is_local_file_url(place: str) -> bool:
    """A ``file://`` URL (not a chain): served from the disk like a plain path."""
    return place.startswith("file://")


def local_path(place: str) -> Path:
    """The local folder a plain path or a ``file://`` URL names."""
    if is_local_file_url(place):
        return Path(unquote(urlparse(place).path))
    return Path(place).expanduser()


def _protocol(url: str) -> str:
    # 'simplecache::gs://b' stores on gs: the last link of the chain is the one to install.
    return url.split("://", 1)[0].split("::")[-1]


def _fix(url: str) -> str:
    protocol = _protocol(url)
    if protocol in _PACKAGES:
        return f"pip install fsspec {_PACKAGES[protocol]}"
    return f"pip install fsspec (and the package fsspec names for {protocol}://)"


def _fsspec(place: str) -> Any:
    try:
        import fsspec  # type: ignore[import-untyped]
    except ImportError as error:
        raise ImportError(
            f"{place}: durable checkpoints on a URL need fsspec: {_fix(place)}"
        ) from error
    return fsspec


def check_place(place: str) -> None:
    """Raises the ImportError (with its ``pip install``) now when the filesystem of ``place``
    is not installed, without connecting to it."""
    if not place:
        raise ValueError("a checkpoint place is a folder or a URL, not an empty string")
    if not is_url(place) or is_local_file_url(place):
        return
    fsspec = _fsspec(place)
    for protocol in place.split("://", 1)[0].split("::"):
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as error:
            raise ImportError(
                f"{place}: fsspec's {protocol}:// filesystem is not installed: {_fix(place)}"
                f" ({error})"
            ) from error


class Store(Protocol):
    """The few operations the durable copies need of a place."""

    def read_bytes(self, rel: str) -> bytes:
        """The file's bytes; FileNotFoundError when it is missing."""
        ...

    def sizes(self, rel: str) -> dict[str, int]:
        """Every file under folder ``rel`` ('' for the root), by path relative to it, with
        its size; empty when the folder is missing."""
        ...

    def put_file(self, local: Path, rel: str) -> None:
        """Uploads one local file (the folders it needs are made)."""
        ...

    def get_file(self, rel: str, local: Path) -> None:
        """Downloads one file to a local path whose folder exists."""
        ...

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Writes a small file so that a reader sees the old or the new bytes, never a mix."""
        ...

    def remove(self, rel: str) -> None:
        """Removes a folder and everything under it; nothing when it is missing."""
        ...


def open_place(place: str) -> Store:
    """The store of a local folder (a plain path or ``file://``) or of an fsspec URL."""
    check_place(place)
    if not is_url(place) or is_local_file_url(place):
        return LocalStore(local_path(place))
    try:
        fs, root = _fsspec(place).core.url_to_fs(place)
    except ImportError as error:
        raise ImportError(f"{place}: {_fix(place)} ({error})") from error
    return FsspecStore(fs, root)


def _temporary_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")


def _fsync_folder(folder: Path) -> None:
    # Makes the rename itself durable; some filesystems (and Windows) refuse to open a
    # folder, which only loses that extra guarantee.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class LocalStore:
    """A folder on this machine (or on a mounted drive): atomic, fsynced writes."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def read_bytes(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def sizes(self, rel: str) -> dict[str, int]:
        base = self.root / rel if rel else self.root
        found: dict[str, int] = {}
        for folder, _, files in os.walk(base):
            for name in files:
                path = Path(folder, name)
                try:
                    found[path.relative_to(base).as_posix()] = path.stat().st_size
                except FileNotFoundError:
                    continue  # removed while we looked: it is not there
        return found

    def _replace(self, rel: str, write: Any) -> None:
        target = self.root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = _temporary_sibling(target)
        try:
            with open(temporary, "wb") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_folder(target.parent)

    def put_file(self, local: Path, rel: str) -> None:
        with open(local, "rb") as source:
            self._replace(rel, lambda out: shutil.copyfileobj(source, out, 1 << 20))

    def get_file(self, rel: str, local: Path) -> None:
        shutil.copyfile(self.root / rel, local)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._replace(rel, lambda out: out.write(data))

    def remove(self, rel: str) -> None:
        try:
            shutil.rmtree(self.root / rel)
        except FileNotFoundError:
            pass


class FsspecStore:
    """A root on any fsspec filesystem (``fs``) at path ``root`` (the URL without scheme)."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = str(root).rstrip("/")

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(rel)))

    def sizes(self, rel: str) -> dict[str, int]:
        base = self._path(rel)
        # Listings are cached by gcsfs, s3fs...: a verification must see the store as it is.
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        prefix = self.fs._strip_protocol(base).rstrip("/") + "/"
        sizes: dict[str, int] = {}
        for path, info in found.items():
            path = self.fs._strip_protocol(path)
            if info.get("type", "file") != "directory" and path.startswith(prefix):
                sizes[path[len(prefix) :]] = int(info["size"])
        return sizes

    def put_file(self, local: Path, rel: str) -> None:
        self.fs.put_file(str(local), self._path(rel))

    def get_file(self, rel: str, local: Path) -> None:
        self.fs.get_file(self._path(rel), str(local))

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        protocols = self.fs.protocol
        protocols = {protocols} if isinstance(protocols, str) else set(protocols)
        if protocols & _WHOLE_OBJECT_WRITES:
            self.fs.pipe_file(path, data)
            return
        temporary = f"{path}.tmp-{secrets.token_hex(4)}"
        try:
            self.fs.pipe_file(temporary, data)
            self.fs.mv(temporary, path)
        except Exception:
            try:
                self.fs.rm(temporary)
            except Exception:  # noqa: BLE001 - the write's own error is the one to tell
                pass
            raise

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm(self._path(rel), recursive=True)
        except FileNotFoundError:
            pass
