"""Finishing checkpoints so that no reader takes a half-written one.

Object stores (`gs://`) cannot rename, so Orbax writes there in place and marks a finished item directory with
`commit_success.txt` (Orbax's private constant; the tests check that the two agree), which every reader requires.
Locally a finished directory, written as a hidden sibling and flushed, is renamed into place, an existing one swapped
in one step (`renameat2(RENAME_EXCHANGE)`) where Linux offers it; `epath` has no atomic replacement, so this is the
only module that calls `os` on checkpoint paths.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
from typing import Any

from etils import epath

from zero_optax.checkpoint import _paths
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError

COMMIT_FILE = "commit_success.txt"
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


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
    if _paths.is_local(path):
        return
    with _paths.reading(path):
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
        target = path / name
        if target.exists():
            target.unlink()
    if path.exists():
        path.rmtree()


def overlap(a: Any, b: Any) -> bool:
    """Whether two directories are the same or one lies inside the other."""
    x, y = str(a).rstrip("/") + "/", str(b).rstrip("/") + "/"
    return x.startswith(y) or y.startswith(x)
