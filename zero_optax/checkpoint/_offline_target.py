"""The offline `zo.reshard`'s target: a saved `StoredLayout` on a mesh given by its axis sizes, without devices.

Examples:
  >>> from zero_optax.checkpoint import _offline_target
  >>> _offline_target.parse_axis_sizes("data=2,model=4")
  {'data': 2, 'model': 4}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from zero_optax.checkpoint import _tp_blocks, _schema
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout import _owners
from zero_optax.layout._stored import ParamLeaf, StoredLayout, slot_count

Specs = dict[str, Sequence[Any]]
"""Leaf path -> its PartitionSpec (a sequence with one entry per dimension: None, an axis or a tuple of axes)."""


def check_world_size(world_size: Any) -> int:
    """`world_size` (or an axis size) checked: a positive int up to `_schema.MAX_WORLD_SIZE`."""
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ZeroCheckpointError(f"`world_size` must be a positive int, got {world_size!r}.")
    if world_size > _schema.MAX_WORLD_SIZE:
        raise ZeroCheckpointError(f"`world_size` must be at most {_schema.MAX_WORLD_SIZE}, got {world_size}.")
    return int(world_size)


def parse_axis_sizes(text: str) -> dict[str, int]:
    """`"data=2,model=4"` as `{"data": 2, "model": 4}` (the command line's `--axis-sizes`)."""
    out = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not name.strip() or not size.strip().isdigit():
            raise ZeroCheckpointError(f"`--axis-sizes` must look like data=2,model=4; `{item}` is not NAME=SIZE.")
        out[name.strip()] = int(size)
    return out


def check_axis_sizes(axis_sizes: Any) -> dict[str, int]:
    """`axis_sizes` checked: a non-empty mapping of axis names to sizes."""
    if not isinstance(axis_sizes, Mapping) or not axis_sizes:
        raise ZeroCheckpointError(f"`axis_sizes` must be a non-empty mapping of mesh axis names to sizes, such "
                                  f"as {{'data': 2, 'model': 4}}; got {axis_sizes!r}.")
    for name, size in axis_sizes.items():
        if not isinstance(name, str) or not name:
            raise ZeroCheckpointError(f"`axis_sizes` names an axis {name!r}; axis names are non-empty strings.")
        check_world_size(size)
    return {a: int(k) for a, k in axis_sizes.items()}


def specs_by_path(param_specs: Any, paths: set[str]) -> Specs:
    """`param_specs` (a mapping of leaf paths, or a pytree of `PartitionSpec`s like the parameters) by leaf path."""
    if param_specs is None:
        return {}
    if isinstance(param_specs, Mapping) and param_specs and all(isinstance(k, str) and k in paths
                                                                   for k in param_specs):
        return {k: tuple(v) for k, v in param_specs.items()}
    flat = jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=lambda x: isinstance(x, P) or x is None)[0]
    out = {_names.key_path(path): tuple(spec) for path, spec in flat if spec is not None}
    unknown = sorted(set(out) - paths)
    if unknown:
        raise ZeroCheckpointError(
            f"`param_specs` names {unknown[:3]}, which are not parameter leaves of the checkpoint (they are "
            f"{sorted(paths)[:5]}...); give a pytree of PartitionSpecs shaped like the parameters, or a mapping "
            "of these leaf paths.")
    return out


def target_sizes(old: StoredLayout, world_size: int | None, axis_sizes: dict[str, int] | None, where: str
                 ) -> tuple[int, dict[str, int]]:
    """The target's world size and axis sizes: `axis_sizes`, or the saved ones with the ZeRO axes at `world_size`."""
    zero = old.axes
    if axis_sizes is None:
        experts = [x.path for x in old.leaves if set(x.axes) & set(zero)]
        if experts and len(zero) > 1:
            raise ZeroCheckpointError(
                f"{where}: leaf `{experts[0]}` is sharded over a ZeRO axis (an expert parameter), so the new size "
                f"of each of {list(zero)} is needed: pass `axis_sizes` (`--axis-sizes`) instead of `world_size`.")
        sizes = dict(old.axis_sizes) | ({zero[0]: world_size} if len(zero) == 1 else {})
        return world_size, sizes
    missing = [a for a in zero if a not in axis_sizes]
    if missing:
        raise ZeroCheckpointError(f"`axis_sizes` must give the size of every ZeRO axis of {where}; it lacks "
                                  f"{missing}.")
    n = math.prod(axis_sizes[a] for a in zero)
    if world_size is not None and world_size != n:
        raise ZeroCheckpointError(f"`world_size` is {world_size}, but `axis_sizes` makes the ZeRO axes {list(zero)} "
                                  f"{n} devices; give one of the two.")
    return n, dict(axis_sizes)


def new_layout(old: StoredLayout, world_size: int | None, axis_sizes: dict[str, int] | None,
               owners: Sequence[int] | None, specs: Specs, where: str) -> StoredLayout:
    """`old` on the target mesh: sliced leaves cut anew, owned leaves given `owners` (default: balanced)."""
    n, sizes = target_sizes(old, world_size, axis_sizes, where)
    owners = (_owners.owners_for_entries(old.entries, [not x.sliced for x in old.leaves], n) if owners is None
              else _owners.check_owners(owners, len(old.leaves), n, old.paths))
    zero = old.axes
    leaves = []
    for x, o in zip(old.leaves, owners):
        if not x.sliced:
            leaves.append(dataclasses.replace(_owned_leaf(old, x, sizes, specs.get(x.path), where), group=n, owner=o))
            continue
        saved = _tp_blocks.leaf_blocks(old, x, where)
        cut, shape = _tp_blocks.target_blocks(saved, sizes, specs.get(x.path), x.path, where)
        axes = tuple(a for a in sizes if a in cut or a in x.axes)  # size-1 axes stay where they were
        group = math.prod(sizes[a] for a in zero if a not in axes) if all(a in sizes for a in zero) else n
        blocks = math.prod(sizes[a] for a in axes)
        leaves.append(dataclasses.replace(x, shape=shape, axes=axes, blocks=blocks, group=group,
                                          slots=slot_count(math.prod(shape), group)))
    entries = tuple(dataclasses.replace(e, shape=(leaves[e.leaf].slots,))
                    if e.leaf is not None and leaves[e.leaf].sliced else e for e in old.entries)
    used = {a for x in leaves for a in x.axes} | set(zero)
    axis_sizes = tuple((a, k) for a, k in sizes.items() if a in used)
    return dataclasses.replace(old, world_size=n, leaves=tuple(leaves), entries=entries, axis_sizes=axis_sizes)


def _owned_leaf(old: StoredLayout, x: ParamLeaf, sizes: dict[str, int], spec: Sequence[Any] | None, where: str
                ) -> ParamLeaf:
    """Owned leaf `x` of `old` on a mesh of axis sizes `sizes`, its blocks cut as `spec` says, else as saved."""
    whole = old.whole_shape(x)
    if spec is not None:
        cut = _tp_blocks.spec_entries(spec)
        cut += [()] * (len(whole) - len(cut))
    else:
        cut = list(x.dims) or [()] * len(whole)
    dims = tuple(tuple(a for a in c if a not in old.axes and a in sizes and (sizes[a] > 1 or a in x.axes))
                 for c in cut)
    if not any(dims):
        return dataclasses.replace(x, shape=whole, axes=(), blocks=1, dims=(), slots=math.prod(whole))
    k = [math.prod(sizes[a] for a in c) for c in dims]
    if len(dims) != len(whole) or any(w % m for w, m in zip(whole, k)):
        raise ZeroCheckpointError(
            f"{where}: owned leaf `{x.path}` of shape {list(whole)} is to be cut over {[list(c) for c in dims]} "
            f"into {k} blocks per dimension, which do not divide it; give the target mesh axis sizes that divide "
            "the parameter, or `param_specs` with the spec it trains with.")
    shape = tuple(w // m for w, m in zip(whole, k))
    axes = tuple(a for a in sizes if any(a in c for c in dims))
    return dataclasses.replace(x, shape=shape, axes=axes, blocks=math.prod(sizes[a] for a in axes), dims=dims,
                               slots=math.prod(shape))
