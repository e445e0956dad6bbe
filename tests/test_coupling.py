"""Tests for the coupling analysis (`zero_optax.analysis._coupling`) and its test-only forms
(`tests/_coupling_forms.py`)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests._coupling_forms import find_coordinate_coupling, find_leaf_coupling, program_signature
from zero_optax.analysis._coupling import analyze_leaves
from zero_optax.core._errors import ZeroCouplingError as CouplingError

PARAMS = {"a": jnp.ones((4, 3)), "b": jnp.ones((5,)), "c": jnp.ones(())}
BIG = {"a": jnp.ones((4, 3)), "d": jnp.ones((130, 129))}  # adafactor factors dims >= 128.


def _update(tx):
    return lambda g, s, p: tx.update(g, s, p)


def _coord(tx, params=PARAMS):
    return find_coordinate_coupling(_update(tx), params, tx.init(params), params)


def _leaf(tx, params=PARAMS):
    labels = jax.tree_util.tree_unflatten(jax.tree.structure(params), range(len(jax.tree.leaves(params))))
    return find_leaf_coupling(_update(tx), params, tx.init(params), params, sources=(labels, None, labels))


ELEMENTWISE = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "adamw_masked": lambda: optax.adamw(1e-3, mask={"a": True, "b": False, "c": False}),
    "lion": lambda: optax.lion(1e-3),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adagrad": lambda: optax.adagrad(1e-3),
    "adabelief": lambda: optax.adabelief(1e-3),
    "warmup_cosine": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)),
    "join_schedules": lambda: optax.adam(optax.join_schedules(
        [optax.constant_schedule(1e-3), optax.linear_schedule(1e-3, 0.0, 10), optax.constant_schedule(0.0)],
        [5, 15])),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-3), 3).gradient_transformation(),
    "masked": lambda: optax.masked(optax.adam(1e-3), {"a": True, "b": False, "c": True}),
    "partition": lambda: optax.partition(
        {"a": optax.adam(1e-3), "f": optax.set_to_zero()}, {"a": "a", "b": "f", "c": "a"}),
    "chain": lambda: optax.chain(optax.scale_by_adam(), optax.scale(-1e-3)),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_optimizers_are_clean(name):
    tx = ELEMENTWISE[name]()
    assert _coord(tx) is None
    assert _leaf(tx) is None


@pytest.mark.parametrize("make, primitive, where", [
    (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "reduce_sum", "clip_by_global_norm"),
    (lambda: optax.adafactor(1e-3), "reduce_sum", "factor"),
    (lambda: optax.contrib.muon(1e-3), "", "muon"),
    (lambda: optax.lamb(1e-3), "reduce_sum", "trust_ratio"),
    (lambda: optax.apply_if_finite(optax.adam(1e-3), 3), "reduce_and", "apply_if_finite"),
], ids=["clip_by_global_norm", "adafactor", "muon", "lamb", "apply_if_finite"])
def test_coordinate_coupling_is_flagged(make, primitive, where):
    msg = _coord(make(), BIG)
    assert msg is not None
    assert msg.startswith(f"`{primitive}") and where in msg, msg


def test_message_names_primitive_and_optax_location():
    msg = _coord(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    assert msg.startswith("`reduce_sum` at optax/"), msg
    assert "clip_by_global_norm.<locals>.update_fn" in msg


@pytest.mark.parametrize("make", [
    lambda: optax.contrib.muon(1e-3),
    lambda: optax.adafactor(1e-3),
    lambda: optax.lamb(1e-3),
    lambda: optax.adamw(1e-3),
], ids=["muon", "adafactor", "lamb", "adamw"])
def test_per_leaf_optimizers_have_no_leaf_coupling(make):
    assert _leaf(make(), BIG) is None


def test_global_norm_clipping_couples_leaves():
    msg = _leaf(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    assert msg is not None and "mixes parameter leaves" in msg, msg
    assert "clip_by_global_norm" in msg


def test_apply_if_finite_couples_leaves():
    assert _leaf(optax.apply_if_finite(optax.adam(1e-3), 3)) is not None


def test_leaf_sources_with_state_labels_and_structs():
    """Labels on the state too, abstract inputs, and None / MaskedNode in the args."""
    tx = optax.masked(optax.adam(1e-3), {"a": True, "b": False, "c": True})
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
    state = jax.eval_shape(tx.init, structs)
    labels = {"a": 0, "b": 1, "c": 2}

    def state_label(path, _):
        keys = [getattr(k, "key", None) for k in path]
        return next((labels[k] for k in keys if k in labels), None)

    state_labels = jax.tree_util.tree_map_with_path(state_label, state)
    assert find_leaf_coupling(_update(tx), structs, state, structs, sources=(labels, state_labels, labels)) is None
    assert find_coordinate_coupling(_update(tx), structs, state, None) is None
    assert find_coordinate_coupling(lambda g, m, n: g, structs, optax.MaskedNode(), None) is None


def test_leaf_sources_must_match_args():
    with pytest.raises(ValueError):
        find_leaf_coupling(lambda x, y: x + y, jnp.ones(3), jnp.ones(3), sources=(0,))


X = jnp.ones((4, 3))


@pytest.mark.parametrize("fn", [
    lambda x: jnp.where(x > 0, x, 2 * x),
    lambda x: jnp.where(x.reshape(-1) > 0, 1.0, 0.0).reshape(4, 3),
    lambda x: x[None, :, :] * 2,
    lambda x: jnp.sum(x[:, :, None], axis=2),
    lambda x: jnp.transpose(x[:, None, :], (1, 0, 2)),
    lambda x: jax.jit(lambda y: jax.nn.relu(y) + jax.nn.sigmoid(y))(x),
    lambda x: jax.checkpoint(lambda y: jnp.sqrt(y * y + 1))(x),
    lambda x: jax.lax.fori_loop(0, 3, lambda i, y: y * 0.5 + 1.0, x),
    lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1],
    lambda x: jax.lax.cond(jnp.ones(()) > 0, lambda y: y + 1, lambda y: y - 1, x),
    lambda x: x * jnp.sum(jnp.arange(3.0)),
], ids=["where", "reshape", "unit_broadcast", "unit_reduce", "unit_transpose", "jit_custom_jvp", "remat",
        "fori_loop", "while", "cond_untainted", "reduce_constant"])
def test_elementwise_constructs_are_clean(fn):
    assert find_coordinate_coupling(fn, X) is None


@pytest.mark.parametrize("fn, primitive", [
    (lambda x: x / jnp.max(x), "reduce_max"),
    (lambda x: x.T * 1, "transpose"),
    (lambda x: x @ jnp.ones((3, 3)), "dot_general"),
    (lambda x: x[::-1], "rev"),
    (lambda x: jnp.cumsum(x, axis=0), "cumsum"),
    (lambda x: jnp.broadcast_to(x[0], (4, 3)), ""),
    (lambda x: jax.lax.scan(lambda c, r: (c + r, c), jnp.zeros(3), x)[0], "scan"),
    (lambda x: jax.lax.cond(x[0, 0] > 0, lambda y: y, lambda y: -y, x), ""),
    (lambda x: jax.lax.while_loop(lambda y: y[0, 0] < 3, lambda y: y + 1, x), ""),
    (lambda x: jnp.sort(x, axis=0), "sort"),
    (lambda x: jax.lax.reduce((x, x), (0.0, 1.0), lambda a, b: (a[0] + b[0], a[1] * b[1]), (0,))[0], "reduce"),
    (lambda x: jax.lax.reduce_window(x, 0.0, lambda a, b: a + jnp.abs(b), (2, 1), (1, 1), "VALID"),
     "reduce_window"),
], ids=["max", "transpose", "matmul", "rev", "cumsum", "broadcast", "scan_xs", "cond_pred", "while_pred", "sort",
        "generic_reduce", "generic_reduce_window"])
def test_coupling_constructs_are_flagged(fn, primitive):
    msg = find_coordinate_coupling(fn, X)
    assert msg is not None and msg.startswith(f"`{primitive}"), msg


def test_scalars_are_not_coordinate_sources():
    assert find_coordinate_coupling(lambda x, c: x * jnp.sum(c * jnp.ones(3)), X, jnp.ones(())) is None


def test_leaf_mode_rules():
    a, b = jnp.ones((4, 3)), jnp.ones((4, 3))
    assert find_leaf_coupling(lambda x, y: (x @ x.T, jnp.sum(y)), a, b, sources=(0, 1)) is None
    assert find_leaf_coupling(lambda x, y: x * y, a, b, sources=(0, None)) is None
    assert find_leaf_coupling(lambda x, y: x * y, a, b, sources=(0, 1)) is not None
    assert find_leaf_coupling(lambda x, y: jax.jit(lambda u, v: (u + 1, v * 2))(x, y), a, b, sources=(0, 1)) is None
    branchy = lambda x, y: jax.lax.cond(jnp.sum(x) > 0, lambda u: u, lambda u: -u, y)
    assert "branch predicate" in find_leaf_coupling(branchy, a, b, sources=(0, 1))
    assert find_leaf_coupling(branchy, a, b, sources=(0, None)) is None
    carry = lambda x, y: jax.lax.fori_loop(0, 3, lambda i, c: (c[1], c[0]), (x, y))
    assert find_leaf_coupling(lambda x, y: sum(jnp.sum(t) for t in carry(x, y)), a, b, sources=(0, None)) is None
    assert find_leaf_coupling(lambda x, y: carry(x, y)[0] * 1 + carry(x, y)[1], a, b, sources=(0, 1)) is not None


# --- Soundness: random numbers, position-dependent values, opaque primitives -------------------------------------

def _rng_tx(raw_key: bool, noisy: bool):
    """A transformation carrying a PRNG key in its state; adds noise to the updates if `noisy`."""

    def init(params):
        del params
        return jax.random.PRNGKey(0) if raw_key else jax.random.key(0)

    def update(updates, key, params=None):
        del params
        key, sub = jax.random.split(key)
        if noisy:
            leaves, treedef = jax.tree.flatten(updates)
            subs = jax.random.split(sub, len(leaves))
            updates = treedef.unflatten([g + jax.random.normal(k, g.shape) for g, k in zip(leaves, subs)])
        return updates, key

    return optax.GradientTransformation(init, update)


def _state_labels(params, state):
    """Labels each state leaf by the first parameter key on its path (None: shared state)."""
    labels = dict(zip(sorted(params), range(len(params))))
    return jax.tree_util.tree_map_with_path(
        lambda path, _: next((labels[k.key] for k in path if getattr(k, "key", None) in labels), None), state)


def _analyze(tx, params, **kwargs):
    labels = dict(zip(sorted(params), range(len(params))))
    state = tx.init(params)
    return analyze_leaves(_update(tx), params, state, params, sources=(labels, _state_labels(params, state), labels),
                          **kwargs)


@pytest.mark.parametrize("make", [
    lambda: optax.chain(optax.add_noise(0.1, 0.55, key=jax.random.key(0)), optax.adam(1e-3)),
    lambda: _rng_tx(raw_key=False, noisy=True),
    lambda: _rng_tx(raw_key=True, noisy=True),
    lambda: optax.chain(optax.set_to_zero(), optax.add_noise(0.1, 0.55, key=jax.random.key(0))),
], ids=["add_noise", "typed_key", "raw_key", "noise_only"])
def test_random_numbers_in_updates_are_refused_in_every_mode(make):
    """Noise added to the updates, or (noise_only) replacing them: it reaches the outputs but meets no gradient."""
    tx = make()
    msg = _leaf(tx)
    assert msg is not None and msg.startswith("`random_bits` at ") and "draws random numbers" in msg, msg
    with pytest.raises(CouplingError, match="^`random_bits` at "):
        _analyze(tx, PARAMS)
    assert _coord(tx) is not None  # A raw u32[2] key is a tainted input there: `random_wrap` is not elementwise.


def test_add_noise_message_names_random_primitive_and_location():
    msg = _coord(optax.chain(optax.add_noise(0.1, 0.55, key=jax.random.key(0)), optax.adam(1e-3)))
    assert msg.startswith("`random_bits` at optax/"), msg
    assert "add_noise.<locals>.update_fn" in msg and "meet parameter-derived values in `add`" in msg, msg


@pytest.mark.parametrize("raw_key", [False, True], ids=["typed_key", "raw_key"])
def test_prng_key_in_shared_state_is_fine(raw_key):
    tx = optax.chain(_rng_tx(raw_key=raw_key, noisy=False), optax.adam(1e-3))
    assert _leaf(tx) is None
    assert _analyze(tx, PARAMS).coupled == frozenset()
    if not raw_key:  # Coordinate mode taints every non-scalar input, the raw u32[2] key too.
        assert _coord(tx) is None


def test_random_numbers_may_reach_outputs_labelled_shared():
    def fn(g, key):
        return g * 2, jax.random.normal(key, (3,))

    args = (X, jax.random.key(0))
    assert find_leaf_coupling(fn, *args, sources=(0, None)).startswith("`random_bits`")
    assert find_leaf_coupling(fn, *args, sources=(0, None), out_sources=(0, None)) is None
    assert "output of parameter leaf 0" in find_leaf_coupling(fn, *args, sources=(0, None), out_sources=(None, 0))
    assert analyze_leaves(fn, *args, sources=(0, None), out_sources=(0, None)).coupled == frozenset()


@pytest.mark.parametrize("fn, primitive", [
    (lambda x: x * jnp.arange(3.0), "iota"),
    (lambda x: x * jnp.tri(4, 3), "iota"),
    (lambda x: jnp.where(jnp.indices((4, 3))[0] > 1, x, 0.0), "iota"),
    (lambda x: x * np.arange(3.0), "mul"),  # A non-scalar constant.
    (lambda x: x * jnp.zeros(3).at[1].set(1.0), "scatter"),
    (lambda x: x * jnp.concatenate([jnp.zeros(1), jnp.ones(2)]), "concatenate"),
    (lambda x: x * jnp.cumsum(jnp.ones(3)), "cumsum"),
    (lambda x: x * jax.lax.scan(lambda c, _: (c + 1.0, c), 0.0, None, length=3)[1], "scan"),
    (lambda x: x * jax.jit(lambda: jnp.arange(3.0))(), "iota"),
], ids=["arange", "tri", "indices", "constant", "scatter", "concatenate", "cumsum", "scan_ys", "jit"])
def test_position_dependent_values_meeting_parameters_are_refused(fn, primitive):
    msg = find_coordinate_coupling(fn, X)
    assert msg is not None and msg.startswith(f"`{primitive}`"), msg
    assert "wrong coordinates" in msg, msg
    assert find_leaf_coupling(fn, X, sources=(0,)) is None  # Whole tensors: positions are right.
    assert analyze_leaves(fn, X, sources=(0,)).coupled == {0}


@pytest.mark.parametrize("fn", [
    lambda x: x + jnp.zeros_like(x),
    lambda x: x * jnp.full((4, 3), 2.0),
    lambda x: x * jnp.ones(3)[::-1],
    lambda x: x * jnp.sum(jnp.arange(12.0).reshape(4, 3)),
    lambda x: x * jnp.array(2.0),
    lambda x: x * jnp.ones((4, 3)).T.T,
], ids=["zeros_like", "full", "reversed_ones", "sum_of_iota", "scalar_constant", "transposed_ones"])
def test_uniform_values_are_not_positional(fn):
    assert find_coordinate_coupling(fn, X) is None


def test_non_scalar_shared_inputs_are_positional():
    vector_hyperparameter = lambda g, v, c: g * v * c
    r = analyze_leaves(vector_hyperparameter, X, jnp.ones(3), jnp.ones(()), sources=(0, None, None))
    assert r.coupled == {0} and "non-scalar shared state" in r.reasons[0], r.reasons
    assert find_leaf_coupling(vector_hyperparameter, X, jnp.ones(3), jnp.ones(()), sources=(0, None, None)) is None
    assert analyze_leaves(lambda g, c: g * c, X, jnp.ones(()), sources=(0, None)).coupled == frozenset()


def _callback(x):
    return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _pallas(x):
    from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _ffi(x):
    return jax.ffi.ffi_call("zero_optax_test_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


@pytest.mark.parametrize("kernel, primitive, what", [
    (_callback, "pure_callback", "host callback"),
    (_pallas, "pallas_call", "opaque kernel (custom call / Pallas)"),
    (_ffi, "ffi_call", "opaque kernel (custom call / Pallas)"),
], ids=["pure_callback", "pallas_call", "ffi_call"])
def test_opaque_primitives(kernel, primitive, what):
    consumes = find_coordinate_coupling(kernel, X)
    assert consumes.startswith(f"`{primitive}` at ") and what in consumes and "consumes" in consumes, consumes
    produces = find_coordinate_coupling(lambda x: x * kernel(jnp.ones((4, 3))), X)  # Made from nothing.
    assert produces.startswith(f"`{primitive}` at ") and "combines it with a parameter-derived" in produces, produces
    assert find_coordinate_coupling(lambda x: x * jnp.sum(kernel(jnp.ones((4, 3)))), X) is None  # A scalar.
    assert find_leaf_coupling(lambda x, y: (kernel(x), y), X, X, sources=(0, 1)) is None
    assert "mixes parameter leaves [0, 1]" in find_leaf_coupling(lambda x, y: kernel(x) * y, X, X, sources=(0, 1))
    r = analyze_leaves(lambda x, y: (kernel(x), y * 2), X, X, sources=(0, 1))
    assert r.coupled == {0} and r.reasons[0].startswith(f"`{primitive}`") and r.output_taints == ({0}, {1})


def test_opaque_primitive_seeing_two_leaves_mixes_them():
    both = lambda x, y: jax.pure_callback(lambda a, b: np.asarray(a) + b, jax.ShapeDtypeStruct(x.shape, x.dtype), x, y)
    assert find_leaf_coupling(both, X, X, sources=(0, 1)).startswith("`pure_callback` at ")
    assert find_leaf_coupling(both, X, X, sources=(0, None)) is None
    with pytest.raises(CouplingError, match="mixes parameter leaves"):
        analyze_leaves(both, X, X, sources=(0, 1))


def test_debug_print_is_harmless():
    assert find_coordinate_coupling(lambda x: (jax.debug.print("{}", x), x * 2)[1], X) is None


# --- program_signature --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: optax.adamw(1e-3), lambda: optax.adam(1e-3), lambda: optax.lion(1e-3),
    lambda: optax.sgd(1e-2, momentum=0.9), lambda: optax.adabelief(1e-3),
], ids=["adamw", "adam", "lion", "sgd", "adabelief"])
def test_signature_is_the_same_on_a_parameter_and_its_slice(make):
    tx = make()
    full, part = {"a": jax.ShapeDtypeStruct((5, 7), jnp.float32)}, {"a": jax.ShapeDtypeStruct((5,), jnp.float32)}
    sig = program_signature(_update(tx), full, jax.eval_shape(tx.init, full), full)
    assert sig == program_signature(_update(tx), part, jax.eval_shape(tx.init, part), part)
    assert any("(" in entry for entry in sig), sig  # Literal values are part of it.


@pytest.mark.parametrize("fn", [
    lambda g: g * (1.0 / g.size),
    lambda g: g / g.shape[0],
    lambda g: jnp.where(g.shape[0] > 6, g, 2 * g),
    lambda g: g * jnp.float32(g.ndim),  # A scalar constant.
], ids=["inverse_size", "divide_by_rows", "where_on_shape", "scalar_constant"])
def test_signature_sees_shape_dependent_literals(fn):
    assert program_signature(fn, jnp.ones((5, 7))) != program_signature(fn, jnp.ones((7,)))


def test_signature_entries():
    """Non-shape parameters, literals (also passed into a jit), captured scalars; no axes, shapes or indices."""
    captured = jnp.float32(3.0) + 1

    def fn(g):
        return jnp.sum(g ** 2, axis=0) * 0.5 + jax.jit(lambda y, c: y - c)(g[0], 3.0) * captured

    sig = program_signature(fn, jnp.ones((5, 7)))
    assert sig == ["integer_pow[y=2]", "reduce_sum", "mul(_,0.5)", "slice", "sub(_,3.0)", "mul(_,4.0)", "add"], sig


# --- analyze_leaves -----------------------------------------------------------------------------------------------

AUTO = {"emb": jnp.ones((10, 6)), "w": jnp.ones((6, 6)), "b": jnp.ones((6,)), "s": jnp.ones(())}
LABEL = dict(zip(sorted(AUTO), range(len(AUTO))))  # b: 0, emb: 1, s: 2, w: 3.


def _coupled_names(tx, params=AUTO):
    names = sorted(params)
    return {names[i] for i in _analyze(tx, params).coupled}


def test_analyze_muon_couples_matrices_only():
    r = _analyze(optax.contrib.muon(1e-3), AUTO)
    assert r.coupled == {LABEL["emb"], LABEL["w"]}
    assert set(r.reasons) == set(r.coupled) and all("muon" in m for m in r.reasons.values()), r.reasons


def test_analyze_partition_with_adam_embedding():
    labels = {"emb": "adam", "w": "muon", "b": "adam", "s": "adam"}
    tx = optax.partition({"muon": optax.contrib.muon(1e-3), "adam": optax.adamw(1e-3)}, labels)
    assert _coupled_names(tx) == {"w"}


def test_analyze_adamw_output_taints():
    tx = optax.adamw(1e-3)
    r = _analyze(tx, AUTO)
    assert r.coupled == frozenset() and r.reasons == {}
    out = jax.eval_shape(_update(tx), AUTO, tx.init(AUTO), AUTO)
    updates, state = jax.tree.unflatten(jax.tree.structure(out), r.output_taints)
    assert updates == {k: frozenset({i}) for k, i in LABEL.items()}
    assert state[0].count == frozenset()
    assert state[0].mu == state[0].nu == updates


def test_analyze_adafactor():
    """Factored moments couple the large matrix; block-RMS update clipping (on by default) reduces every leaf."""
    params = dict(AUTO, big=jnp.ones((130, 129)))
    assert _coupled_names(optax.adafactor(1e-3), params) == {"b", "emb", "w", "big"}  # Not the scalar `s`.
    plain = optax.adafactor(1e-3, clipping_threshold=None, multiply_by_parameter_scale=False)
    r = _analyze(plain, params)
    assert r.coupled == {sorted(params).index("big")}
    assert "factorized" in r.reasons[sorted(params).index("big")], r.reasons


def test_analyze_refuses_leaf_mixing():
    with pytest.raises(CouplingError, match="mixes parameter leaves") as e:
        _analyze(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), AUTO)
    assert "clip_by_global_norm" in str(e.value)


def test_analyze_refuses_random_numbers():
    with pytest.raises(CouplingError, match="^`random_bits` at .*add_noise"):
        _analyze(optax.chain(optax.add_noise(0.1, 0.55, key=jax.random.key(0)), optax.adam(1e-3)), AUTO)


def test_analyze_position_mask_couples_its_leaf():
    def update(updates, state, params=None):
        del params
        return dict(updates, w=updates["w"] * jnp.tri(6)), state  # Lower-triangular updates for `w`.

    tx = optax.chain(optax.GradientTransformation(lambda p: optax.EmptyState(), update), optax.adam(1e-3))
    r = _analyze(tx, AUTO)
    assert r.coupled == {LABEL["w"]} and r.reasons[LABEL["w"]].startswith("`iota`"), r.reasons


def test_analyze_control_dependence():
    a, b = jnp.ones((4, 3)), jnp.ones((4, 3))
    same = lambda x, y: (jax.lax.cond(jnp.sum(x) > 0, lambda u: u, lambda u: -u, x), y)
    assert analyze_leaves(same, a, b, sources=(0, 1)).coupled == {0}
    other = lambda x, y: jax.lax.cond(jnp.sum(x) > 0, lambda u: u, lambda u: -u, y)
    with pytest.raises(CouplingError, match="branch predicate depends on a leaf"):
        analyze_leaves(other, a, b, sources=(0, 1))
    scalar = lambda s, y: jax.lax.cond(s > 0, lambda u: u, lambda u: -u, y)  # A scalar leaf has one coordinate.
    r = analyze_leaves(scalar, jnp.ones(()), b, sources=(0, None))
    assert r.coupled == frozenset() and r.output_taints == ({0},)


def test_analyze_sources_must_match_args():
    with pytest.raises(ValueError):
        analyze_leaves(lambda x, y: x + y, X, X, sources=(0,))


def test_analyze_is_fast_on_many_leaves():
    """1000 leaves: one trace and one linear pass (no per-leaf re-tracing, no growing unions)."""
    params = {f"p{i:04d}": jax.ShapeDtypeStruct((3, 2), jnp.float32) for i in range(1000)}
    tx = optax.adamw(1e-3)
    state = jax.eval_shape(tx.init, params)
    labels = dict(zip(sorted(params), range(len(params))))
    start = time.perf_counter()
    r = analyze_leaves(_update(tx), params, state, params, sources=(labels, _state_labels(params, state), labels))
    print(f"analyze_leaves(adamw, 1000 leaves): {time.perf_counter() - start:.2f} s")
    assert r.coupled == frozenset() and r.output_taints[:1000] == tuple(frozenset({i}) for i in range(1000))
