"""Flax's `nnx.Optimizer` and `TrainState`, stepping through `zero_optax.apply_gradients` (which all-gathers new
parameters, not updates); for any other transformation they step exactly as their Flax parents do.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.nnx import filterlib
from flax.training import train_state

from zero_optax.api._zero1 import apply_gradients
from zero_optax.layout import _handle

M = tp.TypeVar("M")


class ZeroOptimizer(nnx.Optimizer[M]):
    """`nnx.Optimizer` whose `update` is one `zero_optax.apply_gradients` call.

    Constructed and used as `nnx.Optimizer`, with the same fields. With a mesh-bound zero1, `step` starts
    replicated on its mesh, where the steps leave it, so `nnx.jit` compiles the step once.

    Args:
      model: the NNX module whose `wrt` variables `tx` updates.
      tx: the transformation, typically `zo.zero1(..., mesh=mesh)`; any optax transformation works.
      wrt: the filter of the variables to update, the one given to `nnx.grad`.
      **kwargs: other arguments of `nnx.Optimizer` (`graph=` on Flax >= 0.12.8).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> from flax import nnx
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> model = nnx.Linear(2, 1, use_bias=False, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
      >>> optimizer = zo.ZeroOptimizer(model, zo.zero1(optax.sgd(0.5), axis_name="data", mesh=mesh),
      ...                              wrt=nnx.Param)
      >>> @nnx.jit
      ... def train_step(model, optimizer, x):
      ...     optimizer.update(model, nnx.grad(lambda m: m(x).sum())(model))
      >>> train_step(model, optimizer, jnp.ones((1, 2)))
      >>> model.kernel[...].tolist(), int(optimizer.step[...])
      ([[0.5], [0.5]], 1)
    """

    def __init__(self, model: M, tx: optax.GradientTransformation, *, wrt: filterlib.Filter, **kwargs: tp.Any
                 ) -> None:
        super().__init__(model, tx, wrt=wrt, **kwargs)
        self.step.set_value(_on_mesh(tx, self.step.get_value()))

    def update(self, model: M, grads: tp.Any, /, **kwargs: tp.Any) -> None:  # type: ignore[override]
        """As `nnx.Optimizer.update` (`kwargs` go to `tx.update`), but returns None: the updates are never formed."""
        graph = {"graph": self.graph} if "graph" in vars(self) else {}  # (Flax 0.12.7 has no `graph=`)
        params = nnx.as_pure(nnx.state(model, self.wrt, **graph))
        grads = nnx.as_pure(nnx.state(grads, self.wrt, **graph))
        new_params, new_opt_state = apply_gradients(self.tx, grads, nnx.as_pure(self.opt_state), params,
                                                    **nnx.as_pure(kwargs))
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, **graph))
        self.step[...] += 1


class ZeroTrainState(train_state.TrainState):
    """`flax.training.train_state.TrainState` whose `apply_gradients` is one `zero_optax.apply_gradients` call.

    Same fields and FP8 `OVERWRITE_WITH_GRADIENT` handling as `TrainState`. With a mesh-bound zero1, `create`
    places `step` replicated on its mesh, where the steps leave it, so `jax.jit` compiles the step once.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> state = zo.ZeroTrainState.create(apply_fn=None, params={"w": jnp.ones(3)},
      ...                                  tx=zo.zero1(optax.sgd(0.5), axis_name="data", mesh=mesh))
      >>> state = jax.jit(lambda s: s.apply_gradients(grads={"w": jnp.ones(3)}))(state)
      >>> state.params["w"].tolist(), int(state.step)
      ([0.5, 0.5, 0.5], 1)
    """

    @classmethod
    def create(cls, *, apply_fn: tp.Any, params: tp.Any, tx: optax.GradientTransformation, **kwargs: tp.Any
               ) -> ZeroTrainState:
        """As `TrainState.create`: `step` 0 (on a mesh-bound zero1's mesh), `opt_state` from `tx.init(params)`."""
        state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        return state.replace(step=_on_mesh(tx, state.step))

    def apply_gradients(self, *, grads: tp.Any, **kwargs: tp.Any) -> ZeroTrainState:
        """As `TrainState.apply_gradients`: one optimizer step, `kwargs` replacing other fields."""
        overwrite = OVERWRITE_WITH_GRADIENT in grads
        params, opt_state = apply_gradients(self.tx, grads["params"] if overwrite else grads, self.opt_state,
                                            self.params["params"] if overwrite else self.params)
        if overwrite:
            params = {"params": params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)


def _on_mesh(tx: optax.GradientTransformation, step):
    """`step` replicated on `tx`'s mesh if `tx` is a mesh-bound zero1 (where jitted steps leave it), else as it is."""
    zero = _handle.find(tx)
    if zero is None or zero.mesh is None:
        return step
    return jax.device_put(jnp.asarray(step), jax.sharding.NamedSharding(zero.mesh, jax.sharding.PartitionSpec()))

