"""Finished checkpoints on object stores: Orbax's commit file, written last and required by every reader.

Object stores (`gs://`) cannot rename, so Orbax writes there in place and marks a finished item directory with
`commit_success.txt`, which its readers require; so does zero_optax. The name is Orbax's private constant (the
tests check that the two agree).
"""

from __future__ import annotations

from typing import Any

from etils import epath

from zero_optax.checkpoint import _paths
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError

COMMIT_FILE = "commit_success.txt"


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
