"""`python -m zero_optax.demo --quantize`: the demo's transformer trained with quantized collectives (issue 33).

The demo's model, loss, batches and AdamW (`zero_optax.demo` passes them in a `Task`), stepped inside
`jax.shard_map` over all devices (per-device gradients: quantized gradients need zero1 to do the reduction), with
float32 master copies, four times: exactly, with `zo.Quantize(params="int8")`, with `zo.Quantize(grads="int8")`
and with both. The loss curves go to one plot (`quantize_curves.png`); the table gives each run's final loss and
its gap to the exact run's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure
from rich.progress import Progress
from rich.table import Table

import zero_optax as zo

if TYPE_CHECKING:
    Device = Any  # `jax.Device`, which type checkers cannot read as a class (jaxlib ships no type stubs)
else:
    Device = jax.Device

CONFIGS = {
    "exact": None,
    "params int8": zo.Quantize(params="int8"),
    "grads int8": zo.Quantize(grads="int8"),
    "both int8": zo.Quantize(params="int8", grads="int8"),
}
"""The runs, by label: what each quantizes (block size 256)."""

TAIL = 20
"""The final loss is the mean over the last `TAIL` steps (one step's loss is one batch's)."""


@dataclasses.dataclass(frozen=True)
class Task:
    """What the runs train: a fresh model (the same initial parameters each call), its loss, the global batch of
    each step (inputs, targets), and the inner optimizer."""

    model: Callable[[], nnx.Module]
    loss: Callable[[Any, jax.Array, jax.Array], jax.Array]  # (the model's own class, the inputs, the targets)
    batch: Callable[[int], tuple[np.ndarray, np.ndarray]]
    inner: Callable[[], optax.GradientTransformation]


@dataclasses.dataclass
class Run:
    label: str
    losses: list[float]

    @property
    def final(self) -> float:
        return float(np.mean(self.losses[-TAIL:]))


def _step(task: Task, graphdef, tx, mesh, specs):
    """The jitted shard_map step: each device's gradient of its batch's mean loss, then `zo.apply_gradients`."""
    def loss(params, inputs, targets):
        return task.loss(nnx.merge(graphdef, params), inputs, targets)

    def step(params, state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(zo.as_local(params, "data"), inputs, targets)
        params, state = zo.apply_gradients(tx, grads, state, params)
        return params, state, value[None]  # this device's batch's loss; equal batches: the mean is the global loss

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                 out_specs=(P(), specs, P("data"))), donate_argnums=(0, 1))


def train(label: str, quantize, task: Task, devices: Sequence[Device], steps: int, progress: Progress) -> Run:
    """`steps` steps of `task` with zero1 (master copies in float32) quantizing as `quantize`."""
    mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
    graphdef, params = nnx.split(task.model())
    params = jax.device_put(params, NamedSharding(mesh, P()))
    tx = zo.zero1(task.inner(), axis_name="data", master_dtype=jnp.float32, quantize=quantize)
    specs = zo.state_specs(tx, params, P(), mesh=mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = _step(task, graphdef, tx, mesh, specs)
    bar = progress.add_task(f"{label:<12}", total=steps, loss=float("nan"))
    losses = []
    for t in range(steps):
        batch = jax.device_put(task.batch(t), NamedSharding(mesh, P("data")))
        params, state, loss = step(params, state, *batch)
        losses.append(float(loss.mean()))
        progress.update(bar, advance=1, loss=losses[-1])
    return Run(label, losses)


def run_all(task: Task, devices: Sequence[Device], steps: int, progress: Progress) -> list[Run]:
    """The runs of `CONFIGS`, in order (the exact one first)."""
    return [train(label, q, task, devices, steps, progress) for label, q in CONFIGS.items()]


def table(runs: list[Run]) -> Table:
    exact = runs[0].final
    out = Table(title=f"Quantized collectives: final loss (mean of the last {min(TAIL, len(runs[0].losses))} steps)")
    for column in ("run", "final loss", "gap to exact"):
        out.add_column(column)
    for r in runs:
        out.add_row(r.label, f"{r.final:.4f}", f"{100 * (r.final - exact) / exact:+.2f}%")
    return out


def plot(runs: list[Run], path: Path) -> None:
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for r in runs:
        ax.plot(np.arange(1, len(r.losses) + 1), r.losses, lw=1, label=f"{r.label} (final {r.final:.3f})")
    ax.set(xlabel="step", ylabel="training loss", title="zero1(AdamW), int8 collectives beside the exact run")
    ax.legend(frameon=False)
    fig.savefig(path, dpi=120)
