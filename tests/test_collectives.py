"""The collectives a zero1 step compiles to, on every JAX release CI tests: the invariant all-gather stays an
all-gather (a masked-psum stand-in would all-reduce a parameter-sized buffer: 1.5 x the wire)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from benchmarks.hlo import WIRE_WEIGHTS, collective_ops

N = 8


def _step_ops(tx):
    mesh = h.mesh_of(N)
    params = jax.device_put(h.small_params(), NamedSharding(mesh, P()))
    grads = jax.device_put(h.gradient_sequence(h.small_params(), N, 1)[0], NamedSharding(mesh, P("data")))
    init, step = h.zero_fns(tx, mesh)
    state = init(params)
    return collective_ops(step.lower(params, state, grads).compile().as_text()), state


def test_flat_step_is_one_reduce_scatter_and_one_all_gather():
    ops, state = _step_ops(zo.zero1(optax.adamw(1e-2), axis_name="data"))
    assert sorted(o["kind"] for o in ops) == ["all-gather", "reduce-scatter"]
    # Each moves the padded parameter bytes once: N x slots x 4 bytes over the leaves (2 x P up to padding).
    padded = sum(N * slots * 4 for slots in zo.describe(state).slots)
    wire = sum(WIRE_WEIGHTS[o["kind"]] * o["bytes"] * o["multiplier"] for o in ops)
    assert wire == 2 * padded


def _owned_ops(partition: str, params: dict):
    """The collectives of a zero1 Muon step on `params`, and the sizes (elements) of each device's owned leaves."""
    mesh = h.mesh_of(N)
    tx = zo.zero1(optax.contrib.muon(1e-2), axis_name="data", partition=partition)
    init, step = h.zero_fns(tx, mesh)
    grads = jax.device_put(h.gradient_sequence(params, N, 1)[0], NamedSharding(mesh, P("data")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = init(params)
    leaves = zo.describe(state).leaves
    rows = [sum(leaf.size for leaf in leaves if leaf.owner == r) for r in range(N)]
    return collective_ops(step.lower(params, state, grads).compile().as_text()), rows


@pytest.mark.parametrize("partition", ["leaf", "auto"])
def test_owned_updates_travel_in_one_all_gather_of_even_rows(partition):
    """Eight matrices of one shape: each device owns one, and the updates travel in one all-gather of the rows."""
    params = {f"w{k}": jnp.full((3, 5), 0.1 * k + 0.1) for k in range(N)}
    ops, rows = _owned_ops(partition, params)
    assert rows == [15] * N
    gathers = [o for o in ops if o["kind"] == "all-gather"]
    assert [o["bytes"] * o["multiplier"] for o in gathers] == [N * 15 * 4], ops
    # The gradient reduction may all-reduce (the packed reduce-scatter moves as much here), but nothing larger
    # than the gradients is all-reduced.
    assert sum(o["bytes"] * o["multiplier"] for o in ops if o["kind"] == "all-reduce") <= N * 15 * 4, ops


@pytest.mark.parametrize("partition", ["leaf", "auto"])
def test_owned_updates_of_uneven_rows_travel_in_one_all_reduce(partition):
    """Devices owning leaves of very different sizes: an all-gather of rows padded to the largest (35 elements) would
    move N x 35 = 280 elements, more than twice the 80 the updates hold, so the updates travel as one sum of the
    unpadded buffer (each owner's part, zeros elsewhere): no all-gather, and each all-reduce holds at most the
    owned leaves' bytes."""
    ops, rows = _owned_ops(partition, h.small_params())
    assert max(rows) == 35 and sum(rows) == 80
    assert [o["kind"] for o in ops] == ["all-reduce", "all-reduce"], ops  # the gradients', then the updates'
    assert [o["bytes"] * o["multiplier"] for o in ops] == [80 * 4, 80 * 4], ops
