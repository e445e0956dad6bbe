"""`zo.plan` equals, to the byte, what the real state and the compiled step measure on the 8 simulated devices:
the layout `init` builds, each device's shard bytes, each mesh axis's collective bytes in the optimized HLO, and
the arrays and record a checkpoint writes."""

import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.hlo import collective_ops, heaviest_path

SHAPES = {"emb": (37, 16), "b": (16,), "s": (), "w": (16, 12), "v": (24, 12)}
TP = {"emb": P(), "b": P(), "s": P(), "w": P(None, "model"), "v": P("model")}

CASES = {
    "flat-adamw": ((8,), ("data",), optax.adamw(1e-2), {}, None),
    "auto-muon-master": ((8,), ("data",), optax.contrib.muon(1e-2), dict(partition="auto",
                                                                         master_dtype=jnp.float32), None),
    "leaf-adafactor": ((8,), ("data",), optax.adafactor(1e-2), dict(partition="leaf"), None),
    "flat-tp": ((4, 2), ("data", "model"), optax.adam(1e-2), dict(axis_name="data"), TP),
    "auto-tp": ((4, 2), ("data", "model"), optax.contrib.muon(1e-2), dict(axis_name="data", partition="auto"), TP),
    "replica": ((4, 2), ("data", "replica"), optax.lion(1e-3), dict(axis_name="data", replica_axis="replica"),
                None),
    "accumulate": ((8,), ("data",), optax.adam(1e-2), dict(accumulate_steps=2), None),
}


def params_of(mesh, specs):
    rng = np.random.default_rng(0)
    specs = specs or dict.fromkeys(SHAPES, P())
    return {k: jax.device_put(jnp.asarray(rng.normal(size=s), jnp.float32), NamedSharding(mesh, specs[k]))
            for k, s in SHAPES.items()}


def axes_of(group, mesh) -> str:
    """The mesh axes along which the devices of one replica group differ (ids index the mesh's devices)."""
    coords = np.array([np.unravel_index(i, mesh.devices.shape) for i in group])
    return "+".join(a for d, a in enumerate(mesh.axis_names) if len(set(coords[:, d])) > 1)


def measured_wire(compiled, mesh) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for op in heaviest_path(compiled.as_text()):
        kinds = out.setdefault(axes_of(op["replica_groups"][0], mesh), {})
        kinds[op["kind"]] = kinds.get(op["kind"], 0) + op["bytes"] * op["multiplier"]
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_equals_the_real_state_step_and_checkpoint(case, tmp_path):
    shape, names, inner, options, specs = CASES[case]
    mesh = jax.make_mesh(shape, names)
    params = params_of(mesh, specs)
    structs = {k: jax.ShapeDtypeStruct(x.shape, x.dtype) for k, x in params.items()}
    planned = zo.plan(inner, structs, mesh=dict(zip(names, shape)), param_specs=specs, **options)

    tx = zo.zero1(inner, **({"axis_name": "data"} | options), param_specs=specs)
    pspecs = specs or P()
    state_specs = zo.state_specs(tx, params, pspecs, mesh=mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=state_specs))(params)
    assert zo.describe(state) == planned.describe()
    for device in mesh.devices.flat:
        held = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == device)
        assert held == planned.stored_bytes == planned.memory["zero1"].stored
        assert sum(s.data.nbytes for x in params.values() for s in x.addressable_shards if s.device == device) \
            == planned.memory["zero1"].parameters == planned.memory["replicated"].gradients

    def step(grads, state, params):
        return tx.update(zo.as_local(grads, planned.layout.replica_axes + planned.layout.axes), state, params)

    compiled = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(pspecs, state_specs, pspecs),
                                     out_specs=(pspecs, state_specs))).lower(params, state, params).compile()
    wire = measured_wire(compiled, mesh)
    assert wire == planned.wire
    assert max(op["bytes"] for op in collective_ops(compiled.as_text())) == planned.largest_collective

    path = str(tmp_path / "opt_state")
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        ckpt.save(path, args=zo.ZeroSave(state))
    record_file = os.path.join(path, "zero_record.json")
    with open(record_file) as f:
        arrays = json.load(f)["states"][0]["arrays"]
    assert len(arrays) == planned.checkpoint_arrays
    assert sum(np.prod(a["shape"], dtype=int) * np.dtype(a["dtype"]).itemsize for a in arrays) == \
        planned.checkpoint_bytes
    assert os.path.getsize(record_file) == planned.record_bytes


def test_plan_reads_the_parameters_shardings():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    from_arrays = zo.plan(optax.adam(1e-2), params_of(mesh, TP), mesh=mesh, axis_name="data")
    abstract = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
    structs = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    assert zo.plan(optax.adam(1e-2), structs, mesh=abstract, param_specs=TP, axis_name="data") == from_arrays
    assert {leaf.path: leaf.axes for leaf in from_arrays.layout.leaves}["['v']"] == ("model",)


def test_plan_at_a_size_this_machine_lacks():
    params = {"w": jax.ShapeDtypeStruct((1000, 77), jnp.bfloat16), "s": jax.ShapeDtypeStruct((), jnp.float32)}
    p = zo.plan(optax.adam(1e-3), params, mesh={"data": 1024}, master_dtype=jnp.float32)
    # mu, nu and the master copy in float32: ceil(77000 / 1024) = 76 coordinates of w and 1 of s; the count.
    # The gradients are summed in float32 (the master copy's dtype), the new bfloat16 parameters gathered.
    assert p.stored_bytes == 3 * 4 * (76 + 1) + 4
    assert p.wire["data"] == {"reduce-scatter": 1024 * (76 + 1) * 4, "all-gather": 1024 * (76 * 2 + 4)}
    assert p.as_dict()["world_size"] == 1024 and "1,024" not in p.summary()


@pytest.mark.parametrize("kwargs, match", [
    (dict(mesh={"data": 0}), "mapping of axis names to sizes"),
    (dict(mesh={"data": 2, "model": 2}), "pass axis_name="),
    (dict(mesh={"data": 2}, partition="rows"), "`partition` must be"),
    (dict(mesh={"data": 2}, learning_rate=1.0), "no options of zero1"),
    (dict(mesh={"data": 2}, axis_name="batch"), "batch"),
])
def test_plan_refuses_bad_arguments(kwargs, match):
    with pytest.raises(zo.ZeroError, match=match):
        zo.plan(optax.adam(1e-2), {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, **kwargs)


def run_cli(capsys, *argv):
    status = importlib.import_module("zero_optax.plan").main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_reads_a_json_of_shapes(tmp_path, capsys):
    shapes = {"layer": {"w": {"shape": [16, 12], "dtype": "bfloat16", "spec": [None, "model"]},
                        "b": {"shape": [12]}}, "s": {"shape": []}}
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(shapes))
    status, out, _ = run_cli(capsys, "--params-from", str(path), "--mesh", "data=4,model=2", "--axis-name", "data",
                             "--master-dtype", "float32", "--json")
    assert status == 0
    params = {"layer": {"w": jax.ShapeDtypeStruct((16, 12), jnp.bfloat16), "b": jax.ShapeDtypeStruct((12,), "float32")},
              "s": jax.ShapeDtypeStruct((), jnp.float32)}
    specs = {"layer": {"w": P(None, "model"), "b": P()}, "s": P()}
    expected = zo.plan(optax.adamw(1e-3), params, mesh={"data": 4, "model": 2}, param_specs=specs,
                       axis_name="data", master_dtype="float32")
    assert json.loads(out) == expected.as_dict()
    status, out, _ = run_cli(capsys, "--params-from", str(path), "--mesh", "data=4,model=2", "--axis-name", "data")
    assert status == 0 and "stored per device" in out and "step moves over data" in out


def test_cli_plans_an_nnx_factory_with_its_partitioning(capsys):
    from flax import nnx

    import docs.examples.gpt as gpt

    status, out, _ = run_cli(capsys, "--params-from", "docs/examples/gpt.py:gpt_small", "--mesh", "data=4,model=2",
                             "--axis-name", "data", "--partition", "auto", "--optimizer", "muon", "--json")
    assert status == 0
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
    with jax.sharding.use_abstract_mesh(mesh):
        model = nnx.eval_shape(gpt.gpt_small)
    state = nnx.state(model, nnx.Param)
    expected = zo.plan(optax.contrib.muon(1e-3), nnx.to_pure_dict(state), mesh=mesh, axis_name="data", partition="auto",
                       param_specs=nnx.to_pure_dict(nnx.get_partition_spec(state)))
    assert json.loads(out) == expected.as_dict()
    assert any(leaf.axes == ("model",) for leaf in expected.layout.leaves)


@pytest.mark.parametrize("argv, message", [
    (["--params-from", "nowhere.json", "--mesh", "data=2"], "cannot read --params-from file nowhere.json"),
    (["--params-from", "docs/examples/gpt.py:gpt_small", "--mesh", "data=two"], "`--mesh` must look like"),
    (["--params-from", "docs/examples/gpt.py:nothing", "--mesh", "data=2"], "has no 'nothing'"),
    (["--params-from", "docs/examples/gpt.py:gpt_small", "--mesh", "data=2,model=1", "--axis-name", "data",
      "--optimizer", "nosuch"], "no optimizer of optax or optax.contrib"),
])
def test_cli_refuses_bad_input_in_one_line(capsys, argv, message):
    status, out, err = run_cli(capsys, *argv)
    assert status == 1 and out == "" and message in err and err.count("\n") == 1


def test_the_package_attribute_stays_callable():
    import zero_optax.plan  # noqa: F401  (replaces the package attribute by the submodule)

    p = zo.plan(optax.sgd(0.1), {"w": jax.ShapeDtypeStruct((10,), jnp.float32)}, mesh={"data": 4})
    assert p.stored_bytes == 0 and p.wire["data"] == {"reduce-scatter": 48, "all-gather": 48}


def test_at_16_devices_plan_state_exactness_and_checkpoints(tmp_path):
    """`benchmarks/plan_scale.py` at a size the suite affords (it runs at 64 and 256 devices): in fresh processes
    of 16 simulated devices, plan equals the real run, zero1 matches optax, a checkpoint saved at 16 restores at 8
    and at (data=4, model=4), at load time and offline, bit for bit."""
    from benchmarks import plan_scale

    flat = plan_scale._child(16, "check", "flat")
    assert flat["plan"] == {"layout": True, "stored": True, "wire": True, "largest": True}
    assert flat["exact"]["params"] < 1e-6 and flat["exact"]["state"] < 1e-6
    assert flat["state"]["ratio"] <= 1.01
    restored = plan_scale._checkpoints(16, "auto", str(tmp_path), tensor_parallel=True)
    assert restored == {target: {"load_time": True, "offline": True} for target in ("data=8", "data=4,model=4")}
