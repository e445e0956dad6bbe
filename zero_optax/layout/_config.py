"""`Config`: zero1's arguments as one validated value, the same for every stage of `init` and `update`."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import optax

from zero_optax.core import _compat


@dataclasses.dataclass(frozen=True)
class Config:
    """The arguments of `zero1`, validated once (`zero_optax.api._zero1._config`): what every stage receives."""

    inner: optax.GradientTransformationExtraArgs
    axis_name: str | tuple[str, ...]
    partition: str
    owners: tuple[int, ...] | None
    reduce: str | None          # "default", "psum", "psum_scatter", or None: the gradients are the global mean
    reduce_dtype: Any
    master_dtype: Any
    assume_elementwise: bool
    bucket_bytes: int
    accumulating: Any = None    # `Accumulating` with accumulate_steps > 1 (`inner` is its final step)
    offload: bool = False       # the stored arrays live in `pinned_host` memory between steps
    typed_init: Any = None      # the inner `init` whose typed PRNG keys `inner` holds as key data
    param_specs: Any = None     # the parameters' PartitionSpecs (`zero1(..., param_specs=)`)
    replica_axes: tuple[str, ...] = ()  # the state is replicated over these (`replica_axis=`)
    quantize: Any = None        # a `Quantize`, or None: every collective exact

    @property
    def accumulate(self) -> str | None:
        return None if self.accumulating is None else self.accumulating.mode

    @property
    def accumulate_steps(self) -> int:
        return 1 if self.accumulating is None else self.accumulating.steps

    @property
    def axes(self) -> tuple[str, ...]:
        return _compat.as_tuple(self.axis_name)

    def inner_dtype(self, dtype) -> np.dtype:
        """The dtype the inner optimizer sees a leaf's gradients, parameters and state in."""
        return np.dtype(self.master_dtype) if self.master_dtype is not None else np.dtype(dtype)
