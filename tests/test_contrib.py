"""optax.contrib optimizers through zero1: GaLore's results equal plain optax's on one device fed the mean gradient;
differentially private aggregation (it needs per-example gradients) and updates shaped unlike the gradients are
refused at init with an error that says why and what to do."""

import jax
import jax.numpy as jnp
import optax
import pytest

import zero_optax as zo
from tests import _harness as h


def _params():
    """A 2-D leaf, a 1-D leaf and a scalar, none of whose sizes divides 8."""
    return {"w": jnp.linspace(-1.0, 1.0, 35).reshape(5, 7), "b": jnp.linspace(-1.0, 1.0, 7),
            "s": jnp.float32(0.3), "h": jnp.eye(4, 6) + 0.05}


GALORE = {
    "galore": lambda: optax.contrib.galore(1e-2, rank=2, update_proj_gap=2),
    "chain": lambda: optax.chain(optax.clip(0.5), optax.contrib.galore(1e-2, rank=2, update_proj_gap=2,
                                                                        weight_decay=0.1)),
}


@pytest.mark.parametrize("partition", ["auto", "leaf"])
@pytest.mark.parametrize("name", sorted(GALORE))
def test_galore_matches_optax(name, partition):
    """Every leaf of GaLore needs an owner (its projector is not shaped like the leaf), so no view of sliced leaves
    computes the shared step counts, and optax's galore fails on the view whose every leaf is masked: a leaf's
    view computes them instead."""
    make = GALORE[name]
    params = _params()
    grads = h.gradient_sequence(params, 8, 3)
    tx = zo.zero1(make(), axis_name="data", partition=partition)
    zp, zs, _ = h.run_zero(tx, params, grads, 8)
    assert not zo.describe(zs).groups
    rp, rs = h.run_oracle(make(), params, grads)
    h.assert_matches(zp, zs, rp, rs)


PRIVATE = {
    "dpsgd": lambda: optax.contrib.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=0, momentum=0.9),
    "aggregate": lambda: optax.chain(optax.contrib.differentially_private_aggregate(1.0, 0.5, key=jax.random.key(0)),
                                     optax.sgd(0.1)),
}


@pytest.mark.parametrize("partition", ["flat", "auto", "leaf"])
@pytest.mark.parametrize("name", sorted(PRIVATE))
def test_private_aggregation_refused(name, partition):
    tx = zo.zero1(PRIVATE[name](), axis_name="data", partition=partition, mesh=h.mesh_of(8))
    with pytest.raises(zo.ZeroCouplingError, match=r"differentially_private_aggregate[\s\S]*per-example "
                                                   r"gradients[\s\S]*reduce=False"):
        tx.init(_params())


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_updates_shaped_unlike_gradients_refused(partition):
    """A transformation that sums its gradients over their first axis (per-example aggregation, say)."""
    summed = optax.stateless(lambda g, p: jax.tree.map(lambda x: x.sum(0), g))
    tx = zo.zero1(summed, axis_name="data", partition=partition, mesh=h.mesh_of(8))
    with pytest.raises(zo.ZeroStructureError, match=r"shape \(\) at `\['b'\]`, where zero1 gave it "
                                                   r"gradients of shape \(5,\)[\s\S]*shaped like its gradients"):
        tx.init({"w": jnp.ones((5, 7)), "b": jnp.ones((5,))})
