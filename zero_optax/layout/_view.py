"""A zero1 state read as its inner optimizer's state: `state[i]`, iteration, unpacking and fields at every level,
each part an instance of the inner state's own type, with plain values in it.

The stored tree (`_inner_state.tree`) has the inner state's structure, with a `Shared` for each shared field and a
`Sharded` marker for each per-parameter one. A read resolves the part it reads:

* a shared field reads as its value, each device's own copy (no collective, also under `jax.jit`);
* a per-parameter field (Adam's `mu`) reads as the tree the inner optimizer would hold, its leaves gathered across
  the devices (one gather for all the part's fields) and replicated. Inside `shard_map`, where each device holds its
  slices only, its read is refused (in a part, it reads as its `Sharded` marker, refused where used). A part is read
  whole: `state[1]` of `chain(clip, inject_hyperparams(adam))` gathers Adam's moments, `state.hyperparams` (a
  top-level field) or `optax.tree.get(state, "learning_rate")` gathers nothing; under `jax.jit` the gathers of
  fields that are not used are dropped from the program;
* a dict holding shared fields (`hyperparams`) reads as a dict that writes through: `state.hyperparams[
  "learning_rate"] = x` changes the stored state (the next `update` stores `x`, as after `optax.tree.set`), as it
  changes a plain optax state in place.

Reading never changes the stored state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroStructureError
from zero_optax.layout._inner_state import Sharded, Shared

GATHER: list[Callable[[Any, Sequence[int]], list[jax.Array]]] = []
"""The full values of some entries of a global state, which `zero_optax.api._transfer` (a layer above, where the
state's arrays are cut and joined) registers."""

_WRITE_HELP = "Set the inner state's fields with optax.tree.set(state, name=value), as for a plain optax state."


def _is_marker(x: Any) -> bool:
    return isinstance(x, (Shared, Sharded))


def _markers(node: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(node, is_leaf=_is_marker) if _is_marker(x)]


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


class _Reader:
    """Resolves the parts of one state's stored inner tree."""

    __slots__ = ("entries", "state", "writable")

    def __init__(self, state: Any):
        self.writable = not _compat.has_variables(state)  # (Flax Variables: a read is a copy of their values)
        self.state = state if self.writable else _compat.pure(state)
        self.entries = {e.path: j for j, e in enumerate(state.layout.entries)}

    def read(self, node: Any) -> Any:
        """`node` of the stored tree as the inner state holds it."""
        found = _markers(node)
        sharded = [x for x in found if isinstance(x, Sharded)]
        if sharded and _compat.manual_axes():  # no gather: each device holds its slices only
            if len(sharded) == len(found):  # the read of a per-parameter field
                raise ZeroStructureError(sharded[0].path_help)
            return self._built(node, {})  # (a part holding some: their markers, refused where used)
        values = GATHER[0](self.state, [self.entries[x.path] for x in sharded]) if sharded else []
        return self._built(node, {x.path: v for x, v in zip(sharded, values)})

    def _built(self, node: Any, gathered: dict[str, jax.Array]) -> Any:
        if isinstance(node, Shared):
            return node.value
        if isinstance(node, Sharded):
            return gathered.get(node.path, node)
        found = _markers(node)
        if not found:  # a plain part, or a value optax.tree.set put there
            return node
        if isinstance(node, dict) and any(isinstance(x, Shared) for x in found):
            return _Fields(self, node, {k: self._built(v, gathered) for k, v in node.items()})
        if _is_namedtuple(node):
            return type(node)(*[self._built(x, gathered) for x in node])
        if type(node) in (tuple, list, dict):
            items = node.items() if isinstance(node, dict) else enumerate(node)
            built = {k: self._built(x, gathered) for k, x in items}
            return built if isinstance(node, dict) else type(node)(built.values())
        return jax.tree.map(lambda x: self._built(x, gathered), node, is_leaf=_is_marker)

    def write(self, stored: dict, key: Any, value: Any) -> None:
        """`stored[key] = value` into the state, where a shared field may take it."""
        if not self.writable:
            raise ZeroStructureError(
                f"This zero1 state holds Flax Variables, so reading it gave a copy: the write of {key!r} would be "
                f"lost. {_WRITE_HELP}")
        if key not in stored:
            raise ZeroStructureError(f"The inner state has no field {key!r} here: a zero1 state's fields are fixed "
                                     f"by the inner transformation's init. {_WRITE_HELP}")
        if any(isinstance(x, Sharded) for x in _markers(stored[key])):
            raise ZeroStructureError(
                f"The inner state's {key!r} is per-parameter and stored sharded across the devices: a read of it "
                "is a gathered copy. Build a state from a plain optax state with zo.scatter_state(tx, state, "
                "params).")
        stored[key] = value


class _Fields(dict):
    """A dict of the inner state holding shared fields (`hyperparams`), whose writes reach the stored state."""

    def __init__(self, reader: _Reader, stored: dict, values: dict):
        super().__init__(values)
        self._reader, self._stored = reader, stored

    def __setitem__(self, key: Any, value: Any) -> None:
        self._reader.write(self._stored, key, value)
        super().__setitem__(key, value)

    def _refuse(self, *args, **kwargs):
        del args, kwargs
        raise ZeroStructureError(f"A zero1 state's fields are fixed by the inner transformation's init. {_WRITE_HELP}")

    __delitem__ = pop = popitem = clear = setdefault = update = _refuse  # type: ignore[assignment]


def _flatten_fields(x: Any) -> Any:
    keys = tuple(sorted(x))
    return [(jax.tree_util.DictKey(k), dict.__getitem__(x, k)) for k in keys], keys


def _unflatten_fields(keys: Any, children: Any) -> Any:
    return dict(zip(keys, children))


# (as a pytree, a plain dict: `jax.tree.map` over a read gives plain dicts)
jax.tree_util.register_pytree_with_keys(_Fields, _flatten_fields, _unflatten_fields)


def _top(state: Any) -> tuple[_Reader, Any]:
    """A reader of the zero1 state `state`, and the top level of its stored inner tree."""
    reader = _Reader(state)
    return reader, reader.state._inner.shared


def field(state: Any, name: str) -> Any:
    """The field `name` of the inner state's top level, read (`_Reader.read`).

    Raises:
      AttributeError: the top level is no NamedTuple with such a field.
    """
    reader, top = _top(state)
    if name not in getattr(type(top), "_fields", ()):
        raise AttributeError(f"{type(state).__name__!r} object has no attribute {name!r} (nor has its inner state, "
                             f"a {type(top).__name__})")
    return reader.read(getattr(top, name))


def item(state: Any, index: Any) -> Any:
    """`inner_state[index]`, read (a slice of a tuple reads as a tuple of its items)."""
    reader, top = _top(state)
    return reader.read(top[index])


def size(state: Any) -> int:
    """`len(inner_state)`."""
    return len(_top(state)[1])


def parts(state: Any) -> Iterator[Any]:
    """The items of the inner state's top level, each read as the iteration reaches it."""
    reader, top = _top(state)
    return map(reader.read, top)
