"""Step time on many leaves or on the GPT tree: `python -m benchmarks.step_time [--leaves 1000 | --gpt]`.

The tree of `benchmarks.first_step` (L leaves, half 16 x 16 matrices, half 16-vectors), or with `--gpt` the 99-leaf
GPT tree of `benchmarks.run` (`gpt_params(2048, 256, 8)`, 26.1 MB), AdamW, simulated CPU devices. One process,
interleaved rounds (every variant once per round), the median step of each round, then the median over rounds;
ratios are taken within the run:

* N = 1: `optax_jit` (plain `optax.adamw` under `jax.jit` on one device, the reference) against `replicated`
  (the same inside a `shard_map`, with a gradient `pmean`), `zero1_flat_scatter` (zero1 inside a `shard_map`) and
  `zero1_flat_bound` (mesh-bound zero1 under plain `jax.jit`);
* N = 8: `gspmd` (MaxText style) against `zero1_flat_scatter`, and with `--gpt` also `zero1_flat_psum` and
  `zero1_flat_bound`;
* with `--gpt`, also `zero1_flat_apply` at both sizes (the mesh-bound step as one `zo.apply_gradients` call, which
  all-gathers the new parameters) and at N = 8 `zero1_flat_apply_per_leaf` (the same, one all-gather per leaf);
* with `--flax` (the GPT tree, N = 8): `gspmd`, `zero1_flat_bound` and `zero1_flat_apply_per_leaf` against Flax's
  classes stepping the same mesh-bound zero1 with one all-gather per leaf (`benchmarks.variants.FLAX_VARIANTS`):
  `nnx_optimizer` / `train_state` (`tx.update` + `optax.apply_updates`) and `nnx_zero_optimizer` /
  `zero_train_state` (`zo.ZeroOptimizer` / `zo.ZeroTrainState`: `zo.apply_gradients`).

Each step is the whole optimizer step (reduction, update, gather, `optax.apply_updates`), donated. With `--hlo`,
also what each compiled step moves (`benchmarks.hlo.entry_traffic`: the kernels of its entry computation and the
bytes they write and read, per device), which is exact where the times are noisy.
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

from benchmarks.model import gpt_params
from benchmarks.variants import FLAX_VARIANTS, VARIANTS, make_mesh
from benchmarks.hlo import entry_traffic

PAIRS = ((1, "optax_jit"), (1, "replicated"), (1, "zero1_flat_scatter"), (1, "zero1_flat_bound"), (8, "gspmd"),
         (8, "zero1_flat_scatter"))
GPT_PAIRS = tuple(sorted(PAIRS + ((1, "zero1_flat_apply"), (8, "zero1_flat_psum"), (8, "zero1_flat_bound"),
                                  (8, "zero1_flat_apply"), (8, "zero1_flat_apply_per_leaf")), key=lambda p: p[0]))
FLAX_PAIRS = ((8, "gspmd"), (8, "zero1_flat_bound"), (8, "zero1_flat_apply_per_leaf"),
              *((8, v.name) for v in FLAX_VARIANTS))


def tree(leaves: int) -> dict[str, np.ndarray]:
    return {f"p{i:04d}": np.full((16, 16) if i % 2 == 0 else (16,), 0.01, np.float32) for i in range(leaves)}


def gpt_tree() -> dict:
    return jax.tree.map(np.asarray, gpt_params(2048, 256, 8, 4))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=1000)
    parser.add_argument("--gpt", action="store_true", help="the GPT tree of benchmarks.run instead")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps per round and variant")
    parser.add_argument("--flax", action="store_true", help="the GPT tree stepped by Flax's classes (implies --gpt)")
    parser.add_argument("--hlo", action="store_true", help="also count what each compiled step writes and reads")
    args = parser.parse_args(argv)
    args.gpt = args.gpt or args.flax
    builders = {v.name: v.build for v in VARIANTS + FLAX_VARIANTS}
    rng = np.random.default_rng(0)
    runs, traffic = {}, {}
    for n, name in FLAX_PAIRS if args.flax else GPT_PAIRS if args.gpt else PAIRS:
        mesh = make_mesh(n, jax.devices()[:n])
        params = gpt_tree() if args.gpt else tree(args.leaves)
        built = builders[name](optax.adamw(1e-3), mesh, params)
        p = jax.device_put(params, built.param_sharding)
        state = built.init(p)
        grads = jax.device_put(jax.tree.map(lambda x, n=n: jnp.asarray(rng.normal(size=(n, *x.shape)) * 1e-3,
                                                                        jnp.float32), params), built.grad_sharding)
        if args.hlo:
            traffic[(n, name)] = entry_traffic(built.step.lower(p, grads, state).compile().as_text())
        for _ in range(2):  # compile; twice, as Flax's step counters start off the mesh (a second compilation)
            p, state = built.step(p, grads, state)
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
    what = "GPT tree (99 leaves)" if args.gpt else f"{args.leaves} leaves"
    print(f"{what}, AdamW, median of {args.rounds} interleaved rounds of {args.steps} steps:")
    print("| N | variant | step ms | ratio |")
    print("|---|---|---|---|")
    base = {n: ms[(n, ref)] for n, ref in ((1, "optax_jit"), (8, "gspmd")) if (n, ref) in ms}
    for (n, name), t in ms.items():
        ref = "optax.adamw" if n == 1 else "gspmd"
        print(f"| {n} | {name} | {t:.2f} | {t / base[n]:.2f} x {ref} |")
    if traffic:
        print("\nWhat each compiled step moves per device (MB written / read by the entry computation's kernels):")
        print("| N | variant | kernels | written MB | read MB | by kind (count, MB written) |")
        print("|---|---|---|---|---|---|")
        for (n, name), kinds in traffic.items():
            written, read = (sum(r[k] for r in kinds.values()) / 1e6 for k in ("written", "read"))
            by_kind = ", ".join(f"{k} {r['count']}, {r['written'] / 1e6:.1f}" for k, r in
                                sorted(kinds.items(), key=lambda kv: -kv[1]["written"]))
            print(f"| {n} | {name} | {sum(r['count'] for r in kinds.values())} | {written:.1f} | {read:.1f} | "
                  f"{by_kind} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
