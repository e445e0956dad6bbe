"""Step time on a tree of many small leaves: `python -m benchmarks.step_time [--leaves 1000] [--rounds 7]`.

The tree of `benchmarks.first_step` (L leaves, half 16 x 16 matrices, half 16-vectors), AdamW, simulated CPU
devices. One process, interleaved rounds (every variant once per round), the median step of each round, then the
median over rounds; ratios are taken within the run:

* N = 1: `replicated` (plain `optax.adamw` under `jax.jit` on one device) against `zero1_flat_scatter` (inside a
  `shard_map`) and `zero1_flat_bound` (mesh-bound, under plain `jax.jit`);
* N = 8: `gspmd` (MaxText style) against `zero1_flat_scatter`.

Each step is the whole optimizer step (reduction, update, gather, `optax.apply_updates`), donated.
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

import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.variants import VARIANTS, make_mesh

PAIRS = ((1, "replicated"), (1, "zero1_flat_scatter"), (1, "zero1_flat_bound"), (8, "gspmd"),
         (8, "zero1_flat_scatter"))


def tree(leaves: int) -> dict[str, jax.Array]:
    return {f"p{i:04d}": (jnp.ones((16, 16)) if i % 2 == 0 else jnp.ones((16,))) * 0.01 for i in range(leaves)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps per round and variant")
    args = parser.parse_args(argv)
    builders = {v.name: v.build for v in VARIANTS}
    rng = np.random.default_rng(0)
    runs = {}
    for n, name in PAIRS:
        mesh = make_mesh(n, jax.devices()[:n])
        params = tree(args.leaves)
        built = builders[name](optax.adamw(1e-3), mesh, params)
        p = jax.device_put(params, built.param_sharding)
        state = built.init(p)
        grads = jax.device_put({k: jnp.asarray(rng.normal(size=(n, *x.shape)), jnp.float32) * 1e-3
                                for k, x in params.items()}, built.grad_sharding)
        p, state = built.step(p, grads, state)  # compile
        jax.block_until_ready((p, state))
        runs[(n, name)] = [built.step, p, state, grads, []]
    for _ in range(args.rounds):
        for run in runs.values():
            step, p, state, grads, times = run
            samples = []
            for _ in range(args.steps):
                t = time.perf_counter()
                p, state = step(p, grads, state)
                jax.block_until_ready((p, state))
                samples.append(time.perf_counter() - t)
            run[1], run[2] = p, state
            times.append(statistics.median(samples))
    ms = {key: 1e3 * statistics.median(run[4]) for key, run in runs.items()}
    print(f"{args.leaves} leaves, AdamW, median of {args.rounds} interleaved rounds of {args.steps} steps:")
    print("| N | variant | step ms | ratio |")
    print("|---|---|---|---|")
    base = {1: ms[(1, "replicated")], 8: ms[(8, "gspmd")]}
    for (n, name), t in ms.items():
        ref = "optax.adamw" if n == 1 else "gspmd"
        print(f"| {n} | {name} | {t:.2f} | {t / base[n]:.2f} x {ref} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
