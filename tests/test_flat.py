"""partition="flat" equals plain optax on one device fed the reduced gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)

ELEMENTWISE = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.5),
    "adagrad": lambda: optax.adagrad(1e-1),
    "adabelief": lambda: optax.adabelief(1e-2),
    "schedule": lambda: optax.adamw(SCHEDULE),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.8),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation(),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
@pytest.mark.parametrize("n", [1, 3, 8])
def test_matches_single_device_optax(name, n):
    inner = ELEMENTWISE[name]
    params = h.small_params()
    grads = h.gradient_sequence(params, n, steps=4)
    zp, zs, _ = h.run_zero(zo.zero1(inner(), axis_name="data"), params, grads, n)
    rp, rs = h.run_oracle(inner(), params, grads)
    h.assert_matches(zp, zs, rp, rs)


@pytest.mark.parametrize("reduce", ["psum", "psum_scatter", True])
def test_reductions_are_exact(reduce):
    params = h.small_params()
    grads = h.gradient_sequence(params, 8, steps=3)
    zp, zs, _ = h.run_zero(zo.zero1(optax.adam(1e-2), axis_name="data", reduce=reduce), params, grads, 8)
    rp, rs = h.run_oracle(optax.adam(1e-2), params, grads)
    h.assert_matches(zp, zs, rp, rs)


def test_bf16_params_reduced_in_float32():
    params = h.small_params(jnp.bfloat16)
    grads = h.gradient_sequence(params, 8, steps=3)
    for reduce in ("psum", "psum_scatter"):
        tx = zo.zero1(optax.adam(1e-2), axis_name="data", reduce=reduce, reduce_dtype=jnp.float32)
        zp, zs, _ = h.run_zero(tx, params, grads, 8)
        rp, rs = h.run_oracle(optax.adam(1e-2), params, grads, reduce_dtype=jnp.float32)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(zp))
        h.assert_matches(zp, zs, rp, rs, rtol=1e-2, atol=1e-2)
        # Differences stay within bf16 rounding of the last step: the state matches closely.
        for a, b in zip(jax.tree.leaves(zp), jax.tree.leaves(rp)):
            assert np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))) <= 2 ** -7


@pytest.mark.parametrize("reduce", ["psum", "psum_scatter"])
@pytest.mark.parametrize("n", [1, 8])
def test_weighted_reduction_uneven_and_zero_weights(reduce, n):
    params = h.small_params()
    grads = h.gradient_sequence(params, n, steps=4)
    weights = [np.array([3, 0, 1, 7, 2, 0, 5, 1.0]), np.array([1, 1, 1, 1, 1, 1, 1, 0.0]),
               np.zeros(8), np.array([0, 0, 0, 4, 0, 0, 0, 0.0])]
    if n == 1:
        weights = [np.array([2.5]), np.array([0.0]), np.array([4.0]), np.array([0.5])]
    tx = zo.zero1(optax.adamw(1e-2, weight_decay=0.1), axis_name="data", reduce=reduce)
    zp, zs, _ = h.run_zero(tx, params, grads, n, weights)
    rp, rs = h.run_oracle(optax.adamw(1e-2, weight_decay=0.1), params, grads, weights)
    h.assert_matches(zp, zs, rp, rs)
    count = [v for k, v in h.full_state(zs).items() if k.endswith("count")]
    assert [int(c) for c in count] == [3]  # the zero-weight step was skipped


def test_zero_global_weight_leaves_params_and_state_unchanged():
    params = h.small_params()
    grads = h.gradient_sequence(params, 3, steps=1)
    tx = zo.zero1(optax.adam(1e-2), axis_name="data")
    p0, s0, _ = h.run_zero(tx, params, [], 3)
    p1, s1, _ = h.run_zero(tx, params, grads, 3, [np.zeros(3)])
    jax.tree.map(np.testing.assert_array_equal, p0, p1)
    jax.tree.map(np.testing.assert_array_equal, s0, s1)


def test_reduce_false_after_reduce_gradients_and_global_clipping():
    params = h.small_params()
    grads = h.gradient_sequence(params, 8, steps=3)
    tx = optax.chain(zo.reduce_gradients("data"), optax.clip_by_global_norm(0.5),
                     zo.zero1(optax.adam(1e-2), axis_name="data", reduce=False))
    zp, zs, _ = h.run_zero(tx, params, grads, 8)
    rp, rs = h.run_oracle(optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)), params, grads)
    h.assert_matches(zp, zs[2], rp, rs[1])


def test_frozen_leaves_hold_no_state():
    params = h.small_params()
    labels = jax.tree.map(lambda _: "train", params)
    labels["head"] = "frozen"
    inner = optax.partition({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
    grads = h.gradient_sequence(params, 3, steps=2)
    zp, zs, _ = h.run_zero(zo.zero1(inner, axis_name="data"), params, grads, 3)
    layout = zo.describe(zs)
    head = layout.paths.index("['head']")
    assert not any(e.leaf == head for e in layout.entries)
    np.testing.assert_array_equal(zp["head"], params["head"])
    rp, rs = h.run_oracle(inner, params, grads)
    h.assert_matches(zp, zs, rp, rs)


def test_state_bytes_are_one_nth_on_a_model_shaped_tree():
    from tests._models import gpt_params
    params = gpt_params(vocab=1000, d_model=40, n_layers=2)
    n = 8
    mesh = h.mesh_of(n)
    tx = zo.zero1(optax.adamw(1e-3), axis_name="data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))(params)
    per_device = {}
    for arr in jax.tree.leaves(state):
        for shard in arr.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    replicated = jax.tree.leaves(optax.adamw(1e-3).init(params))
    scalars = sum(x.nbytes for x in replicated if x.size == 1)
    ideal = sum(x.nbytes for x in replicated) / n
    assert len(per_device) == n
    assert max(per_device.values()) <= 1.01 * ideal + scalars, (max(per_device.values()), ideal)
    assert zo.describe(state).stored_bytes_per_device == max(per_device.values())


def test_step_compiles_once():
    params = h.small_params()
    grads = h.gradient_sequence(params, 8, steps=4)
    tx = zo.zero1(optax.adam(1e-2), axis_name="data")
    h.run_zero(tx, params, grads[:1], 8)  # warm the helper ops (device_put, random) once
    with h.CompileCounter() as first:
        h.run_zero(tx, params, grads[:1], 8)
    with h.CompileCounter() as more:
        h.run_zero(tx, params, grads, 8)
    assert first.count == more.count  # four steps compile exactly what one step does: no recompilation


def test_init_accepts_shape_dtype_structs_and_state_types_match():
    params = h.small_params()
    mesh = h.mesh_of(3)
    tx = zo.zero1(optax.adam(1e-2), axis_name="data")
    init, step = h.zero_fns(tx, mesh)
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    abstract = jax.eval_shape(init, structs)
    state = init(params)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    grads = jax.device_put(h.gradient_sequence(params, 3, 1)[0], NamedSharding(mesh, P("data")))
    _, new = step(params, state, grads)
    assert jax.tree.structure(new) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(abstract)):
        assert a.shape == b.shape and a.dtype == b.dtype


def test_describe_reports_the_layout():
    params = h.small_params()
    _, state, _ = h.run_zero(zo.zero1(optax.adam(1e-2), axis_name="data"), params, [], 3)
    layout = zo.describe(state)
    assert layout.world_size == 3 and layout.axis_name == "data" and layout.partition == "flat"
    assert layout.paths == ("['dense']['b']", "['dense']['w']", "['head']", "['scale']", "['vec']")
    assert layout.shapes == ((7,), (5, 7), (4, 6), (), (13,))
    assert layout.slots == (3, 12, 8, 1, 5)
    assert layout.owners is None
    assert "world_size=3" in layout.summary()


def test_weight_decay_mask_given_as_a_tree():
    params = h.small_params()
    mask = jax.tree.map(lambda x: x.ndim > 1, params)  # computed once from the real parameters
    grads = h.gradient_sequence(params, 3, steps=3)
    inner = lambda: optax.adamw(1e-2, weight_decay=0.5, mask=mask)
    zp, zs, _ = h.run_zero(zo.zero1(inner(), axis_name="data"), params, grads, 3)
    rp, rs = h.run_oracle(inner(), params, grads)
    h.assert_matches(zp, zs, rp, rs)
