"""Sphinx configuration of the zero_optax documentation: `sphinx-build -W -b html docs docs/_build/html`.

Offline: no intersphinx, no downloads. The quickstart notebook (`notebooks/quickstart.ipynb`, one copy in the
repository) is copied in and executed at build time on 8 simulated CPU devices; a failing cell fails the build.
"""

import importlib
import os
import pathlib
import re
import shutil
import sys

from sphinx.ext.autosummary import Autosummary

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

(ROOT / "docs" / "notebooks").mkdir(exist_ok=True)
shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", ROOT / "docs" / "notebooks" / "quickstart.ipynb")

import zero_optax  # noqa: E402  (after sys.path)

project = "zero_optax"
author = "The zero_optax authors"
release = zero_optax.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "cli_help",
]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}  # autosummary writes .rst
exclude_patterns = ["_build", "**.ipynb_checkpoints", "examples"]

autosummary_generate = True
templates_path = ["_templates"]
default_role = "code"  # docstrings write `name` for code, as Markdown does
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 600
nb_merge_streams = True

# Every reference to zero_optax's public names must resolve (offline: other libraries' names cannot, and private
# modules' types are not documented by design).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(collections|numpy|optax|jax|orbax|ocp|flax|os|typing)(\..*)?"),
    (r"py:.*", r"zero_optax(\.\w+)*\._\w+(\.\w+)*"),
    (r"py:.*", r"ArrayTree|M"),
]

html_theme = "sphinx_book_theme"
html_title = f"zero_optax {release}"
html_theme_options = {"show_toc_level": 2}
html_static_path = ["_static"]


def _markdown_backticks(app, what, name, obj, options, lines):
    """`ShapeDtypeStruct`s: a plural `s` right after code, which Markdown allows and reStructuredText does not."""
    for i, line in enumerate(lines):
        lines[i] = re.sub(r"(?<!`)(`[^`]+`)(?!`)(?=[A-Za-z0-9])", r"\1\\ ", line)


class _Autosummary(Autosummary):
    """autosummary whose table gives an alias (`ZeroFlatState = ZeroState`) a one-line description: autodoc
    documents an alias by its target's name and no docstring, which leaves its summary cell empty."""

    def get_items(self, names):
        items = super().get_items(names)
        for i, (display, sig, summary, real_name) in enumerate(items):
            module, _, attr = real_name.rpartition(".")
            try:
                obj = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError, ValueError):
                continue
            target = getattr(obj, "__name__", attr)
            if not summary and isinstance(obj, type) and target != attr:
                items[i] = (display, sig, f"Another name of :class:`~{module}.{target}` (an alias).", real_name)
        return items


def setup(app):
    app.connect("autodoc-process-docstring", _markdown_backticks)
    app.add_directive("autosummary", _Autosummary, override=True)
    app.add_css_file("code.css")  # docs/_static/code.css: code blocks within the page column
