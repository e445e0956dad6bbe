"""zero1 bound to a mesh: `init` and `update` on global arrays, eagerly or under `jax.jit` (and so in Flax).

Outside `shard_map`, a mesh-bound zero1 runs its own `shard_map` over the mesh. Parameters keep their
`NamedSharding`s (replicated over the data axes; any other axis is tensor or expert parallelism), the state comes
back sharded over the data axes (`zero_optax.state_specs`), and updates come back with the parameters' shardings.
Gradients are the global mean, as `jax.grad` of a global loss under `jax.jit` gives them: XLA reduces them before
zero1 sees them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.core import _compat
from zero_optax.core._errors import WeightError, ZeroStructureError
from zero_optax.transform import _engine, _specs
from zero_optax.transform._state import ZeroState


def _spec_of(x: Any, mesh: jax.sharding.Mesh) -> P:
    """The `PartitionSpec` of a global array (or tracer) over `mesh`; replicated when it carries none."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        try:
            sharding = jax.typeof(x).sharding
        except Exception:  # noqa: BLE001  (tracers of older JAX releases carry no sharding)
            sharding = None
    if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.axis_names) == tuple(mesh.axis_names):
        spec = tuple(sharding.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return P(*spec)
    return P()


def param_specs(params: Any, mesh: jax.sharding.Mesh) -> Any:
    return jax.tree.map(lambda x: _spec_of(x, mesh), params)


def _placed(tree: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
    return jax.tree.map(lambda x, s: _compat.reshard(x, NamedSharding(mesh, s)), tree, specs)


def _key(tree: Any, specs: Any) -> tuple:
    return (jax.tree.structure(tree), tuple((np.shape(x), np.dtype(x.dtype).name) for x in jax.tree.leaves(tree)),
            tuple(jax.tree.leaves(specs)))


class Bound:
    """The compiled `shard_map`s of one mesh-bound zero1, cached by layout and parameter shardings."""

    def __init__(self, zero, mesh: jax.sharding.Mesh):
        self.zero = zero
        self.mesh = mesh
        # Gradients reach a mesh-bound update already reduced: the engine takes them as the global mean.
        self.mean = _engine.Engine(dataclasses.replace(zero.cfg, reduce=None))
        self._fns: dict = {}
        self._specs: dict = {}

    def init(self, params):
        specs = param_specs(params, self.mesh)
        key = ("init", _key(params, specs))
        if key not in self._fns:
            out = _specs.tree_specs(_specs.traced_state(self.zero_init, params, specs, self.mesh))
            self._fns[key] = jax.jit(jax.shard_map(self.zero.engine.init, mesh=self.mesh, in_specs=(specs,),
                                                   out_specs=out))
        state = self._fns[key](_placed(params, specs, self.mesh))
        self._specs[state.layout] = specs
        return state

    @property
    def zero_init(self):
        """A stand-in transformation whose `init` is the unbound engine's (for tracing the state's layout)."""
        return _Tx(self.zero.engine.init)

    def update(self, grads, state, params=None, *, weight=None, apply: bool = False, **extra):
        """`update` on global arrays (with `apply`, the new parameters: `Engine.update`)."""
        if weight is not None:
            raise WeightError(
                "A mesh-bound zero1 used outside shard_map receives the global mean gradient (jax.grad of the global "
                "loss), so `weight=` has nothing to weigh. Weigh the loss instead (a token-weighted mean), or call "
                "update inside shard_map with per-device gradients.")
        if not isinstance(state, ZeroState):
            raise ZeroStructureError(
                f"zero1 update expected the ZeroState returned by this transformation's init, got "
                f"{type(state).__name__}.")
        layout = state.layout
        specs = self._specs.get(layout)
        if specs is None or params is not None:
            found = param_specs(params if params is not None else grads, self.mesh)
            specs = found if specs is None or any(s != P() for s in jax.tree.leaves(found)) else specs
        state_specs = _specs.specs_of(state)
        extra_specs = jax.tree.map(lambda _: P(), extra)
        with_params = params is not None
        key = ("update", layout, tuple(jax.tree.leaves(specs)), with_params, apply, jax.tree.structure(extra))
        if key not in self._fns:
            def run(grads, state, params, extra):
                return self.mean.update(grads, state, params, apply=apply, **extra)

            # On a one-device mesh nothing varies: untyped (check_vma=False), the step needs no collective at all,
            # where typed values would have to be retyped replicated by one-device collectives (copies on XLA:CPU).
            self._fns[key] = jax.jit(jax.shard_map(
                run, mesh=self.mesh, in_specs=(specs, state_specs, specs if with_params else P(), extra_specs),
                out_specs=(specs, state_specs), check_vma=self.mesh.size > 1))
        grads = _placed(grads, specs, self.mesh)
        params = _placed(params, specs, self.mesh) if with_params else None
        extra = jax.tree.map(lambda x: _compat.reshard(x, NamedSharding(self.mesh, P())), extra)
        return self._fns[key](grads, state, params, extra)


@dataclasses.dataclass(frozen=True)
class _Tx:
    init: Any
