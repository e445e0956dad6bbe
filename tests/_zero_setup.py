"""A tiny deterministic zero1 training setup shared by the checkpoint tests and their subprocess workers.

Everything is built with `jax.make_array_from_callback` from numpy values that every process computes alike,
so the same code runs in one process with 8 devices or in several processes of a `jax.distributed` job.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo

SHAPES = {"a": (5, 3), "b": (), "c": (7,), "m": (4, 4)}


def inner(kind: str) -> optax.GradientTransformation:
    if kind == "adamw":
        return optax.adamw(1e-2, weight_decay=1e-3)
    if kind == "adam":
        return optax.adam(1e-2)
    if kind == "lion":
        return optax.lion(1e-3)
    if kind == "muon":
        return optax.contrib.muon(1e-2)
    if kind == "adafactor":
        return optax.adafactor(1e-2)
    raise ValueError(kind)


PARTITION = {"adamw": "flat", "adam": "flat", "lion": "flat", "muon": "leaf", "adafactor": "leaf"}


def make_tx(kind: str, owners=None, chain: bool = False) -> optax.GradientTransformation:
    """zero1 of `inner(kind)`; with `chain`, behind reduce_gradients and a global-norm clip (reduce=False)."""
    if chain:
        return optax.chain(zo.reduce_gradients("data"), optax.clip_by_global_norm(1.0),
                           zo.zero1(inner(kind), axis_name="data", partition=PARTITION[kind], owners=owners,
                                    reduce=False))
    return zo.zero1(inner(kind), axis_name="data", partition=PARTITION[kind], owners=owners)


def mesh(n: int = 8) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def global_array(x: np.ndarray, sharding) -> jax.Array:
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def params_np(shapes=SHAPES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) * 0.5 for k, s in shapes.items()}


def params(m, shapes=SHAPES) -> dict[str, jax.Array]:
    return {k: global_array(v, NamedSharding(m, P())) for k, v in params_np(shapes).items()}


def grads_np(step: int, n: int, shapes=SHAPES) -> dict[str, np.ndarray]:
    """Per-device gradients of step `step`, `[n, *shape]`."""
    rng = np.random.default_rng(1000 + step)
    return {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in shapes.items()}


class Trainer:
    """Compiled init and step of `tx` on `m`; the step donates the optimizer state."""

    def __init__(self, tx: optax.GradientTransformation, m: jax.sharding.Mesh):
        self.tx, self.mesh, self.n = tx, m, m.shape["data"]
        self.init = jax.jit(jax.shard_map(tx.init, mesh=m, in_specs=P(), out_specs=P("data")))

        def step(p, s, g):
            g = jax.tree.map(lambda x: x[0], g)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        self._step = jax.jit(
            jax.shard_map(step, mesh=m, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))),
            donate_argnums=(1,))

    @functools.cached_property
    def grad_sharding(self):
        return NamedSharding(self.mesh, P("data"))

    def train(self, p, s, start: int, stop: int, shapes=SHAPES):
        for t in range(start, stop):
            g = {k: global_array(v, self.grad_sharding) for k, v in grads_np(t, self.n, shapes).items()}
            p, s = self._step(p, s, g)
        return p, s

    def abstract(self, p):
        """An abstract target: `jax.eval_shape` of init, each leaf carrying its sharding."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.mesh, x.sharding.spec)),
            jax.eval_shape(self.init, p))


def host(tree) -> list[np.ndarray]:
    """Every leaf of a pytree of (fully addressable) arrays as numpy, in tree order."""
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_bit_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))



@functools.cache
def trainer(kind: str, n: int = 8, chain: bool = False, owners: tuple[int, ...] | None = None) -> Trainer:
    """One compiled Trainer per configuration for the whole test session."""
    return Trainer(make_tx(kind, owners=owners, chain=chain), mesh(n))
