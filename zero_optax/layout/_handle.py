"""Which zero1 object a transformation is: `zero1` records it here, so nothing reads `tx.init`'s bound instance."""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

from zero_optax.core._errors import NotZero1Error

# `tx.init` (a bound method, alive as long as `tx`) -> the object it is bound to.
_OBJECTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record(init: Callable[..., Any], obj: Any) -> None:
    """Records `obj` as the zero1 object behind the transformation whose `init` is `init`."""
    _OBJECTS[init] = obj


def find(tx: Any) -> Any | None:
    """The zero1 object behind `tx` if `zero1` returned `tx` (not a chain that holds one), else None."""
    init = getattr(tx, "init", None)
    return _OBJECTS.get(init) if isinstance(init, types.MethodType) else None


def zero1_of(tx: Any, what: str) -> Any:
    """The zero1 object behind `tx`; raises `NotZero1Error` naming `what` (the caller) for anything else."""
    found = find(tx)
    if found is None:
        raise NotZero1Error(f"{what} expects the transformation returned by zo.zero1(...) itself (not a chain "
                            f"that contains it), got {type(tx).__name__}.")
    return found
