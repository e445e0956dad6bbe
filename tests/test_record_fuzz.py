"""Hostile and corrupt records: every field of real records mutated, for restore, reshard and the command line.

Each mutation (wrong type, negative, off by one, huge, missing, extra, deep nesting, very long string, a path
name) of each field of a flat and a leaf-partition record must end in a `ZeroCheckpointError`, or in exactly the
result of the intact record (for fields that change nothing, such as `zero_optax_version`). Never another
exception, never other values, and never a file touched outside the checkpoint and the output directories.
"""

import copy
import json
import os
import re
import shutil
import subprocess
import sys

import _zero_setup as zs
import numpy as np
import orbax.checkpoint as ocp
import pytest

import zero_optax as zo
from zero_optax.checkpoint import _record, _store
from zero_optax.core import _names

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, M = 4, 3
KINDS = [("adamw", True), ("muon", False)]
NAME = re.compile(r"^\d+\.(entry\d{4,}|buffer_[a-z0-9_]+)$")
SEED = 20240601
PER_KIND = 250  # mutations per record, drawn deterministically from every (field, mutation) pair


def _paths(x, prefix=()):
    """Every field of a JSON value, as a path of keys and indices (the root excluded)."""
    out = []
    if isinstance(x, dict):
        for k, v in x.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(x, list):
        for i in sorted({*range(min(3, len(x))), len(x) - 1} if x else ()):  # long lists repeat themselves
            out.append(prefix + (i,))
            out += _paths(x[i], prefix + (i,))
    return out


def _nest(depth: int):
    out = 0
    for _ in range(depth):
        out = [out]
    return out


def _mutations(value):
    """Names and replacement values (None: delete) for one field."""
    out = [("null", None), ("string", "x"), ("list", [value]), ("object", {"k": value}), ("bool", True),
           ("float", 1.5), ("deep", _nest(40)), ("long", "y" * 70000), ("path", "../../../etc"),
           ("delete", ...)]
    if isinstance(value, int) and not isinstance(value, bool):
        out += [("negative", -1), ("minus one", value - 1), ("plus one", value + 1), ("huge", 2 ** 62),
                ("huger", 10 ** 40), ("zero", 0)]
    if isinstance(value, (list, dict)):
        out += [("extra", "extra"), ("empty", type(value)())]
    if isinstance(value, str):
        out += [("other string", value + "x"), ("empty string", ""), ("dtype", "float32"), ("object dtype", "object")]
    return out


def _apply(record, path, mutation):
    name, new = mutation
    record = copy.deepcopy(record)
    parent = record
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if name == "delete":
        del parent[key]
    elif name == "extra":
        if isinstance(parent[key], dict):
            parent[key]["zz_extra"] = 1
        else:
            parent[key].append(copy.deepcopy(parent[key][-1]) if parent[key] else 0)
    else:
        parent[key] = new
    return record


def _cases(record, seed):
    cases = [(p, m) for p in _paths(record) for m in _mutations(_get(record, p))]
    rng = np.random.default_rng(seed)
    return [cases[i] for i in sorted(rng.choice(len(cases), size=min(PER_KIND, len(cases)), replace=False))]


def _get(record, path):
    for k in path:
        record = record[k]
    return record


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    """For each kind: the saved item, its record, the baseline restore (plain and at M) and reshard output."""
    root = tmp_path_factory.mktemp("fuzz")
    out = {}
    for kind, chain in KINDS:
        tr = zs.trainer(kind, N, chain)
        p = zs.params(tr.mesh)
        _, s = tr.train(p, tr.init(p), 0, 1)
        item = root / kind
        with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
            ckpt.save(item, args=zo.ZeroSave(s))
        small = zs.trainer(kind, M, chain)
        targets = {False: tr.abstract(p), True: small.abstract(zs.params(small.mesh))}
        zo.reshard(item, root / f"{kind}-resharded", world_size=M)
        out[kind] = (item, json.loads((item / _names.RECORD_FILE).read_text()), targets,
                     {r: zs.host(_restore(item, t, r)) for r, t in targets.items()},
                     _arrays_of(root / f"{kind}-resharded"))
    return out


def _restore(item, target, reshard):
    return zo.ZeroCheckpointHandler().restore(item, args=zo.ZeroRestore(target, reshard=reshard))


def _arrays_of(item):
    store = _store.ItemArrays(item)
    names = sorted({k.split("/")[0] for k in store.stored_keys()})
    return {n: store.read(n, tuple((0, d) for d in store.open(n).shape)).tobytes() for n in names}


@pytest.fixture
def names_used(monkeypatch):
    """Every array name that reaches TensorStore."""
    seen = []
    spec = _store._spec

    def spy(directory, name):
        seen.append(name)
        return spec(directory, name)

    monkeypatch.setattr(_store, "_spec", spy)
    return seen


@pytest.mark.parametrize("kind", [k for k, _ in KINDS])
def test_every_field_mutated(items, tmp_path, kind, names_used):
    item, record, targets, baseline, resharded = items[kind]
    fence = tmp_path / "fence"  # nothing may appear next to the directories under test
    fence.mkdir()
    outcomes = {"refused": 0, "same": 0}
    for i, (path, mutation) in enumerate(_cases(record, SEED + len(kind))):
        bad = tmp_path / "fence" / "item"
        shutil.copytree(item, bad)
        (bad / _names.RECORD_FILE).write_text(json.dumps(_apply(record, path, mutation)))
        where = f"case {i}: {mutation[0]} at {path}"
        for reshard, target in targets.items():
            try:
                got = _restore(bad, target, reshard)
            except zo.ZeroCheckpointError:
                outcomes["refused"] += 1
            else:
                zs.assert_bit_equal(zs.host(got), baseline[reshard])
                outcomes["same"] += 1
        dst = tmp_path / "fence" / "out"
        try:
            zo.reshard(bad, dst, world_size=M)
        except zo.ZeroCheckpointError:
            outcomes["refused"] += 1
            assert not dst.exists(), where
        else:
            assert _arrays_of(dst) == resharded, where
            outcomes["same"] += 1
            shutil.rmtree(dst)
        shutil.rmtree(bad)
        assert os.listdir(fence) == [], where
        assert all(NAME.match(n) for n in names_used), (where, [n for n in names_used if not NAME.match(n)])
    assert sorted(os.listdir(tmp_path)) == ["fence"]
    assert outcomes["refused"] > 5 * outcomes["same"] > 0, outcomes


def test_deep_and_large_records_are_refused_before_parsing(items, tmp_path, monkeypatch):
    item, record, targets, _, _ = items["adamw"]
    bad = tmp_path / "item"
    shutil.copytree(item, bad)
    (bad / _names.RECORD_FILE).write_text("[" * 200_000 + "]" * 200_000)  # json.loads would hit the recursion limit
    with pytest.raises(zo.ZeroCheckpointError, match="nests JSON deeper than a zero_optax record"):
        _restore(bad, targets[False], False)
    monkeypatch.setattr(_record, "MAX_RECORD_BYTES", 1000)
    (bad / _names.RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(zo.ZeroCheckpointError, match=r"bytes, more than a zero_optax record may hold \(1000\)"):
        _restore(bad, targets[False], False)
    with pytest.raises(zo.ZeroCheckpointError, match="more than a zero_optax record may hold"):
        zo.reshard(bad, tmp_path / "out", world_size=M)


def test_negative_leaf_index_never_picks_another_leaf(items, tmp_path):
    item, record, targets, _, _ = items["adamw"]
    bad = tmp_path / "item"
    shutil.copytree(item, bad)
    edited = copy.deepcopy(record)
    edited["states"][0]["entries"][1]["leaf"] = -1
    (bad / _names.RECORD_FILE).write_text(json.dumps(edited))
    for attempt in (lambda: _restore(bad, targets[True], True), lambda: zo.reshard(bad, tmp_path / "o", world_size=M),
                    lambda: zo.load_rank_records(bad)):
        with pytest.raises(zo.ZeroCheckpointError, match=r"`states\[0\].entries\[1\].leaf` is -1, outside \[0, 3\]"):
            attempt()


def test_command_line_answers_hostile_records_in_one_line(items, tmp_path):
    item, record, _, _, _ = items["muon"]
    sample = [(p, m) for p, m in _cases(record, SEED)[::40]][:4]
    sample.append((("states", 0, "leaves", 0, "owner"), ("negative", -1)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for i, case in enumerate(sample):
        bad = tmp_path / f"item{i}"
        shutil.copytree(item, bad)
        (bad / _names.RECORD_FILE).write_text(json.dumps(_apply(record, *case)))
        cmd = [sys.executable, "-m", "zero_optax.reshard", str(bad), str(tmp_path / f"out{i}"), "--world-size", str(M)]
        procs.append((i, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                          cwd=REPO_ROOT)))
    refused = 0
    for i, proc in procs:
        out, err = proc.communicate(timeout=120)
        if proc.returncode == 0:  # a field that changes nothing
            assert err == "" and _arrays_of(tmp_path / f"out{i}") == items["muon"][4]
            continue
        refused += 1
        assert proc.returncode == 1 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("python -m zero_optax.reshard: error: ") and not (tmp_path / f"out{i}").exists()
    assert refused >= 1


def _edited(src, tmp_path, edit) -> str:
    bad = tmp_path / "edited"
    shutil.copytree(src, bad)
    record = json.loads((bad / _names.RECORD_FILE).read_text())
    edit(record["states"][0])
    (bad / _names.RECORD_FILE).write_text(json.dumps(record))
    return bad


def _refused_everywhere(bad, tmp_path, targets, match) -> None:
    """The offline tools refuse `bad` with `match` (they have no target to compare with), both restores refuse it
    (the target may already differ), and nothing is written."""
    for attempt in (lambda: zo.reshard(bad, tmp_path / "out", world_size=M), lambda: zo.load_rank_records(bad)):
        with pytest.raises(zo.ZeroCheckpointError, match=match):
            attempt()
    for reshard, target in targets.items():
        with pytest.raises(zo.ZeroCheckpointError):
            _restore(bad, target, reshard)
    assert not (tmp_path / "out").exists()


def _unpinned_owned_entry(record_state, delta: int) -> tuple[int, list[int], list[int]] | None:
    """An owned entry whose first dimension the packing does not pin, and its shape changed by `delta` rows: the
    last entry of a device whose share is not the largest (the buffers' size is the largest share), changed so
    that it still fits. Returns the entry's index, its shape and the changed shape (None if there is none)."""
    entries, packing = record_state["entries"], record_state["packing"]
    for offsets in packing["offsets"]:
        if not offsets:
            continue
        j, dtype, offset = offsets[-1]
        shape = entries[j]["shape"]
        changed = [shape[0] + delta] + shape[1:] if shape else None
        size = packing["sizes"][dtype]
        if changed and changed[0] >= 0 and offset + int(np.prod(shape)) < size and \
                offset + int(np.prod(changed)) <= size:
            return j, shape, changed
    return None


@pytest.mark.parametrize("storage", ["orbax", "tensorstore"])
def test_owned_entry_shape_changed_to_another_size_is_refused(items, tmp_path, storage):
    """The packing and the arrays' shapes stay valid; the shapes kept with the arrays' metadata disagree."""
    item, _, targets, _, _ = items["muon"]
    src = item if storage == "orbax" else item.parent / "muon-resharded"
    state = json.loads((src / _names.RECORD_FILE).read_text())["states"][0]
    targets = targets if storage == "orbax" else {True: targets[True], False: targets[True]}
    cases = [_unpinned_owned_entry(state, delta) for delta in (-1, 1)]
    assert any(cases)
    for j, shape, changed in filter(None, cases):
        bad = _edited(src, tmp_path, lambda s, j=j, changed=changed: s["entries"][j].update(shape=changed))
        _refused_everywhere(bad, tmp_path, targets, rf"the record's `states\[0\]\.entries\[{j}\]\.shape` is "
                            rf"{re.escape(str(changed))}, but the stored arrays' metadata says {re.escape(str(shape))}")
        shutil.rmtree(bad)


@pytest.mark.parametrize("storage", ["orbax", "tensorstore"])
@pytest.mark.parametrize("kind", [k for k, _ in KINDS])
def test_scalar_leaf_shape_changed_to_one_is_refused(items, tmp_path, kind, storage):
    """A scalar leaf and a [1] leaf store the same history (flat) or the same packed elements (leaf)."""
    item, record, targets, _, _ = items[kind]
    src = item if storage == "orbax" else item.parent / f"{kind}-resharded"
    i = next(i for i, x in enumerate(record["states"][0]["leaves"]) if x["shape"] == [])
    bad = _edited(src, tmp_path, lambda s: s["leaves"][i].update(shape=[1], spec=[[]], global_shape=[1]))
    targets = targets if storage == "orbax" else {True: targets[True], False: targets[True]}
    _refused_everywhere(bad, tmp_path, targets, rf"the record's `states\[0\]\.leaves\[{i}\]\.shape` is \[1\], but "
                        r"the stored arrays' metadata says \[\]")


def test_missing_orbax_metadata_is_refused(items, tmp_path):
    item, _, targets, _, _ = items["adamw"]
    bad = tmp_path / "item"
    shutil.copytree(item, bad)
    (bad / "_METADATA").unlink()
    with pytest.raises(zo.ZeroCheckpointError, match="Orbax's _METADATA is missing"):
        zo.reshard(bad, tmp_path / "out", world_size=M)
    assert not (tmp_path / "out").exists()
