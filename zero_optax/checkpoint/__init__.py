"""Checkpoints of zero1 states: written, read, checked, and re-cut for another mesh. The top layer.

Written:
* `_handler`: the Orbax `ZeroCheckpointHandler` and its `ZeroSave` / `ZeroRestore` arguments.
* `_save`: what a save writes: the state's arrays and its record.
* `_record`: the versioned JSON record beside the arrays, built, written and read.
* `_arrays`: which arrays a state stores (names, shapes, dtypes, shardings), and a state rebuilt from them.
* `_tree`: the zero1 states inside a saved pytree: found, named, put back.

Read and checked:
* `_restore`: restoring into a target, everything checked before any array is read.
* `_schema`: the record checked field by field into `StoredLayout`s.
* `_match`: whether a saved state fits a target, and the first difference if not.
* `_shapes`: a copy of the record's shapes kept in the arrays' own metadata, checked against the record.
* `_store`: stored arrays read and written with TensorStore.
* `_paths`: checkpoint locations (local or `gs://`) as paths and TensorStore kvstores.
* `_commit`: Orbax's commit file on object stores, written last and required by every reader.
* `_install`: a finished directory put in place atomically (local file systems).

Re-cut for another mesh:
* `_regions`: any region of a state's arrays on a new mesh, from the arrays saved on the old one.
* `_tp_blocks`: a sliced leaf's tensor-parallel or expert blocks on one mesh, cut again for another.
* `_offline`: `zo.reshard`, converting an item directory offline to a mesh given by its axis sizes.
* `_rank_migration`: rank-local records, their explicit migration and the state they build (`load_rank_records`,
  `reshard_explicit`, `state_from_rank_records`).
"""
