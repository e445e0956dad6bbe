"""`python -m zero_optax.demo`: ZeRO-1 on 8 devices, checked against plain optax, saved, resharded and resumed.

On a machine without accelerators it simulates 8 CPU devices. It trains a small next-token model with
token-count-weighted gradients and prints a report:

1. `zero1(adamw)` with the flat partition and `zero1(muon)` with the leaf partition, each against plain optax on
   one device fed the same globally reduced gradient (the parameters must agree to float32 rounding);
2. optimizer-state bytes per device against replicated optax;
3. an Orbax `CheckpointManager` save/restore, `zero_optax.reshard` of the checkpoint from 8 to 3 devices, and
   training resumed on 3 devices, again against plain optax.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import jax

if not os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORMS") == "cpu":
    try:  # 8 simulated CPU devices where there is no accelerator; ignored once the backend is up
        jax.config.update("jax_num_cpu_devices", 8)
    except Exception:  # noqa: BLE001
        pass

import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo

VOCAB, DIM, SEQ, BATCH_PER_DEVICE = 61, 24, 12, 4


def init_params(key: jax.Array) -> dict:
    k = jax.random.split(key, 4)
    return {
        "embed": 0.3 * jax.random.normal(k[0], (VOCAB, DIM)),
        "mlp": {"w_in": 0.3 * jax.random.normal(k[1], (DIM, 3 * DIM)), "b_in": jnp.zeros(3 * DIM),
                "w_out": 0.3 * jax.random.normal(k[2], (3 * DIM, DIM))},
        "norm": jnp.ones(DIM),
        "head": 0.3 * jax.random.normal(k[3], (DIM, VOCAB)),
        "temperature": jnp.asarray(1.0),
    }


def loss_sum(params: dict, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Summed next-token cross-entropy over the unmasked positions of this device's batch."""
    x = params["embed"][tokens[:, :-1]]
    h = jax.nn.gelu(x @ params["mlp"]["w_in"] + params["mlp"]["b_in"]) @ params["mlp"]["w_out"]
    h = (x + h) * params["norm"] / jnp.sqrt(jnp.mean((x + h) ** 2, -1, keepdims=True) + 1e-6)
    logits = h @ params["head"] / params["temperature"]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(nll * mask[:, 1:])


def batch(step: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic global batch: sequences following a fixed rule, with ragged lengths (masked tails)."""
    rng = np.random.default_rng(step)
    start = rng.integers(0, VOCAB, size=(n * BATCH_PER_DEVICE, 1))
    tokens = (start * 7 + 3 * np.arange(SEQ)[None]) % VOCAB
    lengths = rng.integers(3, SEQ + 1, size=(n * BATCH_PER_DEVICE, 1))
    return tokens.astype(np.int32), (np.arange(SEQ)[None] < lengths).astype(np.float32)


class ZeroTrainer:
    """A zero1 train step on an `n`-device mesh: local loss-sum gradients, weighted by local token counts."""

    def __init__(self, inner: optax.GradientTransformation, n: int, **kwargs):
        self.mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        self.n = n
        self.tx = zo.zero1(inner, axis_name="data", **kwargs)
        self.init = jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=P(), out_specs=P("data")))

        def step(params, state, tokens, mask):
            loss, grads = jax.value_and_grad(loss_sum)(zo.as_local(params, "data"), tokens, mask)
            updates, state = self.tx.update(grads, state, params, weight=jnp.sum(mask[:, 1:]))
            return optax.apply_updates(params, updates), state, jax.lax.psum(loss, "data")

        self.step = jax.jit(jax.shard_map(step, mesh=self.mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                                          out_specs=(P(), P("data"), P())), donate_argnums=(0, 1))

    def replicate(self, params):
        """A replicated copy (from host memory, so donating it never deletes the caller's arrays)."""
        return jax.device_put(jax.tree.map(np.asarray, params), NamedSharding(self.mesh, P()))

    def train(self, params, state, steps: range):
        shard = NamedSharding(self.mesh, P("data"))
        losses = []
        for t in steps:
            tokens, mask = batch(t, self.n)
            params, state, loss = self.step(params, state, jax.device_put(tokens, shard),
                                            jax.device_put(mask, shard))
            losses.append(float(loss) / float(mask[:, 1:].sum()))
        return params, state, losses


def train_reference(inner, params, steps: range, n: int, state=None):
    """Plain optax on one device fed the globally reduced (token-weighted) gradient."""
    state = inner.init(params) if state is None else state

    @jax.jit
    def step(params, state, tokens, mask):
        grads = jax.grad(loss_sum)(params, tokens, mask)
        grads = jax.tree.map(lambda g: g / jnp.sum(mask[:, 1:]), grads)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for t in steps:
        params, state = step(params, state, *batch(t, n))
    return params, state


def max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def state_bytes(state) -> int:
    per_device: dict = {}
    for arr in jax.tree.leaves(state):
        for shard in arr.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def main() -> int:
    n = min(8, jax.device_count())
    print(f"zero_optax {zo.__version__} demo: jax {jax.__version__}, {n} x {jax.devices()[0].platform} devices\n")
    params0 = init_params(jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    rows = []
    ok = True
    for name, inner_fn, partition, tol in (("adamw", lambda: optax.adamw(3e-3, weight_decay=0.01), "flat", 1e-5),
                                            ("muon", lambda: optax.contrib.muon(2e-2), "leaf", 5e-5)):
        t0 = time.perf_counter()
        trainer = ZeroTrainer(inner_fn(), n, partition=partition)
        params = trainer.replicate(params0)
        state = trainer.init(params)
        params, state, losses = trainer.train(params, state, range(30))
        seconds = time.perf_counter() - t0
        ref_params, _ = train_reference(inner_fn(), params0, range(30), n)
        diff = max_diff(params, ref_params)
        replicated = sum(x.nbytes for x in jax.tree.leaves(inner_fn().init(params0)))
        ok &= diff <= tol
        rows.append((name, partition, losses[0], losses[-1], diff, state_bytes(state), replicated, seconds))
    print(f"{n_params:,} parameters; 30 steps, loss weighted by each device's token count\n")
    print("| optimizer | partition | loss first -> last | max |param - optax| | state bytes/device | "
          "replicated | ratio | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, partition, l0, l1, diff, mine, rep, sec in rows:
        print(f"| {name} | {partition} | {l0:.3f} -> {l1:.3f} | {diff:.1e} | {mine:,} | {rep:,} | "
              f"{mine / rep:.3f} | {sec:.1f} |")

    # Checkpoint on n devices, reshard to 3, resume: compare with 40 uninterrupted steps of plain optax.
    inner_fn = lambda: optax.adamw(3e-3, weight_decay=0.01)
    trainer = ZeroTrainer(inner_fn(), n)
    params = trainer.replicate(params0)
    params, state, _ = trainer.train(params, trainer.init(params), range(20))
    m = 3 if n > 3 else max(1, n - 1)  # a different world size where the machine has one
    with tempfile.TemporaryDirectory() as tmp:
        with ocp.CheckpointManager(os.path.join(tmp, "run")) as mngr:
            mngr.save(20, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                  opt_state=zo.ZeroSave(state)))
            mngr.wait_until_finished()
        src = os.path.join(tmp, "run", "20", "opt_state")
        dst = os.path.join(tmp, "opt_state_m")
        zo.reshard(src, dst, world_size=m)
        small = ZeroTrainer(inner_fn(), m)
        target = jax.eval_shape(small.init, small.replicate(params0))
        restored = ocp.Checkpointer(zo.ZeroCheckpointHandler()).restore(
            dst, args=zo.ZeroRestore(jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(small.mesh, P("data"))),
                target)))
        params, state, _ = small.train(small.replicate(params), restored, range(20, 40))
    ref_params, ref_state = train_reference(inner_fn(), params0, range(20), n)
    ref_params, ref_state = train_reference(inner_fn(), ref_params, range(20, 40), m, ref_state)
    diff = max_diff(params, ref_params)
    ok &= diff <= 1e-5
    print(f"\nCheckpoint at step 20 on {n} devices -> zero_optax.reshard to {m} devices -> 20 more steps on {m}: "
          f"max |param - uninterrupted optax| = {diff:.1e}")
    print("\n" + zo.describe(state).summary())
    print("\nOK: zero1 matches single-device optax" if ok else "\nMISMATCH: see the table above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
