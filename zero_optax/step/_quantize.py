"""The block-wise int8 codec of zero1's quantized collectives (ZeRO++'s qwZ and qgZ), and `Quantize`, its option.

A block of `block_size` elements travels as a float32 `scale = absmax / 127` and int8 codes `round(x / scale)`.
Both divisions are written as multiplications by a float32 reciprocal, as XLA compiles them, so that a numpy
reference reproduces the codes bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError

QMAX = 127  # codes lie in [-127, 127], symmetric
_INV_QMAX = np.float32(1) / np.float32(QMAX)

INT8 = "int8"


@dataclasses.dataclass(frozen=True)
class Quantize:
    """Quantized collectives for `zero_optax.zero1(..., quantize=zo.Quantize(...))` (ZeRO++'s qwZ and qgZ).

    Attributes:
      params: `"int8"`: new parameters travel in zero1's all-gathers as int8 codes with one float32 scale per
        block; every device then holds the int8 rounding of the master copy, which `master_dtype` (required)
        keeps exact. None: exact.
      grads: `"int8"`: gradients are reduce-scattered as int8 blocks through an all-to-all and summed in float32,
        within the senders' half-scales of the exact sum. Only inside `shard_map` (a mesh-bound zero1 under
        `jax.jit` receives gradients XLA has already reduced). None: exact.
      block_size: elements per scale; small blocks keep outliers local.
      axes: the mesh axes whose collectives are quantized (for example only zero1's `replica_axis`); None: all.

    Raises:
      ZeroError: an option is neither None nor `"int8"`, `block_size` is no positive int, or `axes` names no axis.

    Examples:
      >>> import zero_optax as zo
      >>> zo.Quantize(params="int8", grads="int8", block_size=256).grads
      'int8'
    """

    params: str | None = None
    grads: str | None = None
    block_size: int = 256
    axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("params", "grads"):
            if getattr(self, name) not in (None, INT8):
                raise ZeroError(f"Quantize({name}=...) must be None or \"int8\", got {getattr(self, name)!r}.")
        check_block_size(self.block_size)
        if self.axes is not None:
            axes = (self.axes,) if isinstance(self.axes, str) else self.axes
            if not isinstance(axes, Sequence) or not axes or not all(isinstance(a, str) and a for a in axes):
                raise ZeroError(f"Quantize(axes=...) must be None or mesh axis names, got {self.axes!r}.")
            object.__setattr__(self, "axes", tuple(axes))

    def quantizes(self, kind: str, axes: Sequence[str]) -> bool:
        """Whether a collective of `kind` (`"params"` or `"grads"`) over `axes` is quantized."""
        return getattr(self, kind) == INT8 and bool(axes) and (self.axes is None or bool(set(axes) & set(self.axes)))


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_block_size(block_size) -> int:
    if not _is_int(block_size) or block_size < 1:
        raise ZeroError(f"block_size must be a positive int (the elements that share one scale), got {block_size!r}.")
    return int(block_size)


def check_vector(x, what: str) -> jax.Array:
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise ZeroError(f"{what}: x must be a 1-D floating array, got {type(x).__name__}.")
    if x.ndim != 1:
        raise ZeroError(f"{what}: x must be a 1-D floating array, got shape {tuple(x.shape)}; flatten it first "
                        "(x.reshape(-1)).")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ZeroError(f"{what}: x must be a 1-D floating array, got dtype {x.dtype}.")
    return x


def check_axes(axes, what: str) -> tuple[str, ...]:
    names = _compat.as_tuple(axes) if isinstance(axes, (str, tuple, list)) else None
    if not names or not all(isinstance(a, str) for a in names):
        raise ZeroError(f"{what}: axes must be a non-empty tuple of mesh axis names, such as ('data',), got "
                        f"{axes!r}.")
    return names


def padded_size(n: int, block_size: int) -> int:
    """`n` rounded up to a multiple of `block_size` (0 stays 0).

    Examples:
      >>> padded_size(10, 4)
      12
      >>> padded_size(8, 4), padded_size(0, 4)
      (8, 0)
    """
    block_size = check_block_size(block_size)
    if not _is_int(n) or n < 0:
        raise ZeroError(f"n must be a non-negative int (an element count), got {n!r}.")
    return -(-int(n) // block_size) * block_size


def quantize_rows(x: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Int8 codes and float32 scales of the float32 `x`, in blocks along its last axis (a multiple of them)."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    scales = jnp.max(jnp.abs(blocks), axis=-1, initial=0.0) * _INV_QMAX
    inverse = jnp.float32(1) / jnp.where(scales == 0, jnp.float32(1), scales)  # a zero block's codes are 0
    q = jnp.clip(jnp.round(blocks * inverse[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return q.reshape(x.shape), scales


def dequantize_rows(q: jax.Array, scales: jax.Array, block_size: int) -> jax.Array:
    """`quantize_rows` inverted: float32 `[..., padded]`."""
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // block_size, block_size).astype(jnp.float32)
    return (blocks * scales[..., None]).reshape(q.shape)


def pad_last(x: jax.Array, padded: int) -> jax.Array:
    pad = padded - x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def quantize(x: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Int8 codes and float32 scales of the 1-D floating `x`, zero-padded to whole blocks.

    Examples:
      >>> import jax.numpy as jnp
      >>> q, scales = quantize(jnp.array([1.0, -0.5, 0.25, 0.0, 0.0, 0.0]), 3)
      >>> q
      Array([127, -64,  32,   0,   0,   0], dtype=int8)
      >>> scales
      Array([0.00787402, 0.        ], dtype=float32)
    """
    block_size = check_block_size(block_size)
    x = check_vector(x, "quantize")
    x = pad_last(x.astype(jnp.float32), padded_size(x.shape[0], block_size))
    return quantize_rows(x, block_size)
