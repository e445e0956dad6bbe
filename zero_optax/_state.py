"""The state pytrees zero1 returns. Every array leaf is sharded along its leading axis over the data axis."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from zero_optax._layout import Layout


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inner_state"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ZeroFlatState:
    """State of `zero1(..., partition="flat")`.

    Attributes:
      inner_state: the inner optimizer's state over this device's coordinate slices. Every leaf has a leading
        device axis: a coordinate history of leaf `i` is `[N, slots_i]` globally (row `r` = device `r`'s
        coordinates `[r*slots_i, (r+1)*slots_i)` of the flattened leaf, zero-padded), a shared scalar such as a
        step count is `[N]` (one identical copy per device). Sharding: `P(axis_name)` on every leaf.
      layout: static description of the partition (see `zero_optax.describe`).
    """

    inner_state: Any
    layout: Layout


@functools.partial(jax.tree_util.register_dataclass, data_fields=["buffers"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ZeroLeafState:
    """State of `zero1(..., partition="leaf")`.

    Attributes:
      buffers: dtype name -> `[N, size]` packed buffer; row `r` holds, in the inner state's flatten order, the
        complete state of the leaves device `r` owns plus its copy of the shared entries (step counts), padded
        with zeros to the largest device's share. Sharding: `P(axis_name)`.
      layout: static description, including each entry's offset (`layout.state_packing`).
    """

    buffers: dict[str, jax.Array]
    layout: Layout


ZeroState = ZeroFlatState | ZeroLeafState
