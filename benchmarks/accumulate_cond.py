"""What the accumulation `lax.cond` costs on XLA:CPU: `python -m benchmarks.accumulate_cond`.

Two isolated measurements behind the non-final micro-step's time in `benchmarks.accumulate` (8 simulated CPU
devices, interleaved repetitions, medians without the first two):

* zero updates: a non-final call must return updates of the parameters' shape. Returning them per leaf from a
  `lax.cond` (as zero1 does) against one flat buffer sliced outside the conditional, and against the caller's
  `apply_updates` alone, on the GPT tree of the benchmark.
* pass-through state: AdamW's moments (2/N of the parameter bytes per device, in 100 arrays) passing unchanged
  through a `lax.cond` (XLA copies them) against staying outside it.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import time

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.model import gpt_params


def interleaved(fns: dict, args: tuple, repetitions: int) -> dict[str, float]:
    times = {k: [] for k in fns}
    for _ in range(repetitions):
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v[2:]) * 1e3) for k, v in times.items()}


def zero_updates(mesh, repetitions: int = 12) -> dict[str, float]:
    params = jax.device_put(gpt_params(vocab=1024, d_model=256, n_layers=4), NamedSharding(mesh, P()))
    leaves, treedef = jax.tree.flatten(params)
    sizes = [x.size for x in leaves]

    def per_leaf(p, flag):
        u = jax.lax.cond(flag[0] > 0, lambda p: jax.tree.map(lambda x: x * 2, p),
                         lambda p: jax.tree.map(jnp.zeros_like, p), p)
        return jax.tree.map(lambda x, y: x + y, p, u)

    def flat(p, flag):
        u = jax.lax.cond(flag[0] > 0, lambda p: jnp.concatenate([x.ravel() * 2 for x in jax.tree.leaves(p)]),
                         lambda p: jnp.zeros((sum(sizes),), jnp.float32), p)
        parts = jnp.split(u, np.cumsum(sizes)[:-1])
        return jax.tree.unflatten(treedef, [x + y.reshape(x.shape) for x, y in zip(jax.tree.leaves(p), parts)])

    def add_only(p, flag):
        return jax.tree.map(lambda x: x + 0.0 * flag[0], p)

    fns = {name: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False))
           for name, f in [("zero updates per leaf from a lax.cond, + apply_updates", per_leaf),
                           ("one flat zero buffer from a lax.cond, sliced outside, + apply_updates", flat),
                           ("apply_updates alone", add_only)]}
    flag = jax.device_put(jnp.zeros(8, jnp.int32), NamedSharding(mesh, P("data")))
    return interleaved(fns, (params, flag), repetitions)


def pass_through(mesh, repetitions: int = 15) -> dict[str, float]:
    n = 3421696 // 8
    data = NamedSharding(mesh, P("data"))
    state = [jax.device_put(jnp.ones((8 * (n // 50),)), data) for _ in range(100)]
    acc = jax.device_put(jnp.ones((8 * n,)), data)
    flag = jax.device_put(jnp.zeros(8, jnp.int32), data)

    def through(s, a, f):
        return jax.lax.cond(f[0] > 0, lambda s, a: ([x * 2 for x in s], a * 0), lambda s, a: (s, a + 1), s, a)

    def outside(s, a, f):
        return s, jax.lax.cond(f[0] > 0, lambda a: a * 0, lambda a: a + 1, a)

    specs = [P("data")] * 100
    fns = {name: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(specs, P("data"), P("data")),
                                       out_specs=(specs, P("data")), check_vma=False))
           for name, f in [("moments pass through the lax.cond", through), ("moments outside it", outside)]}
    return interleaved(fns, (state, acc, flag), repetitions)


def main() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    for name, ms in {**zero_updates(mesh), **pass_through(mesh)}.items():
        print(f"{name:<72} {ms:8.2f} ms")


if __name__ == "__main__":
    main()
