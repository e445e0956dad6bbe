"""Benchmark harness for ``zero_optax``: ZeRO-1 variants against plain data parallelism and GSPMD.

Run from the repository root with ``python -m benchmarks.run`` (see ``benchmarks/run.py``).
The entry point configures 8 simulated CPU devices before any JAX backend starts, so import
``benchmarks.run`` (or set the device count yourself) before touching ``jax.devices()``.
"""
