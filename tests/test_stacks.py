"""Owned leaves that run one program on one shape are updated as one vectorised stack (`Layout.stacks`).

The oracle is plain optax on one device fed the reduced gradient; the stacks only change how many programs the
step compiles, never what it computes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h

N = 3


def params_with_repeats() -> dict:
    """Four (5, 7) matrices, three 7-vectors, a (4, 6) matrix and a scalar: sizes that do not divide N."""
    out = {f"w{k}": jnp.linspace(-1, 1, 35).reshape(5, 7) * (k + 1) / 4 for k in range(4)}
    out.update({f"b{k}": jnp.linspace(0, 1, 7) + k for k in range(3)})
    out["head"] = jnp.eye(4, 6) + 0.05
    out["scale"] = jnp.asarray(0.7)
    return out


# w0..w3 and b0..b2 with device 0 owning w0, w2, w3 and b0, b1 (the leaves flatten in sorted key order)
OWNERS = {"b0": 0, "b1": 0, "b2": 1, "head": 2, "scale": 1, "w0": 0, "w1": 1, "w2": 0, "w3": 0}


def owners_list(params) -> list[int]:
    return [OWNERS[k] for k in sorted(params)]


def index(params, *names) -> tuple[int, ...]:
    keys = sorted(params)
    return tuple(keys.index(k) for k in names)


def count_dots(jaxpr) -> int:
    """`dot_general` equations in a jaxpr, sub-jaxprs included (each is a program XLA compiles)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += count_dots(inner)
    return total


def test_same_program_leaves_update_as_one_stack():
    """Device 0's three (5, 7) Muon matrices are one stack and its two vectors (Adam) another; device 1's single
    matrix and vector stay alone. The step runs Muon's orthogonalisation once per stack, and equals optax."""
    params = params_with_repeats()
    inner = optax.contrib.muon(2e-2)
    tx = zo.zero1(inner, axis_name="data", partition="leaf", owners=owners_list(params))
    grads = h.gradient_sequence(params, N, steps=3)
    zp, zs, step = h.run_zero(tx, params, grads, N)
    rp, rs = h.run_oracle(inner, params, grads)
    h.assert_matches(zp, zs, rp, rs, rtol=5e-5, atol=1e-6)
    assert zo.describe(zs).stacks == (index(params, "b0", "b1"), index(params, "w0", "w2", "w3"))

    # the orthogonalisation's matrix products: optax runs them once per matrix, zero1 once per stack or lone matrix
    one = {"w": params["w0"]}
    per_matrix = count_dots(jax.make_jaxpr(inner.update)(one, inner.init(one), one).jaxpr)
    assert per_matrix > 0
    traced = step.trace(zp, zs, jax.device_put(grads[0], NamedSharding(h.mesh_of(N), P("data"))))
    # device 0: one stack (w0, w2, w3); device 1: w1; device 2: head
    assert count_dots(traced.jaxpr.jaxpr) == 3 * per_matrix


def test_leaves_with_different_programs_are_not_stacked():
    """Two (5, 7) matrices that one device owns but `optax.multi_transform` sends to different optimizers (by path)
    run different programs: they stay apart, and the result is optax's."""
    params = params_with_repeats()
    labels = {k: ("sgd" if k == "w2" else "adam") for k in params}
    inner = optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2, momentum=0.9)}, labels)
    tx = zo.zero1(inner, axis_name="data", partition="leaf", owners=owners_list(params))
    grads = h.gradient_sequence(params, N, steps=3)
    zp, zs, _ = h.run_zero(tx, params, grads, N)
    rp, rs = h.run_oracle(inner, params, grads)
    h.assert_matches(zp, zs, rp, rs)
    stacks = zo.describe(zs).stacks
    w0, w2, w3 = index(params, "w0", "w2", "w3")
    assert (w0, w3) in stacks and not any(w2 in s for s in stacks)


@pytest.mark.parametrize("case", ["master", "accumulate", "offload"])
def test_stacks_with_master_weights_accumulation_and_offload(case):
    """Stacks keep optax's result with float32 master copies of bfloat16 parameters, with accumulated micro-batches,
    and with the state streaming from host memory in buckets smaller than a stack (a bucket stacks what it holds)."""
    params = params_with_repeats()
    inner = optax.contrib.muon(2e-2)
    kwargs = {"master": {"master_dtype": jnp.float32},
              "accumulate": {"accumulate_steps": 2},
              "offload": {"offload": True, "bucket_bytes": 400}}[case]
    if case == "master":
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tx = zo.zero1(inner, axis_name="data", partition="leaf", owners=owners_list(params), **kwargs)
    grads = h.gradient_sequence(params, N, steps=4)
    zp, zs, _ = h.run_zero(tx, params, grads, N)
    oracle = optax.MultiSteps(inner, 2) if case == "accumulate" else inner
    if case == "master":  # the oracle steps float32 copies and rounds them, as the master copies do
        wide = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        rp, _ = h.run_oracle(inner, wide, [jax.tree.map(lambda g: g.astype(jnp.float32), g) for g in grads])
        rp = jax.tree.map(lambda x: x.astype(jnp.bfloat16), rp)
    else:
        rp, _ = h.run_oracle(oracle, params, grads)
    assert zo.describe(zs).stacks
    for a, b in zip(jax.tree.leaves(zp), jax.tree.leaves(rp)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=5e-5, atol=1e-6)


def callback_scale(factor: float) -> optax.GradientTransformation:
    """Scales each update on the host (`jax.pure_callback`, which `jax.vmap` refuses without a `vmap_method`)."""

    def update_fn(updates, state, params=None):
        del params
        def host(x):
            return jax.pure_callback(lambda a: (np.asarray(a) * factor).astype(a.dtype),
                                     jax.ShapeDtypeStruct(x.shape, x.dtype), x)

        return jax.tree.map(host, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def test_an_update_that_cannot_be_vectorised_runs_leaf_by_leaf():
    """A stack whose update `jax.vmap` cannot run (a host callback) falls back to one masked view of its members:
    the same result as optax."""
    params = params_with_repeats()
    inner = optax.chain(optax.trace(0.9), callback_scale(-1e-2))
    tx = zo.zero1(inner, axis_name="data", partition="leaf", owners=owners_list(params))
    grads = h.gradient_sequence(params, N, steps=2)
    zp, zs, _ = h.run_zero(tx, params, grads, N)
    assert zo.describe(zs).stacks  # the analysis sees one program per shape; only the vectorised trace fails
    rp, rs = h.run_oracle(inner, params, grads)
    h.assert_matches(zp, zs, rp, rs)


def test_stacks_are_cut_at_stack_bytes(monkeypatch):
    """A stack brings at most `STACK_BYTES` of state, parameters and gradients: a (5, 7) Muon matrix brings 420
    bytes (its momentum, its parameter and its gradient), so with 900 bytes device 0's three matrices make a stack
    of two and a lone matrix."""
    from zero_optax.layout import _fusion

    monkeypatch.setattr(_fusion, "STACK_BYTES", 900)
    params = params_with_repeats()
    inner = optax.contrib.muon(2e-2)
    tx = zo.zero1(inner, axis_name="data", partition="leaf", owners=owners_list(params))
    grads = h.gradient_sequence(params, N, steps=2)
    zp, zs, _ = h.run_zero(tx, params, grads, N)
    assert zo.describe(zs).stacks == (index(params, "b0", "b1"), index(params, "w0", "w2"))
    rp, rs = h.run_oracle(inner, params, grads)
    h.assert_matches(zp, zs, rp, rs, rtol=5e-5, atol=1e-6)
