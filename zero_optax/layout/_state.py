"""`ZeroState`, the pytree zero1's `init` and `update` return, and helpers that find and normalize it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax

from zero_optax.layout import _inner_state, _view
from zero_optax.layout._layout import Layout


class SlicedState(NamedTuple):
    """How `ZeroState.inner_state` stores the inner optimizer's state: its tree (`_inner_state.tree`), and per group
    of sliced leaves, per history (Adam's `mu`, `nu`), one array."""

    shared: Any
    histories: tuple[tuple[jax.Array, ...], ...]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["_inner", "buffers", "master", "local"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ZeroState:
    """State of `zero1(...)`, a pytree whose arrays are sharded along their leading axis over the mesh.

    It reads as the inner optimizer's state (`_view`): `len(state)`, `state[i]`, iteration and unpacking, and
    fields at every level (`state[1].hyperparams["learning_rate"]`, `state.mu`), each part an instance of the inner
    state's own type. Shared fields (counts, hyperparameters) read exact, without a collective. A per-parameter
    field (Adam's `mu`) reads as the tree the inner optimizer would hold, its leaves replicated global arrays,
    gathered across the devices when that field is read (outside `shard_map` only; `zo.gather_state` gathers the
    whole state). Writes go through `optax.tree.set`; a write into a read dict (`state.hyperparams[...] = x`)
    reaches the state. `optax.tree.get` finds the inner state's fields too.

    Attributes:
      buffers: dtype name -> `[N, size]` packed buffer: row `r` holds the state of the leaves device `r` owns.
      master: None without `master_dtype`; else per group of sliced leaves their master slices.
      layout: static description of the partition (see `zero_optax.describe`).
      local: None unless `accumulate="local"`; else each device's float32 gradient sums, a tree like the parameters.

    The inner optimizer's state of the sliced leaves and the shared entries, stored by group, is kept in `_inner`,
    a name no optax state field can take (NamedTuple fields never start with an underscore), so that an inner
    field named `inner_state` (a top-level `inject_hyperparams`) reads as the inner's.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> state = zo.zero1(optax.adam(0.1), axis_name="data", mesh=mesh).init({"w": jnp.ones(3)})
      >>> [x.shape for x in jax.tree.leaves(state)]   # count, mu, nu
      [(1,), (3,), (3,)]
      >>> adam, _ = state                             # as optax.adam's state unpacks
      >>> type(adam).__name__, int(adam.count), adam.mu["w"].shape
      ('ScaleByAdamState', 0, (3,))
    """

    _inner: Any
    buffers: dict[str, jax.Array]
    master: Any
    layout: Layout
    local: Any = None

    def __getattr__(self, name: str) -> Any:
        """A field of the inner state's top level, as plain optax holds it."""
        if name.startswith("_") or "_inner" not in vars(self):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return _view.field(self, name)

    def __len__(self) -> int:
        return _view.size(self)

    def __getitem__(self, index: Any) -> Any:
        return _view.item(self, index)

    def __iter__(self):
        return _view.parts(self)

    def __bool__(self) -> bool:  # (a state is a state, even where the inner one is an empty tuple)
        return True


# Other names of `ZeroState`, so that code written for zero_optax 0.1 imports (its checkpoints do not restore).
ZeroFlatState = ZeroState
ZeroLeafState = ZeroState


def canonical(state: ZeroState, rows: int | None = None, place=None) -> ZeroState:
    """`state` with a value `optax.tree.set` put in a shared field stored again (`_inner_state.arrays`)."""
    layout, inner = state.layout, state._inner
    old = _inner_state.items(inner.shared)
    new = _inner_state.arrays(layout, inner.shared, layout.world_size if rows is None else rows, place)
    if all(a is b for a, b in zip(old, new)):
        return state
    return dataclasses.replace(state, _inner=inner._replace(shared=_inner_state.tree(layout, new)))


def shared_arrays(state: ZeroState) -> dict[int, Any]:
    """Shared entry -> its stored `[N, *shape]` array (the state must be `canonical`)."""
    return dict(zip(state.layout.shared_entries, _inner_state.items(state._inner.shared)))


def is_state(x: Any) -> bool:
    """Whether `x` is a zero1 state."""
    return isinstance(x, ZeroState)


def find_states(tree: Any) -> list[ZeroState]:
    """Every zero1 state inside `tree`, in tree order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]
