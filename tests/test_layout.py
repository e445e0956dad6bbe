"""The package layout: every import runs from a higher layer to a lower one (or within a folder), nothing imports
in a cycle, nothing hides an import inside a function, and every module says its one idea in its docstring.

Layers, bottom to top: `zero_optax.core` < `zero_optax.analysis` < `zero_optax.layout` < `zero_optax.step` < `zero_optax.api`
< `zero_optax.checkpoint` < the package's own modules (`__init__`, `demo`, `reshard`). The checks read the sources with `ast`.
"""

import ast
import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zero_optax"
LAYERS = ("core", "analysis", "layout", "step", "api", "checkpoint")
TOP = len(LAYERS)


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported zero_optax module, line, at module level) for every import statement of `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import _mod` imports the module `pkg._mod`; `from mod import name` imports `mod`.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            if t == "zero_optax" or t.startswith("zero_optax."):
                out.append((t, node.lineno, id(node) in top))
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def test_the_folders_are_the_layers():
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(LAYERS)
    loose = sorted(m for m in MODULES if _layer(m) == TOP)
    assert loose == ["zero_optax", "zero_optax._plan", "zero_optax._quantized_demo", "zero_optax.demo", "zero_optax.plan",
                     "zero_optax.reshard", "zero_optax.with_kauldron", "zero_optax.with_maxtext"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_up_a_layer(module):
    for target, line, _ in GRAPH[module]:
        assert _layer(target) <= _layer(module), (
            f"{module}:{line} imports {target}, a higher layer ({LAYERS[_layer(module)]} < "
            f"{(LAYERS + ('zero_optax',))[_layer(target)]})")
        if _layer(module) < TOP:
            assert target != "zero_optax", f"{module}:{line} imports the package's top (`zero_optax`)"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_are_at_module_level(module):
    hidden = [(t, line) for t, line, at_top in GRAPH[module] if not at_top]
    assert not hidden, f"{module} imports inside a function or block (a cycle dodged?): {hidden}"


def test_no_cycles():
    edges = {m: sorted({t for t, _, _ in GRAPH[m] if t in MODULES and t != m}) for m in MODULES}
    done, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for t in edges[m]:
            visit(t)
        stack.pop()
        done.add(m)

    for m in sorted(MODULES):
        visit(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_opens_with_its_idea(module):
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text()))
    assert doc and len(doc.splitlines()[0]) > 20, f"{module} has no opening docstring that says what it is"


def test_the_handler_keeps_its_recorded_name():
    """Orbax writes the handler's `typestr()` into every checkpoint's metadata; moving the module keeps it."""
    import zero_optax as zo  # pylint: disable=import-outside-toplevel

    with open(os.path.join(ROOT, "tests", "data", "golden_v2", "item", "_CHECKPOINT_METADATA")) as f:
        recorded = json.load(f)["item_handlers"]
    assert zo.ZeroCheckpointHandler.typestr() == recorded
