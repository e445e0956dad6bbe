"""The peak of the whole training step, per device: `python -m benchmarks.step_peak [--out PNG]`.

One jitted step (loss, gradient, AdamW update, new parameters; parameters and optimizer state donated; the global
batch sharded over "data"; 8 simulated CPU devices) for two models:

* `demo`: the demo's character transformer (`zero_optax.demo.CharLM` at its defaults, its `loss_fn` and batch), its
  NNX parameters split off as a plain dict and merged back inside the loss;
* `gpt`: the GPT-like tree of `tests._models.gpt_params(1024, 256, 12)`, with a small GPT forward written here over
  those parameters (token embedding tied to the output head, pre-norm blocks with 4-head causal attention and a GELU
  MLP): every leaf is used, so every leaf has a gradient.

Variants, each checked once against `plain` (the new parameters after one step, to 1e-5):

* `plain`: plain optax data parallel: parameters and AdamW state replicated, GSPMD inserts the gradient all-reduce;
* `gspmd`: MaxText-style ZeRO-1: the state sharded over "data" (`benchmarks.variants.gspmd_state_specs`);
* `zero1 bound`: `zo.zero1(adamw, axis_name="data", mesh=mesh)` under `jax.jit`, `tx.update` + `optax.apply_updates`;
* `zero1 sm contract` / `zero1 sm apply`: zero1 inside `jax.shard_map`, each device's own gradient (`zo.as_local`),
  then `tx.update` + `optax.apply_updates`, or `zo.apply_gradients`.

Figures are XLA's `compiled.memory_analysis()` per device (exact bytes; nothing is timed): argument, output,
temporary, aliased (outputs written into donated arguments) and generated code. `peak` is argument + output + temp
- alias: everything the step holds at once if nothing is freed early, the usual upper bound. `B/param` is peak over
the parameter count, against plain data parallelism's 16 (fp32 parameters, gradient, two moments) and the ZeRO-1
bound 4 + 12/N (fp32 parameters replicated, gradient and moments split N ways; 5.5 at N=8), before activations.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_NUM_CPU_DEVICES", "8")))

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.variants import gspmd_state_specs, make_mesh
from tests._models import gpt_params

FIELDS = ("argument", "output", "temp", "alias", "code")
VARIANTS = ("plain", "gspmd", "zero1 bound", "zero1 sm contract", "zero1 sm apply")
GPT_BATCH, GPT_SEQ, GPT_HEADS = 16, 64, 4
TOLERANCE = 1e-5
TINY = 1e-7  # 10 x AdamW's eps: where |g| is this small, its first step g / (|g| + eps) turns on the rounding of g


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """Layer norm over the last axis with `p`'s scale and bias."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _gpt_block(x: jax.Array, layer: dict[str, Any]) -> jax.Array:
    """One pre-norm block of the GPT-like tree: causal self-attention, then the MLP, each with a residual."""
    b, t, d = x.shape
    attn, mlp = layer["attn"], layer["mlp"]
    qkv = _layer_norm(x, layer["ln1"]) @ attn["qkv"] + attn["qkv_bias"]
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * GPT_HEADS, d // GPT_HEADS), 3, axis=2)
    x = x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d) @ attn["proj"] + attn["proj_bias"]
    h = jax.nn.gelu(_layer_norm(x, layer["ln2"]) @ mlp["mlp_in"] + mlp["mlp_in_bias"])
    return x + h @ mlp["mlp_out"] + mlp["mlp_out_bias"]


def gpt_loss(params: dict[str, Any], ids: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of the GPT-like tree on `ids` (batch, seq + 1); the head tied to the embedding."""
    embed = params["embed"]
    x = jax.nn.one_hot(ids[:, :-1], embed.shape[0]) @ embed
    for i in range(len(params["layers"])):
        x = _gpt_block(x, params["layers"][f"layer_{i}"])
    logits = _layer_norm(x, params["ln_f"]) @ embed.T
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(ids[:, 1:], embed.shape[0])).mean()


def demo_model() -> tuple[Callable[..., jax.Array], Any, tuple[np.ndarray, ...]]:
    """The demo's transformer: a loss over its parameters as a plain dict, the parameters, and step 0's batch."""
    from flax import nnx

    from zero_optax import demo

    text = demo.Text.load()
    graph, state = nnx.split(demo.CharLM(len(text.alphabet), rngs=nnx.Rngs(0)), nnx.Param)

    def loss(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        return demo.loss_fn(nnx.merge(graph, params), inputs, targets)

    return loss, nnx.to_pure_dict(state), text.batch(0)


def gpt_model() -> tuple[Callable[..., jax.Array], Any, tuple[np.ndarray, ...]]:
    """The GPT-like tree (12 blocks, width 256, vocabulary 1024): its loss, parameters and a random batch."""
    ids = np.random.default_rng(0).integers(0, 1024, (GPT_BATCH, GPT_SEQ + 1), dtype=np.int32)
    return gpt_loss, gpt_params(1024, 256, 12), (ids,)


def _steps(loss: Callable[..., jax.Array], mesh: Any) -> dict[str, Callable[..., Any]]:
    """Each variant's step `(params, state, batch) -> (params, state)`, not yet jitted."""
    tx, btx, ztx = _optimizers(mesh)

    def jitted(t: Any) -> Callable[..., Any]:
        def step(p: Any, s: Any, batch: tuple[Any, ...]) -> Any:
            u, s = t.update(jax.grad(loss)(p, *batch), s, p)
            return optax.apply_updates(p, u), s
        return step

    def local(apply: bool) -> Callable[..., Any]:
        def step(p: Any, s: Any, batch: tuple[Any, ...]) -> Any:
            g = jax.grad(loss)(zo.as_local(p, "data"), *batch)
            if apply:
                return zo.apply_gradients(ztx, g, s, p)
            u, s = ztx.update(g, s, p)
            return optax.apply_updates(p, u), s
        return jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data")))

    return {"plain": jitted(tx), "gspmd": jitted(tx), "zero1 bound": jitted(btx),
            "zero1 sm contract": local(False), "zero1 sm apply": local(True)}


def _optimizers(mesh: Any) -> tuple[optax.GradientTransformation, ...]:
    """Plain AdamW, the mesh-bound zero1 of it, and the zero1 of it for `shard_map`."""
    tx = optax.adamw(1e-3, weight_decay=0.01)
    return tx, zo.zero1(tx, axis_name="data", mesh=mesh), zo.zero1(tx, axis_name="data")


def _inits(params: Any, mesh: Any) -> dict[str, Callable[[Any], Any]]:
    """Each variant's jitted state initializer, the state placed as that variant keeps it."""
    tx, btx, ztx = _optimizers(mesh)
    specs = gspmd_state_specs(tx, params, mesh.shape["data"])
    state_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    local = jax.jit(jax.shard_map(ztx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))
    return {"plain": jax.jit(tx.init, out_shardings=NamedSharding(mesh, P())),
            "gspmd": jax.jit(tx.init, out_shardings=state_sh), "zero1 bound": btx.init,
            "zero1 sm contract": local, "zero1 sm apply": local}


def _agreement(new: Any, reference: Any, grad: Any) -> tuple[float, int, int]:
    """Largest difference from `reference`, coordinates over `TOLERANCE`, and those of them where |grad| >= `TINY`."""
    pairs = [(np.abs(np.asarray(a) - np.asarray(b)), np.abs(np.asarray(g)))
             for a, b, g in zip(jax.tree.leaves(new), jax.tree.leaves(reference), jax.tree.leaves(grad))]
    off = [(d > TOLERANCE, g) for d, g in pairs]
    return (max(float(d.max()) for d, _ in pairs), sum(int(o.sum()) for o, _ in off),
            sum(int((o & (g >= TINY)).sum()) for o, g in off))


def measure(name: str, model: Callable[[], tuple[Any, Any, Any]], mesh: Any) -> list[dict[str, Any]]:
    """One row per variant: the compiled step's memory figures, and how its new parameters differ from `plain`'s."""
    loss, params, batch = model()
    params = jax.device_get(params)  # host copies: each variant's donated arguments are its own
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    batch = tuple(jax.device_put(b, dat) for b in batch)
    grad = jax.device_get(jax.jit(jax.grad(loss))(jax.device_put(params, rep), *batch))
    steps, inits = _steps(loss, mesh), _inits(params, mesh)
    rows, reference = [], None
    for variant in VARIANTS:
        p = jax.device_put(params, rep)
        s = inits[variant](p)
        fn = jax.jit(steps[variant], out_shardings=(rep, None), donate_argnums=(0, 1))
        compiled = fn.lower(p, s, batch).compile()
        m = compiled.memory_analysis()
        new = jax.device_get(compiled(p, s, batch)[0])
        reference = reference or new
        diff, off, unexplained = _agreement(new, reference, grad)
        rows.append({"model": name, "variant": variant, "argument": m.argument_size_in_bytes,
                     "output": m.output_size_in_bytes, "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes,
                     "code": m.generated_code_size_in_bytes, "diff": diff, "off": off, "unexplained": unexplained,
                     "params": sum(x.size for x in jax.tree.leaves(params))})
    return rows


def peak(row: dict[str, Any]) -> int:
    """Argument + output + temp - alias: the step's bytes per device if nothing is freed early."""
    return row["argument"] + row["output"] + row["temp"] - row["alias"]


def table(rows: list[dict[str, Any]], n: int) -> str:
    """The markdown table of one model's rows: MB per device, bytes per parameter, and the check against plain."""
    lines = [f"{rows[0]['model']}: {rows[0]['params']:,} parameters, N={n}, ZeRO-1 bound 4 + 12/N = {4 + 12 / n:.2f}"
             f" B/param, plain DP 16 B/param (before activations)", "",
             "| variant | argument MB | output MB | temp MB | alias MB | code MB | peak MB | peak B/param | "
             "x ZeRO-1 bound | x gspmd | max diff vs plain | coords over 1e-5 (of them with abs(g) >= 1e-7) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    gspmd = next(peak(r) for r in rows if r["variant"] == "gspmd")
    for r in rows:
        mb = " | ".join(f"{r[f] / 1e6:.3f}" for f in FIELDS)
        per = peak(r) / r["params"]
        lines.append(f"| {r['variant']} | {mb} | {peak(r) / 1e6:.3f} | {per:.2f} | {per / (4 + 12 / n):.2f} | "
                     f"{peak(r) / gspmd:.2f} | {r['diff']:.1e} | {r['off']} ({r['unexplained']}) |")
    return "\n".join(lines)


def plot(tables: dict[str, list[dict[str, Any]]], out: Path) -> bool:
    """Grouped bars (argument, output, temp, alias, peak; MB per device) per variant and the ZeRO-1 bound, per model."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fields = (*FIELDS[:4], "peak")
    fig, axes = plt.subplots(1, len(tables), figsize=(7 * len(tables), 4.5))
    for ax, (name, rows) in zip(np.atleast_1d(axes), tables.items()):
        x = np.arange(len(rows))
        for i, f in enumerate(fields):
            ax.bar(x + (i - 2) * 0.16, [(peak(r) if f == "peak" else r[f]) / 1e6 for r in rows], 0.16, label=f)
        bound = (4 + 12 / len(jax.devices())) * rows[0]["params"] / 1e6
        ax.axhline(bound, color="k", ls="--", lw=1, label="ZeRO-1 bound (before activations)")
        ax.set_xticks(x, [r["variant"] for r in rows], rotation=20)
        ax.set_ylabel("MB per device")
        ax.set_title(f"{name} ({rows[0]['params']:,} params)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_peak.png"))
    args = parser.parse_args()
    mesh = make_mesh(len(jax.devices()))
    tables = {}
    with jax.set_mesh(mesh):
        for name, model in (("demo", demo_model), ("gpt", gpt_model)):
            tables[name] = measure(name, model, mesh)
            print(table(tables[name], mesh.shape["data"]) + "\n", flush=True)
    bad = [(r["model"], r["variant"]) for rows in tables.values() for r in rows if r["unexplained"]]
    print(f"every variant's new parameters within {TOLERANCE} of plain optax's, except where |g| < {TINY}: "
          f"{not bad} {bad or ''}")
    print(f"plot: {args.out}" if plot(tables, args.out) else "plot skipped: matplotlib is not importable")


if __name__ == "__main__":
    main()
