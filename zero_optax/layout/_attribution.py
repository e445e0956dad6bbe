"""Which inner-state leaves belong to which parameter leaf, found from the inner `init` on partial trees the way
`optax.masked` calls it, and which device owns which parameter leaf (`balanced_owners`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np
import optax

from zero_optax.core import _names
from zero_optax.core._errors import OwnersError, ZeroCouplingError
from zero_optax.layout._layout import masked_view
from zero_optax.layout._stored import StateEntry

_MARKER = 1_000_000_007
"""Sliced leaves are traced with the distinct, implausible lengths `_MARKER + i`, so their histories name them."""


def discover_entries(init_fn, treedef, leaf_structs: Sequence[jax.ShapeDtypeStruct], sliced: Sequence[int] = ()
                     ) -> tuple[tuple[StateEntry, ...], Any]:
    """The entries of `init_fn`'s state, in flatten order, and the full abstract state: state present on a fully
    masked tree is shared, a `sliced` leaf's histories end in an axis of length `_MARKER + i` (after leading axes
    of a stacked history, L-BFGS's `(memory, *param.shape)`), others are spelled bit by bit."""
    n = len(leaf_structs)
    sliced_leaves = set(sliced)
    owned = [i for i in range(n) if i not in sliced_leaves and not isinstance(leaf_structs[i], optax.MaskedNode)]

    def state_of(values):
        try:
            return jax.eval_shape(init_fn, jax.tree_util.tree_unflatten(treedef, values))
        except Exception as e:
            raise ZeroCouplingError(
                "zero1 could not tell which optimizer state belongs to which parameter: the inner "
                "transformation's init failed on a tree whose other leaves are optax.MaskedNode() "
                f"(the way optax.masked calls it): {type(e).__name__}: {e}") from e

    def paths_of(present) -> set[str]:
        return set(_names.leaf_paths(state_of(masked_view(leaf_structs, present))))

    marked = [jax.ShapeDtypeStruct((_MARKER + i,), x.dtype) if i in sliced_leaves else x
              for i, x in enumerate(leaf_structs)]
    marked_state = state_of(marked)
    full = list(zip(_names.leaf_paths(marked_state), jax.tree.leaves(marked_state)))
    shared = paths_of(())
    owner_of: dict[str, int] = {}
    rest = []
    for path, x in full:
        if path in shared:
            continue
        if _history_of(x.shape) in sliced_leaves:
            owner_of[path] = _history_of(x.shape)
        else:
            rest.append(path)
    histories = set(owner_of)
    # (a sliced leaf's state that is no history, novograd's per-leaf norm, is found as an owned leaf's is)
    owner_of.update(_owned_entry_leaves(rest, sorted(sliced_leaves | set(owned)), paths_of))
    entries = []
    for path, x in full:
        leaf = owner_of.get(path)
        shape = (*x.shape[:-1], *leaf_structs[owner_of[path]].shape) if path in histories else tuple(x.shape)
        entries.append(StateEntry(path, leaf, tuple(shape), np.dtype(x.dtype).name))
    return tuple(entries), marked_state


def _history_of(shape: tuple[int, ...]) -> int:
    """The sliced leaf whose marked length ends `shape` (no leading axis marked), or -1."""
    if not shape or any(d >= _MARKER for d in shape[:-1]):
        return -1
    return shape[-1] - _MARKER


def _owned_entry_leaves(rest: Sequence[str], owned: Sequence[int], paths_of) -> dict[str, int]:
    """The owned leaf each state path of `rest` belongs to: for every bit `b` of a position among `owned`, a leaf's
    path is on exactly one of the views holding the leaves with `b` set and with `b` clear."""
    if not rest:
        return {}
    bits = dict.fromkeys(rest, 0)
    for b in range(max(len(owned) - 1, 0).bit_length()):
        on = {i for k, i in enumerate(owned) if k >> b & 1}
        with_on, with_off = paths_of(on), paths_of(set(owned) - on)
        for path in rest:
            if path in with_on and path in with_off:
                raise ZeroCouplingError(
                    f"The inner optimizer's state `{path}` appears for two disjoint sets of parameter leaves; zero1 "
                    "can only shard state that belongs to one leaf or to none.")
            if path not in with_on and path not in with_off:
                raise ZeroCouplingError(
                    f"The inner optimizer's state `{path}` depends on several parameter leaves at once, or is "
                    "neither shared nor a per-coordinate history of a sliced leaf; zero1 can only shard state that "
                    "belongs to one leaf or to none.")
            if path in with_on:
                bits[path] |= 1 << b
    out = {}
    for path in rest:
        if not owned or bits[path] >= len(owned):
            raise ZeroCouplingError(
                f"The inner optimizer's state `{path}` is neither shared nor a per-coordinate history of a sliced "
                "leaf (the flat partition slices every leaf into 1-D coordinates), so zero1 cannot shard it.")
        out[path] = owned[bits[path]]
    return out


def _greedy(costs: Sequence[int], world_size: int) -> list[int]:
    """Each cost, largest first, to the least-loaded device; ties to the lower index."""
    load = [0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def owners_for_entries(entries, owned: Sequence[bool], world_size: int) -> list[int | None]:
    """Balanced owners of the `owned` leaves by the bytes of their state entries; None for the others."""
    costs = [0] * len(owned)
    for e in entries:
        if e.leaf is not None:
            costs[e.leaf] += e.nbytes
    which = [i for i, o in enumerate(owned) if o]
    chosen = dict(zip(which, _greedy([costs[i] for i in which], world_size)))
    return [chosen.get(i) for i in range(len(owned))]


def balanced_owners(params: Any, world_size: int, *, inner: optax.GradientTransformation | None = None) -> list[int]:
    """Assigns every parameter leaf to one device, balancing optimizer-state bytes.

    Leaves go largest first to the least-loaded device, ties to the lower index.

    Args:
      params: the parameter pytree (arrays or `jax.ShapeDtypeStruct`s).
      world_size: number of devices on the data axis.
      inner: optional inner optimizer; if given, a leaf costs its optimizer-state bytes under `inner`, else its
        parameter bytes.

    Returns:
      One device index per leaf, in tree-flatten order.

    Raises:
      OwnersError: `world_size` is not a positive int.

    Examples:
      >>> import jax.numpy as jnp, zero_optax as zo
      >>> zo.balanced_owners({"a": jnp.zeros((4, 4)), "b": jnp.zeros(3), "c": jnp.zeros(8)}, world_size=2)
      [0, 1, 1]
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise OwnersError(f"`world_size` must be a positive int, got {world_size!r}.")
    if inner is None:
        return _greedy([int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)],
                       world_size)
    # traced abstractly, nothing allocated
    structs, treedef = jax.tree.flatten(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))
    entries = discover_entries(optax.with_extra_args_support(inner).init, treedef, structs)[0]
    # every leaf is owned, so no owner is None
    return cast(list[int], owners_for_entries(entries, [True] * len(structs), world_size))


def check_owners(owners: Sequence[int], n_leaves: int, world_size: int, paths: Sequence[str]) -> tuple[int, ...]:
    """`owners` as a tuple after checking its length and range."""
    owners = tuple(owners)
    if len(owners) != n_leaves:
        raise OwnersError(
            f"`owners` has {len(owners)} entries, but the parameters have {n_leaves} trainable leaves; give one "
            "device index per leaf in tree-flatten order (zero_optax.balanced_owners(params, world_size) builds one).")
    for i, r in enumerate(owners):
        if not isinstance(r, (int, np.integer)) or not 0 <= r < world_size:
            raise OwnersError(
                f"`owners[{i}]` (leaf `{paths[i]}`) is {r!r}, but device indices must be ints in [0, {world_size}).")
    return tuple(int(r) for r in owners)
