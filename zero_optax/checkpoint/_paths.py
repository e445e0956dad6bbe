"""Checkpoint locations, and how a checkpoint appears at one whole, so that no reader takes a half-written one.

Local paths (TensorStore's `file` driver) and `gs://bucket/...` (the `gcs` driver), exactly what Orbax stores arrays
at. Files are reached through `epath` or TensorStore, never `os`/`open`, so every location works alike; except that
a local checkpoint, written as a hidden sibling and flushed, is renamed into place, an existing one swapped in one
step (`renameat2(RENAME_EXCHANGE)`) where Linux offers it (`epath` has no atomic replacement). Object stores cannot
rename, so Orbax writes there in place and marks a finished item directory with `commit_success.txt` (Orbax's
private constant; the tests check that the two agree), which every reader requires.

Examples:
  >>> from zero_optax.checkpoint import _paths
  >>> _paths.kvstore(_paths.as_path("/tmp/ckpt/1/opt_state"))
  {'driver': 'file', 'path': '/tmp/ckpt/1/opt_state/'}
  >>> _paths.kvstore(_paths.as_path("gs://bucket/run/1/opt_state"))
  {'driver': 'gcs', 'bucket': 'bucket', 'path': 'run/1/opt_state/'}
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

from etils import epath

from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError

COMMIT_FILE = "commit_success.txt"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]$")
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def as_path(directory: Any) -> epath.Path:
    """`directory` (a str, `os.PathLike` or `epath.Path`) as an absolute `epath.Path`; refuses other schemes."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ZeroCheckpointError(f"A checkpoint path must be a str or a path, got {type(directory).__name__}.")
    text = os.fspath(directory)
    scheme = _SCHEME.match(text)
    if scheme is not None:
        if scheme.group(1) != "gs":
            raise ZeroCheckpointError(
                f"`{text}`: the scheme `{scheme.group(1)}://` is not supported. zero_optax checkpoints live where "
                "Orbax stores arrays: on a local file system (a path such as /data/ckpt) or at gs://bucket/path.")
        bucket = text[len("gs://"):].split("/", 1)[0]
        if not _BUCKET.match(bucket):
            raise ZeroCheckpointError(f"`{text}` does not name a valid Google Cloud Storage bucket.")
        return epath.Path(text)
    return epath.Path(os.path.abspath(text))


def is_local(path: epath.Path) -> bool:
    return not str(path).startswith("gs://")


@contextlib.contextmanager
def reading(path: Any) -> Iterator[None]:
    """Turns an `OSError` raised while reading `path` into a `ZeroCheckpointError` naming it."""
    try:
        yield
    except OSError as e:
        raise ZeroCheckpointError(f"cannot read {path}: {e}") from None


def check_writable(path: epath.Path) -> None:
    """Refuses a local path that is a file or lies under one (`gs://` paths: syntax only, checked by `as_path`)."""
    if not is_local(path):
        return
    if path.exists() and not path.is_dir():
        raise ZeroCheckpointError(f"Cannot save a checkpoint at {path}: it is a file, not a directory.")
    parent = next((p for p in path.parents if p.exists()), path.parent)
    if not parent.is_dir():
        raise ZeroCheckpointError(f"Cannot save a checkpoint at {path}: {parent} is a file, not a directory.")


def kvstore(path: epath.Path) -> dict[str, Any]:
    """The TensorStore kvstore spec of the directory `path` (a key prefix ending in `/`)."""
    text = str(path)
    if not is_local(path):
        bucket, _, rest = text[len("gs://"):].partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": rest.rstrip("/") + "/" if rest else ""}
    return {"driver": "file", "path": text.rstrip("/") + "/"}


def renameat2(src: str, dst: str, flags: int) -> bool:
    """`renameat2(src, dst, flags)`; False where the system or the file system does not offer it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    if not hasattr(libc, "renameat2"):
        return False
    if libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), dst)


def fsync_path(path: str) -> None:
    """Flushes one file, or one directory's entries (creations, renames), to stable storage."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """Flushes every file and directory under `path`, and `path` itself, children first (links not followed)."""
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            file = os.path.join(root, name)
            if not os.path.islink(file):
                fsync_path(file)
        fsync_path(root)


def temporary_sibling(dst: str, what: str) -> str:
    """A fresh hidden directory next to `dst`, for writing what will replace it."""
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(dst)}.{what}-{os.getpid()}")
    remove(tmp)
    os.makedirs(tmp)
    return tmp


def remove(path: str) -> None:
    """Removes a directory tree, a file or a link, if there is one."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def already_exists(dst: Any) -> ZeroCheckpointError:
    """The error for an existing destination replaced without `force`."""
    return ZeroCheckpointError(f"{dst} already exists; pass force=True (--force) to replace it.")


def install(tmp: str, dst: str, force: bool) -> None:
    """Renames the finished directory `tmp` to `dst`; an existing `dst` is replaced only with `force`.

    Without `renameat2` the old destination is moved aside first: a crash between the two renames then leaves no
    destination, never a partial one.
    """
    fsync_tree(tmp)
    parent = os.path.dirname(dst)
    if not os.path.lexists(dst):
        if not renameat2(tmp, dst, _RENAME_NOREPLACE):
            os.rename(tmp, dst)
        fsync_path(parent)
        return
    if not force:
        raise already_exists(dst)
    if renameat2(tmp, dst, _RENAME_EXCHANGE):  # tmp now holds the old destination
        fsync_path(parent)
        remove(tmp)
        return
    aside = os.path.join(parent, f".{os.path.basename(dst)}.replaced-{os.getpid()}")
    os.rename(dst, aside)
    try:
        os.rename(tmp, dst)
    except OSError:
        os.rename(aside, dst)
        raise
    fsync_path(parent)
    remove(aside)


def check(path: epath.Path) -> None:
    """Refuses a `gs://` item directory without `commit_success.txt` (local ones are complete by their rename)."""
    if is_local(path):
        return
    with reading(path):
        committed = (path / COMMIT_FILE).exists()
    if not committed:
        raise ZeroCheckpointError(
            f"{path} is not a finished checkpoint: {COMMIT_FILE} is missing. On object stores Orbax (and "
            f"zero_optax.reshard) write it last, once everything else is in place, so this checkpoint is still "
            "being written or its writer was interrupted. Nothing was loaded; save or reshard it again (with "
            "force=True / --force to replace what is there).")


def mark(path: epath.Path) -> None:
    """Marks the item directory `path` finished, the way Orbax does (the file's text is Orbax's)."""
    (path / COMMIT_FILE).write_text(f"Checkpoint commit was successful to {path}")


def retract(path: epath.Path) -> None:
    """Deletes the checkpoint at `path`, its commit file and then its record first, so no reader takes it for one."""
    for name in (COMMIT_FILE, _names.RECORD_FILE):
        (path / name).unlink(missing_ok=True)
    path.rmtree(missing_ok=True)


def overlap(a: Any, b: Any) -> bool:
    """Whether two directories are the same or one lies inside the other."""
    x, y = str(a).rstrip("/") + "/", str(b).rstrip("/") + "/"
    return x.startswith(y) or y.startswith(x)
