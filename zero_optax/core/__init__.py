"""The bottom layer, shared by every other folder; it imports nothing else of zero_optax.

* `_errors`: every exception zero_optax raises.
* `_compat`: what differs between the supported JAX releases, each behind one function.
* `_names`: release-independent names of leaf paths, tree structures and stored arrays.
* `_version`: the release number.
"""
