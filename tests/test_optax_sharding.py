"""optax's own `ShardingTest`, with every optimizer wrapped in a mesh-bound zero1.

`optax/_src/sharding_test.py` (shipped in the optax wheel that pip resolves) runs each optimizer of its module dict
`OPTIMIZERS` through `init` on a `jax.ShapeDtypeStruct`, and through `init`/`update` eagerly and under `jax.jit` on
a parameter sharded over an `Explicit` mesh axis, comparing the state's types (shapes, dtypes, shardings) between
them. The module reads `OPTIMIZERS` as it defines its test class, so swapping a module attribute cannot reach it:
its source is executed again here (`_load`) with one statement inserted after the dict,
`OPTIMIZERS = _wrap(OPTIMIZERS)`, whose `_wrap` returns
`zo.zero1(<the optax optimizer>, axis_name="x", mesh=MESH, partition="auto")` for each. Its version checks compare
`jax.__version__` with a string (`'0.10.2' < '0.7.2'`, so every JAX >= 0.10 skipped the sharding-in-types cases);
they compare parsed versions here (`_version`). The test bodies are unchanged.

* `TestShardingOptax`: the module as optax ships it (plain optax), the reference;
* `TestShardingZero1`: every optimizer through zero1.

Cases that fail in optax itself on the JAX versions we support (0.10.2 and 0.12) are strict expected failures in
both classes (`_OPTAX_FAILS`), so the plain run shows that the list is exact; a case that starts to pass fails the
suite until its row goes; those of them that pass through zero1 (`_ZERO1_PASSES`) must pass in `TestShardingZero1`.
`_ZERO1_FAILS` lists the cases that fail through zero1 alone, each with its reason.
The module is skipped where absl-py is missing (optax's tests need it; the `test` extra installs it).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import pathlib
import re
import types

import pytest

pytest.importorskip("absl")

import jax

import zero_optax as zo

MESH = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
PARTITION = "auto"

# Cases that fail in optax itself (no zero1), by test method name: strict xfails in both classes.
_RESHAPE = ("fails in optax too: it reshapes an array sharded over the Explicit axis without an `out_sharding` "
            "(ShardingTypeError)")
_OPTAX_FAILS: dict[str, str] = {
    "test_microbatch_with_explicit_sharding_sharded": _RESHAPE,  # (the microbatches, cut from the sharded data)
    "test_state_sharding_type_init_match_update_lbfgs": _RESHAPE,  # (lbfgs ravels the parameters)
    "test_state_sharding_type_preserved_with_jit_lbfgs": _RESHAPE,
}

# Cases of `_OPTAX_FAILS` that pass through zero1: lbfgs ravels what zero1 hands it, each device's 1-D slice of
# the parameter (replicated over the mesh), not the parameter sharded over the Explicit axis.
_ZERO1_PASSES = frozenset({
    "test_state_sharding_type_init_match_update_lbfgs", "test_state_sharding_type_preserved_with_jit_lbfgs",
})

# Cases that fail through zero1 only: (reason, strict).
_ZERO1_FAILS: dict[str, tuple[str, bool]] = {}


def _version(text: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: `"0.12.1.dev20250101"` -> `(0, 12, 1)`."""
    found = re.match(r"\d+(?:\.\d+)*", text)
    if found is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in found.group().split("."))


class _NumericVersions(ast.NodeTransformer):
    """Rewrites `<x>.__version__ < '<version>'` (any comparison) into `_version(...) < _version('<version>')`."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        operands = [node.left, *node.comparators]
        if not any(isinstance(x, ast.Attribute) and x.attr == "__version__" for x in operands):
            return self.generic_visit(node)
        wrapped = [ast.Call(ast.Name("_version", ast.Load()), [x], []) for x in operands]
        return ast.copy_location(ast.Compare(wrapped[0], node.ops, wrapped[1:]), node)


def _with_wrapped_optimizers(tree: ast.Module) -> ast.Module:
    """`tree` with `OPTIMIZERS = _wrap(OPTIMIZERS)` right after the module's assignment of `OPTIMIZERS`."""
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "OPTIMIZERS" for t in node.targets):
            tree.body.insert(i + 1, ast.parse("OPTIMIZERS = _wrap(OPTIMIZERS)").body[0])
            return tree
    raise AssertionError("optax's sharding_test.py no longer assigns OPTIMIZERS: its layout has changed")


def _wrap(optimizers: dict) -> dict:
    return {name: zo.zero1(tx, axis_name="x", mesh=MESH, partition=PARTITION) for name, tx in optimizers.items()}


@functools.cache
def _load(wrapped: bool) -> types.ModuleType:
    """optax's `sharding_test` module executed again from its source, its optimizers wrapped in zero1 if
    `wrapped`. Its `XLA_FLAGS` assignment (too late to matter here) is undone, so processes tests start keep ours."""
    path = pathlib.Path(importlib.util.find_spec("optax._src.sharding_test").origin)
    tree = _NumericVersions().visit(ast.parse(path.read_text()))
    if wrapped:
        tree = _with_wrapped_optimizers(tree)
    name = f"optax_sharding_test_{'zero1' if wrapped else 'optax'}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__dict__.update(_version=_version, _wrap=_wrap)
    flags = os.environ.get("XLA_FLAGS")
    try:
        exec(compile(ast.fix_missing_locations(tree), str(path), "exec"), module.__dict__)  # noqa: S102
    finally:
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags
    return module


def _case(test, marks: list):
    @functools.wraps(test)
    def case(self):
        return test(self)

    case.pytestmark = marks
    return case


def _marks(name: str, wrapped: bool) -> list:
    if name in _OPTAX_FAILS and not (wrapped and name in _ZERO1_PASSES):
        return [pytest.mark.xfail(strict=True, reason=_OPTAX_FAILS[name])]
    if wrapped and name in _ZERO1_FAILS:
        reason, strict = _ZERO1_FAILS[name]
        return [pytest.mark.xfail(strict=strict, reason=reason)]
    return []


def _sharding_test(wrapped: bool) -> type:
    """A subclass of the re-executed module's `ShardingTest`, its expected failures marked."""
    base = _load(wrapped).ShardingTest
    namespace = {"__test__": True, "__module__": __name__}
    for name in dir(base):
        if name.startswith("test") and callable(getattr(base, name)) and (marks := _marks(name, wrapped)):
            namespace[name] = _case(getattr(base, name), marks)
    return type(f"TestSharding{'Zero1' if wrapped else 'Optax'}", (base,), namespace)


TestShardingOptax = _sharding_test(wrapped=False)
TestShardingZero1 = _sharding_test(wrapped=True)
