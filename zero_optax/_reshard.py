"""Offline resharding of zero1 checkpoints to another world size, exactly, with numpy and `_store` only.

Flat states are re-sliced coordinate by coordinate: the old rows of each history are concatenated, the padding
is dropped and the result is cut again for the new world size (new padding is zero). Leaf states move each
leaf's complete state from its old owner's row to its new owner's. Shared entries (step counts) are copied
after checking that every source row agrees. Nothing is replayed or summed, so a restored run continues exactly.

`reshard` streams one chunk of one array at a time and writes into a temporary sibling directory that is
renamed into place at the end. The source checks and the re-slicing helpers here are shared with
`zero_optax._migrate`, which migrates rank-local records whose data-parallel groups differ per parameter.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, so np.dtype("bfloat16") works)
import numpy as np

from zero_optax import _owners, _record, _store
from zero_optax._errors import ZeroCheckpointError as _Error
from zero_optax._layout import FLAT, LEAF, Layout

Progress = Callable[[int, int], None]
"""`progress(done_bytes, total_bytes)`, called after every chunk written (bytes of the new checkpoint)."""


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality, so NaN clocks compare equal to themselves and -0.0 differs from 0.0."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def show(x: np.ndarray) -> str:
    """A short text form of a value, for error messages."""
    return str(x.item() if x.size == 1 else x.tolist())


def recut(out: np.ndarray, start: int, stop: int, slots: int, read: Callable[[int, int, int], Any]) -> np.ndarray:
    """Fills `out` with coordinates `[start, stop)` of a history kept as rows of `slots`; `read(row, lo, hi)`."""
    at = 0
    while start < stop:
        row, lo = divmod(start, slots)
        hi = min(slots, lo + stop - start)
        out[at:at + hi - lo] = read(row, lo, hi)
        at, start = at + hi - lo, start + hi - lo
    return out


# ------------------------------------------------------------------------------------------------ source checks


def load_states(src: str) -> tuple[dict[str, Any], list[Layout]]:
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
                _store.validate_array(array_dir(src, a["name"]), a["shape"], a["dtype"])
            except _store.StoreError as e:
                raise _Error(f"{src} is damaged: {e}") from None
        layouts.append(layout)
    if not layouts:
        raise _Error(f"{src}: the record holds no zero1 state.")
    return rec, layouts


def array_dir(root: str, name: str) -> str:
    """The directory of array `name` in item directory `root`."""
    return os.path.join(root, _record.ARRAYS_DIR, name)


def shared_values(src: str, layout: Layout, k: int) -> dict[int, np.ndarray]:
    """Entry index -> value of every shared entry, checked to agree on every source row."""
    values = {}
    for j, e in enumerate(layout.entries):
        if e.leaf is not None:
            continue
        if layout.partition == FLAT:
            rows = list(_store.read(array_dir(src, f"{k}.entry{j:04d}")))
        else:
            rows = []
            for r, offsets in enumerate(layout.state_packing.offsets):
                d, off = offsets[j]
                flat = _store.read(array_dir(src, f"{k}.buffer_{d}"), (r, slice(off, off + e.size)))
                rows.append(flat.reshape(e.shape))
        for r, row in enumerate(rows):
            if not same(row, rows[0]):
                raise _Error(f"{src}: shared entry `{e.path}` of state {k} differs between source rows: row 0 holds "
                             f"{show(rows[0])}, row {r} holds {show(row)}; the checkpoint is inconsistent.")
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
        owners = _owners.owners_for_entries(old.entries, len(old.leaves), n)
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


def _write(path: str, shape: tuple[int, ...], dtype: str, fill: Callable[[int, int, int], np.ndarray],
           tick: Callable[[int], None]) -> None:
    """Creates a `[rows, width]` array and writes it one chunk at a time; `fill(t, a, b)` is row t's `[a, b)`."""
    out = _store.create_array(path, shape, dtype)
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
            _store.write_array(array_dir(tmp, name), np.broadcast_to(shared[j], (new.world_size, *e.shape)))
            tick(shared[j].nbytes * new.world_size)
            continue
        size, s_old, s_new = old.leaves[e.leaf].size, e_old.shape[0], e.shape[0]
        source = _store.open_array(array_dir(src, name))

        def fill(t: int, a: int, b: int, source=source, size=size, s_old=s_old, s_new=s_new, dtype=e.dtype):
            out = np.zeros(b - a, np.dtype(dtype))  # coordinates past `size` stay zero: the new padding
            return recut(out, min(t * s_new + a, size), min(t * s_new + b, size), s_old,
                          lambda r, lo, hi: source[r, lo:hi].read().result())

        _write(array_dir(tmp, name), (new.world_size, s_new), e.dtype, fill, tick)


def _write_leaf(src: str, tmp: str, k: int, old: Layout, new: Layout, shared: dict[int, np.ndarray],
                tick: Callable[[int], None]) -> None:
    p_old, p_new = old.state_packing, new.state_packing
    sources = {d: _store.open_array(array_dir(src, f"{k}.buffer_{d}")) for d in p_old.sizes}
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

        _write(array_dir(tmp, f"{k}.buffer_{d}"), (new.world_size, size), d, fill, tick)


def _install(tmp: str, dst: str, force: bool) -> None:
    """Renames `tmp` to `dst`; an existing `dst` (only with `force`) is moved aside first, then deleted.

    Everything in `tmp` is flushed to stable storage before the rename, and the parent directory after it, so a
    power loss never leaves a `dst` with missing or incomplete files.
    """
    _store.fsync_tree(tmp)
    if not os.path.lexists(dst):
        os.replace(tmp, dst)
        _store.fsync_path(os.path.dirname(dst))
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
    _store.fsync_path(os.path.dirname(dst))
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
    rec, layouts = load_states(src)
    per_state = _owners_per_state(owners, layouts)
    shared = [shared_values(src, x, k) for k, x in enumerate(layouts)]
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
