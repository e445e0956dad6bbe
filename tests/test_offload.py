"""Tests for `zero1(..., offload=True)`: the stored state lives in `pinned_host` memory between steps.

Oracles: plain optax on one device fed the globally reduced gradient (`_harness.run_oracle`), and the same zero1
configuration without offload for checkpoints saved in the other memory kind.
"""

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
from tests._models import muon_recipe
from benchmarks import hlo

N = 3
STEPS = 3
HOST = "pinned_host"

CASES = {
    "flat": lambda: (optax.adamw(1e-2, weight_decay=0.1), "flat"),
    "leaf": lambda: (optax.contrib.muon(1e-2), "leaf"),
    "auto": lambda: (muon_recipe(), "auto"),
}


def kinds(state) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(state)}


def fns(tx, mesh):
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))

    def step(params, state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))),
                   donate_argnums=(1,))
    return init, step


def train(tx, mesh, params, grads_seq, state=None, check=True):
    init, step = fns(tx, mesh)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = init(params) if state is None else state
    if check:
        assert kinds(state) == {HOST}
    for g in grads_seq:
        params, state = step(params, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
        if check:
            assert kinds(state) == {HOST}
    return params, state, step


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_stays_in_host_memory_and_matches_optax(case):
    inner, partition = CASES[case]()
    params = h.small_params()
    grads = h.gradient_sequence(params, N, STEPS)
    tx = zo.zero1(inner, axis_name="data", partition=partition, master_dtype=jnp.float32, offload=True)
    p, s, step = train(tx, h.mesh_of(N), params, grads)
    compiled = step._cache_size()
    p_more, s_more = step(p, jax.device_get(s) and s, jax.device_put(grads[0], NamedSharding(h.mesh_of(N), P("data"))))
    assert step._cache_size() == compiled  # the host-resident state it returns is what it takes: no recompilation
    assert kinds(s_more) == {HOST}
    grads = grads + [grads[0]]
    p, s = p_more, s_more
    ref_p, ref_s = h.run_oracle(inner, params, grads)
    h.assert_matches(p, s, ref_p, ref_s)
    layout = zo.describe(s)
    assert layout.memory_kind == HOST and f"state in {HOST} memory" in layout.summary()
    assert h.full_state(s).keys() == h.full_state(jax.device_get(s)).keys()
    assert kinds(zo.gather_state(s)) <= {HOST, "device"}
    for a, b in zip(jax.tree.leaves(zo.gather_state(s)), jax.tree.leaves(ref_s)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=2e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(zo.master_params(s)), jax.tree.leaves(ref_p)):  # read on the device
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def moves_in_step(step, mesh, params, state, grads) -> list[dict]:
    """The memory-kind moves inside the `shard_map` of `step`, lowered for GPU (`hlo.placement_transfers`)."""
    traced = step.trace(jax.device_put(params, NamedSharding(mesh, P())), state,
                        jax.device_put(grads, NamedSharding(mesh, P("data"))))
    return [m for m in hlo.placement_transfers(traced.lower(lowering_platforms=("cuda",)).as_text())
            if m["in_shard_map"]]


@pytest.mark.parametrize("mode,case", [("sharded", "flat"), ("local", "flat"), ("sharded", "auto")])
def test_accumulation_with_offload(mode, case):
    """Accumulating micro-batches, the state (sharded accumulators included) streams through the device: no move
    is larger than `bucket_bytes`, or one owned leaf's state; `accumulate="local"`'s sums are gradient-sized and
    come to the device whole."""
    inner = optax.adamw(1e-2, weight_decay=0.1) if case == "flat" else muon_recipe()
    params = h.small_params()
    grads = h.gradient_sequence(params, N, 4)
    bucket = 64
    tx = zo.zero1(inner, axis_name="data", partition=case, accumulate_steps=2, accumulate=mode, offload=True,
                  bucket_bytes=bucket, master_dtype=jnp.float32)
    p, s, step = train(tx, h.mesh_of(N), params, grads)
    ref_p, _ = h.run_oracle(optax.MultiSteps(inner, 2), params, grads)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    largest_leaf = max(x.nbytes for x in jax.tree.leaves(params))
    # an owned leaf's state: Adam's mu and nu (or Muon's mu), its accumulator and its master copy
    bound = bucket if case == "flat" else 4 * largest_leaf
    stored = [x for x in jax.tree.leaves(s._inner.histories) + jax.tree.leaves(s.master)
              + jax.tree.leaves(s.buffers)]
    moves = moves_in_step(step, h.mesh_of(N), p, s, grads[0])
    sizes = sorted(m["bytes"] for m in moves if m["to"] == "device")
    local = sorted(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(s.local))
    assert [x for x in sizes if x > bound] == [x for x in local if x > bound], sizes
    assert all(x.addressable_shards[0].data.nbytes not in sizes for x in stored if x.size > bound), sizes


@pytest.mark.parametrize("direction", ["host_to_device", "device_to_host"])
def test_checkpoints_cross_memory_kinds_and_world_sizes(tmp_path, direction):
    inner, partition = CASES["auto"]()
    params = h.small_params()
    grads = h.gradient_sequence(params, N, 2)
    save_offload = direction == "host_to_device"
    make = lambda off: zo.zero1(inner, axis_name="data", partition=partition, master_dtype=jnp.float32,  # noqa: E731
                                offload=off)
    p, s, _ = train(make(save_offload), h.mesh_of(N), params, grads, check=save_offload)
    saved = h.full_state(s)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(s)))
        mngr.wait_until_finished()
    for n, reshard in ((N, False), (2, True)):
        mesh = h.mesh_of(n)
        tx = make(not save_offload)
        target = fns(tx, mesh)[0](jax.device_put(params, NamedSharding(mesh, P())))
        with ocp.CheckpointManager(tmp_path) as mngr:
            got = mngr.restore(1, args=ocp.args.Composite(opt_state=zo.ZeroRestore(target, reshard=reshard)))
        restored = got["opt_state"]
        assert kinds(restored) == ({"device"} if save_offload else {HOST}), (n, kinds(restored))
        for k, v in h.full_state(restored).items():
            np.testing.assert_array_equal(v, saved[k], err_msg=k)
        # and it trains on, in its own memory kind, as optax would after the same steps
        more = h.gradient_sequence(params, n, 1, seed=7)
        p2, s2, _ = train(tx, mesh, p, more, state=restored, check=not save_offload)
        ref_p2, ref_s2 = h.run_oracle(inner, params, grads + more)
        h.assert_matches(p2, s2, ref_p2, ref_s2)


@pytest.mark.parametrize("case,n", [("flat", N), ("leaf", N), ("flat", 1)])
def test_mesh_bound_under_jit(case, n):
    inner, partition = CASES[case]()
    mesh = h.mesh_of(n)
    params = jax.device_put(h.small_params(), NamedSharding(mesh, P()))
    tx = zo.zero1(inner, axis_name="data", mesh=mesh, partition=partition, master_dtype=jnp.float32, offload=True)
    state = tx.init(params)
    assert kinds(state) == {HOST}
    ref_state = inner.init(params)
    step = jax.jit(lambda p, s, g: tx.update(g, s, p), donate_argnums=(1,))
    ref_p = p = params
    for t in range(STEPS):
        g = jax.tree.map(lambda x: jnp.sin(x * (t + 1.0)), p)
        u, state = step(p, state, g)
        assert kinds(state) == {HOST}
        p = optax.apply_updates(p, u)
        ru, ref_state = inner.update(jax.tree.map(lambda x: jnp.sin(x * (t + 1.0)), ref_p), ref_state, ref_p)
        ref_p = optax.apply_updates(ref_p, ru)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    scattered = jax.jit(lambda s, p: zo.scatter_state(tx, s, p))(zo.gather_state(state), p)
    assert kinds(scattered) == {HOST}
    for a, b in zip(jax.tree.leaves(scattered._inner), jax.tree.leaves(state._inner)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flax_optimizer():
    from flax import nnx

    mesh = h.mesh_of(N)

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.linspace(-1, 1, 15).reshape(5, 3))
            self.b = nnx.Param(jnp.asarray(0.25))

    def loss(m):
        return jnp.sum(jnp.tanh(m.w[...]) ** 2) + m.b[...] ** 2

    def make(tx):
        m = Model()
        nnx.update(m, jax.device_put(nnx.state(m), NamedSharding(mesh, P())))
        return m, nnx.Optimizer(m, tx, wrt=nnx.Param)

    m, opt = make(zo.zero1(optax.adam(1e-1), axis_name="data", mesh=mesh, offload=True))
    rm, ropt = make(optax.adam(1e-1))

    @nnx.jit
    def step(m, opt):
        opt.update(m, nnx.grad(loss)(m))

    for _ in range(STEPS):
        step(m, opt)
        step(rm, ropt)
        assert kinds(nnx.as_pure(opt.opt_state)) == {HOST}
    np.testing.assert_allclose(np.asarray(m.w[...]), np.asarray(rm.w[...]), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(m.b[...]), np.asarray(rm.b[...]), rtol=2e-5, atol=1e-6)


def test_compiled_step_moves_the_state_in_buckets():
    """Lowered for GPU (where `device_put` between memory kinds becomes a placement annotation), a step moves every
    stored array to the device once and back once, grouped by `bucket_bytes`; on CPU the state is the entry
    computation's host-memory (`S(5)`) parameters and results."""
    params = {"w": jnp.ones((40, 30)), "b": jnp.zeros(()), "v": jnp.ones((13,))}
    mesh = h.mesh_of(N)
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", offload=True, bucket_bytes=0)
    init, step = fns(tx, mesh)
    state = init(jax.device_put(params, NamedSharding(mesh, P())))
    grads = jax.device_put(jax.tree.map(lambda x: jnp.ones((N, *x.shape)), params), NamedSharding(mesh, P("data")))
    traced = step.trace(jax.device_put(params, NamedSharding(mesh, P())), state, grads)
    moves = hlo.placement_transfers(traced.lower(lowering_platforms=("cuda",)).as_text())
    stored = jax.tree.leaves(state)
    local = sorted(x.addressable_shards[0].data.nbytes for x in stored)
    inside = [m for m in moves if m["in_shard_map"]]
    assert sorted(m["bytes"] for m in inside if m["to"] == "device") == local
    assert sorted(m["bytes"] for m in inside if m["to"] == HOST) == local
    compiled = hlo.host_entry_buffers(traced.lower().compile().as_text())
    assert sorted(compiled["parameters"]) == local and sorted(compiled["results"]) == local


def test_refusals():
    class NoHost:
        platform = "fake"

        def addressable_memories(self):
            class M:
                kind = "device"
            return [M()]

    from zero_optax.step import _offload

    with pytest.raises(zo.ZeroError, match="pinned_host"):
        _offload.check_devices([NoHost()])
    with pytest.raises(zo.ZeroError, match="`offload` must be True or False"):
        zo.zero1(optax.adam(1e-2), axis_name="data", offload="yes")


def test_groups_stream_through_the_device_in_chunks():
    """With the state in host memory, a group's arrays reach the device `bucket_bytes` at a time (all its arrays
    together, in a loop over chunks, the last one shorter) and never whole; the result is still optax's."""
    params = {"w": jnp.linspace(-1, 1, 120).reshape(40, 3), "b": jnp.asarray(0.5), "v": jnp.ones((13,))}
    bucket = 96  # bytes: 8 coordinates of mu, nu and the master copy (float32) together
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data", offload=True, bucket_bytes=bucket, master_dtype=jnp.float32)
    grads = h.gradient_sequence(params, N, STEPS)
    p, s, step = train(tx, h.mesh_of(N), params, grads)
    ref_p, ref_s = h.run_oracle(optax.adamw(1e-2), params, grads)
    h.assert_matches(p, s, ref_p, ref_s)
    (group,) = zo.describe(s).groups
    assert group.size == 40 + 1 + 5  # slots per device: 120 / 3, 1, ceil(13 / 3)
    moves = moves_in_step(step, h.mesh_of(N), params, s, grads[0])
    for to in ("device", HOST):
        sizes = sorted(m["bytes"] for m in moves if m["to"] == to)
        assert sizes.count(8 * 4) >= 3 and sizes.count(6 * 4) == 3, (to, sizes)  # chunks of 8, the tail of 6
        assert group.size * 4 not in sizes and max(sizes) <= bucket, (to, sizes)


def test_owned_leaves_stream_through_the_device_by_bucket():
    """With `partition="leaf"` (Muon), each device's packed buffer stays in host memory and reaches the device
    bucket by bucket of the leaves it owns: at most `bucket_bytes` of state, or one leaf's if it has more. Every
    stored coordinate crosses once each way, and the result is still optax's."""
    params = {"a": jnp.linspace(-1, 1, 48).reshape(8, 6), "b": jnp.linspace(0, 1, 48).reshape(6, 8),
              "c": jnp.linspace(-1, 0, 40).reshape(5, 8), "v": jnp.ones((7,))}
    bucket = 400  # bytes: c (Muon's mu and a master copy, 320 bytes) and v (Adam's mu and nu, a master copy: 84)
    inner = optax.contrib.muon(1e-2)
    tx = zo.zero1(inner, axis_name="data", partition="leaf", offload=True, bucket_bytes=bucket,
                  master_dtype=jnp.float32)
    grads = h.gradient_sequence(params, N, STEPS)
    p, s, step = train(tx, h.mesh_of(N), params, grads)
    ref_p, ref_s = h.run_oracle(inner, params, grads)
    h.assert_matches(p, s, ref_p, ref_s)
    assert len({leaf.owner for leaf in zo.describe(s).leaves}) == N
    shapes = {x.shape for x in jax.tree.leaves(params)}
    owned = sum(x.nbytes for x in jax.tree.leaves(ref_s) if x.shape in shapes) + \
        sum(x.nbytes for x in jax.tree.leaves(params))  # the histories and master copies of every leaf
    row = s.buffers["float32"].addressable_shards[0].data.nbytes
    largest = max(2 * x.nbytes for x in jax.tree.leaves(params) if x.ndim == 2)  # Muon's mu and the master copy
    assert row > max(bucket, largest)
    moves = moves_in_step(step, h.mesh_of(N), p, s, grads[0])
    shared = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(s._inner.shared))
    for to in ("device", HOST):
        sizes = [m["bytes"] for m in moves if m["to"] == to]
        assert max(sizes) <= max(bucket, largest) and row not in sizes, (to, sizes)
        assert sum(sizes) == owned + shared, (to, sizes)  # (every device's branch appears in the program once)


def test_a_step_of_zero_weight_leaves_the_streamed_state_as_it_was():
    """A global weight of zero skips the step: the streamed histories and masters and the step count stay."""
    params = h.small_params()
    mesh = h.mesh_of(N)
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data", offload=True, bucket_bytes=32, master_dtype=jnp.float32)
    init, step = h.zero_fns(tx, mesh, weighted=True)
    shard = NamedSharding(mesh, P("data"))
    grads = h.gradient_sequence(params, N, 2)
    p, s = step(jax.device_put(params, NamedSharding(mesh, P())), init(jax.device_put(params, NamedSharding(mesh, P()))),
                jax.device_put(grads[0], shard), jax.device_put(jnp.ones(N), shard))
    before, p_before = h.full_state(s), jax.device_get(p)
    p, s = step(p, s, jax.device_put(grads[1], shard), jax.device_put(jnp.zeros(N), shard))
    assert kinds(s) == {HOST}
    after = h.full_state(s)
    assert after.keys() == before.keys() and int(after["[0].count"]) == 1
    for k, v in after.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_before)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_an_empty_owned_leaf_streams():
    """An owned leaf with no elements has no range to move; the others stream as usual."""
    params = {"a": jnp.linspace(-1, 1, 48).reshape(8, 6), "e": jnp.zeros((0, 4)), "v": jnp.ones((7,))}
    inner = optax.adamw(1e-2)
    tx = zo.zero1(inner, axis_name="data", partition="leaf", offload=True, bucket_bytes=64, master_dtype=jnp.float32)
    grads = h.gradient_sequence(params, N, 2)
    p, s, _ = train(tx, h.mesh_of(N), params, grads)
    ref_p, ref_s = h.run_oracle(inner, params, grads)
    h.assert_matches(p, s, ref_p, ref_s)
