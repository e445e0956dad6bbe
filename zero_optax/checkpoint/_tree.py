"""The zero1 states inside an optimizer state: found, named, and put back.

A zero1 state may stand alone, nest in a larger optax state, or sit in Flax `nnx.Variable`s (stripped first); every
other leaf is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zero_optax.core import _compat, _names
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._state import ZeroState, is_state


@dataclasses.dataclass(frozen=True)
class Split:
    """A pytree taken apart at its zero1 states: `(path, state)` of each in tree order (`<root>` for the tree
    itself), and the tree's `_names.tree_signature` with each shown as `*`."""

    states: list[tuple[str, ZeroState]]
    signature: str
    treedef: Any


def split(tree: Any, what: str) -> Split:
    """The zero1 states of `tree` (Flax Variables stripped); refuses a tree without one or with other leaves."""
    tree = _compat.pure(tree)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)
    for path, leaf in flat:
        if not is_state(leaf):
            raise ZeroCheckpointError(
                f"{what} has a leaf outside any zero1 state at `{_names.key_path(path)}` ({type(leaf).__name__}). "
                "ZeroSave/ZeroRestore handle only zero1 states (and empty nodes such as optax.EmptyState()); save "
                "other arrays with ocp.args.StandardSave as a separate item of ocp.args.Composite.")
    if not flat:
        raise ZeroCheckpointError(f"{what} contains no zero1 state (a ZeroState from zero_optax.zero1).")
    return Split([(_names.key_path(path) or "<root>", leaf) for path, leaf in flat],
                 _names.tree_signature(tree, is_leaf=is_state), treedef)


def put_back(original: Any, parts: Split, states: list[ZeroState]) -> Any:
    """`states` in place of the zero1 states of `original`, keeping its Flax Variables if it has any."""
    pure = jax.tree.unflatten(parts.treedef, states)
    if _compat.pure(original) is original:
        return pure
    return jax.tree.unflatten(jax.tree.structure(original), jax.tree.leaves(pure))


def where(i: int, path: str) -> str:
    """How error messages name zero1 state `i`."""
    return f"zero1 state {i} (at `{path}`)"
