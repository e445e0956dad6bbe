"""Flax's `nnx.Optimizer` and `TrainState`, stepping through `zero_optax.apply_gradients`.

`nnx.Optimizer.update` and `TrainState.apply_gradients` call `tx.update` and then `optax.apply_updates`. With a
zero1 transformation that means the devices all-gather the *updates* and every device then adds them to its
parameters in a separate full-size pass. `ZeroOptimizer` and `ZeroTrainState` are the same classes with that one
step replaced by `zero_optax.apply_gradients`: each device adds its coordinates' updates to its slice of the
parameters and the devices all-gather the *new parameters*, as GSPMD's compiled step does
(`benchmarks/RESULTS.md`, "Flax: the apply_gradients path"). The values are the same; a training loop changes
only the class it constructs. For any other transformation (plain optax, a chain holding a zero1, zero1 under
accumulation or offload) `apply_gradients` runs `tx.update` + `optax.apply_updates`, so both classes step exactly
as their Flax parents do.
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

from zero_optax.api._zero1 import apply_gradients, find_zero1

M = tp.TypeVar("M")


class ZeroOptimizer(nnx.Optimizer[M]):
    """`nnx.Optimizer` whose `update` is one `zero_optax.apply_gradients` call.

    Construct it as `nnx.Optimizer` (`ZeroOptimizer(model, tx, wrt=nnx.Param)`); `step`, `tx`, `opt_state` and
    `wrt` are the parent's, so checkpoints (`zo.ZeroSave(optimizer.opt_state)`) and `nnx.jit` treat it alike.
    `update` takes the parameters selected by `wrt` and the gradients as `nnx.Optimizer.update` does, then writes
    back the new parameters and state that `apply_gradients` returns and increments `step`. One addition: with a
    mesh-bound zero1 the `step` counter is placed on that mesh, replicated, where the steps leave it, so `nnx.jit`
    compiles the step once instead of twice.

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

    def __init__(self, model: M, tx: optax.GradientTransformation, *, wrt: filterlib.Filter, **kwargs):
        """As `nnx.Optimizer(model, tx, wrt=..., **kwargs)` (`graph=` on Flax >= 0.12.8).

        Args:
          model: the NNX module whose `wrt` variables `tx` updates.
          tx: the transformation, typically `zo.zero1(..., mesh=mesh)`; any optax transformation works.
          wrt: the filter of the variables to update, the one given to `nnx.grad`.
          **kwargs: other arguments of `nnx.Optimizer`.
        """
        super().__init__(model, tx, wrt=wrt, **kwargs)
        self.step.set_value(_on_mesh(tx, self.step.get_value()))

    def update(self, model: M, grads, /, **kwargs) -> None:  # type: ignore[override]
        """Updates the model's parameters and the optimizer state from `grads`, and increments `step`.

        Args:
          model: the NNX module (or tree-mode pytree) whose `wrt` variables are updated in place.
          grads: the gradients, as `nnx.grad` returns them.
          **kwargs: extra arguments of `tx.update` (`value=` for `optax.contrib.reduce_on_plateau`).

        Returns:
          None. `nnx.Optimizer.update` returns the updates; this step never forms them (the devices gather the
          new parameters instead), so there is nothing to return.
        """
        graph = _graph_mode(self)
        params = nnx.as_pure(nnx.state(model, self.wrt, **graph))
        grads = nnx.as_pure(nnx.state(grads, self.wrt, **graph))
        new_params, new_opt_state = apply_gradients(self.tx, grads, nnx.as_pure(self.opt_state), params,
                                                    **nnx.as_pure(kwargs))
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, **graph))
        self.step[...] += 1


class ZeroTrainState(train_state.TrainState):
    """`flax.training.train_state.TrainState` whose `apply_gradients` is one `zero_optax.apply_gradients` call.

    Same fields as `TrainState`; `apply_gradients` returns the state with `step + 1`, the new parameters and
    optimizer state (FP8 `OVERWRITE_WITH_GRADIENT` parameters are handled as `TrainState` does). `create` is
    `TrainState.create`, except that with a mesh-bound zero1 `step` starts as an array replicated on its mesh, as
    the steps return it, so `jax.jit` compiles the step once instead of twice.

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
    def create(cls, *, apply_fn, params, tx, **kwargs) -> ZeroTrainState:
        """As `TrainState.create`: `step` 0 (on a mesh-bound zero1's mesh), `opt_state` from `tx.init(params)`."""
        state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        return state.replace(step=_on_mesh(tx, state.step))

    def apply_gradients(self, *, grads, **kwargs) -> ZeroTrainState:
        """One optimizer step.

        Args:
          grads: gradients with the structure of `params`.
          **kwargs: other fields to `replace`, as in `TrainState.apply_gradients`.

        Returns:
          The state with `step` incremented, `params` and `opt_state` updated, and `kwargs` replaced.
        """
        overwrite = OVERWRITE_WITH_GRADIENT in grads
        params, opt_state = apply_gradients(self.tx, grads["params"] if overwrite else grads, self.opt_state,
                                            self.params["params"] if overwrite else self.params)
        if overwrite:
            params = {"params": params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)


def _on_mesh(tx: optax.GradientTransformation, step):
    """`step` (a step counter) as an array replicated on `tx`'s mesh if `tx` is a mesh-bound zero1, else as it is.

    Flax creates its counters on the default device; the first jitted step returns them replicated on the mesh of
    the arrays it ran on, and the second call then compiles the step again for the new placement."""
    zero = find_zero1(tx)
    if zero is None or zero.mesh is None:
        return step
    return jax.device_put(jnp.asarray(step), jax.sharding.NamedSharding(zero.mesh, jax.sharding.PartitionSpec()))


def _graph_mode(optimizer: nnx.Optimizer) -> dict[str, tp.Any]:
    """`nnx.state`'s `graph=` argument as the optimizer was built with it (Flax >= 0.12.8), or none (Flax 0.12.7,
    which has no tree mode)."""
    return {"graph": optimizer.graph} if "graph" in vars(optimizer) else {}
