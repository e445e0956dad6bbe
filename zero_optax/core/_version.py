"""The release number: `zero_optax.__version__` and a checkpoint record's `zero_optax_version`.

The one place it is set: pyproject.toml reads it from here.
"""

__version__ = "0.4.0"
