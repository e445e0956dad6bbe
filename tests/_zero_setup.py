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


class MeshTrainer:
    """zero1 on a mesh with model-parallel (or expert) axes: parameters laid out by `param_specs`, the state by
    `zo.state_specs`, per-device gradients varying over the ZeRO axes.

    Args:
      kind: the inner optimizer (`inner(kind)`).
      mesh_shape: `{axis: size}` in mesh order (devices are the first ones).
      axis_name: the ZeRO axis or axes.
      param_specs: `{name: PartitionSpec}` of the parameters (global shapes `shapes`).
    """

    def __init__(self, kind: str, mesh_shape: dict, axis_name, param_specs: dict, shapes: dict):
        import math  # pylint: disable=import-outside-toplevel
        n = math.prod(mesh_shape.values())
        self.mesh = jax.make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape), devices=jax.devices()[:n])
        self.shapes, self.param_specs = shapes, param_specs
        self.tx = zo.zero1(inner(kind), axis_name=axis_name, partition=PARTITION[kind])
        zero = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
        self.grad_specs, self.grad_rows = {}, {}
        for k, spec in param_specs.items():
            own = {a for part in spec if part for a in ((part,) if isinstance(part, str) else part)}
            rows = tuple(a for a in zero if a not in own)
            self.grad_specs[k] = P(rows, *spec) if rows else P(None, *spec)
            self.grad_rows[k] = math.prod(mesh_shape[a] for a in rows)
        p = self.params()
        self.specs = zo.state_specs(self.tx, p, param_specs, mesh=self.mesh)
        self.init = jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=(param_specs,), out_specs=self.specs))

        def step(p, s, g):
            u, s = self.tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s

        self._step = jax.jit(jax.shard_map(step, mesh=self.mesh, in_specs=(param_specs, self.specs, self.grad_specs),
                                           out_specs=(param_specs, self.specs)))

    def params(self):
        return {k: global_array(v, NamedSharding(self.mesh, self.param_specs[k]))
                for k, v in params_np(self.shapes).items()}

    def grads_np(self, t: int) -> dict[str, np.ndarray]:
        """The gradients of step `t`: per leaf, one row per device of the ZeRO axes it is not sharded over,
        `[rows, *global shape]` (their mean over the rows is the leaf's global mean gradient)."""
        rng = np.random.default_rng(3000 + t)
        return {k: rng.standard_normal((self.grad_rows[k], *shape)).astype(np.float32)
                for k, shape in self.shapes.items()}

    def train(self, p, s, start: int, stop: int):
        for t in range(start, stop):
            g = {k: global_array(v, NamedSharding(self.mesh, self.grad_specs[k])) for k, v in self.grads_np(t).items()}
            p, s = self._step(p, s, g)
        return p, s

    def abstract(self):
        """An abstract target: `jax.eval_shape` of init, each leaf carrying its sharding."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.mesh, x.sharding.spec)),
            jax.eval_shape(self.init, self.params()))


class ReplicaTrainer:
    """zero1 sharded over `data` and replicated over `replica` (`zero1(..., replica_axis="replica")`) on a
    `(replica, data)` mesh of the first devices (in `jax.devices()` order: on a two-process job of 4 devices each,
    `replica=2` puts one replica on each process), with per-device gradients varying over both axes.

    Args:
      kind: the inner optimizer (`inner(kind)`), partitioned as `PARTITION` says, or `partition`.
      replicas, data: the mesh's shape.
    """

    def __init__(self, kind: str, replicas: int = 2, data: int = 4, partition: str | None = None):
        devices = np.array(jax.devices()[:replicas * data]).reshape(replicas, data)
        self.mesh = jax.sharding.Mesh(devices, ("replica", "data"))
        self.devices = replicas * data
        self.tx = zo.zero1(inner(kind), axis_name="data", replica_axis="replica",
                           partition=partition or PARTITION[kind])
        self.specs = zo.state_specs(self.tx, params_np(), P(), mesh=self.mesh)
        self.init = jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=P(), out_specs=self.specs))

        def step(p, s, g):
            u, s = self.tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s

        self.grad_sharding = NamedSharding(self.mesh, P(("replica", "data")))
        self._step = jax.jit(jax.shard_map(step, mesh=self.mesh, in_specs=(P(), self.specs, P(("replica", "data"))),
                                           out_specs=(P(), self.specs)))

    def params(self):
        return params(self.mesh)

    def train(self, p, s, start: int, stop: int):
        for t in range(start, stop):
            g = {k: global_array(v, self.grad_sharding) for k, v in grads_np(t, self.devices).items()}
            p, s = self._step(p, s, g)
        return p, s


def oracle(kind: str, devices: int, start: int, stop: int, p=None, s=None):
    """Plain optax `inner(kind)` on one device fed the mean of `grads_np(t, devices)` for the steps
    `start..stop`: `(params, state)` (from `params_np()` and a fresh state unless given)."""
    tx = inner(kind)
    p = params_np() if p is None else p
    s = tx.init(p) if s is None else s
    for t in range(start, stop):
        u, s = tx.update({k: g.mean(0) for k, g in grads_np(t, devices).items()}, s, p)
        p = optax.apply_updates(p, u)
    return p, s
