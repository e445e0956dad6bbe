"""One zero1 step inside `shard_map`: reduce, update, gather. Above `zero_optax.layout`.

* `_engine`: `init` and `update`, the step's stages top to bottom.
* `_sliced_step`: the sliced leaves' stages: reduce-scatter, update each group's slots, all-gather.
* `_owned_step`: the owned leaves' stages (tensor-parallel ones too): reduce to the owners, one `lax.switch`, gather.
* `_master`: master copies, one strategy the stages call.
* `_accumulate`: gradient accumulation over micro-batches, a wrapper around the inner transformation.
* `_reduce`: the gradients' reduction: the denominator, the checks, `reduce_gradients`.
* `_groups`: sliced leaves, grouped to run as one buffer; the inner transformation's masked views.
* `_packed`: owned leaves, packed per owner.
* `_varying`: the inner update run on slices, its full reductions and random draws exact.
* `_wire`: every collective the step emits, exact or int8 (no other module emits one), and the slots of sliced leaves.
* `_quantize`: the block-wise int8 codec of the quantized collectives.
* `_offload`: the state in host memory: its moves, and the updates streamed through the device chunk by chunk.
"""
