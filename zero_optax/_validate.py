"""Checks shared by both partitions: the state, gradients and parameters match the layout."""

from __future__ import annotations

import jax
import numpy as np

from zero_optax import _compat
from zero_optax._errors import ZeroStructureError
from zero_optax._layout import Layout


def check_layout(state, state_type: type, axis_name: str) -> Layout:
    """The state's layout, after checking its type, its axis and the world size of the enclosing mesh."""
    if not isinstance(state, state_type):
        raise ZeroStructureError(
            f"zero1 update expected a {state_type.__name__} from this transformation's init, got "
            f"{type(state).__name__}. Pass the opt_state returned by tx.init (inside jax.shard_map).")
    layout = state.layout
    n = _compat.axis_size(axis_name)
    if layout.axis_name != axis_name or layout.world_size != n:
        raise ZeroStructureError(
            f"This state was initialised for axis `{layout.axis_name}` with {layout.world_size} devices, but "
            f"update runs over axis `{axis_name}` with {n}. Re-initialise, or reshard the checkpoint with "
            "zero_optax.reshard.")
    return layout


def check_tree(tree, layout: Layout, what: str) -> list[jax.Array]:
    """The leaves of `tree` after checking structure and shapes against the parameters of `layout`."""
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != layout.treedef:
        raise ZeroStructureError(
            f"The {what} do not have the structure of the parameters this state was initialised with.\n"
            f"  {what}: {treedef}\n  parameters: {layout.treedef}")
    for x, leaf in zip(leaves, layout.leaves):
        if tuple(np.shape(x)) != leaf.shape:
            raise ZeroStructureError(
                f"The {what} leaf `{leaf.path}` has shape {tuple(np.shape(x))}, but the parameter has shape "
                f"{leaf.shape}.")
    return leaves
