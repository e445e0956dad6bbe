"""partition="auto" with float32 master copies: checkpointed, restored at another world size (reshard=True and
offline), and continued exactly like single-device float32 optax fed the same bf16 gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from tests.test_auto import PARAMS, muon_recipe
from tests.test_master import bf16_grads, reference

K = 3


def _trainer(n):
    mesh = h.mesh_of(n)
    tx = zo.zero1(muon_recipe(), axis_name="data", partition="auto", master_dtype=jnp.float32)
    init, step = h.zero_fns(tx, mesh)
    return mesh, init, step


def _train(mesh, step, params, state, grads_seq):
    params = jax.device_put(params, NamedSharding(mesh, P()))
    for g in grads_seq:
        params, state = step(params, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
    return params, state


def _restore(directory, target, reshard):
    return ocp.Checkpointer(zo.ZeroCheckpointHandler()).restore(directory, args=zo.ZeroRestore(target, reshard=reshard))


def test_auto_master_checkpoint_restores_at_another_world_size_and_continues(tmp_path):
    params_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    first, second = bf16_grads(PARAMS, 4, K), bf16_grads(PARAMS, 3, K)

    mesh4, init4, step4 = _trainer(4)
    state = init4(jax.device_put(PARAMS, NamedSharding(mesh4, P())))
    params, state = _train(mesh4, step4, params_bf16, state, first)
    layout = zo.describe(state)
    assert set(layout.sharding) == {"sliced", "owned"} and layout.master_dtype == "float32"
    ocp.Checkpointer(zo.ZeroCheckpointHandler()).save(tmp_path / "item", args=zo.ZeroSave(state))

    same = _restore(tmp_path / "item", init4(jax.device_put(PARAMS, NamedSharding(mesh4, P()))), reshard=False)
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    mesh3, init3, step3 = _trainer(3)
    target = init3(jax.device_put(PARAMS, NamedSharding(mesh3, P())))
    resharded = _restore(tmp_path / "item", target, reshard=True)
    zo.reshard(tmp_path / "item", tmp_path / "three", world_size=3)
    offline = _restore(tmp_path / "three", target, reshard=False)
    for a, b in zip(jax.tree.leaves(resharded), jax.tree.leaves(offline)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    params, state = _train(mesh3, step3, jax.device_get(params), resharded, second)
    ref_params, ref_state = reference(muon_recipe(), PARAMS, first + second)
    master = zo.master_params(state)
    for p, m, r in zip(jax.tree.leaves(params), jax.tree.leaves(master), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(m), np.asarray(r), rtol=5e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(p).view(np.uint16), np.asarray(m.astype(jnp.bfloat16)).view(np.uint16))
    for a, b in zip(jax.tree.leaves(zo.gather_state(state)), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=5e-5, atol=1e-6)
