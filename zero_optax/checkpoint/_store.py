"""The arrays of an item directory, read and written with TensorStore: zarr3 arrays in one OCDBT database.

As Orbax's `PyTreeCheckpointHandler` stores a flat dict of arrays (`use_zarr3=True`). `ItemArrays` reads regions
without devices; `ItemWriter` writes such arrays offline (`zo.reshard`) in bounded transactions.

Examples:
  >>> import numpy as np, tempfile
  >>> from zero_optax.checkpoint import _store, _paths
  >>> path = _paths.as_path(tempfile.mkdtemp())
  >>> with _store.ItemWriter(path) as w:
  ...     w.create("0.entry0000", (10,), "float32", (4,))
  ...     w.write("0.entry0000", ((0, 10),), np.arange(10, dtype=np.float32))
  >>> _store.ItemArrays(path).read("0.entry0000", ((3, 6),)).tolist()
  [3.0, 4.0, 5.0]
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self, cast

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy)
import numpy as np
import tensorstore as ts
from etils import epath

from zero_optax.checkpoint import _paths
from zero_optax.core._errors import StoreError

PIECE_BYTES = 16 << 20
"""Reads larger than this are split into sequential pieces aligned to the stored chunks."""
CACHE_BYTES = 64 << 20
"""`ItemArrays` reads an array of at most `PIECE_BYTES` whole once and keeps it, up to this many bytes in all (the
least recently read leave first): a restore at another world size reads many small regions of each."""
BATCH_BYTES = 64 << 20
"""`ItemWriter` commits a transaction (one new OCDBT data file) whenever this many bytes are staged."""
Region = tuple[tuple[int, int], ...]
"""A region of an array: `(start, stop)` per dimension."""


def _kvstore(directory: epath.Path) -> dict[str, Any]:
    return {"driver": "ocdbt", "base": _paths.kvstore(directory)}


def _spec(directory: epath.Path, name: str) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {**_kvstore(directory), "path": name + "/"}}


@contextlib.contextmanager
def _failing(make: Callable[[str], Exception]) -> Iterator[None]:
    """Raises `make(message)` for a TensorStore `ValueError`: its first line, without the spec it appends."""
    try:
        yield
    except ValueError as e:
        text = str(e).split(" [tensorstore_spec=")[0]
        raise make(text.splitlines()[0] if text else type(e).__name__) from None


def aligned_empty(shape: int | Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised array aligned to 64 bytes, which `jax.device_put` places on a CPU device without a copy."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape: int | Sequence[int], dtype: Any) -> np.ndarray:
    """`aligned_empty`, filled with zeros."""
    out = aligned_empty(shape, dtype)
    out.fill(0)
    return out


def chunk_keys(name: str, shape: Sequence[int], chunks: Sequence[int]) -> set[str]:
    """The keys of every chunk of a zarr3 array of `shape` stored in `chunks` (default key encoding)."""
    grid = [range(-(-d // c)) for d, c in zip(shape, chunks)]
    return {f"{name}/c/" + "/".join(map(str, cell)) for cell in itertools.product(*grid)}


class ItemArrays:
    """The arrays of one item directory, opened once each, read region by region."""

    def __init__(self, directory: Any):
        self.directory = _paths.as_path(directory)
        self.context = ts.Context()
        self._open: dict[str, ts.TensorStore] = {}
        self._whole: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()

    def _fail(self, name: str, problem: str) -> StoreError:
        return StoreError(f"{self.directory} is incomplete or damaged: array {name}: {problem}. Nothing was loaded.")

    def open(self, name: str) -> ts.TensorStore:
        """Array `name`, opened for reading (no missing chunk is read as fill)."""
        if name not in self._open:
            spec = dict(_spec(self.directory, name), fill_missing_data_reads=False)
            with _failing(lambda m: self._fail(name, f"cannot open it ({m})")):
                self._open[name] = ts.open(spec, open=True, read=True, context=self.context).result()
        return self._open[name]

    def _database(self, operation: Callable[[ts.KvStore], Any]) -> Any:
        """What `operation` returns for the item's OCDBT database."""
        with _failing(lambda m: StoreError(f"{self.directory} holds no readable array database ({m}).")):
            return operation(ts.KvStore.open(_kvstore(self.directory), context=self.context).result())

    def stored_keys(self) -> set[str]:
        """Every key of the item's OCDBT database (array metadata and chunks)."""
        return self._database(lambda kv: {k.decode() for k in kv.list().result()})

    def read_key(self, key: str) -> bytes | None:
        """The value of one key of the item's OCDBT database (`name/zarr.json`: an array's metadata), or None."""
        result = self._database(lambda kv: kv.read(key).result())
        return result.value if result.state == "value" else None

    def check(self, arrays: Sequence[Any]) -> None:
        """Refuses the first of `arrays` (`StoredArray`s) not stored whole with its shape and dtype (metadata only)."""
        keys = self.stored_keys()
        for a in arrays:
            store = self.open(a.name)
            shape, dtype = tuple(store.domain.shape), store.dtype.numpy_dtype
            if shape != tuple(a.shape) or np.dtype(dtype).name != a.dtype:
                raise self._fail(a.name, f"it is {list(shape)} {np.dtype(dtype).name}, expected {list(a.shape)} "
                                         f"{a.dtype}")
            # (tensorstore types a chunk shape as possibly unset; a stored array's is set)
            missing = chunk_keys(a.name, shape, cast(tuple[int, ...], store.chunk_layout.write_chunk.shape)) - keys
            if missing:
                raise self._fail(a.name, f"{len(missing)} chunks are missing (first: {min(missing)})")

    def read(self, name: str, region: Region) -> np.ndarray:
        """The values of `region` of array `name`, read in pieces of about `PIECE_BYTES` at most (a small array's
        from its whole, read once: `CACHE_BYTES`)."""
        store = self.open(name)
        shape = tuple(hi - lo for lo, hi in region)
        out = aligned_empty(shape, store.dtype.numpy_dtype)
        if out.size == 0:
            return out
        whole = self._small(name, store)
        if whole is not None:
            out[...] = whole[tuple(slice(lo, hi) for lo, hi in region)]
            return out
        chunk = cast(tuple[int, ...], store.chunk_layout.read_chunk.shape)[-1]  # (set, as `check` says)
        row_bytes = math.prod(shape[:-1]) * out.dtype.itemsize
        step = max(1, PIECE_BYTES // max(row_bytes * chunk, 1)) * chunk
        lo, hi = region[-1]
        with _failing(lambda m: self._fail(name, f"reading {list(region)} failed ({m})")):
            for start, stop in itertools.pairwise([lo, *range(lo - lo % chunk + step, hi, step), hi]):
                index = tuple(slice(a, b) for a, b in region[:-1]) + (slice(start, stop),)
                out[..., start - lo:stop - lo] = store[index].read().result()
        return out


    def _small(self, name: str, store: ts.TensorStore) -> np.ndarray | None:
        """Array `name` whole if it is at most `PIECE_BYTES` (read once, kept up to `CACHE_BYTES`), else None."""
        if name in self._whole:
            self._whole.move_to_end(name)
            return self._whole[name]
        shape = tuple(store.domain.shape)
        if math.prod(shape) * store.dtype.numpy_dtype.itemsize > PIECE_BYTES:
            return None
        with _failing(lambda m: self._fail(name, f"reading it failed ({m})")):
            whole = np.asarray(store.read().result())
        self._whole[name] = whole
        while sum(x.nbytes for x in self._whole.values()) > CACHE_BYTES and len(self._whole) > 1:
            self._whole.popitem(last=False)
        return whole


class ItemWriter:
    """Writes zarr3 arrays at an item directory: their metadata in one transaction, then their data in transactions
    of about `batch_bytes`. A context manager: `create` every array, then `write`."""

    def __init__(self, directory: Any, batch_bytes: int = BATCH_BYTES):
        self.directory = _paths.as_path(directory)
        self.context = ts.Context()
        self.batch_bytes = batch_bytes
        self._pending: dict[str, dict[str, Any]] = {}
        self._arrays: dict[str, ts.TensorStore] = {}
        self._txn: ts.Transaction | None = None
        self._staged = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self._create_pending()
            self.commit()
        elif self._txn is not None:
            self._txn.abort()

    def create(self, name: str, shape: Sequence[int], dtype: str, chunks: Sequence[int],
               attributes: dict[str, Any] | None = None) -> None:
        """Declares array `name`, stored zstd-compressed in chunks of `chunks`; every declared array's metadata is
        written together before the first `write`."""
        self._pending[name] = ({"attributes": attributes} if attributes else {}) | {
            "shape": list(shape), "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, c) for c in chunks]}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                       {"name": "zstd", "configuration": {"level": 3}}]}

    def _create_pending(self) -> None:
        if not self._pending:
            return
        txn = ts.Transaction()
        with _failing(lambda m: StoreError(f"cannot create arrays in {self.directory}: {m}")):
            for name, metadata in self._pending.items():
                ts.open(_spec(self.directory, name) | {"metadata": metadata}, create=True, context=self.context,
                        transaction=txn).result()
            txn.commit_async().result()
            for name in self._pending:
                # Chunks of zeros are stored too, so that a missing chunk is damage (as in Orbax's arrays).
                self._arrays[name] = ts.open(_spec(self.directory, name) | {"store_data_equal_to_fill_value": True},
                                             open=True, write=True, context=self.context).result()
        self._pending = {}

    def write(self, name: str, region: Region, data: np.ndarray) -> None:
        """Stages `data` as `region` of array `name`; commits once `batch_bytes` are staged."""
        self._create_pending()
        if self._txn is None:
            self._txn = ts.Transaction()
        index = tuple(slice(lo, hi) for lo, hi in region)
        with _failing(lambda m: StoreError(f"cannot write array {name} in {self.directory}: {m}")):
            self._arrays[name].with_transaction(self._txn)[index].write(data).result()
        self._staged += data.nbytes
        if self._staged >= self.batch_bytes:
            self.commit()

    def commit(self) -> None:
        """Commits what is staged."""
        if self._txn is not None:
            txn, self._txn, self._staged = self._txn, None, 0
            with _failing(lambda m: StoreError(f"cannot write arrays to {self.directory}: {m}")):
                txn.commit_async().result()
