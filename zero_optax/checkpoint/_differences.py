"""How a checkpoint's record of a zero1 state differs from the target's, in words.

`describe` compares two state records (`_record.state_record`, possibly trimmed to what resharding keeps) and
names each difference by the leaf or inner-state entry it concerns: the leaves and entries only one side has, a
leaf's shapes or dtypes, the inner optimizer's state types. Differences of the model (paths, logical shapes,
dtypes, the optimizer's state, master weights) are named with their fix; differences of the layout alone
(owners, slots, tensor-parallel blocks, the other mesh axes), which resharding bridges, only where the model is
the same. At most `MAX_LISTED` differences are listed, then a count of the rest.

Examples:
  >>> from zero_optax.checkpoint import _differences
  >>> leaf = {"path": "['a']", "shape": [16, 4], "dtype": "float32"}
  >>> _differences.describe({"leaves": [leaf]}, {"leaves": [dict(leaf, shape=[32, 4])]}, "state 0",
  ...                       ("leaves",))
  "state 0 differs from the checkpoint: leaf `['a']` has shape (16, 4) in the checkpoint, (32, 4) in the target. ..."
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

MAX_LISTED = 10
"""The most differences (and the most paths in one) a message lists; it counts the rest."""
MODEL_FIX = ("Restore into a target built from the model, optimizer and zero1 settings that saved the checkpoint; "
             "resharding (reshard=True, zo.reshard) cannot change a leaf's path, shape or dtype, or the optimizer's "
             "state.")
LAYOUT_FIX = ("Only the layout differs: restore with zo.ZeroRestore(target, reshard=True), or convert the "
              "checkpoint first with zo.reshard(src, dst, ...) (`python -m zero_optax.reshard SRC DST "
              "--world-size N`, or `--axis-sizes`, `--owners`).")
_LAYOUT_FIELDS = {"owner": "owner", "slots": "slots per device", "group": "devices per block",
                  "axes": "tensor-parallel axes", "blocks": "blocks", "shape": "block shape",
                  "dims": "axes per dimension", "spec": "placement", "global_shape": "logical shape"}
"""A leaf's fields that its layout on a mesh sets, and their names in a message."""
_ENTRY_FIELDS = {"shape": "shape", "dtype": "dtype", "role": "role", "key_impl": "key implementation"}
_CONTAINERS = frozenset({"tuple", "list", "dict", "OrderedDict", "defaultdict", "NoneType"})
_TYPE = re.compile(r"([A-Za-z_][\w.]*)\(")


class _Found(NamedTuple):
    """Differences found so far, as phrases: of the model, and of the layout alone."""

    model: list[str]
    layout: list[str]


def describe(saved: dict[str, Any], target: dict[str, Any], where: str, keys: Sequence[str]) -> str | None:
    """A message naming how two state records differ in `keys`, and the fix; None where they do not.

    Args:
      saved: the checkpoint's state record.
      target: the target's state record, in the same form.
      where: the state, as messages name it (`zero1 state 0 (at `<root>`)`).
      keys: the record fields to compare.

    Returns:
      Short sentences: the differences (each leaf and entry by path) and what to do; None if none of `keys`
      differs.
    """
    diff = [k for k in keys if saved.get(k) != target.get(k)]
    if not diff:
        return None
    found = _Found([], [])
    gone, changed = _leaves(found, saved.get("leaves") or [], target.get("leaves") or []) if "leaves" in diff \
        else (set(), set())
    if "state_tree" in diff:
        _state_types(found, _types(saved["state_tree"]), _types(target["state_tree"]))
    if "entries" in diff:
        _entries(found, saved, target, gone, changed)
    if "state_tree" in diff and not found.model:
        found.model.append(f"the inner optimizer's state tree is {tree_text(saved['state_tree'], 120)} in the "
                           f"checkpoint, {tree_text(target['state_tree'], 120)} in the target")
    _settings(found, saved, target, diff)
    if found.model:
        return f"{where} differs from the checkpoint: {_listed(found.model)}. {MODEL_FIX}"
    if not found.layout:  # fields with no words of their own: the stored arrays, packing, owned entries' shapes
        found.layout.append(f"its stored {' and '.join(_FIELD_WORDS.get(k, k) for k in diff)} differ")
    return f"{where} differs from the checkpoint: {_listed(found.layout)}. {LAYOUT_FIX}"


_FIELD_WORDS = {"arrays": "arrays", "packing": "packing of owned states", "entries": "inner-state entries",
                "leaves": "leaves", "owners": "owners", "state_tree": "optimizer state"}


def _leaves(found: _Found, saved: list[dict], target: list[dict]) -> tuple[set[str], set[str]]:
    """Adds the leaves only one side has and each common leaf's differences.

    Returns:
      The paths of the leaves only one side has, and of those both have that differ: their entries' own
      differences follow from theirs.
    """
    a, b = {x["path"]: x for x in saved}, {x["path"]: x for x in target}
    only_target, only_saved = [p for p in b if p not in a], [p for p in a if p not in b]
    if only_target:
        found.model.append(f"the target has {_named(only_target, 'leaf', 'leaves')}, which the checkpoint lacks")
    if only_saved:
        found.model.append(f"the checkpoint has {_named(only_saved, 'leaf', 'leaves')}, which the target lacks")
    changed = {p for p in a if p in b and a[p] != b[p]}
    for p in (p for p in a if p in changed):
        _leaf(found, p, a[p], b[p])
    if not (only_target or only_saved or changed):
        found.model.append("the leaves are in another order")
    return set(only_target + only_saved), changed


def _leaf(found: _Found, path: str, x: dict[str, Any], y: dict[str, Any]) -> None:
    """Adds how leaf `path` differs: its logical shape or dtype (the model), or else its layout."""
    model = []
    key = _shape_key(x, y)
    if key is not None and x.get(key) != y.get(key):
        model.append(_both("shape", _value(key, x.get(key)), _value(key, y.get(key))))
    if x.get("dtype") != y.get("dtype"):
        model.append(_both("dtype", x.get("dtype"), y.get("dtype")))
    if model:
        found.model.append(f"leaf `{path}` has {' and '.join(model)}")
        return
    fields = [f for f in _LAYOUT_FIELDS if x.get(f) != y.get(f)][:3]
    if fields:
        found.layout.append(f"leaf `{path}` has " + ", ".join(
            _both(_LAYOUT_FIELDS[f], _value(f, x.get(f)), _value(f, y.get(f))) for f in fields))


def _shape_key(x: dict[str, Any], y: dict[str, Any]) -> str | None:
    """The field that holds both leaves' logical shapes: `global_shape` where both records know it, `shape` where
    both are cut alike; None where only the layout can tell the shapes apart."""
    if x.get("global_shape") is not None and y.get("global_shape") is not None:
        return "global_shape"
    if (x.get("axes"), x.get("blocks"), x.get("dims")) == (y.get("axes"), y.get("blocks"), y.get("dims")):
        return "shape"
    return None


def _entries(found: _Found, saved: dict[str, Any], target: dict[str, Any], gone: set[str],
             changed: set[str]) -> None:
    """Adds the inner-state entries only one side has (but for those of leaves only one side has) and how each
    common entry differs (but for the shape and dtype of an entry of a leaf that differs: they follow the leaf)."""
    a = _entry_map(saved, gone)
    b = _entry_map(target, gone)
    only_saved, only_target = [p for p in a if p not in b], [p for p in b if p not in a]
    if only_saved:
        found.model.append(f"the checkpoint has inner-state {_named(only_saved, 'entry', 'entries')}, which the "
                           "target lacks")
    if only_target:
        found.model.append(f"the target has inner-state {_named(only_target, 'entry', 'entries')}, which the "
                           "checkpoint lacks")
    for p in (p for p in a if p in b and a[p] != b[p]):
        (x, lx), (y, ly) = a[p], b[p]
        fields = [f for f in _ENTRY_FIELDS if x.get(f) != y.get(f) and not (f in ("shape", "dtype") and lx in changed)]
        words = [_both(_ENTRY_FIELDS[f], _value(f, x.get(f)), _value(f, y.get(f))) for f in fields]
        if lx != ly:
            words.insert(0, _both("leaf", _value("path", lx), _value("path", ly)))
        if words:
            found.model.append(f"inner-state entry `{p}` has {' and '.join(words)}")


def _entry_map(record: dict[str, Any], gone: set[str]) -> dict[str, tuple[dict[str, Any], str | None]]:
    """A record's entries by path, each with its leaf's path (None: a shared entry), without those of `gone`."""
    leaves = [x["path"] for x in record.get("leaves") or []]
    out = {}
    for e in record.get("entries") or []:
        i = e.get("leaf")
        leaf = leaves[i] if isinstance(i, int) and 0 <= i < len(leaves) else None
        if leaf not in gone:
            out[e["path"]] = (e, leaf)
    return out


def _state_types(found: _Found, saved: list[str], target: list[str]) -> None:
    """Adds the inner optimizer's state types where they differ: those only one side has (all, if only their
    order differs)."""
    if saved == target:
        return
    a, b = [t for t in saved if t not in target], [t for t in target if t not in saved]
    a, b = (a, b) if a or b else (saved, target)
    found.model.append(f"the inner optimizer's state is {' and '.join(a) or 'empty'} in the checkpoint, "
                       f"{' and '.join(b) or 'empty'} in the target")


def _types(tree: str) -> list[str]:
    """The state types a tree signature (`_names.tree_signature`) names, in order, each once, containers left out."""
    return list(dict.fromkeys(n for n in _TYPE.findall(tree) if n not in _CONTAINERS))


def _settings(found: _Found, saved: dict[str, Any], target: dict[str, Any], diff: list[str]) -> None:
    """Adds the differing settings of the state as a whole: partition, master weights (the model), the owners
    (where no leaf's layout differs: the leaves name them) and the other mesh axes (the layout)."""
    if "partition" in diff:
        found.model.append(_both("partition", repr(saved["partition"]), repr(target["partition"])))
    if "master_dtype" in diff:
        found.model.append(_both("master weights", saved["master_dtype"] or "none", target["master_dtype"] or "none"))
    if "owners" in diff and not found.layout:
        found.layout.append(_both("owners", _owners(saved["owners"]), _owners(target["owners"])))
    if "mesh_axes" in diff:
        found.layout.append(_both("other mesh axes", _axes(saved["mesh_axes"]), _axes(target["mesh_axes"])))


def _axes(mesh_axes: list | None) -> str:
    return ", ".join(f"{a}={s}" for a, s in mesh_axes or []) or "none"


def _owners(owners: list | None) -> str:
    return "balanced by zero1" if owners is None else f"given as {', '.join(map(str, owners))}"


def _value(field: str, v: Any) -> str:
    """A record value as a message shows it: shapes as tuples, placements as PartitionSpecs."""
    if v is None:
        return "sliced" if field == "owner" else "unknown" if field == "global_shape" else "none"
    if field in ("shape", "global_shape"):
        return str(tuple(v))
    if field in ("spec", "dims"):
        return "P(" + ", ".join(repr(a[0]) if len(a) == 1 else repr(tuple(a)) if a else "None" for a in v) + ")"
    if field == "axes":
        return ", ".join(map(str, v)) or "none"
    if field == "owner":
        return f"device {v}"
    if field == "role":
        return "master copy" if v == "master" else "optimizer state"
    return f"`{v}`" if field == "path" else str(v)


def _both(what: str, a: Any, b: Any) -> str:
    return f"{what} {a} in the checkpoint, {b} in the target"


def _named(paths: list[str], one: str, many: str) -> str:
    """`leaf `['c']`` or `leaves `['c']`, `['d']` and 3 more`."""
    shown = [f"`{p}`" for p in paths[:MAX_LISTED]]
    if len(paths) > MAX_LISTED:
        return f"{many} {', '.join(shown)} and {len(paths) - MAX_LISTED} more"
    if len(shown) == 1:
        return f"{one} {shown[0]}"
    return f"{many} {', '.join(shown[:-1])} and {shown[-1]}"


def _listed(items: list[str]) -> str:
    """At most `MAX_LISTED` differences, then how many more there are."""
    more = len(items) - MAX_LISTED
    return "; ".join(items[:MAX_LISTED]) + (f"; and {more} more difference{'s' * (more > 1)}" if more > 0 else "")


def tree_text(signature: str, size: int = 200) -> str:
    """A tree signature (`_names.tree_signature`) as a message shows it: in backticks, cut to `size` characters.

    Examples:
      >>> tree_text("tuple([0]=*,[1]=EmptyState())")
      '`tuple([0]=*,[1]=EmptyState())`'
    """
    return f"`{signature if len(signature) <= size else signature[:size - 3] + '...'}`"
