"""What collective reductions cost on the wire (issue 29): `python -m benchmarks.reductions`.

The GPT tree of `benchmarks.step_time --gpt` (99 leaves, 26.1 MiB), 8 simulated CPU devices, the `shard_map` step
of zero1 with `partition="flat"` (per-device gradients, `tx.update` + `optax.apply_updates`) for `optax.adamw` and
for `optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))` and `optax.lamb`, whose norms run as a
reduction of each device's slice and a `psum` of the scalar. Prints each compiled step's collectives by kind
(count, full-tensor bytes) from its HLO (`benchmarks.hlo.collective_ops`).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.step_time import gpt_tree
from benchmarks.hlo import collective_ops

INNERS = {
    "adamw": lambda: optax.adamw(3e-4),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4)),
    "lamb": lambda: optax.lamb(3e-4),
}


def _ops(inner, params, mesh):
    tx = zo.zero1(inner, axis_name="data")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))
    state = init(params)

    def step(params, state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))))
    grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8,) + x.shape, x.dtype,
                                                        sharding=NamedSharding(mesh, P("data"))), params)
    return collective_ops(step.lower(params, state, grads).compile().as_text())


def main() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    params = jax.device_put(jax.tree.map(jnp.asarray, gpt_tree()), NamedSharding(mesh, P()))
    leaves = len(jax.tree.leaves(params))
    print(f"GPT tree: {leaves} leaves, {sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20:.1f} MiB, N = 8")
    base = None
    for name, make in INNERS.items():
        ops = _ops(make(), params, mesh)
        kinds: dict[str, list[int]] = {}
        for o in ops:
            k = kinds.setdefault(o["kind"], [0, 0])
            k[0] += o["multiplier"]
            k[1] += o["bytes"] * o["multiplier"]
        total = sum(b for _, b in kinds.values())
        extra = "" if base is None else f"  (+{total - base} bytes vs adamw)"
        base = total if base is None else base
        print(f"{name:11s} " + ", ".join(f"{k} x{c} ({b} B)" for k, (c, b) in sorted(kinds.items())) + extra)


if __name__ == "__main__":
    main()
