"""partition="leaf": whole-tensor owners equal plain optax on one device fed the reduced gradient."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h


class ShampooState(NamedTuple):
    stats: dict  # per leaf: (left, right) Gram accumulators for matrices, a scalar accumulator otherwise


def shampoo_like(learning_rate: float = 1e-2, eps: float = 1e-3) -> optax.GradientTransformation:
    """A small Shampoo-like transformation whose state shapes differ from the parameter shapes."""

    def stats_for(p):
        if p.ndim == 2:
            return (jnp.zeros((p.shape[0], p.shape[0]), p.dtype), jnp.zeros((p.shape[1], p.shape[1]), p.dtype))
        return jnp.zeros((), p.dtype)

    def init_fn(params):
        return ShampooState(jax.tree.map(stats_for, params))

    def update_fn(updates, state, params=None):
        del params

        def one(g, s):
            if g.ndim == 2:
                left, right = s[0] + g @ g.T, s[1] + g.T @ g
                pre = g / jnp.sqrt(jnp.outer(jnp.diag(left), jnp.diag(right)) ** 0.5 + eps)
                return -learning_rate * pre, (left, right)
            acc = s + jnp.sum(g * g)
            return -learning_rate * g / jnp.sqrt(acc + eps), acc

        out = jax.tree.map(one, updates, state.stats, is_leaf=lambda x: x is None)
        treedef = jax.tree.structure(updates)
        pairs = treedef.flatten_up_to(out)
        return (treedef.unflatten([u for u, _ in pairs]), ShampooState(treedef.unflatten([s for _, s in pairs])))

    return optax.GradientTransformation(init_fn, update_fn)


MATRIX = {
    "muon": lambda: optax.contrib.muon(2e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "lamb": lambda: optax.lamb(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "shampoo_like": shampoo_like,
}


def mixed_params():
    params = h.small_params()
    params["emb16"] = (jnp.arange(30).reshape(6, 5) / 30).astype(jnp.bfloat16)
    return params


@pytest.mark.parametrize("name", sorted(MATRIX))
@pytest.mark.parametrize("n", [1, 3, 8])
def test_matches_single_device_optax(name, n):
    inner = MATRIX[name]
    params = h.small_params() if name in ("muon", "shampoo_like") else mixed_params()
    grads = h.gradient_sequence(params, n, steps=3)
    zp, zs, _ = h.run_zero(zo.zero1(inner(), axis_name="data", partition="leaf"), params, grads, n)
    rp, rs = h.run_oracle(inner(), params, grads)
    h.assert_matches(zp, zs, rp, rs, rtol=5e-5, atol=1e-6)
    layout = zo.describe(zs)
    assert sorted(set(layout.owners)) == sorted(set(zo.balanced_owners(params, n, inner=inner())))
    if n == 8:
        assert 0 in layout.owned_leaves_per_device  # more devices than leaves: some own nothing


@pytest.mark.parametrize("reduce", ["psum", "psum_scatter"])
def test_explicit_owners_are_honoured(reduce):
    params = h.small_params()
    n = 3
    grads = h.gradient_sequence(params, n, steps=2)
    for owners in ([2, 2, 2, 2, 2], [1, 0, 2, 0, 1]):
        tx = zo.zero1(optax.contrib.muon(2e-2), axis_name="data", partition="leaf", owners=owners, reduce=reduce)
        zp, zs, _ = h.run_zero(tx, params, grads, n)
        layout = zo.describe(zs)
        assert layout.owners == tuple(owners)
        assert layout.owned_leaves_per_device == tuple(owners.count(r) for r in range(n))
        rp, rs = h.run_oracle(optax.contrib.muon(2e-2), params, grads)
        h.assert_matches(zp, zs, rp, rs, rtol=5e-5)


def test_invalid_owners_are_refused():
    params = h.small_params()
    mesh = h.mesh_of(3)
    for owners, match in (([0, 1], r"`owners` has 2 entries, but the parameters have 5 trainable leaves"),
                          ([0, 1, 2, 3, 0], r"`owners\[3\]` \(leaf `\['scale'\]`\) is 3, .* ints in \[0, 3\)"),
                          ([0, 1, -1, 0, 0], r"`owners\[2\]`")):
        tx = zo.zero1(optax.adam(1e-2), axis_name="data", partition="leaf", owners=owners)
        with pytest.raises(zo.ZeroError, match=match):
            jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data"))(params)
    with pytest.raises(zo.ZeroError, match="`owners` applies to partition=\"leaf\" only"):
        zo.zero1(optax.adam(1e-2), axis_name="data", owners=[0])


@pytest.mark.parametrize("reduce", ["psum", "psum_scatter"])
@pytest.mark.parametrize("n", [1, 3])
def test_weighted_reduction(reduce, n):
    params = mixed_params()
    grads = h.gradient_sequence(params, n, steps=3)
    weights = [np.array([2.0, 0.0, 5.0])[-n:], np.zeros(n), np.array([0.0, 0.0, 3.0])[-n:]]
    tx = zo.zero1(optax.adafactor(1e-2, min_dim_size_to_factor=4), axis_name="data", partition="leaf",
                  reduce=reduce)
    zp, zs, _ = h.run_zero(tx, params, grads, n, weights)
    rp, rs = h.run_oracle(optax.adafactor(1e-2, min_dim_size_to_factor=4), params, grads, weights)
    h.assert_matches(zp, zs, rp, rs, rtol=5e-5)


def test_reduce_false_and_reduce_dtype():
    params = h.small_params(jnp.bfloat16)
    grads = h.gradient_sequence(params, 3, steps=2)
    tx = optax.chain(zo.reduce_gradients("data", reduce_dtype=jnp.float32), optax.clip_by_global_norm(0.5),
                     zo.zero1(optax.contrib.muon(2e-2), axis_name="data", partition="leaf", reduce=False))
    zp, zs, _ = h.run_zero(tx, params, grads, 3)
    rp, rs = h.run_oracle(optax.chain(optax.clip_by_global_norm(0.5), optax.contrib.muon(2e-2)), params, grads)
    h.assert_matches(zp, zs[2], rp, rs[1], rtol=1e-2, atol=1e-2)
    for reduce in ("psum", "psum_scatter"):
        tx = zo.zero1(optax.adam(1e-2), axis_name="data", partition="leaf", reduce=reduce,
                      reduce_dtype=jnp.float32)
        zp, zs, _ = h.run_zero(tx, params, grads, 3)
        rp, rs = h.run_oracle(optax.adam(1e-2), params, grads)
        h.assert_matches(zp, zs, rp, rs, rtol=1e-2, atol=1e-2)


def test_leaf_coupling_is_refused():
    tx = zo.zero1(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), axis_name="data", partition="leaf")
    with pytest.raises(zo.ZeroCouplingError, match=r"combines several parameter leaves[\s\S]*reduce_gradients"):
        jax.shard_map(tx.init, mesh=h.mesh_of(3), in_specs=P(), out_specs=P("data"))(h.small_params())


def test_state_bytes_near_the_whole_tensor_limit_on_a_gpt_shaped_tree():
    from tests._models import gpt_params
    params = gpt_params(vocab=512, d_model=32, n_layers=12)
    n = 8
    for inner in (optax.adamw(1e-3), optax.contrib.muon(2e-2)):
        tx = zo.zero1(inner, axis_name="data", partition="leaf", owners=zo.balanced_owners(params, n, inner=inner))
        state = jax.jit(jax.shard_map(tx.init, mesh=h.mesh_of(n), in_specs=P(), out_specs=P("data")))(params)
        per_device = {}
        for arr in jax.tree.leaves(state):
            for shard in arr.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        layout = zo.describe(state)
        replicated = sum(e.nbytes for e in layout.entries)
        largest = max(sum(e.nbytes for e in layout.entries if e.leaf == i) for i in range(len(layout.leaves)))
        limit = max(replicated / n, largest)
        assert max(per_device.values()) <= 1.10 * limit, (max(per_device.values()), limit)
        assert max(per_device.values()) == layout.stored_bytes_per_device
        assert sum(layout.owned_leaves_per_device) == len(layout.leaves)


def test_balanced_owners_is_deterministic_and_balanced():
    params = {"a": jnp.zeros((4, 4)), "b": jnp.zeros(3), "c": jnp.zeros(8), "d": jnp.zeros(8)}
    assert zo.balanced_owners(params, 2) == [0, 0, 1, 1]  # a->0, c->1, d->1, b->0 (tie: lower device)
    assert zo.balanced_owners(params, 2) == zo.balanced_owners(params, 2)
    assert zo.balanced_owners(params, 1) == [0, 0, 0, 0]
    with pytest.raises(zo.ZeroError, match="world_size"):
        zo.balanced_owners(params, 0)


def test_step_compiles_once_and_describe():
    params = mixed_params()
    grads = h.gradient_sequence(params, 3, steps=3)
    tx = zo.zero1(optax.contrib.muon(2e-2), axis_name="data", partition="leaf")
    h.run_zero(tx, params, grads[:1], 3)
    with h.CompileCounter() as first:
        h.run_zero(tx, params, grads[:1], 3)
    with h.CompileCounter() as more:
        _, state, _ = h.run_zero(tx, params, grads, 3)
    assert first.count == more.count
    layout = zo.describe(state)
    assert layout.partition == "leaf" and layout.world_size == 3 and len(layout.owners) == 6
    assert layout.slots == tuple(leaf.size for leaf in layout.leaves)
    assert len(layout.state_bytes_per_device) == 3
    assert "owner" in layout.summary()


def test_leaf_and_flat_side_by_side_under_optax_partition():
    """Matrices under Muon with whole-leaf owners, the rest under AdamW on flat slices (as the README suggests)."""
    params = h.small_params()
    labels = jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)
    tx = optax.partition({"muon": zo.zero1(optax.contrib.muon(2e-2), axis_name="data", partition="leaf"),
                          "adam": zo.zero1(optax.adamw(1e-2), axis_name="data")}, labels)
    ref = optax.partition({"muon": optax.contrib.muon(2e-2), "adam": optax.adamw(1e-2)}, labels)
    grads = h.gradient_sequence(params, 3, steps=3)
    zp, zs, _ = h.run_zero(tx, params, grads, 3)
    rp, rs = h.run_oracle(ref, params, grads)
    for part in ("muon", "adam"):  # parameters, and each part's complete state against optax's masked state
        h.assert_matches(zp, zs.inner_states[part].inner_state, rp, rs.inner_states[part].inner_state, rtol=5e-5)
    muon_state, adam_state = zs.inner_states["muon"].inner_state, zs.inner_states["adam"].inner_state
    assert zo.describe(muon_state).partition == "leaf" and len(zo.describe(muon_state).leaves) == 2
    assert zo.describe(adam_state).partition == "flat" and len(zo.describe(adam_state).leaves) == 3


def test_side_by_side_states_checkpoint_round_trip(tmp_path):
    import orbax.checkpoint as ocp
    params = h.small_params()
    labels = jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)
    tx = optax.partition({"muon": zo.zero1(optax.contrib.muon(2e-2), axis_name="data", partition="leaf"),
                          "adam": zo.zero1(optax.adamw(1e-2), axis_name="data")}, labels)
    _, state, _ = h.run_zero(tx, params, h.gradient_sequence(params, 3, steps=2), 3)
    ckpt = ocp.Checkpointer(zo.ZeroCheckpointHandler())
    ckpt.save(tmp_path / "state", args=zo.ZeroSave(state))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = ckpt.restore(tmp_path / "state", args=zo.ZeroRestore(target))
    jax.tree.map(np.testing.assert_array_equal, restored, state)


def test_devices_that_own_nothing_share_one_branch():
    """The owners' `lax.switch` has a branch per distinct owned set, not per device: 2 leaves on 8 devices give 3
    branches (each owner's and one for the six that own nothing), in init and update, and still match optax."""
    tx = zo.zero1(optax.adafactor(1e-2), axis_name="data", partition="leaf")
    params = {"a": jnp.ones((5, 3)), "b": jnp.arange(7.0)}
    grads = h.gradient_sequence(params, 8, 2)
    zero_params, zero_state, step = h.run_zero(tx, params, grads, 8)
    mesh = h.mesh_of(8)
    init, _ = h.zero_fns(tx, mesh)
    g = jax.device_put(grads[0], NamedSharding(mesh, P("data")))
    for compiled in (init.lower(params).compile(), step.lower(zero_params, zero_state, g).compile()):
        sets = [line.split("branch_computations={")[1].split("}")[0] for line in compiled.as_text().splitlines()
                if "branch_computations={" in line]
        assert sets and max(len(b.split(",")) for b in sets) == 3
    h.assert_matches(zero_params, zero_state, *h.run_oracle(optax.adafactor(1e-2), params, grads))



SHARED = {
    "muon": lambda: optax.contrib.muon(2e-2),
    "adamw_masked": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=lambda p: {k: k != "w1" for k in p}),
    "shampoo_like": shampoo_like,
}


@pytest.mark.parametrize(("name", "partition", "branches"), [
    ("muon", "leaf", 4), ("muon", "auto", 4), ("adamw_masked", "leaf", 5), ("shampoo_like", "leaf", 4)])
def test_devices_owning_alike_share_a_branch(name, partition, branches, monkeypatch):
    """Past `SHARED_BRANCHES` (here 0), devices whose leaves run one program share a branch of the owners' switch,
    each on its own leaves' values, and the results still equal plain optax's: 8 devices owning 7 leaves of 3 shapes
    run 4 branches (one for the device owning nothing); `w1`, of `w0`'s shape but masked out of AdamW's weight
    decay, runs its own program and keeps its own branch."""
    from zero_optax.step import _owned_step

    monkeypatch.setattr(_owned_step, "SHARED_BRANCHES", 0)
    keys_of = _owned_step.branch_keys
    seen = []
    monkeypatch.setattr(_owned_step, "branch_keys", lambda *a: seen.append(len(set(keys := keys_of(*a)))) or keys)
    params = {"w0": jnp.linspace(-1, 1, 35).reshape(5, 7), "w1": jnp.linspace(1, -1, 35).reshape(5, 7),
              "w2": jnp.linspace(-0.5, 1, 35).reshape(5, 7), "b0": jnp.linspace(-1, 1, 13),
              "b1": jnp.linspace(0, 1, 13), "s": jnp.float32(0.3), "t": jnp.float32(-0.2)}
    grads = h.gradient_sequence(params, 8, steps=3)
    zp, zs, _ = h.run_zero(zo.zero1(SHARED[name](), axis_name="data", partition=partition), params, grads, 8)
    rp, rs = h.run_oracle(SHARED[name](), params, grads)
    h.assert_matches(zp, zs, rp, rs, rtol=5e-5, atol=1e-6)
    assert set(seen) == {branches}
