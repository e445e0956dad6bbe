"""One zero1 step inside `shard_map`: reduce, update, gather. Above `zero_optax.layout`.

* `_engine`: `init` and `update`, the step's stages top to bottom.
* `_reduce`: the gradients' reduction: the denominator, the checks, `reduce_gradients`.
* `_groups` and `_slots`: sliced leaves: groups run as one buffer; each device's slots of a leaf.
* `_owned` and `_tp_owned`: owned leaves: packed per owner, one `lax.switch`; those sharded over tensor-parallel axes.
* `_varying`: the inner update run on slices, its full reductions and random draws exact.
* `_wire` and `_quantize`: every collective the step emits, exact or int8 (the only module that emits them).
* `_accumulate`: gradient accumulation over micro-batches; `_offload`: the state in host memory.
"""
