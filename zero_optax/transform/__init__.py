"""The transformation: `zero1` and everything its `init` and `update` run. Above `zero_optax.analysis`.

* `_zero1`: `zero1` itself, the optax transformation, `apply_gradients` (the step in one call) and `describe`;
  `zero1_of`/`find_zero1`, the `Zero1` object behind a transformation.
* `_handle`: the record of which `Zero1` object each transformation `zero1` returned is, found without reading its bound methods.
* `_plan`: what `init` decides once: each leaf sliced or owned, and where its state lives (a `Layout`); the extra
  arguments the inner update requires, read from signatures.
* `_layout`: the static `Layout` a state carries: leaves, entries, owners, packing; `StoredLayout`, what a
  checkpoint records of one (no treedefs, groups or stacks), with the views both answer (`StoredViews`); the names
  every layer shares (partitions, accumulate modes, accumulator paths) and the slot rule `slot_count`.
* `_state`: the `ZeroState` pytree.
* `_shared`: the inner state's own tree inside it (shared fields as values, per-parameter fields as markers), for optax's tree utilities.
* `_engine`: `init` and `update` inside `shard_map`, for sliced and owned leaves alike; `update` as stages
  (offload in, accumulate, then `_run`: reduce, update the groups and the owned leaves, gather; offload out).
* `_wire`: every collective zero1 emits (`Wire`: reduce-scatter, all-reduce, all-gather, weight sums, the
  accumulation position, the joint reductions of sliced leaves; the replica level; the int8 all-gather and the
  all-to-all reduce-scatter), the bucket plan and the dtype each travels in.
* `_quantize`: the block-wise int8 codec the quantized collectives send (`quantize`, `dequantize`) and
  `Quantize`, what `zero1(..., quantize=)` takes.
* `_groups`: sliced leaves that run one program, stored and updated as one buffer per group; `Step`, what the
  parts of one `update` call read alike.
* `_varying`: the inner update with every value typed varying, so it runs whatever it branches on; its full
  reductions and random draws on slices, exact.
* `_keys`: typed PRNG keys of the inner state, held as key data.
* `_sliced`: sliced leaves: the slot geometry (padding, this device's coordinate slice, and back).
* `_owned`: owned leaves: whole tensors, packed per owner (the packings their collectives move), one `lax.switch`.
* `_owners`: which device owns which leaf (`balanced_owners`).
* `_reduce`: gradient reduction across the ZeRO axes, mean or weighted: the denominator, the checks, `reduce_gradients`.
* `_accumulate`: gradient accumulation over micro-batches (`accumulate_steps`), sharded or local accumulators:
  the pieces the engine's accumulate stage composes.
* `_offload`: the state in each device's `pinned_host` memory (`offload=True`): the first and last stages of an
  offloaded step (its small arrays in and out) and the moves the streamed updates make.
* `_mesh`: zero1 bound to a mesh, on global arrays under plain `jax.jit`.
* `_specs`: the `PartitionSpec`s of a state (`state_specs`).
* `_transfer`: state in and out of zero1: `gather_state`, `scatter_state`, `master_params`.
* `_entries`: a state's arrays per entry (the groups cut per leaf), for checkpoints and `gather_state`.
"""
