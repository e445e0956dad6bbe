"""What users call: `zero1`, the mesh-bound form, the state helpers and Flax. Above `zero_optax.step`.

* `_zero1`: `zero1` (its arguments checked once into a `Config`), `apply_gradients`, `describe`, `as_local`.
* `_bound`: zero1 bound to a mesh, on global arrays under plain `jax.jit`.
* `_transfer`: state in and out of zero1: `gather_state`, `scatter_state`, `master_params`, and a state's arrays
  per entry, for checkpoints.
* `_flax`: `ZeroOptimizer` (Flax NNX) and `ZeroTrainState`.
"""
