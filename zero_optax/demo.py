"""`python -m zero_optax.demo`: train a small language model with ZeRO-1, check it against optax, reshard, resume.

The main job of the package, written to be read top to bottom:

1. A character-level transformer language model (Flax NNX) learns the first chapters of *Pride and Prejudice*,
   which ship with the package, on all devices (8 simulated CPU devices where there is no accelerator).
2. Its optimizer is `zero1(optax.adamw(...), mesh=mesh)` (flat partition) inside an `nnx.Optimizer`, stepped under
   `nnx.jit`; then `zero1(optax.contrib.muon(...), partition="leaf")`. Next to it, the same model trains with the
   plain optax optimizer on the same batches, and after every step the parameters of the two must agree to float32
   rounding.
3. A table compares the optimizer-state bytes each device holds (read from the arrays' `addressable_shards`, and
   checked against what `zero_optax.describe` reports) with replicated optax, before and after resharding.
4. Half-way, the run is saved with an Orbax `CheckpointManager` (`StandardSave` for the parameters, `ZeroSave` for
   the optimizer state), restored onto half the devices with `ZeroRestore(target, reshard=True)`, and resumed
   there; every resumed step is checked against the plain optax run, which never stopped.
5. The loss curves of the resumed and the uninterrupted run go to `loss_curves.png` in the output folder.

The exit status is 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

import zero_optax as zo
from zero_optax import _quantized_demo

if TYPE_CHECKING:
    Device = Any  # `jax.Device`, which type checkers cannot read as a class (jaxlib ships no type stubs)
else:
    Device = jax.Device

SIMULATED_DEVICES = 8
SEQ_LEN = 64
BATCH = 16  # sequences per step, split over the devices (divisible by 8 and 4)
DIM, HEADS, LAYERS = 48, 4, 2


# --------------------------------------------------------------------------------------------------- devices


def simulate_cpu_devices(count: int) -> None:
    """Asks XLA for `count` CPU devices; only effective before the backend starts (the first device query).

    Accelerators are unaffected (the setting concerns the CPU backend); where the backend has already started
    (for example in a test session that set it first) the current count stays.
    """
    with contextlib.suppress(Exception):  # the backend is up: keep what it has
        jax.config.update("jax_num_cpu_devices", count)


def pick_devices(count: int | None) -> list[Device]:
    """`count` devices (default: all) of the default backend, or simulated CPU devices where it has fewer than 2."""
    devices = jax.devices()
    if len(devices) < 2:
        devices = jax.devices("cpu")
    count = len(devices) if count is None else count
    if count < 2 or count % 2 or count > len(devices) or BATCH % count:
        raise SystemExit(f"--devices must be even, between 2 and {len(devices)}, and divide {BATCH}; got {count}.")
    return devices[:count]


def data_mesh(devices: Sequence[Device], model: int = 1) -> jax.sharding.Mesh:
    """A 1-D "data" mesh over `devices`, or with `model > 1` a (data, model) mesh whose "model" axis is `Auto`:
    XLA then places the tensor-parallel matrix products (under `Explicit` axes a row-parallel product would need
    an explicit `out_sharding`)."""
    if model == 1:
        return jax.make_mesh((len(devices),), ("data",), devices=devices)
    types = (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto)
    return jax.make_mesh((len(devices) // model, model), ("data", "model"), devices=devices, axis_types=types)


def parse_mesh(text: str | None) -> tuple[int | None, int]:
    """`--mesh data=4,model=2` as (devices, model size); `(None, 1)` without it (a 1-D mesh of all devices)."""
    if text is None:
        return None, 1
    sizes = {key: value for key, _, value in (item.partition("=") for item in text.split(","))}
    if set(sizes) != {"data", "model"} or not all(v.isdigit() and int(v) >= 1 for v in sizes.values()):
        raise SystemExit(f"--mesh must look like data=4,model=2; got {text!r}.")
    data, model = int(sizes["data"]), int(sizes["model"])
    if data % 2:
        raise SystemExit(f"--mesh: the data size must be even (the run resumes on half of it); got {data}.")
    return data * model, model


# ------------------------------------------------------------------------------------------------------ data


@dataclasses.dataclass(frozen=True)
class Text:
    """A text as integer character ids, and the alphabet that maps them back."""

    ids: np.ndarray
    alphabet: str

    @classmethod
    def load(cls) -> Text:
        raw = resources.files("zero_optax").joinpath("data/pride_and_prejudice.txt").read_text(encoding="utf-8")
        alphabet = "".join(sorted(set(raw)))
        lookup = {c: i for i, c in enumerate(alphabet)}
        return cls(np.array([lookup[c] for c in raw], np.int32), alphabet)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The global batch of `step`: `BATCH` random windows of the text, inputs and next-character targets."""
        starts = np.random.default_rng(step).integers(0, len(self.ids) - SEQ_LEN - 1, size=BATCH)
        windows = np.stack([self.ids[s:s + SEQ_LEN + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------------------------------- model


class Block(nnx.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.attn_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class CharLM(nnx.Module):
    """A character-level transformer language model: embeddings, `LAYERS` blocks, a final norm and a head."""

    def __init__(self, vocab: int, *, rngs: nnx.Rngs):
        self.vocab = vocab
        self.embed = nnx.Linear(vocab, DIM, use_bias=False, rngs=rngs)  # applied to one-hot characters
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, DIM)))
        self.blocks = nnx.List([Block(DIM, HEADS, rngs=rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, vocab, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        # A one-hot product rather than a gather: it shards with the batch under the mesh's explicit axes.
        x = self.embed(jax.nn.one_hot(ids, self.vocab)) + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model: CharLM, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy over the global batch (so `jax.grad` gives the global mean gradient)."""
    # One-hot targets rather than an integer-label gather: its gradient shards with the batch on every JAX release
    # (under Explicit mesh axes JAX >= 0.12 refuses the gather's scatter gradient without an `out_sharding`).
    logits = model(inputs)
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(targets, logits.shape[-1])).mean()


@nnx.jit
def train_step(model: CharLM, optimizer: nnx.Optimizer, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """One step, the same for zero1 and for plain optax: nothing in it knows the optimizer state is sharded."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
    optimizer.update(model, grads)
    return loss


def place(node: nnx.Module | nnx.Optimizer, mesh: jax.sharding.Mesh) -> None:
    """Moves every array of a model or optimizer that is not yet on `mesh` there, replicated; in place.

    Parameters must be replicated over the data axis. Arrays already on `mesh` (a zero1 state, sharded over
    "data") stay as they are. Counters that Flax and optax create off the mesh (`nnx.Optimizer.step`, optax's
    `count`) would otherwise change type after the first step and make `nnx.jit` compile the step twice.
    """
    def onto_mesh(x: jax.Array) -> jax.Array:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return x
        return jax.device_put(x, NamedSharding(mesh, P()))

    nnx.update(node, jax.tree.map(onto_mesh, nnx.state(node)))


TENSOR_PARALLEL = {"qkv": P(None, "model"), "up": P(None, "model"), "out": P("model", None), "down": P("model", None)}
"""Megatron-style specs of the blocks' matrices on a mesh with a "model" axis: qkv and up column-parallel, out and
down row-parallel (`--mesh`); everything else replicated."""


def new_model(vocab: int, mesh: jax.sharding.Mesh, tensor_parallel: bool = False) -> CharLM:
    """The model with its parameters replicated over `mesh` (the same initial values every time: seed 0), or with
    `tensor_parallel` its blocks' matrices sharded over "model" (`TENSOR_PARALLEL`)."""
    model = CharLM(vocab, rngs=nnx.Rngs(0))
    place(model, mesh)
    if tensor_parallel:
        def shard(path, x):
            names = {getattr(k, "key", None) for k in path}
            spec = next((s for name, s in TENSOR_PARALLEL.items() if name in names), None)
            return x if spec is None or x.ndim != 2 else jax.device_put(x, NamedSharding(mesh, spec))
        nnx.update(model, jax.tree_util.tree_map_with_path(shard, nnx.state(model, nnx.Param)))
    return model


def new_optimizer(model: CharLM, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh) -> nnx.Optimizer:
    """`nnx.Optimizer(model, tx, wrt=nnx.Param)`, with its step counter (and optax's counts) on `mesh`."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    place(optimizer, mesh)
    return optimizer


# ---------------------------------------------------------------------------------------------------- checks


def parameter_difference(model: CharLM, reference: CharLM) -> tuple[float, float]:
    """max |zero1 - optax| over all parameters, and the largest |optax| parameter (on the host)."""
    ours, theirs = (jax.tree.leaves(jax.device_get(nnx.as_pure(nnx.state(m, nnx.Param)))) for m in (model, reference))
    return (max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs)),
            max(float(np.max(np.abs(b))) for b in theirs))


def bytes_per_device(tree) -> dict[Device, int]:
    """What each device really stores of `tree`: the sizes of its arrays' addressable shards."""
    per_device: dict[Device, int] = {}
    for array in jax.tree.leaves(tree):
        for shard in array.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device


@dataclasses.dataclass
class Memory:
    """Optimizer-state bytes per device of one layout, next to replicated optax."""

    label: str
    devices: int
    measured: int  # max over devices of the zero1 state's addressable shards
    described: int  # max over devices of `zo.describe(state).state_bytes_per_device`
    stored: int  # `zo.describe(state).stored_bytes_per_device` (owned leaves padded to one shape)
    replicated: int  # max over devices of the plain optax state's addressable shards

    @classmethod
    def of(cls, label: str, optimizer: nnx.Optimizer, reference: nnx.Optimizer) -> Memory:
        state = nnx.as_pure(optimizer.opt_state)
        layout = zo.describe(state)
        return cls(label, layout.world_size, max(bytes_per_device(state).values()),
                   max(layout.state_bytes_per_device), layout.stored_bytes_per_device,
                   max(bytes_per_device(nnx.as_pure(reference.opt_state)).values()))


# ------------------------------------------------------------------------------------------------------- run


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An inner optimizer, the partition zero1 gives it, and the tolerance of the comparison with optax."""

    name: str
    make: Callable[[], optax.GradientTransformation]
    partition: str
    rtol: float


RECIPES = {
    "flat": Recipe("AdamW", lambda: optax.adamw(3e-3, weight_decay=0.01), "flat", 1e-5),
    "leaf": Recipe("Muon", lambda: optax.contrib.muon(2e-2, adam_learning_rate=3e-3), "leaf", 5e-5),
    "auto": Recipe("Muon", lambda: optax.contrib.muon(2e-2, adam_learning_rate=3e-3), "auto", 5e-5),
}


@dataclasses.dataclass
class Result:
    """What one recipe's run measured."""

    recipe: Recipe
    devices: int
    resumed_on: int
    checkpoint_step: int
    zero_losses: list[float] = dataclasses.field(default_factory=list)
    optax_losses: list[float] = dataclasses.field(default_factory=list)
    before: float = 0.0  # worst relative difference before the checkpoint
    after: float = 0.0  # worst relative difference after resuming
    restored_state: float = 0.0  # restored optimizer state, gathered, against optax's at the checkpoint
    max_abs: float = 0.0  # worst max |zero1 - optax| over all parameters and steps
    memory: list[Memory] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return max(self.before, self.after, self.restored_state) <= self.recipe.rtol


def state_difference(zero_state, optax_state) -> float:
    """max |gathered zero1 state - optax state| over all floating leaves, relative to the largest optax entry."""
    pairs = [(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(zo.gather_state(zero_state)),
                                                             jax.tree.leaves(optax_state))
             if jnp.issubdtype(b.dtype, jnp.floating)]
    scale = max(float(np.max(np.abs(b), initial=0.0)) for _, b in pairs) or 1.0
    return max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in pairs) / scale


def save(directory: Path, step: int, model: CharLM, optimizer: nnx.Optimizer) -> None:
    """Saves the parameters with Orbax's `StandardSave` and the sharded optimizer state with `zo.ZeroSave`."""
    with ocp.CheckpointManager(directory) as manager:
        manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(nnx.as_pure(nnx.state(model, nnx.Param))),
            opt_state=zo.ZeroSave(nnx.as_pure(optimizer.opt_state))))  # the zero1 state, unwrapped from NNX
        manager.wait_until_finished()


def restore(directory: Path, step: int, recipe: Recipe, vocab: int,
            mesh: jax.sharding.Mesh) -> tuple[CharLM, nnx.Optimizer, zo.ZeroState]:
    """Restores a checkpoint saved on any number of devices onto `mesh`.

    A fresh model and optimizer on `mesh` give the targets: shapes, shardings and the zero1 layout for this mesh.
    `reshard=True` lets `ZeroRestore` re-slice (flat) or re-own (leaf) a state saved at another world size.

    Returns:
      The model and optimizer with the restored values, and the restored zero1 state.
    """
    model = new_model(vocab, mesh, "model" in mesh.axis_names)
    tx = zo.zero1(recipe.make(), axis_name="data", mesh=mesh, partition=recipe.partition)
    optimizer = new_optimizer(model, tx, mesh)
    with ocp.CheckpointManager(directory) as manager:
        restored = manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(nnx.as_pure(nnx.state(model, nnx.Param))),
            opt_state=zo.ZeroRestore(nnx.as_pure(optimizer.opt_state), reshard=True)))
    nnx.update(model, restored["params"])
    nnx.update(optimizer.opt_state, nnx.state(restored["opt_state"]))
    optimizer.step.set_value(jnp.full_like(optimizer.step.get_value(), step))  # nnx.Optimizer's own count
    return model, optimizer, restored["opt_state"]


def train(recipe: Recipe, text: Text, devices: Sequence[Device], steps: int, out: Path,
          progress: Progress, model_size: int = 1) -> Result:
    """Trains with zero1 and with plain optax side by side, checkpoints half-way, resumes on half the devices.

    Args:
      recipe: the inner optimizer and its partition.
      text: the training text.
      devices: the devices to start on (an even number); the run resumes on the first half of them.
      steps: steps in all, `steps // 2` before the checkpoint.
      out: the output folder; the checkpoint goes to `out/checkpoints/<optimizer>_<partition>`.
      progress: where to show the progress bars.
      model_size: with more than 1, the run is on a (data, model) mesh with the blocks' matrices sharded over
        "model" (`--mesh`), resumed on half the data size; plain optax keeps them replicated.

    Returns:
      The losses, differences from optax and state bytes of the run.
    """
    t0 = time.perf_counter()
    vocab = len(text.alphabet)
    n, half, k = len(devices), len(devices) // 2, steps // 2
    mesh = data_mesh(devices, model_size)
    result = Result(recipe, n, half, k)

    # The model twice, from the same initial parameters: one with zero1, one with the plain optax optimizer.
    model = new_model(vocab, mesh, model_size > 1)
    tx = zo.zero1(recipe.make(), axis_name="data", mesh=mesh, partition=recipe.partition)
    optimizer = new_optimizer(model, tx, mesh)
    reference = new_model(vocab, mesh)
    ref_optimizer = new_optimizer(reference, recipe.make(), mesh)
    result.memory.append(Memory.of(f"{recipe.name} {recipe.partition}", optimizer, ref_optimizer))

    def run(model, optimizer, zero_mesh, steps: range, label: str) -> float:
        """Steps zero1 (on `zero_mesh`) and optax (always on `mesh`) on the same batches.

        Returns the worst relative parameter difference (max |zero1 - optax| / max |optax|) after any step.
        """
        task = progress.add_task(label, total=len(steps), loss=float("nan"), diff=0.0)
        worst = 0.0
        for t in steps:
            batch = text.batch(t)
            loss = train_step(model, optimizer, *jax.device_put(batch, NamedSharding(zero_mesh, P("data"))))
            ref_loss = train_step(reference, ref_optimizer, *jax.device_put(batch, NamedSharding(mesh, P("data"))))
            result.zero_losses.append(float(loss))
            result.optax_losses.append(float(ref_loss))
            diff, scale = parameter_difference(model, reference)
            worst, result.max_abs = max(worst, diff / scale), max(result.max_abs, diff)
            progress.update(task, advance=1, loss=result.zero_losses[-1], diff=worst)
        return worst

    result.before = run(model, optimizer, mesh, range(k), f"{recipe.name} {recipe.partition}, {n} devices")

    # Half-way: save on n devices and restore on half of them; the optax run goes on, uninterrupted, on all n.
    ckpt_dir = (out / "checkpoints" / f"{recipe.name.lower()}_{recipe.partition}").absolute()
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # a fresh run: an old step k would not be overwritten
    save(ckpt_dir, k, model, optimizer)
    small = data_mesh(devices[:half], model_size)
    model, optimizer, restored = restore(ckpt_dir, k, recipe, vocab, small)
    result.restored_state = state_difference(restored, nnx.as_pure(ref_optimizer.opt_state))
    result.memory.append(Memory.of(f"{recipe.name} {recipe.partition}", optimizer, ref_optimizer))

    result.after = run(model, optimizer, small, range(k, steps), f"  resumed on {half} devices")
    result.seconds = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------------------------------- report


def memory_table(results: Sequence[Result]) -> Table:
    """Optimizer-state bytes per device, one row per optimizer: replicated optax, then zero1 before the checkpoint
    and after resuming on half the devices, each with its ratio to replicated optax.

    zero1's bytes are its arrays' addressable shards on the fullest device; where `zo.describe` counts otherwise
    (or stores more, padding included), the cell says so.
    """
    table = Table(title="Optimizer state per device (bytes)")
    r = results[0]
    columns = ("optimizer", "optax\nreplicated", f"zero1\n{r.devices} devices", "ratio",
               f"zero1\n{r.resumed_on} device{'s' * (r.resumed_on > 1)}", "ratio")
    for column in columns:
        table.add_column(column, justify="left" if column == "optimizer" else "right")

    def cell(m: Memory) -> str:
        notes = [f"{name} {value:,}" for name, value in (("describe", m.described), ("stored", m.stored))
                 if value != m.measured]
        return f"{m.measured:,}" + (f" ({', '.join(notes)})" if notes else "")

    for r in results:
        before, after = r.memory
        table.add_row(f"{r.recipe.name} {r.recipe.partition}", f"{before.replicated:,}",
                      cell(before), f"{before.measured / before.replicated:.3f}",
                      cell(after), f"{after.measured / after.replicated:.3f}")
    return table


def checks_table(results: Sequence[Result]) -> Table:
    """max |zero1 - optax| / max |optax| per optimizer: over the parameters after each step before the checkpoint,
    the restored optimizer state, and the parameters after each resumed step."""
    table = Table(title="zero1 against plain optax: max |zero1 - optax| / max |optax|")
    for column in ("optimizer", "steps (devices)", "params\nbefore", "restored\nstate", "params\nresumed", "rtol", ""):
        table.add_column(column, justify="left" if column == "optimizer" else "right")
    for r in results:
        table.add_row(f"{r.recipe.name} {r.recipe.partition}",
                      f"{r.checkpoint_step} ({r.devices}) + {len(r.zero_losses) - r.checkpoint_step} ({r.resumed_on})",
                      f"{r.before:.1e}", f"{r.restored_state:.1e}", f"{r.after:.1e}", f"{r.recipe.rtol:.0e}",
                      "[green]pass" if r.ok else "[red]FAIL")
    return table


def plot(results: Sequence[Result], path: Path) -> None:
    """Loss curves: zero1 (checkpointed, resharded, resumed) over the uninterrupted optax run."""
    fig = Figure(figsize=(5.5 * len(results), 3.8), layout="tight")  # no pyplot: no GUI backend, no global state
    axes = fig.subplots(1, len(results), squeeze=False)
    for ax, r in zip(axes[0], results):
        steps = np.arange(1, len(r.optax_losses) + 1)
        ax.plot(steps, r.optax_losses, color="0.6", lw=4, label="plain optax, uninterrupted")
        k = r.checkpoint_step
        ax.plot(steps[:k], r.zero_losses[:k], "C0.-", ms=3, label=f"zero1 on {r.devices} devices")
        ax.plot(steps[k:], r.zero_losses[k:], "C1.-", ms=3, label=f"restored, resumed on {r.resumed_on}")
        ax.axvline(k + 0.5, color="k", ls=":", lw=1)
        ax.annotate(f" checkpoint: {r.devices} -> {r.resumed_on} devices", (k + 0.5, 0.5),
                    xycoords=("data", "axes fraction"), fontsize=8)
        ax.set(title=f"zero1({r.recipe.name.lower()}), partition={r.recipe.partition!r}", xlabel="step",
               ylabel="loss (cross-entropy, nats)")
        ax.legend(frameon=False)
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m zero_optax.demo",
        description="Train a small character-level transformer with zero1 on all devices, check every step "
                    "against plain optax, checkpoint with Orbax, reshard to half the devices, resume, and plot the "
                    "loss curves. Exits non-zero if any check fails.")
    parser.add_argument("--steps", type=int, default=60,
                        help="steps per optimizer, half before the checkpoint and half after (default: 60)")
    parser.add_argument("--devices", type=int, default=None,
                        help=f"devices to train on, even (default: all; {SIMULATED_DEVICES} simulated CPU devices "
                             "where there is no accelerator)")
    parser.add_argument("--partition", choices=("flat", "leaf", "auto", "both"), default="both",
                        help="flat: AdamW; leaf or auto: Muon; both (default): AdamW flat, then Muon leaf")
    parser.add_argument("--mesh", default=None,
                        help="a (data, model) mesh such as data=4,model=2: the blocks' matrices sharded over "
                             "\"model\" (Muon's owner gathers them whole), resumed at half the data size; "
                             "default: a 1-D data mesh")
    parser.add_argument("--quantize", action="store_true",
                        help="instead: AdamW with int8 collectives (zo.Quantize params, grads, both) beside the "
                             "exact run, --steps steps each (300 for the figures in benchmarks/RESULTS.md), loss "
                             "curves on one plot")
    parser.add_argument("--out", type=Path, default=Path("zero_optax_demo"),
                        help="output folder for checkpoints and loss_curves.png (default: ./zero_optax_demo)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (one before the checkpoint, one after).")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns the exit status (0 only if every check passed)."""
    args = parse_args(argv)
    simulate_cpu_devices(max(SIMULATED_DEVICES, args.devices or 0))  # before anything starts the backend
    console = Console()
    count, model_size = parse_mesh(args.mesh)
    devices = pick_devices(count or args.devices)
    text = Text.load()
    recipes = [RECIPES["flat"], RECIPES["leaf"]] if args.partition == "both" else [RECIPES[args.partition]]
    args.out.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]zero_optax {zo.__version__}[/] demo: jax {jax.__version__}, {len(devices)} x "
                  f"{devices[0].platform} devices; {len(text.ids):,} characters of Pride and Prejudice, "
                  f"{len(text.alphabet)} symbols")

    results = []
    columns = (TextColumn("{task.description:<24}"), BarColumn(bar_width=12), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.3f}  rel. diff {task.fields[diff]:.0e}"), TimeElapsedColumn())
    if args.quantize:
        return quantized(text, devices, args, Progress(*columns[:3], TextColumn("loss {task.fields[loss]:.3f}"),
                                                       TimeElapsedColumn(), console=console), console)
    with Progress(*columns, console=console) as progress:
        for recipe in recipes:
            results.append(train(recipe, text, devices, args.steps, args.out, progress, model_size))

    console.print(memory_table(results))
    console.print(checks_table(results))
    png = args.out / "loss_curves.png"
    plot(results, png)
    ok = all(r.ok for r in results)
    for r in results:
        console.print(f"{r.recipe.name} {r.recipe.partition}: loss {r.zero_losses[0]:.3f} -> {r.zero_losses[-1]:.3f} "
                      f"in {len(r.zero_losses)} steps ({r.seconds:.0f} s); max |zero1 - optax| over all parameters "
                      f"and steps: {r.max_abs:.1e}")
    console.print(f"loss curves: {png}; checkpoints: {args.out / 'checkpoints'}")
    console.print("[bold green]OK[/]: every step of zero1 matched plain optax, before and after resharding "
                  f"from {len(devices)} to {len(devices) // 2} devices" if ok else
                  "[bold red]FAILED[/]: zero1 differed from plain optax beyond float32 rounding (see the checks)")
    return 0 if ok else 1


def quantized(text: Text, devices: Sequence[Device], args: argparse.Namespace, progress: Progress,
              console: Console) -> int:
    """`--quantize`: the four runs of `zero_optax._quantized_demo` on the flat recipe, their table and plot."""
    task = _quantized_demo.Task(lambda: CharLM(len(text.alphabet), rngs=nnx.Rngs(0)), loss_fn, text.batch,
                                RECIPES["flat"].make)
    with progress:
        runs = _quantized_demo.run_all(task, devices, args.steps, progress)
    console.print(_quantized_demo.table(runs))
    png = args.out / "quantize_curves.png"
    _quantized_demo.plot(runs, png)
    console.print(f"loss curves: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
