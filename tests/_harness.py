"""Shared test machinery: run zero1 on a sub-mesh and plain optax on one device fed the reduced gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo


class CompileCounter:
    """Counts XLA backend compilations while active (a context manager)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self._active = False

    def _listener(self, event, duration, **kwargs):
        del duration, kwargs
        if self._active and event == self.EVENT:
            self.count += 1

    def __enter__(self):
        self._active = True
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        self._active = False
        jax.monitoring.unregister_event_duration_listener(self._listener)


def mesh_of(n: int) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def small_params(dtype=jnp.float32) -> dict:
    """Leaves whose sizes do not divide 3 or 8, a scalar, and matrices for matrix optimizers."""
    return {
        "dense": {"w": (jnp.arange(35, dtype=jnp.float32).reshape(5, 7) / 35 - 0.5).astype(dtype),
                  "b": jnp.linspace(-1, 1, 7).astype(dtype)},
        "scale": jnp.asarray(0.7, dtype),
        "head": (jnp.eye(4, 6) + 0.05).astype(dtype),
        "vec": jnp.full((13,), 0.3, dtype),
    }


def gradient_sequence(params, n: int, steps: int, seed: int = 0) -> list:
    """`steps` pytrees of per-device gradients, each leaf stacked along a leading device axis of size n."""
    key = jax.random.key(seed)
    out = []
    for t in range(steps):
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.fold_in(key, t), len(leaves))
        out.append(jax.tree.unflatten(treedef, [
            jax.random.normal(k, (n,) + x.shape, jnp.float32).astype(x.dtype) for k, x in zip(keys, leaves)]))
    return out


def reduced(grads, weights=None, reduce_dtype=jnp.float32):
    """The oracle's globally reduced gradient: mean over devices, or psum(grads) / psum(weights)."""
    def one(g):
        wide = np.asarray(g.astype(reduce_dtype), np.float64)
        total = wide.sum(0) / (g.shape[0] if weights is None else float(np.sum(weights)) or 1.0)
        return jnp.asarray(total, reduce_dtype).astype(g.dtype)
    return jax.tree.map(one, grads)


def run_oracle(inner, params, grads_seq, weights_seq=None, reduce_dtype=jnp.float32):
    state = inner.init(params)
    update = jax.jit(inner.update)
    for t, g in enumerate(grads_seq):
        w = None if weights_seq is None else weights_seq[t]
        if w is not None and float(np.sum(w)) == 0:
            continue  # zero1 skips a step with zero global weight
        u, state = update(reduced(g, w, reduce_dtype), state, params)
        params = optax.apply_updates(params, u)
    return params, state


def zero_fns(tx, mesh, weighted: bool = False, one_call: bool = False):
    """The shard_map'ed init and step of `tx`; the step is `tx.update` + `optax.apply_updates`, or with `one_call`
    `zo.apply_gradients`."""
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))

    def step(params, state, grads, *weight):
        grads = jax.tree.map(lambda g: g[0], grads)
        kw = {"weight": weight[0][0]} if weight else {}
        if one_call:
            return zo.apply_gradients(tx, grads, state, params, **kw)
        updates, state = tx.update(grads, state, params, **kw)
        return optax.apply_updates(params, updates), state

    specs = (P(), P("data"), P("data")) + ((P("data"),) if weighted else ())
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P(), P("data"))))
    return init, step


def run_zero(tx, params, grads_seq, n, weights_seq=None, one_call: bool = False):
    mesh = mesh_of(n)
    init, step = zero_fns(tx, mesh, weighted=weights_seq is not None, one_call=one_call)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = init(params)
    shard = NamedSharding(mesh, P("data"))
    for t, g in enumerate(grads_seq):
        args = [jax.device_put(g, shard)]
        if weights_seq is not None:
            args.append(jax.device_put(jnp.asarray(weights_seq[t], jnp.float32), shard))
        params, state = step(params, state, *args)
    return params, state, step


def run_mesh_bound(tx, ref, params, steps: int, mesh):
    """`steps` jitted `update` + `apply_updates` steps of `tx`, bound to `mesh`, on its devices (the parameters
    replicated) and of plain `ref` on one device, both fed the global mean of `gradient_sequence`'s per-device
    gradients: `(zero params, zero state, optax params, optax state)`."""
    n = mesh.devices.size
    grads = [jax.tree.map(lambda g: g.mean(0), g) for g in gradient_sequence(params, n, steps)]

    def step_of(tx):
        def step(params, state, g):
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state
        return jax.jit(step)

    z_step, r_step = step_of(tx), step_of(ref)
    z_params = jax.device_put(params, NamedSharding(mesh, P()))
    z_state, r_params, r_state = tx.init(z_params), params, ref.init(params)
    for g in grads:
        z_params, z_state = z_step(z_params, z_state, jax.device_put(g, NamedSharding(mesh, P())))
        r_params, r_state = r_step(r_params, r_state, g)
    return z_params, z_state, r_params, r_state


def stored_entries(state) -> dict[int, np.ndarray]:
    """Entry index -> its stored values, read straight from a zero1 state's arrays as `zero_optax.layout._state`
    documents them: a shared entry as `[N, *shape]` (the leaves of the inner state's tree); a sliced history or master copy as its 1-D padded,
    flattened coordinates of every device (`blocks * group * slots`): a group's array has one row of `size` per
    device, each row its members' slots one after the other, so a member's values are its columns of the rows."""
    layout = zo.describe(state)
    shared = [j for j in layout.inner_entries if layout.entries[j].leaf is None]
    stored = jax.tree.leaves(state._inner.shared)  # the inner state's tree: one array per shared field
    assert len(stored) == len(shared)
    out = {j: np.asarray(x) for j, x in zip(shared, stored)}
    masters = [None] * len(layout.groups) if state.master is None else state.master
    for group, histories, master in zip(layout.groups, state._inner.histories, masters, strict=True):
        arrays = list(zip(zip(*group.histories), histories))
        if master is not None:
            arrays.append((group.masters, master))
        for entries, arr in arrays:
            rows = np.asarray(arr).reshape(-1, group.size)
            for i, off, j in zip(group.leaves, group.offsets, entries):
                leaf = layout.leaves[i]
                assert rows.shape[0] == leaf.blocks * leaf.group and layout.entries[j].leaf == i
                out[j] = rows[:, off:off + leaf.slots].reshape(-1)
    return out


def full_state(state) -> dict[str, np.ndarray]:
    """The inner optimizer's complete, unsharded state by entry path, read back from a zero1 state (1-D mesh):
    `stored_entries`, each cut to its leaf, and the owned entries from the packed buffers."""
    layout = zo.describe(state)
    out = {}
    stored = stored_entries(state)
    for j in layout.inner_entries:
        entry = layout.entries[j]
        if entry.leaf is None:
            arr = stored[j]
            assert all((row == arr[0]).all() for row in arr), f"shared entry {entry.path} differs across devices"
            out[entry.path] = arr[0]
        elif layout.leaves[entry.leaf].sliced:
            leaf, arr = layout.leaves[entry.leaf], stored[j]
            assert arr.shape == (leaf.group * leaf.slots,), (entry.path, arr.shape)
            assert not arr[leaf.size:].any(), f"padding of {entry.path} leaked"
            out[entry.path] = arr[:leaf.size].reshape(leaf.shape)
    buffers = {d: np.asarray(b) for d, b in state.buffers.items()}
    for r in range(layout.world_size):
        for j in layout.rank_entries(r):
            entry = layout.entries[j]
            if entry.role != "state":
                continue
            dtype, off = layout.state_packing.offsets[r][j]
            out[entry.path] = buffers[dtype][r, off:off + entry.size].reshape(entry.shape)
    return out


def _tol(dtype, rtol, atol):
    """16-bit values may differ by one rounding of the reduced gradient (the sum order of psum is not ours)."""
    return (max(rtol, 1e-2), max(atol, 1e-2)) if np.dtype(dtype).itemsize == 2 else (rtol, atol)


def key_data(x):
    """A typed PRNG key's data (what zero1 stores), anything else as it is."""
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def assert_matches(zero_params, zero_state, ref_params, ref_state, rtol=2e-5, atol=1e-6):
    for a, b in zip(jax.tree.leaves(zero_params), jax.tree.leaves(ref_params)):
        assert a.dtype == b.dtype
        r, t = _tol(a.dtype, rtol, atol)
        wide = np.complex64 if np.iscomplexobj(a) else np.float32
        np.testing.assert_allclose(np.asarray(a, wide), np.asarray(b, wide), rtol=r, atol=t)
    got = full_state(zero_state)
    want = {jax.tree_util.keystr(p): np.asarray(key_data(x)) for p, x in jax.tree_util.tree_leaves_with_path(ref_state)}
    assert set(got) == set(want), (sorted(got), sorted(want))
    for path, x in want.items():
        assert got[path].dtype == x.dtype, path
        r, t = _tol(x.dtype, rtol, atol)
        wide = np.complex128 if np.iscomplexobj(x) else np.float64
        np.testing.assert_allclose(np.asarray(got[path], wide), np.asarray(x, wide), rtol=r, atol=t, err_msg=path)


def assert_resumes_anywhere(make, tmp_path, params=None, steps=(2, 2)):
    """`zero1(make())`, mesh-bound on 8 devices, trained `steps[0]` steps and checkpointed, restored at 3 devices
    (`ZeroRestore(reshard=True)`) and at 5 (offline `zo.reshard`), and trained `steps[1]` more steps each: both
    match plain `make()` on one device, trained all the steps without a break."""
    params = small_params() if params is None else params
    grads = [jax.tree.map(lambda g: g.mean(0), g) for g in gradient_sequence(params, 8, sum(steps))]

    def run(n, state, p, gs):
        mesh = mesh_of(n)
        tx = zo.zero1(make(), axis_name="data", mesh=mesh)

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        p = jax.device_put(p, NamedSharding(mesh, P()))
        state = tx.init(p) if state is None else state
        for g in gs:
            p, state = jax.jit(step)(p, state, jax.device_put(g, NamedSharding(mesh, P())))
        return p, state

    ref = make()
    r_params, r_state = params, ref.init(params)
    for g in grads:
        u, r_state = ref.update(g, r_state, r_params)
        r_params = optax.apply_updates(r_params, u)
    p8, s8 = run(8, None, params, grads[:steps[0]])
    with ocp.CheckpointManager(tmp_path / "saved") as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(s8)))
        mngr.wait_until_finished()
    item = tmp_path / "saved" / "1" / "opt_state"
    for m, offline in ((3, False), (5, True)):
        mesh = mesh_of(m)
        target = zo.zero1(make(), axis_name="data", mesh=mesh).init(jax.device_put(params, NamedSharding(mesh, P())))
        src = item
        if offline:
            src = tmp_path / f"at{m}"
            zo.reshard(item, src, world_size=m)
        with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
            restored = ckpt.restore(src, args=zo.ZeroRestore(target, reshard=not offline))
        assert_matches(*run(m, restored, p8, grads[steps[0]:]), r_params, r_state)
