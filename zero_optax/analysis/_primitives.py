"""What each JAX primitive does, as the analyses of programs read it: elementwise, reducing, position-dependent,
random, calling a sub-program or opaque; and what one equation holds (its sub-programs, the program it calls, whether
it is a full reduction)."""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core as jcore

from zero_optax.core import _compat

# Every output coordinate depends only on the same coordinate of each operand (operands of another size are
# checked separately).
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "bessel_i0e",
    "bessel_i1e", "bitcast_convert_type", "cbrt", "ceil", "clamp", "clz", "complex", "conj", "convert_element_type",
    "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor",
    "ge", "gt", "igamma", "igamma_grad_a", "igammac", "imag", "integer_pow", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "mulhi", "ne", "neg", "nextafter", "not", "or", "polygamma",
    "population_count", "pow", "random_gamma_grad", "real", "reduce_precision", "regularized_incomplete_beta", "rem",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh",
    "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "zeta",
})
# Identity on each operand separately (outputs[i] is operands[i]).
PER_OPERAND_IDENTITY = frozenset({
    "device_put", "optimization_barrier", "sharding_constraint", "layout_constraint", "reshard", "pvary",
})
# Reductions with an `axes` parameter, and cumulative ops with an `axis`.
REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax",
    "argmin",
})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
# Not elementwise, but uniform operands give a uniform result: moving, reducing or contracting equal values.
UNIFORM_PRESERVING = REDUCTIONS | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice", "rev", "dynamic_slice",
    "dot_general", "sort", "split", "unstack", "tile", "zeros_like", "reduce",
}
# Non-scalar results may differ by position even from uniform operands (`concatenate([zeros, ones])`, `cumsum`).
POSITIONAL = CUMULATIVE | {
    "iota", "iota_2x32_shape", "concatenate", "stack", "pad", "gather", "scatter", "scatter-add", "scatter_add",
    "scatter-sub", "scatter-mul", "scatter-min", "scatter-max", "dynamic_update_slice", "conv_general_dilated",
    "reduce_window", "reduce_window_sum", "reduce_window_max", "reduce_window_min", "select_and_scatter",
    "select_and_scatter_add", "select_and_gather_add", "fft", "cholesky", "cholesky_update", "eig", "eigh", "lu",
    "lu_pivots_to_permutation", "qr", "geqrf", "geqp3", "householder_product", "ormqr", "svd", "schur", "hessenberg",
    "triangular_solve", "tridiagonal", "tridiagonal_solve", "symmetric_product", "top_k", "approx_top_k",
    "ragged_dot_general",
}
# Random primitives: those producing random numbers, and those making or transforming PRNG keys.
RANDOM_NUMBERS = frozenset({
    "random_bits", "random_gamma", "threefry2x32", "threefry4x32", "philox2x32", "philox4x32", "rng_bit_generator",
    "rng_uniform", "prng_random_bits",
})
RANDOM_KEYS = frozenset({
    "random_seed", "random_wrap", "random_unwrap", "random_split", "random_fold_in", "random_clone", "prng_seed",
})
RANDOM = RANDOM_NUMBERS | RANDOM_KEYS
# Opaque primitives the analyses never look into (even if they carry a jaxpr).
KERNELS = frozenset({
    "pallas_call", "custom_call", "ffi_call", "tpu_custom_call", "custom_partitioning", "cudnn_fusion", "custom_fusion",
})
CALLBACKS = frozenset({"pure_callback", "io_callback", "buffer_callback"})
# Effects with no results: nothing flows out of them.
SINKS = frozenset({"debug_callback", "debug_print"})
# Call-like primitives: operands and results map 1:1 onto their one sub-jaxpr.
CALLS = frozenset(_compat.CALLS) | {"remat2"}
CONTROL = frozenset({"cond", "while", "scan"})
KNOWN = ELEMENTWISE | PER_OPERAND_IDENTITY | UNIFORM_PRESERVING | POSITIONAL | RANDOM | SINKS | CALLS | CONTROL

_COLLECTIVE_KINDS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "dot_general": "sum"}


def shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def size(atom: Any) -> int:
    return math.prod(shape(atom))


def subjaxprs(params: dict[str, Any]) -> list[Any]:
    """Every sub-jaxpr in an equation's params (ClosedJaxpr or Jaxpr, possibly in tuples), as found."""
    found: list[Any] = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                found.append(item)
    return found


def call_body(eqn: Any) -> Any:
    """The sub-jaxpr of a call-like equation whose inputs and outputs are the equation's, or None."""
    name = eqn.primitive.name
    candidates = subjaxprs(eqn.params)
    if name not in CALLS and (name in KNOWN or name in KERNELS or name in CALLBACKS or len(candidates) != 1):
        return None  # (`reduce`'s reducer or a kernel's body is no call; an unknown primitive, shard_map, must fit)
    for sub in candidates:
        inner = _compat.jaxpr_parts(sub)[0]
        if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
            return sub
    return None


def collective_kind(eqn: Any) -> str | None:
    """`"sum"`, `"max"` or `"min"` if `eqn` reduces whole arrays to one element (`reduce_*`, or a `dot_general` of
    two operands of one shape contracting all their axes in order: `jnp.vdot`), else None."""
    name = eqn.primitive.name
    kind = _COLLECTIVE_KINDS.get(name)
    if kind is None or not eqn.outvars or size(eqn.outvars[0]) != 1:
        return None
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        dims = tuple(range(len(shape(lhs))))
        if lb or rb or shape(lhs) != shape(rhs) or tuple(lc) != dims or tuple(rc) != dims:
            return None
    return kind
