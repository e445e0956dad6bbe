"""What a partition may do: proofs, from the inner transformation's jaxpr, that an update does not couple the
values one device would update apart. Above `zero_optax.core`; it knows nothing of zero1's state.

* `_coupling`: the dependency ("taint") analysis behind the flat, leaf and auto partitions' refusals, and the
  program signatures (`leaf_programs`) by which the plan groups sliced leaves, stacks owned ones and refuses an
  update that runs something else on slices than on the parameters.
"""
