"""Gradient accumulation inside zero1: `python -m benchmarks.accumulate [repetitions]`.

k = 4 micro-batches per optimizer step on the GPT tree (`benchmarks.model.gpt_params`), AdamW, flat partition,
8 simulated CPU devices, in one run: `zero1(accumulate_steps=4)` (sharded and local) and
`zero1(MultiSteps(...))` in `shard_map`, fed per-device gradients; `optax.MultiSteps(zero1(...))`, which refuses in
`shard_map` (MultiSteps' zero accumulators are invariant, so zero1 sees gradients invariant across devices) and is
measured in the form where it works, the mesh-bound zero1 under `jax.jit`, fed `jax.grad` of the global loss
(`global_loss`, whose gradient is the mean of the same per-device gradients: XLA reduces them outside the
optimizer); and plain data parallelism (`pmean` + AdamW).

Reported per optimizer step, in units of the parameter bytes: the wire volume from the compiled HLO (for a
`conditional`, the branch each call executes: `benchmarks.hlo.branch_collectives`); accumulator bytes per device
(zero1's own from `describe`; MultiSteps' `acc_grads` as held by device 0) against the float32 accumulator / N;
inner updates per optimizer step, counted at run time (a host callback in AdamW's update, in a separate, untimed
run); and the median wall time of a non-final micro-step and of a final one. All variants run cycle by cycle in
turn, `repetitions` times (default 8; the first is warm-up), so the noise of a shared machine hits them alike.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_NUM_CPU_DEVICES", "8")))

import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.model import gpt_params, tree_bytes
from benchmarks.hlo import branch_collectives

N, K = 8, 4
CALLS = {"n": 0}


def adamw(count: bool = False):
    """AdamW; with `count`, its update bumps a host counter each time it executes (once per device)."""
    inner = optax.adamw(3e-4, weight_decay=0.1)
    if not count:
        return inner

    def bump():
        CALLS["n"] += 1

    def update(updates, state, params=None, **kw):
        jax.debug.callback(bump)
        return inner.update(updates, state, params, **kw)
    return optax.GradientTransformationExtraArgs(inner.init, update)


def shard_map_variants(count: bool = False):
    return {
        "zero1(accumulate_steps=4) sharded": zo.zero1(adamw(count), axis_name="data", accumulate_steps=K,
                                                      assume_elementwise=True),
        "zero1(accumulate_steps=4, accumulate='local')": zo.zero1(adamw(count), axis_name="data",
                                                                  accumulate_steps=K, accumulate="local",
                                                                  assume_elementwise=True),
        "zero1(MultiSteps(adamw, 4))": zo.zero1(optax.MultiSteps(adamw(count), K).gradient_transformation(),
                                               axis_name="data", assume_elementwise=True),
        "MultiSteps(zero1(adamw), 4) in shard_map": optax.MultiSteps(
            zo.zero1(adamw(count), axis_name="data", assume_elementwise=True), K).gradient_transformation(),
    }


JIT_NAME = "MultiSteps(zero1(adamw, mesh=mesh), 4) under jax.jit"


def global_loss(params, grads):
    """A loss whose gradient is the mean over devices of `grads` (stacked `[N, ...]`, sharded over `data`)."""
    return sum(jnp.mean(jnp.sum((p[None] * g).reshape(g.shape[0], -1), axis=1))
               for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads)))


def accumulator_bytes(state) -> int:
    """Bytes per device of the accumulators: zero1's own (`describe`), or MultiSteps' `acc_grads`."""
    if isinstance(state, optax.MultiStepsState):  # the arrays device 0 holds
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.acc_grads))
    inner = zo.layout._state.find_states(state)[0]._inner
    if isinstance(inner, tuple) and hasattr(inner, "_fields") and "acc_grads" in inner._fields:
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(inner.acc_grads)) // N
    return max(zo.describe(zo.layout._state.find_states(state)[0]).accumulator_bytes_per_device)


def wire_per_step(text: str) -> float:
    """Bytes on the wire per optimizer step: k x what sits outside the accumulation `conditional`, its final
    branch (the one with the all-gathers) once and its other branch k - 1 times."""
    paths = branch_collectives(text)
    if not paths["branches"]:
        return K * paths["outside"]
    (per,), (kinds,) = paths["branches"], paths["kinds"]
    final = max(range(len(per)), key=lambda b: kinds[b].get("all-gather", 0))
    mid = [b for b in range(len(per)) if b != final]
    return K * paths["outside"] + per[final] + (K - 1) * (per[mid[0]] if mid else 0)


def build(name, tx, mesh, params):
    """`(step, state)` of one variant, or raises where it is refused."""
    if name == JIT_NAME:
        def jit_step(p, s, g):
            u, s = tx.update(jax.grad(global_loss)(p, g), s, p)
            return optax.apply_updates(p, u), s
        return jax.jit(jit_step), tx.init(params)
    specs = zo.state_specs(tx, params, mesh=mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], zo.as_local(g, "data")), s, p)
        return optax.apply_updates(p, u), s
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))), state


def variants(mesh, count: bool = False):
    out = shard_map_variants(count)
    out[JIT_NAME] = optax.MultiSteps(zo.zero1(adamw(count), axis_name="data", mesh=mesh,
                                              assume_elementwise=True), K)
    return out


def inner_updates_per_step(name, mesh, params, grads) -> float:
    tx = variants(mesh, count=True)[name]
    fn, state = build(name, tx, mesh, params)
    CALLS["n"] = 0
    p = params
    for g in grads:
        p, state = fn(p, state, g)
    jax.block_until_ready((p, state))
    jax.effects_barrier()
    return CALLS["n"] / N


def cycle(run, grads) -> list[float]:
    fn, p, s = run
    times = []
    for g in grads:
        t0 = time.perf_counter()
        p, s = fn(p, s, g)
        jax.block_until_ready((p, s))
        times.append(time.perf_counter() - t0)
    run[1], run[2] = p, s
    return times


def main(repetitions: int = 8) -> None:
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
          f"float32; {N} devices, k = {K}, AdamW, flat partition; {repetitions} interleaved repetitions")
    runs, rows = {}, {}
    for name, tx in variants(mesh).items():
        try:
            fn, state = build(name, tx, mesh, params)
            text = fn.lower(params, state, grads[0]).compile().as_text()
        except Exception as e:  # noqa: BLE001
            rows[name] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
            continue
        rows[name] = (wire_per_step(text) / pbytes, accumulator_bytes(state),
                      inner_updates_per_step(name, mesh, params, grads))
        runs[name] = [fn, params, state]

    def dp(p, s, g):
        g = jax.lax.pmean(jax.tree.map(lambda x: x[0], zo.as_local(g, "data")), "data")
        u, s = adamw().update(g, s, p)
        return optax.apply_updates(p, u), s
    dp_name = "plain data parallel (pmean + AdamW), per micro-step"
    fn = jax.jit(jax.shard_map(dp, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())))
    runs[dp_name] = [fn, params, adamw().init(params)]
    rows[dp_name] = (wire_per_step(fn.lower(params, runs[dp_name][2], grads[0]).compile().as_text()) / pbytes,
                     None, K)

    times = {name: [] for name in runs}
    for _ in range(repetitions):
        for name, run in runs.items():
            times[name].append(cycle(run, grads))
    print(f"{'variant':<56} {'wire/param bytes':>16} {'acc bytes/dev':>14} {'x f32/N':>8} {'inner/step':>10} "
          f"{'mid ms':>8} {'final ms':>8}")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:<56} {row}")
            continue
        wire, acc, inner = row
        t = np.asarray(times[name][1:]) * 1e3  # the first repetition is warm-up
        acc_text = "" if acc is None else f"{acc:,}"
        ratio = "" if acc is None else f"{acc / (pbytes / N):.3f}"
        mid = np.median(t) if name == dp_name else np.median(t[:, :-1])
        final = "" if name == dp_name else f"{np.median(t[:, -1]):.2f}"
        print(f"{name:<56} {wire:>16.3f} {acc_text:>14} {ratio:>8} {inner:>10g} {mid:>8.2f} {final:>8}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
