"""Offline resharding of a zero1 checkpoint item directory onto another mesh (`zo.reshard`), exactly.

Every array of the new layout is written chunk by chunk from `_regions.Remap`, as zarr3 over OCDBT by TensorStore
alone (Orbax's own metadata can only come from whole `jax.Array`s). The result appears atomically: by a rename on a
local file system (`_install`), on `gs://` by Orbax's commit file, written last (`_commit`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from zero_optax.checkpoint import (_arrays, _commit, _install, _offline_target, _paths, _record, _regions, _restore,
                                   _schema, _shapes, _store)
from zero_optax.checkpoint._store import Region
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._stored import LEAF, StoredLayout

Progress = Callable[[int, int], None]
"""`progress(done_bytes, total_bytes)`, called after every chunk written (bytes of the new checkpoint)."""
CHUNK_ELEMENTS = 1 << 22
"""The most elements one chunk of the output holds."""


def load(src: Any) -> tuple[_schema.Saved, _store.ItemArrays, list[dict[int, np.ndarray]]]:
    """The checked record of `src`, its checked arrays and each state's shared entries' values."""
    path = _paths.as_path(src)
    saved = _schema.load(path)
    return saved, *_restore.checked_arrays(path, saved)


def _owners_per_state(owners: Any, layouts: list[StoredLayout]) -> list[Sequence[int] | None]:
    """`owners` (None, one list for the only leaf-partition state, or one item per state) as one item per state."""
    if owners is None:
        return [None] * len(layouts)
    if not isinstance(owners, (list, tuple)):
        raise ZeroCheckpointError(f"`owners` must be a list, got {type(owners).__name__}.")
    if all(isinstance(o, (int, np.integer)) and not isinstance(o, bool) for o in owners):
        leaf_states = [k for k, x in enumerate(layouts) if x.partition == LEAF]
        if len(leaf_states) != 1:
            raise ZeroCheckpointError(
                f"`owners` is one list, but the checkpoint has {len(leaf_states)} leaf-partition states; give one "
                "item (a list or None) per state.")
        owners = [owners if k == leaf_states[0] else None for k in range(len(layouts))]
    if len(owners) != len(layouts):
        raise ZeroCheckpointError(f"`owners` has {len(owners)} items, but the checkpoint has {len(layouts)} zero1 "
                                  "states.")
    for k, o in enumerate(owners):
        if o is not None and layouts[k].partition != LEAF:
            raise ZeroCheckpointError(f"`owners[{k}]` is given, but state {k} uses the {layouts[k].partition} "
                                      "partition, which has no owners to choose.")
        if o is not None and not isinstance(o, (list, tuple)):
            raise ZeroCheckpointError(f"`owners[{k}]` must be a list of device indices or None, got {o!r}.")
    return list(owners)


def _chunks(a: _arrays.StoredArray, layout: StoredLayout) -> tuple[int, ...]:
    """Chunks of an output array: one device's share where it fits in `CHUNK_ELEMENTS`, else balanced pieces."""
    def fit(n: int) -> int:
        return max(1, -(-n // -(-n // CHUNK_ELEMENTS))) if n else 1
    if a.buffer is not None:
        return 1, fit(a.shape[1])
    if a.local is not None:  # local accumulators `[N, *shape]`: one device's block, cut along its first axis
        if len(a.shape) == 1:
            return (1,)
        rest = math.prod(a.shape[2:])
        return (1, max(1, min(a.shape[1], CHUNK_ELEMENTS // max(1, rest))), *a.shape[2:])
    e = layout.entries[a.entry]
    if e.leaf is None:
        return a.shape if math.prod(a.shape) <= CHUNK_ELEMENTS else (1, *e.shape)
    return (fit(layout.leaves[e.leaf].slots),)


def _chunk_regions(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[Region]:
    """The chunk-sized regions of an array, in order."""
    return itertools.product(*[[(lo, min(lo + c, d)) for lo in range(0, d, c)] for d, c in zip(shape, chunks)])


def _write(dst: Any, saved: _schema.Saved, store: _store.ItemArrays, shared: list[dict[int, np.ndarray]],
           layouts: list[StoredLayout], specs: list[_offline_target.Specs], progress: Progress | None) -> None:
    """Writes every array of `layouts` into `dst`, then the record, then the commit file."""
    outputs = [_arrays.stored_arrays(x, k) for k, x in enumerate(layouts)]
    total = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for arrays in outputs for a in arrays)
    done = 0
    with _store.ItemWriter(dst) as writer:
        plans = []
        for old, lay, arrays, values, spec in zip(saved.states, layouts, outputs, shared, specs):
            remap = _regions.Remap(old, lay, store.read, values, f"state {old.index}", spec)
            for i, a in enumerate(arrays):
                chunks = _chunks(a, lay)
                writer.create(a.name, a.shape, a.dtype, chunks, None if i else {_shapes.KEY: _shapes.describe(lay)})
                plans.append((remap, a, chunks))
        for remap, a, chunks in plans:
            for region in _chunk_regions(a.shape, chunks):
                data = remap.region(a, region)
                writer.write(a.name, region, data)
                done += data.nbytes
                if progress is not None:
                    progress(done, total)
    states = [_record.state_record(lay, k, old.clocks) for k, (old, lay) in enumerate(zip(saved.states, layouts))]
    _record.write(dst, _record.new_record(saved.tree, states, _record.STORAGE_TENSORSTORE))
    _commit.mark(_paths.as_path(dst))  # last: what Orbax's and zero_optax's readers take as finished


def reshard(src_dir: Any, dst_dir: Any, world_size: int | None = None, *,
            axis_sizes: Mapping[str, int] | None = None, param_specs: Any = None,
            owners: Sequence[int] | Sequence[Sequence[int] | None] | None = None, force: bool = False,
            progress: Progress | None = None) -> None:
    """Converts a zero1 checkpoint item directory to another mesh (data-parallel size, tensor-parallel and expert
    axis sizes), exactly.

    Sliced leaves' histories are cut again into `ceil(size / group)` slots per device (zero padded), through the
    leaf's logical array where an axis it is sharded over changes size. Owned leaves move whole to their new
    owners. Shared entries (step counts) are copied after checking that every old row agrees. Every source field
    and array is checked before anything is written; the result appears complete or not at all (on `gs://`,
    `force` deletes the old destination first), and memory does not grow with the checkpoint.

    Args:
      src_dir: an item directory written by `ZeroSave` (or by `reshard`), local or `gs://`.
      dst_dir: where to write the converted item directory.
      world_size: the new number of devices along each state's ZeRO axes (the other axes keep their sizes).
      axis_sizes: the target mesh, every axis (the ZeRO axes included), e.g. `{"data": 2, "model": 4}`, instead
        of `world_size`; an axis left out is not in the target mesh.
      param_specs: the parameters' `PartitionSpec`s (a pytree like the parameters, or a mapping of leaf paths
        such as `"['w']"`), where a leaf's blocks cannot tell which dimension a resized axis cuts (a square
        block) or a leaf is to be sharded over a new axis. `ZeroRestore(target, reshard=True)` needs none.
      owners: leaf partition only: one device index per leaf of the checkpoint's only leaf state, or one item
        (a list or None) per zero1 state. None balances them the way `zero1` does.
      force: replace an existing `dst_dir`.
      progress: optional `progress(done_bytes, total_bytes)` callback.

    Raises:
      ZeroCheckpointError: `src_dir` is not a complete, valid zero1 checkpoint of this format version, its shared
        entries differ between rows, `dst_dir` exists without `force`, `force` would delete the source of a
        `gs://` destination, a path has a scheme other than a local path or `gs://`, or the arguments are
        invalid.

    Examples:
      >>> import zero_optax as zo
      >>> zo.reshard("ckpt/100/opt_state", "ckpt3/100/opt_state", world_size=3)  # doctest: +SKIP
      >>> zo.reshard("ckpt/100/opt_state", "tp4/100/opt_state",
      ...            axis_sizes={"data": 2, "model": 4})  # doctest: +SKIP
    """
    src, dst = _paths.as_path(src_dir), _paths.as_path(dst_dir)
    if world_size is not None:
        world_size = _offline_target.check_world_size(world_size)
    if axis_sizes is not None:
        axis_sizes = _offline_target.check_axis_sizes(axis_sizes)
    if dst.exists() and not force:
        raise _install.already_exists(dst)
    if not _paths.is_local(dst) and force and _commit.overlap(src, dst):
        raise ZeroCheckpointError(
            f"{dst}: on an object store, replacing a checkpoint deletes it before the new one is written, so the "
            f"destination must not be {src} or lie inside or around it; write to another directory.")
    if world_size is None and axis_sizes is None:
        raise ZeroCheckpointError("Give the target mesh: `world_size=` (the data-parallel size) or `axis_sizes=` "
                                  "(every axis, e.g. {'data': 2, 'model': 4}).")
    saved, store, shared = load(src)
    per_state = _owners_per_state(owners, [s.layout for s in saved.states])
    specs = [_offline_target.specs_by_path(param_specs, set(s.layout.paths)) for s in saved.states]
    layouts = [_offline_target.new_layout(s.layout, world_size, axis_sizes, o, p, f"{src}: state {s.index}")
               for s, p, o in zip(saved.states, specs, per_state)]
    if not _paths.is_local(dst):
        if force and dst.exists():
            _commit.retract(dst)
        _write(dst, saved, store, shared, layouts, specs, progress)
        return
    tmp = _install.temporary_sibling(str(dst), "reshard")
    try:
        _write(tmp, saved, store, shared, layouts, specs, progress)
        _install.install(tmp, str(dst), force)
    except FileExistsError:
        raise _install.already_exists(dst) from None
    finally:
        _install.remove(tmp)
