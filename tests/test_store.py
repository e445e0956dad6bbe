"""Tests for zero_optax._store (zarr3 arrays in an OCDBT database, through TensorStore) and zero_optax._paths."""

import os

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.checkpoint import _paths, _schema, _store
from zero_optax.checkpoint._arrays import StoredArray
from zero_optax.core._errors import StoreError, ZeroCheckpointError


def _random(shape, dtype, seed=0):
    """Random values covering every bit pattern of the dtype (NaN payloads, -0.0, ...)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    bits = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return bits.view(dtype).reshape(shape)


def _assert_bit_equal(actual, expected):
    actual = np.asarray(actual)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert actual.tobytes() == expected.tobytes()


def _write(path, arrays, chunks=None, batch_bytes=_store.BATCH_BYTES):
    with _store.ItemWriter(path, batch_bytes) as w:
        for name, x in arrays.items():
            w.create(name, x.shape, x.dtype.name, chunks or x.shape)
        for name, x in arrays.items():
            w.write(name, tuple((0, d) for d in x.shape), x)


def _files(path):
    return [os.path.join(b, f) for b, _, fs in os.walk(path) for f in fs]


@pytest.mark.parametrize("dtype", sorted(_schema.DTYPES))
def test_every_allowed_dtype_round_trips_bit_for_bit(tmp_path, dtype):
    x = _random((3, 5), ml_dtypes.bfloat16 if dtype == "bfloat16" else getattr(ml_dtypes, dtype, dtype))
    _write(tmp_path, {"0.entry0000": x}, chunks=(1, 2))
    store = _store.ItemArrays(tmp_path)
    _assert_bit_equal(store.read("0.entry0000", ((0, 3), (0, 5))), x)
    store.check([StoredArray("0.entry0000", (3, 5), dtype, ((), ()))])


def test_regions_match_numpy_slicing(tmp_path):
    x = _random((4, 10), np.float32)
    y = _random((23,), np.int32, seed=1)
    _write(tmp_path, {"a": x}, chunks=(1, 3))
    _write(tmp_path / "b", {"b": y}, chunks=(5,))
    a, b = _store.ItemArrays(tmp_path), _store.ItemArrays(tmp_path / "b")
    _assert_bit_equal(a.read("a", ((2, 3), (3, 9))), x[2:3, 3:9])
    _assert_bit_equal(a.read("a", ((0, 4), (0, 10))), x)
    for lo, hi in [(0, 23), (4, 6), (5, 10), (22, 23), (7, 7)]:
        _assert_bit_equal(b.read("b", ((lo, hi),)), y[lo:hi])


def test_large_reads_go_in_chunk_aligned_pieces(tmp_path, monkeypatch):
    x = _random((100,), np.float32)
    _write(tmp_path, {"a": x}, chunks=(8,))
    monkeypatch.setattr(_store, "PIECE_BYTES", 40)  # 10 elements: one 8-element chunk per piece
    store = _store.ItemArrays(tmp_path)
    pieces = []
    real = store.open("a")

    class Spy:
        def __getitem__(self, index):
            pieces.append((index[0].start, index[0].stop))
            return real[index]

        def __getattr__(self, name):
            return getattr(real, name)

    store._open["a"] = Spy()
    _assert_bit_equal(store.read("a", ((3, 45),)), x[3:45])
    assert pieces == [(3, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 45)]


def test_check_names_the_problem(tmp_path):
    x = _random((4, 6), np.float32)
    _write(tmp_path, {"0.entry0000": x}, chunks=(1, 6))
    store = _store.ItemArrays(tmp_path)
    ok = StoredArray("0.entry0000", (4, 6), "float32", ((), ()))
    store.check([ok])
    with pytest.raises(StoreError, match=r"array 0.entry0000: it is \[4, 6\] float32, expected \[4, 7\] float32"):
        store.check([StoredArray("0.entry0000", (4, 7), "float32", ((), ()))])
    with pytest.raises(StoreError, match="expected \\[4, 6\\] bfloat16"):
        store.check([StoredArray("0.entry0000", (4, 6), "bfloat16", ((), ()))])
    with pytest.raises(StoreError, match="array 0.entry0001: cannot open it"):
        store.check([StoredArray("0.entry0001", (4, 6), "float32", ((), ()))])
    database = __import__("tensorstore").KvStore.open(_store._kvstore(_paths.as_path(tmp_path))).result()
    del database[b"0.entry0000/c/2/0"]
    with pytest.raises(StoreError, match=r"1 chunks are missing \(first: 0.entry0000/c/2/0\)"):
        _store.ItemArrays(tmp_path).check([ok])
    with pytest.raises(StoreError, match="reading .* failed .*missing"):  # reads refuse missing chunks too
        _store.ItemArrays(tmp_path).read("0.entry0000", ((0, 4), (0, 6)))
    assert _store.ItemArrays(tmp_path / "nowhere").stored_keys() == set()
    with pytest.raises(StoreError, match="cannot open it"):
        _store.ItemArrays(tmp_path / "nowhere").check([ok])
    assert not os.path.exists(tmp_path / "nowhere")  # reading creates nothing


def test_chunks_of_zeros_are_stored(tmp_path):
    _write(tmp_path, {"z": np.zeros((3, 4), np.float32)}, chunks=(1, 4))
    _store.ItemArrays(tmp_path).check([StoredArray("z", (3, 4), "float32", ((), ()))])
    assert _store.chunk_keys("z", (3, 4), (1, 4)) <= _store.ItemArrays(tmp_path).stored_keys()


def test_zero_sized_arrays(tmp_path):
    _write(tmp_path, {"e": np.zeros((0,), np.float32), "f": np.zeros((3, 0), np.int32)})
    store = _store.ItemArrays(tmp_path)
    store.check([StoredArray("e", (0,), "float32", ((),)), StoredArray("f", (3, 0), "int32", ((), ()))])
    assert store.read("f", ((0, 3), (0, 0))).shape == (3, 0)
    assert _store.chunk_keys("f", (3, 0), (1, 1)) == set()


def test_writes_commit_in_bounded_transactions(tmp_path):
    """Data files grow with the bytes written, not with the number of writes; an error commits nothing."""
    x = _random((64, 256), np.float32)  # 64 KiB in 64 row writes
    with _store.ItemWriter(tmp_path / "a", batch_bytes=16 << 10) as w:
        w.create("a", x.shape, "float32", (1, 256))
        for r in range(64):
            w.write("a", ((r, r + 1), (0, 256)), x[r:r + 1])
    data = [f for f in _files(tmp_path / "a") if os.sep + "d" + os.sep in f]
    assert 4 <= len(data) <= 10  # the metadata, then 4 batches of 16 KiB (each a data file and tree nodes)
    _assert_bit_equal(_store.ItemArrays(tmp_path / "a").read("a", ((0, 64), (0, 256))), x)
    with pytest.raises(RuntimeError), _store.ItemWriter(tmp_path / "b", batch_bytes=1 << 30) as w:
        w.create("a", x.shape, "float32", (1, 256))
        w.write("a", ((0, 1), (0, 256)), x[:1])
        raise RuntimeError("interrupted")
    assert "a/c/0/0" not in _store.ItemArrays(tmp_path / "b").stored_keys()


def test_reads_arrays_that_orbax_wrote(tmp_path):
    mesh = jax.make_mesh((8,), ("data",))
    x = _random((8 * 5,), np.float32)
    y = _random((8, 3), ml_dtypes.bfloat16, seed=2)
    arrays = {"0.entry0001": jax.device_put(x, NamedSharding(mesh, P("data"))),
              "0.buffer_bfloat16": jax.device_put(y, NamedSharding(mesh, P("data")))}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)) as ckpt:
        ckpt.save(tmp_path / "item", args=ocp.args.PyTreeSave(arrays))
    store = _store.ItemArrays(tmp_path / "item")
    store.check([StoredArray("0.entry0001", (40,), "float32", (("data",),)),
                 StoredArray("0.buffer_bfloat16", (8, 3), "bfloat16", (("data",), ()))])
    _assert_bit_equal(store.read("0.entry0001", ((7, 23),)), x[7:23])  # across devices' chunks
    _assert_bit_equal(store.read("0.buffer_bfloat16", ((5, 6), (1, 3))), y[5:6, 1:3])


# --- paths ------------------------------------------------------------------------------


def test_paths_orbax_accepts(tmp_path):
    assert str(_paths.as_path(tmp_path)) == str(tmp_path)
    assert str(_paths.as_path("relative/dir")) == os.path.join(os.getcwd(), "relative/dir")
    assert _paths.kvstore(_paths.as_path(tmp_path / "x")) == {"driver": "file", "path": f"{tmp_path}/x/"}
    gs = _paths.as_path("gs://my-bucket/runs/1/opt_state/")
    assert not _paths.is_local(gs)
    assert _paths.kvstore(gs) == {"driver": "gcs", "bucket": "my-bucket", "path": "runs/1/opt_state/"}
    _paths.check_writable(gs)  # syntax only: no network here
    for bad, message in [("s3://b/x", "`s3://` is not supported"), ("memory://x", "`memory://` is not supported"),
                         ("gs:///x", "valid Google Cloud Storage bucket"), (3, "must be a str or a path")]:
        with pytest.raises(ZeroCheckpointError, match=message):
            _paths.as_path(bad)


def test_check_writable(tmp_path):
    (tmp_path / "f").write_text("x")
    _paths.check_writable(_paths.as_path(tmp_path / "new" / "deeper"))
    _paths.check_writable(_paths.as_path(tmp_path))
    with pytest.raises(ZeroCheckpointError, match="it is a file"):
        _paths.check_writable(_paths.as_path(tmp_path / "f"))
    with pytest.raises(ZeroCheckpointError, match=r"/f is a file, not a directory"):
        _paths.check_writable(_paths.as_path(tmp_path / "f" / "a" / "b"))
