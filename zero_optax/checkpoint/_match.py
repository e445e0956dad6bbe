"""Whether a saved zero1 state can be restored into a target state, and the first difference if not.

A plain restore needs the saved layout itself (world size, owners, slots, packing). A restore onto another mesh
(`reshard=True`) needs only what resharding keeps: the partition, the leaves' paths, dtypes, kinds and logical
shapes, the inner-state tree, the entries and the master dtype.

Examples:
  >>> from zero_optax.checkpoint import _match
  >>> _match.first_difference({"world_size": 8, "owners": [0]}, {"world_size": 8, "owners": [1]}, "state 0",
  ...                         ("owners",))
  'state 0: owners[0] is 0 in the checkpoint but 1 in the target.'
"""

from __future__ import annotations

from typing import Any

from zero_optax.checkpoint import _record, _regions
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._stored import AUTO, StoredLayout, StoredViews

PLAIN_KEYS = ("partition", "owners", "leaves", "state_tree", "entries", "master_dtype", "mesh_axes", "arrays",
              "packing")
RESHARD_KEYS = ("partition", "leaves", "state_tree", "entries", "master_dtype")
_PER_MESH = ("slots", "owner", "group")
"""Leaf fields that resharding changes; a sliced leaf's `_BLOCKS` too (`_regions`)."""
_BLOCKS = ("shape", "axes", "blocks", "dims")


def first_difference(saved: dict[str, Any], target: dict[str, Any], where: str, keys) -> str | None:
    """A sentence naming the first of `keys` whose value differs between two records, or None."""
    for key in keys:
        a, b = saved.get(key), target.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                return f"{where}: {key} has {len(a)} items in the checkpoint but {len(b)} in the target."
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    return (f"{where}: {key}[{i}] is {_record.short(x)} in the checkpoint but {_record.short(y)} in "
                            "the target.")
        return f"{where}: {key} is {_record.short(a)} in the checkpoint but {_record.short(b)} in the target."
    return None


def _invariant(rec: dict[str, Any], sliced: list[bool], blocked: list[bool]) -> dict[str, Any]:
    """The parts of a state record that resharding keeps. Leaves `blocked` (sliced, or owned in tensor-parallel
    blocks, on either side) may change blocks; entries of leaves `sliced` on either side may change shape."""
    leaves = [{k: v for k, v in x.items() if k not in _PER_MESH + (_BLOCKS if s else ())}
              for x, s in zip(rec["leaves"], blocked)]
    entries = [dict(e, shape=None) if e["leaf"] is not None and sliced[e["leaf"]] else e for e in rec["entries"]]
    return dict(rec, leaves=leaves, entries=entries)


def check(saved_layout: StoredLayout, target: StoredViews, k: int, where: str, reshard: bool) -> None:
    """Refuses, naming the first difference, a saved state `k` that cannot be restored into layout `target`."""
    if not reshard and saved_layout.world_size != target.world_size:
        m = target.world_size
        raise ZeroCheckpointError(
            f"{where} was saved with world size {saved_layout.world_size}, but the target state has {m} devices. "
            f"Restore it with zo.ZeroRestore(target, reshard=True), or convert the checkpoint first with "
            f"zo.reshard(src, dst, world_size={m}) (`python -m zero_optax.reshard SRC DST --world-size {m}`; "
            f"zero_optax.reshard).")
    difference = partition_difference(saved_layout, target, where, reshard)
    if difference is None and not reshard:
        difference = plain_difference(saved_layout, target, k, where)
    elif difference is None:
        sliced = [x.sliced or y.sliced for x, y in zip(saved_layout.leaves, target.leaves)]
        blocked = [s or x.tp_owned or y.tp_owned for s, x, y in zip(sliced, saved_layout.leaves, target.leaves)]
        a, b = _record.state_record(saved_layout, k), _record.state_record(target, k)
        difference = first_difference(_invariant(a, sliced, blocked), _invariant(b, sliced, blocked), where,
                                      RESHARD_KEYS)
    if difference is not None:
        raise ZeroCheckpointError(difference)
    if reshard:
        _regions.recuts(saved_layout, target, where)  # refuses a leaf whose logical shape changed


def plain_difference(saved: StoredViews, target: StoredViews, k: int, where: str) -> str | None:
    """The first difference between the records of two layouts of state `k` that a plain restore cannot bridge."""
    return first_difference(_record.state_record(saved, k), _record.state_record(target, k), where, PLAIN_KEYS)


def partition_difference(saved: StoredViews, target: StoredViews, where: str, reshard: bool = False) -> str | None:
    """A sentence naming how the partition differs (itself, or a leaf sliced in one and owned in the other) and
    what to do; None if it does not. With `reshard`, a leaf `"auto"` slices on one mesh and owns on the other is no
    difference when its state is a history per coordinate in both."""
    fix = ("Resharding moves a state between meshes, not between partitions: build the target with the "
           "checkpoint's zero1 settings, or move the state through plain optax (restore it on its own mesh, "
           "`zo.gather_state`, then `zo.scatter_state` with the new zero1).")
    if saved.partition != target.partition:
        return (f"{where} was saved with partition={saved.partition!r}, but the target uses "
                f"partition={target.partition!r}. {fix}")
    for i, (old, new) in enumerate(zip(saved.leaves, target.leaves)):
        if old.sliced == new.sliced or old.path != new.path:
            continue
        owned, layout = (new, target) if old.sliced else (old, saved)
        per_coordinate = all(e.shape == layout.whole_shape(owned) for e in layout.entries if e.leaf == i)
        if saved.partition == AUTO and per_coordinate:
            if reshard:
                continue
            fix = "Restore it with zo.ZeroRestore(target, reshard=True), which moves such a leaf's history."
        how = {True: "sliced (every device holds a slice of its history)",
               False: "owned (one device holds its whole state)"}
        return (f"{where}: leaf `{old.path}` is {how[old.sliced]} in the checkpoint but {how[new.sliced]} in "
                f"the target (partition={target.partition!r} chose differently, or the target's optimizer "
                f"differs). {fix}")
    return None
