"""Gradient accumulation inside zero1: `python -m benchmarks.accumulate`.

k = 4 micro-batches per optimizer step on the GPT tree (`benchmarks.model.gpt_params`), AdamW, flat partition,
8 simulated CPU devices, for `zero1(accumulate_steps=4)` (sharded and local), `zero1(MultiSteps(...))` and
`MultiSteps(zero1(...))`, in one run. Reported per optimizer step, in units of the parameter bytes: the wire
volume from the compiled HLO (for a `conditional`, the branch each call executes: `benchmarks.hlo.branch_collectives`);
accumulator bytes per device against the float32 accumulator / N; and wall time of a non-final micro-step, a final one and a
plain data-parallel micro-step (all-reduce + replicated AdamW).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_NUM_CPU_DEVICES", "8")))

import time

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.hlo import branch_collectives
from benchmarks.model import gpt_params, tree_bytes

N, K = 8, 4
CALLS = {"n": 0}


def counted(inner):
    """`inner` whose update bumps a host counter each time it executes (once per device)."""
    def bump():
        CALLS["n"] += 1

    def update(g, s, p=None, **kw):
        jax.debug.callback(bump)
        return inner.update(g, s, p, **kw)
    return optax.GradientTransformationExtraArgs(inner.init, update)


def variants():
    adamw = lambda: optax.adamw(3e-4, weight_decay=0.1)  # noqa: E731
    return {
        "zero1(accumulate_steps=4) sharded": zo.zero1(adamw(), axis_name="data", accumulate_steps=K,
                                                      assume_elementwise=True),
        "zero1(accumulate_steps=4, accumulate='local')": zo.zero1(adamw(), axis_name="data",
                                                                  accumulate_steps=K, accumulate="local",
                                                                  assume_elementwise=True),
        "zero1(MultiSteps(adamw, 4))": zo.zero1(optax.MultiSteps(adamw(), K).gradient_transformation(),
                                               axis_name="data", assume_elementwise=True),
        "MultiSteps(zero1(adamw), 4)": optax.MultiSteps(zo.zero1(adamw(), axis_name="data",
                                                                 assume_elementwise=True), K)
                                       .gradient_transformation(),
    }


def accumulator_bytes(state) -> int:
    """Bytes per device of the accumulators: zero1's own (`describe`), or MultiSteps' `acc_grads`."""
    found = zo.transform._state.find_states(state)
    if isinstance(state, optax.MultiStepsState):
        return tree_bytes(state.acc_grads)  # replicated: every device holds all of it
    inner = found[0].inner_state
    if isinstance(inner, tuple) and hasattr(inner, "_fields") and "acc_grads" in inner._fields:
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(inner.acc_grads)) // N
    return max(zo.describe(found[0]).accumulator_bytes_per_device)


def main() -> None:
    mesh = jax.make_mesh((N,), ("data",))
    params = gpt_params(vocab=1024, d_model=256, n_layers=4)
    pbytes = tree_bytes(params)
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put(params, rep)
    key = jax.random.key(0)
    grads = [jax.device_put(jax.tree.map(lambda x, i=i: jax.random.normal(jax.random.fold_in(key, i),
                                                                          (N,) + x.shape, x.dtype), params), shard)
             for i in range(K)]
    print(f"GPT tree: {sum(x.size for x in jax.tree.leaves(params)):,} parameters, {pbytes / 2**20:.2f} MiB "
          f"float32; {N} devices, k = {K}, AdamW, flat partition")
    print(f"{'variant':<48} {'wire/param bytes':>16} {'acc bytes/dev':>14} {'x f32/N':>8} "
          f"{'mid ms':>8} {'final ms':>8}")
    for name, tx in variants().items():
        specs = zo.state_specs(tx, params, mesh=mesh)
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
        try:
            state = init(params)
        except Exception as e:  # noqa: BLE001
            print(f"{name:<48} refused: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            continue

        def step(p, s, g):
            u, s = tx.update(jax.tree.map(lambda x: x[0], zo.as_local(g, "data")), s, p)
            return optax.apply_updates(p, u), s
        try:
            fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))
            compiled = fn.lower(params, state, grads[0]).compile()
        except Exception as e:  # noqa: BLE001
            print(f"{name:<48} refused: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            continue
        paths = branch_collectives(compiled.as_text())
        if paths["branches"]:
            (per,), (kinds,) = paths["branches"], paths["kinds"]
            final = max(range(len(per)), key=lambda b: kinds[b].get("all-gather", 0))
            mid = [b for b in range(len(per)) if b != final]
            wire = K * paths["outside"] + per[final] + (K - 1) * (per[mid[0]] if mid else 0)
        else:
            wire = K * paths["outside"]
        acc = accumulator_bytes(state)
        p, s = params, state
        times = []
        for g in grads * 3:
            t0 = time.perf_counter()
            p, s = fn(p, s, g)
            jax.block_until_ready((p, s))
            times.append(time.perf_counter() - t0)
        times = np.asarray(times[K:]).reshape(-1, K) * 1e3  # drop the first cycle (warm-up)
        print(f"{name:<48} {wire / pbytes:>16.3f} {acc:>14,} {acc / (pbytes / N):>8.3f} "
              f"{np.median(times[:, :-1]):>8.2f} {np.median(times[:, -1]):>8.2f}")

    def dp(p, s, g):
        g = jax.lax.pmean(jax.tree.map(lambda x: x[0], zo.as_local(g, "data")), "data")
        u, s = optax.adamw(3e-4, weight_decay=0.1).update(g, s, p)
        return optax.apply_updates(p, u), s
    s = optax.adamw(3e-4, weight_decay=0.1).init(params)
    fn = jax.jit(jax.shard_map(dp, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())))
    p, times = params, []
    for g in grads * 3:
        t0 = time.perf_counter()
        p, s = fn(p, s, g)
        jax.block_until_ready((p, s))
        times.append(time.perf_counter() - t0)
    print(f"{'plain data parallel (pmean + AdamW), per micro-step':<48} {K * 2.0:>16.3f} {'':>14} {'':>8} "
          f"{np.median(times[K:]) * 1e3:>8.2f}")


if __name__ == "__main__":
    main()
