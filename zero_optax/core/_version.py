"""The release number: `zero_optax.__version__`, and what a checkpoint record's `zero_optax_version` says.

It lives in the bottom layer so that the checkpoint code can write it without importing the package's top.
Keep it equal to `version` in pyproject.toml.
"""

__version__ = "0.2.0"
