"""Typed PRNG keys in the inner state (`optax.noisy_sgd`'s), stored as their key data: a typed key cannot be
summed, packed or written by Orbax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zero_optax.analysis import _programs
from zero_optax.core import _names


def is_key(x: Any) -> bool:
    """Whether `x` (an array or abstract value) is a typed PRNG key."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def to_data(x: Any) -> Any:
    """A typed key's key data; anything else as it is."""
    return jax.random.key_data(x) if is_key(x) else x


def to_key(x: Any, impl: str | None) -> Any:
    """`x` (key data) as a typed key of implementation `impl`; as it is when `impl` is None or it already is one."""
    return x if impl is None or is_key(x) else jax.random.wrap_key_data(x, impl=impl)


def _recording(init_fn: Callable, found: dict[int, str]) -> Callable:
    """`init_fn` with its typed keys as key data, writing each key's leaf position -> implementation into `found`."""
    def init_data(p):
        state = init_fn(p)
        found.update((k, str(jax.random.key_impl(x))) for k, x in enumerate(jax.tree.leaves(state)) if is_key(x))
        return jax.tree.map(to_data, state)
    return init_data


def _traced(init_fn: Callable, params: Any) -> tuple[Any, dict[int, str]]:
    """`init_fn(params)`'s abstract state holding key data, and leaf position -> implementation of its keys."""
    found: dict[int, str] = {}
    return jax.eval_shape(_recording(init_fn, found), params), found


def impls(init_fn: Callable, params: Any) -> tuple[dict[str, str], _programs.Traced]:
    """The typed keys `init_fn(params)` puts in its state (state path -> implementation name), and its program with
    them as key data (`as_data`'s `init`, where it holds no key): one trace for the layout's analyses."""
    found: dict[int, str] = {}
    traced = _programs.trace(_recording(init_fn, found), params)
    return {path: found[k] for k, path in enumerate(_names.leaf_paths(traced.out_shape)) if k in found}, traced


def _unsigned(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not is_key(x) and jnp.issubdtype(dtype, jnp.unsignedinteger)


def as_data(inner: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    """`inner` with every typed key of its state held as key data (`update` traces `inner.init` on the updates)."""
    def init_fn(params):
        return jax.tree.map(to_data, inner.init(params))

    def update_fn(updates, state, params=None, **extra):
        leaves, treedef = jax.tree.flatten(state)
        # key data is unsigned: a state without unsigned arrays (Adam's) needs no trace of `init`
        keys = _traced(inner.init, updates)[1] if any(_unsigned(x) for x in leaves) else {}
        if not keys:
            return inner.update(updates, state, params, **extra)
        typed = jax.tree.unflatten(treedef, [to_key(x, keys.get(k)) for k, x in enumerate(leaves)])
        new_updates, new_state = inner.update(updates, typed, params, **extra)
        return new_updates, jax.tree.map(to_data, new_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
