"""zero1 at 64 and 256 simulated devices, and `zo.plan` against it: `python -m benchmarks.plan_scale [--devices 64 256]`.

Each device count runs in a fresh subprocess with that many simulated CPU devices (1-D mesh "data"), on a GPT-like
tree (`tests._models.gpt_params`; by default 12 layers, width 128, vocabulary 256: 123 leaves, 2.4 M
parameters; the suite's test runs 4 layers of width 64). For flat AdamW and for Muon under
`partition="auto"` it checks and prints:

* `plan`: `zo.plan` (an `AbstractMesh`, no devices) equals the real run to the byte: the layout, every device's
  shard bytes, each axis's collective bytes in the compiled step's HLO, the largest collective;
* `exact`: two steps of zero1 inside `shard_map` (per-device gradients) against plain optax fed the mean gradient:
  the largest parameter and state difference (0.0 is bit for bit);
* `state`: the largest state a device holds against the ideal (flat: the state's bytes / N) or, under "auto",
  against the bound whole matrices set (the larger of bytes / N and the largest owned leaf's state);
* `checkpoint` (with `--checkpoints`): a state saved after two mesh-bound steps at N devices restores bit for bit
  at 8 devices and at (data=N/4, model=4), through `ZeroRestore(target, reshard=True)` (load time) and through
  `zo.reshard` then `ZeroRestore` (offline); with `--tensor-parallel` the matrices are cut over "model" there
  (Megatron style), and the restored state is checked by converting it back to N devices offline;
* `ttfs`: time to first step (init, trace and compile of the step) of zero1 over GSPMD (MaxText style,
  `benchmarks.variants.build_gspmd`), each timed in its own fresh subprocess.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
n, what, partition = int(sys.argv[1]), sys.argv[2], sys.argv[3]
TREE = tuple(int(v) for v in os.environ.get("PLAN_SCALE_TREE", "256,64,4").split(","))
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
import jax
import jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import zero_optax as zo
from benchmarks.hlo import collective_ops
from tests._models import gpt_params

mesh = jax.make_mesh((n,), ("data",))
inner = optax.adamw(1e-3, weight_decay=0.1) if partition == "flat" else optax.contrib.muon(1e-3)
params = jax.device_put(gpt_params(*TREE), NamedSharding(mesh, P()))
tx = zo.zero1(inner, axis_name="data", partition=partition)
out = {}
t0 = time.perf_counter()
if what == "ttfs-gspmd":
    from benchmarks.variants import build_gspmd
    from jax.sharding import AxisType
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    params = jax.device_put(gpt_params(*TREE), NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        built = build_gspmd(inner, mesh, params)
        state = jax.block_until_ready(built.init(params))
        grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + x.shape, x.dtype, sharding=built.grad_sharding), params)
        built.step.lower(params, grads, state).compile()
    print(json.dumps({"seconds": time.perf_counter() - t0})); sys.exit()
specs = zo.state_specs(tx, params, P(), mesh=mesh)
init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
state = jax.block_until_ready(init(params))
def step(g, s, p):
    u, s = tx.update(zo.as_local(g, "data"), s, p)
    return optax.apply_updates(p, u), s
run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs)))
compiled = run.lower(params, state, params).compile()
if what == "ttfs-zero1":
    print(json.dumps({"seconds": time.perf_counter() - t0})); sys.exit()

structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
t0 = time.perf_counter()
plan = zo.plan(inner, structs, mesh={"data": n}, partition=partition)
out["plan_seconds"] = time.perf_counter() - t0
held = {}
for x in jax.tree.leaves(state):
    for s in x.addressable_shards:
        held[s.device.id] = held.get(s.device.id, 0) + s.data.nbytes
wire = {}
for op in collective_ops(compiled.as_text()):
    wire.setdefault("data", {}).setdefault(op["kind"], 0)
    wire["data"][op["kind"]] += op["bytes"] * op["multiplier"]
out["plan"] = {"layout": zo.describe(state) == plan.describe(),
               "stored": set(held.values()) == {plan.stored_bytes},
               "wire": wire == plan.wire,
               "largest": max(op["bytes"] for op in collective_ops(compiled.as_text())) == plan.largest_collective}

rng = np.random.default_rng(0)
ref_p = jax.device_get(params)  # (the oracle: plain optax on one device)
ref_s = inner.init(ref_p)
local = jax.jit(jax.shard_map(lambda g, s, p: step(jax.tree.map(lambda x: x[0], g), s, p), mesh=mesh, in_specs=(P("data"), specs, P()),
                              out_specs=(P(), specs)), donate_argnums=(0, 1, 2))
p, s = params, state
del compiled, params  # (at 256 simulated devices every replicated byte counts 256 times in this process)
for _ in range(2):
    g = jax.tree.map(lambda x: rng.standard_normal(size=(n,) + x.shape, dtype=np.float32), p)
    mean = jax.tree.map(lambda x: x.mean(0), g)
    p, s = local(jax.device_put(g, NamedSharding(mesh, P("data"))), s, p)
    del g
    u, ref_s = inner.update(mean, ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
diff = lambda a, b: max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
out["exact"] = {"params": diff(p, ref_p), "state": diff(zo.gather_state(s)[0], ref_s)}
layout = plan.layout
total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(inner.init, structs)) if x.ndim)
largest = max([sum(e.nbytes for e in layout.entries if e.leaf == i) for i, leaf in enumerate(layout.leaves)
               if not leaf.sliced] or [0])
bound = max(total / n, largest)
out["state"] = {"max_per_device": max(layout.state_bytes_per_device), "ideal": total / n, "bound": bound,
                "ratio": max(layout.state_bytes_per_device) / bound}
print(json.dumps(out))
"""


CHECKPOINT = r"""
import json, os, sys
n, shape, partition, mode, directory = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
TREE = tuple(int(v) for v in os.environ.get("PLAN_SCALE_TREE", "256,64,4").split(","))
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
import jax, numpy as np, optax, orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
import zero_optax as zo
from tests._models import gpt_params

sizes = dict(item.split("=") for item in shape.split(","))
mesh = jax.make_mesh(tuple(int(v) for v in sizes.values()), tuple(sizes))
inner = optax.adamw(1e-3, weight_decay=0.1) if partition == "flat" else optax.contrib.muon(1e-3)
tree = gpt_params(*TREE)
def spec(path, x):  # Megatron style over "model" where the mesh has it and TP is asked for
    name = jax.tree_util.keystr(path)
    if "model" not in sizes or x.ndim != 2 or "embed" in name or os.environ.get("PLAN_SCALE_TP") != "1":
        return P()
    return P("model", None) if ("proj'" in name or "mlp_out'" in name) else P(None, "model")
specs = jax.tree_util.tree_map_with_path(spec, tree)
tensor_parallel = any(s != P() for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)))
params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)
tx = zo.zero1(inner, axis_name="data", partition=partition, mesh=mesh)
state = tx.init(params)
if mode == "save":
    rng = np.random.default_rng(0)
    for _ in range(2):
        g = jax.tree.map(lambda x: jax.device_put(rng.normal(size=x.shape).astype(np.float32), x.sharding), params)
        params, state = zo.apply_gradients(tx, g, state, params)
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        ckpt.save(os.path.join(directory, "saved"), args=zo.ZeroSave(state), force=True)
    np.savez(os.path.join(directory, "full.npz"), *[np.asarray(x) for x in jax.tree.leaves(zo.gather_state(state))])
    print(json.dumps({"saved": True})); sys.exit()
expected = np.load(os.path.join(directory, "full.npz"))
expected = [expected[f"arr_{i}"] for i in range(len(expected.files))]
def same(restored):
    if tensor_parallel:  # (gather_state needs whole leaves: back to a 1-D mesh of the same devices, offline)
        back = os.path.join(directory, "back")
        ckpt.save(back + "-tp", args=zo.ZeroSave(restored), force=True)
        zo.reshard(back + "-tp", back, axis_sizes={"data": int(n)}, param_specs=specs, force=True)
        mesh1 = jax.make_mesh((int(n),), ("data",))
        flat = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh1, P())), tree)
        restored = ckpt.restore(back, args=zo.ZeroRestore(zo.zero1(inner, axis_name="data", partition=partition,
                                                                   mesh=mesh1).init(flat)))
    got = [np.asarray(x) for x in jax.tree.leaves(zo.gather_state(restored))]
    return len(got) == len(expected) and all(a.dtype == b.dtype and a.tobytes() == b.tobytes()
                                             for a, b in zip(got, expected))
out = {}
with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
    out["load_time"] = same(ckpt.restore(os.path.join(directory, "saved"), args=zo.ZeroRestore(state, reshard=True)))
    offline = os.path.join(directory, "offline")
    zo.reshard(os.path.join(directory, "saved"), offline, axis_sizes={k: int(v) for k, v in sizes.items()},
               param_specs=specs if tensor_parallel else None, force=True)
    out["offline"] = same(ckpt.restore(offline, args=zo.ZeroRestore(state)))
print(json.dumps(out))
"""


def _checkpoints(n: int, partition: str, directory: str, tensor_parallel: bool = False) -> dict:
    """Saves at `n` devices (1-D), restores at 8 and at (data=n/4, model=4), at load time and offline."""
    os.environ["PLAN_SCALE_TP"] = "1" if tensor_parallel else "0"
    _run(CHECKPOINT, str(n), f"data={n}", partition, "save", directory)
    return {target: _run(CHECKPOINT, str(math.prod(int(v.split("=")[1]) for v in target.split(","))), target,
                         partition, "restore", directory)
            for target in ("data=8", f"data={n // 4},model=4")}


def _run(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    env.pop("NPROC", None)  # (a parent's, sized for its own device count: zero_optax sizes the child's, jaxlib < 0.12)
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(n: int, what: str, partition: str) -> dict:
    return _run(CHILD, str(n), what, partition)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--partitions", nargs="+", default=["flat", "auto"])
    parser.add_argument("--tree", default="256,128,12", help="the GPT-like tree: vocabulary,width,layers (the "
                                                               "default has 123 leaves, 2.4 M parameters)")
    parser.add_argument("--checkpoints", action="store_true", help="also save at each count and restore at 8 "
                                                                    "and (data=N/4, model=4)")
    parser.add_argument("--tensor-parallel", action="store_true", help="the matrices cut over \"model\" at "
                        "(data=N/4, model=4) (checked through an offline reshard back to N devices: slow at 256)")
    args = parser.parse_args(argv)
    os.environ["PLAN_SCALE_TREE"] = args.tree
    for n in args.devices:
        for partition in args.partitions:
            result = _child(n, "check", partition)
            gspmd = _child(n, "ttfs-gspmd", partition)["seconds"]
            zero = _child(n, "ttfs-zero1", partition)["seconds"]
            result["ttfs"] = {"zero1_s": round(zero, 2), "gspmd_s": round(gspmd, 2), "ratio": round(zero / gspmd, 3)}
            print(json.dumps({"devices": n, "partition": partition, **result}), flush=True)
            if args.checkpoints:
                with tempfile.TemporaryDirectory() as directory:
                    print(json.dumps({"devices": n, "partition": partition,
                                      "checkpoint": _checkpoints(n, partition, directory, args.tensor_parallel)}),
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
