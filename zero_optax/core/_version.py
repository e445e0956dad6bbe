"""The release number, `zero_optax.__version__` and a record's `zero_optax_version`; pyproject.toml reads it here."""

__version__ = "0.5.0"
