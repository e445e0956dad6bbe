"""Rank-local records of zero1 states: read from a checkpoint, and migrated between data-parallel groups.

`reshard_explicit` moves each parameter from its own group of records to a new one, exactly, with numpy only, so
that parameters whose groups differ (tensor-parallel, expert) move together.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from zero_optax.checkpoint import _regions, _offline
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError as _Error
from zero_optax.layout._stored import slot_count


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


def load_rank_records(directory: str | os.PathLike, state: int = 0) -> list[RankRecord]:
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
    for s, rec in zip(m.sources, group):
        if m.param not in rec.params:
            raise _Error(f"{where}: source records[{s}] (rank {rec.rank}) lacks the parameter.")
        if rec.world_size != len(group):
            raise _Error(f"{where}: the source group has {len(group)} records, but records[{s}] was saved with "
                         f"world size {rec.world_size}; name exactly one record per rank of that group.")
        if not 0 <= rec.rank < rec.world_size:
            raise _Error(f"{where}: records[{s}] has rank {rec.rank}, out of range for world size {rec.world_size}.")
    seen: dict[int, int] = {}
    for s, rec in zip(m.sources, group):
        if rec.rank in seen:
            raise _Error(f"{where}: records[{seen[rec.rank]}] and records[{s}] both hold rank {rec.rank}: repeated "
                         "source ranks.")
        seen[rec.rank] = s
    first, a = m.sources[0], group[0].params[m.param]
    size = math.prod(a.shape)
    for s, rec in zip(m.sources, group):
        if diff := clock_difference(group[0].clocks, rec.clocks):
            raise _Error(f"{where}: clocks differ between sources records[{first}] and records[{s}]: {diff}.")
        b = rec.params[m.param]
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
            h = np.concatenate([rec.params[m.param].buffers[name] for rec in group])
            buffers[name] = _regions.recut(lambda lo, hi, h=h: h[lo:hi], size, t * s_new, (t + 1) * s_new, h.dtype)
        if key not in out:
            first[key] = i
            out[key] = RankRecord(t, n, {}, {c: np.array(v, copy=True) for c, v in group[0].clocks.items()})
        out[key].params[m.param] = ParamSlice(tuple(src.shape), buffers)  # type: ignore[index]
    return out
