"""The bottom layer, shared by every other folder; it imports nothing else of zero_optax.

* `_errors`: every exception zero_optax raises.
* `_compat`: the JAX primitives whose name or home moved between releases, each behind one function.
* `_names`: how zero_optax names leaf paths, tree structures and stored arrays, whatever the JAX release.
* `_reach`: the Python objects reachable from a value (closures, defaults, partials, attributes), read without
  running it: what a transformation closes over.
* `_hlo`: what a compiled program moves, read from its HLO text (collective bytes per kind and per conditional
  branch, memory-kind transfers, the traffic of the entry computation's kernels): how the tests and `benchmarks/`
  check the wire. Nothing in the package runs it.
* `_version`: the release number (`zero_optax.__version__`, and what a checkpoint record says wrote it).
"""
