"""The inner transformation's masked views of one layout, and what they return, computed once per layout.

A view is the parameter tree with some leaves present and every other leaf `optax.MaskedNode()`: a group's first
member holding the group's part of the buffer, the joint view of every sliced leaf, or the leaves an owner updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_optax.layout import _fusion, _layout
from zero_optax.layout._config import Config
from zero_optax.layout._layout import Layout


def tree(layout: Layout, values: list) -> Any:
    """The parameter-shaped tree of `values`, one per leaf."""
    return jax.tree_util.tree_unflatten(layout.treedef, values)


def masked_tree(layout: Layout, values: dict[int, Any]) -> Any:
    """A parameter-shaped tree holding `values` (leaf index -> array) and `optax.MaskedNode()` elsewhere."""
    return tree(layout, _layout.masked_view([values.get(i) for i in range(len(layout.leaves))], values))


def owned_entries(layout: Layout, r: int, leaves: Sequence[int] | None = None) -> list[int]:
    """The inner entries of device `r`'s view of `leaves` (all it owns by default): shared entries and histories."""
    mine = {i for i, leaf in enumerate(layout.leaves) if leaf.owner == r} if leaves is None else set(leaves)
    shared = set(layout.view_shared(mine))
    return [j for j in layout.inner_entries if j in shared or layout.entries[j].leaf in mine]


class Views:
    """The treedefs of the inner state on the views of one `Config`'s layouts, and the updates' dtypes (cached)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._cache: dict = {}

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def group(self, layout: Layout, g: int | None) -> tuple[Any, list[int]]:
        """Group `g`'s view (of no leaf when None): its state treedef and the entries it stands for, in order."""
        def make():
            group = None if g is None else layout.groups[g]
            present = set() if group is None else {group.first}
            order = sorted(layout.view_shared(present) + (() if group is None else group.histories[0]))
            what = "with no leaf" if group is None else f"on the sliced leaf `{layout.leaves[group.first].path}`"
            return _fusion.view_treedef(self.cfg, layout, present, order, what), order
        return self._cached((layout, g), make)

    def joint(self, layout: Layout) -> tuple[Any, list[int]]:
        """The view of every sliced leaf (`Layout.joint`): its state treedef and the entries, in order."""
        def make():
            present = {g.first for g in layout.groups}
            order = sorted(layout.view_shared(present) + tuple(j for g in layout.groups for j in g.histories[0]))
            return _fusion.view_treedef(self.cfg, layout, present, order, "on the sliced leaves"), order
        return self._cached((layout, "joint"), make)

    def owned(self, layout: Layout, r: int, leaves: Sequence[int] | None = None):
        """The state treedef of device `r`'s view of `leaves` (all it owns by default)."""
        present = frozenset(i for i, leaf in enumerate(layout.leaves) if leaf.owner == r) if leaves is None \
            else frozenset(leaves)
        return self._cached((layout, r, present), lambda: _fusion.view_treedef(
            self.cfg, layout, set(present), owned_entries(layout, r, present), f"on device {r}"))

    def update_dtypes(self, layout: Layout, extra: dict, phase=None) -> dict[int, str]:
        """Per leaf, the dtype of the inner update's result (of `phase`'s under accumulation), from one abstract
        trace of a view holding one member of each group and stack and every other owned leaf."""
        key = (layout, phase, jax.tree.structure(extra), tuple((np.shape(x), jnp.result_type(x))
                                                                for x in jax.tree.leaves(extra)))
        inner = self.cfg.inner if phase is None else phase.inner

        def make():
            first = {i: g.first for g in layout.groups for i in g.leaves}
            first.update((i, s[0]) for s in layout.stacks for i in s)
            present = {first.get(i, i) for i in range(len(layout.leaves))}
            structs = [jax.ShapeDtypeStruct(layout.view_shape(leaf), self.cfg.inner_dtype(leaf.dtype))
                       for leaf in layout.leaves]
            view = tree(layout, _layout.masked_view(structs, present))
            state = jax.eval_shape(inner.init, view)
            updates, _ = jax.eval_shape(lambda g, s, p, e: inner.update(g, s, p, **e), view, state, view, extra)
            got = {i: np.dtype(u.dtype).name for i, u in zip(sorted(present), jax.tree.leaves(updates))}
            return {i: got[first.get(i, i)] for i in range(len(layout.leaves))}
        return self._cached(key, make)
