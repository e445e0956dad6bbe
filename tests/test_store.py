"""Tests for zero_optax._store: zarr v2 raw array storage written with TensorStore."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax import _store
from zero_optax._store import (
    StoreError,
    array_spec,
    create_array,
    expected_chunk_files,
    open_array,
    read,
    read_to_jax,
    validate_array,
    write_array,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DTYPES = [
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    np.int32,
    np.int64,
    np.uint32,
    np.bool_,
    np.float64,
]


def _random(shape, dtype, seed=0):
    """Random values covering every bit pattern of the dtype (NaN payloads, -0.0, ...)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    bits = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return bits.view(dtype).reshape(shape)


def _bits(x):
    x = np.ascontiguousarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(f"u{x.dtype.itemsize}")


def _assert_bit_equal(actual, expected):
    actual = np.asarray(actual)
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    np.testing.assert_array_equal(_bits(actual), _bits(expected))


def _files(path):
    """{name: bytes} of everything under path except .zarray."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name != ".zarray":
            with open(os.path.join(path, name), "rb") as f:
                out[name] = f.read()
    return out


def _row_sharded(x, mesh):
    return jax.device_put(x, NamedSharding(mesh, P("data")))


@pytest.fixture(scope="module")
def mesh8():
    return jax.make_mesh((8,), ("data",))


# --- metadata and layout ---------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, chunks",
    [
        ((), []),
        ((8,), [1]),
        ((8, 5), [1, 5]),
        ((8, 3, 4), [1, 3, 4]),
        ((8, 0), [1, 1]),
        ((0, 3), [1, 3]),
    ],
)
def test_array_spec_chunks_whole_rows(shape, chunks):
    spec = array_spec(shape, np.float32)
    assert spec["shape"] == list(shape)
    assert spec["chunks"] == chunks
    assert spec["dtype"] == "<f4"
    assert spec["compressor"] is None and spec["filters"] is None


@pytest.mark.parametrize(
    "shape, chunks",
    [
        ((4, 100), [1, 15]),  # 1-row chunks split along the last axis, 7 balanced pieces.
        ((4, 3, 100), [1, 1, 15]),  # last axis too long: middle axes at 1.
        ((4, 96), [1, 16]),  # 6 full pieces.
        ((4, 5, 3, 4), [1, 1, 3, 4]),  # trailing axes fit whole, axis 1 does not.
        ((4, 5, 2, 3), [1, 2, 2, 3]),  # axis 1 split into pieces that fit.
    ],
)
def test_array_spec_splits_long_rows(monkeypatch, shape, chunks):
    monkeypatch.setattr(_store, "CHUNK_ELEMENTS", 16)
    spec = array_spec(shape, np.float32)
    assert spec["chunks"] == chunks
    assert np.prod(spec["chunks"]) <= 16


@pytest.mark.parametrize(
    "dtype, name",
    [
        (np.float32, "<f4"),
        (ml_dtypes.bfloat16, "bfloat16"),
        (jnp.bfloat16, "bfloat16"),
        (np.float16, "<f2"),
        (np.int32, "<i4"),
        (np.int64, "<i8"),
        (np.uint32, "<u4"),
        (np.bool_, "|b1"),
        (np.float64, "<f8"),
        (np.dtype(">f4"), "<f4"),
    ],
)
def test_array_spec_dtype_names(dtype, name):
    assert array_spec((2,), dtype)["dtype"] == name


@pytest.mark.parametrize(
    "shape, chunk_elements",
    [
        ((3, 5), None),
        ((), None),
        ((4,), None),
        ((2, 0), None),
        ((0, 4), None),
        ((3, 10), 4),  # edge chunk 2.2 holds 2 elements but is stored full size.
        ((2, 3, 7), 5),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.bool_, np.int64])
def test_files_on_disk_match_expected_chunk_files(
    tmp_path, monkeypatch, shape, chunk_elements, dtype
):
    if chunk_elements is not None:
        monkeypatch.setattr(_store, "CHUNK_ELEMENTS", chunk_elements)
    path = tmp_path / "a"
    write_array(path, _random(shape, dtype))
    on_disk = sorted(
        (name, os.path.getsize(path / name)) for name in os.listdir(path) if name != ".zarray"
    )
    assert on_disk == sorted(expected_chunk_files(path, shape, dtype))
    with open(path / ".zarray") as f:
        assert json.load(f) == array_spec(shape, dtype) | {"zarr_format": 2}
    validate_array(path, shape, dtype)


def test_chunk_file_names():
    assert expected_chunk_files("x", (), np.float32) == [("0", 4)]
    assert expected_chunk_files("x", (2, 3), np.float32) == [("0.0", 12), ("1.0", 12)]
    assert expected_chunk_files("x", (2, 0), np.float32) == []


# --- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (8,), (8, 7), (4, 3, 5)], ids=str)
def test_numpy_round_trip_is_bit_exact(tmp_path, dtype, shape):
    x = _random(shape, dtype)
    write_array(tmp_path / "a", x)
    validate_array(tmp_path / "a", shape, dtype)
    _assert_bit_equal(read(tmp_path / "a"), x)


def test_special_float_values_round_trip(tmp_path):
    x = np.array([[0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45]], np.float32)
    x = np.concatenate([x, x.view(np.uint32).__or__(1).view(np.float32)])  # NaN payloads
    write_array(tmp_path / "a", x)
    _assert_bit_equal(read(tmp_path / "a"), x)


def test_all_zero_chunks_are_written(tmp_path):
    # Zarr drops chunks equal to the fill value unless told otherwise; ours must all exist.
    write_array(tmp_path / "a", np.zeros((4, 3), np.float32))
    validate_array(tmp_path / "a", (4, 3), np.float32)


def test_big_endian_input_is_stored_little_endian(tmp_path):
    x = np.arange(6, dtype=">f4").reshape(2, 3)
    write_array(tmp_path / "a", x)
    validate_array(tmp_path / "a", (2, 3), np.float32)
    np.testing.assert_array_equal(read(tmp_path / "a"), x)


def test_zero_sized_arrays(tmp_path):
    for shape in [(0, 3), (4, 0)]:
        path = tmp_path / str(shape)
        write_array(path, np.zeros(shape, np.float32))
        validate_array(path, shape, np.float32)
        assert read(path).shape == shape
        assert os.listdir(path) == [".zarray"]


# --- streaming reads -------------------------------------------------------------------


def test_read_row_and_sub_range(tmp_path, monkeypatch):
    monkeypatch.setattr(_store, "CHUNK_ELEMENTS", 4)
    x = _random((4, 10), np.float32)
    write_array(tmp_path / "a", x)
    _assert_bit_equal(read(tmp_path / "a", 2), x[2])
    _assert_bit_equal(read(tmp_path / "a", (1, slice(3, 9))), x[1, 3:9])
    _assert_bit_equal(read(tmp_path / "a", (slice(1, 3),)), x[1:3])


def test_read_touches_only_the_needed_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(_store, "CHUNK_ELEMENTS", 4)
    x = _random((4, 10), np.float32)
    path = tmp_path / "a"
    write_array(path, x)
    # Corrupt every chunk except 1.1 (row 1, elements 4..8): reading them would fail.
    for name, _ in expected_chunk_files(path, x.shape, x.dtype):
        if name != "1.1":
            with open(path / name, "r+b") as f:
                f.truncate(1)
    _assert_bit_equal(read(path, (1, slice(4, 8))), x[1, 4:8])
    with pytest.raises(ValueError):
        read(path, 1)


# --- validation ------------------------------------------------------------------------


@pytest.fixture
def stored(tmp_path):
    path = tmp_path / "a"
    x = _random((4, 6), np.float32)
    write_array(path, x)
    return path, x


def test_validate_passes_on_complete_array(stored):
    path, x = stored
    validate_array(path, x.shape, x.dtype)


def test_validate_detects_missing_chunk(stored):
    path, x = stored
    os.remove(path / "2.0")
    # TensorStore itself silently reads the fill value for the missing chunk.
    assert not np.asarray(read(path, 2)).any()
    with pytest.raises(StoreError, match=r"missing chunk file .*2\.0"):
        validate_array(path, x.shape, x.dtype)


def test_validate_detects_truncated_chunk(stored):
    path, x = stored
    with open(path / "1.0", "r+b") as f:
        f.truncate(10)
    with pytest.raises(StoreError, match=r"truncated chunk file .*1\.0: 10 bytes, expected 24"):
        validate_array(path, x.shape, x.dtype)


def test_validate_detects_oversized_chunk(stored):
    path, x = stored
    with open(path / "3.0", "ab") as f:
        f.write(b"\0")
    with pytest.raises(StoreError, match=r"oversized chunk file .*3\.0"):
        validate_array(path, x.shape, x.dtype)


def test_validate_detects_missing_metadata(stored):
    path, x = stored
    os.remove(path / ".zarray")
    with pytest.raises(StoreError, match=r"\.zarray"):
        validate_array(path, x.shape, x.dtype)
    with pytest.raises(StoreError, match="cannot read"):
        validate_array(path.parent / "nonexistent", x.shape, x.dtype)


def test_validate_detects_metadata_mismatch(stored):
    path, x = stored
    with pytest.raises(StoreError, match=r"shape is \[4, 6\], expected \[4, 7\]"):
        validate_array(path, (4, 7), x.dtype)
    with pytest.raises(StoreError, match=r"dtype is '<f4', expected 'bfloat16'"):
        validate_array(path, x.shape, ml_dtypes.bfloat16)


def test_write_over_different_metadata_raises(stored):
    path, _ = stored
    with pytest.raises(StoreError, match="cannot open"):
        write_array(path, np.zeros((4, 7), np.float32))


def test_rewrite_with_same_metadata_overwrites(stored):
    path, x = stored
    write_array(path, x + 1)
    np.testing.assert_array_equal(read(path), x + 1)


# --- durability ------------------------------------------------------------------------


def _record_fsyncs(monkeypatch):
    """The inode numbers of everything fsynced from now on, in order."""
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_fsync_tree_flushes_every_file_and_directory_children_first(tmp_path, monkeypatch):
    write_array(tmp_path / "arrays" / "a", _random((2, 3), np.float32))
    write_array(tmp_path / "arrays" / "b", _random((), np.int32))
    (tmp_path / "record.json").write_text("{}")
    os.symlink(tmp_path / "record.json", tmp_path / "link")
    synced = _record_fsyncs(monkeypatch)
    _store.fsync_tree(tmp_path)
    everything = [str(tmp_path)] + [
        os.path.join(root, name)
        for root, dirs, files in os.walk(tmp_path)
        for name in dirs + files
        if name != "link"
    ]
    paths = {os.stat(path).st_ino: path for path in everything}
    assert sorted(synced) == sorted(paths)  # each once; the link is not followed
    position = {paths[ino]: i for i, ino in enumerate(synced)}
    for path in everything[1:]:
        assert position[path] < position[os.path.dirname(path)]
    assert position[str(tmp_path)] == len(synced) - 1


def test_fsync_path_flushes_one_file_or_directory(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    synced = _record_fsyncs(monkeypatch)
    _store.fsync_path(tmp_path / "f")
    _store.fsync_path(tmp_path)
    assert synced == [os.stat(tmp_path / "f").st_ino, os.stat(tmp_path).st_ino]


# --- jax.Array writes and reads --------------------------------------------------------


class _RecordingStore:
    """Wraps a TensorStore, recording the indices written through __getitem__."""

    def __init__(self, store, log):
        self._store, self._log = store, log

    def __getitem__(self, index):
        self._log.append(index)
        return self._store[index]

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.fixture
def write_log(monkeypatch):
    log = []
    real_open = _store._open
    monkeypatch.setattr(
        _store, "_open", lambda *a, **k: _RecordingStore(real_open(*a, **k), log)
    )
    return log


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_])
def test_sharded_write_matches_numpy_write(tmp_path, mesh8, dtype):
    x = _random((8, 5, 3), dtype)
    write_array(tmp_path / "np", x)
    write_array(tmp_path / "jax", _row_sharded(x, mesh8))
    validate_array(tmp_path / "jax", x.shape, x.dtype)
    assert _files(tmp_path / "jax") == _files(tmp_path / "np")
    _assert_bit_equal(read(tmp_path / "jax"), x)


def test_sharded_write_writes_each_row_once(tmp_path, mesh8, write_log):
    write_array(tmp_path / "a", _row_sharded(np.ones((8, 3), np.float32), mesh8))
    rows = sorted(index[0].start for index in write_log)
    assert rows == list(range(8))


def test_replicated_write_writes_only_replica_zero(tmp_path, mesh8, write_log):
    x = _random((8, 4), np.float32)
    write_array(tmp_path / "a", jax.device_put(x, NamedSharding(mesh8, P())))
    assert len(write_log) == 1
    _assert_bit_equal(read(tmp_path / "a"), x)
    validate_array(tmp_path / "a", x.shape, x.dtype)


def test_partially_replicated_write(tmp_path, write_log):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = _random((4, 6), np.float32)
    write_array(tmp_path / "a", jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert sorted(index[0].start for index in write_log) == [0, 1, 2, 3]
    _assert_bit_equal(read(tmp_path / "a"), x)


def test_scalar_jax_array(tmp_path, mesh8):
    x = jax.device_put(jnp.float32(3.5), NamedSharding(mesh8, P()))
    write_array(tmp_path / "a", x)
    validate_array(tmp_path / "a", (), np.float32)
    assert read(tmp_path / "a") == np.float32(3.5)
    y = read_to_jax(tmp_path / "a", (), np.float32, NamedSharding(mesh8, P()))
    assert y.shape == () and float(y) == 3.5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint32])
def test_read_to_jax_same_mesh(tmp_path, mesh8, dtype):
    x = _random((8, 6), dtype)
    write_array(tmp_path / "a", _row_sharded(x, mesh8))
    sharding = NamedSharding(mesh8, P("data"))
    y = read_to_jax(tmp_path / "a", x.shape, x.dtype, sharding)
    assert y.sharding == sharding
    for shard in y.addressable_shards:
        _assert_bit_equal(shard.data, x[shard.index])
    _assert_bit_equal(y, x)


def test_read_to_jax_onto_smaller_mesh(tmp_path, mesh8):
    x = _random((8, 6), np.float32)
    write_array(tmp_path / "a", _row_sharded(x, mesh8))
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    sharding = NamedSharding(mesh4, P("data"))
    y = read_to_jax(tmp_path / "a", x.shape, x.dtype, sharding)
    assert y.sharding == sharding
    assert [s.data.shape for s in y.addressable_shards] == [(2, 6)] * 4
    _assert_bit_equal(y, x)


def test_read_to_jax_replicated_reads_each_region_once(tmp_path, mesh8, write_log):
    x = _random((8, 6), np.float32)
    write_array(tmp_path / "a", x)
    write_log.clear()
    y = read_to_jax(tmp_path / "a", x.shape, x.dtype, NamedSharding(mesh8, P()))
    assert len(write_log) == 1
    _assert_bit_equal(y, x)


def test_read_to_jax_checks_shape_and_dtype(stored, mesh8):
    path, x = stored
    sharding = NamedSharding(jax.make_mesh((4,), ("data",), devices=jax.devices()[:4]), P())
    with pytest.raises(StoreError, match="expected"):
        read_to_jax(path, (4, 7), x.dtype, sharding)
    with pytest.raises(StoreError, match="expected"):
        read_to_jax(path, x.shape, np.int32, sharding)


def test_read_to_jax_refuses_silent_64_bit_narrowing(tmp_path, mesh8):
    x = np.arange(8, dtype=np.int64) << 40
    write_array(tmp_path / "a", x)
    sharding = NamedSharding(mesh8, P("data"))
    if jax.config.jax_enable_x64:
        np.testing.assert_array_equal(read_to_jax(tmp_path / "a", (8,), np.int64, sharding), x)
    else:
        with pytest.raises(StoreError, match="jax_enable_x64"):
            read_to_jax(tmp_path / "a", (8,), np.int64, sharding)


# --- concurrent writers ----------------------------------------------------------------


def test_threads_writing_disjoint_rows_of_a_new_array(tmp_path):
    x = _random((2, 1000), np.float32)
    for trial in range(10):
        path = tmp_path / str(trial)
        barrier = threading.Barrier(2)
        errors = []

        def host(row):
            try:
                barrier.wait()
                store = _store._open(
                    path, create=True, open=True, metadata=array_spec(x.shape, x.dtype)
                )
                store[row].write(x[row]).result()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=host, args=(row,)) for row in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        validate_array(path, x.shape, x.dtype)
        _assert_bit_equal(read(path), x)


_HOST = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_num_cpu_devices", 4)
    port, process_id, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    from zero_optax._store import write_array

    mesh = jax.make_mesh((8,), ("data",))
    x = np.arange(8 * 1000, dtype=np.float32).reshape(8, 1000)
    for name, spec in [("rows", P("data")), ("replicated", P())]:
        value = jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])
        write_array(f"{out}/{name}", value)
    jax.distributed.shutdown()
    """
)


def test_two_processes_write_one_global_array(tmp_path):
    """Two JAX processes with 4 CPU devices each write one 8-row global array."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="",
        PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]),
    )
    hosts = [
        subprocess.Popen(
            [sys.executable, "-c", _HOST, str(port), str(i), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for host in hosts:
        output, _ = host.communicate(timeout=60)
        assert host.returncode == 0, output
    x = np.arange(8 * 1000, dtype=np.float32).reshape(8, 1000)
    write_array(tmp_path / "reference", x)
    for name in ["rows", "replicated"]:
        validate_array(tmp_path / name, x.shape, x.dtype)
        assert _files(tmp_path / name) == _files(tmp_path / "reference")
        np.testing.assert_array_equal(read(tmp_path / name), x)


def test_row_longer_than_chunk_elements(tmp_path):
    n = _store.CHUNK_ELEMENTS + 3
    x = np.zeros((2, n), np.bool_)
    x[:, -3:] = True
    path = tmp_path / "a"
    write_array(path, x)
    half = _store.CHUNK_ELEMENTS // 2 + 2  # two balanced pieces, not CHUNK_ELEMENTS + 3
    assert array_spec(x.shape, x.dtype)["chunks"] == [1, half]
    assert expected_chunk_files(path, x.shape, x.dtype) == [
        (name, half) for name in ["0.0", "0.1", "1.0", "1.1"]
    ]
    validate_array(path, x.shape, x.dtype)
    np.testing.assert_array_equal(read(path, (1, slice(n - 5, n))), x[1, -5:])


@pytest.mark.parametrize("extra", [3, 1, 0, -1])
@pytest.mark.parametrize("pieces", [1, 2, 5])
def test_split_rows_have_balanced_chunk_widths(tmp_path, monkeypatch, pieces, extra):
    """A row of `pieces * CHUNK_ELEMENTS + extra` wastes less than one element per piece."""
    monkeypatch.setattr(_store, "CHUNK_ELEMENTS", 16)
    n = pieces * 16 + extra
    [_, width] = array_spec((2, n), np.float32)["chunks"]
    count = -(-n // width)
    assert width <= 16 and count == -(-n // 16)  # the fewest pieces that fit
    assert 0 <= count * width - n < count
    x = _random((2, n), np.float32)
    write_array(tmp_path / "a", x)
    files = expected_chunk_files(tmp_path / "a", x.shape, x.dtype)
    assert {name: len(data) for name, data in _files(tmp_path / "a").items()} == dict(files)
    assert sum(size for _, size in files) == 2 * count * width * 4 < 2 * (n + count) * 4
    validate_array(tmp_path / "a", x.shape, x.dtype)
    _assert_bit_equal(read(tmp_path / "a"), x)


def test_row_of_chunk_elements_plus_three_is_split_evenly(monkeypatch):
    monkeypatch.setattr(_store, "CHUNK_ELEMENTS", 64)
    # Not [1, 64], whose second piece would hold 3 elements and 61 of padding.
    assert array_spec((4, 67), np.float32)["chunks"] == [1, 34]
    assert expected_chunk_files("x", (1, 67), np.float32) == [("0.0", 136), ("0.1", 136)]


def test_validate_accepts_arrays_written_before_balanced_widths(tmp_path, monkeypatch):
    monkeypatch.setattr(_store, "CHUNK_ELEMENTS", 16)
    x = _random((2, 100), np.float32)
    path = tmp_path / "a"
    old = array_spec(x.shape, x.dtype) | {"chunks": [1, 16]}
    _store._open(path, create=True, metadata=old)[...].write(x).result()
    assert len(os.listdir(path)) == 1 + 2 * 7
    validate_array(path, x.shape, x.dtype)
    _assert_bit_equal(read(path), x)
    with open(path / "1.6", "r+b") as f:
        f.truncate(16)
    with pytest.raises(StoreError, match=r"truncated chunk file .*1\.6: 16 bytes, expected 64"):
        validate_array(path, x.shape, x.dtype)
    _store._open(tmp_path / "b", create=True, metadata=old | {"chunks": [1, 10]})
    with pytest.raises(StoreError, match=r"chunks is \[1, 10\], expected \[1, 15\]"):
        validate_array(tmp_path / "b", x.shape, x.dtype)


def test_open_array_and_create_array_stream_regions(tmp_path, monkeypatch):
    monkeypatch.setattr(_store, "CHUNK_ELEMENTS", 4)
    x = _random((3, 10), np.float32)
    out = create_array(tmp_path / "a", x.shape, x.dtype)
    step = array_spec(x.shape, x.dtype)["chunks"][1]
    for r in range(3):
        for a in range(0, 10, step):
            b = min(a + step, 10)
            out[r, a:b].write(x[r, a:b]).result()
    validate_array(tmp_path / "a", x.shape, x.dtype)
    source = open_array(tmp_path / "a")
    pieces = [
        source[r, a : min(a + 3, 10)].read().result() for r in range(3) for a in range(0, 10, 3)
    ]
    _assert_bit_equal(np.concatenate(pieces), x.reshape(-1))
    with pytest.raises(StoreError, match="cannot open"):
        open_array(tmp_path / "missing")
    with pytest.raises(StoreError, match="cannot open"):
        create_array(tmp_path / "a", (3, 11), x.dtype)
