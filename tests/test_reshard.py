"""Tests for zero_optax.reshard (`checkpoint/_offline`), reshard_explicit / load_rank_records
(`checkpoint/_rank_migration`) and the
`python -m zero_optax.reshard` command line.

The oracle: plain optax on one device fed the mean gradient. A run trains on N devices, saves through Orbax,
reshards to M, restores into `tx.init` on M devices and continues; it must match the uninterrupted oracle.
"""

import functools
import io
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from zero_optax.checkpoint import _paths, _record, _store
from zero_optax.core import _names

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"a": (5, 3), "b": (), "c": (7,), "m": (4, 6)}
STEPS_BEFORE, STEPS_AFTER = 2, 2
ITEM = "opt_state"

INNER = {
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=1e-2), "flat"),
    "muon": (lambda: optax.contrib.muon(1e-2), "leaf"),
    "adafactor": (lambda: optax.adafactor(1e-2), "leaf"),
    # bf16 first moments, f16 second moments, and a frozen leaf "c" without history
    "masked": (lambda: optax.masked(optax.adam(1e-2, mu_dtype=jnp.bfloat16), {"a": True, "b": True, "c": False,
                                                                               "m": True}), "flat"),
}
TOL = {"flat": 2e-5, "leaf": 5e-5}


# ------------------------------------------------------------------------------------------------ training


def params_np() -> dict:
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in SHAPES.items()}


def mean_grads(t: int) -> dict:
    """The global (mean) gradient of step t, the same for every world size (multiples of 2**-8)."""
    rng = np.random.default_rng(100 + t)
    return {k: (np.round(rng.standard_normal(s) * 256) / 256).astype(np.float32) for k, s in SHAPES.items()}


def device_grads(t: int, n: int) -> dict:
    """Per-device gradients `[n, *shape]` whose mean over devices is exactly `mean_grads(t)` in float32.

    Every value is a small multiple of 2**-8, so the sums any reduction order forms are exact, and so is the
    division of the sum by n; bf16 moments then see bit-identical gradients at every world size.
    """
    rng = np.random.default_rng(200 + t * 10 + n)
    out = {}
    for k, g in mean_grads(t).items():
        noise = np.round(rng.standard_normal((n, *g.shape)) * 256) / 256
        noise[-1] -= noise.sum(0)
        out[k] = (g + noise).astype(np.float32)
    return out


class Trainer:
    def __init__(self, kind: str, n: int, owners=None):
        inner, partition = INNER[kind]
        self.n, self.mesh = n, jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        self.tx = zo.zero1(inner(), axis_name="data", partition=partition, owners=owners)
        self.init = jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=P(), out_specs=P("data")))

        def step(p, s, g):
            u, s = self.tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s

        self._step = jax.jit(jax.shard_map(step, mesh=self.mesh, in_specs=(P(), P("data"), P("data")),
                                           out_specs=(P(), P("data"))))

    def train(self, p, s, start: int, stop: int):
        for t in range(start, stop):
            g = jax.device_put(device_grads(t, self.n), NamedSharding(self.mesh, P("data")))
            p, s = self._step(p, s, g)
        return p, s


@functools.cache
def trainer(kind: str, n: int, owners=None) -> Trainer:
    return Trainer(kind, n, owners)


@functools.cache
def oracle(kind: str):
    """Params and full inner state of plain optax after STEPS_BEFORE + STEPS_AFTER steps on one device."""
    tx = INNER[kind][0]()
    p = jax.tree.map(jnp.asarray, params_np())
    s, update = tx.init(p), jax.jit(tx.update)  # jitted, as zero1 is: XLA may fuse away bf16 roundings
    for t in range(STEPS_BEFORE + STEPS_AFTER):
        u, s = update(jax.tree.map(jnp.asarray, mean_grads(t)), s, p)
        p = optax.apply_updates(p, u)
    return p, s


def full_state(state) -> list[np.ndarray]:
    """The unsharded inner-state leaves of a zero1 state (1-D mesh), in the inner state's flatten order, read
    straight from its arrays as zero_optax._state documents them."""
    layout = zo.describe(state)
    stored = h.stored_entries(state)
    out = []
    for j in layout.inner_entries:
        e = layout.entries[j]
        if e.leaf is None:
            out.append(np.asarray(stored[j])[0])
        elif layout.leaves[e.leaf].sliced:
            leaf = layout.leaves[e.leaf]
            out.append(np.asarray(stored[j])[:leaf.size].reshape(leaf.shape))
        else:
            owner = layout.leaves[e.leaf].owner
            d, off = layout.state_packing.offsets[owner][j]
            out.append(np.asarray(state.buffers[d])[owner, off:off + e.size].reshape(e.shape))
    return out


def save(directory, state, step: int = STEPS_BEFORE) -> str:
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(step, args=ocp.args.Composite(**{ITEM: zo.ZeroSave(state)}))
        mngr.wait_until_finished()
    return os.path.join(directory, str(step), ITEM)


def restore(directory, target, step: int = STEPS_BEFORE, reshard: bool = False):
    with ocp.CheckpointManager(directory) as mngr:
        return mngr.restore(step, args=ocp.args.Composite(**{ITEM: zo.ZeroRestore(target, reshard=reshard)}))[ITEM]


@functools.cache
def saved_run(kind: str, n: int, root: str) -> tuple[str, dict]:
    """Trains STEPS_BEFORE steps on n devices and saves; returns the item directory and the params."""
    tr = trainer(kind, n)
    p, s = tr.train(params_np(), tr.init(params_np()), 0, STEPS_BEFORE)
    return save(os.path.join(root, f"{kind}-{n}"), s), jax.tree.map(np.asarray, p)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("runs"))


def continue_on(kind: str, m: int, ckpt_root: str, params, owners=None):
    tr = trainer(kind, m, owners)
    state = restore(ckpt_root, tr.init(params_np()))
    return tr.train(params, state, STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)


def assert_matches_oracle(kind: str, p, state) -> None:
    ref_p, ref_s = oracle(kind)
    tol = TOL[INNER[kind][1]]
    for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)
    ref = jax.tree.leaves(ref_s)
    got = full_state(state)
    assert len(got) == len(ref)
    for x, y in zip(got, ref):
        assert x.dtype == np.asarray(y).dtype
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol)


PAIRS = [(8, 3), (3, 8), (8, 1), (1, 5), (4, 4)]


@pytest.mark.parametrize("kind", ["adamw", "muon", "adafactor"])
@pytest.mark.parametrize("n,m", PAIRS)
def test_reshard_then_continue_matches_uninterrupted_optax(root, tmp_path, kind, n, m):
    src, p = saved_run(kind, n, root)
    zo.reshard(src, tmp_path / str(STEPS_BEFORE) / ITEM, world_size=m)
    record = _record.read(tmp_path / str(STEPS_BEFORE) / ITEM)
    assert record["states"][0]["world_size"] == m and record["storage"] == "tensorstore"
    p, state = continue_on(kind, m, str(tmp_path), p)
    assert_matches_oracle(kind, p, state)


@pytest.mark.parametrize("kind", ["adamw", "muon"])
@pytest.mark.parametrize("n,m", [(8, 3), (1, 5)])
def test_restore_with_reshard_then_continue_matches_uninterrupted_optax(root, kind, n, m):
    """The same, without the offline step: ZeroRestore(target, reshard=True) straight from the N-device save."""
    src, p = saved_run(kind, n, root)
    tr = trainer(kind, m)
    state = restore(os.path.dirname(os.path.dirname(src)), tr.init(params_np()), reshard=True)
    p, state = tr.train(p, state, STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
    assert_matches_oracle(kind, p, state)


def test_explicit_owners(root, tmp_path):
    src, p = saved_run("muon", 8, root)
    owners = (2, 0, 2, 1)
    zo.reshard(src, tmp_path / str(STEPS_BEFORE) / ITEM, world_size=3, owners=owners)
    p, state = continue_on("muon", 3, str(tmp_path), p, owners=owners)
    assert zo.describe(state).owners == owners
    assert_matches_oracle("muon", p, state)


def test_dtypes_and_absent_histories_kept(root, tmp_path):
    src, p = saved_run("masked", 8, root)
    dst = tmp_path / str(STEPS_BEFORE) / ITEM
    zo.reshard(src, dst, world_size=3)
    rec = _record.read(dst)["states"][0]
    assert {e["dtype"] for e in rec["entries"] if e["leaf"] is not None} == {"bfloat16", "float32"}
    assert all(e["leaf"] != 2 for e in rec["entries"])  # the frozen leaf "c" has no history
    assert [x["slots"] for x in rec["leaves"]] == [5, 1, 3, 8]
    p, state = continue_on("masked", 3, str(tmp_path), p)
    assert_matches_oracle("masked", p, state)


# ------------------------------------------------------------------------------------------------ round trips


def arrays(directory) -> dict[str, np.ndarray]:
    """Every stored array of an item directory, whole, by name."""
    store = _store.ItemArrays(directory)
    names = sorted({k.split("/")[0] for k in store.stored_keys()})
    return {name: store.read(name, tuple((0, d) for d in store.open(name).shape)) for name in names}


def record_without_storage(directory) -> dict:
    record = _record.read(directory)
    record.pop("storage")
    return record


def assert_same_checkpoint(a, b) -> None:
    """The same record (but for how the arrays are stored) and the same arrays, bit for bit."""
    assert record_without_storage(a) == record_without_storage(b)
    x, y = arrays(a), arrays(b)
    assert sorted(x) == sorted(y)
    for name in x:
        assert x[name].dtype == y[name].dtype and x[name].tobytes() == y[name].tobytes(), name


def files(directory) -> list[str]:
    return sorted(os.path.relpath(os.path.join(b, f), directory) for b, _, fs in os.walk(directory) for f in fs)


@pytest.mark.parametrize("kind,n,m", [("adamw", 8, 3), ("masked", 3, 8), ("muon", 8, 3), ("adafactor", 3, 1)])
def test_n_to_m_to_n_gives_back_the_same_arrays(root, tmp_path, kind, n, m):
    src, _ = saved_run(kind, n, root)
    zo.reshard(src, tmp_path / "m", world_size=m)
    zo.reshard(tmp_path / "m", tmp_path / "n", world_size=n)
    assert_same_checkpoint(src, tmp_path / "n")
    assert _record.read(tmp_path / "n")["storage"] == "tensorstore"


def test_progress_and_force(root, tmp_path):
    src, _ = saved_run("adamw", 8, root)
    dst = tmp_path / "out"
    calls = []
    zo.reshard(src, dst, world_size=3, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] and all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    with pytest.raises(zo.ZeroCheckpointError, match="already exists; pass force=True"):
        zo.reshard(src, dst, world_size=2)
    assert _record.read(dst)["states"][0]["world_size"] == 3
    zo.reshard(src, dst, world_size=2, force=True)
    assert _record.read(dst)["states"][0]["world_size"] == 2
    zo.reshard(dst, dst, world_size=5, force=True)  # in place: read whole, then swapped in
    assert _record.read(dst)["states"][0]["world_size"] == 5
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary or replaced directories left behind
    zo.reshard(dst, tmp_path / "back", world_size=8)
    assert_same_checkpoint(tmp_path / "back", src)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "fallback"])
@pytest.mark.parametrize("force", [False, True])
def test_output_is_flushed_before_it_is_renamed_into_place(root, tmp_path, monkeypatch, force, exchange):
    src, _ = saved_run("adamw", 8, root)
    dst = str(tmp_path / "out")
    if force:
        zo.reshard(src, dst, world_size=2)
    events = []
    fsync_tree, fsync_path, renameat2, rename = _paths.fsync_tree, _paths.fsync_path, _paths.renameat2, os.rename

    def spy_tree(path):
        events.append(("fsync_tree", path, files(path)))
        fsync_tree(path)

    def spy_path(path):
        events.append(("fsync_path", path))
        fsync_path(path)

    def spy_renameat2(a, b, flags):
        done = exchange and renameat2(a, b, flags)
        if done:
            events.append(("exchange" if flags == _paths._RENAME_EXCHANGE else "rename", a, b))
        return done

    def spy_rename(a, b):
        events.append(("rename", os.fspath(a), os.fspath(b)))
        rename(a, b)

    monkeypatch.setattr(_paths, "fsync_tree", spy_tree)
    monkeypatch.setattr(_paths, "fsync_path", spy_path)
    monkeypatch.setattr(_paths, "renameat2", spy_renameat2)
    monkeypatch.setattr(os, "rename", spy_rename)
    zo.reshard(src, dst, world_size=3, force=force)
    tmp = events[0][1]
    assert os.path.dirname(tmp) == str(tmp_path) and tmp != dst
    assert events[0] == ("fsync_tree", tmp, files(dst))  # complete when flushed
    moves = [e for e in events[1:] if e[0] != "fsync_path"]
    if not force:
        assert moves == [("rename", tmp, dst)]
    elif exchange:
        assert moves == [("exchange", tmp, dst)]  # one atomic swap; the old checkpoint is then deleted
    else:
        aside = moves[0][2]
        assert moves == [("rename", dst, aside), ("rename", tmp, dst)]
    assert events[-1] == ("fsync_path", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert _record.read(dst)["states"][0]["world_size"] == 3


def test_several_states_in_one_item(root, tmp_path):
    """A flat and a leaf state saved as one item; the unsharded state is unchanged, bit for bit."""
    states = []
    for kind in ("adamw", "muon"):
        src, _ = saved_run(kind, 4, root)
        states.append(restore(os.path.dirname(os.path.dirname(src)), trainer(kind, 4).init(params_np())))
    item = save(str(tmp_path / "both"), tuple(states))
    zo.reshard(item, tmp_path / "three" / str(STEPS_BEFORE) / ITEM, world_size=3, owners=[None, [2, 0, 2, 1]])
    targets = (trainer("adamw", 3).init(params_np()), trainer("muon", 3, (2, 0, 2, 1)).init(params_np()))
    got = restore(str(tmp_path / "three"), targets)
    assert zo.describe(got[1]).owners == (2, 0, 2, 1)
    for before, after in zip(states, got):
        for x, y in zip(full_state(before), full_state(after), strict=True):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def database(directory):
    return ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(directory) + "/"}}).result()


def tampered(src: str, tmp_path) -> str:
    """A copy of `src` whose shared step count differs on row 1."""
    bad = str(tmp_path / "bad")
    shutil.copytree(src, bad)
    rec = _record.read(bad)["states"][0]
    j = next(j for j, e in enumerate(rec["entries"]) if e["leaf"] is None and "count" in e["path"])
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": {"driver": "file", "path": bad + "/"},
                                                    "path": _names.entry_array(0, j) + "/"}}).result()
    store[1].write(store[1].read().result() + 7).result()
    return bad


@pytest.mark.parametrize("kind,partition", [("adamw", "flat"), ("muon", "leaf")])
def test_differing_clocks_refused(root, tmp_path, kind, partition):
    src, _ = saved_run(kind, 4, root)
    bad = tampered(src, tmp_path)
    with pytest.raises(zo.ZeroCheckpointError, match=r"shared entry `.*count.*` of state 0 differs between source "
                                                     r"rows: row 0 holds 2, row 1 holds 9"):
        zo.reshard(bad, tmp_path / "out", world_size=3)
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_damaged_source_refused_before_writing(root, tmp_path):
    src, _ = saved_run("adamw", 4, root)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    del database(bad)[b"0.entry0003/c/2"]
    with pytest.raises(zo.ZeroCheckpointError, match=r"is incomplete or damaged: array 0\.entry0003: 1 chunks are "
                                                     r"missing \(first: 0\.entry0003/c/2\)"):
        zo.reshard(bad, tmp_path / "out", world_size=3)
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_bad_arguments(root, tmp_path):
    src, _ = saved_run("adamw", 4, root)
    with pytest.raises(zo.ZeroCheckpointError, match="`world_size` must be a positive int, got 0"):
        zo.reshard(src, tmp_path / "out", world_size=0)
    with pytest.raises(zo.ZeroCheckpointError, match="state 0 uses the flat partition, which has no owners"):
        zo.reshard(src, tmp_path / "out", world_size=2, owners=[[0, 1, 0, 1]])
    with pytest.raises(zo.ZeroCheckpointError, match="0 leaf-partition states"):
        zo.reshard(src, tmp_path / "out", world_size=2, owners=[0, 1, 0, 1])
    src, _ = saved_run("muon", 4, root)
    with pytest.raises(zo.ZeroError, match="`owners` has 3 entries, but the parameters have 4"):
        zo.reshard(src, tmp_path / "out", world_size=2, owners=[0, 1, 0])
    with pytest.raises(zo.ZeroError, match=r"`owners\[1\]` \(leaf `\['b'\]`\) is 5"):
        zo.reshard(src, tmp_path / "out", world_size=2, owners=[0, 5, 0, 1])
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------ reshard_explicit


def test_explicit_cuts_the_saved_histories_anew(root):
    """The oracle, by hand: each saved history's 8 rank slices joined in rank order, cut at the parameter's size,
    padded with zeros and cut again for 3 ranks."""
    src, _ = saved_run("masked", 8, root)
    records = zo.load_rank_records(src)
    migrations = [zo.Migration(name, t, 3, sources=range(7, -1, -1)) for name in records[0].params for t in range(3)]
    got = zo.reshard_explicit(records, migrations)
    assert sorted(got) == [0, 1, 2]
    assert got[0].params["['c']"].buffers == {}  # absent history stays absent
    for name, first in records[0].params.items():
        size = int(np.prod(first.shape))
        slots = -(-size // 3)
        for b in first.buffers:
            joined = np.concatenate([records[r].params[name].buffers[b] for r in range(8)])
            assert not joined[size:].astype(np.float32).any()  # the saved padding is zero
            want = np.zeros(3 * slots, joined.dtype)
            want[:size] = joined[:size]
            for t in range(3):
                w = got[t].params[name].buffers[b]
                assert w.dtype == want.dtype and w.tobytes() == want[t * slots:(t + 1) * slots].tobytes(), (name, b)
    for t in range(3):
        assert (got[t].rank, got[t].world_size) == (t, 3)
        assert got[t].params.keys() == records[0].params.keys()
        for c, v in records[0].clocks.items():
            assert got[t].clocks[c].tobytes() == v.tobytes()


def rank_records(histories: dict[str, np.ndarray], n: int, step: int = 3, name: str = "") -> list[zo.RankRecord]:
    """The rank-local records of 1-D full histories cut for n ranks (each param has one buffer "mu")."""
    out = []
    for r in range(n):
        params = {}
        for p, hist in histories.items():
            slots = -(-hist.size // n)
            padded = np.zeros(slots * n, hist.dtype)
            padded[:hist.size] = hist
            params[name + p] = zo.ParamSlice(hist.shape, {"mu": padded[r * slots:(r + 1) * slots]})
        out.append(zo.RankRecord(r, n, params, {"count": np.int32(step)}))
    return out


def test_explicit_groups_differ_per_parameter():
    """Tensor-parallel shards: "w" lives in a group of 4 records, the expert "e" in a group of 2 records."""
    w = np.arange(11, dtype=np.float32)
    e = (np.arange(5) * 10).astype(ml_dtypes.bfloat16)
    records = rank_records({"w": w}, 4) + rank_records({"e": e}, 2)
    migrations = ([zo.Migration("w", t, 3, sources=[0, 1, 2, 3], target=("dense", t)) for t in range(3)]
                  + [zo.Migration("e", t, 3, sources=[5, 4], target=("expert", t)) for t in range(3)])
    out = zo.reshard_explicit(records, migrations)
    assert np.concatenate([out["dense", t].params["w"].buffers["mu"] for t in range(3)]).tolist() == \
        w.tolist() + [0.0]
    got = np.concatenate([out["expert", t].params["e"].buffers["mu"] for t in range(3)])
    assert got.dtype == ml_dtypes.bfloat16 and got.astype(np.float32).tolist() == [0, 10, 20, 30, 40, 0]
    assert all(int(r.clocks["count"]) == 3 for r in out.values())


def explicit_error(records, migrations, match):
    with pytest.raises(zo.ZeroCheckpointError, match=match):
        zo.reshard_explicit(records, migrations)


def test_explicit_refusals():
    w = np.arange(7, dtype=np.float32)
    recs = rank_records({"w": w, "v": w[:3]}, 2)
    ok = zo.Migration("w", 0, 2, sources=[0, 1])
    explicit_error(recs, [ok, zo.Migration("w", 0, 2, sources=[1, 0])], r"migrations\[0\] and migrations\[1\] both "
                   r"place `w` at target 0 \(rank 0\): duplicate target ownership")
    explicit_error(recs, [ok, zo.Migration("w", 0, 2, sources=[0, 1], target="x")], "duplicate target ownership")
    explicit_error(recs + rank_records({"u": w}, 2), [zo.Migration("w", 0, 2, sources=[2, 1])],
                   r"source records\[2\] \(rank 0\) lacks the parameter")
    explicit_error(recs, [zo.Migration("w", 0, 2, sources=[0])], r"the source group has 1 records, but records\[0\] "
                   "was saved with world size 2")
    twin = rank_records({"w": w}, 2)
    explicit_error(recs + twin, [zo.Migration("w", 0, 2, sources=[0, 2])], r"records\[0\] and records\[2\] both "
                   "hold rank 0: repeated source ranks")
    explicit_error(recs, [zo.Migration("w", 0, 2, sources=[0, 0])], "repeated source ranks")
    late = rank_records({"w": w}, 2, step=4)
    explicit_error([recs[0], late[1]], [zo.Migration("w", 0, 2, sources=[0, 1])], r"clocks differ between sources "
                   r"records\[0\] and records\[1\]: clock `count` is 3 vs 4")
    late_v = rank_records({"v": w[:3]}, 2, step=4)
    explicit_error(recs + late_v, [ok, zo.Migration("v", 0, 2, sources=[2, 3])], r"fill target 0 from sources whose "
                   "clocks differ")
    nomu = zo.RankRecord(1, 2, {"w": zo.ParamSlice((7,), {})}, recs[1].clocks)
    explicit_error([recs[0], nomu], [ok], r"optional buffers differ between sources: records\[0\] has \['mu'\], "
                   r"records\[1\] has \[\]")
    half = zo.RankRecord(1, 2, {"w": zo.ParamSlice((7,), {"mu": np.zeros(4, np.float16)})}, recs[1].clocks)
    explicit_error([recs[0], half], [ok], r"buffer `mu` dtype differs: float32 in records\[0\], float16 in "
                   r"records\[1\]")
    short = zo.RankRecord(1, 2, {"w": zo.ParamSlice((7,), {"mu": np.zeros(3, np.float32)})}, recs[1].clocks)
    explicit_error([recs[0], short], [ok], r"buffer structure differs: `mu` in records\[1\] has shape \(3,\)")
    other = zo.RankRecord(1, 2, {"w": zo.ParamSlice((8,), {"mu": np.zeros(4, np.float32)})}, recs[1].clocks)
    explicit_error([recs[0], other], [ok], r"buffer structure differs: the parameter shape is \(7,\)")
    explicit_error(recs, [zo.Migration("w", 0, 2, sources=[0, 9])], "source index 9 is out of range for 2 records")
    explicit_error(recs, [zo.Migration("w", 3, 3, sources=[0, 1])], "target rank 3 is out of range for target "
                   "world size 3")
    explicit_error(recs, [zo.Migration("w", 0, 0, sources=[0, 1])], "out of range for target world size 0")
    bad_rank = zo.RankRecord(2, 2, recs[1].params, recs[1].clocks)
    explicit_error([recs[0], bad_rank], [ok], r"records\[1\] has rank 2, out of range for world size 2")
    explicit_error(recs, [ok, zo.Migration("v", 1, 3, sources=[0, 1], target=0)], "one target record has one "
                   "placement")


# ------------------------------------------------------------------------------------------------ command line


def cli_start(*args) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "zero_optax.reshard", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)


def cli_finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def cli(*args) -> subprocess.CompletedProcess:
    return cli_finish(cli_start(*args))


def test_cli_converts_and_forces(root, tmp_path):
    src, _ = saved_run("muon", 4, root)
    owners = tmp_path / "owners.json"
    owners.write_text("[2, 1, 0, 1]")
    dst = tmp_path / "out"
    r = cli(src, dst, "--world-size", 3, "--owners", owners)
    assert (r.returncode, r.stderr) == (0, "")
    assert _record.read(dst)["states"][0]["owners"] == [2, 1, 0, 1]
    r = cli(src, dst, "--world-size", 2)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "already exists; pass force=True (--force)" in r.stderr
    r = cli(src, dst, "--world-size", 2, "--force")
    assert (r.returncode, r.stderr) == (0, "")
    balanced = zo.balanced_owners(params_np(), 2, inner=INNER["muon"][0]())
    assert _record.read(dst)["states"][0]["owners"] == balanced


def bad_inputs(src: str, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    del database(missing)[b"0.entry0001/c/0"]
    future = tmp_path / "future"
    shutil.copytree(src, future)
    rec = json.loads((future / _names.RECORD_FILE).read_text())
    (future / _names.RECORD_FILE).write_text(json.dumps({**rec, "format_version": 99}))
    return [
        ((empty, "--world-size", 2), "is not a zero_optax checkpoint: zero_record.json is missing"),
        ((tmp_path / "nowhere", "--world-size", 2), "is not a zero_optax checkpoint: no such directory"),
        ((missing, "--world-size", 2), "1 chunks are missing"),
        ((future, "--world-size", 2), "has record format version 99"),
        ((src, "--world-size", 0), "`world_size` must be a positive int, got 0"),
        ((src, "--world-size", "two"), "invalid int value: 'two'"),
        ((src, "--world-size", 2, "--owners", tmp_path / "none.json"), "cannot read --owners file"),
    ]


def test_cli_bad_input(root, tmp_path):
    src, _ = saved_run("adamw", 4, root)
    cases = bad_inputs(src, tmp_path)
    before = sorted(os.listdir(tmp_path))
    procs = [cli_start(args[0], tmp_path / "out", *args[1:]) for args, _ in cases]  # concurrently: startup is slow
    for (args, message), proc in zip(cases, procs):
        r = cli_finish(proc)
        assert r.returncode != 0, args
        assert r.stderr.count("\n") == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert r.stdout == ""
        assert sorted(os.listdir(tmp_path)) == before


def test_module_import_keeps_function_callable(root, tmp_path):
    import zero_optax.reshard  # noqa: F401  # pylint: disable=import-outside-toplevel
    src, _ = saved_run("adamw", 4, root)
    zo.reshard(src, tmp_path / "out", world_size=2)
    assert _record.read(tmp_path / "out")["states"][0]["world_size"] == 2


class FakeStream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_only_on_a_terminal_or_for_large_checkpoints():
    from zero_optax.reshard import LARGE_BYTES, _Progress  # pylint: disable=import-outside-toplevel
    quiet = FakeStream(tty=False)
    bar = _Progress(quiet)
    for done in range(0, 101, 5):
        bar(done, 100)
    bar.close()
    assert quiet.getvalue() == ""
    logged = FakeStream(tty=False)
    bar = _Progress(logged)
    for done in range(0, 101, 5):
        bar(done * LARGE_BYTES // 100, LARGE_BYTES)
    bar.close()
    lines = logged.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1] == "resharding: 100% (1.07/1.07 GB)" and "\r" not in logged.getvalue()
    tty = FakeStream(tty=True)
    bar = _Progress(tty)
    bar(0, 100)
    bar(100, 100)
    bar.close()
    assert "resharding" in tty.getvalue() and "100 bytes" in tty.getvalue()
