"""Checkpoints of zero1 states: saving, restoring, and moving them between meshes. The top layer.

* `_handler`: the Orbax `ZeroCheckpointHandler` and its `ZeroSave` / `ZeroRestore` arguments.
* `_tree`: the zero1 states inside a saved pytree: found, named, put back.
* `_save`: what a save writes: the arrays and the record.
* `_restore`: restoring into a target, everything checked before any array is read.
* `_arrays`: which arrays a state stores: names, shapes, dtypes, shardings.
* `_record`: the versioned JSON record beside the arrays.
* `_schema`: the record checked field by field, into `SavedState`s, each described by a `StoredLayout`
  (`zero_optax.layout._layout`: what a checkpoint records of a layout, no run-time plan).
* `_match`: whether a saved state fits a target, and the first difference if not.
* `_remap`: any region of a state on a new mesh, from the arrays saved on the old one (and how far into an
  accumulation cycle a state was saved, `micro_step`).
* `_blocks`: a sliced leaf's tensor-parallel or expert blocks on one mesh, cut again for another.
* `_store`: stored arrays read and written with TensorStore.
* `_paths`: checkpoint locations (local or `gs://`) as paths and TensorStore kvstores.
* `_install`: putting a finished directory in place atomically (local file systems).
* `_commit`: finished checkpoints on object stores: Orbax's commit file, written last, required by every reader.
* `_shapes`: a copy of every leaf and entry shape kept with the arrays' own metadata, checked against the record.
* `_reshard`: offline resharding of an item directory (`zero_optax.reshard`).
* `_target`: the offline tool's target: a saved `StoredLayout` on a mesh given by its axis sizes.
* `_migrate`: explicit per-parameter migration of rank-local records (`reshard_explicit`).
* `_records`: rank-local records into a zero1 state (`state_from_rank_records`), to train on or save.
"""
