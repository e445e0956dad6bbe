"""Tests for `zero1(..., accumulate_steps=k)`: gradient accumulation, sharded (ZeRO-2) and local.

Oracles run plain optax on one device: `optax.MultiSteps(inner, k)` fed each micro-batch's global mean gradient
(equal weights), and `inner` fed the hand-computed token-weighted mean of each cycle (unequal weights).
"""

import os

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.hlo import branch_collectives
from benchmarks.variants import muon_recipe

K = 2


def inner_of(kind):
    return {"adamw": lambda: optax.adamw(1e-2, weight_decay=0.1), "muon": lambda: optax.contrib.muon(1e-2),
            "recipe": muon_recipe}[kind]()


CASES = [("adamw", "flat", 1, "sharded"), ("adamw", "flat", 3, "local"), ("adamw", "flat", 8, "sharded"),
         ("muon", "leaf", 3, "sharded"), ("muon", "leaf", 8, "local"), ("recipe", "auto", 8, "sharded"),
         ("recipe", "auto", 3, "local")]


def weighted_oracle(inner, params, cycles):
    """`inner` on one device, fed each cycle's sum of loss-sum gradients over its sum of weights (float64 sums);
    a cycle of total weight zero is skipped."""
    state, update = inner.init(params), jax.jit(inner.update)
    for cycle in cycles:
        total = sum(float(np.sum(w)) for _, w in cycle)
        if total == 0:
            continue
        mean = jax.tree.map(lambda *gs: jnp.asarray(sum(np.asarray(g, np.float64).sum(0) for g in gs) / total,
                                                    jnp.float32), *[g for g, _ in cycle])
        u, state = update(mean, state, params)
        params = optax.apply_updates(params, u)
    return params, state


def assert_inner_state(zero_state, ref_state):
    got = {k[len(".inner"):]: v for k, v in h.full_state(zero_state).items() if k.startswith(".inner")}
    want = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(ref_state)}
    assert set(got) == set(want)
    for path, x in want.items():
        np.testing.assert_allclose(np.asarray(got[path], np.float64), np.asarray(x, np.float64), rtol=2e-5,
                                   atol=1e-6, err_msg=path)


def assert_params(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("kind,partition,n,mode", CASES)
def test_matches_multisteps_and_token_weighted_mean(kind, partition, n, mode):
    params = h.small_params()
    tx = zo.zero1(inner_of(kind), axis_name="data", partition=partition, accumulate_steps=K, accumulate=mode)
    # equal weights: optax.MultiSteps fed every micro-batch's global mean gradient
    grads = h.gradient_sequence(params, n, 2 * K, seed=1)
    got, _, _ = h.run_zero(tx, params, grads, n)
    ms = optax.MultiSteps(inner_of(kind), K)
    want, s, update = params, ms.init(params), jax.jit(ms.update)
    for g in grads:
        u, s = update(h.reduced(g), s, want)
        want = optax.apply_updates(want, u)
    assert_params(got, want)
    # unequal token counts, one cycle of total weight zero (skipped), one device with weight zero
    grads = h.gradient_sequence(params, n, 3 * K, seed=2)
    weights = [np.arange(n, dtype=np.float32) + 1 + t for t in range(3 * K)]
    weights[2], weights[3] = np.zeros(n, np.float32), np.zeros(n, np.float32)
    weights[4][0] = 0
    got, state, _ = h.run_zero(tx, params, grads, n, weights)
    cycles = [list(zip(grads[c * K:(c + 1) * K], weights[c * K:(c + 1) * K])) for c in range(3)]
    want, ref_state = weighted_oracle(inner_of(kind), params, cycles)
    assert_params(got, want)
    assert_inner_state(state, ref_state)


def test_non_final_calls_move_no_all_gather_and_return_zeros():
    n, params = 8, h.small_params()
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data", accumulate_steps=3)
    init, step = h.zero_fns(tx, h.mesh_of(n))
    state = init(params)
    g = jax.device_put(h.gradient_sequence(params, n, 1)[0], NamedSharding(h.mesh_of(n), P("data")))
    text = step.lower(params, state, g).compile().as_text()
    paths = branch_collectives(text)
    assert len(paths["kinds"]) == 1
    kinds = sorted(paths["kinds"][0], key=lambda k: "all-gather" in k)
    assert "all-gather" not in kinds[0] and kinds[0].get("reduce-scatter", 0) >= 1   # a micro-batch
    assert kinds[1].get("all-gather", 0) >= 1 and kinds[1].get("reduce-scatter", 0) >= 1  # the optimizer step
    p1, state = step(params, state, g)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
    assert int(np.asarray(state.inner_state.micro_step)[0, ...]) == 1


def test_describe_reports_accumulator_bytes():
    params = h.small_params()
    size = sum(x.size for x in jax.tree.leaves(params))
    for mode, n in (("sharded", 3), ("local", 3)):
        tx = zo.zero1(optax.adam(1e-2), axis_name="data", accumulate_steps=2, accumulate=mode)
        init, _ = h.zero_fns(tx, h.mesh_of(n))
        layout = zo.describe(init(params))
        got = layout.accumulator_bytes_per_device
        want = 4 * sum(-(-x.size // n) for x in jax.tree.leaves(params)) if mode == "sharded" else 4 * size
        assert got == (want,) * n
        assert "accumulator bytes per device" in layout.summary()
    plain = zo.describe(h.zero_fns(zo.zero1(optax.adam(1e-2), axis_name="data"), h.mesh_of(3))[0](params))
    assert plain.accumulator_bytes_per_device == (0, 0, 0)


def test_mesh_bound_inside_lax_scan_matches_multisteps():
    n, params = 3, h.small_params()
    mesh = h.mesh_of(n)
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data", mesh=mesh, accumulate_steps=K)
    state = tx.init(params)

    @jax.jit
    def step(p, s, gs):
        def body(carry, g):
            p, s = carry
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None
        return jax.lax.scan(body, (p, s), gs)[0]

    grads = [h.reduced(g) for g in h.gradient_sequence(params, n, 2 * K, seed=3)]
    stacked = jax.tree.map(lambda *gs: jnp.stack(gs), *grads)
    got, _ = step(params, state, stacked)
    ms = optax.MultiSteps(optax.adamw(1e-2), K)
    want, s, update = params, ms.init(params), jax.jit(ms.update)
    for g in grads:
        u, s = update(g, s, want)
        want = optax.apply_updates(want, u)
    assert_params(got, want)


def _save(directory, state):
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(state)))
        mngr.wait_until_finished()
    return os.path.join(directory, "1", "opt_state")


def _restore(item, target, reshard=False):
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        return ckpt.restore(item, args=zo.ZeroRestore(target, reshard=reshard))


def _run(step, params, state, grads, weights, mesh):
    shard = NamedSharding(mesh, P("data"))
    for g, w in zip(grads, weights):
        params, state = step(params, state, jax.device_put(g, shard), jax.device_put(jnp.asarray(w), shard))
    return params, state


@pytest.mark.parametrize("mode", ["sharded", "local"])
def test_mid_cycle_checkpoint_restores_exactly(tmp_path, mode):
    n, k, params = 3, 3, h.small_params()
    tx = zo.zero1(optax.contrib.muon(1e-2), axis_name="data", partition="auto", accumulate_steps=k,
                  accumulate=mode)
    mesh = h.mesh_of(n)
    init, step = h.zero_fns(tx, mesh, weighted=True)
    grads = h.gradient_sequence(params, n, 2 * k, seed=4)
    weights = [np.arange(n, dtype=np.float32) + t for t in range(2 * k)]
    p_mid, s_mid = _run(step, params, init(params), grads[:4], weights[:4], mesh)  # one call into cycle 2
    item = _save(str(tmp_path), s_mid)
    restored = _restore(item, init(params))
    p_a, s_a = _run(step, p_mid, restored, grads[4:], weights[4:], mesh)
    p_b, s_b = _run(step, p_mid, s_mid, grads[4:], weights[4:], mesh)
    for a, b in zip(jax.tree.leaves((p_a, s_a)), jax.tree.leaves((p_b, s_b))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    cycles = [list(zip(grads[c * k:(c + 1) * k], weights[c * k:(c + 1) * k])) for c in range(2)]
    want, _ = weighted_oracle(optax.contrib.muon(1e-2), params, cycles)
    assert_params(p_a, want)


def test_sharded_accumulators_reshard_mid_cycle(tmp_path):
    k, params = 3, h.small_params()
    kind = "recipe"
    tx = zo.zero1(inner_of(kind), axis_name="data", partition="auto", accumulate_steps=k)
    grads3 = h.gradient_sequence(params, 3, 2, seed=5)
    grads8 = h.gradient_sequence(params, 8, 2 * k - 2, seed=6)
    w3 = [np.arange(3, dtype=np.float32) + 1 + t for t in range(2)]
    w8 = [np.arange(8, dtype=np.float32) * (t + 1) for t in range(2 * k - 2)]
    init3, step3 = h.zero_fns(tx, h.mesh_of(3), weighted=True)
    p_mid, s_mid = _run(step3, params, init3(params), grads3, w3, h.mesh_of(3))  # 2 of 3 calls of cycle 1
    item = _save(str(tmp_path / "a"), s_mid)
    init8, step8 = h.zero_fns(tx, h.mesh_of(8), weighted=True)
    p8 = jax.device_put(p_mid, NamedSharding(h.mesh_of(8), P()))
    restored = _restore(item, init8(p8), reshard=True)
    got, _ = _run(step8, p8, restored, grads8, w8, h.mesh_of(8))
    calls = list(zip(grads3, w3)) + list(zip(grads8, w8))
    want, _ = weighted_oracle(inner_of(kind), params, [calls[:k], calls[k:]])
    assert_params(got, want)
    # offline: zo.reshard to 8 devices, then a plain restore, continues the same
    zo.reshard(item, str(tmp_path / "b"), 8)
    again = _restore(str(tmp_path / "b"), init8(p8))
    got2, _ = _run(step8, p8, again, grads8, w8, h.mesh_of(8))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(got2)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_local_accumulators_refuse_mid_cycle_reshard(tmp_path):
    params = h.small_params()
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", accumulate_steps=2, accumulate="local")
    init3, step3 = h.zero_fns(tx, h.mesh_of(3), weighted=True)
    grads = h.gradient_sequence(params, 3, 2, seed=7)
    w = [np.ones(3, np.float32)] * 2
    p1, s1 = _run(step3, params, init3(params), grads[:1], w[:1], h.mesh_of(3))
    init2, _ = h.zero_fns(tx, h.mesh_of(2))
    with pytest.raises(zo.ZeroCheckpointError, match="cycle boundary"):
        _restore(_save(str(tmp_path / "mid"), s1), init2(params), reshard=True)
    p2, s2 = _run(step3, p1, s1, grads[1:], w[1:], h.mesh_of(3))  # the cycle is complete
    restored = _restore(_save(str(tmp_path / "end"), s2), init2(params), reshard=True)
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(restored.local))
    assert restored.local["vec"].shape == (2, 13)


@pytest.mark.parametrize("kwargs,match", [
    ({"accumulate_steps": 0}, "accumulate_steps"), ({"accumulate_steps": 2.0}, "accumulate_steps"),
    ({"accumulate_steps": True}, "accumulate_steps"), ({"accumulate_steps": 2, "accumulate": "zero2"}, "sharded"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(zo.ZeroError, match=match):
        zo.zero1(optax.adam(1e-2), axis_name="data", **kwargs)
