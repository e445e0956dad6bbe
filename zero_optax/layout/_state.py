"""The state pytree zero1 returns. Every array leaf is sharded along its leading axis over the ZeRO axes."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax

from zero_optax.layout import _inner_state
from zero_optax.layout._layout import Layout


class SlicedState(NamedTuple):
    """How `ZeroState.inner_state` stores the inner optimizer's state of the sliced leaves.

    Attributes:
      shared: the inner optimizer's state tree (`zero_optax.layout._inner_state`), so optax's tree utilities find
        its fields: each field shared across parameters (`Layout.shared_entries`: step counts, injected
        hyperparameters) a `_inner_state.Shared` holding one `[N, *shape]` array, one identical copy per device
        (sharding `P(ZeRO axes)`); each per-parameter field a `_inner_state.Sharded` marker without values.
      histories: per group of sliced leaves (`Layout.groups`), per history of its members (Adam's `mu`, `nu`):
        one 1-D array of `blocks * group * size` elements. Device `r`'s `size` elements are the concatenation of
        its `slots` coordinates of every member (padding zeroed), so one array holds that history of many leaves
        (sharding `P((*leaf axes, *ZeRO axes))`). A group that a device holds whole, one leaf of two or more
        dimensions (`Group.shape`), keeps it in the leaf's shape: `(blocks * shape[0], *shape[1:])`, the same
        elements in the same order, sharded along the first dimension.
    """

    shared: Any
    histories: tuple[tuple[jax.Array, ...], ...]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inner_state", "buffers", "master", "local"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ZeroState:
    """State of `zero1(...)`, for every partition.

    Attributes:
      inner_state: the inner optimizer's state of the sliced leaves and the shared entries, stored by group of
        leaves that run one program (`SlicedState`). `zo.gather_state` and checkpoints present it per leaf.
      buffers: dtype name -> `[N, size]` packed buffer of the owned leaves: row `r` holds the complete state (and
        master copies) of the leaves device `r` owns, padded with zeros to the largest device's share. Empty when
        no leaf is owned. Sharding `P(ZeRO axes)`.
      master: None without `master_dtype`; otherwise one array per group of sliced leaves holding their master
        slices, laid out like the group's histories (owned leaves' masters are packed in `buffers`).
      layout: static description of the partition (see `zero_optax.describe`).
      local: None unless `accumulate="local"`; then a tree like the parameters holding each device's own float32
        gradient sums of the current accumulation cycle, `[1, *shape]` per device (global leading axis over the
        leaf's axes and the ZeRO axes).
    """

    inner_state: Any
    buffers: dict[str, jax.Array]
    master: Any
    layout: Layout
    local: Any = None

    def __getattr__(self, name: str) -> Any:
        """A field of the inner state's top level, as plain optax's state has it, for code that reads the state by
        attribute (`optax.contrib.schedule_free_eval_params` reads `state.b1` and `state.z`): a shared field's
        value, and a per-parameter field gathered from the devices (`zo.gather_state`, on a global state)."""
        top = self.inner_state.shared if not name.startswith("_") and "inner_state" in vars(self) else None
        if name not in getattr(top, "_fields", ()):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        field = getattr(top, name)
        if any(isinstance(x, _inner_state.Sharded) for x in jax.tree.leaves(field, is_leaf=_is_marker)):
            return getattr(GATHER[0](self), name)
        return jax.tree.map(lambda x: x.value if isinstance(x, _inner_state.Shared) else x, field,
                            is_leaf=lambda x: isinstance(x, _inner_state.Shared))


GATHER: list = []
"""`zero_optax.api._transfer`'s gather of one state, which it registers here when it is imported (it sits
above this module): `ZeroState.__getattr__` reads per-parameter fields with it."""


def _is_marker(x: Any) -> bool:
    return isinstance(x, _inner_state.Sharded)


ZeroFlatState = ZeroState
"""Another name of `ZeroState`, kept in the public API only so that code written for zero_optax 0.1 still imports
(its checkpoints are refused: restore reads format version 2 only). Every partition's state is a `ZeroState`."""

ZeroLeafState = ZeroState
"""Another name of `ZeroState`, kept in the public API only so that code written for zero_optax 0.1 still imports
(its checkpoints are refused: restore reads format version 2 only). Every partition's state is a `ZeroState`."""


def canonical(state: ZeroState, rows: int | None = None, place=None) -> ZeroState:
    """`state` with every shared field of its inner state stored, one copy per device: a value that
    `optax.tree.set` put there is broadcast to `rows` copies (the world size by default: a global state) and given
    to `place`, if given (`_inner_state.arrays`)."""
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
    return isinstance(x, ZeroState)


def find_states(tree: Any) -> list[ZeroState]:
    """Every zero1 state inside `tree`, in tree order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]
