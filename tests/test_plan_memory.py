"""`zo.plan`'s memory figures, per device and per step, equal the bytes real arrays hold on the 8 simulated devices:
zero1's state (`tx.init`), the parameters and gradients, plain optax's state replicated and GSPMD-sharded (each
state leaf cut over "data" on its first divisible dimension, `benchmarks.variants.gspmd_state_specs`'s rule);
`device_memory` and `activation_bytes` give the verdicts, and the command line prints them and names its flags."""

import importlib
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.variants import first_divisible_spec, gspmd_state_specs
from zero_optax._plan import Footprint, parse_bytes

SHAPES = {"emb": (40, 16), "b": (16,), "s": (), "w": (16, 12), "v": (24, 12), "odd": (7, 5)}
TP = {"emb": P(), "b": P(), "s": P(), "w": P(None, "model"), "v": P("model"), "odd": P()}

CASES = {
    "adamw": ((8,), ("data",), optax.adamw(1e-2), {}, None),
    "adam-tp": ((4, 2), ("data", "model"), optax.adam(1e-2), dict(axis_name="data"), TP),
    "leaf-adafactor": ((8,), ("data",), optax.adafactor(1e-2), dict(partition="leaf"), None),
    "master-accumulate": ((8,), ("data",), optax.lion(1e-3), dict(master_dtype=jnp.float32, accumulate_steps=2),
                          None),
}


def params_of(mesh, specs):
    rng = np.random.default_rng(0)
    specs = specs or dict.fromkeys(SHAPES, P())
    dtypes = {"emb": jnp.bfloat16}
    return {k: jax.device_put(jnp.asarray(rng.normal(size=s), dtypes.get(k, jnp.float32)),
                              NamedSharding(mesh, specs[k]))
            for k, s in SHAPES.items()}


def held(tree) -> set[int]:
    """The bytes each device holds of the arrays of `tree` (a set: one value where every device holds the same)."""
    per_device: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return set(per_device.values())


def reference_specs(inner, params, specs, mesh, gspmd: bool):
    """optax's state specs, by optax's own `tree_map_params` (the parameters' specs for the trees that mirror them),
    then for GSPMD `first_divisible_spec` over "data" on the dimensions no axis cuts."""
    state = inner.init(params)
    if specs is None:
        return gspmd_state_specs(inner, params, mesh.shape["data"]) if gspmd else jax.tree.map(lambda _: P(), state)
    n = mesh.shape["data"]

    def cut(x, spec):
        free = [d if i >= len(spec) or spec[i] is None else 0 for i, d in enumerate(x.shape)]
        extra = first_divisible_spec(tuple(free), n)
        if not gspmd or not extra:
            return spec
        return P(*[e if e is not None else (spec[i] if i < len(spec) else None) for i, e in
                   enumerate([*extra, *[None] * (len(x.shape) - len(extra))])])

    return optax.tree_map_params(inner, cut, state, specs, transform_non_params=lambda x: cut(x, P()),
                                 is_leaf=lambda x: isinstance(x, P))


@pytest.mark.parametrize("case", sorted(CASES))
def test_memory_figures_equal_the_real_arrays_shards(case):
    shape, names, inner, options, specs = CASES[case]
    mesh = jax.make_mesh(shape, names)
    params = params_of(mesh, specs)
    structs = {k: jax.ShapeDtypeStruct(x.shape, x.dtype) for k, x in params.items()}
    planned = zo.plan(inner, structs, mesh=dict(zip(names, shape)), param_specs=specs, **options)
    memory = planned.memory

    tx = zo.zero1(inner, **({"axis_name": "data"} | options), param_specs=specs)
    pspecs = specs or P()
    state_specs = zo.state_specs(tx, params, pspecs, mesh=mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=state_specs))(params)
    assert held(state) == {memory["zero1"].stored} == {planned.stored_bytes}
    if options.get("master_dtype"):
        assert held(state.master) == {memory["zero1"].master} and memory["zero1"].master > 0
    grads = jax.tree.map(jnp.zeros_like, params)
    for name in ("zero1", "replicated", "gspmd"):
        assert held(params) == {memory[name].parameters} and held(grads) == {memory[name].gradients}

    for name, gspmd in (("replicated", False), ("gspmd", True)):
        ref = reference_specs(inner, params, specs, mesh, gspmd)
        placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), inner.init(params), ref)
        assert held(placed) == {memory[name].state}, name
    assert memory["gspmd"].state < memory["replicated"].state


def test_offloaded_state_is_no_device_memory():
    assert Footprint(1, 2, 30, 40, 50, 6).total == 129
    assert Footprint(1, 2, 30, 40, 50, 6, host=True).total == 9


def test_baselines_keep_optax_multisteps_accumulators():
    params = {"w": jax.ShapeDtypeStruct((64, 8), jnp.bfloat16)}
    plain = zo.plan(optax.sgd(0.1), params, mesh={"data": 8})
    accumulating = zo.plan(optax.sgd(0.1), params, mesh={"data": 8}, accumulate_steps=4)
    assert plain.memory["replicated"].accumulators == 0
    assert accumulating.memory["replicated"].accumulators == 64 * 8 * 2
    assert accumulating.memory["gspmd"].accumulators == 8 * 8 * 2
    assert accumulating.memory["zero1"].accumulators == 8 * 8 * 4  # float32 sums, this device's share


@pytest.mark.parametrize("value, expected", [
    ("80GB", 80 * 10**9), ("16GiB", 16 * 2**30), ("512 MiB", 512 * 2**20), ("1.5TB", 15 * 10**11),
    ("64kB", 64_000), ("2048", 2048), (1234, 1234), ("80gb", 80 * 10**9), (None, None),
])
def test_sizes_parse_decimal_and_binary_units(value, expected):
    assert parse_bytes(value, "device_memory") == expected


@pytest.mark.parametrize("value", ["eighty", "80GX", "80 G B", -1, True, 1.5, ""])
def test_a_bad_size_names_its_argument_and_the_forms(value):
    with pytest.raises(zo.ZeroError, match=r"device_memory must be .* 80GB or 16GiB"):
        zo.plan(optax.sgd(0.1), {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, mesh={"data": 2},
                device_memory=value)
    with pytest.raises(zo.ZeroError, match="activation_bytes must be"):
        zo.plan(optax.sgd(0.1), {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, mesh={"data": 2},
                activation_bytes=value)


BIG = {f"layer{i}": jax.ShapeDtypeStruct((4096, 4096), jnp.float32) for i in range(4)}


def test_fits_and_headroom_with_activations():
    without = zo.plan(optax.adam(1e-3), BIG, mesh={"data": 64})
    assert without.fits is None and without.headroom is None and without.as_dict()["fits"] is None
    zero1, replicated = without.memory["zero1"].total, without.memory["replicated"].total
    assert without.memory["gspmd"].total < zero1 < replicated  # zero1 adds the gradients' buckets
    p = zo.plan(optax.adam(1e-3), BIG, mesh={"data": 64}, device_memory=zero1 + 1000, activation_bytes="1kB")
    assert p.fits == {"zero1": True, "replicated": False, "gspmd": True}
    assert p.headroom["zero1"] == 0 and p.headroom["replicated"] == zero1 - replicated
    assert p.as_dict()["fits"] == p.fits and p.as_dict()["memory"]["zero1"]["total"] == zero1
    over = zo.plan(optax.adam(1e-3), BIG, mesh={"data": 64}, device_memory=zero1 + 999, activation_bytes=1000)
    assert over.fits["zero1"] is False and over.headroom["zero1"] == -1
    assert zo.plan(optax.adam(1e-3), BIG, mesh={"data": 64}, device_memory="80GB").fits == dict.fromkeys(
        ("zero1", "replicated", "gspmd"), True)


def test_summary_says_per_device_per_step_and_collapses_equal_ranges():
    p = zo.plan(optax.adam(1e-3), BIG, mesh={"data": 64}, device_memory="16GiB")
    text = p.summary()
    assert "per device, per step" in text and "fits in 16 GiB (17.18 GB)" in text
    row = next(line for line in text.splitlines() if line.startswith("inner state per device"))
    assert " to " not in row
    assert next(line for line in text.splitlines() if line.startswith("step moves over data")).endswith(
        "(per device, per step)")
    uneven = zo.plan(optax.adafactor(1e-3), {"a": jax.ShapeDtypeStruct((64, 64), jnp.float32),
                                             "b": jax.ShapeDtypeStruct((8,), jnp.float32)},
                     mesh={"data": 2}, partition="leaf")
    assert " to " in next(line for line in uneven.summary().splitlines() if line.startswith("inner state"))


def run_cli(capsys, *argv):
    status = importlib.import_module("zero_optax.plan").main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def shapes(tmp_path):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({name: {"shape": list(x.shape)} for name, x in BIG.items()}))
    return str(path)


def test_cli_prints_the_memory_table_and_the_verdict(capsys, shapes):
    status, out, err = run_cli(capsys, "--params-from", shapes, "--mesh", "data=64", "--device-memory", "80GB",
                               "--activation-bytes", "1GiB")
    assert status == 0 and err == ""
    for text in ("per device, per step", "replicated optax", "GSPMD-sharded optax", "step temporaries (bound)",
                 "activations (given)", "fits in 80.00 GB", "yes, ", "data=64"):
        assert text in out, text
    status, out, _ = run_cli(capsys, "--params-from", shapes, "--mesh", "data=64", "--device-memory", "300MB")
    assert status == 0 and "no, " in out
    status, out, _ = run_cli(capsys, "--params-from", shapes, "--mesh", "data=64", "--device-memory", "300MB",
                             "--json")
    figures = json.loads(out)
    assert figures["device_memory"] == 300 * 10**6 and figures["fits"]["replicated"] is False
    assert set(figures["memory"]) == {"zero1", "replicated", "gspmd"}


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "data=64", "--device-memory", "lots"], "--device-memory must be"),
    (["--mesh", "data=64", "--activation-bytes", "80GX"], "--activation-bytes must be"),
    (["--mesh", "data=32,model=2"], "pass --axis-name"),
    (["--mesh", "data=64", "--axis-name", "batch"], "--axis-name 'batch' names ['batch']"),
    (["--mesh", "data=64", "--master-dtype", "flot"], "--master-dtype 'flot' is no dtype"),
    (["--mesh", "data=64", "--accumulate-steps", "0"], "--accumulate-steps must be"),
])
def test_cli_errors_name_the_flags(capsys, shapes, argv, message):
    status, out, err = run_cli(capsys, "--params-from", shapes, *argv)
    assert status == 1 and out == "" and message in err and err.count("\n") == 1
    assert "axis_name=" not in err and "`" not in err


STEPS = {
    "adamw-master": (optax.adamw(1e-3), dict(master_dtype=jnp.float32), jnp.float32),
    "leaf-adafactor": (optax.adafactor(1e-3), dict(partition="leaf"), jnp.float32),
    "auto-muon": (optax.contrib.muon(1e-3), dict(partition="auto"), jnp.float32),
}


@pytest.mark.parametrize("case", sorted(STEPS))
def test_the_temporaries_bound_holds_the_compiled_steps(case):
    """zero1's `temporaries` is at least XLA:CPU's temporaries of the compiled step (gradients, state and
    parameters donated), on a float32 tree of leaves that travel alone and in buckets (XLA:CPU computes bfloat16
    in float32 copies: a bfloat16 tree's temporaries are about twice its parameters on this backend alone)."""
    inner, options, dtype = STEPS[case]
    mesh = jax.make_mesh((8,), ("data",))
    shapes = [(512, 512)] * 4 + [(512,)] * 6 + [(96, 64)] * 10
    params = {f"p{i}": jnp.ones(s, dtype) for i, s in enumerate(shapes)}
    planned = zo.plan(inner, params, mesh=mesh, **options)
    tx = zo.zero1(inner, axis_name="data", **options)
    specs = zo.state_specs(tx, params, P(), mesh=mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=specs))(params)

    def step(grads, state, params):
        updates, state = tx.update(zo.as_local(grads, "data"), state, params)
        return optax.apply_updates(params, updates), state

    program = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs)),
                      donate_argnums=(0, 1, 2))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        compiled = program.lower(params, state, params).compile()
    assert 0 < compiled.memory_analysis().temp_size_in_bytes <= planned.memory["zero1"].temporaries
