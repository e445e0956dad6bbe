"""Tests for `zero1(..., accumulate_steps=k)`: gradient accumulation, sharded (ZeRO-2) and local.

Oracles run plain optax on one device: `optax.MultiSteps(inner, k)` fed each micro-batch's global mean gradient
(equal weights), and `inner` fed the hand-computed token-weighted mean of each cycle (unequal weights).

Compiling the shard_map steps is most of this file's time, so every (optimizer, partition, world size, mode) has
one init and one step function (`fns`, cached) that the tests share; equal weights are passed as `weight=1` on
every device (the same mean as no `weight`, which the 2-D mesh, lax.scan, nnx and TrainState tests run).
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from tests._models import muon_recipe
from tests.test_jit import MLP
from benchmarks.hlo import branch_collectives

K = 2


def inner_of(kind):
    return {"adamw": lambda: optax.adamw(1e-2, weight_decay=0.1), "muon": lambda: optax.contrib.muon(1e-2),
            "recipe": muon_recipe}[kind]()


@functools.lru_cache(maxsize=None)
def fns(kind, partition, n, mode, **kwargs):
    """The (cached) jitted shard_map init and weighted step of `zero1(inner_of(kind), accumulate_steps=K)`."""
    tx = zo.zero1(inner_of(kind), axis_name="data", partition=partition, accumulate_steps=K, accumulate=mode,
                  **kwargs)
    return h.zero_fns(tx, h.mesh_of(n), weighted=True)


# 1 and 3 devices for the matrix; 8 where it adds something (more devices than some leaves have elements, owned
# leaves with devices that own nothing).
CASES = [("adamw", "flat", 1, "sharded"), ("adamw", "flat", 3, "sharded"), ("adamw", "flat", 3, "local"),
         ("adamw", "flat", 8, "local"),
         ("muon", "leaf", 3, "sharded"), ("recipe", "auto", 3, "sharded"), ("recipe", "auto", 3, "local"),
         ("recipe", "auto", 8, "sharded")]


@functools.lru_cache(maxsize=None)
def oracle_fns(kind, multisteps):
    """`(tx, jax.jit(tx.update))` of the single-device oracle, `inner_of(kind)` or `optax.MultiSteps` of it,
    compiled once per kind (and dtype) for the whole file."""
    tx = optax.MultiSteps(inner_of(kind), K) if multisteps else inner_of(kind)

    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return tx, jax.jit(step)


def mean_oracle(kind, params, cycles):
    """`inner_of(kind)` on one device, fed each cycle's sum of loss-sum gradients over its sum of weights (float64
    sums, then the parameter's dtype); a cycle of total weight zero is skipped."""
    inner, update = oracle_fns(kind, False)
    state = inner.init(params)
    for cycle in cycles:
        total = sum(float(np.sum(w)) for _, w in cycle)
        if total == 0:
            continue
        mean = jax.tree.map(lambda p, *gs: jnp.asarray(
            sum(np.asarray(g, np.float64).sum(0) for g in gs) / total, p.dtype), params, *[g for g, _ in cycle])
        params, state = update(mean, state, params)
    return params, state


def multisteps_oracle(kind, params, grads):
    """`optax.MultiSteps(inner_of(kind), K)` on one device, fed each micro-batch's global mean gradient."""
    ms, update = oracle_fns(kind, True)
    s = ms.init(params)
    for g in grads:
        params, s = update(h.reduced(g), s, params)
    return params, s


def gradient_sequence(params, n, steps, seed=0):
    """`steps` trees of per-device gradients, each leaf `[n, *shape]` in the leaf's dtype (numpy: no compiles)."""
    rng = np.random.default_rng(seed)
    return [jax.tree.map(lambda p: rng.standard_normal((n, *np.shape(p)), np.float32).astype(p.dtype), params)
            for _ in range(steps)]


def placed(params, n):
    """`params` replicated on the first `n` devices, as the cached steps were compiled for."""
    return jax.device_put(params, NamedSharding(h.mesh_of(n), P()))


def assert_inner_state(zero_state, ref_state):
    got = {k[len(".inner"):]: v for k, v in h.full_state(zero_state).items() if k.startswith(".inner")}
    want = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(ref_state)}
    assert set(got) == set(want)
    for path, x in want.items():
        np.testing.assert_allclose(np.asarray(got[path], np.float64), np.asarray(x, np.float64), rtol=2e-5,
                                   atol=1e-6, err_msg=path)


def assert_params(a, b, rtol=2e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)


def ones(n, steps):
    return [np.ones(n, np.float32)] * steps


def _run(step, params, state, grads, weights, mesh):
    shard = NamedSharding(mesh, P("data"))
    for g, w in zip(grads, weights):
        params, state = step(params, state, jax.device_put(g, shard),
                             jax.device_put(jnp.asarray(w, jnp.float32), shard))
    return params, state


def run(key, params, grads, weights):
    init, step = fns(*key[:4], **dict(key[4:]))
    mesh = h.mesh_of(key[2])
    params = jax.device_put(params, NamedSharding(mesh, P()))
    return _run(step, params, init(params), grads, weights, mesh)


@pytest.mark.parametrize("kind,partition,n,mode", CASES)
def test_matches_multisteps_and_token_weighted_mean(kind, partition, n, mode):
    params = h.small_params()
    # equal weights: optax.MultiSteps fed every micro-batch's global mean gradient
    grads = gradient_sequence(params, n, 2 * K, seed=1)
    got, _ = run((kind, partition, n, mode), params, grads, ones(n, 2 * K))
    want, _ = multisteps_oracle(kind, params, grads)
    assert_params(got, want)
    # unequal token counts, one cycle of total weight zero (skipped), one device with weight zero
    grads = gradient_sequence(params, n, 3 * K, seed=2)
    weights = [np.arange(n, dtype=np.float32) + 1 + t for t in range(3 * K)]
    weights[2], weights[3] = np.zeros(n, np.float32), np.zeros(n, np.float32)
    weights[4][0] = 0
    got, state = run((kind, partition, n, mode), params, grads, weights)
    cycles = [list(zip(grads[c * K:(c + 1) * K], weights[c * K:(c + 1) * K])) for c in range(3)]
    want, ref_state = mean_oracle(kind, params, cycles)
    assert_params(got, want)
    assert_inner_state(state, ref_state)


def test_non_final_calls_move_no_all_gather_and_return_zeros():
    n, params = 3, h.small_params()
    mesh = h.mesh_of(n)
    init, step = fns("adamw", "flat", n, "sharded")
    params = placed(params, n)
    state = init(params)
    shard = NamedSharding(mesh, P("data"))
    g = jax.device_put(gradient_sequence(params, n, 1)[0], shard)
    w = jax.device_put(jnp.ones(n), shard)
    text = step.lower(params, state, g, w).compile().as_text()
    paths = branch_collectives(text)
    assert len(paths["kinds"]) == 1
    kinds = sorted(paths["kinds"][0], key=lambda k: "all-gather" in k)
    assert "all-gather" not in kinds[0] and kinds[0].get("reduce-scatter", 0) >= 1   # a micro-batch
    assert kinds[1].get("all-gather", 0) >= 1 and kinds[1].get("reduce-scatter", 0) >= 1  # the optimizer step
    p1, state = step(params, state, g, w)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
    assert int(h.full_state(state)[".micro_step"]) == 1


def test_describe_reports_accumulator_bytes():
    params = h.small_params()
    size = sum(x.size for x in jax.tree.leaves(params))
    for mode, n in (("sharded", 3), ("local", 3)):
        layout = zo.describe(fns("adamw", "flat", n, mode)[0](params))
        got = layout.accumulator_bytes_per_device
        want = 4 * sum(-(-x.size // n) for x in jax.tree.leaves(params)) if mode == "sharded" else 4 * size
        assert got == (want,) * n
        assert "accumulator bytes per device" in layout.summary()
    plain = zo.describe(h.zero_fns(zo.zero1(optax.adam(1e-2), axis_name="data"), h.mesh_of(3))[0](params))
    assert plain.accumulator_bytes_per_device == (0, 0, 0)


def test_mesh_bound_inside_lax_scan_matches_multisteps():
    n, params = 3, h.small_params()
    mesh = h.mesh_of(n)
    tx = zo.zero1(inner_of("adamw"), axis_name="data", mesh=mesh, accumulate_steps=K)
    state = tx.init(params)

    @jax.jit
    def step(p, s, gs):
        def body(carry, g):
            p, s = carry
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None
        return jax.lax.scan(body, (p, s), gs)[0]

    grads = gradient_sequence(params, n, 2 * K, seed=3)
    stacked = jax.tree.map(lambda *gs: jnp.stack(gs), *[h.reduced(g) for g in grads])
    got, _ = step(params, state, stacked)
    assert_params(got, multisteps_oracle("adamw", params, grads)[0])


# ---------------------------------------------------------------- dtypes

@pytest.mark.parametrize("kind,partition,mode", [("recipe", "auto", "sharded"), ("adamw", "flat", "local")])
def test_master_dtype_matches_float32_multisteps(kind, partition, mode):
    """bf16 parameters, float32 master copies: the master copy is float32 MultiSteps on the float32 parameters,
    the bf16 parameters are its rounding."""
    n = 3
    params32 = h.small_params()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
    grads = gradient_sequence(params, n, 2 * K, seed=8)  # bf16 gradients
    got, state = run((kind, partition, n, mode, ("master_dtype", jnp.float32)), params, grads, ones(n, 2 * K))
    want, _ = multisteps_oracle(kind, jax.tree.map(lambda x: x.astype(jnp.float32), params),
                                [jax.tree.map(lambda g: g.astype(jnp.float32), g) for g in grads])
    master = zo.master_params(state)
    assert_params(master, want, rtol=5e-5, atol=5e-6)
    for p, m in zip(jax.tree.leaves(got), jax.tree.leaves(master)):
        assert p.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(p).view(np.uint16),
                                      np.asarray(m.astype(jnp.bfloat16)).view(np.uint16))


def _reduce_scatter_dtypes(step, *args):
    """The element types of the reduce-scatters in the lowered program (XLA:CPU may widen bf16 ones later)."""
    text = step.lower(*args).as_text()
    return {re.search(r"->\s*tensor<(?:[0-9]+x)*([a-z0-9]+)>", text[m.end():]).group(1)
            for m in re.finditer(r"stablehlo\.reduce_scatter", text)}


@pytest.mark.parametrize("mode,reduce_dtype", [("sharded", None), ("sharded", jnp.float32), ("local", None)])
def test_bf16_parameters_without_master(mode, reduce_dtype):
    """bf16 parameters and gradients, no master copy: runs, accumulates in float32, matches the oracle within bf16
    rounding; `reduce_dtype` is the dtype of the micro-batch reductions."""
    n = 3
    params = h.small_params(jnp.bfloat16)
    grads = gradient_sequence(params, n, 2 * K, seed=9)
    weights = [np.arange(n, dtype=np.float32) + 1 + t for t in range(2 * K)]
    key = ("adamw", "flat", n, mode) + ((("reduce_dtype", reduce_dtype),) if reduce_dtype else ())
    got, state = run(key, params, grads, weights)
    want, _ = mean_oracle("adamw", params, [list(zip(grads[c * K:(c + 1) * K], weights[c * K:(c + 1) * K]))
                                                     for c in range(2)])
    assert_params(got, want, rtol=1e-2, atol=1e-2)
    if reduce_dtype is not None or mode == "local":  # float32 sums: within the rounding of the last bf16 step
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))) <= 2 ** -7
    accumulators = [x for path, x in h.full_state(state).items() if path.startswith(".acc")]
    assert all(np.asarray(x).dtype == np.float32 for x in accumulators + jax.tree.leaves(state.local))
    if mode == "sharded":
        mesh = h.mesh_of(n)
        shard = NamedSharding(mesh, P("data"))
        init, step = fns(*key[:4], **dict(key[4:]))
        p = placed(params, n)
        dtypes = _reduce_scatter_dtypes(step, p, init(p), jax.device_put(grads[0], shard),
                                        jax.device_put(jnp.ones(n), shard))
        assert dtypes == {"f32" if reduce_dtype else "bf16"}, dtypes


# ---------------------------------------------------------------- 2-D meshes and Flax

SHAPES_2D = {"w_in": (5, 6), "w_out": (6, 5), "ln": (7,), "s": ()}
TP_SPECS = {"w_in": P(None, "model"), "w_out": P("model", None), "ln": P(), "s": P()}


def _params_2d():
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in SHAPES_2D.items()}


def _grads_2d(t, n_data):
    rng = np.random.default_rng(100 + t)
    return {k: rng.standard_normal((n_data, *s)).astype(np.float32) for k, s in SHAPES_2D.items()}


@pytest.mark.parametrize("form,mode", [("shard_map", "sharded"), ("shard_map", "local"), ("jit", "sharded")])
def test_data_by_model_mesh_with_tensor_parallel_leaves(form, mode):
    mesh, n_data, steps = jax.make_mesh((4, 2), ("data", "model")), 4, 2 * K
    inner = lambda: optax.adamw(1e-2, weight_decay=0.1)  # noqa: E731
    params = {k: jax.device_put(v, NamedSharding(mesh, TP_SPECS[k])) for k, v in _params_2d().items()}
    if form == "shard_map":
        tx = zo.zero1(inner(), axis_name="data", accumulate_steps=K, accumulate=mode)
        specs = zo.state_specs(tx, params, TP_SPECS)
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(TP_SPECS,), out_specs=specs))
        g_specs = {k: P("data", *s) for k, s in TP_SPECS.items()}

        def step(p, s, g):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s
        step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(TP_SPECS, specs, g_specs),
                                     out_specs=(TP_SPECS, specs)))
        place = lambda k, v: jax.device_put(v, NamedSharding(mesh, g_specs[k]))  # noqa: E731
    else:
        tx = zo.zero1(inner(), axis_name="data", mesh=mesh, accumulate_steps=K, accumulate=mode)
        init = tx.init

        @jax.jit
        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        place = lambda k, v: jax.device_put(v.mean(0), NamedSharding(mesh, TP_SPECS[k]))  # noqa: E731
    state = init(params)
    for t in range(steps):
        params, state = step(params, state, {k: place(k, v) for k, v in _grads_2d(t, n_data).items()})
    want, _ = multisteps_oracle("adamw", _params_2d(), [_grads_2d(t, n_data) for t in range(steps)])
    assert_params(params, want)
    leaf = {x.path: x for x in zo.describe(state).leaves}["['w_in']"]
    assert leaf.axes == ("model",) and leaf.blocks == 2


def _micro_batches(mesh, count):
    x = jax.random.normal(jax.random.key(1), (count, 12, 5))
    y = jax.random.normal(jax.random.key(2), (count, 12, 4))
    shard = NamedSharding(mesh, P("data"))
    return [(jax.device_put(x[t], shard), jax.device_put(y[t], shard)) for t in range(count)]


def _nnx_train(tx, mesh, batches):
    model = MLP(nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    for x, y in batches:
        step(model, optimizer, x, y)
    return nnx.state(model, nnx.Param)


@pytest.mark.parametrize("flax_api,mode", [("nnx.Optimizer", "sharded"), ("TrainState", "local")])
def test_nnx_optimizer_and_train_state(flax_api, mode):
    """The mesh-bound form in Flax, one micro-batch per call, against the same code with `optax.MultiSteps`."""
    mesh = h.mesh_of(3)
    batches = _micro_batches(mesh, 2 * K)
    txs = (zo.zero1(optax.adamw(1e-2), axis_name="data", mesh=mesh, accumulate_steps=K, accumulate=mode),
           optax.MultiSteps(optax.adamw(1e-2), K))
    if flax_api == "nnx.Optimizer":
        got, want = (_nnx_train(tx, mesh, batches) for tx in txs)
    else:
        params = jax.device_put({"w": jnp.linspace(-1, 1, 20).reshape(5, 4), "b": jnp.zeros(4)},
                                NamedSharding(mesh, P()))
        loss = lambda p, x, y: jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)  # noqa: E731
        results = []
        for tx in txs:
            state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
            step = jax.jit(lambda s, x, y: s.apply_gradients(grads=jax.grad(loss)(s.params, x, y)))
            for x, y in batches:
                state = step(state, x, y)
            results.append(state.params)
        got, want = results
    assert_params(got, want)


# ---------------------------------------------------------------- checkpoints

def _save(directory, state):
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(state)))
        mngr.wait_until_finished()
    return os.path.join(directory, "1", "opt_state")


def _restore(item, target, reshard=False):
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        return ckpt.restore(item, args=zo.ZeroRestore(target, reshard=reshard))


@pytest.mark.parametrize("mode", ["sharded", "local"])
def test_mid_cycle_checkpoint_restores_exactly(tmp_path, mode):
    n, params = 3, h.small_params()
    init, step = fns("recipe", "auto", n, mode)
    mesh = h.mesh_of(n)
    grads = gradient_sequence(params, n, 2 * K, seed=4)
    weights = [np.arange(n, dtype=np.float32) + t for t in range(2 * K)]
    p_mid, s_mid = _run(step, placed(params, n), init(placed(params, n)), grads[:K + 1], weights[:K + 1],
                        mesh)  # one call into cycle 2
    item = _save(str(tmp_path), s_mid)
    restored = _restore(item, init(placed(params, n)))
    p_a, s_a = _run(step, p_mid, restored, grads[K + 1:], weights[K + 1:], mesh)
    p_b, s_b = _run(step, p_mid, s_mid, grads[K + 1:], weights[K + 1:], mesh)
    for a, b in zip(jax.tree.leaves((p_a, s_a)), jax.tree.leaves((p_b, s_b))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    cycles = [list(zip(grads[c * K:(c + 1) * K], weights[c * K:(c + 1) * K])) for c in range(2)]
    want, _ = mean_oracle("recipe", params, cycles)
    assert_params(p_a, want)


def test_sharded_accumulators_reshard_mid_cycle(tmp_path):
    params = h.small_params()
    grads3 = gradient_sequence(params, 3, 1, seed=5)
    grads8 = gradient_sequence(params, 8, 2 * K - 1, seed=6)
    w3 = [np.arange(3, dtype=np.float32) + 1]
    w8 = [np.arange(8, dtype=np.float32) * (t + 1) for t in range(2 * K - 1)]
    init3, step3 = fns("recipe", "auto", 3, "sharded")
    p_mid, s_mid = _run(step3, placed(params, 3), init3(placed(params, 3)), grads3, w3,
                        h.mesh_of(3))  # 1 of K calls of cycle 1
    item = _save(str(tmp_path / "a"), s_mid)
    init8, step8 = fns("recipe", "auto", 8, "sharded")
    p8 = jax.device_put(p_mid, NamedSharding(h.mesh_of(8), P()))
    restored = _restore(item, init8(p8), reshard=True)
    got, _ = _run(step8, p8, restored, grads8, w8, h.mesh_of(8))
    calls = list(zip(grads3, w3)) + list(zip(grads8, w8))
    want, _ = mean_oracle("recipe", params, [calls[:K], calls[K:]])
    assert_params(got, want)
    # offline: zo.reshard to 8 devices, then a plain restore, continues the same
    zo.reshard(item, str(tmp_path / "b"), 8)
    again = _restore(str(tmp_path / "b"), init8(p8))
    got2, _ = _run(step8, p8, again, grads8, w8, h.mesh_of(8))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(got2)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_local_accumulators_reshard_only_at_a_cycle_boundary(tmp_path):
    """Local accumulators mid-cycle: `reshard=True` and offline `zo.reshard` refuse, saying to checkpoint at a
    cycle boundary; at a boundary both work and the run continues as the oracle."""
    params = h.small_params()
    init3, step3 = fns("adamw", "flat", 3, "local")
    init8, step8 = fns("adamw", "flat", 8, "local")
    grads = gradient_sequence(params, 3, K, seed=7)
    w = [np.arange(3, dtype=np.float32) + 1 + t for t in range(K)]
    p1, s1 = _run(step3, placed(params, 3), init3(placed(params, 3)), grads[:1], w[:1], h.mesh_of(3))
    mid = _save(str(tmp_path / "mid"), s1)
    with pytest.raises(zo.ZeroCheckpointError, match="cycle boundary"):
        _restore(mid, init8(placed(params, 8)), reshard=True)
    with pytest.raises(zo.ZeroCheckpointError, match="cycle boundary"):
        zo.reshard(mid, str(tmp_path / "mid8"), 8)
    assert not os.path.exists(tmp_path / "mid8")
    p2, s2 = _run(step3, p1, s1, grads[1:], w[1:], h.mesh_of(3))  # the cycle is complete
    end = _save(str(tmp_path / "end"), s2)
    restored = _restore(end, init8(placed(params, 8)), reshard=True)
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(restored.local))
    assert restored.local["vec"].shape == (8, 13)
    zo.reshard(end, str(tmp_path / "end8"), 8)
    offline = _restore(str(tmp_path / "end8"), init8(placed(params, 8)))
    grads8 = gradient_sequence(params, 8, K, seed=10)
    w8 = [np.arange(8, dtype=np.float32) + t for t in range(K)]
    p8 = jax.device_put(p2, NamedSharding(h.mesh_of(8), P()))
    got, _ = _run(step8, p8, offline, grads8, w8, h.mesh_of(8))
    got_b, _ = _run(step8, p8, restored, grads8, w8, h.mesh_of(8))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(got_b)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    want, _ = mean_oracle("adamw", params, [list(zip(grads, w)), list(zip(grads8, w8))])
    assert_params(got, want)


@pytest.mark.parametrize("kwargs,match", [
    ({"accumulate_steps": 0}, "accumulate_steps"), ({"accumulate_steps": 2.0}, "accumulate_steps"),
    ({"accumulate_steps": True}, "accumulate_steps"), ({"accumulate_steps": 2, "accumulate": "zero2"}, "sharded"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(zo.ZeroError, match=match):
        zo.zero1(optax.adam(1e-2), axis_name="data", **kwargs)
