"""Rank-local records of zero1 states: read from a checkpoint, migrated between groups, and built into a state.

`reshard_explicit` moves each parameter from its own group of records to a new one, exactly, with numpy only, so
that parameters whose groups differ (tensor-parallel, expert) move together. `state_from_rank_records` checks every
record before it builds any array.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from zero_optax.checkpoint import _arrays, _offline, _regions, _restore
from zero_optax.checkpoint._store import aligned_empty, aligned_zeros
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError as _Error
from zero_optax.layout._stored import LOCAL, StoredViews, slot_count

WHERE = "state_from_rank_records"


@dataclasses.dataclass(frozen=True)
class ParamSlice:
    """One parameter's coordinate histories on one device of its data-parallel group.

    Attributes:
      shape: the parameter's shape (on a mesh with model-parallel axes: its block's shape).
      buffers: history name (for zero1 states, the entry path such as `"[0].mu['w']"`) -> 1-D numpy array of this
        rank's `ceil(size / world_size)` coordinates, zero-padded at the tail. Empty for a parameter without one.
    """

    shape: tuple[int, ...]
    buffers: Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """The rank-local record of one device in one data-parallel group (one zero1 state on one device).

    Attributes:
      rank: this device's index in the group, in `[0, world_size)`.
      world_size: the size of the group the record was saved in.
      params: parameter id -> its `ParamSlice` on this rank (`load_rank_records` keys a leaf by its path, or by
        `path#block<b>` for block `b` of a leaf sharded over model-parallel axes).
      clocks: shared entries (step counts ...), name -> numpy value; identical on every rank of a run.
    """

    rank: int
    world_size: int
    params: Mapping[str, ParamSlice]
    clocks: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Migration:
    """Where one parameter's history goes, and which source records together hold all of it.

    Attributes:
      param: the parameter id (a key of `RankRecord.params`).
      target_rank: the rank in the new data-parallel group whose coordinates this migration produces.
      target_world_size: the size of the new group.
      sources: indices into `records` of the whole old group: one record per old rank, in any order.
      target: the output record this slice goes into; defaults to `target_rank`. Give distinct labels (e.g.
        `("tp1", 0)`) when tensor-parallel or expert groups reuse rank numbers.
    """

    param: str
    target_rank: int
    target_world_size: int
    sources: Sequence[int]
    target: Hashable | None = None


def load_rank_records(directory: str | os.PathLike[str], state: int = 0) -> list[RankRecord]:
    """The rank-local records of zero1 state `state` of an item directory: one per device of each
    data-parallel group its sliced leaves are split over.

    Rank `r` of a group of `g` devices gets `RankRecord(r, g)`, whose `params` hold, for every block `b` of every
    sliced leaf split over `g` devices, the key `"['w']"` (one block) or `"['w']#block<b>"`, with one history per
    state entry (master copies included). Records come by group size, largest first, then rank. Owned leaves are
    left out (move them with `zo.reshard(..., owners=)`). Loads the whole state into memory; `zo.reshard` streams.

    Args:
      directory: an item directory written by `zo.ZeroSave` or `zo.reshard`, local or `gs://`.
      state: which zero1 state of it, in tree order.

    Returns:
      The records, to migrate with `zo.reshard_explicit`.

    Raises:
      ZeroCheckpointError: the directory is not a valid zero1 checkpoint, `state` is out of range, or the state
        has no sliced leaf.
    """
    saved, store, shared = _offline.load(directory)
    if isinstance(state, bool) or not isinstance(state, (int, np.integer)) or not 0 <= state < len(saved.states):
        raise _Error(f"`state` {state!r} is out of range: {directory} holds {len(saved.states)} zero1 states.")
    layout = saved.states[state].layout
    sliced = [i for i, x in enumerate(layout.leaves) if x.sliced]
    if not sliced:
        raise _Error(f"state {state} of {directory} uses the leaf partition; move whole leaves with "
                     "reshard(..., owners=).")
    stacked = next((e for e in layout.entries if layout.kind(e) == "sliced" and len(e.shape) > 1), None)
    if stacked is not None:
        raise _Error(f"state {state} of {directory} holds `{stacked.path}`, a history stacked along leading axes "
                     f"(shape {stacked.shape} on each device), which rank records of 1-D coordinate histories "
                     "cannot hold.")
    clocks = {layout.entries[j].path: v for j, v in shared[state].items()}
    names = {a.entry: a.name for a in saved.states[state].arrays if a.entry is not None}
    histories = {j: store.read(names[j], ((0, math.prod(store.open(names[j]).shape)),))
                 for j, e in enumerate(layout.entries) if e.leaf is not None and layout.leaves[e.leaf].sliced}
    records = []
    for g in sorted({layout.leaves[i].group for i in sliced}, reverse=True):
        members = [i for i in sliced if layout.leaves[i].group == g]
        for r in range(g):
            params = {}
            for i in members:
                leaf, s = layout.leaves[i], layout.leaves[i].slots
                for b in range(leaf.blocks):
                    at = (b * g + r) * s
                    params[_names.block_key(leaf.path, b, leaf.blocks)] = ParamSlice(leaf.shape, {
                        layout.entries[j].path: h[at:at + s].copy() for j, h in histories.items()
                        if layout.entries[j].leaf == i})
            records.append(RankRecord(r, g, params, dict(clocks)))
    return records


def clock_difference(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> str | None:
    """How two records' clocks differ, for an error message; None where they agree bit for bit."""
    if set(a) != set(b):
        return f"clocks {sorted(a)} vs {sorted(b)}"
    for name in sorted(a):
        x, y = np.asarray(a[name]), np.asarray(b[name])
        if not _regions.same(x, y):
            return f"clock `{name}` is {_regions.show(x)} vs {_regions.show(y)}"
    return None


def _sources(where: str, m: Migration, records: Sequence[RankRecord]) -> list[RankRecord]:
    """The records `m.sources` names: one per rank of one group, agreeing on clocks, buffers, shape and dtypes."""
    for s in m.sources:
        if not isinstance(s, (int, np.integer)) or not 0 <= s < len(records):
            raise _Error(f"{where}: source index {s!r} is out of range for {len(records)} records.")
    group = [records[s] for s in m.sources]
    first, seen = m.sources[0], {}
    for s, rec in zip(m.sources, group):
        if m.param not in rec.params:
            raise _Error(f"{where}: source records[{s}] (rank {rec.rank}) lacks the parameter.")
        if rec.world_size != len(group):
            raise _Error(f"{where}: the source group has {len(group)} records, but records[{s}] was saved with "
                         f"world size {rec.world_size}; name exactly one record per rank of that group.")
        if not 0 <= rec.rank < rec.world_size:
            raise _Error(f"{where}: records[{s}] has rank {rec.rank}, out of range for world size {rec.world_size}.")
        if rec.rank in seen:
            raise _Error(f"{where}: records[{seen[rec.rank]}] and records[{s}] both hold rank {rec.rank}: repeated "
                         "source ranks.")
        seen[rec.rank] = s
        if diff := clock_difference(group[0].clocks, rec.clocks):
            raise _Error(f"{where}: clocks differ between sources records[{first}] and records[{s}]: {diff}.")
        a, b = group[0].params[m.param], rec.params[m.param]
        size = math.prod(a.shape)
        if set(b.buffers) != set(a.buffers):
            raise _Error(f"{where}: optional buffers differ between sources: records[{first}] has "
                         f"{sorted(a.buffers)}, records[{s}] has {sorted(b.buffers)}.")
        if tuple(b.shape) != tuple(a.shape):
            raise _Error(f"{where}: buffer structure differs: the parameter shape is {tuple(a.shape)} in "
                         f"records[{first}] but {tuple(b.shape)} in records[{s}].")
        for name, x in b.buffers.items():
            y = a.buffers[name]
            if x.dtype != y.dtype:
                raise _Error(f"{where}: buffer `{name}` dtype differs: {y.dtype} in records[{first}], {x.dtype} in "
                             f"records[{s}].")
            if x.shape != (slot_count(size, len(group)),):
                raise _Error(f"{where}: buffer structure differs: `{name}` in records[{s}] has shape {x.shape}, but a "
                             f"parameter of {size} elements on {len(group)} ranks has "
                             f"({slot_count(size, len(group))},).")
    return sorted(group, key=lambda rec: rec.rank)


def reshard_explicit(records: Sequence[RankRecord], migrations: Sequence[Migration]) -> dict[Hashable, RankRecord]:
    """Migrates parameters whose data-parallel groups differ, each from its own group of rank-local records.

    Per migration, the sources' histories are joined in rank order and the target rank's `ceil(size /
    target_world_size)` coordinates cut out (zero padded). Clocks are copied and must agree; nothing is summed.

    Args:
      records: the rank-local source records, e.g. `load_rank_records(dir)` of several checkpoints joined.
      migrations: one `Migration` per (parameter, target rank).

    Returns:
      `Migration.target` (default `target_rank`) -> new `RankRecord` holding the migrated slices; build them into
      a state on the new mesh with `zo.state_from_rank_records(target, result)`.

    Raises:
      ZeroCheckpointError: duplicate target ownership, a source lacking the parameter, a group whose size
        differs from the recorded world size, repeated source ranks, differing clocks or optional buffers,
        differing buffer structure or dtype, or an index out of range; each with its own message.

    Examples:
      >>> import numpy as np, zero_optax as zo
      >>> src = [zo.RankRecord(r, 2, {"w": zo.ParamSlice((3,), {"mu": np.arange(2.) + 2 * r})}) for r in range(2)]
      >>> out = zo.reshard_explicit(src, [zo.Migration("w", t, 3, sources=[0, 1]) for t in range(3)])
      >>> [out[t].params["w"].buffers["mu"].tolist() for t in range(3)]
      [[0.0], [1.0], [2.0]]
    """
    out: dict[Hashable, RankRecord] = {}
    first: dict[Hashable, int] = {}  # target -> the migration that created it
    owned: dict[tuple, int] = {}
    for i, m in enumerate(migrations):
        n, t = m.target_world_size, m.target_rank
        where = f"migrations[{i}] (`{m.param}`)"
        if not isinstance(n, (int, np.integer)) or n < 1 or not isinstance(t, (int, np.integer)) or not 0 <= t < n:
            raise _Error(f"{where}: target rank {t!r} is out of range for target world size {n!r}.")
        if not m.sources:
            raise _Error(f"{where}: no source records are named.")
        key = t if m.target is None else m.target
        for own in ((key, m.param), (m.param, tuple(sorted(m.sources)), t)):
            if own in owned:
                raise _Error(f"migrations[{owned[own]}] and migrations[{i}] both place `{m.param}` at target "
                             f"{key!r} (rank {t}): duplicate target ownership.")
            owned[own] = i
        if key in out and (out[key].rank, out[key].world_size) != (t, n):
            raise _Error(f"migrations[{first[key]}] puts target {key!r} at rank {out[key].rank} of "
                         f"{out[key].world_size}, but migrations[{i}] at rank {t} of {n}: one target record has one "
                         "placement.")
        group = _sources(where, m, records)
        if key in out and (diff := clock_difference(out[key].clocks, group[0].clocks)):
            raise _Error(f"migrations[{first[key]}] and migrations[{i}] fill target {key!r} from sources whose "
                         f"clocks differ: {diff}.")
        src = group[0].params[m.param]
        size = math.prod(src.shape)
        s_new = slot_count(size, n)
        buffers = {}
        for name in src.buffers:
            h = np.concatenate([rec.params[m.param].buffers[name] for rec in group])[:size][t * s_new:(t + 1) * s_new]
            buffers[name] = aligned_zeros(s_new, h.dtype)  # zero padded past the parameter's end
            buffers[name][:h.size] = h
        if key not in out:
            first[key] = i
            out[key] = RankRecord(t, n, {}, {c: np.array(v, copy=True) for c, v in group[0].clocks.items()})
        out[key].params[m.param] = ParamSlice(tuple(src.shape), buffers)  # type: ignore[index]
    return out


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
        assert e.leaf is not None  # (a history's entry)
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
    parts = _arrays.split(target, "The target")
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
    return _arrays.put_back(target, parts, [_arrays.rebuild(state, arrays)])
