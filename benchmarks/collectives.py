"""Exact memory and communication of zero1 steps: `python -m benchmarks.collectives [--section ...]`.

Everything here is counted, not timed, so it is deterministic: state bytes per device from the arrays'
`addressable_shards`, collective bytes and op counts from the compiled HLO (`zero_optax/core/_hlo.py`). Sections:

* `precision`: AdamW with float32 master copies of bf16 parameters (flat partition, 8 devices): state + master
  bytes per device against 12 B x params / N, and the wire volume of a step (reduce-scatter of the gradients in
  the reduction dtype + all-gather of the bf16 parameters) against plain data parallelism all-reducing in the same
  dtype, with `reduce_dtype` float32 and bf16; beside a replicated float32-master baseline.
* `jit`: a mesh-bound zero1 under plain `jax.jit` (gradients from `jax.grad` of a global loss, so XLA decides
  their reduction) against the same step written in `shard_map` with `zo.as_local`.
* `mesh2d`: a tensor-parallel GPT on a (data=4, model=2) mesh: per-device state against full / (data x model), and
  the step's wire volume per mesh axis.
* `mesh2d_owned`: the same GPT with the Muon recipe under `partition="auto"`: the hidden matrices owned whole
  although sharded over `model` (their owner gathers the blocks over `model`), per-device state and the wire per
  mesh axis.
* `buckets`: an 86-leaf, single-dtype tree: collective ops per step and wire volume for several `bucket_bytes`,
  and agreement with the unbucketed step.
* `quantize`: `zo.Quantize(params="int8", grads="int8", block_size=256)` (issue 33) on the GPT tree with float32
  master copies: the step's collective bytes against the same step unquantized, float32 and bf16 parameters
  (8 devices), and per mesh axis on `(replica=2, data=4)` with `replica_axis`, quantizing every axis or only
  `replica`.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_NUM_CPU_DEVICES", "8")))

import argparse
import sys
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.memory import max_state_bytes
from benchmarks.model import gpt_params, param_count, tensor_parallel_specs, tree_bytes
from tests._models import bucket_tree
from benchmarks.hlo import WIRE_WEIGHTS, collective_ops

N = 8


def _ops(compiled) -> list[dict[str, Any]]:
    return collective_ops(compiled.as_text())


def _wire(ops) -> float:
    return sum(WIRE_WEIGHTS[o["kind"]] * o["bytes"] * o["multiplier"] for o in ops)


def _by_kind(ops) -> str:
    kinds: dict[str, list[int]] = {}
    for o in ops:
        k = kinds.setdefault(o["kind"], [0, 0])
        k[0] += o["multiplier"]
        k[1] += o["bytes"] * o["multiplier"]
    return ", ".join(f"{k} x{c} ({b / 2**20:.2f} MB)" for k, (c, b) in sorted(kinds.items()))


def _mesh(n: int = N):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _per_device_grads(params, mesh, axis="data"):
    n = mesh.shape[axis]
    return jax.device_put(jax.tree.map(lambda x: jnp.full((n, *x.shape), 1e-3, x.dtype), params),
                          NamedSharding(mesh, P(axis)))


def _zero1_step(tx, mesh, params):
    """The shard_map'ed zero1 step on per-device gradients, compiled; and its initial state."""
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))))
    return init, step


def _dp_step(tx, mesh, params, reduce_dtype=None, master=False):
    """Plain data parallelism: pmean of the gradient (in `reduce_dtype`), the whole optimizer on every device."""
    def step(p, s, g):
        g = jax.tree.map(lambda x: x[0], g)
        g = jax.tree.map(lambda x: jax.lax.pmean(x.astype(reduce_dtype or x.dtype), "data"), g)
        if master:  # replicated float32 master copy kept beside the bf16 parameters
            m, s = s
            u, s = tx.update(g, s, m)
            m = optax.apply_updates(m, u)
            return jax.tree.map(lambda x, y: y.astype(x.dtype), p, m), (m, s)
        u, s = tx.update(jax.tree.map(lambda x, q: x.astype(q.dtype), g, p), s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())))


def section_precision() -> str:
    mesh = _mesh()
    params32 = gpt_params(2048, 256, 4)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
    count = param_count(params)
    grads = _per_device_grads(params, mesh)
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    rows, dp = [], {}
    for rd in (jnp.float32, jnp.bfloat16):
        name = np.dtype(rd).name
        tx = optax.adamw(1e-3)
        m32 = jax.device_put(params32, NamedSharding(mesh, P()))
        state = jax.device_put(tx.init(params32), NamedSharding(mesh, P()))
        lowered = _dp_step(tx, mesh, params, reduce_dtype=rd, master=True).lower(placed, (m32, state), grads)
        ops = (collective_ops(lowered.as_text(dialect="hlo")), _ops(lowered.compile()))
        dp[name] = tuple(_wire(o) for o in ops)
        rows.append(("replicated f32 master (plain DP)", name, max_state_bytes((m32, state)), ops))
    for rd in (None, jnp.bfloat16):
        name = "float32" if rd is None else "bfloat16"
        tx = zo.zero1(optax.adamw(1e-3), axis_name="data", master_dtype=jnp.float32, reduce_dtype=rd)
        init, step = _zero1_step(tx, mesh, params)
        state = init(jax.device_put(params32, NamedSharding(mesh, P())))
        lowered = step.lower(placed, state, grads)
        ops = (collective_ops(lowered.as_text(dialect="hlo")), _ops(lowered.compile()))
        rows.append(("zero1 flat, master_dtype=float32", name, max_state_bytes(state), ops))
    lines = [("| variant | gradient sum dtype | state + master MB/device | x (12 B x P / N) | collectives as emitted | "
              "wire MB | x plain DP | wire MB as XLA:CPU compiles it | x plain DP |"),
             "|---|---|---|---|---|---|---|---|---|"]
    counts = 4  # the step count: one int32 per device
    for variant, name, per_device, (program, compiled) in rows:
        w_p, w_c = _wire(program), _wire(compiled)
        lines.append(f"| {variant} | {name} | {per_device / 2**20:.2f} | {(per_device - counts) / (12 * count / N):.4f} "
                     f"| {_by_kind(program)} | {w_p / 2**20:.2f} | {w_p / dp[name][0]:.3f} | {w_c / 2**20:.2f} | "
                     f"{w_c / dp[name][1]:.3f} |")
    return (f"GPT-shaped tree (vocab 2048, d_model 256, 4 layers): {count:,} bf16 parameters, {N} devices. \"As "
            "emitted\" counts the program's collectives before XLA optimises it; XLA:CPU then performs bf16 "
            "collectives in float32 (it upcasts them), which the last two columns show.\n\n" + "\n".join(lines))


def _loss(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def section_jit() -> str:
    mesh = _mesh()
    d, h = 256, 1024
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(d, h)) * 0.02, jnp.float32), "b1": jnp.zeros(h),
              "w2": jnp.asarray(rng.normal(size=(h, d)) * 0.02, jnp.float32)}
    pbytes = tree_bytes(params)
    x = jax.device_put(jnp.asarray(rng.normal(size=(N * 16, d)), jnp.float32), NamedSharding(mesh, P("data")))
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    rows = []

    bound = zo.zero1(optax.adamw(1e-3), axis_name="data", mesh=mesh)

    @jax.jit
    def jit_step(p, s, x):
        g = jax.grad(_loss)(p, x)
        u, s = bound.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = bound.init(placed)
    ops = _ops(jit_step.lower(placed, state, x).compile())
    rows.append(("mesh-bound zero1 under jax.jit (jax.grad of the global loss)", ops))

    plain = zo.zero1(optax.adamw(1e-3), axis_name="data")
    init = jax.jit(jax.shard_map(plain.init, mesh=mesh, in_specs=P(), out_specs=P("data")))

    def sm_step(p, s, x):
        g = jax.grad(_loss)(zo.as_local(p, "data"), x)
        u, s = plain.update(g, s, p)
        return optax.apply_updates(p, u), s

    sm = jax.jit(jax.shard_map(sm_step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))))
    ops = _ops(sm.lower(placed, init(placed), x).compile())
    rows.append(("zero1 in shard_map, grad w.r.t. zo.as_local(params)", ops))

    @jax.jit
    def dp_step(p, s, x):
        g = jax.grad(_loss)(p, x)
        u, s = optax.adamw(1e-3).update(g, s, p)
        return optax.apply_updates(p, u), s

    ops = _ops(dp_step.lower(placed, jax.device_put(optax.adamw(1e-3).init(params), NamedSharding(mesh, P())),
                             x).compile())
    rows.append(("plain optax under jax.jit (replicated state)", ops))
    lines = ["| step | collectives in the compiled step | wire (x parameter bytes) |", "|---|---|---|"]
    lines += [f"| {name} | {_by_kind(ops)} | {_wire(ops) / pbytes:.2f} |" for name, ops in rows]
    return (f"An MLP ({param_count(params):,} float32 parameters), a global batch sharded over {N} devices, AdamW; "
            f"JAX {jax.__version__} on {jax.devices()[0].platform}.\n\n" + "\n".join(lines))


def _axes_of(group: list[int], mesh) -> tuple[str, ...]:
    coords = {int(d.id): idx for idx, d in np.ndenumerate(mesh.devices)}
    pts = np.array([coords[g] for g in group])
    return tuple(a for k, a in enumerate(mesh.axis_names) if len(set(pts[:, k])) > 1)


def _tp_step_ops(tx, mesh, specs, placed, state, state_specs) -> list[dict[str, Any]]:
    """The collectives of `tx`'s shard_map step (update + apply) on `mesh`, per-device gradients over `data`."""
    g_specs = jax.tree.map(lambda s: P("data", *s), specs)
    grads = jax.tree.map(lambda x, s: jax.device_put(jnp.full((4, *x.shape), 1e-3), NamedSharding(mesh, s)),
                         placed, g_specs)

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, state_specs, g_specs),
                                 out_specs=(specs, state_specs)))
    return _ops(step.lower(placed, state, grads).compile())


def section_mesh2d() -> str:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params = gpt_params(2048, 256, 4)
    specs = tensor_parallel_specs(params)
    tx = zo.zero1(optax.adamw(1e-3), axis_name="data")
    state_specs = zo.state_specs(tx, params, specs, mesh=mesh)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs))(placed)
    full = tree_bytes(jax.eval_shape(optax.adamw(1e-3).init, params))
    ops = _tp_step_ops(tx, mesh, specs, placed, state, state_specs)
    block_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(placed))
    per_device = max_state_bytes(state)
    axis_text = ", ".join(f"{'+'.join(a) or 'none'}: {b / block_bytes:.2f}"
                          for a, b in sorted(_wire_per_axis(ops, mesh).items()))
    return (f"Tensor-parallel GPT (vocab 2048, d_model 256, 4 layers; column-parallel qkv/mlp_in/embedding, "
            f"row-parallel proj/mlp_out), {param_count(params):,} float32 parameters, mesh (data=4, model=2), "
            "AdamW, flat partition.\n\n"
            "| figure | value |\n|---|---|\n"
            f"| state MB per device | {per_device / 2**20:.3f} |\n"
            f"| ideal: full state / (data x model) | {full / 8 / 2**20:.3f} |\n"
            f"| x ideal | {per_device / (full / 8):.4f} |\n"
            f"| collectives per step | {_by_kind(ops)} |\n"
            f"| wire per mesh axis (x this device's parameter block bytes) | {axis_text} |")


def _muon_recipe(params):
    """Muon for the hidden matrices, AdamW for the embedding and the vectors."""
    labels = jax.tree_util.tree_map_with_path(
        lambda path, x: "muon" if x.ndim == 2 and "embed" not in jax.tree_util.keystr(path) else "adam", params)
    return optax.partition({"muon": optax.contrib.muon(1e-3), "adam": optax.adamw(1e-3)}, labels)


def _wire_per_axis(ops, mesh) -> dict[tuple[str, ...], float]:
    """Wire bytes per device of the collectives `ops`, by the mesh axes their groups span (no `replica_groups`:
    one group of every device, so every axis)."""
    per_axis: dict[tuple[str, ...], float] = {}
    for o in ops:
        axes = _axes_of(o["replica_groups"][0], mesh) if o["replica_groups"] else tuple(mesh.axis_names)
        per_axis[axes] = per_axis.get(axes, 0.0) + WIRE_WEIGHTS[o["kind"]] * o["bytes"] * o["multiplier"]
    return per_axis


def section_mesh2d_owned() -> str:
    """`partition="auto"` with the Muon recipe on the tensor-parallel GPT: the matrices owned whole though sharded
    over `model` (issue 31), the embedding and vectors sliced; wire per mesh axis."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params = gpt_params(2048, 256, 4)
    specs = tensor_parallel_specs(params)
    tx = zo.zero1(_muon_recipe(params), axis_name="data", partition="auto", param_specs=specs)
    state_specs = zo.state_specs(tx, params, specs, mesh=mesh)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs))(placed)
    ops = _tp_step_ops(tx, mesh, specs, placed, state, state_specs)
    layout = zo.describe(state)
    tp = [leaf for leaf in layout.leaves if leaf.dims]
    block_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(placed))
    tp_bytes = sum(leaf.size * 4 for leaf in tp)  # (float32 blocks of the owned tensor-parallel matrices)
    share = max(sum(leaf.size * 4 for leaf in tp if leaf.owner == r) for r in range(layout.world_size))
    axis_text = ", ".join(f"{'+'.join(a) or 'none'}: {b / 2**20:.3f} MB ({b / block_bytes:.2f} x)"
                          for a, b in sorted(_wire_per_axis(ops, mesh).items()))
    full = tree_bytes(jax.eval_shape(_muon_recipe(params).init, params))
    return (f"Tensor-parallel GPT as in `mesh2d` ({param_count(params):,} float32 parameters), mesh (data=4, "
            f"model=2), Muon on the {len(tp)} hidden matrices (owned, sharded over `model`: the owner gathers "
            "them whole), AdamW on the embedding and vectors (sliced), partition=\"auto\", shard_map step.\n\n"
            "| figure | value |\n|---|---|\n"
            f"| state MB per device (max) | {max_state_bytes(state) / 2**20:.3f} |\n"
            f"| full state / data; full state / (data x model) | {full / 4 / 2**20:.3f}; {full / 8 / 2**20:.3f} |\n"
            f"| collectives per step | {_by_kind(ops)} |\n"
            f"| wire per mesh axis (MB per device; x this device's parameter block bytes) | {axis_text} |\n"
            f"| owned tensor-parallel blocks on this device: all; the busiest owner's share | "
            f"{tp_bytes / 2**20:.3f} MB; {share / 2**20:.3f} MB |\n"
            f"| expected on `model`: gradient + parameter rows, (model - 1) x 2 x that share | "
            f"{2 * share / 2**20:.3f} MB |")


def section_buckets() -> str:
    mesh = _mesh()
    params = bucket_tree()
    leaves = len(jax.tree.leaves(params))
    pbytes = tree_bytes(params)
    grads = _per_device_grads(params, mesh)
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    default = zo.zero1(optax.adamw(1e-3), axis_name="data")
    from zero_optax.step._wire import DEFAULT_BUCKET_BYTES

    settings = [("per leaf", 0), ("1 MiB", 1 << 20), ("4 MiB", 4 << 20), ("16 MiB", 16 << 20),
                (f"default ({DEFAULT_BUCKET_BYTES >> 20} MiB)", DEFAULT_BUCKET_BYTES)]
    lines = [("| bucket_bytes | collective ops per step | bound 2 x ceil(bytes / bucket_bytes) | wire (x P) | "
              "max abs diff vs per-leaf |"), "|---|---|---|---|---|"]
    reference = None
    del default
    for name, bb in settings:
        tx = zo.zero1(optax.adamw(1e-3), axis_name="data", bucket_bytes=bb)
        init, step = _zero1_step(tx, mesh, params)
        state = init(placed)
        compiled = step.lower(placed, state, grads).compile()
        ops = _ops(compiled)
        count = sum(o["multiplier"] for o in ops)
        out = jax.device_get(compiled(placed, state, grads)[0])
        if reference is None:
            reference = out
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference)))
        bound = "-" if bb == 0 else str(2 * -(-pbytes // bb))
        lines.append(f"| {name} | {count} | {bound} | {_wire(ops) / pbytes:.2f} | {diff:.1e} |")
    return f"{leaves} float32 leaves, {pbytes / 2**20:.1f} MB, AdamW, {N} devices.\n\n" + "\n".join(lines)


def _apply_step(tx, mesh, params, names):
    """`zo.apply_gradients` of `tx` in shard_map over `mesh` on per-device gradients over `names`, lowered."""
    specs = zo.state_specs(tx, params, P(), mesh=mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    n = mesh.devices.size

    def step(p, s, g):
        return zo.apply_gradients(tx, jax.tree.map(lambda x: x[0], g), s, p)

    grads = jax.device_put(jax.tree.map(lambda x: jnp.full((n, *x.shape), 1e-3, x.dtype), params),
                           NamedSharding(mesh, P(names)))
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(names)), out_specs=(P(), specs))).lower(
        jax.device_put(params, NamedSharding(mesh, P())), state, grads)


def section_quantize() -> str:
    params32 = gpt_params(2048, 256, 8)
    both = zo.Quantize(params="int8", grads="int8", block_size=256)
    lines = ["| parameters | quantize | collectives (compiled) | wire MB | x unquantized | as emitted: wire MB | x |",
             "|---|---|---|---|---|---|---|"]
    for pdt in (jnp.float32, jnp.bfloat16):
        params = jax.tree.map(lambda x: x.astype(pdt), params32)
        base = None
        for label, q in (("none", None), ("params", zo.Quantize(params="int8")), ("grads", zo.Quantize(grads="int8")),
                         ("params + grads", both)):
            rd = None if pdt == jnp.float32 else jnp.bfloat16  # bf16: gradients summed in bf16 when exact
            tx = zo.zero1(optax.adamw(1e-3), axis_name="data", master_dtype=jnp.float32, reduce_dtype=rd,
                          quantize=q)
            lowered = _apply_step(tx, _mesh(), params, "data")
            ops = [o for o in _ops(lowered.compile()) if o["kind"] != "all-reduce"]
            emitted = [o for o in collective_ops(lowered.as_text(dialect="hlo")) if o["kind"] != "all-reduce"]
            w, e = _wire(ops), _wire(emitted)
            base = base or (w, e)
            lines.append(f"| {np.dtype(pdt).name} | {label} | {_by_kind(ops)} | {w / 2**20:.2f} | {w / base[0]:.3f} | "
                         f"{e / 2**20:.2f} | {e / base[1]:.3f} |")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("replica", "data"))
    pbytes = tree_bytes(params32)
    axis_lines = ["| quantize | over data (x params) | over replica (x params) |", "|---|---|---|"]
    for label, q in (("none", None), ("params + grads, every axis", both),
                     ("params + grads, axes=(\"replica\",)", zo.Quantize(params="int8", grads="int8",
                                                                         axes=("replica",)))):
        tx = zo.zero1(optax.adamw(1e-3), axis_name="data", replica_axis="replica", master_dtype=jnp.float32,
                      quantize=q)
        per = _wire_per_axis(_ops(_apply_step(tx, mesh, params32, ("replica", "data")).compile()), mesh)
        data, replica = per.get(("data",), 0) / pbytes, per.get(("replica",), 0) / pbytes
        axis_lines.append(f"| {label} | {data:.3f} | {replica:.3f} |")
    return (f"GPT tree (vocab 2048, d_model 256, 8 layers): {param_count(params32):,} parameters, float32 master "
            f"copies, `zo.apply_gradients` in `shard_map`, {N} devices, block_size 256. All-reduces (the skipped-"
            "step and weight scalars) left out; \"as emitted\" counts the program before XLA:CPU upcasts bf16 "
            "collectives to float32.\n\n" + "\n".join(lines) +
            "\n\nPer mesh axis on (replica=2, data=4), float32 (`replica_axis=\"replica\"`; all-reduces included):\n\n"
            + "\n".join(axis_lines))


SECTIONS = {"precision": section_precision, "jit": section_jit, "mesh2d": section_mesh2d,
            "mesh2d_owned": section_mesh2d_owned, "buckets": section_buckets, "quantize": section_quantize}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args(argv)
    for name in args.section:
        print(f"### {name}\n\n{SECTIONS[name]()}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
