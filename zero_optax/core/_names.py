"""How zero_optax names leaf paths, tree structures and stored arrays, whatever the JAX release prints, so that a
checkpoint written today still validates after an upgrade."""

from __future__ import annotations

from typing import Any

import jax

_KEYS = {jax.tree_util.DictKey: lambda k: f"[{k.key!r}]", jax.tree_util.GetAttrKey: lambda k: f".{k.name}",
         jax.tree_util.SequenceKey: lambda k: f"[{k.idx}]", jax.tree_util.FlattenedIndexKey: lambda k: f"[{k.key}]"}


def key_path(path: tuple) -> str:
    """A key path (from `jax.tree_util.tree_flatten_with_path`) as text, e.g. `.mu['w']` or `[0].count`."""
    return "".join(_KEYS.get(type(k), lambda k: f"[{k!s}]")(k) for k in path)


def leaf_paths(tree: Any, is_leaf=None) -> list[str]:
    """The `key_path` of every leaf of `tree`, in flatten order."""
    return [key_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


def tree_signature(tree: Any, is_leaf=None) -> str:
    """`tree`'s structure by node type and key, leaves as `*`: `tuple([0]=ScaleByAdamState(.count=*,...),...)`."""
    def walk(node: Any) -> str:
        if is_leaf is not None and is_leaf(node):
            return "*"
        children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
        if len(children) == 1 and children[0][0] == () and children[0][1] is node:
            return "*"  # a leaf
        inner = ",".join(f"{key_path(path)}={walk(child)}" for path, child in children)
        return f"{type(node).__name__}({inner})"

    return walk(tree)


# Every name a checkpoint stores is formatted here from validated values, never taken from a record, so no record
# can point outside its item directory.

RECORD_FILE = "zero_record.json"
"""The file, in an item directory, that holds the record (`zero_optax.checkpoint._record`)."""

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._")


def _checked(name: str) -> str:
    if not name or not set(name) <= _NAME_CHARS or ".." in name or name[0] == ".":
        raise ValueError(f"not a valid zero_optax array name: {name!r}")  # only reachable through a bug
    return name


def entry_array(state: int, entry: int) -> str:
    """The array of unowned entry `entry` of zero1 state `state`, e.g. `0.entry0003`."""
    return _checked(f"{int(state)}.entry{int(entry):04d}")


def buffer_array(state: int, dtype: str) -> str:
    """The packed `[N, size]` buffer of dtype `dtype` of zero1 state `state`, e.g. `0.buffer_float32`."""
    return _checked(f"{int(state)}.buffer_{dtype}")


def local_array(state: int, leaf: int) -> str:
    """The local gradient accumulator of leaf `leaf` of zero1 state `state`, e.g. `0.local0002`."""
    return _checked(f"{int(state)}.local{int(leaf):04d}")


def block_key(path: str, block: int, blocks: int) -> str:
    """A parameter block's key in `RankRecord.params`: `path` for one block, else `path#block<b>`."""
    return path if blocks == 1 else f"{path}#block{int(block)}"
