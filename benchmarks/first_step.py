"""Time to first step against the number of leaves: `python -m benchmarks.first_step [--leaves 100 400 1000]`.

A tree of L leaves (half 16x16 matrices, half 16-vectors), AdamW, 8 simulated CPU devices. For plain optax: jit
of `init` (compile + run) plus the trace and compile of a jitted `update` step. For zero1 (flat, leaf): the shard_map'ed
`init` (trace, compile, run) plus the compile of the shard_map'ed step. Each measurement runs in a fresh
subprocess, so no cache is shared.
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
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import zero_optax as zo

L, variant = int(sys.argv[1]), sys.argv[2]
params = {f"p{i:04d}": (jnp.ones((16, 16)) if i % 2 == 0 else jnp.ones((16,))) * 0.01 for i in range(L)}
mesh = jax.make_mesh((8,), ("data",))
params = jax.device_put(params, NamedSharding(mesh, P()))
grads = jax.device_put(jax.tree.map(lambda x: jnp.zeros((8,) + x.shape), params), NamedSharding(mesh, P("data")))
with jax.set_mesh(mesh):
    t0 = time.perf_counter()
    if variant in ("optax", "optax_shard_map"):
        tx = optax.adamw(1e-3)
        state = jax.block_until_ready(jax.jit(tx.init)(params))
    else:
        tx = zo.zero1(optax.adamw(1e-3), axis_name="data", partition=variant)
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))
        state = jax.block_until_ready(init(params))
    t_init = time.perf_counter() - t0
    if variant == "optax":
        step = jax.jit(lambda p, s, g: tx.update(g, s, p))
        args = (params, state, params)
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
print(json.dumps({"leaves": L, "variant": variant, "init_s": t_init, "update_compile_s": t_update,
                  "total_s": t_init + t_update, "collectives": coll}))
"""


def measure(leaves: int, variant: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHILD, str(leaves), variant], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[100, 400, 1000])
    parser.add_argument("--variants", nargs="+", default=["optax", "optax_shard_map", "flat", "leaf"])
    args = parser.parse_args(argv)
    rows = [measure(L, v) for L in args.leaves for v in args.variants]
    base = {r["leaves"]: r["total_s"] for r in rows if r["variant"] == "optax"}
    print("| leaves | variant | init s | first update compile s | total s | x optax | collectives |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["total_s"] / base[r["leaves"]] if r["leaves"] in base else float("nan")
        print(f"| {r['leaves']} | {r['variant']} | {r['init_s']:.2f} | {r['update_compile_s']:.2f} | "
              f"{r['total_s']:.2f} | {ratio:.2f} | {r['collectives']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
