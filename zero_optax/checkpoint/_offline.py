"""Offline resharding of a zero1 checkpoint item directory onto another mesh (`zo.reshard`), exactly.

Every array of the new layout is written chunk by chunk from `_regions.Remap`, as zarr3 over OCDBT by TensorStore
alone (Orbax's own metadata can only come from whole `jax.Array`s). The result appears atomically: by a rename on a
local file system, on `gs://` by Orbax's commit file, written last (both `_paths`).

Examples:
  >>> from zero_optax.checkpoint import _offline
  >>> _offline.parse_axis_sizes("data=2,model=4")
  {'data': 2, 'model': 4}
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from zero_optax.checkpoint import _arrays, _paths, _record, _regions, _restore, _schema, _store
from zero_optax.checkpoint._store import Region
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout import _attribution
from zero_optax.layout._stored import LEAF, ParamLeaf, StoredLayout, slot_count, spec_axes

Progress = Callable[[int, int], None]
"""`progress(done_bytes, total_bytes)`, called after every chunk written (bytes of the new checkpoint)."""
CHUNK_ELEMENTS = 1 << 22
"""The most elements one chunk of the output holds."""
Specs = dict[str, Sequence[Any]]
"""Leaf path -> its PartitionSpec (a sequence with one entry per dimension: None, an axis or a tuple of axes)."""


def load(src: Any) -> tuple[_schema.Saved, _store.ItemArrays, list[dict[int, np.ndarray]]]:
    """The checked record of `src`, its checked arrays and each state's shared entries' values."""
    path = _paths.as_path(src)
    saved = _schema.load(path)
    return saved, *_restore.checked_arrays(path, saved)


def _check_world_size(world_size: Any) -> int:
    """`world_size` (or an axis size) checked: a positive int up to `_schema.MAX_WORLD_SIZE`."""
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ZeroCheckpointError(f"`world_size` must be a positive int, got {world_size!r}.")
    if world_size > _schema.MAX_WORLD_SIZE:
        raise ZeroCheckpointError(f"`world_size` must be at most {_schema.MAX_WORLD_SIZE}, got {world_size}.")
    return int(world_size)


def parse_axis_sizes(text: str, flag: str = "--axis-sizes") -> dict[str, int]:
    """`"data=2,model=4"` as `{"data": 2, "model": 4}` (the command line's `flag`)."""
    out = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not name.strip() or not size.strip().isdigit():
            raise ZeroCheckpointError(f"`{flag}` must look like data=2,model=4; `{item}` is not NAME=SIZE.")
        out[name.strip()] = int(size)
    return out


def _check_axis_sizes(axis_sizes: Any) -> dict[str, int]:
    """`axis_sizes` checked: a non-empty mapping of axis names to sizes."""
    if not isinstance(axis_sizes, Mapping) or not axis_sizes:
        raise ZeroCheckpointError(f"`axis_sizes` must be a non-empty mapping of mesh axis names to sizes, such "
                                  f"as {{'data': 2, 'model': 4}}; got {axis_sizes!r}.")
    for name, size in axis_sizes.items():
        if not isinstance(name, str) or not name:
            raise ZeroCheckpointError(f"`axis_sizes` names an axis {name!r}; axis names are non-empty strings.")
        _check_world_size(size)
    return {a: int(k) for a, k in axis_sizes.items()}


def _specs_by_path(param_specs: Any, paths: set[str]) -> Specs:
    """`param_specs` (a mapping of leaf paths, or a pytree of `PartitionSpec`s like the parameters) by leaf path."""
    if isinstance(param_specs, Mapping) and all(isinstance(k, str) and k in paths for k in param_specs):
        return {k: tuple(v) for k, v in param_specs.items()}
    flat = jax.tree.leaves_with_path(param_specs, is_leaf=lambda x: isinstance(x, P) or x is None)
    out: Specs = {_names.key_path(path): tuple(spec) for path, spec in flat if spec is not None}
    unknown = sorted(set(out) - paths)
    if unknown:
        raise ZeroCheckpointError(
            f"`param_specs` names {unknown[:3]}, which are not parameter leaves of the checkpoint (they are "
            f"{sorted(paths)[:5]}...); give a pytree of PartitionSpecs shaped like the parameters, or a mapping "
            "of these leaf paths.")
    return out


def _target_sizes(old: StoredLayout, world_size: int | None, axis_sizes: dict[str, int] | None, where: str
                 ) -> tuple[int, dict[str, int]]:
    """The target's world size and axis sizes: `axis_sizes`, or the saved ones with the ZeRO axes at `world_size`."""
    zero = old.axes
    if axis_sizes is None:
        experts = [x.path for x in old.leaves if set(x.axes) & set(zero)]
        if experts and len(zero) > 1:
            raise ZeroCheckpointError(
                f"{where}: leaf `{experts[0]}` is sharded over a ZeRO axis (an expert parameter), so the new size "
                f"of each of {list(zero)} is needed: pass `axis_sizes` (`--axis-sizes`) instead of `world_size`.")
        assert world_size is not None  # (`reshard` refuses neither given)
        return world_size, dict(old.axis_sizes) | ({zero[0]: world_size} if len(zero) == 1 else {})
    missing = [a for a in zero if a not in axis_sizes]
    if missing:
        raise ZeroCheckpointError(f"`axis_sizes` must give the size of every ZeRO axis of {where}; it lacks "
                                  f"{missing}.")
    n = math.prod(axis_sizes[a] for a in zero)
    if world_size is not None and world_size != n:
        raise ZeroCheckpointError(f"`world_size` is {world_size}, but `axis_sizes` makes the ZeRO axes {list(zero)} "
                                  f"{n} devices; give one of the two.")
    return n, dict(axis_sizes)


def _new_layout(old: StoredLayout, world_size: int | None, axis_sizes: dict[str, int] | None,
               owners: Sequence[int] | None, specs: Specs, where: str) -> StoredLayout:
    """`old` on the target mesh: sliced leaves cut anew, owned leaves given `owners` (default: balanced)."""
    n, sizes = _target_sizes(old, world_size, axis_sizes, where)
    chosen = (_attribution.owners_for_entries(old.entries, [not x.sliced for x in old.leaves], n) if owners is None
              else _attribution.check_owners(owners, len(old.leaves), n, old.paths))
    zero = old.axes
    leaves = []
    for x, o in zip(old.leaves, chosen):
        if not x.sliced:
            spec = _spec(x, specs.get(x.path), (), where)
            leaves.append(dataclasses.replace(_owned_leaf(old, x, sizes, spec, where), group=n, owner=o))
            continue
        saved = _regions.leaf_blocks(old, x, where)
        spec = _spec(x, specs.get(x.path), saved.axes, where)
        cut, shape = _regions.target_blocks(saved, sizes, spec, x.path, where)
        axes = tuple(a for a in sizes if a in cut or a in x.axes)  # size-1 axes stay where they were
        group = math.prod(sizes[a] for a in zero if a not in axes) if all(a in sizes for a in zero) else n
        blocks = math.prod(sizes[a] for a in axes)
        leaves.append(dataclasses.replace(x, shape=shape, axes=axes, blocks=blocks, group=group,
                                          slots=slot_count(math.prod(shape), group), spec=_kept(spec, axes, shape)))
    entries = tuple(dataclasses.replace(e, shape=(leaves[e.leaf].slots,))
                    if e.leaf is not None and leaves[e.leaf].sliced else e for e in old.entries)
    used = {a for x in leaves for a in x.axes} | set(zero)
    used_sizes = tuple((a, k) for a, k in sizes.items() if a in used)
    return dataclasses.replace(old, world_size=n, leaves=tuple(leaves), entries=entries, axis_sizes=used_sizes)


def _spec(x: ParamLeaf, given: Sequence[Any] | None, cut: tuple[tuple[str, int], ...], where: str
          ) -> Sequence[Any] | None:
    """The spec leaf `x` is laid out by on the target: `given` (`param_specs`'), refused where it places an axis of
    `cut` (those the saved blocks differ along) on another dimension than the record; else the recorded one."""
    if given is None:
        return x.spec
    if x.spec is not None:
        was, now = _regions.spec_dims(x.spec), _regions.spec_dims(given)
        for a, _ in cut:
            if now.get(a, was[a]) != was[a]:
                raise ZeroCheckpointError(
                    f"{where}: `param_specs` gives leaf `{x.path}` the spec {tuple(given)}, which cuts `{a}` along "
                    f"dimension {now[a]}, but the checkpoint records that `{a}` cuts dimension {was[a]} (spec "
                    f"{_regions.show_spec(x.spec)}); give the spec the parameter was trained with, or leave it out "
                    "of `param_specs` to use the recorded one.")
    return given


def _kept(spec: Sequence[Any] | None, axes: tuple[str, ...], shape: tuple[int, ...]
          ) -> tuple[tuple[str, ...], ...] | None:
    """A target leaf's `ParamLeaf.spec`: `spec` on the target's `axes` (None where unknown and `axes` are some)."""
    if spec is None and axes:
        return None
    cut = spec_axes(spec or ())[:len(shape)]
    return tuple(tuple(a for a in c if a in axes) for c in cut) + ((),) * (len(shape) - len(cut))


def _owned_leaf(old: StoredLayout, x: ParamLeaf, sizes: dict[str, int], spec: Sequence[Any] | None, where: str
                ) -> ParamLeaf:
    """Owned leaf `x` of `old` on a mesh of axis sizes `sizes`, its blocks cut as `spec` says, else as saved."""
    whole = old.whole_shape(x)
    if spec is not None:
        cut = spec_axes(spec)
        cut += [()] * (len(whole) - len(cut))
    else:
        cut = list(x.dims) or [()] * len(whole)
    dims = tuple(tuple(a for a in c if a not in old.axes and a in sizes and (sizes[a] > 1 or a in x.axes))
                 for c in cut)
    if not any(dims):
        return dataclasses.replace(x, shape=whole, axes=(), blocks=1, dims=(), slots=math.prod(whole),
                                   spec=((),) * len(whole))
    k = [math.prod(sizes[a] for a in c) for c in dims]
    if len(dims) != len(whole) or any(w % m for w, m in zip(whole, k)):
        raise ZeroCheckpointError(
            f"{where}: owned leaf `{x.path}` of shape {list(whole)} is to be cut over {[list(c) for c in dims]} "
            f"into {k} blocks per dimension, which do not divide it; give the target mesh axis sizes that divide "
            "the parameter, or `param_specs` with the spec it trains with.")
    shape = tuple(w // m for w, m in zip(whole, k))
    axes = tuple(a for a in sizes if any(a in c for c in dims))
    return dataclasses.replace(x, shape=shape, axes=axes, blocks=math.prod(sizes[a] for a in axes), dims=dims,
                               slots=math.prod(shape), spec=dims)


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
    assert a.entry is not None  # (neither a buffer nor local sums: an entry)
    e = layout.entries[a.entry]
    if e.leaf is None:
        return a.shape if math.prod(a.shape) <= CHUNK_ELEMENTS else (1, *e.shape)
    return (fit(layout.leaves[e.leaf].slots),)


def _chunk_regions(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[Region]:
    """The chunk-sized regions of an array, in order."""
    return itertools.product(*[[(lo, min(lo + c, d)) for lo in range(0, d, c)] for d, c in zip(shape, chunks)])


def _write(dst: Any, saved: _schema.Saved, store: _store.ItemArrays, shared: list[dict[int, np.ndarray]],
           layouts: list[StoredLayout], specs: list[Specs], progress: Progress | None) -> None:
    """Writes every array of `layouts` into `dst`, then the record, then the commit file."""
    outputs = [_arrays.stored_arrays(x, k) for k, x in enumerate(layouts)]
    states = [_record.state_record(lay, k, old.clocks) for k, (old, lay) in enumerate(zip(saved.states, layouts))]
    total = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for arrays in outputs for a in arrays)
    done = 0
    with _store.ItemWriter(dst) as writer:
        plans = []
        for old, lay, arrays, values, spec, state in zip(saved.states, layouts, outputs, shared, specs, states):
            remap = _regions.Remap(old, lay, store.read, values, f"state {old.index}", spec)
            copy = {_record.SHAPES_KEY: _record.shapes_table(state)}
            for i, a in enumerate(arrays):
                chunks = _chunks(a, lay)
                writer.create(a.name, a.shape, a.dtype, chunks, None if i else copy)
                plans.append((remap, a, chunks))
        for remap, a, chunks in plans:
            for region in _chunk_regions(a.shape, chunks):
                data = remap.region(a, region)
                writer.write(a.name, region, data)
                done += data.nbytes
                if progress is not None:
                    progress(done, total)
    _record.write(dst, _record.new_record(saved.tree, states, _record.STORAGE_TENSORSTORE))
    _paths.mark(_paths.as_path(dst))  # last: what Orbax's and zero_optax's readers take as finished


def reshard(src_dir: Any, dst_dir: Any, world_size: int | None = None, *,
            axis_sizes: Mapping[str, int] | None = None, param_specs: Any = None,
            owners: Sequence[int] | Sequence[Sequence[int] | None] | None = None, force: bool = False,
            progress: Progress | None = None) -> None:
    """Converts a zero1 checkpoint item directory to another mesh (data-parallel size, tensor-parallel and expert
    axis sizes), exactly.

    Sliced leaves are cut again, owned leaves move whole to their new owners, and shared entries (step counts) are
    copied once every old row agrees. Everything is checked before anything is written; the result appears complete
    or not at all (on `gs://`, `force` deletes the old destination first), and memory does not grow with it.

    Args:
      src_dir: an item directory written by `ZeroSave` (or by `reshard`), local or `gs://`.
      dst_dir: where to write the converted item directory.
      world_size: the new number of devices along each state's ZeRO axes (the other axes keep their sizes).
      axis_sizes: the target mesh, every axis (the ZeRO axes included), e.g. `{"data": 2, "model": 4}`, instead
        of `world_size`; an axis left out is not in the target mesh.
      param_specs: the parameters' `PartitionSpec`s on the target (a pytree like the parameters, or a mapping
        of leaf paths such as `"['w']"`). A checkpoint of record format 3 (zero_optax 0.5 on) records every
        leaf's placement whenever the run knew it (the mesh-bound form, `param_specs` or `zo.state_specs`), so
        it needs none to resize or drop axes; they are needed where the record lacks it (format 2, a raw
        `shard_map` without `param_specs`) and a leaf's blocks cannot tell which dimension a resized axis cuts
        (a square block), and always to shard a leaf over an axis the checkpoint does not have (`model=4` from
        a run without `model`). A spec that places an axis of the checkpoint on another dimension than the
        record is refused. `ZeroRestore(target, reshard=True)` needs none.
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
        world_size = _check_world_size(world_size)
    if axis_sizes is not None:
        axis_sizes = _check_axis_sizes(axis_sizes)
    if dst.exists() and not force:
        raise _paths.already_exists(dst)
    if not _paths.is_local(dst) and force and _paths.overlap(src, dst):
        raise ZeroCheckpointError(
            f"{dst}: on an object store, replacing a checkpoint deletes it before the new one is written, so the "
            f"destination must not be {src} or lie inside or around it; write to another directory.")
    if world_size is None and axis_sizes is None:
        raise ZeroCheckpointError("Give the target mesh: `world_size=` (the data-parallel size) or `axis_sizes=` "
                                  "(every axis, e.g. {'data': 2, 'model': 4}).")
    saved, store, shared = load(src)
    per_state = _owners_per_state(owners, [s.layout for s in saved.states])
    specs = [_specs_by_path(param_specs, set(s.layout.paths)) for s in saved.states]
    layouts = [_new_layout(s.layout, world_size, axis_sizes, o, p, f"{src}: state {s.index}")
               for s, p, o in zip(saved.states, specs, per_state)]
    if not _paths.is_local(dst):
        if force and dst.exists():
            _paths.retract(dst)
        _write(dst, saved, store, shared, layouts, specs, progress)
        return
    tmp = _paths.temporary_sibling(str(dst), "reshard")
    try:
        _write(tmp, saved, store, shared, layouts, specs, progress)
        _paths.install(tmp, str(dst), force)
    except FileExistsError:
        raise _paths.already_exists(dst) from None
    finally:
        _paths.remove(tmp)
