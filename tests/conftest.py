"""Test configuration: 8 simulated CPU devices for the whole suite, set before the backend starts.

XLA:CPU compiles the tests' programs with LLVM's optimisations off (`--xla_backend_optimization_level=0`, unless
`XLA_FLAGS` already sets it): compiling is most of the suite's time, and less of it goes (`tests/test_flat.py`:
65 s -> 47 s). The level leaves the HLO programs zero1 emits as they are (their collectives, buffers and bytes,
which the tests count); machine code built at another level may round the last bit of a float differently
(vectorised math, fused multiply-adds), and every test passes at either level (`XLA_FLAGS=--xla_backend_optimization_level=2 pytest`
runs the suite at XLA's default). Benchmarks and the demo run at XLA's default. The processes the tests start
inherit the flags.

`ZERO_OPTAX_TESTS=floors` (set by `.ci/run` in its floors venv, only while that venv's JAX and optax are the 3.11
venv's) runs the tests that reach flax, orbax-checkpoint or chex, the three packages that venv pins to other
versions: a test whose own source, the source of a fixture it takes or of a function of `tests/` it names (and so
on through the functions those name) names one of them or their entry points (`FLOORS`). The others would run
the same code on the same JAX and optax a second time. `ZERO_OPTAX_TESTS=others` (the 3.11 venv then) runs the
rest, so the two venvs of one JAX split the suite between them.

The suite runs on two pytest-xdist workers, a test file to a worker (`-n 2 --dist loadfile` in `pyproject.toml`):
XLA:CPU compiles on one thread, so two processes keep two cores busy (`.ci/run`'s 3.11 venv: 984 s -> 703 s on
2 cores), and a file's shared compiled steps (`functools.cache`) stay in one process. `pytest -n 0` runs in one.
"""

import ast
import inspect
import os
import pathlib
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)


FLOORS = re.compile(r"\b(flax|nnx|orbax|ocp|chex|[Cc]heckpoints?|ZeroSave|ZeroRestore|ZeroCheckpointHandler|"
                    r"ZeroOptimizer|ZeroTrainState|assert_resumes_anywhere|notebooks?|nbclient|demo)\b")


def _definitions() -> dict[str, dict[str, str]]:
    """The source of every top-level function and class of each module of `tests/`, by module and name, and of
    the import statement of every name a module imports (so `_store` of `from zero_optax.checkpoint import
    _store` reads as that statement)."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        text = path.read_text()
        names = out[path.stem] = {}
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = ast.get_source_segment(text, node) or ""
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names[(alias.asname or alias.name).split(".")[0]] = ast.get_source_segment(text, node) or ""
    return out


def _reaches_floors(item, definitions: dict[str, dict[str, str]]) -> bool:
    """Whether the test `item` names one of the `FLOORS` packages or their entry points: in its own source, in a
    fixture it takes, or in a function of its module or of the shared `tests/_*.py` modules that it names (and so
    on through the functions those name)."""
    home = item.module.__name__.rsplit(".", 1)[-1]
    shared = [m for m in definitions if m.startswith("_") or m == "conftest"]

    def resolve(module: str, name: str):
        for m in (module, *shared):
            if name in definitions[m]:
                return m, name
        return None

    try:
        pending = [(home, inspect.getsource(item.function))]
    except (OSError, TypeError):
        pending = []
    seen: set = set()

    def follow(keys) -> None:
        for key in keys:
            if key and key not in seen:
                seen.add(key)
                pending.append((key[0], definitions[key[0]][key[1]]))

    follow(resolve(home, n) for n in item.fixturenames)
    while pending:
        module, src = pending.pop()
        if FLOORS.search(src):
            return True
        follow(resolve(module, n) for n in set(re.findall(r"[A-Za-z_]\w*", src)))
    return False


def pytest_collection_modifyitems(config, items):
    """`ZERO_OPTAX_TESTS=floors`: only the tests that reach flax, orbax-checkpoint or chex (`_reaches_floors`);
    `ZERO_OPTAX_TESTS=others`: all but those."""
    subset = os.environ.get("ZERO_OPTAX_TESTS", "all")
    if subset == "all":
        return
    if subset not in ("floors", "others"):
        raise ValueError(f"ZERO_OPTAX_TESTS must be all, floors or others, got {subset!r}")
    definitions = _definitions()
    keep = [_reaches_floors(item, definitions) == (subset == "floors") for item in items]
    config.hook.pytest_deselected(items=[item for item, k in zip(items, keep) if not k])
    items[:] = [item for item, k in zip(items, keep) if k]
