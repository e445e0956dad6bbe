"""Offline resharding of zero1 checkpoints to another world size, exactly, with numpy and `_store` only.

Flat states are re-sliced coordinate by coordinate: the old rows of each history are concatenated, the padding
is dropped and the result is cut again for the new world size (new padding is zero). Leaf states move each
leaf's complete state from its old owner's row to its new owner's. Shared entries (step counts) are copied
after checking that every source row agrees. Nothing is replayed or summed, so a restored run continues exactly.

`reshard` streams one chunk of one array at a time and writes into a temporary sibling directory that is
renamed into place at the end. `reshard_explicit` migrates rank-local records whose data-parallel groups differ
per parameter (tensor-parallel or expert parameters).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, so np.dtype("bfloat16") works)
import numpy as np

from zero_optax import _owners, _record, _store
from zero_optax._errors import ZeroCheckpointError as _Error
from zero_optax._layout import FLAT, LEAF, Layout

Progress = Callable[[int, int], None]
"""`progress(done_bytes, total_bytes)`, called after every chunk written (bytes of the new checkpoint)."""


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality, so NaN clocks compare equal to themselves and -0.0 differs from 0.0."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _show(x: np.ndarray) -> str:
    return str(x.item() if x.size == 1 else x.tolist())


def _recut(out: np.ndarray, start: int, stop: int, slots: int, read: Callable[[int, int, int], Any]) -> np.ndarray:
    """Fills `out` with coordinates `[start, stop)` of a history kept as rows of `slots`; `read(row, lo, hi)`."""
    at = 0
    while start < stop:
        row, lo = divmod(start, slots)
        hi = min(slots, lo + stop - start)
        out[at:at + hi - lo] = read(row, lo, hi)
        at, start = at + hi - lo, start + hi - lo
    return out


# ------------------------------------------------------------------------------------------------ source checks


def _load_states(src: str) -> tuple[dict[str, Any], list[Layout]]:
    """The record of `src` and one layout per state, after validating every array it names."""
    if not os.path.isdir(src):
        raise _Error(f"{src} is not a zero_optax checkpoint: no such directory.")
    rec = _record.read_record(src)
    if not isinstance(rec.get("tree"), str):
        raise _Error(f"{src}: the record has no `tree`; the record is damaged.")
    layouts = []
    for k, state in enumerate(rec.get("states") or []):
        try:
            layout = _record.layout_from_record(state)
            expected = _record.array_names(layout, k)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise _Error(f"{src}: the record of state {k} is damaged ({type(e).__name__}: {e}).") from None
        if layout.partition not in (FLAT, LEAF):
            raise _Error(f"{src}: state {k} has unknown partition {layout.partition!r}.")
        if state.get("arrays") != expected:
            raise _Error(f"{src}: the arrays listed for state {k} do not match its layout; the record is damaged.")
        if layout.partition == LEAF and state.get("packing") != _record.layout_record(layout, k)["packing"]:
            raise _Error(f"{src}: the packing recorded for state {k} does not match its owners; the record is damaged.")
        for a in expected:
            try:
                _store.validate_array(_array_dir(src, a["name"]), a["shape"], a["dtype"])
            except _store.StoreError as e:
                raise _Error(f"{src} is damaged: {e}") from None
        layouts.append(layout)
    if not layouts:
        raise _Error(f"{src}: the record holds no zero1 state.")
    return rec, layouts


def _array_dir(root: str, name: str) -> str:
    return os.path.join(root, _record.ARRAYS_DIR, name)


def _shared_values(src: str, layout: Layout, k: int) -> dict[int, np.ndarray]:
    """Entry index -> value of every shared entry, checked to agree on every source row."""
    values = {}
    for j, e in enumerate(layout.entries):
        if e.leaf is not None:
            continue
        if layout.partition == FLAT:
            rows = list(_store.read(_array_dir(src, f"{k}.entry{j:04d}")))
        else:
            rows = []
            for r, offsets in enumerate(layout.state_packing.offsets):
                d, off = offsets[j]
                flat = _store.read(_array_dir(src, f"{k}.buffer_{d}"), (r, slice(off, off + e.size)))
                rows.append(flat.reshape(e.shape))
        for r, row in enumerate(rows):
            if not _same(row, rows[0]):
                raise _Error(f"{src}: shared entry `{e.path}` of state {k} differs between source rows: row 0 holds "
                             f"{_show(rows[0])}, row {r} holds {_show(row)}; the checkpoint is inconsistent.")
        values[j] = rows[0]
    return values


# ------------------------------------------------------------------------------------------------ new layouts


def _flat_layout(old: Layout, n: int) -> Layout:
    leaves = tuple(dataclasses.replace(x, slots=-(-x.size // n)) for x in old.leaves)
    entries = tuple(e if e.leaf is None else dataclasses.replace(e, shape=(leaves[e.leaf].slots,))
                    for e in old.entries)
    return dataclasses.replace(old, world_size=n, leaves=leaves, entries=entries)


def _leaf_layout(old: Layout, n: int, owners: Sequence[int] | None) -> Layout:
    if owners is None:
        costs = [0] * len(old.leaves)
        for e in old.entries:
            if e.leaf is not None:
                costs[e.leaf] += e.nbytes
        owners = _owners._greedy(costs, n)  # pylint: disable=protected-access
    owners = _owners.check_owners(owners, len(old.leaves), n, old.paths)
    leaves = tuple(dataclasses.replace(x, owner=o) for x, o in zip(old.leaves, owners))
    return dataclasses.replace(old, world_size=n, leaves=leaves)


def _owners_per_state(owners: Any, layouts: list[Layout]) -> list[Sequence[int] | None]:
    """`owners` (None, one list for the only leaf state, or one item per state) as one item per state."""
    leaf_states = [k for k, x in enumerate(layouts) if x.partition == LEAF]
    if owners is not None and all(isinstance(o, (int, np.integer)) for o in owners):
        if len(leaf_states) != 1:
            raise _Error(f"`owners` is one list, but the checkpoint has {len(leaf_states)} leaf-partition states; "
                         "give one item (a list or None) per state.")
        owners = [owners if k == leaf_states[0] else None for k in range(len(layouts))]
    owners = [None] * len(layouts) if owners is None else list(owners)
    if len(owners) != len(layouts):
        raise _Error(f"`owners` has {len(owners)} items, but the checkpoint has {len(layouts)} zero1 states.")
    for k, o in enumerate(owners):
        if o is not None and layouts[k].partition != LEAF:
            raise _Error(f"`owners[{k}]` is given, but state {k} uses the flat partition, which has no owners.")
    return owners


# ------------------------------------------------------------------------------------------------ writing


def _open_old(path: str):
    return _store._open(path, open=True, read=True)  # pylint: disable=protected-access


def _write(path: str, shape: tuple[int, ...], dtype: str, fill: Callable[[int, int, int], np.ndarray],
           tick: Callable[[int], None]) -> None:
    """Creates a `[rows, width]` array and writes it one chunk at a time; `fill(t, a, b)` is row t's `[a, b)`."""
    out = _store._open(path, create=True, metadata=_store.array_spec(shape, dtype))  # pylint: disable=protected-access
    step = _store.array_spec(shape, dtype)["chunks"][1]
    for t in range(shape[0]):
        for a in range(0, shape[1], step):
            b = min(a + step, shape[1])
            out[t, a:b].write(fill(t, a, b)).result()
            tick((b - a) * np.dtype(dtype).itemsize)


def _write_flat(src: str, tmp: str, k: int, old: Layout, new: Layout, shared: dict[int, np.ndarray],
                tick: Callable[[int], None]) -> None:
    for j, (e_old, e) in enumerate(zip(old.entries, new.entries)):
        name = f"{k}.entry{j:04d}"
        if e.leaf is None:  # small: written whole
            _store.write_array(_array_dir(tmp, name), np.broadcast_to(shared[j], (new.world_size, *e.shape)))
            tick(shared[j].nbytes * new.world_size)
            continue
        size, s_old, s_new = old.leaves[e.leaf].size, e_old.shape[0], e.shape[0]
        source = _open_old(_array_dir(src, name))

        def fill(t: int, a: int, b: int, source=source, size=size, s_old=s_old, s_new=s_new, dtype=e.dtype):
            out = np.zeros(b - a, np.dtype(dtype))  # coordinates past `size` stay zero: the new padding
            return _recut(out, min(t * s_new + a, size), min(t * s_new + b, size), s_old,
                          lambda r, lo, hi: source[r, lo:hi].read().result())

        _write(_array_dir(tmp, name), (new.world_size, s_new), e.dtype, fill, tick)


def _write_leaf(src: str, tmp: str, k: int, old: Layout, new: Layout, shared: dict[int, np.ndarray],
                tick: Callable[[int], None]) -> None:
    p_old, p_new = old.state_packing, new.state_packing
    sources = {d: _open_old(_array_dir(src, f"{k}.buffer_{d}")) for d in p_old.sizes}
    for d, size in p_new.sizes.items():
        def fill(t: int, a: int, b: int, d=d):
            out = np.zeros(b - a, np.dtype(d))
            for j, (dj, off) in p_new.offsets[t].items():
                e = new.entries[j]
                lo, hi = max(off, a), min(off + e.size, b)
                if dj != d or lo >= hi:
                    continue
                if e.leaf is None:
                    out[lo - a:hi - a] = shared[j].reshape(-1)[lo - off:hi - off]
                else:  # the leaf's complete state, from its old owner's row
                    owner = old.leaves[e.leaf].owner
                    _, at = p_old.offsets[owner][j]
                    out[lo - a:hi - a] = sources[d][owner, at + lo - off:at + hi - off].read().result()
            return out

        _write(_array_dir(tmp, f"{k}.buffer_{d}"), (new.world_size, size), d, fill, tick)


def _install(tmp: str, dst: str, force: bool) -> None:
    """Renames `tmp` to `dst`; an existing `dst` (only with `force`) is moved aside first, then deleted."""
    if not os.path.lexists(dst):
        os.replace(tmp, dst)
        return
    if not force:
        raise _Error(f"{dst} already exists; pass force=True (--force) to replace it.")
    aside = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.replaced-{os.getpid()}")
    os.replace(dst, aside)
    try:
        os.replace(tmp, dst)
    except OSError:
        os.replace(aside, dst)
        raise
    shutil.rmtree(aside) if os.path.isdir(aside) and not os.path.islink(aside) else os.remove(aside)


def reshard(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, world_size: int, *,
            owners: Sequence[int] | Sequence[Sequence[int] | None] | None = None, force: bool = False,
            progress: Progress | None = None) -> None:
    """Converts a zero1 checkpoint item directory to another data-parallel world size, exactly.

    Flat states: every coordinate history is concatenated over the old rows, stripped of padding and cut again
    into `ceil(size / world_size)` slots per row (zero padding); `slots` is updated in the record. Leaf states:
    each leaf's complete state moves to its new owner (`owners`, else balanced by state bytes the way
    `zero1(partition="leaf")` balances them) and the buffers are packed anew. Shared entries (step counts) are
    copied unchanged after checking that all old rows agree. Dtypes (f32, bf16, f16 ...) are kept.

    Every source array is validated before anything is written. The output is written into a temporary sibling
    of `dst_dir` and renamed into place, so `dst_dir` appears complete or not at all. Arrays are copied one
    storage chunk (at most 4 Mi elements) at a time, so peak memory does not grow with the checkpoint or leaf size.

    Args:
      src_dir: an item directory written by `ZeroSave` (or by `reshard`).
      dst_dir: where to write the converted item directory.
      world_size: the new number of devices on each state's data axis.
      owners: leaf partition only: one device index per leaf of the checkpoint's only leaf state, or one item
        (a list or None) per zero1 state. None balances.
      force: replace an existing `dst_dir`.
      progress: optional `progress(done_bytes, total_bytes)` callback.

    Raises:
      ZeroCheckpointError: `src_dir` is not a complete zero1 checkpoint of a known version, its shared entries
        differ between rows, `dst_dir` exists without `force`, or the arguments are invalid.

    Examples:
      >>> import zero_optax as zo
      >>> zo.reshard("ckpt/100/opt_state", "ckpt3/100/opt_state", world_size=3)  # doctest: +SKIP
    """
    src, dst = os.path.abspath(os.fspath(src_dir)), os.path.abspath(os.fspath(dst_dir))
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise _Error(f"`world_size` must be a positive int, got {world_size!r}.")
    if os.path.lexists(dst) and not force:
        raise _Error(f"{dst} already exists; pass force=True (--force) to replace it.")
    rec, layouts = _load_states(src)
    per_state = _owners_per_state(owners, layouts)
    shared = [_shared_values(src, x, k) for k, x in enumerate(layouts)]
    new = [_flat_layout(x, int(world_size)) if x.partition == FLAT else _leaf_layout(x, int(world_size), o)
           for x, o in zip(layouts, per_state)]
    total = sum(math.prod(a["shape"]) * np.dtype(a["dtype"]).itemsize
                for k, x in enumerate(new) for a in _record.array_names(x, k))
    done = 0

    def tick(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.reshard-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(os.path.join(tmp, _record.ARRAYS_DIR))
        states = []
        for k, (old, lay) in enumerate(zip(layouts, new)):
            (_write_flat if old.partition == FLAT else _write_leaf)(src, tmp, k, old, lay, shared[k], tick)
            states.append({**rec["states"][k], **_record.layout_record(lay, k, rec["states"][k].get("clocks"))})
        _record.write_record(tmp, {**rec, **_record.new_record(rec["tree"], states)})
        _install(tmp, dst, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ rank-local records


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
    rec, layouts = _load_states(src)
    if not 0 <= state < len(layouts):
        raise _Error(f"`state` {state} is out of range: {src} holds {len(layouts)} zero1 states.")
    layout = layouts[state]
    if layout.partition != FLAT:
        raise _Error(f"state {state} of {src} uses the leaf partition; move whole leaves with reshard(..., owners=).")
    clocks = {layout.entries[j].path: v for j, v in _shared_values(src, layout, state).items()}
    rows = {j: _store.read(_array_dir(src, f"{state}.entry{j:04d}"))
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
        if not _same(x, y):
            return f"clock `{name}` is {_show(x)} vs {_show(y)}"
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
        buffers = {name: _recut(np.zeros(s_new, first.dtype), min(t * s_new, size), min((t + 1) * s_new, size),
                                s_old, lambda r, lo, hi, name=name: group[r].params[m.param].buffers[name][lo:hi])
                   for name, first in src.buffers.items()}
        if key not in out:
            placed[key] = (t, n, i)
            out[key] = RankRecord(t, n, {}, {c: np.array(v, copy=True) for c, v in group[0].clocks.items()})
        out[key].params[m.param] = ParamSlice(tuple(src.shape), buffers)  # type: ignore[index]
    return out
