"""Owned leaves sharded over tensor-parallel axes (issue 31): the owner gathers the blocks, updates the whole
tensor, and every device keeps its block; against single-device optax fed the global mean gradient, parameters
and state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo

# (5, 6) cuts into (5, 3) blocks over model=2, (6, 5) into (3, 5); nothing divides the data axis (4).
SHAPES = {"w_in": (5, 6), "w_out": (6, 5), "ln": (7,), "emb": (9, 4)}
TP_SPECS = {"w_in": P(None, "model"), "w_out": P("model", None), "ln": P(), "emb": P()}
LABELS = {"w_in": "muon", "w_out": "muon", "ln": "adam", "emb": "adam"}
STEPS = 3


def muon():
    return optax.contrib.muon(1e-2, weight_decay=0.05)


def muon_recipe():
    """Muon for the matrices, AdamW for the rest (partition="auto" owns the matrices, slices the embedding)."""
    return optax.partition({"muon": optax.contrib.muon(1e-2, weight_decay=0.05),
                            "adam": optax.adamw(1e-2, weight_decay=0.1)}, LABELS)


def params_np(shapes=SHAPES):
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}


def grads_np(t: int, n_data: int, shapes=SHAPES):
    rng = np.random.default_rng(100 + t)
    return {k: rng.standard_normal((n_data, *s)).astype(np.float32) for k, s in shapes.items()}


def oracle(inner, steps, n_data, shapes=SHAPES, start=0):
    params, state, update = params_np(shapes), inner.init(params_np(shapes)), jax.jit(inner.update)
    for t in range(start, start + steps):
        g = {k: v.mean(0) for k, v in grads_np(t, n_data, shapes).items()}
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


def mesh_of(shape=(4, 2)):
    return jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:int(np.prod(shape))])


def placed(tree, mesh, specs):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


def shard_map_fns(tx, mesh, params, specs=TP_SPECS):
    """The shard_map'ed init and step (update + apply_updates) of `tx`, per-device gradients stacked over data."""
    state_specs = zo.state_specs(tx, params, specs, mesh=mesh)
    g_specs = {k: P("data", *s) for k, s in specs.items()}

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, state_specs, g_specs), out_specs=(specs, state_specs)))
    return init, step, g_specs


def run_shard_map(tx, mesh, steps=STEPS):
    n_data = mesh.shape["data"]
    params = placed(params_np(), mesh, TP_SPECS)
    init, step, g_specs = shard_map_fns(tx, mesh, params)
    state = init(params)
    for t in range(steps):
        params, state = step(params, state, placed(grads_np(t, n_data), mesh, g_specs))
    return params, state


def jit_step(tx):
    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step


def run_jit(tx, mesh, steps=STEPS, specs=TP_SPECS):
    n_data = mesh.shape["data"]
    params = placed(params_np(), mesh, specs)
    state, step = tx.init(params), jit_step(tx)
    for t in range(steps):
        params, state = step(params, state, placed({k: v.mean(0) for k, v in grads_np(t, n_data).items()}, mesh, specs))
    return params, state


def assert_tree(got, want, rtol=5e-5, atol=5e-6):
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(got_l, want_l):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def check(params, state, inner, n_data=4):
    ref, ref_state = oracle(inner, STEPS, n_data)
    assert_tree({k: np.asarray(v) for k, v in params.items()}, ref)
    assert_tree(zo.gather_state(state), ref_state)


@pytest.mark.parametrize("partition,inner", [("leaf", muon), ("auto", muon_recipe)])
def test_shard_map_with_param_specs(partition, inner):
    mesh = mesh_of()
    tx = zo.zero1(inner(), axis_name="data", partition=partition, param_specs=TP_SPECS)
    params, state = run_shard_map(tx, mesh)
    check(params, state, inner())
    layout = zo.describe(state)
    w_in = layout.leaves[layout.paths.index("['w_in']")]
    assert not w_in.sliced and w_in.shape == (5, 3) and w_in.dims == ((), ("model",))
    assert layout.whole_shape(w_in) == (5, 6)
    if partition == "auto":
        assert dict(zip(layout.paths, layout.sharding))["['emb']"] == "sliced"


@pytest.mark.parametrize("partition,inner", [("leaf", muon), ("auto", muon_recipe)])
def test_mesh_bound_under_jit(partition, inner):
    mesh = mesh_of()
    tx = zo.zero1(inner(), axis_name="data", partition=partition, mesh=mesh)
    params, state = run_jit(tx, mesh)
    check(params, state, inner())
    assert params["w_in"].sharding.spec == P(None, "model")


def test_shard_map_without_specs_is_refused_naming_the_fixes():
    mesh = mesh_of()
    tx = zo.zero1(muon(), axis_name="data", partition="leaf")
    params = placed(params_np(), mesh, TP_SPECS)
    with pytest.raises(zo.ZeroCouplingError, match=r"(?s)`\['w_in'\]`.*mesh=mesh.*param_specs=param_specs"):
        jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(TP_SPECS,), out_specs=P()), params)


def test_every_leaf_records_its_placement_and_a_wrong_spec_for_a_sliced_leaf_is_refused():
    """With `param_specs`, a sliced leaf sharded over `model` has its placement too (checkpoints record it), and a
    spec that disagrees with its blocks is refused as a tensor-parallel owned leaf's is; without them it is
    unknown (None), a replicated leaf's placement trivially known."""
    mesh = mesh_of()
    params = placed(params_np(), mesh, TP_SPECS)
    captured = []

    def init(tx):
        def capture(p):
            captured.append(tx.init(p).layout)
            return ()
        jax.eval_shape(jax.shard_map(capture, mesh=mesh, in_specs=(TP_SPECS,), out_specs=()), params)
        return {x.path: x.spec for x in captured.pop().leaves}

    assert init(zo.zero1(optax.adam(1e-2), axis_name="data", param_specs=TP_SPECS)) == {
        "['emb']": ((), ()), "['ln']": ((),), "['w_in']": ((), ("model",)), "['w_out']": (("model",), ())}
    assert init(zo.zero1(optax.adam(1e-2), axis_name="data")) == {"['emb']": ((), ()), "['ln']": ((),),
                                                                    "['w_in']": None, "['w_out']": None}
    wrong = dict(TP_SPECS, w_out=P(None, None))
    with pytest.raises(zo.ZeroStructureError, match=r"(?s)records from the PartitionSpec .* of `\['w_out'\]` which "
                                                     r"mesh axes cut.*varies over\s+the mesh axes \['model'\]"):
        init(zo.zero1(optax.adam(1e-2), axis_name="data", param_specs=wrong))


def test_a_spec_that_disagrees_with_the_blocks_is_refused():
    mesh = mesh_of()
    wrong = dict(TP_SPECS, w_in=P())
    tx = zo.zero1(muon(), axis_name="data", partition="leaf", param_specs=wrong)
    params = placed(params_np(), mesh, TP_SPECS)
    with pytest.raises(zo.ZeroStructureError, match=r"(?s)`\['w_in'\]`.*varies over the mesh axes\s+\['model'\]"):
        jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(TP_SPECS,), out_specs=P()), params)


def test_owners_balance_whole_sizes_and_state_lives_whole_on_the_owners_peers():
    """Costs are the whole matrices' state: a (5, 6) matrix cut in (5, 3) blocks weighs 30 elements, not 15. Each
    device of the owner's rank keeps the leaf's whole state (replicated over model)."""
    mesh = mesh_of()
    tx = zo.zero1(muon(), axis_name="data", partition="leaf", mesh=mesh)
    state = tx.init(placed(params_np(), mesh, TP_SPECS))
    layout = zo.describe(state)
    plain = optax.contrib.muon(1e-2).init(params_np())
    assert layout.owners == tuple(zo.balanced_owners(params_np(), 4, inner=muon()))
    assert sum(layout.state_bytes_per_device) - sum(e.nbytes for e in layout.entries if e.leaf is None) * 3 == \
        sum(np.asarray(x).nbytes for x in jax.tree.leaves(plain))
    specs = zo.state_specs(tx, params_np(), TP_SPECS, mesh=mesh)
    assert all(s == P("data") for s in jax.tree.leaves(specs))



# Accumulation, offload and master copies: (partition, form, zero1 options, parameter dtype). Each case compiles
# one init and one step; mesh-bound (jit) and shard_map forms alternate so both meet every option.
ACC2 = {"accumulate_steps": 2}
OPTION_CASES = [
    ("leaf", "shard_map", dict(ACC2, accumulate="sharded"), np.float32),
    ("auto", "jit", dict(ACC2, accumulate="sharded"), np.float32),
    ("leaf", "jit", dict(ACC2, accumulate="local"), np.float32),
    ("auto", "shard_map", dict(ACC2, accumulate="local"), np.float32),
    ("leaf", "shard_map", {"offload": True}, np.float32),
    ("auto", "jit", {"offload": True}, np.float32),
    ("leaf", "jit", {"master_dtype": jnp.float32}, jnp.bfloat16),
    ("auto", "shard_map", dict(ACC2, master_dtype=jnp.float32, offload=True), jnp.bfloat16),
]


def micro_grads(t: int, n_data: int, dtype, form: str) -> dict:
    """Update call `t`'s gradients in `dtype`: per device (`[n_data, *shape]`) for shard_map, their mean for jit."""
    g = {k: np.asarray(jnp.asarray(v, dtype)) for k, v in grads_np(t, n_data).items()}
    return g if form == "shard_map" else {k: np.asarray(jnp.asarray(v.astype(np.float64).mean(0), dtype))
                                          for k, v in grads_np(t, n_data).items()}


def options_oracle(inner, calls: int, k: int, n_data: int, dtype, form: str):
    """Float32 optax on one device over `calls // k` steps, each fed the mean over its `k` update calls of the
    global mean gradient zero1 saw (`micro_grads`, widened to float32)."""
    params = {kk: np.asarray(jnp.asarray(v, dtype), np.float32) for kk, v in params_np().items()}
    state, update = inner.init(params), jax.jit(inner.update)
    for c in range(calls // k):
        cycle = [micro_grads(t, n_data, dtype, form) for t in range(c * k, c * k + k)]
        g = {kk: np.float32(sum(np.asarray(m[kk], np.float64).reshape(-1, *SHAPES[kk]).mean(0) for m in cycle) / k)
             for kk in SHAPES}
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("partition,form,options,dtype", OPTION_CASES)
def test_accumulation_offload_and_master_copies(partition, form, options, dtype):
    """Owned tensor-parallel leaves under `accumulate_steps=2` (sharded and local accumulators), `offload=True` and
    float32 master copies of bf16 parameters, on a (data=4, model=2) mesh: parameters (the master copy's, and the
    bf16 parameters its rounding) and state equal single-device optax fed the cycles' global mean gradients."""
    mesh, inner = mesh_of(), {"leaf": muon, "auto": muon_recipe}[partition]
    calls, k = 4, options.get("accumulate_steps", 1)
    bound = {"mesh": mesh} if form == "jit" else {"param_specs": TP_SPECS}
    tx = zo.zero1(inner(), axis_name="data", partition=partition, **bound, **options)
    params = placed({kk: np.asarray(jnp.asarray(v, dtype)) for kk, v in params_np().items()}, mesh, TP_SPECS)
    if form == "jit":
        state, step, g_specs = tx.init(params), jit_step(tx), TP_SPECS
    else:
        init, step, g_specs = shard_map_fns(tx, mesh, params)
        state = init(params)
    for t in range(calls):
        params, state = step(params, state, placed(micro_grads(t, 4, dtype, form), mesh, g_specs))
    ref, ref_state = options_oracle(inner(), calls, k, 4, dtype, form)
    got = zo.master_params(state) if "master_dtype" in options else params
    assert_tree({kk: np.asarray(v, np.float32) for kk, v in got.items()}, ref)
    if "master_dtype" in options:
        for kk, p in params.items():
            assert p.dtype == dtype and p.sharding.is_equivalent_to(NamedSharding(mesh, TP_SPECS[kk]), p.ndim)
            np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(got[kk].astype(dtype), np.float32))
    gathered = zo.gather_state(state)
    if k > 1:  # (a cycle boundary: the accumulators start afresh)
        assert int(gathered.micro_step) == 0
        gathered = gathered.inner
    assert_tree(gathered, ref_state)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state)}
    assert kinds == ({"pinned_host"} if options.get("offload") else {"device"})


# Checkpoints: shapes that model=4 divides too.
CK_SHAPES = {"w_in": (5, 8), "w_out": (8, 6), "ln": (7,)}
CK_SPECS = {"w_in": P(None, "model"), "w_out": P("model", None), "ln": P()}


def ck_mesh(shape):
    return jax.make_mesh(shape, ("data", "model")[:len(shape)], devices=jax.devices()[:int(np.prod(shape))])


def ck_specs(mesh):
    return {k: P(*(a if a in mesh.axis_names else None for a in s)) for k, s in CK_SPECS.items()}


def ck_train(mesh, params, state, calls):
    """Mesh-bound Muon (leaf partition) on `mesh` from `params` and `state` (None: init) over update calls
    `calls`: the tx, params and state."""
    tx = zo.zero1(muon(), axis_name="data", partition="leaf", mesh=mesh)
    specs = ck_specs(mesh)
    params = placed(params, mesh, specs)
    state = tx.init(params) if state is None else state
    step = jit_step(tx)
    for t in calls:
        g = {k: v.mean(0) for k, v in grads_np(t, mesh.shape["data"], CK_SHAPES).items()}
        params, state = step(params, state, placed(g, mesh, specs))
    return tx, params, state


def ck_oracle(phases):
    """Optax on one device over `phases`: (update calls, data size) pairs."""
    inner, params = muon(), params_np(CK_SHAPES)
    state, update = inner.init(params), jax.jit(inner.update)
    for calls, n in phases:
        for t in calls:
            u, state = update({k: v.mean(0) for k, v in grads_np(t, n, CK_SHAPES).items()}, state, params)
            params = optax.apply_updates(params, u)
    return params, state


def ck_target(mesh):
    tx = zo.zero1(muon(), axis_name="data", partition="leaf", mesh=mesh)
    return tx.init(placed(params_np(CK_SHAPES), mesh, ck_specs(mesh)))


def test_checkpoints_round_trip_and_reshard_to_other_meshes(tmp_path):
    """Saved on (data=4, model=2); restored there exactly; moved to (2, 4) by ZeroRestore(reshard=True) and by the
    offline tool (bit for bit the same), and to a 1-D mesh (8,) offline; training on equals optax throughout."""
    handler = lambda: ocp.Checkpointer(zo.ZeroCheckpointHandler())
    _, params, state = ck_train(ck_mesh((4, 2)), params_np(CK_SHAPES), None, range(2))
    handler().save(tmp_path / "saved", args=zo.ZeroSave(state))
    same = handler().restore(tmp_path / "saved", args=zo.ZeroRestore(ck_target(ck_mesh((4, 2)))))
    assert_tree(same, state, rtol=0, atol=0)
    assert zo.describe(same) == zo.describe(state)

    mesh24 = ck_mesh((2, 4))
    moved = handler().restore(tmp_path / "saved", args=zo.ZeroRestore(ck_target(mesh24), reshard=True))
    zo.reshard(tmp_path / "saved", tmp_path / "offline", axis_sizes={"data": 2, "model": 4})
    offline = handler().restore(tmp_path / "offline", args=zo.ZeroRestore(ck_target(mesh24)))
    assert_tree(offline, moved, rtol=0, atol=0)
    layout = zo.describe(moved)
    w_in = layout.leaves[layout.paths.index("['w_in']")]
    assert w_in.shape == (5, 2) and w_in.dims == ((), ("model",))
    host = {k: np.asarray(v) for k, v in params.items()}
    _, p24, s24 = ck_train(mesh24, host, moved, range(2, 4))
    ref, ref_state = ck_oracle([(range(2), 4), (range(2, 4), 2)])
    assert_tree({k: np.asarray(v) for k, v in p24.items()}, ref)
    assert_tree(zo.gather_state(s24), ref_state)

    zo.reshard(tmp_path / "saved", tmp_path / "flat8", axis_sizes={"data": 8})
    mesh8 = ck_mesh((8,))
    one_d = handler().restore(tmp_path / "flat8", args=zo.ZeroRestore(ck_target(mesh8)))
    assert not any(leaf.dims for leaf in zo.describe(one_d).leaves)
    _, p8, s8 = ck_train(mesh8, host, one_d, range(2, 4))
    ref, ref_state = ck_oracle([(range(2), 4), (range(2, 4), 8)])
    assert_tree({k: np.asarray(v) for k, v in p8.items()}, ref)
    assert_tree(zo.gather_state(s8), ref_state)


def test_demo_mesh_flag():
    """`python -m zero_optax.demo --mesh data=4,model=2` trains on a (data, model) mesh (a full run takes minutes:
    `--partition leaf --mesh data=4,model=2` is recorded in benchmarks/RESULTS.md)."""
    from zero_optax import demo

    assert demo.parse_mesh("data=4,model=2") == (8, 2) and demo.parse_mesh(None) == (None, 1)
    with pytest.raises(SystemExit, match="data=4,model=2"):
        demo.parse_mesh("data=4,expert=2")
    mesh = demo.data_mesh(jax.devices()[:8], 2)
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    model = demo.new_model(5, mesh, tensor_parallel=True)
    assert model.blocks[0].qkv.kernel[...].sharding.spec == P(None, "model")
    assert model.blocks[0].down.kernel[...].sharding.spec == P("model", None)
