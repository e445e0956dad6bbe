"""Test configuration: 8 simulated CPU devices for the whole suite, set before the backend starts.

`ZERO_OPTAX_TESTS=floors` (set by `.ci/run` in its floors venv, only while that venv's JAX and optax are the 3.11
venv's) runs the test modules that reach flax, orbax-checkpoint or chex, the three packages that venv pins to
other versions (`FLOORS`, read off each module's text); the others would run the same code on the same JAX and
optax a second time.
"""

import os
import pathlib
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)


FLOORS = re.compile(r"\b(flax|nnx|orbax|ocp|chex|[Cc]heckpoints?|ZeroSave|ZeroRestore|ZeroCheckpointHandler|"
                    r"ZeroOptimizer|ZeroTrainState|assert_resumes_anywhere|notebooks?|demo)\b")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ZERO_OPTAX_TESTS", "all") == "all":
        return
    if os.environ["ZERO_OPTAX_TESTS"] != "floors":
        raise ValueError(f"ZERO_OPTAX_TESTS must be all or floors, got {os.environ['ZERO_OPTAX_TESTS']!r}")
    texts: dict = {}

    def reaches_floors(item) -> bool:
        path = pathlib.Path(str(item.fspath))
        if path not in texts:
            texts[path] = bool(FLOORS.search(path.read_text()))
        return texts[path]
    kept = [item for item in items if reaches_floors(item)]
    config.hook.pytest_deselected(items=[item for item in items if not reaches_floors(item)])
    items[:] = kept
