"""Block-wise int8 quantized collectives (`zero_optax.step._quantize`) against numpy references written here.

The references (`np_quantize`, `np_dequantize`, and the per-device gathers and sums built from them) use none of
the module's helpers: numpy's `np.round` rounds half to even like `jnp.round`, and every float32 operation is the
same IEEE operation in both, so codes and scales must match bit for bit.

The scale is `absmax * float32(1/127)` and the codes `round(x * float32(1 / scale))`: XLA compiles `absmax / 127`
and `x / scale[:, None]` into exactly these multiplications by a reciprocal (its algebraic simplifier rewrites a
division by a broadcast), which differ from numpy's true division by an ulp in about 1 scale in 20, so the module
writes them out and the reference follows (`test_xla_divides_by_a_broadcast_as_a_reciprocal` pins the rewrite).
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError
from benchmarks.hlo import collective_ops
from zero_optax.step import _quantize as qz
from zero_optax.step import _wire as wire

# ---------------------------------------------------------------------------------------------- numpy references


def np_quantize(x: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (int8) and scales (float32) of the 1-D `x`, computed in float32 with numpy."""
    x = np.asarray(x).astype(np.float32)
    padded = -(-x.size // b) * b
    blocks = np.concatenate([x, np.zeros(padded - x.size, np.float32)]).reshape(-1, b)
    absmax = np.abs(blocks).max(axis=1) if blocks.size else np.zeros(0, np.float32)
    scales = (absmax * (np.float32(1) / np.float32(127))).astype(np.float32)
    inverse = (np.float32(1) / np.where(scales == 0, np.float32(1), scales)).astype(np.float32)
    q = np.clip(np.round(blocks * inverse[:, None]), -127, 127).astype(np.int8)
    return q.reshape(-1), scales


def np_dequantize(q: np.ndarray, scales: np.ndarray, size: int) -> np.ndarray:
    b = q.size // scales.size
    return (q.reshape(-1, b).astype(np.float32) * scales[:, None]).reshape(-1)[:size]


def np_roundtrip(x: np.ndarray, b: int) -> np.ndarray:
    return np_dequantize(*np_quantize(x, b), np.asarray(x).size)


def element_scales(x: np.ndarray, b: int) -> np.ndarray:
    """The scale of the block each element of `x` falls in (float64)."""
    return np.repeat(np_quantize(x, b)[1].astype(np.float64), b)[:np.asarray(x).size]


def spiky(rng: np.random.Generator, n: int, spikes: int = 3) -> np.ndarray:
    """Small normal values with a few +-1e3 outliers."""
    x = rng.normal(size=n).astype(np.float32) * np.float32(1e-3)
    idx = rng.choice(n, size=min(spikes, n), replace=False)
    x[idx] = rng.choice([-1e3, 1e3], size=idx.size).astype(np.float32)
    return x


def wire_bytes(n_elements: int, block_size: int) -> int:
    """Bytes one quantized copy of `n_elements` values costs on the wire: a code an element, a float32 scale a block."""
    padded = qz.padded_size(n_elements, block_size)
    return padded + 4 * (padded // block_size)


def to_dtype(x: np.ndarray, dtype) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else x.astype(dtype)


# ---------------------------------------------------------------------------------------------- pure functions


def test_padded_size_and_wire_bytes():
    assert [qz.padded_size(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 4, 4, 8, 8, 12]
    assert qz.padded_size(7, 1) == 7
    assert wire_bytes(10, 4) == 12 + 4 * 3
    assert wire_bytes(0, 4) == 0
    assert wire_bytes(1024, 256) == 1024 + 16


def cases():
    rng = np.random.default_rng(0)
    x64 = spiky(rng, 64)
    x70 = spiky(rng, 70)                       # 70 = 4 blocks of 16 + 6: a padded tail
    x70[16:32] = 0                             # an all-zero block
    x70[40:48] = rng.normal(size=8) * 1e-3
    x70[45] = -7e2                             # a block whose absmax is negative
    x5 = np.array([-3.0, 1.0, 0.5, -0.25, 2.0], np.float32)  # shorter than one block, negative max
    return [("div", x64, 16), ("tail", x70, 16), ("short", x5, 8), ("block1", x64[:9], 1), ("one", x64, 64)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name,x,b", cases(), ids=[c[0] for c in cases()])
def test_quantize_equals_numpy(name, x, b, dtype):
    x = to_dtype(x, dtype)
    q, scales = qz.quantize(jnp.asarray(x), b)
    ref_q, ref_s = np_quantize(x, b)
    assert q.dtype == jnp.int8 and scales.dtype == jnp.float32
    assert q.shape == (qz.padded_size(x.size, b),) and scales.shape == (q.shape[0] // b,)
    np.testing.assert_array_equal(np.asarray(q), ref_q)
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint32), ref_s.view(np.uint32))
    if name == "tail":
        assert scales[1] == 0 and not np.asarray(q[16:32]).any()     # the zero block
        assert q[45] == -127                                         # the negative max maps to -127
    # the same under jit, where XLA fuses the block's max, multiplications and rounding: the codes must not change
    jq, js = jax.jit(qz.quantize, static_argnums=1)(jnp.asarray(x), b)
    np.testing.assert_array_equal(np.asarray(jq), ref_q)
    np.testing.assert_array_equal(np.asarray(js), ref_s)


def test_xla_divides_by_a_broadcast_as_a_reciprocal():
    """Why the module multiplies by reciprocals: XLA's `a / 127` is `a * float32(1/127)`, not numpy's `a / 127`
    (if a JAX release stops rewriting, the first assertion fails and the module may divide again)."""
    a = np.random.default_rng(5).random(2000).astype(np.float32) * np.float32(1000)
    out = np.asarray(jax.jit(lambda v: v / jnp.float32(127))(a))
    assert np.any(out != a / np.float32(127))
    np.testing.assert_array_equal(out, a * (np.float32(1) / np.float32(127)))


def test_quantize_rounds_half_to_even():
    x = jnp.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5], jnp.float32)  # scale 1: x / scale is x
    q, scales = qz.quantize(x, 8)
    assert scales.tolist() == [1.0]
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -2, 4]


@pytest.mark.parametrize("name,x,b", cases(), ids=[c[0] for c in cases()])
def test_dequantize_within_half_a_scale(name, x, b):
    q, scales = qz.quantize(jnp.asarray(x), b)
    out = qz.dequantize_rows(q, scales, b)[: x.size]   # how every receiver decodes a row
    assert out.dtype == jnp.float32 and out.shape == x.shape
    ref = np_dequantize(*np_quantize(x, b), x.size)
    np.testing.assert_array_equal(np.asarray(out), ref)
    # |x - q * scale| <= scale / 2 in exact arithmetic; float32 rounds 1 / scale, x * (1 / scale) and q * scale, each
    # by at most half an ulp of a value at most 127 * scale (the block's absmax): 127 * scale * 2**-22 covers them.
    s = element_scales(x, b)
    err = np.abs(np.asarray(out, np.float64) - x.astype(np.float64))
    assert np.all(err <= s / 2 + 127 * s * 2.0**-22), (err - s / 2).max()
    assert np.all(out[x == 0] == 0)


# ---------------------------------------------------------------------------------------------- collectives

MESHES = [((8,), ("data",), ("data",)),
          ((2, 4), ("replica", "data"), ("replica", "data")),
          ((2, 4), ("replica", "data"), ("data",))]
MESH_IDS = ["8-data", "2x4-both", "2x4-data"]


def groups(shape, names, axes) -> list[list[int]]:
    """The devices (linear, row-major over the mesh) of each collective group over `axes`, in device order."""
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    others = [i for i, a in enumerate(names) if a not in axes]
    ids = ids.transpose(others + [names.index(a) for a in axes])
    return ids.reshape(-1, int(np.prod([shape[names.index(a)] for a in axes]))).tolist()


def placed(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def hlo_line(text: str, name: str) -> str:
    pattern = re.compile(rf"^\s*(?:ROOT\s+)?%?{re.escape(name)}\s*=")
    return next(line for line in text.splitlines() if pattern.match(line))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,names,axes", MESHES, ids=MESH_IDS)
def test_all_gather(shape, names, axes, dtype):
    mesh = jax.make_mesh(shape, names)
    size, b = 37, 8
    rng = np.random.default_rng(1)
    blocks = [to_dtype(spiky(rng, size, spikes=2), dtype) for _ in range(8)]
    full = axes == names
    # gathered over every mesh axis the result is replicated (out_specs=P() holds only for an invariant value);
    # over "data" only it varies over "replica", and P("replica") holds only if it is invariant over "data"
    f = jax.jit(jax.shard_map(lambda x: wire.quantized_all_gather(x, axes, b), mesh=mesh, in_specs=P(names),
                              out_specs=P() if full else P("replica")))
    x = placed(mesh, np.concatenate(blocks), P(names))
    out = f(x)
    assert out.dtype == dtype
    # either way the global result is every device's block, rounded, in device order
    ref = np.concatenate([np_roundtrip(blk, b).astype(blk.dtype) for blk in blocks])
    np.testing.assert_array_equal(np.asarray(out), ref)

    if dtype == jnp.float32:  # the wire: an int8 and a float32 all-gather, of codes and of scales
        n = int(np.prod([mesh.shape[a] for a in axes]))
        padded, nblocks = qz.padded_size(size, b), qz.padded_size(size, b) // b
        text = f.lower(x).compile().as_text()
        ops = collective_ops(text)
        assert {op["kind"] for op in ops} == {"all-gather"}
        assert sorted(op["bytes"] for op in ops) == sorted([n * padded, n * 4 * nblocks])
        assert sum(op["bytes"] * op["multiplier"] for op in ops) == n * wire_bytes(size, b)
        assert any("s8[" in hlo_line(text, op["name"]).split("all-gather")[0] for op in ops)
        want = groups(shape, names, axes)
        assert all(op["replica_groups"] == want for op in ops)


def rs_reference(inputs: list[np.ndarray], group: list[int], r: int, rows: int, b: int) -> np.ndarray:
    """Device `r` of `group`: every sender's part `r`, quantized by the sender, dequantized, summed in order."""
    acc = np.zeros(rows, np.float32)
    for s in group:
        acc = (acc + np_roundtrip(inputs[s][r * rows:(r + 1) * rows], b)).astype(np.float32)
    return acc


def assert_sums_close(out: np.ndarray, inputs: list[np.ndarray], group: list[int], r: int, rows: int, b: int):
    """`out` equals `rs_reference` to rtol 1e-6, or within 2 float32 ulps of the terms' magnitude: where +-1e3
    outliers cancel, a sum computed another way (XLA:CPU at `--xla_backend_optimization_level=2` contracts the
    dequantizing multiply and the add into a fused multiply-add) differs by ulps of the terms, not of the result."""
    terms = np.sum([np.abs(np_roundtrip(inputs[s][r * rows:(r + 1) * rows], b)) for s in group], axis=0)
    ref = rs_reference(inputs, group, r, rows, b)
    excess = np.abs(out - ref) - (1e-6 * np.abs(ref) + 2.0**-22 * terms)
    assert np.all(excess <= 0), f"device {r}: {np.sum(excess > 0)} sums off, the worst by {excess.max()}"


def rs_bound(inputs: list[np.ndarray], group: list[int], r: int, rows: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Device `r`'s exact sum (float64) and its error bound: every sender's block scale / 2, plus float32 slack."""
    parts = [inputs[s][r * rows:(r + 1) * rows].astype(np.float64) for s in group]
    exact = np.sum(parts, axis=0)
    scales = [element_scales(inputs[s][r * rows:(r + 1) * rows], b) for s in group]
    half = np.sum([s / 2 for s in scales], axis=0)
    # float32 slack: each dequantized term is off by a few ulps of its block's absmax (127 * scale), and the float32
    # sum of n terms by n ulps of the running magnitude (at most sum |x| + the scales); 2**-20 of both covers it
    slack = 2.0**-20 * (np.sum(np.abs(parts), axis=0) + 127 * np.sum(scales, axis=0)) + 1e-6 * np.abs(exact)
    return exact, half + slack


@pytest.mark.parametrize("shape,names,axes", MESHES, ids=MESH_IDS)
def test_reduce_scatter(shape, names, axes):
    mesh = jax.make_mesh(shape, names)
    n = int(np.prod([mesh.shape[a] for a in axes]))
    rows, b = 45, 8                                  # 45 rows: padded to 48, 6 blocks per part
    rng = np.random.default_rng(2)
    inputs = [spiky(rng, n * rows, spikes=3 * n) for _ in range(8)]
    inputs[3][:rows] = 0                             # a sender whose first part is all zeros
    f = jax.jit(jax.shard_map(lambda x: wire.quantized_reduce_scatter(x, axes, b), mesh=mesh, in_specs=P(names),
                              out_specs=P(names)))
    x = placed(mesh, np.concatenate(inputs), P(names))
    out = f(x)
    assert out.dtype == jnp.float32 and out.shape == (8 * rows,)
    out = np.asarray(out).reshape(8, rows)

    for group in groups(shape, names, axes):
        for r, d in enumerate(group):
            # (a) the numpy reference: senders quantize, I dequantize and sum in float32, senders in order
            assert_sums_close(out[d], inputs, group, r, rows, b)
            # (b) the error against the exact sum: at most each sender's block scale / 2
            exact, bound = rs_bound(inputs, group, r, rows, b)
            assert np.all(np.abs(out[d] - exact) <= bound), (np.abs(out[d] - exact) - bound).max()

    # (c) the wire: two all-to-alls (int8 codes and float32 scales), no reduce-scatter and no all-reduce.
    # collective_ops counts an all-to-all as the larger of its operands and results; XLA:CPU prints it in tuple
    # form, n operands of [1, padded] (one per destination), which it sums: n * padded int8 bytes and
    # n * nblocks * 4 scale bytes, what passes through each device (n - 1 of the n parts cross the wire).
    padded, nblocks = qz.padded_size(rows, b), qz.padded_size(rows, b) // b
    text = f.lower(x).compile().as_text()
    ops = collective_ops(text)
    assert [op["kind"] for op in ops] == ["all-to-all", "all-to-all"]
    assert sorted(op["bytes"] for op in ops) == sorted([n * padded, n * 4 * nblocks])
    assert sum(op["bytes"] * op["multiplier"] for op in ops) == n * wire_bytes(rows, b)
    shapes = [hlo_line(text, op["name"]).split("all-to-all(")[0] for op in ops]
    assert any("s8[" in s and "f32[" not in s for s in shapes)   # the int8 payload
    assert any("f32[" in s and "s8[" not in s for s in shapes)   # the float32 scales
    want = groups(shape, names, axes)
    assert all(op["replica_groups"] == want for op in ops)

    # psum_scatter: a float32 reduce-scatter of n * rows * 4 bytes, whose result this one approximates
    plain = jax.jit(jax.shard_map(lambda x: _compat.psum_scatter(x, axes), mesh=mesh, in_specs=P(names),
                                  out_specs=P(names))).lower(x).compile()
    assert [op["kind"] for op in collective_ops(plain.as_text())] == ["reduce-scatter"]
    assert sum(op["bytes"] for op in collective_ops(plain.as_text())) == n * rows * 4 > n * wire_bytes(rows, b)
    worst = n * max(float(np.max(element_scales(v, b))) for v in inputs)
    assert np.max(np.abs(np.asarray(plain(x)).reshape(8, rows) - out)) <= worst


def test_all_to_all_over_a_tuple_of_axes_is_row_major():
    """`lax.all_to_all` over ("replica", "data") sends part r to the device of linear index r (row-major), as
    `psum_scatter` does: what `reduce_scatter` relies on, on every tested JAX release."""
    mesh = jax.make_mesh((2, 4), ("replica", "data"))
    k = 3
    g = np.array([100 * d + 10 * r + j for d in range(8) for r in range(8) for j in range(k)], np.float32)

    def body(x):
        y = lax.all_to_all(x.reshape(8, k), ("replica", "data"), 0, 0, tiled=True)
        assert _compat.varying_axes(y) >= {"replica", "data"}
        return y.reshape(-1)
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("replica", "data")),
                                out_specs=P(("replica", "data"))))(placed(mesh, g, P(("replica", "data"))))
    want = np.array([100 * s + 10 * r + j for r in range(8) for s in range(8) for j in range(k)], np.float32)
    np.testing.assert_array_equal(np.asarray(out), want)


def test_reduce_scatter_of_an_invariant_value_and_typing():
    """A replicated input (typed invariant) is retyped varying before the all-to-all; the result varies over the
    axes, like psum_scatter's."""
    mesh = jax.make_mesh((8,), ("data",))
    rows, b = 5, 4
    x = spiky(np.random.default_rng(3), 8 * rows, spikes=4)

    def body(v):
        out = wire.quantized_reduce_scatter(v, ("data",), b)
        assert "data" in _compat.varying_axes(out)
        assert "data" in _compat.varying_axes(_compat.psum_scatter(v, ("data",)))
        return out
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("data")))(placed(mesh, x, P()))
    for r in range(8):
        assert_sums_close(np.asarray(out)[r * rows:(r + 1) * rows], [x] * 8, list(range(8)), r, rows, b)


def test_collectives_without_vma_checks():
    mesh = jax.make_mesh((8,), ("data",))
    rows, b = 6, 4
    rng = np.random.default_rng(4)
    inputs = [spiky(rng, 8 * rows, spikes=2) for _ in range(8)]
    x = placed(mesh, np.concatenate(inputs), P("data"))
    rs = jax.jit(jax.shard_map(lambda v: wire.quantized_reduce_scatter(v, ("data",), b), mesh=mesh,
                               in_specs=P("data"), out_specs=P("data"), check_vma=False))(x)
    for r in range(8):
        assert_sums_close(np.asarray(rs)[r * rows:(r + 1) * rows], inputs, list(range(8)), r, rows, b)
    ag = jax.jit(jax.shard_map(lambda v: wire.quantized_all_gather(v[:rows], ("data",), b), mesh=mesh,
                               in_specs=P("data"), out_specs=P(), check_vma=False))(x)
    np.testing.assert_array_equal(np.asarray(ag), np.concatenate([np_roundtrip(v[:rows], b) for v in inputs]))


# ---------------------------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("block_size", [0, -4, 2.5, True, "8", None])
def test_bad_block_size(block_size):
    x = jnp.ones(8)
    for call in (lambda: qz.quantize(x, block_size), lambda: qz.padded_size(8, block_size),
                 lambda: wire_bytes(8, block_size)):
        with pytest.raises(ZeroError, match="block_size"):
            call()


@pytest.mark.parametrize("x", [jnp.ones((2, 4)), jnp.ones(8, jnp.int32), jnp.ones((), jnp.float32), [1.0, 2.0]],
                         ids=["2d", "int", "scalar", "list"])
def test_bad_x(x):
    with pytest.raises(ZeroError, match=r"\bx\b"):
        qz.quantize(x, 4)


def test_bad_arguments_inside_shard_map():
    mesh = jax.make_mesh((8,), ("data",))
    x = placed(mesh, np.ones(8 * 12, np.float32), P("data"))

    def run(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P()))(x)
    with pytest.raises(ZeroError, match="axes"):
        run(lambda v: wire.quantized_all_gather(v, (), 4))
    with pytest.raises(ZeroError, match="axes"):
        run(lambda v: wire.quantized_reduce_scatter(v, (1,), 4)[:0])
    with pytest.raises(ZeroError, match=r"\bx\b.*multiple"):
        run(lambda v: wire.quantized_reduce_scatter(v[:10], ("data",), 4)[:0])
    with pytest.raises(ZeroError, match=r"\bx\b"):
        run(lambda v: wire.quantized_all_gather(v.reshape(3, 4), ("data",), 4))
    with pytest.raises(ZeroError, match="block_size"):
        run(lambda v: wire.quantized_all_gather(v, ("data",), 0))


def test_bad_sizes():
    with pytest.raises(ZeroError, match=r"\bn\b"):
        qz.padded_size(-1, 4)
