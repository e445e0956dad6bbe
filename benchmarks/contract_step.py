"""The step trainers run, `tx.update` + `optax.apply_updates`, against GSPMD: `python -m benchmarks.contract_step`.

Per device, from XLA's own `compiled.memory_analysis()` and `compiled.cost_analysis()` of one jitted step (params
and state donated, their shardings pinned; 8 simulated CPU devices; a GPT-like tree, `--layers 12 --width 256`),
for flat AdamW and for the Muon recipe (`optax.contrib.muon`, `partition="auto"`):

* `gspmd(reduced)`: `jax.jit` with the state sharded over "data" (MaxText style), fed the already-reduced gradient;
* `gspmd(reducing)`: the same fed each device's own gradient (stacked over "data"), reduced inside the step as a
  data-parallel backward pass hands it over;
* `zero1 sm contract` / `zero1 sm apply`: zero1 under `jax.shard_map`, each device's own gradient, then
  `tx.update` + `optax.apply_updates`, or `zo.apply_gradients`;
* `zero1 bound contract` / `zero1 bound apply`: the mesh-bound zero1 under plain `jax.jit`, the reduced gradient
  (under a trace its sliced leaves' updates leave cut in rows over "data": `Engine.exit_rows`). `main` first checks
  that three such steps give the same bits as the same steps run eagerly, where the updates are gathered.

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

OPTIMIZERS = {"adamw": (optax.adamw(1e-3), "flat"), "muon": (optax.contrib.muon(1e-3), "auto")}
SCHEDULERS = {"default": "", "memory": "--xla_cpu_enable_concurrency_optimized_scheduler=false"}


def _programs(tx: optax.GradientTransformation, partition: str, params: Any, mesh: Any
              ) -> dict[str, Callable[[], Any]]:
    """Each variant's lowered step, built lazily."""
    n = mesh.shape["data"]
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    specs = gspmd_state_specs(tx, params, n)
    state_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=dat), params)
    p = jax.device_put(params, rep)
    ztx = zo.zero1(tx, axis_name="data", partition=partition)
    btx = zo.zero1(tx, axis_name="data", mesh=mesh, partition=partition)

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
        pinned = (rep, jax.tree.map(lambda x: x.sharding, state))
        return jax.jit(make(btx, False), donate_argnums=(0, 2), out_shardings=pinned).lower(p, p, state)

    return {
        "gspmd(reduced)": lambda: gspmd(False),
        "gspmd(reducing)": lambda: gspmd(True),
        "zero1 sm contract": lambda: sharded(contract),
        "zero1 sm apply": lambda: sharded(apply),
        "zero1 bound contract": lambda: bound(contract),
        "zero1 bound apply": lambda: bound(apply),
    }


def bits_agree(layers: int, width: int) -> dict[str, bool]:
    """Per optimizer, whether three mesh-bound contract steps under `jax.jit` (updates leaving in rows) give the same
    bits as the same steps run eagerly (updates gathered inside the `shard_map`)."""
    params = gpt_params(1024, width, layers)
    mesh = make_mesh(len(jax.devices()))
    rep = NamedSharding(mesh, P())
    out = {}
    with jax.set_mesh(mesh):
        for name, (tx, partition) in OPTIMIZERS.items():
            btx = zo.zero1(tx, axis_name="data", mesh=mesh, partition=partition)

            def step(p: Any, g: Any, s: Any, btx: Any = btx) -> Any:
                u, s = btx.update(g, s, p)
                return optax.apply_updates(p, u), s
            runs = []
            for run in (jax.jit(step), step):
                p = jax.device_put(params, rep)
                s = btx.init(p)
                for t in range(3):
                    p, s = run(p, jax.tree.map(lambda x, t=t: jnp.cos(x * (t + 1)) * 1e-2, p), s)
                runs.append(jax.tree.leaves((p, s)))
            out[name] = all(bool((x == y).all()) for x, y in zip(*runs))
    return out


def measure(layers: int, width: int) -> list[dict[str, Any]]:
    """One row per variant, under this process's scheduler: temporaries and bytes accessed per device."""
    params = gpt_params(1024, width, layers)
    mesh = make_mesh(len(jax.devices()))
    rows = []
    with jax.set_mesh(mesh):
        for optimizer, (tx, partition) in OPTIMIZERS.items():
            for name, lower in _programs(tx, partition, params, mesh).items():
                compiled = lower().compile()
                memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, list) else cost
                rows.append({"optimizer": optimizer, "variant": name, "temp": memory.temp_size_in_bytes,
                             "argument": memory.argument_size_in_bytes, "alias": memory.alias_size_in_bytes,
                             "accessed": int(cost.get("bytes accessed", 0))})
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
    print(f"mesh-bound contract under jit, same bits as eagerly: {bits_agree(args.layers, args.width)}")
    rows = [r for s in SCHEDULERS for r in _child(s, args.layers, args.width)]
    base = {(r["optimizer"], r["scheduler"]): r for r in rows if r["variant"] == "gspmd(reduced)"}
    fair = {(r["optimizer"], r["scheduler"]): r for r in rows if r["variant"] == "gspmd(reducing)"}
    print("| optimizer | variant | scheduler | temporaries MB | bytes accessed MB | x gspmd(reduced) | "
          "x gspmd(reducing) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        k = (r["optimizer"], r["scheduler"])
        print(f"| {r['optimizer']} | {r['variant']} | {k[1]} | {r['temp'] / 1e6:.2f} | {r['accessed'] / 1e6:.1f} | "
              f"{r['accessed'] / base[k]['accessed']:.2f} | {r['accessed'] / fair[k]['accessed']:.2f} |")


if __name__ == "__main__":
    main()
