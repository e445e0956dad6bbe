"""Whether a saved zero1 state can be restored into a target state, and the first difference if not.

A plain restore (`reshard=False`) needs the target's layout to be the saved one: the same world size, owners,
slots and packing. A restore onto another mesh (`reshard=True`) needs only what resharding keeps: the same
partition, parameter leaves (paths, dtypes, which are sliced or owned, and each leaf's logical shape: a sliced
leaf's blocks may be cut anew over tensor-parallel or expert axes of other sizes, `zero_optax.checkpoint._tp_blocks`),
inner-state tree and entries (paths, leaves, dtypes, roles, and shapes where they do not depend on the mesh) and
master dtype. The world size, the other mesh axes, owners and slots may change.

Examples:
  >>> from zero_optax.checkpoint import _match
  >>> _match.first_difference({"world_size": 8, "owners": [0]}, {"world_size": 8, "owners": [1]}, "state 0",
  ...                         ("owners",))
  'state 0: owners[0] is 0 in the checkpoint but 1 in the target.'
"""

from __future__ import annotations

from typing import Any

from zero_optax.checkpoint import _tp_blocks, _record
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._layout import AUTO, Layout, StoredLayout

PLAIN_KEYS = ("partition", "owners", "leaves", "state_tree", "entries", "master_dtype", "mesh_axes", "arrays",
              "packing")
RESHARD_KEYS = ("partition", "leaves", "state_tree", "entries", "master_dtype")
_PER_MESH = ("slots", "owner", "group")
"""Leaf fields that resharding changes; a sliced leaf's `_BLOCKS` too (`zero_optax.checkpoint._tp_blocks`)."""
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
    """The parts of a state record that resharding keeps, `sliced` saying which leaves are sliced on either side,
    `blocked` which are sliced or cut into blocks of a whole owned tensor (`ParamLeaf.dims`) on either side: their
    blocks may change, their entries' whole shapes may not (`partition_difference` checks the rest)."""
    leaves = [{k: v for k, v in x.items() if k not in _PER_MESH + (_BLOCKS if s else ())}
              for x, s in zip(rec["leaves"], blocked)]
    entries = [dict(e, shape=None) if e["leaf"] is not None and sliced[e["leaf"]] else e for e in rec["entries"]]
    return dict(rec, leaves=leaves, entries=entries)


def check(saved_layout: StoredLayout, target: Layout, k: int, where: str, reshard: bool) -> None:
    """Raises `ZeroCheckpointError` naming the first way zero1 state `k` of a checkpoint cannot be restored into
    a state with layout `target`."""
    a, b = _record.state_record(saved_layout, k), _record.state_record(target, k)
    if not reshard:
        if saved_layout.world_size != target.world_size:
            m = target.world_size
            raise ZeroCheckpointError(
                f"{where} was saved with world size {saved_layout.world_size}, but the target state has {m} devices. "
                f"Restore it with zo.ZeroRestore(target, reshard=True), or convert the checkpoint first with "
                f"zo.reshard(src, dst, world_size={m}) (`python -m zero_optax.reshard SRC DST --world-size {m}`; "
                f"zero_optax.reshard).")
        difference = partition_difference(saved_layout, target, where) or first_difference(a, b, where, PLAIN_KEYS)
    else:
        difference = partition_difference(saved_layout, target, where, reshard=True)
        if difference is None:
            sliced = [x.sliced or y.sliced for x, y in zip(saved_layout.leaves, target.leaves)]
            blocked = [s or x.tp_owned or y.tp_owned for s, x, y in zip(sliced, saved_layout.leaves, target.leaves)]
            difference = first_difference(_invariant(a, sliced, blocked), _invariant(b, sliced, blocked), where,
                                          RESHARD_KEYS)
    if difference is not None:
        raise ZeroCheckpointError(difference)
    if reshard:
        _tp_blocks.recuts(saved_layout, target, where)  # refuses a leaf whose logical shape changed


def partition_difference(saved: StoredLayout, target: StoredLayout | Layout, where: str, reshard: bool = False) -> str | None:
    """A sentence naming how the partition differs between a checkpoint and a target (the partition itself, or
    a leaf sliced in one and owned in the other), and what to do; None if it does not.

    With `reshard`, a leaf that `partition="auto"` slices on one mesh and owns on the other (a vector split over a
    tensor-parallel axis there, small enough to own here) is no difference: its state is a history per
    coordinate in both, whole on its owner or cut in slices."""
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
