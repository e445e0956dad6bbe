"""`ZeroState`, the pytree zero1's `init` and `update` return, and helpers that find and normalize it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax

from zero_optax.layout import _inner_state
from zero_optax.layout._layout import Layout


class SlicedState(NamedTuple):
    """How `ZeroState.inner_state` stores the inner optimizer's state: its tree (`_inner_state.tree`), and per group
    of sliced leaves, per history (Adam's `mu`, `nu`), one array."""

    shared: Any
    histories: tuple[tuple[jax.Array, ...], ...]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inner_state", "buffers", "master", "local"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ZeroState:
    """State of `zero1(...)`, a pytree whose arrays are sharded along their leading axis over the mesh.

    It reads as the inner optimizer's state: `optax.tree.get` finds its fields, and a field of the top level reads
    by attribute (a per-parameter one gathered, as `zo.gather_state` does).

    Attributes:
      inner_state: the inner optimizer's state of the sliced leaves and the shared entries, stored by group.
      buffers: dtype name -> `[N, size]` packed buffer: row `r` holds the state of the leaves device `r` owns.
      master: None without `master_dtype`; else per group of sliced leaves their master slices.
      layout: static description of the partition (see `zero_optax.describe`).
      local: None unless `accumulate="local"`; else each device's float32 gradient sums, a tree like the parameters.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> state = zo.zero1(optax.scale_by_adam(), axis_name="data", mesh=mesh).init({"w": jnp.ones(3)})
      >>> [x.shape for x in jax.tree.leaves(state)]   # count, mu, nu
      [(1,), (3,), (3,)]
      >>> int(state.count), state.mu["w"].shape
      (0, (3,))
    """

    inner_state: Any
    buffers: dict[str, jax.Array]
    master: Any
    layout: Layout
    local: Any = None

    def __getattr__(self, name: str) -> Any:
        """A field of the inner state's top level, as plain optax holds it (for `schedule_free_eval_params`)."""
        top = self.inner_state.shared if not name.startswith("_") and "inner_state" in vars(self) else None
        if name not in getattr(top, "_fields", ()):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        field = getattr(top, name)
        markers = jax.tree.leaves(field, is_leaf=lambda x: isinstance(x, _inner_state.Sharded))
        if any(isinstance(x, _inner_state.Sharded) for x in markers):
            return getattr(GATHER[0](self), name)
        return jax.tree.map(lambda x: x.value if isinstance(x, _inner_state.Shared) else x, field,
                            is_leaf=lambda x: isinstance(x, _inner_state.Shared))


GATHER: list = []
"""The gather of one state, which `zero_optax.api._transfer` (a layer above) registers for `__getattr__`."""


# Other names of `ZeroState`, so that code written for zero_optax 0.1 imports (its checkpoints do not restore).
ZeroFlatState = ZeroState
ZeroLeafState = ZeroState


def canonical(state: ZeroState, rows: int | None = None, place=None) -> ZeroState:
    """`state` with a value `optax.tree.set` put in a shared field stored again (`_inner_state.arrays`)."""
    layout, inner = state.layout, state.inner_state
    old = _inner_state.items(inner.shared)
    new = _inner_state.arrays(layout, inner.shared, layout.world_size if rows is None else rows, place)
    if all(a is b for a, b in zip(old, new)):
        return state
    return dataclasses.replace(state, inner_state=inner._replace(shared=_inner_state.tree(layout, new)))


def shared_arrays(state: ZeroState) -> dict[int, Any]:
    """Shared entry -> its stored `[N, *shape]` array (the state must be `canonical`)."""
    return dict(zip(state.layout.shared_entries, _inner_state.items(state.inner_state.shared)))


def is_state(x: Any) -> bool:
    """Whether `x` is a zero1 state."""
    return isinstance(x, ZeroState)


def find_states(tree: Any) -> list[ZeroState]:
    """Every zero1 state inside `tree`, in tree order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]
