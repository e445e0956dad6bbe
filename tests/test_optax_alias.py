"""optax's own `AliasTest`, with every optimizer wrapped in a mesh-bound zero1.

`optax/_src/alias_test.py` (shipped in the optax wheel that pip resolves) looks every optimizer up through its
module attribute `alias` (`_get_opt`, and `alias.sgd` in `test_explicit_dtype`). The classes here subclass its
`AliasTest`, swap that attribute for a namespace whose factories return
`zo.zero1(<the optax alias>, axis_name="data", mesh=mesh, partition=...)` and run each test under
`jax.set_mesh(mesh)`, the test bodies unchanged:

* `TestAliasZero1Auto`: every alias with `partition="auto"`;
* `TestAliasZero1Flat`: `partition="flat"`, for the aliases whose `init` the flat partition accepts (it refuses
  the others with `zo.ZeroCouplingError`; `_flat_aliases` probes each one at collection).

The quick cases run on all 8 simulated devices. `test_optimization` runs 10,000 jitted steps per case (each a
`shard_map` with collectives): those run on a sub-mesh of `CONVERGENCE_DEVICES` devices, and only in
`TestAliasZero1Auto` (for every alias the flat partition accepts, "auto" slices every leaf as "flat" does: the
same layout and program). The environment
variable `ZERO_OPTAX_ALIAS_TESTS` says what runs, as a comma-separated set of `auto` (the quick cases of
`TestAliasZero1Auto`), `flat` (those of `TestAliasZero1Flat`) and `convergence` (the `test_optimization` cases),
or one of `quick` (the default: `auto,flat`), `all` (`auto,flat,convergence`) and `off` (this module skipped).
`.ci/run` sets `auto,convergence` in its Python 3.11 venv, leaves the newest venv at `quick` (both venvs resolve
the same optax, so each case of optax's suite runs through each partition at least once and through "auto" on
both JAX ends), and sets `off` in its floors venv (the same JAX and optax as the 3.11 venv), to keep the three
venvs within their time budget.

Cases that fail through zero1 today are strict expected failures (`_XFAIL`, one reason per category), so a fix
that makes one pass fails the suite until its row is removed. Cases that optax itself skips are skipped here too.
A failure inside one of the tests' `self.subTest` blocks fails its case (as under a runner without subtests): the
subclasses' `subTest` lets it through, since pytest >= 9 would report it apart and pass the case itself.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import types
import warnings

import pytest

_RUN = os.environ.get("ZERO_OPTAX_ALIAS_TESTS") or "quick"
_PARTS = {"quick": {"auto", "flat"}, "all": {"auto", "flat", "convergence"}, "off": set()}
RUN = frozenset(_PARTS[_RUN] if _RUN in _PARTS else _RUN.split(","))
if not RUN <= {"auto", "flat", "convergence"}:
    raise ValueError("ZERO_OPTAX_ALIAS_TESTS must be quick, all, off or a comma-separated set of auto, flat and "
                     f"convergence, got {_RUN!r}")
if not RUN & {"auto", "flat"}:
    pytest.skip(f"ZERO_OPTAX_ALIAS_TESTS={_RUN}", allow_module_level=True)
for _module in ("absl", "scipy", "sklearn"):  # optax's own tests need them (the `test` extra installs them)
    pytest.importorskip(_module)

import jax
import jax.numpy as jnp
import optax
from optax._src import alias as _optax_alias
from optax._src import alias_test as _alias_test

import zero_optax as zo

QUICK_DEVICES = 8
CONVERGENCE_DEVICES = 2
_CONVERGENCE_METHOD = "test_optimization"


def _mesh(devices: int) -> jax.sharding.Mesh:
    return jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])


class _Zero1Aliases:
    """Stands in for `optax._src.alias`: each optimizer factory returns its transformation wrapped in zero1."""

    def __init__(self, mesh: jax.sharding.Mesh, partition: str):
        self._mesh, self._partition = mesh, partition

    def __getattr__(self, name):
        factory = getattr(_optax_alias, name)
        if not callable(factory) or isinstance(factory, type):
            return factory

        @functools.wraps(factory)  # inject_hyperparams reads the factory's signature
        def wrapped(*args, **kwargs):
            tx = factory(*args, **kwargs)
            if not isinstance(tx, optax.GradientTransformation):
                return tx
            return zo.zero1(tx, axis_name="data", mesh=self._mesh, partition=self._partition)

        return wrapped


@functools.cache
def _flat_aliases() -> frozenset[str]:
    """The aliases (of `_OPTIMIZERS_UNDER_TEST`, with every keyword set it lists) whose `init` the flat partition
    accepts, on a one-leaf vector and on a tree of a matrix and a 3-D array."""
    mesh = _mesh(QUICK_DEVICES)
    trees = (jnp.array([-1.0, 10.0, 1.0]), [jnp.ones((2, 3)), jnp.ones((2, 5, 2))])
    refused = set()
    with jax.set_mesh(mesh):
        for case in _alias_test._OPTIMIZERS_UNDER_TEST:
            name = case["opt_name"]
            if name in refused:
                continue
            with warnings.catch_warnings():  # optimistic_adam is deprecated
                warnings.simplefilter("ignore", DeprecationWarning)
                tx = getattr(_Zero1Aliases(mesh, "flat"), name)(**case["opt_kwargs"])
            if any(_refuses(tx, tree) for tree in trees):
                refused.add(name)
    return frozenset(c["opt_name"] for c in _alias_test._OPTIMIZERS_UNDER_TEST) - refused


def _refuses(tx, params) -> bool:
    """Whether zero1 refuses `tx` at `init` (`zo.ZeroCouplingError`); any other error is left to the cases."""
    try:
        tx.init(params)
    except zo.ZeroCouplingError:
        return True
    except Exception:  # noqa: BLE001 (not a refusal: the cases show it)
        return False
    return False


def _case_params(test) -> dict:
    """The parameters absl's `parameterized` bound to a generated test method (kept in its closure)."""
    for cell in test.__closure__ or ():
        if isinstance(cell.cell_contents, dict):
            return cell.cell_contents
    raise AssertionError(f"cannot read the parameters of {test.__name__}: absl's parameterized has changed")


def _describe(value) -> str:
    if isinstance(value, types.FunctionType):
        return value.__name__.removeprefix("_setup_")
    if isinstance(value, dict):
        return "(" + ",".join(f"{k}={v}" for k, v in value.items()) + ")"
    if isinstance(value, type):
        return jnp.dtype(value).name
    return str(value)


def _case_key(partition: str, method: str, params: dict) -> str:
    """`<partition> <method> <opt_name>[(<opt_kwargs>)] <other parameters>`, what the patterns of `_XFAIL` match,
    e.g. `auto test_optimization novograd(learning_rate=0.001) target=parabola dtype=complex64`."""
    params = dict(params)
    name = params.pop("opt_name", "")
    if "opt_kwargs" in params:
        name += _describe(params.pop("opt_kwargs"))
    rest = " ".join(f"{k}={_describe(v)}" for k, v in params.items())
    return " ".join(part for part in (partition, method, name, rest) if part)


# Cases that fail through zero1 today, by category: (reason, fnmatch patterns over `_case_key`); the first category
# with a matching pattern gives a case its reason. Each is a strict xfail: a case that starts to pass fails the
# suite until its pattern goes.
_XFAIL: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _marks(key: str) -> list:
    for reason, patterns in _XFAIL:
        if any(fnmatch.fnmatchcase(key, p) for p in patterns):
            return [pytest.mark.xfail(strict=True, reason=reason)]
    return []


def _case(test, marks):
    @functools.wraps(test)
    def case(self):
        return test(self)

    case.pytestmark = marks
    return case


def _wrapped_alias_test(partition: str, aliases: frozenset[str] | None):
    """A subclass of optax's `AliasTest` that runs its cases (those of `aliases`, or all) through zero1."""
    namespace = {"__test__": True, "__module__": __name__, "partition": partition}
    for name in dir(_alias_test.AliasTest):
        test = getattr(_alias_test.AliasTest, name)
        if not name.startswith("test") or not callable(test):
            continue
        method = name.rstrip("0123456789")
        params = _case_params(test)
        opt_name = {"sgd_mom": "sgd"}.get(params["opt_name"], params["opt_name"])  # test_explicit_dtype's name
        if aliases is not None and opt_name not in aliases:
            namespace[name] = None  # not collected
            continue
        namespace[name] = _case(test, _marks(_case_key(partition, method, params)))

    def setUp(self):
        convergence = self._testMethodName.startswith(_CONVERGENCE_METHOD)
        if convergence and "convergence" not in RUN:
            self.skipTest("10,000-step convergence case: ZERO_OPTAX_ALIAS_TESTS=all (or with convergence) runs it")
        if convergence and partition == "flat":
            self.skipTest("10,000-step convergence case: for an alias the flat partition accepts, \"auto\" slices "
                          "every leaf as \"flat\" does, so TestAliasZero1Auto runs the same program")
        super(cls, self).setUp()
        mesh = _mesh(CONVERGENCE_DEVICES if convergence else QUICK_DEVICES)
        original = _alias_test.alias
        _alias_test.alias = _Zero1Aliases(mesh, partition)
        self.addCleanup(setattr, _alias_test, "alias", original)
        self.enterContext(jax.set_mesh(mesh))

    @contextlib.contextmanager
    def subTest(self, msg=None, **params):
        # A failure in a subtest fails the case where it happens, as unittest does under a runner without subtest
        # support: pytest >= 9 reports subtests apart and then counts a strict-xfail case that failed only inside
        # one as XPASS(strict). The note names the subtest.
        try:
            yield
        except Exception as e:
            e.add_note(f"in subTest {msg!r}" + "".join(f", {k}={v!r}" for k, v in params.items()))
            raise

    namespace["setUp"] = setUp
    namespace["subTest"] = subTest
    cls = type(f"TestAliasZero1{partition.capitalize()}", (_alias_test.AliasTest,), namespace)
    return cls


if "auto" in RUN:
    TestAliasZero1Auto = _wrapped_alias_test("auto", None)
if "flat" in RUN:
    TestAliasZero1Flat = _wrapped_alias_test("flat", _flat_aliases())
