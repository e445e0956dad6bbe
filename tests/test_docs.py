"""Every docstring example in zero_optax runs and shows what it says (they are the API's first tutorial)."""

import doctest
import importlib
import pkgutil

import pytest

import zero_optax

MODULES = sorted(m.name for m in pkgutil.walk_packages(zero_optax.__path__, "zero_optax.")
                 if m.name not in ("zero_optax.demo", "zero_optax.reshard"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
