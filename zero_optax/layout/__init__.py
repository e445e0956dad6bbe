"""What `init` decides once per parameter tree and mesh: the layout of a zero1 state. Above `zero_optax.analysis`.

* `_config`: `Config`, zero1's arguments as one validated value.
* `_planner`: the plan: each leaf sliced or owned, its owner and entries, into a `Layout`.
* `_fusion`: which sliced leaves run as one group and which owned leaves as one stack.
* `_attribution`: which inner-state leaves belong to which parameter leaf.
* `_layout`: `Layout`, the run-time plan a state carries, and its `Group`s.
* `_stored`: `StoredLayout`, what a checkpoint records, and the records both layouts are made of.
* `_owners`: which device owns which leaf (`balanced_owners`).
* `_state`: the `ZeroState` pytree.
* `_inner_state`: the inner optimizer's state tree inside it, for optax's tree utilities.
* `_keys`: typed PRNG keys of the inner state, held as key data.
* `_specs`: the `PartitionSpec`s of a state (`state_specs`).
* `_handle`: which zero1 object a transformation is.
"""
