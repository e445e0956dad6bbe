"""Which inner-state leaves belong to which parameter leaf, found from the inner `init` on partial trees the way
`optax.masked` calls it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from zero_optax.core import _names
from zero_optax.core._errors import ZeroCouplingError
from zero_optax.layout._layout import masked_view
from zero_optax.layout._stored import StateEntry

_MARKER = 1_000_000_007
"""Sliced leaves are traced with the distinct, implausible lengths `_MARKER + i`, so their histories name them."""


def discover_entries(init_fn, treedef, leaf_structs: Sequence[jax.ShapeDtypeStruct], sliced: Sequence[int] = ()
                     ) -> tuple[tuple[StateEntry, ...], Any]:
    """The entries of `init_fn`'s state, in flatten order, and the full abstract state: state present on a fully
    masked tree is shared, a `sliced` leaf's histories have length `_MARKER + i`, others are spelled bit by bit."""
    n = len(leaf_structs)
    sliced = set(sliced)
    owned = [i for i in range(n) if i not in sliced and not isinstance(leaf_structs[i], optax.MaskedNode)]

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

    marked = [jax.ShapeDtypeStruct((_MARKER + i,), x.dtype) if i in sliced else x for i, x in enumerate(leaf_structs)]
    marked_state = state_of(marked)
    full = list(zip(_names.leaf_paths(marked_state), jax.tree.leaves(marked_state)))
    shared = paths_of(())
    owner_of: dict[str, int] = {}
    rest = []
    for path, x in full:
        if path in shared:
            continue
        mark = x.shape[0] - _MARKER if len(x.shape) == 1 else -1
        if mark in sliced:
            owner_of[path] = mark
        else:
            rest.append(path)
    histories = set(owner_of)
    # (a sliced leaf's state that is no history, novograd's per-leaf norm, is found as an owned leaf's is)
    owner_of.update(_owned_entry_leaves(rest, sorted(sliced | set(owned)), paths_of))
    entries = []
    for path, x in full:
        leaf = owner_of.get(path)
        shape = leaf_structs[leaf].shape if path in histories else tuple(x.shape)
        entries.append(StateEntry(path, leaf, tuple(shape), np.dtype(x.dtype).name))
    return tuple(entries), marked_state


def _owned_entry_leaves(rest: Sequence[str], owned: Sequence[int], paths_of) -> dict[str, int]:
    """The owned leaf each state path of `rest` belongs to: for every bit `b` of a position among `owned`, a leaf's
    path is on exactly one of the views holding the leaves with `b` set and with `b` clear."""
    if not rest:
        return {}
    bits = {path: 0 for path in rest}
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
