"""What zero1 learns about the inner transformation; above `zero_optax.core`, it knows nothing of zero1's state.

* `_inner`: the transformation read as Python objects (required extra arguments, closed-over values), its update
  traced once. `_programs`: what each JAX primitive does, what a program runs on each leaf (`leaf_programs`), and
  the one interpreter of programs. `_coupling`: the proof of what a partition may do.
"""
