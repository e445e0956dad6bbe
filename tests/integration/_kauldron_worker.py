"""Trains a small MLP with `kd.train.Trainer` in this process, on the device count that `XLA_FLAGS` sets.

    python tests/integration/_kauldron_worker.py OUT.json OPTIMIZER:WORKDIR:STEPS [...]

OPTIMIZER is `adamw` (Kauldron's own: `optax.adamw`, `kd.ckpts.Checkpointer`), `zero1` (the same adamw through
`zo.zero1(..., mesh=kd.sharding.DEVICES_MESH)`, `zero_optax.with_kauldron.Checkpointer`) or `zero1-kd` (that zero1 with
`kd.ckpts.Checkpointer`). Each run trains to STEPS in
WORKDIR, resuming from its latest checkpoint (saved every 3 steps); OUT.json gets, per run, the loss of every
step, the optimizer state's bytes on each device after init, after the restore and at the end, whether restoring
the `TrainState` alone gives the same optimizer state, and the final parameters; or the error that stopped it.
"""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import numpy as np
import optax
from kauldron import kd
from kauldron.train import checkpoint_state

import zero_optax as zo
import zero_optax.with_kauldron

SAVE_EVERY = 3
LOSSES = []


class MLP(nn.Module):
    """16 -> 32 -> 4: 676 parameters, a count 8 does not divide."""

    x: kd.kontext.Key = "batch.x"

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))


class Regression:
    """256 examples of a fixed linear target, a grain random-access source (its iterator is checkpointed)."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(256, 16)).astype(np.float32)
        self.y = (self.x[:, :4] * 2 + 0.1).astype(np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class LossLog(kd.train.metric_writer.NoopWriter):
    """Keeps every step's loss."""

    def write_step_metrics(self, *, step, aux, schedules, log_summaries, timer=None):
        LOSSES.append((int(step), float(aux.compute(flatten=True).loss_values["losses/l2"])))


def trainer(optimizer, workdir, steps):
    """The trainer; only the optimizer and the checkpointer depend on `optimizer`."""
    tx = optax.adamw(1e-2)
    checkpointer = kd.ckpts.Checkpointer(save_interval_steps=SAVE_EVERY)
    if optimizer.startswith("zero1"):
        tx = zo.zero1(tx, axis_name="devices", mesh=kd.sharding.DEVICES_MESH)
    if optimizer == "zero1":
        checkpointer = zero_optax.with_kauldron.Checkpointer(save_interval_steps=SAVE_EVERY)
    return kd.train.Trainer(
        seed=0, workdir=workdir, model=MLP(), num_train_steps=steps, optimizer=tx, checkpointer=checkpointer,
        train_ds=kd.data.py.DataSource(data_source=Regression(), shuffle=True, seed=1, batch_size=16,
                                       num_workers=0),
        train_losses={"l2": kd.losses.L2(preds="preds", targets="batch.y")},
        writer=LossLog(), log_metrics_every=1, log_summaries_every=10**9, evals={})


def bytes_per_device(opt_state):
    """Bytes of `opt_state` each device holds, in `jax.devices()` order."""
    held = dict.fromkeys(jax.devices(), 0)
    for leaf in jax.tree.leaves(opt_state):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return list(held.values())


def run(optimizer, workdir, steps):
    """Trains one run and returns what OUT.json records of it."""
    LOSSES.clear()
    t = trainer(optimizer, workdir, steps)
    out = {"devices": jax.device_count(), "init": bytes_per_device(t.init_state().opt_state), "restored": None}
    if t.checkpointer.latest_step is not None:
        state = checkpoint_state.CheckpointState(t.init_state(skip_transforms=True), t._chrono, iter(t.train_ds))
        restored = t.checkpointer.restore(state).train_state.opt_state
        out["restored"] = bytes_per_device(restored)
        if optimizer == "zero1":  # a continuous evaluator's restore, of the TrainState alone
            alone = t.checkpointer.restore(t.init_state(skip_transforms=True)).opt_state
            out["alone_equal"] = jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), restored, alone))
    state, _ = t.train()
    t.checkpointer.wait_until_finished()
    out["final"] = bytes_per_device(state.opt_state)
    out["losses"] = dict(LOSSES)
    out["params"] = [float(v) for leaf in jax.tree.leaves(state.params) for v in np.ravel(leaf)]
    return out


if __name__ == "__main__":
    results = []
    for optimizer, workdir, steps in (arg.split(":") for arg in sys.argv[2:]):
        try:
            results.append(run(optimizer, workdir, int(steps)))
        except (ValueError, zo.ZeroCheckpointError) as e:  # Orbax's refusal of a shape, or zero_optax's
            results.append({"error": f"{type(e).__name__}: {e}"})
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
