"""The block-wise int8 codec of zero1's quantized collectives (DeepSpeed ZeRO++'s quantized weights, qwZ, and
quantized gradients, qgZ), in plain JAX, and `Quantize`, the option that turns them on.

A 1-D value is cut into blocks of `block_size` consecutive elements (the tail block zero-padded). Each block
travels as one float32 scale and `block_size` int8 codes::

    scale = max(|x| over the block) / 127
    q     = clip(round_half_to_even(x / scale), -127, 127)     (int8; -128 is never used)
    x    ~= q * scale

A block of zeros has scale 0 and codes 0 (where the scale is 0 the division is by 1), and comes back as zeros.
Rounding to the nearest code puts every element within `scale / 2` of its original value (up to float32 rounding,
a few ulps of the block's absmax), so an outlier costs precision only to the elements of its own block.

In float32 both divisions are multiplications by a reciprocal, written out: `scale = absmax * float32(1 / 127)`
and `q = round(x * (1 / scale))`, with `1 / scale` one float32 division per block. XLA's algebraic simplifier
rewrites a division by a broadcast value (`absmax / 127`, `x / scale` over a block) into exactly these
multiplications, eagerly and under `jax.jit` alike, so they are what `/` would compute on XLA:CPU anyway (an ulp
off numpy's correctly rounded division for about one scale in twenty); written out, the codes no longer depend on
that rewrite, and a numpy reference reproduces them bit for bit (`tests/test_quantize.py`).

On the wire a block of `b` elements costs `b + 4` bytes instead of `4 b` (`wire_bytes`).

The collectives built on these (`zero_optax.step._wire.quantized_all_gather`, and
`quantized_reduce_scatter`, an all-to-all) are the wire's, as every collective zero1 emits is:

* the all-gather: every device quantizes its own block, the codes and scales are all-gathered, and every device
  dequantizes every sender's block;
* the reduce-scatter: every device quantizes each of its `n` parts (part `r` destined to device `r`), one
  all-to-all of the codes and one of the scales deliver to every device the `n` parts destined to it, and it
  dequantizes and sums them in float32. Each part is quantized once, by its sender, so the error of the sum is
  at most the sum over the senders of their blocks' `scale / 2`.

`Quantize` is what `zero1(..., quantize=)` takes (issue 33).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError

QMAX = 127
"""The largest int8 code: codes lie in [-127, 127], symmetric, so a block's scale is its absmax / 127."""

_INV_QMAX = np.float32(1) / np.float32(QMAX)
"""float32(1 / 127): a block's scale is its absmax times this (what XLA makes of `absmax / 127`)."""

SCALE_BYTES = 4
"""Bytes of one block's scale on the wire (float32)."""

INT8 = "int8"


@dataclasses.dataclass(frozen=True)
class Quantize:
    """Quantized collectives for `zero_optax.zero1(..., quantize=zo.Quantize(...))` (ZeRO++'s qwZ and qgZ).

    Attributes:
      params: `"int8"`: the new parameters travel in zero1's all-gathers as int8 codes with one float32 scale per
        block of `block_size` (about a quarter of the float32 bytes); every device then holds the block-wise int8
        rounding of the master copy (within `scale / 2` of it per element, the same on every device). Requires
        `zero1(..., master_dtype=...)`, so that the master copy stays exact and the rounding never accumulates.
        None: exact.
      grads: `"int8"`: each device quantizes its gradients per block, the blocks are exchanged by all-to-all,
        and each receiver dequantizes and sums them in float32 (the reduce-scatter; over replica axes, the same
        reduce-scatter followed by an int8 all-gather of the sums). The reduced gradient then differs from the
        exact sum by at most the senders' half-scales summed (each part is quantized once, by its sender; the
        replica level adds its own). Only inside `shard_map`: a mesh-bound zero1 under `jax.jit` receives
        gradients XLA has already reduced. None: exact.
      block_size: elements per scale (DeepSpeed uses about 4k, at most 16k; 256 keeps the scales at 1.6% of the
        bytes and outliers local).
      axes: the mesh axes whose collectives are quantized (a collective over any of them is), for example only
        zero1's `replica_axis`; None: all of them.

    Examples:
      >>> import zero_optax as zo
      >>> zo.Quantize(params="int8", grads="int8", block_size=256).grads
      'int8'
    """

    params: str | None = None
    grads: str | None = None
    block_size: int = 256
    axes: tuple[str, ...] | None = None

    def __post_init__(self):
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


def check_block_size(block_size) -> int:
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
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
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ZeroError(f"n must be a non-negative int (an element count), got {n!r}.")
    return -(-int(n) // block_size) * block_size


def wire_bytes(n_elements: int, block_size: int) -> int:
    """Bytes one quantized copy of `n_elements` values costs on the wire: one int8 code per (padded) element and
    one float32 scale per block.

    Examples:
      >>> wire_bytes(10, 4)  # 12 codes + 3 scales
      24
      >>> wire_bytes(1024, 256), 4 * 1024
      (1040, 4096)
    """
    padded = padded_size(n_elements, block_size)
    return padded + SCALE_BYTES * (padded // block_size)


def quantize_rows(x: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Codes and scales of `x` (`[..., padded]` float32, `padded` a multiple of `block_size`), blocks along the
    last axis: int8 `[..., padded]` and float32 `[..., padded // block_size]`."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    scales = jnp.max(jnp.abs(blocks), axis=-1, initial=0.0) * _INV_QMAX
    inverse = jnp.float32(1) / jnp.where(scales == 0, jnp.float32(1), scales)  # one division per block
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
    """Block-wise int8 codes and float32 scales of the 1-D floating `x` (computed in float32).

    `x` is zero-padded to `padded_size(x.size, block_size)`; block `k` is elements `[k*block_size,
    (k+1)*block_size)`, with `scale = absmax / 127` and `q = clip(round(x / scale), -127, 127)` (round half to
    even; where the scale is 0 the division is by 1, so a block of zeros has codes 0). Both divisions are float32
    multiplications by a reciprocal (`absmax * float32(1 / 127)`, `x * (1 / scale)`; see the module docstring).

    Args:
      x: a 1-D array of any floating dtype.
      block_size: elements per scale (a positive int).

    Returns:
      `(q, scales)`: int8 `[padded]` and float32 `[padded // block_size]`.

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


def dequantize(q: jax.Array, scales: jax.Array, size: int, dtype) -> jax.Array:
    """The values `quantize` encoded: `q * scale` per block in float32, the first `size` elements, as `dtype`.

    Args:
      q: int8 `[nblocks * block_size]` codes.
      scales: float32 `[nblocks]`; the block size is `q.size // scales.size`.
      size: how many elements to keep (the length `quantize` was given).
      dtype: the result's dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([1.0, -0.5, 0.25, 3.0, 0.0])
      >>> dequantize(*quantize(x, 3), x.size, jnp.float32)
      Array([ 1.       , -0.503937 ,  0.2519685,  3.       ,  0.       ], dtype=float32)
    """
    if q.ndim != 1 or scales.ndim != 1:
        raise ZeroError(f"dequantize: q and scales must be 1-D, got shapes {tuple(q.shape)} and "
                        f"{tuple(scales.shape)}.")
    nblocks = scales.shape[0]
    if (nblocks == 0 and q.shape[0]) or (nblocks and q.shape[0] % nblocks):
        raise ZeroError(f"dequantize: q's length {q.shape[0]} is not a multiple of the {nblocks} scales.")
    block_size = q.shape[0] // nblocks if nblocks else 1
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or not 0 <= size <= q.shape[0]:
        raise ZeroError(f"dequantize: size must be an int in [0, {q.shape[0]}] (q's length), got {size!r}.")
    return dequantize_rows(q, scales.astype(jnp.float32), block_size)[:size].astype(dtype)
