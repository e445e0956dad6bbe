"""Time to first step against the number of leaves: `python -m benchmarks.first_step [--leaves 400 1000]`.

A tree of L leaves (half 16x16 matrices, half 16-vectors), AdamW (or `--optimizer muon`: `optax.contrib.muon`), 8
simulated CPU devices (`--devices N`). Every variant is timed from nothing to a compiled step, each in a fresh
subprocess so that no cache is shared:

* `optax`: plain optax under `jax.jit` (one program, the parameters replicated): `init` (compile + run) plus the
  trace and compile of the step;
* `gspmd`: MaxText style, `jax.jit` with the state sharded over "data" on its first divisible dimension
  (`benchmarks.variants.build_gspmd`), the gradient given as the stacked per-device gradients;
* `flat`, `leaf`, `auto`: zero1 under `jax.shard_map`: the shard_map'ed `init` (trace, compile, run) plus the
  compile of the step;
* `gspmd_traced`: `gspmd` plus one `jax.make_jaxpr` of the inner update on the parameters' shapes before its
  `init`: the least time any `init` adds to GSPMD's when it decides how to store the state from the update's
  program (which leaves couple, which run one program), as zero1's layout does;
* `bound`: the mesh-bound zero1 (on the "Auto" mesh GSPMD gets): `tx.init` plus the compile of `tx.update` +
  `optax.apply_updates` under `jax.jit`, parameters and state donated and pinned.

`--gpt` times the GPT-like tree of 12 blocks of width 256 (147 leaves, 9.74 M parameters; `--tree 256,128,12`: 12 of
width 128, 123 leaves) instead; the leaf count column then reads 0. `--repeat K` runs every variant K times, one round after another, and shows each variant's
median run (the machine is shared: single runs vary by 0.1-0.2 x). `fusions / distinct`: the compiled step's fused
computations, and how many differ (names and metadata aside): XLA:CPU generates code once per distinct one, which is
most of a compile's time after its passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import os, sys, time, json
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
N = int(sys.argv[4])
jax.config.update("jax_num_cpu_devices", N)
import jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import zero_optax as zo

L, variant, optimizer = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if L == 0:  # --gpt: the GPT-like tree (`--tree`; by default 12 blocks of width 256: 9.74 M parameters, 147 leaves)
    from tests._models import gpt_params
    params = gpt_params(*(int(v) for v in sys.argv[5].split(",")))
else:
    params = {f"p{i:04d}": (jnp.ones((16, 16)) if i % 2 == 0 else jnp.ones((16,))) * 0.01 for i in range(L)}
if variant in ("gspmd", "gspmd_traced", "bound"):
    from jax.sharding import AxisType
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
else:
    mesh = jax.make_mesh((N,), ("data",))
params = jax.device_put(params, NamedSharding(mesh, P()))
grads = jax.device_put(jax.tree.map(lambda x: jnp.zeros((N,) + x.shape), params), NamedSharding(mesh, P("data")))
inner = optax.adamw(1e-3) if optimizer == "adamw" else optax.contrib.muon(1e-3)
with jax.set_mesh(mesh):
    t0 = time.perf_counter()
    if variant == "gspmd_traced":
        shapes = jax.eval_shape(lambda: params)
        jax.make_jaxpr(inner.update)(shapes, jax.eval_shape(inner.init, shapes), shapes)
    if variant in ("gspmd", "gspmd_traced"):
        from benchmarks.variants import build_gspmd
        built = build_gspmd(inner, mesh, params)
        state = jax.block_until_ready(built.init(params))
    elif variant in ("optax", "optax_shard_map"):
        tx = inner
        state = jax.block_until_ready(jax.jit(tx.init)(params))
    elif variant == "bound":
        tx = zo.zero1(inner, axis_name="data", mesh=mesh)
        state = jax.block_until_ready(tx.init(params))
    else:
        tx = zo.zero1(inner, axis_name="data", partition=variant)
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))
        state = jax.block_until_ready(init(params))
    t_init = time.perf_counter() - t0
    if variant in ("gspmd", "gspmd_traced"):
        step = built.step
        args = (params, grads, state)
    elif variant == "optax":
        step = jax.jit(lambda p, s, g: tx.update(g, s, p))
        args = (params, state, params)
    elif variant == "bound":  # the step trainers write: update + apply_updates, donated and pinned
        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        rep = NamedSharding(mesh, P())
        step = jax.jit(step, donate_argnums=(0, 1), out_shardings=(rep, jax.tree.map(lambda x: x.sharding, state)))
        args = (params, state, jax.device_put(params, rep))
    else:
        out_specs = P() if variant == "optax_shard_map" else P("data")
        def step(p, s, g):
            g = jax.tree.map(lambda x: x[0], g)
            if variant == "optax_shard_map":  # plain optax inside a shard_map: the floor of any shard_map step
                g = jax.lax.pmean(g, "data")
            return tx.update(g, s, p)
        step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), out_specs, P("data")),
                                     out_specs=(P(), out_specs)))
        args = (params, state, grads)
    t1 = time.perf_counter()
    compiled = step.lower(*args).compile()
    t_update = time.perf_counter() - t1
text = compiled.as_text()
coll = sum(text.count(k) for k in ("all-reduce(", "all-gather(", "reduce-scatter(", "all-to-all(", "collective-permute("))
import re  # XLA:CPU compiles one program per distinct fused computation: count them, names and metadata aside
bodies = re.findall(r"^%?fused_computation\S* (.*?)^}", text, flags=re.S | re.M)
kernels = len({re.sub(r"param_[\d.]+|%[\w.\-]+|, metadata=\{[^}]*\}", "", b) for b in bodies})
print(json.dumps({"leaves": L, "variant": variant, "init_s": t_init, "update_compile_s": t_update,
                  "total_s": t_init + t_update, "collectives": coll, "fusions": len(bodies), "kernels": kernels}))
"""


def measure(leaves: int, variant: str, optimizer: str, devices: int = 8, tree: str = "1024,256,12") -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHILD, str(leaves), variant, optimizer, str(devices), tree], capture_output=True,
                         text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[400, 1000])
    parser.add_argument("--variants", nargs="+", default=["optax", "gspmd", "flat"])
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--gpt", action="store_true", help="the GPT-like tree of 147 real-size leaves instead")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (the mesh's one axis)")
    parser.add_argument("--tree", default="1024,256,12", help="with --gpt: vocabulary,width,layers")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of every variant, interleaved; each row is the round of median total time")
    args = parser.parse_args(argv)
    rounds = [[measure(L, v, args.optimizer, args.devices, args.tree) for L in ([0] if args.gpt else args.leaves) for v in args.variants]
              for _ in range(args.repeat)]
    rows = [sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2] for runs in zip(*rounds)]
    base = {r["leaves"]: r["total_s"] for r in rows if r["variant"] == "optax"}
    gspmd = {r["leaves"]: r["total_s"] for r in rows if r["variant"] == "gspmd"}
    print(f"{args.optimizer}:")
    print("| leaves | variant | init s | first update compile s | total s | x optax | x gspmd | collectives | "
          "fusions / distinct |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["total_s"] / base[r["leaves"]] if r["leaves"] in base else float("nan")
        to_gspmd = r["total_s"] / gspmd[r["leaves"]] if r["leaves"] in gspmd else float("nan")
        print(f"| {r['leaves']} | {r['variant']} | {r['init_s']:.2f} | {r['update_compile_s']:.2f} | "
              f"{r['total_s']:.2f} | {ratio:.2f} | {to_gspmd:.2f} | {r['collectives']} | "
              f"{r['fusions']} / {r['kernels']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
