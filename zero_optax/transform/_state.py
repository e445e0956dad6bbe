"""The state pytree zero1 returns. Every array leaf is sharded along its leading axis over the ZeRO axes."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax

from zero_optax.transform._layout import Layout


class SlicedState(NamedTuple):
    """How `ZeroState.inner_state` stores the inner optimizer's state of the sliced leaves.

    Attributes:
      shared: one `[N, *shape]` array per shared entry (`Layout.shared_entries`: step counts, schedules), one
        identical copy per device (sharding `P(ZeRO axes)`).
      histories: per group of sliced leaves (`Layout.groups`), per history of its members (Adam's `mu`, `nu`):
        one 1-D array of `blocks * group * size` elements. Device `r`'s `size` elements are the concatenation of
        its `slots` coordinates of every member (padding zeroed), so one array holds that history of many leaves
        (sharding `P((*leaf axes, *ZeRO axes))`). A group that a device holds whole, one leaf of two or more
        dimensions (`Group.shape`), keeps it in the leaf's shape: `(blocks * shape[0], *shape[1:])`, the same
        elements in the same order, sharded along the first dimension.
    """

    shared: tuple[jax.Array, ...]
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


ZeroFlatState = ZeroState
"""Alias kept from zero_optax 0.1 (the flat partition's state is a `ZeroState`)."""

ZeroLeafState = ZeroState
"""Alias kept from zero_optax 0.1 (the leaf partition's state is a `ZeroState`)."""


def is_state(x: Any) -> bool:
    return isinstance(x, ZeroState)


def find_states(tree: Any) -> list[ZeroState]:
    """Every zero1 state inside `tree`, in tree order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]
