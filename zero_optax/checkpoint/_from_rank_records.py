"""Rank-local records into a zero1 state (`zo.state_from_rank_records`): where `zo.reshard_explicit` leads.

Every record is checked before any array is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zero_optax.checkpoint import _arrays, _regions, _restore, _tree
from zero_optax.checkpoint._rank_migration import ParamSlice, RankRecord, clock_difference
from zero_optax.checkpoint._store import aligned_empty
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError as _Error
from zero_optax.layout._stored import LOCAL, StoredViews

WHERE = "state_from_rank_records"


def _slices(layout: StoredViews, records: list[RankRecord]) -> dict[tuple[int, int, int], ParamSlice]:
    """`(leaf, block, rank)` -> the `ParamSlice` that device holds, checked against the layout."""
    by_rank: dict[tuple[int, int], list[RankRecord]] = {}
    for rec in records:
        by_rank.setdefault((rec.world_size, rec.rank), []).append(rec)
    out = {}
    for i, leaf in enumerate(layout.leaves):
        histories = {e.path: e for e in layout.entries if e.leaf == i}
        for b in range(leaf.blocks):
            key = _names.block_key(leaf.path, b, leaf.blocks)
            for r in range(leaf.group):
                found = [rec for rec in by_rank.get((leaf.group, r), ()) if key in rec.params]
                if len(found) != 1:
                    raise _Error(
                        f"{WHERE}: {'no' if not found else len(found)} records of rank {r} in a group of "
                        f"{leaf.group} hold `{key}` (the target's leaf `{leaf.path}` has {leaf.blocks} blocks, each "
                        f"on {leaf.group} devices); give exactly one, e.g. Migration(`{key}`, {r}, {leaf.group}, "
                        "sources=...).")
                part = found[0].params[key]
                where = f"{WHERE}: `{key}` at rank {r} of {leaf.group}"
                if tuple(part.shape) != leaf.shape:
                    raise _Error(f"{where} has shape {tuple(part.shape)}, but the target's block is {leaf.shape}.")
                if set(part.buffers) != set(histories):
                    raise _Error(f"{where} holds histories {sorted(part.buffers)}, but the target's optimizer keeps "
                                 f"{sorted(histories)}.")
                for name, x in part.buffers.items():
                    e = histories[name]
                    if np.dtype(x.dtype).name != e.dtype or tuple(x.shape) != (leaf.slots,):
                        raise _Error(f"{where}: `{name}` is {x.shape} {np.dtype(x.dtype).name}, but the target "
                                     f"holds ({leaf.slots},) {e.dtype} on each device.")
                out[i, b, r] = part
    return out


def _shared(layout: StoredViews, records: list[RankRecord]) -> dict[int, np.ndarray]:
    """Entry index -> value of every shared entry, from the records' clocks (which must agree)."""
    for rec in records[1:]:
        if diff := clock_difference(records[0].clocks, rec.clocks):
            raise _Error(f"{WHERE}: the records' clocks differ ({diff}); records of one state share them.")
    out = {}
    for j, e in enumerate(layout.entries):
        if e.leaf is not None:
            continue
        if e.path not in records[0].clocks:
            raise _Error(f"{WHERE}: the records have no clock `{e.path}`, which the target's optimizer keeps.")
        value = np.asarray(records[0].clocks[e.path])
        if value.shape != e.shape or value.dtype.name != e.dtype:
            raise _Error(f"{WHERE}: clock `{e.path}` is {value.shape} {value.dtype.name}, but the target keeps "
                         f"{e.shape} {e.dtype}.")
        out[j] = value
    return out


@dataclasses.dataclass
class _Records(_regions.Regions):
    """Any region of the target's stored arrays, from checked records (the target has no owned leaves)."""

    slices: dict[tuple[int, int, int], ParamSlice]

    def _history(self, j: int, span: tuple[int, int], dtype: np.dtype) -> np.ndarray:
        e = self.target.entries[j]
        leaf = self.target.leaves[e.leaf]
        lo, hi = span
        out = aligned_empty(hi - lo, dtype)
        at = lo
        while at < hi:
            (b, r), c = divmod(at // leaf.slots, leaf.group), at % leaf.slots
            n = min(hi - at, leaf.slots - c)
            out[at - lo:at - lo + n] = self.slices[e.leaf, b, r].buffers[e.path][c:c + n]
            at += n
        return out


def state_from_rank_records(target: Any, records: Mapping[Any, RankRecord] | Sequence[RankRecord]) -> Any:
    """A zero1 state like `target` holding the histories and clocks of rank-local `records` (what
    `zo.reshard_explicit` or `zo.load_rank_records` return), to train on or save with `zo.ZeroSave`.

    Args:
      target: a state holding one zero1 state, from `tx.init` on the new mesh (concrete, or abstract from
        `jax.eval_shape` under `jax.set_mesh`): its layout says which record each device reads.
      records: `RankRecord`s (a list, or `reshard_explicit`'s dict). For block `b` of sliced leaf `path`, split
        over `g` devices in the target, rank `r` reads the one record with `world_size == g`, `rank == r` and the
        key `path` (one block) or `path#block<b>` in its `params`. Their clocks must agree.

    Returns:
      `target` with its zero1 state's arrays replaced.

    Raises:
      ZeroCheckpointError: the target has owned leaves (rank-local records hold sliced leaves only), a block has
        no record or several, a record's shape, histories or dtypes differ from the target's, clocks differ or
        are missing, or local accumulators are mid-cycle.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> tx = zo.zero1(optax.sgd(0.1, momentum=0.9), axis_name="data")
      >>> target = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=jax.P(), out_specs=jax.P("data")))(
      ...     {"w": jnp.zeros(3)})
      >>> trace = {"[0].trace['w']": np.arange(3.0, dtype=np.float32)}   # one device's history of w
      >>> src = [zo.RankRecord(0, 1, {"['w']": zo.ParamSlice((3,), trace)})]
      >>> moved = zo.reshard_explicit(src, [zo.Migration("['w']", t, 2, sources=[0]) for t in range(2)])
      >>> zo.gather_state(zo.state_from_rank_records(target, moved))[0].trace["w"].tolist()
      [0.0, 1.0, 2.0]
    """
    recs = list(records.values()) if isinstance(records, Mapping) else list(records)
    if not recs or not all(isinstance(r, RankRecord) for r in recs):
        raise _Error(f"{WHERE}: `records` must be RankRecords (a list, or reshard_explicit's dict).")
    parts = _tree.split(target, "The target")
    if len(parts.states) != 1:
        raise _Error(f"{WHERE}: the target holds {len(parts.states)} zero1 states; give one at a time.")
    state = parts.states[0][1]
    layout = state.layout
    owned = [x.path for x in layout.leaves if not x.sliced]
    if owned:
        raise _Error(f"{WHERE}: the target's leaf `{owned[0]}` is owned (partition={layout.partition!r}), and "
                     "rank-local records hold sliced leaves only; move owned leaves with "
                     "zo.ZeroRestore(target, reshard=True) or zo.reshard(..., owners=).")
    slices, shared = _slices(layout, recs), _shared(layout, recs)
    if layout.accumulate == LOCAL and _regions.micro_step(layout, shared):
        raise _Error(f"{WHERE}: the records were taken mid-cycle of accumulate=\"local\", whose per-device sums "
                     "they do not hold; take them at a cycle boundary.")
    regions = _Records(layout, shared, slices)
    specs = _arrays.stored_arrays(layout, 0)
    arrays = [_restore.build(a, _restore.concrete_sharding(s.sharding, f"{WHERE}: the target's array {a.name}"),
                             regions.region)
              for a, s in zip(specs, _arrays.target_structs(state), strict=True)]
    return _tree.put_back(target, parts, [_arrays.rebuild(state, arrays)])
