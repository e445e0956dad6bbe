"""Finished checkpoints on object stores: Orbax's commit file, written last and required by every reader.

Object stores (`gs://`) have no atomic rename, so Orbax does not write a checkpoint into a temporary directory
there: it writes into the final location and, once everything else is in place, writes `commit_success.txt`
into it (`orbax.checkpoint._src.path.atomicity.CommitFileTemporaryPath`, chosen for `gs://` paths by
`atomicity_defaults`). Orbax's readers (`ocp.Checkpointer.restore`, `ocp.CheckpointManager`) treat a `gs://`
directory without that file as incomplete ("Found incomplete checkpoint"), and `ocp.CheckpointManager` does not
list such a step. Orbax writes the file into every item directory and into the step directory.

zero_optax keeps the same rule on both sides:

* `check`: `ZeroRestore`, `zo.reshard` and `zo.load_rank_records` refuse a `gs://` item directory without the
  commit file, as Orbax's readers do, so a checkpoint that is still being written, or whose writer was killed,
  is absent for every reader (local directories are complete by their atomic rename and are not checked);
* `mark`: the offline `zo.reshard` writes the commit file after the record, which it writes after every array,
  so an interrupted run leaves a directory that no reader takes for a checkpoint;
* `retract`: replacing an existing `gs://` destination (`force`) first deletes its commit file (after which no
  reader takes it for a checkpoint), then its record, then everything else, and only then writes the new one.

This module names the file itself rather than importing Orbax's private constant; the tests check that the two
agree.
"""

from __future__ import annotations

from typing import Any

from etils import epath

from zero_optax.checkpoint import _paths
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError

COMMIT_FILE = "commit_success.txt"
"""The file Orbax writes last into a finished checkpoint directory (its `COMMIT_SUCCESS_FILE`)."""


def needed(path: epath.Path) -> bool:
    """Whether a finished checkpoint at `path` carries the commit file: on object stores, where Orbax needs it."""
    return not _paths.is_local(path)


def check(path: epath.Path) -> None:
    """Refuses an item directory on an object store that was not marked finished.

    Raises:
      ZeroCheckpointError: `path` is a `gs://` directory without `commit_success.txt`.
    """
    if not needed(path):
        return
    try:
        committed = (path / COMMIT_FILE).exists()
    except OSError as e:
        raise ZeroCheckpointError(f"cannot read {path}: {e}") from None
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
    """Deletes the checkpoint at `path`, first making it unreadable for every reader: its commit file (Orbax's
    readers and ours), then its record (readers of local copies), then everything else."""
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
