"""Small sliced leaves that run one program are stored and updated as one buffer (`Layout.groups`), exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from zero_optax.layout import _fusion


def many_params(count: int = 60) -> dict:
    """Leaves of sizes that do not divide the device counts, scalars included, and one large leaf."""
    rng = np.random.default_rng(3)
    shapes = [(), (3,), (5, 3), (7,), (2, 2, 3)]
    out = {f"p{i:03d}": jnp.asarray(rng.normal(size=shapes[i % len(shapes)]), jnp.float32) for i in range(count)}
    out["big"] = jnp.asarray(rng.normal(size=(_fusion.FUSE_BYTES // 4 * 8 + 5,)), jnp.float32)  # > FUSE_BYTES/device
    return out


def groups_by_path(state) -> list[set[str]]:
    layout = zo.describe(state)
    return [{layout.leaves[i].path for i in g.leaves} for g in layout.groups]


def test_one_program_is_one_group_and_few_arrays():
    params = many_params()
    grads = h.gradient_sequence(params, 3, steps=3)
    zp, zs, _ = h.run_zero(zo.zero1(optax.adamw(1e-2, weight_decay=0.1), axis_name="data"), params, grads, 3)
    rp, rs = h.run_oracle(optax.adamw(1e-2, weight_decay=0.1), params, grads)
    h.assert_matches(zp, zs, rp, rs)
    groups = groups_by_path(zs)
    assert len(groups) == 2 and {"['big']"} in groups  # the large leaf keeps arrays of its own
    # 61 leaves, 2 histories each: the state crosses shard_map as the step count and 2 arrays per group
    assert len(jax.tree.leaves(zs)) == 1 + 2 * 2


def test_different_programs_are_different_groups():
    """A weight-decay mask and two learning rates (shared values) make four programs; each stays exact."""
    params = many_params(20)
    labels = {k: ("fast" if i % 3 == 0 else "slow") for i, k in enumerate(sorted(params))}
    mask = {k: i % 2 == 0 for i, k in enumerate(sorted(params))}
    inner = optax.partition({"fast": optax.adamw(1e-2, weight_decay=0.5, mask=mask),
                             "slow": optax.adamw(1e-3, weight_decay=0.5, mask=mask)}, labels)
    grads = h.gradient_sequence(params, 8, steps=3)
    zp, zs, _ = h.run_zero(zo.zero1(inner, axis_name="data"), params, grads, 8)
    rp, rs = h.run_oracle(inner, params, grads)
    h.assert_matches(zp, zs, rp, rs)
    small = [g for g in groups_by_path(zs) if g != {"['big']"}]
    key = {f"['{k}']": (labels[k], mask[k]) for k in params}
    assert sorted(sorted({key[p] for p in g}) for g in small) == [[("fast", False)], [("fast", True)],
                                                                  [("slow", False)], [("slow", True)]]


@pytest.mark.parametrize("n", [1, 8])
def test_master_copies_and_state_transfer_per_leaf(n):
    """With master weights the groups' master buffers step exactly; gather/scatter present every leaf."""
    params = many_params(12)
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", master_dtype=jnp.float32)
    grads = h.gradient_sequence(params, n, steps=3)
    zp, zs, _ = h.run_zero(tx, params, grads, n)
    rp, rs = h.run_oracle(optax.adam(1e-2), params, grads)
    h.assert_matches(zp, zs, rp, rs)
    for a, b in zip(jax.tree.leaves(zo.gather_state(zs)), jax.tree.leaves(rs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    mesh = h.mesh_of(n)
    bound = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh, master_dtype=jnp.float32)
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    again = zo.scatter_state(bound, rs, placed)
    for a, b in zip(jax.tree.leaves(zo.gather_state(again)), jax.tree.leaves(rs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_program_that_reads_the_length_is_not_fused():
    """An update whose constant depends on the slice's length (here 1 / size) runs per leaf, or is refused."""
    def scale_by_size():
        return optax.stateless(lambda u, p: jax.tree.map(lambda x: x / x.size, u))
    params = {"a": jnp.ones(8), "b": jnp.ones(6)}  # on 2 devices: slices of 4 and 3, 7 in one buffer
    tx = zo.zero1(optax.chain(optax.sgd(1e-2), scale_by_size()), axis_name="data")
    with pytest.raises(zo.ZeroCouplingError, match="operations to the parameters"):
        jax.shard_map(tx.init, mesh=h.mesh_of(2), in_specs=P(), out_specs=P("data"))(params)


def test_an_update_that_fails_on_slices_names_the_failure():
    """An update that runs on the parameters but cannot run on 1-D slices is refused with its own error."""
    def two_d_only():
        return optax.stateless(lambda u, p: jax.tree.map(lambda x: x[:, :] * 2.0, u))
    params = {"a": jnp.ones((4, 3)), "b": jnp.ones((2, 5))}
    tx = zo.zero1(optax.chain(optax.sgd(1e-2), two_d_only()), axis_name="data")
    with pytest.raises(zo.ZeroCouplingError, match="fails on their 1-D coordinate slices.*IndexError"):
        jax.shard_map(tx.init, mesh=h.mesh_of(2), in_specs=P(), out_specs=P("data"))(params)


def equal_leaves(count: int) -> dict:
    """`count` leaves of one shape, each large enough to keep arrays of its own (a group of one)."""
    rng = np.random.default_rng(5)
    return {f"w{i}": jnp.asarray(rng.normal(size=(_fusion.FUSE_BYTES // 4 * 8 + 5,)), jnp.float32)
            for i in range(count)}


def counting(inner: optax.GradientTransformation) -> tuple[optax.GradientTransformationExtraArgs, list]:
    """`inner`, and the list its update appends to each time it is called (traced)."""
    calls = []

    def update(updates, state, params=None, **extra):
        calls.append(1)
        return inner.update(updates, state, params, **extra)
    return optax.GradientTransformationExtraArgs(inner.init, update), calls


def test_groups_of_one_program_trace_it_once():
    """Groups that run one program on views of one shape trace the inner update once, however many there are."""
    traced = []
    for count in (3, 6):
        params = equal_leaves(count)
        inner, calls = counting(optax.adam(1e-2))
        grads = h.gradient_sequence(params, 8, steps=2)
        zp, zs, _ = h.run_zero(zo.zero1(inner, axis_name="data"), params, grads, 8)
        rp, rs = h.run_oracle(optax.adam(1e-2), params, grads)
        h.assert_matches(zp, zs, rp, rs)
        layout = zo.describe(zs)
        assert len(layout.groups) == count and len({g.program for g in layout.groups}) == 1
        traced.append(len(calls))
    assert traced[0] == traced[1]


def offset_accumulator(offsets: dict[str, float]) -> optax.GradientTransformation:
    """Adagrad whose accumulator starts at a value per leaf, by path: one update program, `init`s that differ."""
    def init(params):
        return jax.tree_util.tree_map_with_path(lambda path, p: jnp.full_like(p, offsets[jax.tree_util.keystr(path)]),
                                                params)

    def update(updates, state, params=None):
        state = jax.tree.map(lambda s, g: s + g * g, state, updates)
        return jax.tree.map(lambda g, s: -0.1 * g / jnp.sqrt(s), updates, state), state
    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("case", ["labels", "init"])
def test_leaves_whose_program_depends_on_their_path_trace_their_own(case):
    """Leaves of one shape that two labels' states (or `init`s) treat apart are no groups of one program."""
    params = equal_leaves(4)
    side = {k: i % 2 for i, k in enumerate(sorted(params))}
    if case == "labels":  # one optimizer under two labels: each has a step count of its own
        inner = optax.partition({0: optax.adam(1e-2), 1: optax.adam(1e-2)}, side)
    else:
        inner = offset_accumulator({f"['{k}']": 0.5 + side[k] for k in params})
    grads = h.gradient_sequence(params, 8, steps=2)
    zp, zs, _ = h.run_zero(zo.zero1(inner, axis_name="data"), params, grads, 8)
    rp, rs = h.run_oracle(inner, params, grads)
    h.assert_matches(zp, zs, rp, rs)
    layout = zo.describe(zs)
    program = {layout.leaves[g.first].path: g.program for g in layout.groups}
    assert program["['w0']"] == program["['w2']"] != program["['w1']"] == program["['w3']"]
