"""Inner transformations run unchanged whatever they branch on: `lax.cond`, `lax.switch`, `jnp.where`, `lax.scan`
and `lax.while_loop` over the values zero1 hands them, exact against plain optax on one device."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import zero_optax as zo
from tests import _harness as h


class BranchyState(NamedTuple):
    count: jax.Array  # int32 scalar
    cool: jax.Array  # int32 scalar
    trace: optax.Params


def branchy(learning_rate: float) -> optax.GradientTransformation:
    """An elementwise optimizer written with every control-flow construct, each fed a different mix of values:
    a constant against a state-derived value, a gradient against a history, a scalar loop counter."""

    def init(params):
        return BranchyState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32),
                            jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del params
        count = state.count + 1
        # A constant in one branch, the state in the other (reduce_on_plateau's cooldown).
        cool = lax.cond(state.cool > 0, lambda: jnp.asarray(0, jnp.int32), lambda: state.cool + count % 2)
        # The gradient in one branch, the history in the other (novograd's first step).
        trace = jax.tree.map(lambda t, g: lax.cond(count == 1, lambda: g, lambda: 0.9 * t + g), state.trace, grads)
        scale = lax.switch(count % 3, [lambda: jnp.float32(1.0), lambda: jnp.float32(0.5),
                                       lambda: 0.25 * (cool + 1).astype(jnp.float32)])

        def damp(t):
            c, _ = lax.scan(lambda c, _: (0.5 * c + t, None), jnp.zeros_like(t), None, length=3)
            return jnp.where(t > 0, c, 2 * c)
        updates = jax.tree.map(lambda t: -learning_rate * scale * damp(t), trace)
        counted = lax.while_loop(lambda k: k < count, lambda k: k + 1, jnp.zeros([], jnp.int32))
        return updates, BranchyState(counted, cool, trace)

    return optax.GradientTransformation(init, update)


CASES = {
    "branchy": (lambda: branchy(0.1), ("flat", "auto")),
    "novograd": (lambda: optax.novograd(1e-2), ("flat", "leaf", "auto")),
    "plateau": (lambda: optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1, cooldown=1)),
                ("flat", "auto")),
}


@pytest.mark.parametrize("name,partition", [(k, p) for k, (_, ps) in CASES.items() for p in ps])
def test_branching_inner_in_shard_map(name, partition):
    make, _ = CASES[name]
    params = h.small_params()
    grads = h.gradient_sequence(params, 3, 4)
    tx = zo.zero1(make(), axis_name="data", partition=partition)
    extra = {"value": jnp.float32(1.0)} if name == "plateau" else {}
    if extra:  # every device passes the same value, as the README asks
        tx = _with_value(tx)
        ref = _with_value(make())
    else:
        ref = make()
    z_params, z_state, _ = h.run_zero(tx, params, grads, 3)
    r_params, r_state = h.run_oracle(ref, params, grads)
    h.assert_matches(z_params, z_state, r_params, r_state)


def _with_value(tx):
    """`tx` called with a fixed `value=` (reduce_on_plateau's loss), the same on every device."""
    tx = optax.with_extra_args_support(tx)
    return optax.GradientTransformation(tx.init, lambda g, s, p=None: tx.update(g, s, p, value=jnp.float32(1.0)))


@pytest.mark.parametrize("partition", ["flat", "auto", "leaf"])
def test_novograd_mesh_bound(partition):
    """Mesh-bound on 8 devices under `jax.jit`: the owned leaves' reduced gradients are the same on every device
    while their stored state is not, which novograd's first-step `lax.cond` used to refuse."""
    mesh = h.mesh_of(8)
    tx = zo.zero1(optax.novograd(1e-2), axis_name="data", mesh=mesh, partition=partition)
    h.assert_matches(*h.run_mesh_bound(tx, optax.novograd(1e-2), h.small_params(), 3, mesh))
