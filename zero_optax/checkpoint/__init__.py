"""Checkpoints of zero1 states: written, read, checked, and re-cut for another mesh. The top layer.

The Orbax handler (`_handler`) saves the arrays of a pytree's zero1 states (`_arrays`) beside a versioned JSON
record (`_record`). A restore (`_restore`) checks the record (`_schema`) and the target before it reads any
array (`_store`, at `_paths`, which keeps half-written checkpoints unread). `_regions` re-cuts arrays for another
mesh: for restores, for `zo.reshard` (`_offline`) and for rank-local records (`_rank_migration`).
"""
