"""The bottom layer, shared by every other folder: errors, JAX-release compatibility, names and the version."""
