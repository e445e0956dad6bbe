"""Raw array storage for ZeRO checkpoints: uncompressed zarr v2 arrays written with TensorStore.

Every optimizer-state array has a leading device axis, shape ``(N, *rest)``, and each
device holds one row. Arrays are stored so that:

* chunks never span two rows, so hosts writing the rows they own never touch the same
  chunk file, and the files are identical whether written by one process or many;
* chunks are uncompressed, so every chunk file has an exact, known byte size
  (``prod(chunks) * itemsize``; zarr v2 edge chunks are stored full size) and missing or
  truncated files can be detected by :func:`validate_array` before anything is loaded;
* an axis split into chunks is split into pieces of balanced width, so the full-size edge
  chunk wastes less than one element (of that axis) per piece;
* any region (one row, or part of one) can be read without loading the rest;
* chunk files are fsynced as they are written; :func:`fsync_tree` flushes a whole tree
  (arrays, other files, the directories themselves) before it is renamed into view.

On-disk layout of an array at ``path``::

    path/.zarray      JSON metadata (zarr_format 2, shape, chunks, dtype, ...)
    path/0.0, 0.1 ... one file per chunk, chunk grid indices joined by "."
    path/0            the single chunk of a 0-d array

Arrays with a zero-sized dimension have only ``.zarray``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from typing import Any

import jax
import numpy as np
import tensorstore as ts

CHUNK_ELEMENTS = 1 << 22
"""Maximum number of elements in one chunk."""

_DIMENSION_SEPARATOR = "."


from zero_optax._errors import StoreError  # noqa: E402  (re-exported: zero_optax._store.StoreError)


def _zarr_dtype(dtype: Any) -> str:
    """Returns the zarr v2 dtype string for ``dtype`` (little-endian; ml_dtypes by name)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "V":  # ml_dtypes extension types such as bfloat16.
        return dtype.name
    return dtype.newbyteorder("<").str


def _chunks(shape: tuple[int, ...], balanced: bool = True) -> list[int]:
    """Returns chunk sizes: one row per chunk, trailing axes kept whole while they fit.

    Axis 0 is always chunked at 1. Walking from the last axis towards axis 1, each axis
    is kept whole while the chunk stays within ``CHUNK_ELEMENTS``; the first axis that does
    not fit is split into the fewest pieces that do, all of width
    ``ceil(size / pieces)``, and the axes before it are chunked at 1. ``balanced=False``
    gives the layout of checkpoints written before widths were balanced: pieces as wide
    as fit, so the last one may be almost empty.
    Zero-sized axes get chunk size 1 (zarr requires positive chunk sizes).
    """
    chunks = [1] * len(shape)
    elements = 1
    for axis in range(len(shape) - 1, 0, -1):
        size = max(shape[axis], 1)
        if elements * size <= CHUNK_ELEMENTS:
            chunks[axis] = size
            elements *= size
        else:
            widest = max(CHUNK_ELEMENTS // elements, 1)
            chunks[axis] = -(-size // -(-size // widest)) if balanced else widest
            break
    return chunks


def array_spec(shape: tuple[int, ...], dtype: Any) -> dict[str, Any]:
    """Returns the zarr v2 metadata used to store an array of ``shape`` and ``dtype``.

    Args:
      shape: Global array shape, leading axis the device axis.
      dtype: Array dtype (numpy or ml_dtypes).

    Returns:
      The ``metadata`` dictionary of the TensorStore zarr spec, also what ``.zarray``
      holds (apart from ``zarr_format``).
    """
    shape = tuple(int(d) for d in shape)
    return {
        "shape": list(shape),
        "chunks": _chunks(shape),
        "dtype": _zarr_dtype(dtype),
        "compressor": None,
        "filters": None,
        "fill_value": None,
        "order": "C",
        "dimension_separator": _DIMENSION_SEPARATOR,
    }


def _open(
    path: str | os.PathLike, metadata: dict[str, Any] | None = None, **kwargs: Any
) -> ts.TensorStore:
    """Opens (or with ``create=True`` creates) the zarr array at ``path``.

    Every file is written under a temporary name, fsynced, renamed into place, and the
    array directory fsynced (``file_io_sync``), so a write is durable once its future is.
    """
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": os.fspath(path)},
        # Write chunk files even when they equal the fill value, so every chunk exists.
        "store_data_equal_to_fill_value": True,
        "context": {"file_io_sync": True},  # TensorStore's default, relied on: keep it.
    }
    if metadata is not None:
        spec["metadata"] = metadata
    try:
        return ts.open(spec, **kwargs).result()
    except ValueError as e:
        raise StoreError(f"cannot open array at {os.fspath(path)}: {e}") from e


def open_array(path: str | os.PathLike) -> ts.TensorStore:
    """Opens the array at ``path`` for reading, once, for callers that read many regions.

    ``open_array(path)[index].read().result()`` is :func:`read` without opening the array
    again for every region. Missing chunks read as zeros; run :func:`validate_array` first.

    Raises:
      StoreError: If no readable array is stored at ``path``.
    """
    return _open(path, open=True, read=True)


def create_array(
    path: str | os.PathLike, shape: tuple[int, ...], dtype: Any
) -> ts.TensorStore:
    """Creates (or opens, if its metadata is identical) the array at ``path`` for writing.

    For writers that fill an array region by region (e.g. one chunk, ``array_spec(shape,
    dtype)["chunks"]``, at a time): ``create_array(...)[index].write(data).result()``.
    Writes of whole chunks from different processes never touch the same file.

    Raises:
      StoreError: If an array with different metadata already exists at ``path``.
    """
    return _open(path, create=True, open=True, metadata=array_spec(shape, dtype))


def write_array(path: str | os.PathLike, value: jax.Array | np.ndarray) -> None:
    """Writes ``value`` as a zarr array at ``path``, creating the array if needed.

    For a ``jax.Array`` only the addressable shards with ``replica_id == 0`` are written,
    each to the region its index names, so every process of a multi-host job can call this
    for the same global array and together they write each element exactly once. The
    array is opened with ``create=True, open=True``: processes racing to create it with
    identical metadata all succeed. Safe concurrent writing needs shard boundaries that
    align with chunk boundaries, which holds for row sharding ``P("data")`` and replicated
    arrays.

    Args:
      path: Directory of the array.
      value: A global ``jax.Array`` or a numpy array (written whole).

    Raises:
      StoreError: If an array with different metadata already exists at ``path``.
    """
    if isinstance(value, jax.Array):
        regions = [
            (shard.index, np.asarray(shard.data))
            for shard in value.addressable_shards
            if shard.replica_id == 0
        ]
    else:
        regions = [((), np.asarray(value))]
    write_regions(path, value.shape, value.dtype, regions)


def write_regions(
    path: str | os.PathLike,
    shape: tuple[int, ...],
    dtype: Any,
    regions: list[tuple[Any, np.ndarray]],
) -> None:
    """Writes host ``(index, data)`` regions of an array of ``shape`` and ``dtype`` at ``path``.

    The array is created if needed, as in :func:`write_array` (which calls this with a
    ``jax.Array``'s replica-0 shards); this form takes data already copied to host memory,
    for writers that copy device data first and write later (asynchronous checkpointing).

    Raises:
      StoreError: If an array with different metadata already exists at ``path``.
    """
    store = create_array(path, shape, dtype)
    futures = [store[index].write(data) for index, data in regions]
    for future in futures:
        future.result()


def expected_chunk_files(
    path: str | os.PathLike, shape: tuple[int, ...], dtype: Any
) -> list[tuple[str, int]]:
    """Lists every chunk file an array of ``shape`` and ``dtype`` has, with its exact size.

    Args:
      path: Directory of the array (unused; the names are relative to it).
      shape: Global array shape.
      dtype: Array dtype.

    Returns:
      ``(file name relative to path, size in bytes)`` for each chunk, in row-major order
      of the chunk grid. Empty for arrays with a zero-sized dimension.
    """
    del path
    spec = array_spec(shape, dtype)
    return _chunk_files(spec["shape"], spec["chunks"], dtype)


def _chunk_files(
    shape: list[int], chunks: list[int], dtype: Any
) -> list[tuple[str, int]]:
    """:func:`expected_chunk_files` of an array of ``shape`` stored in ``chunks``."""
    nbytes = math.prod(chunks) * np.dtype(dtype).itemsize
    grid = [range(math.ceil(d / c)) for d, c in zip(shape, chunks)]
    if not grid:  # 0-d arrays have one chunk, named "0".
        return [("0", nbytes)]
    return [
        (_DIMENSION_SEPARATOR.join(map(str, cell)), nbytes)
        for cell in itertools.product(*grid)
    ]


def validate_array(path: str | os.PathLike, shape: tuple[int, ...], dtype: Any) -> None:
    """Checks that a complete array of ``shape`` and ``dtype`` is stored at ``path``.

    Only file metadata is read: ``.zarray`` must match :func:`array_spec`, and every chunk
    file must exist with exactly its expected size. TensorStore silently reads fill values
    for missing chunks, so call this before reading a checkpoint. Arrays written before
    chunk widths were balanced (``_chunks(shape, balanced=False)``) are accepted too.

    Args:
      path: Directory of the array.
      shape: Expected global shape.
      dtype: Expected dtype.

    Raises:
      StoreError: Naming the first problem: missing or unreadable ``.zarray``,
        mismatching metadata, or a missing, truncated or oversized chunk file.
    """
    path = os.fspath(path)
    zarray = os.path.join(path, ".zarray")
    try:
        with open(zarray) as f:
            metadata = json.load(f)
    except (OSError, ValueError) as e:
        raise StoreError(f"cannot read array metadata {zarray}: {e}") from e
    expected = array_spec(shape, dtype) | {"zarr_format": 2}
    unbalanced = _chunks(tuple(expected["shape"]), balanced=False)
    if metadata.get("chunks") == unbalanced:
        expected["chunks"] = unbalanced
    for key, want in expected.items():
        if metadata.get(key) != want:
            raise StoreError(
                f"{zarray}: {key} is {metadata.get(key)!r}, expected {want!r}"
            )
    for name, size in _chunk_files(expected["shape"], expected["chunks"], dtype):
        file = os.path.join(path, name)
        try:
            actual = os.path.getsize(file)
        except OSError:
            raise StoreError(f"missing chunk file {file}") from None
        if actual != size:
            kind = "truncated" if actual < size else "oversized"
            raise StoreError(f"{kind} chunk file {file}: {actual} bytes, expected {size}")


def fsync_path(path: str | os.PathLike) -> None:
    """Flushes one file, or one directory's entries (creations, renames), to stable storage."""
    directory = getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0
    fd = os.open(path, os.O_RDONLY | directory)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """Flushes every file and directory under ``path``, and ``path`` itself, to stable storage.

    Call it on a directory written in a temporary place before renaming it into view, so
    that a power loss just after the rename cannot expose missing or incomplete files (then
    :func:`fsync_path` the parent to make the rename itself durable). Contents are never
    read; files TensorStore wrote are already synced, so they cost one system call each.
    Symbolic links are not followed.
    """
    for root, _, files in os.walk(os.fspath(path), topdown=False):  # children first
        for name in files:
            file = os.path.join(root, name)
            if not os.path.islink(file):
                fsync_path(file)
        fsync_path(root)


def read(path: str | os.PathLike, index: Any = ...) -> np.ndarray:
    """Reads a region of the array at ``path``, loading only the chunks it touches.

    Missing chunks read as zeros without error; run :func:`validate_array` first.

    Args:
      path: Directory of the array.
      index: A numpy-style basic index, e.g. ``r`` for one row or
        ``(r, slice(a, b))`` for part of a row of a 2-D array. Defaults to everything.

    Returns:
      The region as a numpy array.
    """
    return np.asarray(open_array(path)[index].read().result())


def read_to_jax(
    path: str | os.PathLike,
    shape: tuple[int, ...],
    dtype: Any,
    sharding: jax.sharding.Sharding,
) -> jax.Array:
    """Reads the array at ``path`` into a global ``jax.Array`` laid out by ``sharding``.

    Only the regions of this process's addressable devices are read, each distinct region
    once, all concurrently.

    Args:
      path: Directory of the array.
      shape: Expected global shape.
      dtype: Expected dtype.
      sharding: Target sharding, e.g. ``NamedSharding(mesh, P("data"))``; need not match
        the sharding the array was written from.

    Returns:
      The global array.

    Raises:
      StoreError: If the stored shape or dtype differs from ``shape`` and ``dtype``, or
        JAX would silently narrow ``dtype`` (64-bit types without ``jax_enable_x64``).
    """
    shape = tuple(int(d) for d in shape)
    if jax.dtypes.canonicalize_dtype(dtype) != np.dtype(dtype):
        raise StoreError(f"{np.dtype(dtype)} arrays need jax_enable_x64 to load into JAX")
    store = open_array(path)
    stored_dtype = store.dtype.numpy_dtype
    if tuple(store.shape) != shape or _zarr_dtype(stored_dtype) != _zarr_dtype(dtype):
        raise StoreError(
            f"array at {os.fspath(path)} is {tuple(store.shape)} {stored_dtype},"
            f" expected {shape} {np.dtype(dtype)}"
        )

    def key(index: tuple[slice, ...]) -> tuple[tuple[int, int, int], ...]:
        return tuple(s.indices(d) for s, d in zip(index, shape))

    pending = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        if key(index) not in pending:
            pending[key(index)] = store[index].read()
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.asarray(pending[key(index)].result())
    )
