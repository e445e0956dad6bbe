"""Every docstring example in zero_optax runs and shows what it says (they are the API's first tutorial)."""

import doctest
import importlib
import pkgutil

import pytest

import zero_optax

MODULES = sorted(m.name for m in pkgutil.walk_packages(zero_optax.__path__, "zero_optax.")
                 if m.name not in ("zero_optax.demo", "zero_optax.reshard"))
OPTIONAL = {"zero_optax.with_kauldron": "kauldron", "zero_optax.with_maxtext": "maxtext"}
"""Modules that import a package zero_optax does not depend on: their examples run where it is installed."""


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_every_public_name_has_an_api_entry():
    """docs/api.md lists every name of `zero_optax.__all__` (the site's API reference is generated from it)."""
    import pathlib
    import re

    api = (pathlib.Path(__file__).parent.parent / "docs" / "api.md").read_text()
    listed = set(re.findall(r"^   (\w+)$", api, flags=re.MULTILINE))
    assert sorted(set(zero_optax.__all__) - listed) == [], "add these names to an autosummary list in docs/api.md"
    assert sorted(listed - set(zero_optax.__all__)) == [], "docs/api.md lists names zero_optax does not export"
    for module in ("zero_optax.reshard", "zero_optax.demo"):
        assert f"{{cli-help}} {module}" in api, f"docs/api.md has no command-line reference for {module}"
