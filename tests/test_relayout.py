"""`zo.relayout`: a zero1 state saved at one data-parallel size, laid out in memory for another.

The oracle is plain optax on one device fed the same global mean gradients: a run that moves 8 -> 3 -> 8 devices
through `relayout` (the state read back as a checkpoint holds it, on the host) holds its parameters and state;
`relayout` itself moves every value exactly (`zo.gather_state` before and after, bit for bit).
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


def _inner():
    return optax.adamw(1e-2, weight_decay=0.1)


def _tx(n: int, partition: str = "flat"):
    return zo.zero1(_inner(), axis_name="data", mesh=h.mesh_of(n), partition=partition)


def _grads(params, step: int):
    return jax.tree.map(lambda x: jnp.sin(x * (step + 1.0)), params)


def _steps(tx, n: int, params, state, steps: range):
    """`steps` mesh-bound steps on `n` devices from host `params`; the host parameters and the state after them."""
    params = jax.device_put(params, NamedSharding(h.mesh_of(n), P()))
    for step in steps:
        updates, state = tx.update(_grads(params, step), state, params)
        params = optax.apply_updates(params, updates)
    return jax.device_get(params), state


def _as_saved_dict(state) -> dict:
    """`state`'s arrays on the host in a nested dict keyed by strings, as a checkpoint's pure dict holds them."""
    out: dict = {}
    for path, x in jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]:
        node = out
        names = [str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path]
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = np.asarray(x)
    return out


def _assert_bit_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_a_run_moved_8_3_8_continues_as_optax(partition):
    params = jax.device_get(h.small_params())
    ref_params, ref = params, _inner().init(params)
    for step in range(4):
        updates, ref = _inner().update(_grads(ref_params, step), ref, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)

    p, s = _steps(_tx(8, partition), 8, params, _tx(8, partition).init(params), range(2))
    moved = zo.relayout(jax.device_get(s), _tx(3, partition), p)
    assert zo.describe(moved).world_size == 3 and {x.sharding.spec[0] for x in jax.tree.leaves(moved)} == {"data"}
    _assert_bit_equal(zo.gather_state(moved), jax.device_get(zo.gather_state(s)))
    p, s = _steps(_tx(3, partition), 3, p, moved, range(2, 3))
    moved = zo.relayout(_as_saved_dict(s), _tx(8, partition), p)  # the nested dict a checkpoint's pure dict is
    _assert_bit_equal(zo.gather_state(moved), jax.device_get(zo.gather_state(s)))
    p, s = _steps(_tx(8, partition), 8, p, moved, range(3, 4))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=5e-5, atol=1e-6), p, ref_params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=5e-5, atol=1e-6),
                 jax.device_get(zo.gather_state(s)), ref)


def test_refusals_name_what_is_wrong():
    params = jax.device_get(h.small_params())
    saved = _as_saved_dict(_tx(8).init(params))
    with pytest.raises(zo.ZeroError, match="bound to its mesh"):
        zo.relayout(saved, zo.zero1(_inner(), axis_name="data"), params)
    with pytest.raises(zo.ZeroError, match="zo.zero1"):
        zo.relayout(saved, _inner(), params)
    with pytest.raises(zo.ZeroError, match=r"has no `\._inner\.histories"):
        zo.relayout({"_inner": {"shared": saved["_inner"]["shared"]}}, _tx(3), params)
    histories = saved["_inner"]["histories"]["0"]
    histories["0"] = histories["0"][:-1]
    with pytest.raises(zo.ZeroError, match=r"has shape \(\d+,\), where the state saved on 8 devices holds"):
        zo.relayout(saved, _tx(3), params)
