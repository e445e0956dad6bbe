"""zero1 on parameters the trainer keeps sharded over the data axis (FSDP), against GSPMD-sharded optax:
`python -m benchmarks.fsdp`.

Per device, from XLA's own accounting of one jitted step, `tx.update` + `optax.apply_updates` (parameters and
state donated, their shardings pinned; 8 simulated CPU devices): temporaries (`memory_analysis()`), bytes accessed
(`cost_analysis()`), collective bytes per kind (`benchmarks.hlo.collective_bytes`, full tensors), and the state's
bytes on one device (`addressable_shards`) against the ideal 1/N of plain optax's state.

* `adamw`: a GPT-like tree (`--layers 6 --width 256`, about 5.0 M parameters), its matrices cut over "data" on
  one dimension or the other (`qkv`, `mlp_in` on their first, `proj`, `mlp_out` on their second), the embedding
  and the vectors replicated, as a trainer's FSDP annotations leave them;
* `muon`: 8 matrices of 512 x 512 cut over "data" on their first dimension, `optax.contrib.muon`, and beside them
  one-device optax Muon on one such matrix (what an owner of one matrix needs).

Variants: `gspmd` (plain optax under `jax.jit`, its state in the parameters' shardings, as GSPMD propagates it),
`zero1` (`zo.zero1(..., mesh=mesh)`, `partition="auto"` for Muon, `"flat"` for AdamW) on an `Auto` axis and, for
AdamW, on an `Explicit` one. Bytes are exact; nothing is timed.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_NUM_CPU_DEVICES", "8")))

import argparse
import json
from typing import Any

import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.hlo import KINDS, collective_bytes
from tests._models import gpt_params

_ROWS, _COLUMNS = ("qkv", "mlp_in"), ("proj", "mlp_out")


def fsdp_spec(path: tuple[Any, ...], x: jax.Array, n: int) -> P:
    """A trainer's FSDP annotation: matrices of the layers cut over "data" on one dimension (where it divides)."""
    name = str(getattr(path[-1], "key", path[-1]))
    if x.ndim != 2 or name == "embed":
        return P()
    dim = 0 if name in _ROWS or name not in _COLUMNS else 1
    if x.shape[dim] % n:
        return P()
    return P("data", None) if dim == 0 else P(None, "data")


def _mesh(n: int, axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:n])


def _state_bytes(state: Any) -> int:
    """Bytes of `state` on the first device."""
    first = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == first)


def _step(tx: optax.GradientTransformation):
    def step(p: Any, g: Any, s: Any) -> Any:
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step


def _measure(tx: optax.GradientTransformation, params: Any, specs: Any, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """One variant's compiled step and state, per device."""
    with jax.set_mesh(mesh):
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        p = jax.device_put(params, shardings)
        state = tx.init(p)
        pinned = (shardings, jax.tree.map(lambda x: x.sharding, state))
        compiled = jax.jit(_step(tx), donate_argnums=(0, 2), out_shardings=pinned).lower(p, p, state).compile()
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    wire = collective_bytes(compiled)
    return {"temp": memory.temp_size_in_bytes, "accessed": int(cost.get("bytes accessed", 0)),
            "collectives": sum(wire.values()), **{k: wire[k] for k in KINDS}, "state": _state_bytes(state)}


def _one_device(tx: optax.GradientTransformation, x: jax.Array) -> int:
    """Temporaries of one-device optax on the single leaf `x`."""
    x = jax.device_put(x, jax.devices()[0])
    state = tx.init(x)
    return jax.jit(_step(tx), donate_argnums=(0, 2)).lower(x, x, state).compile().memory_analysis().temp_size_in_bytes


def cases(layers: int, width: int, n: int) -> list[dict[str, Any]]:
    """Every row of the table."""
    gpt = gpt_params(1024, width, layers)
    matrices = {f"m{i}": 0.02 * jax.random.normal(jax.random.PRNGKey(i), (512, 512)) for i in range(8)}
    rows = []
    for name, params, inner, partition in (("adamw", gpt, optax.adamw(1e-3), "flat"),
                                           ("muon", matrices, optax.contrib.muon(1e-3), "auto")):
        specs = jax.tree_util.tree_map_with_path(lambda path, x: fsdp_spec(path, x, n), params)
        ideal = sum(x.nbytes for x in jax.tree.leaves(inner.init(params))) / n
        auto, explicit = _mesh(n, AxisType.Auto), _mesh(n, AxisType.Explicit)
        variants = [("gspmd", inner, auto),
                    ("zero1 (Auto axis)", zo.zero1(inner, axis_name="data", mesh=auto, partition=partition), auto)]
        if name == "adamw":  # (GSPMD's Muon on an Explicit axis refuses x @ x.T of a cut matrix)
            variants.append(("zero1 (Explicit axis)", zo.zero1(inner, axis_name="data", mesh=explicit,
                                                                partition=partition), explicit))
        for variant, tx, mesh in variants:
            rows.append({"optimizer": name, "variant": variant, "ideal_state": ideal, "parameters": sum(
                x.nbytes for x in jax.tree.leaves(params)), **_measure(tx, params, specs, mesh)})
        if name == "muon":
            rows.append({"optimizer": name, "variant": "one-device optax, one matrix",
                         "temp": _one_device(inner, matrices["m0"])})
    return rows


def _mb(x: Any) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    out = ["| optimizer | variant | temporaries MB | bytes accessed MB | collectives MB | all-gather | all-reduce | "
           "reduce-scatter | all-to-all | state MB/device | x ideal |", "|---" * 11 + "|"]
    for r in rows:
        ratio = f"{r['state'] / r['ideal_state']:.3f}" if "state" in r else "-"
        out.append(f"| {r['optimizer']} | {r['variant']} | {_mb(r['temp'])} | {_mb(r.get('accessed'))} | "
                   f"{_mb(r.get('collectives'))} | {_mb(r.get('all-gather'))} | {_mb(r.get('all-reduce'))} | "
                   f"{_mb(r.get('reduce-scatter'))} | {_mb(r.get('all-to-all'))} | {_mb(r.get('state'))} | {ratio} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    rows = cases(args.layers, args.width, len(jax.devices()))
    print(json.dumps(rows, default=lambda x: float(np.asarray(x))) if args.json else table(rows))


if __name__ == "__main__":
    main()
