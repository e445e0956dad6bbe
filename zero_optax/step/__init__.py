"""One zero1 step inside `shard_map`: reduce, update, gather. Above `zero_optax.layout`.

* `_engine`: `init` and `update`, the step's stages top to bottom.
* `_sliced_step`: the sliced leaves' stages: reduce-scatter, update each group's slots, all-gather.
* `_owned_step`: the owned leaves' stages: reduce to the owners, one `lax.switch`, gather.
* `_master`: master copies, one strategy the stages call.
* `_streamed`: offload's updates, streamed through the device chunk by chunk.
* `_accumulate`: gradient accumulation over micro-batches, a wrapper around the inner transformation.
* `_views`: the inner transformation's masked views of one layout, computed once per layout.
* `_reduce`: the gradients' reduction: the denominator, the checks, `reduce_gradients`.
* `_groups`: sliced leaves, grouped to run as one buffer.
* `_slots`: each device's slots of a sliced leaf.
* `_packed`: owned leaves, packed per owner.
* `_tp_owned`: owned leaves sharded over tensor-parallel axes.
* `_varying`: the inner update run on slices, its full reductions and random draws exact.
* `_wire`: every collective the step emits, exact or int8 (the only module that emits them).
* `_quantize`: the block-wise int8 codec of the quantized collectives.
* `_offload`: the state in host memory: its moves.
"""
