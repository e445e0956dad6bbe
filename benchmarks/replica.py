"""Wire bytes per mesh axis and step time with a replica axis: `python -m benchmarks.replica [--rounds R]`.

The GPT tree of `benchmarks.step_time --gpt` (`gpt_params(2048, 256, 8)`, 26.1 MB float32), AdamW, on a
`(replica=2, data=4)` mesh of 8 simulated CPU devices, per-device gradients varying over both axes. Variants:

* `replica_axis`: `zero1(adamw, axis_name="data", replica_axis="replica")`: the state sharded over `data`,
  replicated over `replica` (issue 32), in `shard_map`;
* `joint`: `zero1(adamw, axis_name=("replica", "data"))`: the state sharded over both axes jointly;
* `dp`: plain data parallelism: `lax.pmean` of the gradients over both axes, AdamW on every device;
* `gspmd`: `jax.jit` with the parameters replicated and every state leaf sharded over `data` only on its first
  divisible dimension (MaxText style, `benchmarks.variants.build_gspmd` on this mesh), the gradients stacked per
  device and averaged in the step.

Counted exactly from the compiled HLO (`benchmarks.hlo`): the bytes each device puts on the wire per step,
by the mesh axes a collective's groups span (all-reduce counted twice, as a reduce-scatter plus an all-gather:
`WIRE_WEIGHTS`), and the state bytes per device. Timed: interleaved rounds, the median step of each round, the
median over rounds, ratios against `gspmd` within the run (this machine is shared and noisy; the CPU's
in-process collectives do not model a slow network).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import argparse
import statistics
import sys
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.collectives import _wire_per_axis
from benchmarks.memory import max_state_bytes
from benchmarks.model import gpt_params, param_count, tree_bytes
from benchmarks.variants import first_divisible_spec
from benchmarks.hlo import collective_ops

BOTH = ("replica", "data")


def _zero1(tx, mesh, params, grads):
    specs = zo.state_specs(tx, params, P(), mesh=mesh)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(BOTH)), out_specs=(P(), specs)),
                   donate_argnums=(0, 1))
    return init, step


def _dp(inner, mesh, params, grads):
    def step(p, s, g):
        g = jax.tree.map(lambda x: jax.lax.pmean(x[0], BOTH), g)
        u, s = inner.update(g, s, p)
        return optax.apply_updates(p, u), s

    init = jax.jit(jax.shard_map(inner.init, mesh=mesh, in_specs=P(), out_specs=P()))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(BOTH)), out_specs=(P(), P())),
                   donate_argnums=(0, 1))
    return init, step


def _gspmd(inner, mesh, params, grads):
    n = mesh.shape["data"]
    specs = jax.tree.map(lambda x: first_divisible_spec(x.shape, n), jax.eval_shape(inner.init, params))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    rep = NamedSharding(mesh, P())

    def step(p, s, g):
        u, s = inner.update(jax.tree.map(lambda x: x.mean(0), g), s, p)
        return optax.apply_updates(p, u), s

    init = jax.jit(inner.init, out_shardings=shardings)
    step = jax.jit(step, in_shardings=(rep, shardings, NamedSharding(mesh, P(BOTH))), out_shardings=(rep, shardings),
                   donate_argnums=(0, 1))
    return init, step


def variants(inner) -> dict[str, Any]:
    return {
        "replica_axis": lambda m, p, g: _zero1(zo.zero1(inner, axis_name="data", replica_axis="replica"), m, p, g),
        "joint": lambda m, p, g: _zero1(zo.zero1(inner, axis_name=BOTH), m, p, g),
        "dp": lambda m, p, g: _dp(inner, m, p, g),
        "gspmd": lambda m, p, g: _gspmd(inner, m, p, g),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    args = parser.parse_args(argv)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), BOTH,
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = jax.tree.map(np.asarray, gpt_params(2048, 256, 8))  # (host arrays: every variant places its own)
    pbytes = tree_bytes(params)
    rng = np.random.default_rng(0)
    grads = jax.device_put(jax.tree.map(lambda x: (rng.standard_normal((8, *x.shape)) * 1e-2).astype(x.dtype),
                                        params), NamedSharding(mesh, P(BOTH)))
    inner = optax.adamw(1e-3)
    built, wires, states = {}, {}, {}
    for name, build in variants(inner).items():
        init, step = build(mesh, params, grads)
        p = jax.device_put(params, NamedSharding(mesh, P()))
        s = init(p)
        states[name] = max_state_bytes(s)
        wires[name] = _wire_per_axis(collective_ops(step.lower(p, s, grads).compile().as_text()), mesh)
        p, s = step(p, s, grads)  # (compiles)
        jax.block_until_ready(p)
        built[name] = [step, p, s]
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(args.rounds):
        for name, slot in built.items():
            step, p, s = slot
            per = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                p, s = step(p, s, grads)
                jax.block_until_ready(p)
                per.append(time.perf_counter() - t0)
            slot[1], slot[2] = p, s
            times[name].append(statistics.median(per))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    axes_seen = sorted({a for w in wires.values() for a in w}, key=lambda a: (len(a), a))
    print(f"GPT tree: {param_count(params):,} float32 parameters ({pbytes / 2**20:.1f} MB), AdamW, mesh (replica=2, "
          f"data=4), JAX {jax.__version__} on {jax.devices()[0].platform}; {args.rounds} rounds x {args.steps} "
          "steps.\n")
    head = " | ".join(f"wire over {'+'.join(a)} (MB/device; x params)" for a in axes_seen)
    print(f"| variant | {head} | state MB/device | step ms | x gspmd |")
    print("|---|" + "---|" * (len(axes_seen) + 3))
    for name in built:
        cells = " | ".join(f"{wires[name].get(a, 0) / 2**20:.2f}; {wires[name].get(a, 0) / pbytes:.3f}"
                           for a in axes_seen)
        print(f"| `{name}` | {cells} | {states[name] / 2**20:.2f} | {ms[name]:.1f} | {ms[name] / ms['gspmd']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
