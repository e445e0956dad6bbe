"""The inner transformation read as Python objects, and its update traced once for every analysis.

optax exposes neither the keyword-only arguments an update requires nor the arrays a transformation closes over, so
both are found by a bounded walk over the objects reachable from it; nothing else reads closures or bound methods.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax

from zero_optax.analysis import _programs
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCouplingError, ZeroError, ZeroStructureError

LIMIT = 20_000
"""How many objects a walk visits at most."""

OPAQUE = (str, bytes, int, float, complex, type(None), np.ndarray, np.generic, type, types.ModuleType,
          types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType)
"""Objects `reachable` neither looks into nor yields (they hold no arrays or functions of their own)."""


def reachable(root: Any) -> Iterator[Any]:
    """Every object reachable from `root`, each once, `root` first; `OPAQUE` ones left out, JAX arrays not looked
    into."""
    stack, seen = [root], set()
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, OPAQUE):
            continue
        seen.add(id(x))
        yield x
        if isinstance(x, jax.Array):
            continue
        if isinstance(x, (dict, tuple, list, set, frozenset)):
            stack.extend(x.values() if isinstance(x, dict) else x)
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


def may_reach(root: Any, predicate: Callable[[Any], bool]) -> bool:
    """Whether an object for which `predicate` holds may be reachable from `root` (True past `LIMIT` objects)."""
    return any(count > LIMIT or predicate(x) for count, x in enumerate(reachable(root), 1))


def required_keywords(update: Callable) -> tuple[str, ...]:
    """The keyword-only arguments without a default of the functions reachable from `update`, in the order found
    (`value=` of `optax.contrib.reduce_on_plateau`)."""
    found: dict[str, None] = {}
    for x in itertools.islice(reachable(update), LIMIT):
        if isinstance(x, types.FunctionType):
            found.update((p.name, None) for p in inspect.signature(x).parameters.values()
                         if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty)
    return tuple(found)


def update_fn(inner) -> Callable:
    """`inner.update` taking its extra arguments as one dict: `(g, s, p, extra)`."""
    return lambda g, s, p, e: inner.update(g, s, p, **e)


PER_EXAMPLE_HELP = """\
zero1 cannot run optax.contrib.differentially_private_aggregate (optax.contrib.dpsgd): its update clips each
example's gradient, so it takes per-example gradients with a batch axis first, while zero1 gives it the gradient
already averaged over examples and devices, shaped like the parameters. Aggregate before zero1 instead: on each
device clip its per-example gradients and sum them (optax.per_example_global_norm_clip), sum over the devices
(jax.lax.psum), add Gaussian noise of standard deviation l2_norm_clip * noise_multiplier drawn from a key every
device shares, divide by the global batch size, and pass the result to zero1(rest, ..., reduce=False), `rest` being
the rest of the chain (for dpsgd, optax.sgd(learning_rate, momentum, nesterov))."""


def refuse_per_example(state) -> None:
    """Refuses a state holding optax's differentially private aggregation (`PER_EXAMPLE_HELP`)."""
    private = optax.contrib.DifferentiallyPrivateAggregateState
    if any(isinstance(x, private) for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, private))):
        raise ZeroCouplingError(PER_EXAMPLE_HELP)


def trace_update(inner, grads, state, params) -> tuple[_programs.Traced, dict[str, jax.ShapeDtypeStruct]]:
    """The inner update traced on the real shapes (`update_fn`) with scalar stand-ins for the keyword arguments it
    requires, and those stand-ins; refuses results structured or shaped unlike the inputs."""
    refuse_per_example(state)
    extra = {name: jax.ShapeDtypeStruct((), np.float32) for name in required_keywords(inner.update)}
    try:
        traced = _programs.trace(update_fn(inner), grads, state, params, extra)
    except ZeroError:
        raise
    except (TypeError, ValueError) as err:  # (optax raises ValueError for a missing extra argument: sophia's obj_fn)
        raise ZeroCouplingError(
            f"zero1 could not trace the inner transformation's update on the parameters' shapes: "
            f"{type(err).__name__}: {err}\nIf it requires extra arguments that zero1 did not find among the "
            f"keyword-only arguments of the functions it reaches (found: {sorted(extra)}), wrap it so that they "
            f"are keyword-only arguments of its update. An extra argument that is a function of the whole "
            f"parameters (sophia's `obj_fn`) cannot run on the shards and owned leaves zero1 updates; bind it into "
            f"the transformation (optax.GradientTransformationExtraArgs(inner.init, functools.partial(inner.update, "
            f"obj_fn=...))) so that zero1 analyses the update with it and runs it where its partition can, or names "
            f"what couples the leaves (then use plain optax for it).") from err
    updates, new_state = traced.out_shape
    for what, got, want in (("updates", updates, grads), ("state", new_state, state)):
        if jax.tree.structure(got) != jax.tree.structure(want):
            raise ZeroStructureError(
                f"The inner transformation's update returns {what} structured as {_names.tree_signature(got)}, "
                f"but zero1 gave it {_names.tree_signature(want)}: its results must have the structure of its "
                "inputs.")
    for path, got, want in zip(_names.leaf_paths(grads), jax.tree.leaves(updates), jax.tree.leaves(grads)):
        if np.shape(got) != np.shape(want):
            raise ZeroStructureError(
                f"The inner transformation's update returns updates of shape {np.shape(got)} at `{path}`, where "
                f"zero1 gave it gradients of shape {np.shape(want)}: its updates must be shaped like its gradients.")
    return traced, extra
