"""The inner state's own tree inside a zero1 state, so that optax's tree utilities find its fields: shared fields
as `Shared`s that read as plain optax's values, per-parameter fields as `Sharded` markers without values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroStructureError
from zero_optax.layout import _keys
from zero_optax.layout._layout import Layout


def _on_value(name: str) -> Callable[..., Any]:
    """The method `name` of `Shared`, applied to its value."""
    return lambda self, *other: getattr(jnp.asarray(self.value), name)(*other)


@jax.tree_util.register_pytree_node_class
class Shared:
    """A shared field, `stored` one copy per device, that reads (and computes) as the value plain optax holds; a
    typed PRNG key is stored as its key data."""

    __slots__ = ("key_impl", "stored")

    def __init__(self, stored: Any, key_impl: str | None = None):
        self.stored, self.key_impl = stored, key_impl

    def tree_flatten(self):
        return (self.stored,), self.key_impl

    @classmethod
    def tree_unflatten(cls, aux: str | None, children: tuple[Any]) -> Shared:
        return cls(*children, aux)

    @property
    def value(self) -> jax.Array:
        """The value: inside `shard_map` this device's copy; outside, of a global array sharded over the mesh, each
        device's own copy as one replicated array (no collective: every copy holds the same value)."""
        x = self.stored
        sharding = jax.typeof(x).sharding if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and any(sharding.spec) and not _compat.manual_axes():
            if sharding.memory_kind in (None, "device") and not sharding.mesh.empty:
                return _keys.to_key(_own_copy(x, sharding), self.key_impl)
            x = _compat.reshard(x, NamedSharding(sharding.mesh, P()))
        return _keys.to_key(x[0], self.key_impl)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape if self.key_impl else self.stored.shape[1:])

    @property
    def dtype(self):
        return self.value.dtype if self.key_impl else self.stored.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __jax_array__(self):
        return self.value

    def __array__(self, dtype=None, copy=None):
        del copy
        return np.asarray(self.value, dtype)

    def __repr__(self) -> str:
        return f"Shared({self.value!r})" if hasattr(self.stored, "shape") else f"Shared({self.stored!r})"

    # the operators, on the value
    __float__, __int__ = _on_value("__float__"), _on_value("__int__")

    __add__, __radd__ = _on_value("__add__"), _on_value("__radd__")
    __sub__, __rsub__ = _on_value("__sub__"), _on_value("__rsub__")
    __mul__, __rmul__ = _on_value("__mul__"), _on_value("__rmul__")
    __truediv__, __rtruediv__ = _on_value("__truediv__"), _on_value("__rtruediv__")
    __pow__, __rpow__, __neg__ = _on_value("__pow__"), _on_value("__rpow__"), _on_value("__neg__")
    __lt__, __le__, __gt__, __ge__ = _on_value("__lt__"), _on_value("__le__"), _on_value("__gt__"), _on_value("__ge__")


def _own_copy(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Each device's copy (its first row) of `x`, stored one copy per device, as a replicated array."""
    def first(rows: jax.Array) -> jax.Array:
        return rows[0]
    return jax.shard_map(first, mesh=sharding.mesh, in_specs=P(sharding.spec[0]), out_specs=P(), check_vma=False)(x)


@jax.tree_util.register_pytree_node_class
class Sharded:
    """A per-parameter field, stored sharded elsewhere: its path, logical shape and dtype, and no values."""

    __slots__ = ("dtype", "path", "shape")

    def __init__(self, path: str, shape: tuple[int, ...], dtype: str):
        self.path, self.shape, self.dtype = path, tuple(shape), np.dtype(dtype)

    def tree_flatten(self):
        return (), (self.path, self.shape, self.dtype.name)

    @classmethod
    def tree_unflatten(cls, aux, children):
        del children
        return cls(*aux)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def path_help(self) -> str:
        return (f"The inner state's `{self.path}` is per-parameter: zero1 stores it sharded across the devices, and "
                "inside shard_map each device holds its slice only. Outside shard_map it reads gathered, and "
                "zo.gather_state(state) returns the whole inner state with its values.")

    def _refuse(self, *args, **kwargs):
        del args, kwargs
        raise ZeroStructureError(self.path_help)

    __jax_array__ = __array__ = __float__ = __int__ = _refuse

    def __repr__(self) -> str:
        return f"Sharded({self.path}: {self.dtype.name}{list(self.shape)})"


def tree(layout: Layout, stored: Sequence[Any]) -> Any:
    """The inner state's tree: `stored` (one item per shared entry) as `Shared`s, a `Sharded` for the others."""
    it = iter(stored)
    entries = [layout.entries[j] for j in layout.inner_entries]
    return jax.tree_util.tree_unflatten(layout.state_treedef, [
        Shared(next(it), e.key_impl) if e.leaf is None else _marker(layout, e) for e in entries])


def _marker(layout: Layout, entry) -> Sharded:
    """A per-parameter entry's marker: a sliced leaf's history in the leaf's shape, an owned leaf's in its own."""
    leaf = layout.leaves[entry.leaf]
    return Sharded(entry.path, leaf.shape if leaf.sliced else entry.shape, entry.dtype)


def items(shared: Any) -> list[Any]:
    """Each `Shared`'s stored array of a `tree`, or the value `optax.tree.set` put there."""
    found = jax.tree.leaves(shared, is_leaf=lambda x: isinstance(x, Shared))
    return [x.stored if isinstance(x, Shared) else x for x in found]


def arrays(layout: Layout, shared: Any, rows: int, place=None) -> list[Any]:
    """The stored arrays of a `tree`: a value `optax.tree.set` put there broadcast to `(rows, *shape)` and `place`d."""
    out = []
    values = items(shared)
    if len(values) != len(layout.shared_entries):
        raise ZeroStructureError(
            f"The zero1 state holds {len(values)} values where its inner state shares {len(layout.shared_entries)} "
            "fields across parameters: set a field to one value (optax.tree.set(state, name=value)), not to a tree.")
    for j, x in zip(layout.shared_entries, values):
        entry = layout.entries[j]
        x = _keys.to_data(x)
        if np.ndim(x) != len(entry.shape) + 1:  # a value `optax.tree.set` put there
            x = jnp.broadcast_to(jnp.asarray(x, entry.dtype), (rows, *entry.shape))
            x = x if place is None else place(x)
        out.append(x)
    return out
