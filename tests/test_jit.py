"""zero1 bound to a mesh, under plain jax.jit and in Flax, against the same code with the plain inner optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h

N = 8
INNER = {"flat": lambda: optax.adamw(1e-2, weight_decay=0.1), "leaf": lambda: optax.contrib.muon(1e-2)}


def mesh(n: int = N):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def batch(n: int = N):
    x = jax.random.normal(jax.random.key(1), (4 * n, 5))
    y = jax.random.normal(jax.random.key(2), (4 * n, 4))
    return x, y


def init_params():
    return {"w": jnp.linspace(-1, 1, 20).reshape(5, 4), "b": jnp.zeros(4), "s": jnp.asarray(0.5),
            "v": jnp.linspace(0, 1, 13)}


def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) * p["s"] + jnp.mean(p["v"]) - y) ** 2)


def train(tx, params, x, y, steps=4):
    @jax.jit
    def step(p, s, x, y):
        g = jax.grad(loss_fn)(p, x, y)  # the global mean gradient, as jit computes it
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    s = tx.init(params)
    for _ in range(steps):
        params, s = step(params, s, x, y)
    return params, s


def assert_close(a, b, rtol=1e-6, atol=1e-7):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_plain_jit_step_matches_optax(partition):
    m = mesh()
    params = jax.device_put(init_params(), NamedSharding(m, P()))
    x, y = jax.device_put(batch(), NamedSharding(m, P("data")))
    tx = zo.zero1(INNER[partition](), axis_name="data", mesh=m, partition=partition)
    zp, zs = train(tx, params, x, y)
    rp, rs = train(INNER[partition](), params, x, y)
    assert_close(zp, rp, rtol=2e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(zo.gather_state(zs)), jax.tree.leaves(rs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    # The state is sharded over "data": every leaf's addressable shards hold 1/N of it.
    for leaf in jax.tree.leaves(zs):
        assert all(s.data.size * N == leaf.size for s in leaf.addressable_shards)
    # Updates come back with the parameters' sharding.
    assert all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in zip(jax.tree.leaves(zp),
                                                                                  jax.tree.leaves(params)))


def _contract_step(tx, **jit_options):
    def step(p, g, s):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return jax.jit(step, donate_argnums=(0, 2), **jit_options)


@pytest.mark.parametrize("pinned", [True, False])
def test_updates_leave_in_rows_on_an_auto_axis(pinned):
    """Under jax.jit on an Auto axis the flat leaves' updates leave zero1 cut in rows: GSPMD adds each device's rows to
    its part of the parameters and gathers the new ones where their sharding is pinned, or leaves them sharded where
    it is not, as for its own sharded state; both match optax step by step, and the pinned step costs what GSPMD's
    own sharded AdamW costs (no full-size updates tree, as gathering the updates held on XLA:CPU)."""
    m = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = NamedSharding(m, P())
    keys = jax.random.split(jax.random.key(3), 5)
    start = {f"w{k}": jax.random.normal(keys[k], (256, 160)) for k in range(4)}
    start.update(b=jax.random.normal(keys[4], (13,)), s=jnp.asarray(0.5))
    inner = optax.adamw(1e-2, weight_decay=0.1)
    tx = zo.zero1(inner, axis_name="data", mesh=m)
    params = jax.device_put(jax.tree.map(np.asarray, start), rep)  # (its own buffers: they are donated)
    state = tx.init(params)
    pinned_out = {"out_shardings": (rep, jax.tree.map(lambda x: x.sharding, state))} if pinned else {}
    run = _contract_step(tx, **pinned_out)
    grads = [jax.tree.map(lambda x, t=t: jnp.cos(x * (t + 1)), start) for t in range(3)]
    compiled = run.lower(params, params, state).compile()
    ref_p, ref_s = start, inner.init(start)
    for g in grads:
        params, state = run(params, jax.device_put(g, rep), state)
        u, ref_s = inner.update(g, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    assert_close(params, ref_p, rtol=1e-6, atol=1e-7)
    sharded = [x for x in jax.tree.leaves(params) if "data" in jax.tree.leaves(tuple(x.sharding.spec))]
    if not pinned:
        assert sharded  # and the next steps took them sharded over the ZeRO axis
        return
    assert not sharded
    # GSPMD's own ZeRO-1: the state sharded over "data" on a dimension it divides, the parameters pinned.
    state_sh = jax.tree.map(lambda x: NamedSharding(m, P("data") if x.ndim and x.shape[0] % N == 0 else P()),
                            jax.eval_shape(inner.init, start))
    gspmd = _contract_step(inner, out_shardings=(rep, state_sh)).lower(
        params, params, jax.jit(inner.init, out_shardings=state_sh)(params)).compile()
    whole = sum(x.nbytes for x in jax.tree.leaves(start))
    temp, gspmd_temp = (c.memory_analysis().temp_size_in_bytes for c in (compiled, gspmd))
    assert temp <= gspmd_temp + whole / N, (temp, gspmd_temp, whole)
    assert compiled.cost_analysis()["bytes accessed"] <= 1.1 * gspmd.cost_analysis()["bytes accessed"]


def test_whole_step_holds_what_gspmd_holds():
    """A whole jitted training step (loss, gradient, update, new parameters) on an Auto axis, its large leaves'
    gradients entering zero1 cut in rows and their updates leaving so: it holds no more than GSPMD's own sharded
    AdamW (plus a part of the parameters) and gives its parameters. (Which reduction XLA picks for the gradient
    depends on the model: `benchmarks.step_peak` shows the reduce-scatter on a GPT tree.)"""
    m = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rep, rows = NamedSharding(m, P()), NamedSharding(m, P("data"))
    k = jax.random.split(jax.random.key(4), 4)
    start = {"w1": jax.random.normal(k[0], (128, 512)) * 0.1, "b1": jnp.zeros(512),
             "w2": jax.random.normal(k[1], (512, 128)) * 0.1, "s": jnp.asarray(1.0)}
    x, y = jax.random.normal(k[2], (4 * N, 128)), jax.random.normal(k[3], (4 * N, 128))

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] * p["s"] - y) ** 2)

    inner = optax.adamw(1e-2, weight_decay=0.1)
    state_sh = jax.tree.map(lambda a: NamedSharding(m, P("data") if a.ndim and a.shape[0] % N == 0 else P()),
                            jax.eval_shape(inner.init, start))
    tx = zo.zero1(inner, axis_name="data", mesh=m)
    compiled, final = {}, {}
    for name, t in (("zero1", tx), ("gspmd", inner)):
        params = jax.device_put(jax.tree.map(np.asarray, start), rep)
        state = t.init(params) if name == "zero1" else jax.jit(inner.init, out_shardings=state_sh)(params)

        def step(p, s, x, y, t=t):
            u, s = t.update(jax.grad(loss)(p, x, y), s, p)
            return optax.apply_updates(p, u), s
        run = jax.jit(step, donate_argnums=(0, 1), out_shardings=(rep, jax.tree.map(lambda a: a.sharding, state)))
        xs, ys = jax.device_put((x, y), rows)
        compiled[name] = run.lower(params, state, xs, ys).compile()
        for _ in range(3):
            params, state = run(params, state, xs, ys)
        final[name] = params
    # GSPMD's step sums the gradient in the same order (optax's, under jit); one device sums it in another, which
    # AdamW's first steps, g / (|g| + eps), turn into up to 1e-4 where |g| is about eps.
    assert_close(final["zero1"], final["gspmd"], rtol=1e-5, atol=1e-6)
    ref_p, ref_s = start, inner.init(start)
    for _ in range(3):
        u, ref_s = inner.update(jax.grad(loss)(ref_p, x, y), ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    assert_close(final["zero1"], ref_p, rtol=1e-5, atol=1e-4)
    whole = sum(a.nbytes for a in jax.tree.leaves(start))
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    assert temp["zero1"] <= temp["gspmd"] + whole / N, (temp, whole)


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_one_device_mesh_steps_without_collectives(partition):
    """On a one-device mesh nothing needs reducing or gathering: the compiled step has no collective (typed
    values would need one-device collectives to become replicated, which XLA:CPU runs as copies)."""
    m = mesh(1)
    params = jax.device_put(init_params(), NamedSharding(m, P()))
    x, y = jax.device_put(batch(1), NamedSharding(m, P()))
    kwargs = {"master_dtype": jnp.float32} if partition == "flat" else {}
    tx = zo.zero1(INNER[partition](), axis_name="data", mesh=m, partition=partition, **kwargs)
    zp, zs = train(tx, params, x, y)
    rp, rs = train(INNER[partition](), params, x, y)
    assert_close(zp, rp, rtol=2e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(zo.gather_state(zs)), jax.tree.leaves(rs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    g = jax.grad(loss_fn)(zp, x, y)
    text = jax.jit(lambda g, s, p: tx.update(g, s, p)).lower(g, zs, zp).compile().as_text()
    assert not [op for op in ("all-gather", "all-reduce", "reduce-scatter", "collective-permute") if op in text]


def test_init_eager_under_jit_and_on_unplaced_params():
    m = mesh()
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=m)
    eager = tx.init(init_params())  # single-device arrays: placed replicated on the mesh
    jitted = jax.jit(tx.init)(jax.device_put(init_params(), NamedSharding(m, P())))
    assert jax.tree.structure(eager) == jax.tree.structure(jitted)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(a, b)
        assert a.sharding.spec == P("data")
    assert zo.describe(eager).world_size == N


def test_mesh_bound_inside_shard_map_behaves_like_unbound():
    n = 4
    m = mesh(n)
    params = h.small_params()
    grads = h.gradient_sequence(params, n, steps=3)
    bound = zo.zero1(optax.adamw(1e-2), axis_name="data", mesh=m)
    zp, zs, _ = h.run_zero(bound, params, grads, n)
    rp, rs = h.run_oracle(optax.adamw(1e-2), params, grads)
    h.assert_matches(zp, zs, rp, rs)


def test_mesh_bound_refuses_weights_and_checks_mesh():
    m = mesh()
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=m)
    state = tx.init(init_params())
    with pytest.raises(zo.WeightError, match="global mean gradient"):
        tx.update(init_params(), state, init_params(), weight=3.0)
    with pytest.raises(zo.ZeroError, match="`mesh` has axes"):
        zo.zero1(optax.adam(1e-2), axis_name="batch", mesh=m)


def test_mesh_bound_master_weights_under_jit():
    m = mesh()
    params32 = init_params()
    params = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32), NamedSharding(m, P()))
    x, y = jax.device_put(batch(), NamedSharding(m, P("data")))
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data", mesh=m, master_dtype=jnp.float32)

    @jax.jit
    def step(p, s, x, y):
        g = jax.grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    s = tx.init(params32)
    p = params
    for _ in range(3):
        p, s = step(p, s, x, y)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(zo.master_params(s))):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b.astype(jnp.bfloat16)).view(np.uint16))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(5, 7, rngs=rngs)
        self.l2 = nnx.Linear(7, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _nnx_train(make_tx, m, x, y):
    model = MLP(nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(m, P())))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    for _ in range(3):
        step(model, optimizer, x, y)
    return model, optimizer


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_nnx_optimizer(partition):
    m = mesh()
    x, y = jax.device_put(batch(), NamedSharding(m, P("data")))
    inner = {"flat": lambda: optax.adamw(1e-2), "leaf": lambda: optax.contrib.muon(1e-2)}[partition]
    model, optimizer = _nnx_train(lambda: zo.zero1(inner(), axis_name="data", mesh=m, partition=partition), m, x, y)
    ref_model, ref_optimizer = _nnx_train(inner, m, x, y)
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), rtol=2e-5, atol=1e-6)
    state = nnx.as_pure(optimizer.opt_state)
    assert zo.describe(state).world_size == N
    for a, b in zip(jax.tree.leaves(zo.gather_state(state)), jax.tree.leaves(nnx.as_pure(ref_optimizer.opt_state))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_flax_train_state():
    m = mesh()
    x, y = jax.device_put(batch(), NamedSharding(m, P("data")))
    params = jax.device_put(init_params(), NamedSharding(m, P()))
    results = []
    for tx in (zo.zero1(optax.adamw(1e-2), axis_name="data", mesh=m), optax.adamw(1e-2)):
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

        @jax.jit
        def step(state, x, y):
            return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x, y))

        for _ in range(3):
            state = step(state, x, y)
        results.append(state.params)
    assert_close(*results, rtol=2e-5, atol=1e-6)
