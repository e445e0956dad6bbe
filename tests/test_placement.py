"""A zero1 state that a trainer placed unlike its layout (replicated, or sharded over another mesh axis) is refused
wherever zero1 can tell, with the fix (`zo.state_specs` as the state's shardings): a mesh-bound `update` or
`zo.apply_gradients` given concrete arrays (their shardings say), the same under `jax.jit` on `Explicit` axes (a
traced value's type carries its sharding), a Flax optimizer's jitted step, a checkpoint save (each array's block per
device), and `update` inside the caller's `shard_map` given the state with `in_specs=P()` (typed invariant).
Under `jax.jit` on `Auto` axes a trace does not say, and nothing is refused: the check of
docs/recipes/jit_and_flax.md ("Check that the state is sharded") finds it, run here as the page writes it. Correct
placements are never refused."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h

N = 8
FIX = r"zo\.state_specs\(tx, params, mesh=mesh\) as the state's shardings"
REPLICATED = r"is replicated, but its layout stores it as P\('data',\)[\s\S]*placed the state replicated[\s\S]*" + FIX


def _setup(mesh, axis_name="data"):
    """A mesh-bound AdamW, replicated parameters, its state as `init` places it, and a gradient."""
    params = jax.device_put(h.small_params(), NamedSharding(mesh, P()))
    tx = zo.zero1(optax.adamw(1e-2), axis_name=axis_name, mesh=mesh)
    grads = jax.device_put(jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), h.small_params()), NamedSharding(mesh, P()))
    return tx, params, tx.init(params), grads


def _step(tx, one_call: bool):
    def step(params, state, grads):
        if one_call:
            return zo.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


@pytest.mark.parametrize("one_call", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("form", ["eager", "jit"])
def test_replicated_state_refused(form, one_call):
    mesh = h.mesh_of(N)  # (jax.make_mesh's axes are Explicit: a trace carries the state's sharding)
    tx, params, state, grads = _setup(mesh)
    replicated = jax.device_put(state, NamedSharding(mesh, P()))
    step = _step(tx, one_call)
    step = jax.jit(step) if form == "jit" else step
    with pytest.raises(zo.ZeroStructureError, match=REPLICATED):
        step(params, replicated, grads)
    step(params, state, grads)  # (as init placed it: runs)


@pytest.mark.parametrize("form", ["eager", "jit"])
def test_state_on_another_axis_refused(form):
    """On a ("data", "model") mesh, a state sharded over "model" where its layout says "data"."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:N])
    tx, params, state, grads = _setup(mesh)
    elsewhere = jax.device_put(state, NamedSharding(mesh, P("model")))
    step = _step(tx, False)
    step = jax.jit(step) if form == "jit" else step
    with pytest.raises(zo.ZeroStructureError, match=r"is sharded as P\('model',\), but its layout stores it as "
                                                    r"P\('data',\) on the mesh \(data=4, model=2\)[\s\S]*other "
                                                    r"axes[\s\S]*" + FIX):
        step(params, elsewhere, grads)


def test_state_placed_by_state_specs_runs_and_equals_the_state_init_placed():
    """The fix the refusal names: jit's shardings from `zo.state_specs` (and the eager step between)."""
    mesh = h.mesh_of(N)
    tx, params, state, grads = _setup(mesh)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), zo.state_specs(tx, params, mesh=mesh))
    step = jax.jit(_step(tx, False), in_shardings=(None, shardings, None), out_shardings=(None, shardings))
    p1, s1 = step(params, state, grads)
    p2, s2 = _step(tx, False)(p1, s1, grads)
    r1, rs1 = _step(tx, False)(params, state, grads)
    r2, rs2 = _step(tx, False)(r1, rs1, grads)
    for a, b in zip(jax.tree.leaves((p2, s2)), jax.tree.leaves((r2, rs2))):
        assert (jnp.asarray(a) == jnp.asarray(b)).all()


def test_checkpoint_save_refuses_a_replicated_state(tmp_path):
    mesh = h.mesh_of(N)
    _, _, state, _ = _setup(mesh)
    replicated = jax.device_put(state, NamedSharding(mesh, P()))
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        with pytest.raises(zo.ZeroCheckpointError, match=REPLICATED):
            ckpt.save(tmp_path / "replicated", args=zo.ZeroSave(replicated))
        ckpt.save(tmp_path / "sharded", args=zo.ZeroSave(state))


def _recipe() -> str:
    """The code of docs/recipes/jit_and_flax.md's section "Check that the state is sharded"."""
    page = (pathlib.Path(__file__).parent.parent / "docs" / "recipes" / "jit_and_flax.md").read_text()
    section = page.split("## Check that the state is sharded", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_auto_axes_under_jit_cannot_tell_and_the_recipe_finds_it():
    """Under jit on an `Auto` mesh the trace does not carry the state's sharding: a step whose `out_shardings`
    replicate the state runs; the recipe's bytes check tells it from the state as init placed it."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:N])
    tx, params, state, grads = _setup(mesh)
    replicate = NamedSharding(mesh, P())
    step = jax.jit(_step(tx, False), out_shardings=(replicate, replicate))
    _, replicated = step(params, state, grads)
    recipe = _recipe()
    for opt_state, sharded in ((state, True), (replicated, False)):
        scope = {"opt_state": opt_state}
        if sharded:
            exec(recipe, scope)
        else:
            with pytest.raises(AssertionError, match="not sharded as its layout says"):
                exec(recipe, scope)
    with pytest.raises(zo.ZeroStructureError, match=REPLICATED):  # (eagerly, its arrays say)
        tx.update(grads, replicated, params)


@pytest.mark.parametrize("optimizer", ["nnx.Optimizer", "zo.ZeroOptimizer"])
def test_flax_optimizer_with_a_replicated_state_refused(optimizer):
    """A Flax trainer whose optimizer state was placed replicated: refused at the first jitted step."""
    mesh = h.mesh_of(N)
    model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
    make = nnx.Optimizer if optimizer == "nnx.Optimizer" else zo.ZeroOptimizer
    opt = make(model, tx, wrt=nnx.Param)
    nnx.update(opt.opt_state, jax.device_put(nnx.state(opt.opt_state), NamedSharding(mesh, P())))
    x = jax.device_put(jnp.ones((8, 5)), NamedSharding(mesh, P("data")))

    @nnx.jit
    def step(model, opt, x):
        opt.update(model, nnx.grad(lambda m: (m(x) ** 2).mean())(model))

    with pytest.raises(zo.ZeroStructureError, match=REPLICATED):
        step(model, opt, x)


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_state_passed_replicated_into_shard_map_refused(partition):
    """Inside the caller's `shard_map`, a state given `in_specs=P()` is typed invariant over the data axis."""
    mesh = h.mesh_of(N)
    params = h.small_params()
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", partition=partition)
    init, step = h.zero_fns(tx, mesh)
    state = init(params)
    grads = jax.device_put(h.gradient_sequence(params, N, 1)[0], NamedSharding(mesh, P("data")))

    def update(params, state, grads):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state, params)

    replicated = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())))
    with pytest.raises(zo.ZeroStructureError, match=r"same on every device of `data` \(typed invariant\)[\s\S]*"
                                                    r"in_specs P\(\)[\s\S]*zo\.state_specs\(tx, params"):
        replicated(params, jax.device_put(state, NamedSharding(mesh, P())), grads)
    step(params, state, grads)  # (with in_specs P("data"): runs)
