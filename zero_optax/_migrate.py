"""Rank-local records: migrating parameters whose data-parallel groups differ, exactly, with numpy only.

A `RankRecord` is what one device of one data-parallel group holds of one zero1 state: a `ParamSlice` of
coordinate histories per parameter plus the shared clocks. `reshard_explicit` re-slices each parameter from its
own group of source records (one per old rank) to a target rank of a new group, as `Migration`s name them, so
tensor-parallel or expert parameters whose groups differ can be moved together. `load_rank_records` reads such
records from a flat zero1 checkpoint item directory; `zero_optax._reshard.reshard` converts whole directories.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from zero_optax import _reshard, _store
from zero_optax._errors import ZeroCheckpointError as _Error
from zero_optax._layout import FLAT


@dataclasses.dataclass(frozen=True)
class ParamSlice:
    """One parameter's coordinate histories on one device of its data-parallel group.

    Attributes:
      shape: the full parameter shape.
      buffers: history name (for zero1 states, the inner-state entry path such as `"[0].mu['w']"`) -> 1-D numpy
        array of this rank's `ceil(size / world_size)` coordinates, zero-padded at the tail, in its own dtype.
        Empty for a parameter without history (frozen or never updated).
    """

    shape: tuple[int, ...]
    buffers: Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """The rank-local record of one device in one data-parallel group (one zero1 state on one device).

    Attributes:
      rank: this device's index in the group, in `[0, world_size)`.
      world_size: the size of the group the record was saved in.
      params: parameter id -> its `ParamSlice` on this rank.
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
      target: the output record this slice is placed into; defaults to `target_rank`, which is enough when all
        migrated parameters share one data-parallel group. Give distinct labels (e.g. `("tp1", 0)`) when
        tensor-parallel or expert groups reuse rank numbers.
    """

    param: str
    target_rank: int
    target_world_size: int
    sources: Sequence[int]
    target: Hashable | None = None


def load_rank_records(directory: str | os.PathLike, state: int = 0) -> list[RankRecord]:
    """The rank-local records (one per device row) of flat zero1 state `state` in an item directory.

    Parameters are keyed by their leaf path, buffers by their entry path, clocks by the shared entries' paths.
    Loads the whole state into memory; `reshard` streams instead.
    """
    src = os.path.abspath(os.fspath(directory))
    _, layouts = _reshard.load_states(src)
    if not 0 <= state < len(layouts):
        raise _Error(f"`state` {state} is out of range: {src} holds {len(layouts)} zero1 states.")
    layout = layouts[state]
    if layout.partition != FLAT:
        raise _Error(f"state {state} of {src} uses the leaf partition; move whole leaves with reshard(..., owners=).")
    clocks = {layout.entries[j].path: v for j, v in _reshard.shared_values(src, layout, state).items()}
    rows = {j: _store.read(_reshard.array_dir(src, f"{state}.entry{j:04d}"))
            for j, e in enumerate(layout.entries) if e.leaf is not None}
    return [RankRecord(r, layout.world_size, {
        x.path: ParamSlice(x.shape, {layout.entries[j].path: rows[j][r] for j in rows
                                     if layout.entries[j].leaf == i}) for i, x in enumerate(layout.leaves)},
        dict(clocks)) for r in range(layout.world_size)]


def _clock_difference(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> str | None:
    if set(a) != set(b):
        return f"clocks {sorted(a)} vs {sorted(b)}"
    for name in sorted(a):
        x, y = np.asarray(a[name]), np.asarray(b[name])
        if not _reshard.same(x, y):
            return f"clock `{name}` is {_reshard.show(x)} vs {_reshard.show(y)}"
    return None


def _check_group(i: int, m: Migration, records: Sequence[RankRecord]) -> list[RankRecord]:
    """The sources of migration `i` sorted by rank, after every check that concerns them."""
    where = f"migrations[{i}] (`{m.param}`)"
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
        diff = _clock_difference(group[0].clocks, rec.clocks)
        if diff:
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
            if x.shape != (-(-size // len(group)),):
                raise _Error(f"{where}: buffer structure differs: `{name}` in records[{s}] has shape {x.shape}, but a "
                             f"parameter of {size} elements on {len(group)} ranks has ({-(-size // len(group))},).")
    return sorted(group, key=lambda rec: rec.rank)


def reshard_explicit(records: Sequence[RankRecord], migrations: Sequence[Migration]) -> dict[Hashable, RankRecord]:
    """Migrates parameters whose data-parallel groups differ, each from its own group of rank-local records.

    For every migration the source records (one per old rank) are concatenated in rank order, the padding is
    dropped and the target rank's `ceil(size / target_world_size)` coordinates are cut out (zero padded).
    Clocks are copied and must agree between all sources of a target; nothing is replayed or summed.

    Args:
      records: the rank-local source records, e.g. `load_rank_records(dir)` of several checkpoints joined.
      migrations: one `Migration` per (parameter, target rank).

    Returns:
      `Migration.target` (default `target_rank`) -> new `RankRecord` holding the migrated slices.

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
    placed: dict[Hashable, tuple[int, int, int]] = {}  # target -> (rank, world size, migration index)
    owned: dict[tuple, int] = {}
    for i, m in enumerate(migrations):
        n, t = m.target_world_size, m.target_rank
        if not isinstance(n, (int, np.integer)) or n < 1 or not isinstance(t, (int, np.integer)) or not 0 <= t < n:
            raise _Error(f"migrations[{i}] (`{m.param}`): target rank {t!r} is out of range for target world size "
                         f"{n!r}.")
        if not m.sources:
            raise _Error(f"migrations[{i}] (`{m.param}`): no source records are named.")
        key = t if m.target is None else m.target
        for own in ((key, m.param), (m.param, tuple(sorted(m.sources)), t)):
            if own in owned:
                raise _Error(f"migrations[{owned[own]}] and migrations[{i}] both place `{m.param}` at target "
                             f"{key!r} (rank {t}): duplicate target ownership.")
            owned[own] = i
        if key in placed and placed[key][:2] != (t, n):
            r0, n0, j = placed[key]
            raise _Error(f"migrations[{j}] puts target {key!r} at rank {r0} of {n0}, but migrations[{i}] at rank {t} "
                         f"of {n}: one target record has one placement.")
        group = _check_group(i, m, records)
        if key in out and (diff := _clock_difference(out[key].clocks, group[0].clocks)):
            raise _Error(f"migrations[{placed[key][2]}] and migrations[{i}] fill target {key!r} from sources whose "
                         f"clocks differ: {diff}.")
        src = group[0].params[m.param]
        size, s_old, s_new = math.prod(src.shape), -(-math.prod(src.shape) // len(group)), -(-math.prod(src.shape) // n)
        buffers = {name: _reshard.recut(np.zeros(s_new, first.dtype), min(t * s_new, size), min((t + 1) * s_new, size),
                                        s_old, lambda r, lo, hi, name=name: group[r].params[m.param].buffers[name][lo:hi])
                   for name, first in src.buffers.items()}
        if key not in out:
            placed[key] = (t, n, i)
            out[key] = RankRecord(t, n, {}, {c: np.array(v, copy=True) for c, v in group[0].clocks.items()})
        out[key].params[m.param] = ParamSlice(tuple(src.shape), buffers)  # type: ignore[index]
    return out
