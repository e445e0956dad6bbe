"""Block-wise int8 quantized collectives in plain JAX: DeepSpeed ZeRO++'s quantized weights (qwZ, an all-gather)
and quantized gradients (qgZ, a reduce-scatter done as an all-to-all).

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

* `all_gather`: every device quantizes its own block, the codes and scales are all-gathered (two all-gathers,
  typed invariant like `zero_optax.core._compat.all_gather_invariant`), and every device dequantizes every
  sender's block.
* `reduce_scatter`: every device quantizes each of its `n` parts (part `r` destined to device `r`, as
  `zero_optax.core._compat.psum_scatter` takes them), one `lax.all_to_all` of the codes and one of the scales
  deliver to every device the `n` quantized parts destined to it, and it dequantizes and sums them in float32.
  Each part is quantized once, by its sender, so the error of the sum is at most the sum over the senders of
  their blocks' `scale / 2`.

These are the primitives only; nothing in zero1 uses them yet.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError

QMAX = 127
"""The largest int8 code: codes lie in [-127, 127], symmetric, so a block's scale is its absmax / 127."""

_INV_QMAX = np.float32(1) / np.float32(QMAX)
"""float32(1 / 127): a block's scale is its absmax times this (what XLA makes of `absmax / 127`)."""

SCALE_BYTES = 4
"""Bytes of one block's scale on the wire (float32)."""


def _check_block_size(block_size) -> int:
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ZeroError(f"block_size must be a positive int (the elements that share one scale), got {block_size!r}.")
    return int(block_size)


def _check_vector(x, what: str) -> jax.Array:
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise ZeroError(f"{what}: x must be a 1-D floating array, got {type(x).__name__}.")
    if x.ndim != 1:
        raise ZeroError(f"{what}: x must be a 1-D floating array, got shape {tuple(x.shape)}; flatten it first "
                        "(x.reshape(-1)).")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ZeroError(f"{what}: x must be a 1-D floating array, got dtype {x.dtype}.")
    return x


def _check_axes(axes, what: str) -> tuple[str, ...]:
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
    block_size = _check_block_size(block_size)
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


def _quantize_rows(x: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Codes and scales of `x` (`[..., padded]` float32, `padded` a multiple of `block_size`), blocks along the
    last axis: int8 `[..., padded]` and float32 `[..., padded // block_size]`."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    scales = jnp.max(jnp.abs(blocks), axis=-1, initial=0.0) * _INV_QMAX
    inverse = jnp.float32(1) / jnp.where(scales == 0, jnp.float32(1), scales)  # one division per block
    q = jnp.clip(jnp.round(blocks * inverse[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return q.reshape(x.shape), scales


def _dequantize_rows(q: jax.Array, scales: jax.Array, block_size: int) -> jax.Array:
    """`_quantize_rows` inverted: float32 `[..., padded]`."""
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // block_size, block_size).astype(jnp.float32)
    return (blocks * scales[..., None]).reshape(q.shape)


def _pad_last(x: jax.Array, padded: int) -> jax.Array:
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
    block_size = _check_block_size(block_size)
    x = _check_vector(x, "quantize")
    x = _pad_last(x.astype(jnp.float32), padded_size(x.shape[0], block_size))
    return _quantize_rows(x, block_size)


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
    return _dequantize_rows(q, scales.astype(jnp.float32), block_size)[:size].astype(dtype)


def all_gather(x: jax.Array, axes: tuple[str, ...], block_size: int) -> jax.Array:
    """Every device's `x` over `axes`, concatenated (like `all_gather_invariant(x, axes, tiled=True)`), each
    block as its block-wise int8 rounding. Inside `jax.shard_map`.

    Each device quantizes its own `x`; the codes and the scales are all-gathered (`wire_bytes(x.size,
    block_size)` per device instead of `x.nbytes`) and every sender's block is dequantized. Typed invariant across
    `axes` (so `out_specs=P()` holds over them).

    Args:
      x: this device's 1-D floating block, the same length on every device.
      axes: the mesh axes to gather over (row-major device order over a tuple).
      block_size: elements per scale.

    Returns:
      `[n * x.size]` in `x.dtype`, `n` the product of the sizes of `axes`.
    """
    block_size = _check_block_size(block_size)
    x = _check_vector(x, "all_gather")
    axes = _check_axes(axes, "all_gather")
    n = _compat.axis_size(axes, "all_gather")
    size = x.shape[0]
    q, scales = quantize(x, block_size)
    q = _compat.all_gather_invariant(q, axes, tiled=True).reshape(n, -1)
    scales = _compat.all_gather_invariant(scales, axes, tiled=True).reshape(n, -1)
    return _dequantize_rows(q, scales, block_size)[:, :size].reshape(-1).astype(x.dtype)


def reduce_scatter(x: jax.Array, axes: tuple[str, ...], block_size: int) -> jax.Array:
    """This device's part of the sum over `axes` of every device's `x` (like `psum_scatter(x, axes)`), each part
    quantized block-wise by its sender; float32. Inside `jax.shard_map`.

    `x` is `n` parts of `rows` elements, part `r` destined to device `r` (`n` the product of the sizes of `axes`,
    devices row-major over a tuple). Each part is zero-padded to `padded_size(rows, block_size)` and quantized;
    one all-to-all of the codes and one of the scales hand every device the `n` parts destined to it
    (`n * wire_bytes(rows, block_size)` bytes through each device), which it dequantizes and sums in float32,
    senders in order 0..n-1. Typed varying across `axes`, as `psum_scatter`'s result is.

    Args:
      x: this device's 1-D floating `[n * rows]` values.
      axes: the mesh axes to reduce over.
      block_size: elements per scale.

    Returns:
      float32 `[rows]`.
    """
    block_size = _check_block_size(block_size)
    x = _check_vector(x, "reduce_scatter")
    axes = _check_axes(axes, "reduce_scatter")
    n = _compat.axis_size(axes, "reduce_scatter")
    if x.shape[0] % n:
        raise ZeroError(f"reduce_scatter: x's length {x.shape[0]} is not a multiple of the {n} devices of {axes}.")
    rows = x.shape[0] // n
    parts = _pad_last(x.astype(jnp.float32).reshape(n, rows), padded_size(rows, block_size))
    q, scales = _quantize_rows(parts, block_size)
    q, scales = _compat.pvary((q, scales), axes)  # all_to_all takes values typed varying across its axes
    # lax.all_to_all over a tuple of axes (row-major, like psum_scatter's device order) works on JAX 0.10.2 and
    # 0.12 alike (tests/test_quantize.py checks the order on a (2, 4) mesh): no per-axis emulation is needed.
    axis = _compat._axis_arg(axes)
    q = lax.all_to_all(q, axis, 0, 0, tiled=True)            # row s: sender s's part for this device
    scales = lax.all_to_all(scales, axis, 0, 0, tiled=True)
    received = _dequantize_rows(q, scales, block_size)
    total = functools.reduce(operator.add, [received[s] for s in range(n)])
    return total[:rows]
