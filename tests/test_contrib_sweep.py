"""Every public optimizer of optax.contrib through zero1: it runs with results equal to plain optax on one device fed
the mean gradient, or zero1 refuses it with a `zo.ZeroError` whose message says why and what to do.

The cases come from optax's own list, so that an optimizer a later optax adds shows up here:
`optax/contrib/_common_test.py` (shipped in the optax wheel) names each optimizer it tests with its arguments in
`_MAIN_OPTIMIZERS_UNDER_TEST` (optimizers, and the wrappers `mechanize`, `schedule_free` and `reduce_on_plateau`
around `optax.sgd`). `test_every_public_name_is_covered` sorts every public name of `optax.contrib` (its
`__all__`, or its public attributes where it has none) into one of these categories, and fails on a name it
cannot place:

* optimizers and wrappers of optax's list (`OPTAX_CASES`): each runs through zero1 in the `jax.shard_map` form on
  8 simulated devices, with `partition="flat"` and `"auto"`, for `STEPS` steps on leaves whose sizes do not divide
  8 and a scalar; the parameters and the whole state must equal plain optax's, or zero1 must refuse it where
  `REFUSED` says so, with the error class and the words of the message `REFUSED` gives;
* transformations and wrappers optax's list leaves out (`EXTRA_CASES`): `normalize`, `sam`,
  `split_real_and_imaginary` (on complex parameters), and the Hessian and differentially private aggregations,
  which zero1 refuses (`REFUSED`), run the same way;
* the `scale_by_<name>` bodies of the optimizers above (`<name>` is `chain(scale_by_<name>, learning rate)`): their
  optimizer's case runs them;
* helpers that are not transformations (`HELPERS`): each names the test that covers it;
* types: the state and dimension-number classes (any class).

A shared value that `init` computes from all the parameters (dog's first distance, from their norm) is computed on
the whole parameters, as plain optax does (`test_shared_state_that_init_reads_from_the_parameters`).

Extra arguments: `value=` (the loss) goes to momo, momo_adam and reduce_on_plateau, which require it, the same on
every device and changing from step to step. An extra argument that is not an array (a function, say) is refused
by name at `update` (`test_function_valued_extra_argument_refused_by_name`): zero1 decided how to split the
update at `init` without it; bound into the transformation, it is analysed at `init` as the rest of the update is.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import pytest

pytest.importorskip("absl")  # optax's test module imports it (the `test` extra installs it)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import _common_test as optax_common

import zero_optax as zo
from tests import _harness as h

N = 8
STEPS = 3
PARTITIONS = ("flat", "auto")
VALUE_TAKERS = frozenset({"momo", "momo_adam", "reduce_on_plateau"})


def _params():
    """A matrix, a vector and a scalar, none of whose sizes divides 8."""
    return {"w": jnp.linspace(-1.0, 1.0, 35).reshape(5, 7), "b": jnp.linspace(-1.0, 1.0, 7),
            "s": jnp.float32(0.3), "h": jnp.eye(3, 6) + 0.05}


def _complex_params():
    """Complex leaves beside a real one (for `split_real_and_imaginary`)."""
    real = _params()
    return {"w": (real["w"] + 0.5j * real["w"][::-1]).astype(jnp.complex64), "b": real["b"],
            "s": jnp.complex64(0.3 - 0.2j)}


def _optax_case(entry: dict) -> tuple[str, callable]:
    """An id and a factory for one entry of optax's `_MAIN_OPTIMIZERS_UNDER_TEST`."""
    name, kwargs = entry["opt_name"], entry["opt_kwargs"]
    wrapper, wrapper_kwargs = entry["wrapper_name"], entry["wrapper_kwargs"]
    label = name if wrapper is None else wrapper
    if wrapper is None and kwargs.keys() - {"learning_rate"}:
        label += "(" + ",".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if k != "learning_rate") + ")"

    def make():
        opt = optax_common._get_opt_factory(name)(**kwargs)
        return opt if wrapper is None else optax_common._wrap_opt(opt, wrapper, wrapper_kwargs)
    return label, make


OPTAX_CASES = dict(_optax_case(e) for e in optax_common._MAIN_OPTIMIZERS_UNDER_TEST)

EXTRA_CASES = {
    "normalize": lambda: optax.chain(optax.contrib.normalize(), optax.sgd(0.1)),
    "sam": lambda: optax.contrib.sam(optax.sgd(0.1), optax.chain(optax.contrib.normalize(), optax.sgd(0.05))),
    "split_real_and_imaginary": lambda: optax.contrib.split_real_and_imaginary(optax.adam(1e-2)),
    "hutchinson_estimator_diag_hessian": lambda: optax.contrib.hutchinson_estimator_diag_hessian(jax.random.key(0)),
    "dpsgd": lambda: optax.contrib.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=0),
    "differentially_private_aggregate": lambda: optax.chain(
        optax.contrib.differentially_private_aggregate(1.0, 0.5, key=jax.random.key(0)), optax.sgd(0.1)),
}
PARAMS = {"split_real_and_imaginary": _complex_params}

HELPERS = {
    "schedule_free_eval_params": "tests/test_optax_tools.py::test_schedule_free_eval_params",
}

_SLICES = r"coordinate slices[\s\S]*partition=\"leaf\""
_OBJ_FN = r"obj_fn[\s\S]*function of the whole\s+parameters[\s\S]*functools.partial\(inner.update"
_PER_EXAMPLE = r"per-example gradients[\s\S]*reduce=False"
# (case, partition) -> (error class, what its message must say); a partition of None: every partition.
REFUSED = {
    ("muon", "flat"): (zo.ZeroCouplingError, _SLICES),
    ("galore(rank=8)", "flat"): (zo.ZeroCouplingError, _SLICES),
    ("sophia", None): (zo.ZeroCouplingError, _OBJ_FN),
    ("hutchinson_estimator_diag_hessian", None): (zo.ZeroCouplingError, _OBJ_FN),
    ("dpsgd", None): (zo.ZeroCouplingError, _PER_EXAMPLE),
    ("differentially_private_aggregate", None): (zo.ZeroCouplingError, _PER_EXAMPLE),
}



def _value_of(case: str) -> bool:
    return case.split("(")[0] in VALUE_TAKERS


def _run_zero(tx, params, grads_seq, values):
    """`STEPS` steps of `tx` in the `shard_map` form (each device its own gradient): the parameters and state."""
    mesh = h.mesh_of(N)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))

    def step(params, state, grads, value):
        extra = {} if value is None else {"value": value}
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params, **extra)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                                 out_specs=(P(), P("data"))))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = init(params)
    for grads, value in zip(grads_seq, values):
        params, state = step(params, state, jax.device_put(grads, NamedSharding(mesh, P("data"))), value)
    return params, state


def _run_optax(tx, params, grads_seq, values):
    """Plain optax on one device fed the mean gradient."""
    state = tx.init(params)
    update = jax.jit(lambda g, s, p, v: tx.update(g, s, p, **({} if v is None else {"value": v})))
    for grads, value in zip(grads_seq, values):
        updates, state = update(h.reduced(grads), state, params, value)
        params = optax.apply_updates(params, updates)
    return params, state


def _refusal(case: str, partition: str):
    return REFUSED.get((case, partition)) or REFUSED.get((case, None))


ALL_CASES = {**OPTAX_CASES, **EXTRA_CASES}


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_contrib_optimizer_runs_or_is_refused(case, partition):
    make = ALL_CASES[case]
    params = PARAMS.get(case, _params)()
    grads_seq = h.gradient_sequence(params, N, STEPS)
    values = [jnp.float32(2.0 - 0.25 * t) if _value_of(case) else None for t in range(STEPS)]
    tx = zo.zero1(make(), axis_name="data", partition=partition)
    refusal = _refusal(case, partition)
    if refusal is not None:
        error, words = refusal
        with pytest.raises(error, match=words):
            _run_zero(tx, params, grads_seq, values)
        return
    try:
        got_params, got_state = _run_zero(tx, params, grads_seq, values)
    except zo.ZeroError as err:
        pytest.fail(f"zero1(partition={partition!r}) refused {case}; if that is right, add it to REFUSED with "
                    f"the words its message must say:\n{err}")
    want_params, want_state = _run_optax(make(), params, grads_seq, values)
    h.assert_matches(got_params, got_state, want_params, want_state)


class _NormState(NamedTuple):
    scale: jax.Array  # (): the norm of the parameters at init, shared by every leaf


def _scaled_by_init_norm() -> optax.GradientTransformation:
    """Scales the updates by the parameters' norm at init (as dog's `init` sets its first distance)."""
    return optax.GradientTransformation(lambda params: _NormState(optax.tree.norm(params)),
                                        lambda u, state, params=None: (optax.tree.scale(state.scale, u), state))


@pytest.mark.parametrize("partition", ["flat", "leaf", "auto"])
def test_shared_state_that_init_reads_from_the_parameters(partition):
    """A shared value that `init` computes from all the parameters is optax's on every device, not one computed
    from a device's slices or owned leaves (with Muon beside it, "auto" owns the matrices and slices the rest)."""
    make = lambda: optax.chain(_scaled_by_init_norm(), optax.contrib.muon(0.1) if partition == "auto" else
                               optax.sgd(0.1))
    params = _params()
    grads_seq = h.gradient_sequence(params, N, 2)
    tx = zo.zero1(make(), axis_name="data", partition=partition)
    got_params, got_state = _run_zero(tx, params, grads_seq, [None, None])
    want_params, want_state = _run_optax(make(), params, grads_seq, [None, None])
    h.assert_matches(got_params, got_state, want_params, want_state)
    np.testing.assert_allclose(h.full_state(got_state)["[0].scale"], optax.tree.norm(params), rtol=1e-6)


def test_shared_state_that_init_reads_from_the_parameters_under_accumulation():
    """The same under `accumulate_steps`, whose layout does not keep the inner `init`'s trace (zero1 traces it
    again to find the shared values read from the parameters): optax.MultiSteps on one device."""
    make = lambda: optax.chain(_scaled_by_init_norm(), optax.sgd(0.1))
    params = _params()
    grads_seq = h.gradient_sequence(params, N, 4)
    tx = zo.zero1(make(), axis_name="data", accumulate_steps=2)
    got_params, got_state = _run_zero(tx, params, grads_seq, [None] * 4)
    want_params, want_state = _run_optax(optax.MultiSteps(make(), 2), params, grads_seq, [None] * 4)
    for got, want in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    scale = h.full_state(got_state)[".inner[0].scale"]
    np.testing.assert_allclose(scale, want_state.inner_opt_state[0].scale, rtol=1e-6)
    np.testing.assert_allclose(scale, optax.tree.norm(params), rtol=1e-6)


def _public_names() -> list[str]:
    names = getattr(optax.contrib, "__all__", None)
    return sorted(names if names is not None else (n for n in dir(optax.contrib) if not n.startswith("_")))


def test_every_public_name_is_covered():
    """Each public name of optax.contrib is a case, the body of one (`scale_by_<case>`), a helper with its test,
    or a type; a name a later optax adds fails here until it is sorted into one of them."""
    runs = {case.split("(")[0] for case in ALL_CASES} | {e["opt_name"] for e in
                                                         optax_common._MAIN_OPTIMIZERS_UNDER_TEST}
    unplaced = []
    for name in _public_names():
        obj = getattr(optax.contrib, name)
        body = re.fullmatch(r"scale_by_(\w+)", name)
        if isinstance(obj, type) or name in runs or name in HELPERS or (body and body.group(1) in runs):
            continue
        unplaced.append(name)
    assert not unplaced, (f"optax.contrib names {unplaced} that this module does not cover: add a case "
                          "(EXTRA_CASES), a helper (HELPERS) with the test that covers it, or a refusal (REFUSED)")
    assert {case for case, _ in REFUSED} <= set(ALL_CASES)


def _with_function(fn=None):
    """A transformation whose update takes an optional function-valued extra argument `fn`."""
    def update(updates, state, params=None, fn=fn):
        del params
        return (updates if fn is None else jax.tree.map(fn, updates)), state
    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("form", ["shard_map", "mesh"])
def test_function_valued_extra_argument_refused_by_name(form):
    """A function passed to `update`, which zero1's `init` did not analyse, is refused naming the argument; the
    same function bound into the transformation runs, equal to plain optax."""
    params = _params()
    grads_seq = h.gradient_sequence(params, N, 1)
    double = lambda x: 2.0 * x
    mesh = h.mesh_of(N)
    if form == "mesh":
        tx = zo.zero1(optax.chain(optax.sgd(0.1), _with_function()), axis_name="data", mesh=mesh)
        placed = jax.device_put(params, NamedSharding(mesh, P()))
        call = lambda: tx.update(h.reduced(grads_seq[0]), tx.init(placed), placed, fn=double)
    else:
        tx = zo.zero1(optax.chain(optax.sgd(0.1), _with_function()), axis_name="data")
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))
        step = jax.jit(jax.shard_map(lambda g, s, p: tx.update(jax.tree.map(lambda x: x[0], g), s, p, fn=double),
                                     mesh=mesh, in_specs=(P("data"), P("data"), P()), out_specs=(P(), P("data"))))
        call = lambda: step(jax.device_put(grads_seq[0], NamedSharding(mesh, P("data"))), init(params), params)
    with pytest.raises(zo.ZeroStructureError, match=r"extra argument `fn`[\s\S]*function[\s\S]*"
                                                    r"functools.partial"):
        call()
    bound = lambda: optax.chain(optax.sgd(0.1), _with_function(double))
    got_params, got_state = _run_zero(zo.zero1(bound(), axis_name="data"), params, grads_seq, [None])
    want_params, want_state = _run_optax(bound(), params, grads_seq, [None])
    h.assert_matches(got_params, got_state, want_params, want_state)
    np.testing.assert_allclose(got_params["w"], params["w"] - 0.2 * h.reduced(grads_seq[0])["w"], rtol=1e-6,
                               atol=1e-7)  # (float32 rounding of values near zero: JAX 0.12.1 sums otherwise)



@pytest.mark.parametrize("partition", PARTITIONS)
def test_sophia_with_its_objective_bound_is_analysed(partition):
    """sophia's `obj_fn` bound into the transformation, as the refusal says: zero1 analyses the update with it and
    names what it cannot split (the Hessian estimate's random draw on slices, a sum over all the leaves)."""
    target = jax.tree.map(lambda x: jnp.full_like(x, 0.5), _params())

    def objective(params):
        return sum(jnp.sum((p - t) ** 2) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target)))

    sophia = optax.contrib.sophia(1e-2)
    bound = optax.GradientTransformationExtraArgs(sophia.init, functools.partial(sophia.update, obj_fn=objective))
    with pytest.raises(zo.ZeroCouplingError, match=r"_sophia\.py[\s\S]*(Flat slices|mixes parameter leaves|"
                                                   r"combines full reductions)"):
        _run_zero(zo.zero1(bound, axis_name="data", partition=partition), _params(),
                  h.gradient_sequence(_params(), N, 1), [None])
