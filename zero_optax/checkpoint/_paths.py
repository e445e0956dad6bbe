"""Checkpoint locations: the paths Orbax accepts, as `etils.epath` paths and as TensorStore kvstores.

Local paths (TensorStore's `file` driver) and `gs://bucket/...` (the `gcs` driver), exactly what Orbax stores arrays
at. Files are reached through `epath` or TensorStore, never `os`/`open`, so every location works alike.

Examples:
  >>> from zero_optax.checkpoint import _paths
  >>> _paths.kvstore(_paths.as_path("/tmp/ckpt/1/opt_state"))
  {'driver': 'file', 'path': '/tmp/ckpt/1/opt_state/'}
  >>> _paths.kvstore(_paths.as_path("gs://bucket/run/1/opt_state"))
  {'driver': 'gcs', 'bucket': 'bucket', 'path': 'run/1/opt_state/'}
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

from etils import epath

from zero_optax.core._errors import ZeroCheckpointError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]$")


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
