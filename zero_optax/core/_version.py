"""The release number: `zero_optax.__version__`, and what a checkpoint record's `zero_optax_version` says.

It lives in the bottom layer so that the checkpoint code can write it without importing the package's top.
The one place the version is set: pyproject.toml reads it from here (`[tool.setuptools.dynamic]`).
"""

__version__ = "0.4.0"
