"""The step trainers run, `tx.update` + `optax.apply_updates`, against GSPMD: `python -m benchmarks.contract_step`.

Per device, from XLA's own `compiled.memory_analysis()` and `compiled.cost_analysis()` of one jitted step (params
and state donated; 8 simulated CPU devices; flat AdamW; a GPT-like tree, `--layers 12 --width 256`):

* `gspmd(reduced)`: `jax.jit` with the state sharded over "data" (MaxText style), fed the already-reduced gradient;
* `gspmd(reducing)`: the same fed each device's own gradient (stacked over "data"), reduced inside the step as a
  data-parallel backward pass hands it over;
* `zero1 sm contract` / `zero1 sm apply`: zero1 under `jax.shard_map`, each device's own gradient, then
  `tx.update` + `optax.apply_updates`, or `zo.apply_gradients`;
* `zero1 bound contract` / `zero1 bound apply`: the mesh-bound zero1 under plain `jax.jit`, the reduced gradient;
* `rows gathered` / `rows exit`: a design probe, not zero1: SGD on flat rows (each leaf cut in N equal rows, as
  `partition="flat"` cuts it) inside a `shard_map` under `jax.jit`, then `optax.apply_updates` outside. `gathered`
  all-gathers the updates inside (what the mesh-bound zero1 does today); `exit` returns the rows sharded over
  "data" behind a `lax.optimization_barrier`, so that GSPMD adds each shard and gathers the new parameters, as it
  does for its own state. `main` checks that the two give the same bits.

Every program is compiled twice, each time in a fresh process: with XLA:CPU's default scheduler
(concurrency-optimized) and with its memory scheduler (`XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=
false`; the flag is read from the environment only, `compile(compiler_options=...)` leaves it unchanged), which
shows how much of a step's temporaries is the scheduler's choice. Bytes are exact; nothing is timed.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_NUM_CPU_DEVICES", "8")))

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.variants import gspmd_state_specs, make_mesh
from tests._models import gpt_params

SCHEDULERS = {"default": "", "memory": "--xla_cpu_enable_concurrency_optimized_scheduler=false"}


def _programs(tx: optax.GradientTransformation, params: Any, mesh: Any) -> dict[str, Callable[[], Any]]:
    """Each variant's lowered step, built lazily."""
    n = mesh.shape["data"]
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    specs = gspmd_state_specs(tx, params, n)
    state_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=dat), params)
    p = jax.device_put(params, rep)
    ztx, btx = zo.zero1(tx, axis_name="data"), zo.zero1(tx, axis_name="data", mesh=mesh)

    def contract(t: Any, own: bool) -> Callable[..., Any]:
        def step(p: Any, g: Any, s: Any) -> Any:
            g = jax.tree.map(lambda x: x[0], g) if own else g
            u, s = t.update(g, s, p)
            return optax.apply_updates(p, u), s
        return step

    def apply(t: Any, own: bool) -> Callable[..., Any]:
        def step(p: Any, g: Any, s: Any) -> Any:
            g = jax.tree.map(lambda x: x[0], g) if own else g
            return zo.apply_gradients(t, g, s, p)
        return step

    def gspmd(reducing: bool) -> Any:
        def step(p: Any, g: Any, s: Any) -> Any:
            g = jax.tree.map(lambda x: x.mean(0), g) if reducing else g
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        state = jax.eval_shape(jax.jit(tx.init, out_shardings=state_sh), p)
        fn = jax.jit(step, in_shardings=(rep, dat if reducing else rep, state_sh), out_shardings=(rep, state_sh),
                     donate_argnums=(0, 2))
        return fn.lower(p, stacked if reducing else p, state)

    def sharded(make: Callable[..., Any]) -> Any:
        state = jax.eval_shape(jax.jit(jax.shard_map(ztx.init, mesh=mesh, in_specs=P(), out_specs=P("data"))), p)
        fn = jax.shard_map(make(ztx, True), mesh=mesh, in_specs=(P(), P("data"), P("data")),
                           out_specs=(P(), P("data")))
        return jax.jit(fn, donate_argnums=(0, 2)).lower(p, stacked, state)

    def bound(make: Callable[..., Any]) -> Any:
        state = jax.eval_shape(btx.init, p)
        return jax.jit(make(btx, False), donate_argnums=(0, 2)).lower(p, p, state)

    return {
        **_rows_programs(params, mesh),
        "gspmd(reduced)": lambda: gspmd(False),
        "gspmd(reducing)": lambda: gspmd(True),
        "zero1 sm contract": lambda: sharded(contract),
        "zero1 sm apply": lambda: sharded(apply),
        "zero1 bound contract": lambda: bound(contract),
        "zero1 bound apply": lambda: bound(apply),
    }


def _rows_step(params: Any, mesh: Any, exit_sharded: bool) -> Callable[..., Any]:
    """The design probe: SGD on flat rows, the updates gathered inside or leaving sharded."""
    n, leaves = mesh.shape["data"], jax.tree.leaves(params)

    def rows(x: Any) -> Any:
        flat = x.reshape(-1)
        return jnp.pad(flat, (0, -flat.size % n)).reshape(n, -1)

    def local(grads: list[Any]) -> list[Any]:
        own = [-1e-3 * jax.lax.psum_scatter(rows(g), "data", tiled=True) for g in grads]
        if exit_sharded:
            return jax.lax.optimization_barrier(own)
        return [jax.lax.all_gather(u, "data", tiled=True) for u in own]

    def step(p: Any, g: Any) -> Any:
        out = P("data") if exit_sharded else P()
        u = jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=out, check_vma=False)(jax.tree.leaves(g))
        u = [r.reshape(-1)[: x.size].reshape(x.shape) for r, x in zip(u, leaves)]
        return optax.apply_updates(p, jax.tree.unflatten(jax.tree.structure(params), u))

    return step


def _rows_programs(params: Any, mesh: Any) -> dict[str, Callable[[], Any]]:
    """The design probe's two programs, lowered with the parameters donated and replicated."""
    rep = NamedSharding(mesh, P())
    p = jax.device_put(params, rep)
    return {f"rows {name}": (lambda e=e: jax.jit(_rows_step(params, mesh, e), donate_argnums=(0,),
                                                 out_shardings=rep).lower(p, p))
            for name, e in (("gathered", False), ("exit", True))}


def rows_agree(layers: int, width: int) -> bool:
    """Whether the design probe's two programs give the same bits after one step."""
    params = gpt_params(1024, width, layers)
    mesh = make_mesh(len(jax.devices()))
    rep = NamedSharding(mesh, P())
    p = jax.device_put(params, rep)
    with jax.set_mesh(mesh):
        a, b = (jax.jit(_rows_step(params, mesh, e), out_shardings=rep)(p, p) for e in (False, True))
    return all(bool((x == y).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def measure(layers: int, width: int) -> list[dict[str, Any]]:
    """One row per variant, under this process's scheduler: temporaries and bytes accessed per device."""
    params = gpt_params(1024, width, layers)
    mesh = make_mesh(len(jax.devices()))
    rows = []
    with jax.set_mesh(mesh):
        for name, lower in _programs(optax.adamw(1e-3), params, mesh).items():
            compiled = lower().compile()
            memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            rows.append({"variant": name, "temp": memory.temp_size_in_bytes, "argument": memory.argument_size_in_bytes,
                         "alias": memory.alias_size_in_bytes, "accessed": int(cost.get("bytes accessed", 0))})
    return rows


def _child(scheduler: str, layers: int, width: int) -> list[dict[str, Any]]:
    """`measure` in a fresh process under one scheduler."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {SCHEDULERS[scheduler]}".strip()}
    args = ["--child", "--layers", str(layers), "--width", str(width)]
    out = subprocess.run([sys.executable, "-m", "benchmarks.contract_step", *args], env=env, check=True,
                         capture_output=True, text=True).stdout
    return [{**r, "scheduler": scheduler} for r in json.loads(out.splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.layers, args.width)))
        return
    print(f"rows gathered and rows exit give the same bits: {rows_agree(args.layers, args.width)}")
    rows = [r for s in SCHEDULERS for r in _child(s, args.layers, args.width)]
    base = {r["scheduler"]: r for r in rows if r["variant"] == "gspmd(reduced)"}
    fair = {r["scheduler"]: r for r in rows if r["variant"] == "gspmd(reducing)"}
    print("| variant | scheduler | temporaries MB | bytes accessed MB | x gspmd(reduced) | x gspmd(reducing) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        s = r["scheduler"]
        print(f"| {r['variant']} | {s} | {r['temp'] / 1e6:.2f} | {r['accessed'] / 1e6:.1f} | "
              f"{r['accessed'] / base[s]['accessed']:.2f} | {r['accessed'] / fair[s]['accessed']:.2f} |")


if __name__ == "__main__":
    main()
