"""The Python objects reachable from a value: through containers, functions' closures and defaults, partials, bound
methods and objects' attributes. What a transformation closes over (its hyperparameters, the functions it calls)
is read this way, without running it."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

OPAQUE = (str, bytes, int, float, complex, type(None), np.ndarray, np.generic, type, types.ModuleType,
          types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType)
"""Objects `reachable` does not look into (nor yields): they hold no arrays or functions of their own, or
(classes, modules) only shared ones."""


def reachable(root: Any) -> Iterator[Any]:
    """Every object reachable from `root`, each once (by identity), `root` first; `OPAQUE` ones left out. JAX arrays
    are yielded but not looked into. A caller that needs a bound stops iterating."""
    stack, seen = [root], set()
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, OPAQUE):
            continue
        seen.add(id(x))
        yield x
        if isinstance(x, jax.Array):
            continue
        if isinstance(x, dict):
            stack.extend(x.values())
            continue
        if isinstance(x, (tuple, list, set, frozenset)):
            stack.extend(x)
            continue
        if isinstance(x, types.FunctionType):
            stack.extend(inspect.getclosurevars(x).nonlocals.values())
            stack.extend(x.__defaults__ or ())
            stack.extend((x.__kwdefaults__ or {}).values())
        elif isinstance(x, functools.partial):
            stack.extend((x.func, x.args, x.keywords))
        elif isinstance(x, types.MethodType):
            stack.extend((x.__func__, x.__self__))
        stack.extend(getattr(x, "__dict__", {}).values())
        for cls in type(x).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            stack.extend(getattr(x, name, None) for name in ((slots,) if isinstance(slots, str) else slots))
