"""`zero1(..., quantize=zo.Quantize(...))`: int8 blocks on the wire for the parameter gather and the gradient
reduction (issue 33), against independent numpy oracles of the block-wise rounding and its error bound."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from benchmarks import hlo as _hlo
from zero_optax.core._errors import ZeroError

N = 8
B = 64  # block size: every leaf below spans several blocks, with a partial last one
SHAPES = {"w": (37, 11), "v": (5,), "s": ()}


def np_round_blocks(x: np.ndarray, b: int) -> np.ndarray:
    """The block-wise int8 rounding of 1-D float32 `x` (blocks of `b`, the last one partial): q * scale."""
    out = np.empty_like(x)
    for a in range(0, x.size, b):
        block = x[a:a + b]
        scale = np.float32(np.abs(block).max()) * np.float32(1 / 127)
        inv = np.float32(1) / scale if scale else np.float32(1)
        q = np.clip(np.round(block * inv), -127, 127)
        out[a:a + b] = q.astype(np.int8).astype(np.float32) * scale  # (an int8 code has no -0)
    return out


def np_half_scales(x: np.ndarray, b: int) -> np.ndarray:
    """Per element of 1-D `x`: half the scale of its block."""
    out = np.empty_like(x)
    for a in range(0, x.size, b):
        out[a:a + b] = np.abs(x[a:a + b]).max() / 127 / 2
    return out


def rows(x: np.ndarray, n: int) -> np.ndarray:
    """A leaf's flattened coordinates as the `n` devices hold them: `[n, slots]`, zero-padded."""
    flat = np.asarray(x, np.float32).reshape(-1)
    slots = -(-flat.size // n)
    return np.concatenate([flat, np.zeros(n * slots - flat.size, np.float32)]).reshape(n, slots)


def params_np(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def grads_with_outliers(t: int, n: int = N):
    rng = np.random.default_rng(100 + t)
    out = {}
    for k, s in SHAPES.items():
        g = rng.standard_normal((n, *s)).astype(np.float32)
        flat = g.reshape(n, -1)
        flat[:, :: 17] *= 1e3  # an outlier in most blocks
        out[k] = flat.reshape(n, *s)
    return out


def run(tx, mesh, steps: int, grads_of=grads_with_outliers, after_step=None):
    """`steps` `zo.apply_gradients` steps inside `shard_map` over the 1-D `mesh` on per-device gradients."""
    params = params_np()
    specs = zo.state_specs(tx, params, P(), mesh=mesh)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(p, s, g):
        return zo.apply_gradients(tx, jax.tree.map(lambda x: x[0], g), s, p)

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    s = init(p)
    for t in range(steps):
        p, s = step(p, s, jax.device_put(grads_of(t), NamedSharding(mesh, P("data"))))
        if after_step is not None:
            after_step(p, s)
    return p, s


def test_parameters_are_the_block_wise_int8_rounding_of_the_master_copy_on_every_device():
    """After every step each parameter equals the int8 rounding of its master value in the blocks each device
    sends (its slots of the leaf, each leaf alone: `bucket_bytes=0`), bit for bit, the same on every device, and
    the master copy is exact single-device optax."""
    mesh = h.mesh_of(N)
    inner = optax.adamw(1e-1)
    tx = zo.zero1(inner, axis_name="data", master_dtype=jnp.float32, bucket_bytes=0,
                  quantize=zo.Quantize(params="int8", block_size=B))

    def check(p, s):
        master = zo.master_params(s)
        for k in SHAPES:
            m = rows(np.asarray(master[k]), N)
            want = np.stack([np_round_blocks(r, B) for r in m]).reshape(-1)[:np.size(master[k])]
            got = np.asarray(p[k], np.float32).reshape(-1)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=k)
            halves = np.stack([np_half_scales(r, B) for r in m]).reshape(-1)[:got.size]
            assert np.all(np.abs(got - np.asarray(master[k]).reshape(-1)) <= halves * 1.0001), k
            shards = [np.asarray(x.data) for x in p[k].addressable_shards]
            assert all(np.array_equal(a.view(np.uint32), shards[0].view(np.uint32)) for a in shards)

    _, s = run(tx, mesh, 3, after_step=check)
    ref_p, ref_s = params_np(), inner.init(params_np())
    for t in range(3):
        u, ref_s = inner.update({k: g.mean(0) for k, g in grads_with_outliers(t).items()}, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    for k in SHAPES:
        np.testing.assert_allclose(zo.master_params(s)[k], ref_p[k], rtol=2e-5, atol=1e-5)


def test_the_reduced_gradient_is_within_the_senders_half_scales():
    """SGD with learning rate 1 (the update is minus the reduced gradient, exact master copies): coordinate by
    coordinate |update + exact mean| <= sum over senders of their block's scale / 2, divided by N."""
    mesh = h.mesh_of(N)
    tx = zo.zero1(optax.sgd(1.0), axis_name="data", master_dtype=jnp.float32, bucket_bytes=0,
                  quantize=zo.Quantize(grads="int8", block_size=B))
    g = grads_with_outliers(0)
    p, _ = run(tx, mesh, 1, grads_of=lambda t: g)
    for k in SHAPES:
        update = np.asarray(p[k], np.float64).reshape(-1) - params_np()[k].astype(np.float64).reshape(-1)
        exact = g[k].astype(np.float64).mean(0).reshape(-1)
        # sender s sends its slots for device r as one part: blocks of B within [r * slots, (r + 1) * slots)
        halves = np.zeros_like(rows(g[k][0], N))
        for s in range(N):
            halves += np.stack([np_half_scales(part, B) for part in rows(g[k][s], N)])
        bound = halves.reshape(-1)[:exact.size] / N
        err = np.abs(update + exact)
        assert np.all(err <= bound * 1.001 + 1e-6 * np.abs(exact)), (k, np.max(err - bound))
        assert np.max(err) > 0  # (it did quantize)


def test_weights_accumulation_and_owned_leaves_stay_close_to_optax():
    """Token weights, sharded accumulation and Muon's owned matrices under quantized gradients: within a few
    percent of exact optax on gradients without outliers."""
    mesh = h.mesh_of(N)
    params = h.small_params()
    grads = h.gradient_sequence(params, N, 4)
    for kw, inner in ((dict(partition="flat"), optax.adam(1e-2)), (dict(partition="auto"), optax.contrib.muon(1e-2)),
                      (dict(accumulate_steps=2), optax.adam(1e-2))):
        tx = zo.zero1(inner, axis_name="data", master_dtype=jnp.float32,
                      quantize=zo.Quantize(params="int8", grads="int8", block_size=B), **kw)
        weights = [np.arange(1, N + 1, dtype=np.float32)] * 4
        zp, _, _ = h.run_zero(tx, params, grads, N, weights_seq=weights)
        if "accumulate_steps" in kw:
            grads2 = [jax.tree.map(lambda a, b: jnp.concatenate([a, b]), grads[k], grads[k + 1]) for k in (0, 2)]
            rp, _ = h.run_oracle(inner, params, grads2, [np.concatenate(weights[:2])] * 2)
        else:
            rp, _ = h.run_oracle(inner, params, grads, weights)
        for a, b in zip(jax.tree.leaves(zp), jax.tree.leaves(rp)):
            np.testing.assert_allclose(a, b, rtol=0.05, atol=0.02, err_msg=str(kw))


def _collectives(tx, mesh, names, params):
    specs = zo.state_specs(tx, params, P(), mesh=mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def step(p, s, g):
        return zo.apply_gradients(tx, jax.tree.map(lambda x: x[0], g), s, p)

    grads = jax.device_put(jax.tree.map(lambda x: jnp.zeros((N, *x.shape)), params), NamedSharding(mesh, P(names)))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    text = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(names)), out_specs=(P(), specs))).lower(
        params, state, grads).compile().as_text()
    return _hlo.collective_ops(text)


def test_wire_bytes_are_about_a_quarter_of_float32():
    """Counted from the compiled HLO: the quantized step's collectives move at most 0.27 x the bytes of the same
    step's unquantized ones (block 256: 1 byte per element and 4 per block, against 4 per element)."""
    mesh = h.mesh_of(N)
    params = {"w": jnp.zeros((512, 96)), "u": jnp.zeros((300, 40))}
    totals = {}
    for name, q in (("exact", None), ("int8", zo.Quantize(params="int8", grads="int8"))):
        tx = zo.zero1(optax.adamw(1e-3), axis_name="data", master_dtype=jnp.float32, quantize=q)
        totals[name] = sum(o["bytes"] * o["multiplier"] for o in _collectives(tx, mesh, "data", params)
                           if o["kind"] != "all-reduce")  # (the weights and skipped-step scalars stay exact)
    assert totals["int8"] <= 0.27 * totals["exact"], totals


def test_axes_limits_quantization_to_the_replica_axis():
    """`axes=("replica",)`: over `data` the exact reduce-scatter and all-gather, over `replica` int8 all-to-alls
    and all-gathers only."""
    mesh = jax.make_mesh((2, 4), ("replica", "data"))
    params = {"w": jnp.zeros((64, 50))}
    tx = zo.zero1(optax.adamw(1e-3), axis_name="data", replica_axis="replica", master_dtype=jnp.float32,
                  quantize=zo.Quantize(params="int8", grads="int8", axes=("replica",)))
    kinds = set()
    for o in _collectives(tx, mesh, ("replica", "data"), params):
        groups = o["replica_groups"][0]
        over = "replica" if len(groups) == 2 else "data" if len(groups) == 4 else "both"
        kinds.add((o["kind"], over))
    assert ("reduce-scatter", "data") in kinds and ("all-gather", "data") in kinds
    assert ("all-to-all", "replica") in kinds and ("all-gather", "replica") in kinds
    assert ("all-to-all", "data") not in kinds and ("reduce-scatter", "replica") not in kinds, kinds
    assert not {k for k in kinds if k[1] == "both"}, kinds


def test_checkpoints_move_between_quantized_and_exact_runs(tmp_path):
    mesh = h.mesh_of(N)
    q = zo.zero1(optax.adamw(1e-2), axis_name="data", master_dtype=jnp.float32, mesh=mesh,
                 quantize=zo.Quantize(params="int8"))
    exact = zo.zero1(optax.adamw(1e-2), axis_name="data", master_dtype=jnp.float32, mesh=mesh)
    params = jax.device_put(params_np(), NamedSharding(mesh, P()))
    grads = jax.device_put({k: g.mean(0) for k, g in grads_with_outliers(0).items()}, NamedSharding(mesh, P()))
    _, state = jax.jit(lambda p, s, g: zo.apply_gradients(q, g, s, p))(params, q.init(params), grads)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(state)))
        mngr.wait_until_finished()
        restored = mngr.restore(1, args=ocp.args.Composite(opt_state=zo.ZeroRestore(exact.init(params)))).opt_state
        back = mngr.restore(1, args=ocp.args.Composite(opt_state=zo.ZeroRestore(q.init(params)))).opt_state
    assert zo.describe(restored) == zo.describe(state)  # the state holds no quantized copy
    for a, b, c in zip(jax.tree.leaves(state), jax.tree.leaves(restored), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_refusals_name_the_fix():
    mesh = h.mesh_of(N)
    with pytest.raises(ZeroError, match="master_dtype"):
        zo.zero1(optax.sgd(1.0), axis_name="data", quantize=zo.Quantize(params="int8"))
    with pytest.raises(ZeroError, match="reduce=True"):
        zo.zero1(optax.sgd(1.0), axis_name="data", reduce=False, quantize=zo.Quantize(grads="int8"))
    with pytest.raises(ZeroError, match="names"):
        zo.zero1(optax.sgd(1.0), axis_name="data", quantize=zo.Quantize(grads="int8", axes=("replica",)))
    with pytest.raises(ZeroError, match="int8"):
        zo.Quantize(params="int4")
    with pytest.raises(ZeroError, match="block_size"):
        zo.Quantize(grads="int8", block_size=0)
    with pytest.raises(ZeroError, match="zo.Quantize"):
        zo.zero1(optax.sgd(1.0), axis_name="data", quantize={"grads": "int8"})
    tx = zo.zero1(optax.sgd(1.0), axis_name="data", mesh=mesh, quantize=zo.Quantize(grads="int8"))
    params = jax.device_put({"w": jnp.ones(5)}, NamedSharding(mesh, P()))
    with pytest.raises(ZeroError, match="shard_map"):  # the mesh-bound form gets gradients XLA has reduced
        tx.update(params, tx.init(params), params)


def test_mesh_bound_update_lands_on_the_rounded_master_copy():
    """The mesh-bound form under `jax.jit`, through `tx.update` + `optax.apply_updates`: each parameter within half
    a block scale of its master value (at most the largest |master| / 254), the same on every device."""
    mesh = h.mesh_of(N)
    tx = zo.zero1(optax.adamw(1e-1), axis_name="data", master_dtype=jnp.float32, mesh=mesh,
                  quantize=zo.Quantize(params="int8", block_size=B))
    p = jax.device_put(params_np(), NamedSharding(mesh, P()))
    state = tx.init(p)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for t in range(2):
        g = jax.device_put({k: v.mean(0) for k, v in grads_with_outliers(t).items()}, NamedSharding(mesh, P()))
        p, state = step(p, state, g)
    master = zo.master_params(state)
    largest = max(np.max(np.abs(np.asarray(m))) for m in master.values())  # (a block may hold several leaves)
    for k in SHAPES:
        err = np.abs(np.asarray(p[k]) - np.asarray(master[k]))
        assert np.max(err) <= largest / 254 * 1.001 + 1e-6, k
        shards = [np.asarray(x.data) for x in p[k].addressable_shards]
        assert all(np.array_equal(a, shards[0]) for a in shards)
    assert np.max(np.abs(np.asarray(p["w"]) - np.asarray(master["w"]))) > 0  # (it did quantize)
