"""One zero1 step inside `shard_map`: reduce, update, gather. Above `zero_optax.layout`.

* `_engine`: `init` and `update`, the step's stages top to bottom.
* `_sliced_step`: the sliced leaves' part of a step: reduce-scatter, update each group's slots, all-gather.
* `_owned_step`: the owned leaves' part of a step: reduce to the owners, one `lax.switch`, gather.
* `_views`: the inner transformation's masked views of one layout, computed once per layout.
* `_reduce`: the gradients' reduction: the denominator, the checks, `reduce_gradients`.
* `_groups`: sliced leaves, grouped to run as one buffer.
* `_slots`: each device's slots of a sliced leaf.
* `_owned`: owned leaves, packed per owner, updated in one `lax.switch`.
* `_tp_owned`: owned leaves sharded over tensor-parallel axes.
* `_varying`: the inner update run on slices, its full reductions and random draws exact.
* `_wire`: every collective the step emits, exact or int8 (the only module that emits them).
* `_quantize`: the block-wise int8 codec of the quantized collectives.
* `_accumulate`: gradient accumulation over micro-batches.
* `_offload`: the state in host memory.
"""
