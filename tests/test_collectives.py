"""The collectives a zero1 step compiles to, on every JAX release CI tests: the invariant all-gather stays an
all-gather (a masked-psum stand-in would all-reduce a parameter-sized buffer: 1.5 x the wire)."""

import jax
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


@pytest.mark.parametrize("partition", ["leaf", "auto"])
def test_owned_updates_travel_in_an_all_gather(partition):
    ops, _ = _step_ops(zo.zero1(optax.contrib.muon(1e-2), axis_name="data", partition=partition))
    nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(h.small_params()))
    kinds = [o["kind"] for o in ops]
    assert kinds.count("all-gather") == 1, ops
    # The gradient reduction may all-reduce (the packed reduce-scatter would move more here), but nothing
    # larger than the gradients is all-reduced.
    assert sum(o["bytes"] * o["multiplier"] for o in ops if o["kind"] == "all-reduce") <= nbytes, ops
