"""`init` and `update` of zero1 inside `shard_map`, for sliced and owned leaves alike.

A step runs the inner transformation twice, on two `optax.masked`-style views of the parameter tree:

* the *sliced view*: every sliced leaf as this device's 1-D slice, owned leaves masked. Every device runs it;
  it also advances the shared entries (step counts).
* the *owned view* of device `r`: the leaves `r` owns, whole; everything else masked. One `lax.switch` on the
  device index runs each device's own view; its shared entries are discarded (the sliced view computed them).

The coupling analysis at `init` proves that this is exact: no computation mixes two leaves, and the shared entries
do not depend on any leaf.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_optax.core import _compat
from zero_optax.core._errors import WeightError, ZeroStructureError
from zero_optax.core._names import tree_signature
from zero_optax.transform import _accumulate, _layout, _offload, _owned, _plan, _reduce, _sliced
from zero_optax.transform._layout import MASTER, Layout
from zero_optax.transform._state import ZeroState


def _tree(layout: Layout, values: list) -> Any:
    return jax.tree_util.tree_unflatten(layout.treedef, values)


def _masked_tree(layout: Layout, values: dict[int, Any]) -> Any:
    """A parameter-shaped tree holding `values` (leaf index -> array) and `optax.MaskedNode()` elsewhere."""
    return _tree(layout, _layout.masked_view([values.get(i) for i in range(len(layout.leaves))], values))


def check_layout(state, axis_name) -> Layout:
    """The state's layout, after checking its type, its axis and the world size of the enclosing mesh."""
    if not isinstance(state, ZeroState):
        raise ZeroStructureError(
            f"zero1 update expected the ZeroState returned by this transformation's init, got "
            f"{type(state).__name__}. Pass the opt_state returned by tx.init.")
    layout = state.layout
    n = _compat.axis_size(axis_name)
    if layout.axis_name != axis_name or layout.world_size != n:
        raise ZeroStructureError(
            f"This state was initialised for axis `{layout.axis_name}` with {layout.world_size} devices, but "
            f"update runs over axis `{axis_name}` with {n}. Re-initialise, restore with "
            "zo.ZeroRestore(target, reshard=True), or reshard the checkpoint with zero_optax.reshard.")
    return layout


def check_tree(tree, layout: Layout, what: str) -> list[jax.Array]:
    """The leaves of `tree` after checking structure and shapes against the parameters of `layout`."""
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != layout.treedef:
        raise ZeroStructureError(
            f"The {what} do not have the structure of the parameters this state was initialised with.\n"
            f"  {what}: {tree_signature(tree)}\n"
            f"  parameters: {tree_signature(_tree(layout, [0] * len(layout.leaves)))}")
    for x, leaf in zip(leaves, layout.leaves):
        if tuple(np.shape(x)) != leaf.shape:
            raise ZeroStructureError(
                f"The {what} leaf `{leaf.path}` has shape {tuple(np.shape(x))}, but the parameter has shape "
                f"{leaf.shape}.")
    return leaves


def _full_entries(layout: Layout, full_state) -> list:
    """The leaves of a plain optax state given to `scatter_state`, after checking it is the inner state's tree."""
    full, treedef = jax.tree.flatten(full_state)
    if treedef != layout.state_treedef:
        raise ZeroStructureError(
            f"scatter_state: the inner state is structured as {tree_signature(full_state)}, but the inner "
            f"transformation's init gives {layout.state_tree}.")
    return full


def _check_extra(extra: dict, axes) -> None:
    for name, value in extra.items():
        for x in jax.tree.leaves(value):
            if isinstance(x, jax.Array) and _compat.vma_enabled(axes) and set(axes) & _compat.varying_axes(x):
                raise ZeroStructureError(
                    f"The extra argument `{name}` differs between the devices of `{axes}`, but every device must "
                    f"run the inner update with the same value. Pass its global value (for a loss, "
                    f"lax.pmean(loss, {axes!r})).")


def _check_returned(updates, new_state, g_tree, old_state, what: str) -> None:
    if jax.tree.structure(updates) != jax.tree.structure(g_tree):
        raise ZeroStructureError(
            f"The inner update returned updates structured as {tree_signature(updates)} for the {what}, but the "
            f"gradients it was given are {tree_signature(g_tree)}.")
    if jax.tree.structure(new_state) != jax.tree.structure(old_state):
        raise ZeroStructureError(
            f"The inner update returned a state structured as {tree_signature(new_state)} for the {what}, but "
            f"its state was {tree_signature(old_state)}: zero1 stores the state in the layout init found.")


class Engine:
    """zero1's `init`, `update` and `scatter` for one `Config`, inside `shard_map` over its axes."""

    def __init__(self, cfg: _plan.Config):
        self.cfg = cfg
        self._views: dict = {}
        self._udtypes: dict = {}
        self._invariant: dict = {}

    # ------------------------------------------------------------------ views and bookkeeping

    def _owned_entries(self, layout: Layout, r: int) -> list[int]:
        return [j for j in layout.inner_entries
                if layout.entries[j].leaf is None or layout.leaves[layout.entries[j].leaf].owner == r]

    def _view(self, layout: Layout, r: int | None):
        """The inner state treedef of the sliced view (`r` None) or of device `r`'s owned view (cached)."""
        key = (layout, r)
        if key not in self._views:
            if r is None:
                present = {i for i, leaf in enumerate(layout.leaves) if leaf.sliced}
                self._views[key] = _plan.view_treedef(self.cfg, layout, present, list(layout.unpacked_entries),
                                                      "on the sliced leaves")
            else:
                present = {i for i, leaf in enumerate(layout.leaves) if leaf.owner == r}
                self._views[key] = _plan.view_treedef(self.cfg, layout, present, self._owned_entries(layout, r),
                                                      f"on device {r}")
        return self._views[key]

    @staticmethod
    def _ranks(layout: Layout) -> dict:
        groups = {layout.zero_axes(leaf) for leaf in layout.leaves} | {layout.axes}
        return {axes: _compat.axis_index(axes) for axes in groups}

    def _update_dtypes(self, layout: Layout, extra: dict) -> dict[int, str]:
        """The dtype of the inner transformation's update for each leaf (one abstract trace, cached)."""
        key = (layout, jax.tree.structure(extra), tuple((np.shape(x), jnp.result_type(x))
                                                         for x in jax.tree.leaves(extra)))
        if key not in self._udtypes:
            dt = self.cfg.inner_dtype
            structs = _tree(layout, [jax.ShapeDtypeStruct((leaf.slots,) if leaf.sliced else leaf.shape, dt(leaf.dtype))
                                     for leaf in layout.leaves])
            state = jax.eval_shape(self.cfg.inner.init, structs)
            updates, _ = jax.eval_shape(lambda g, s, p, e: self.cfg.inner.update(g, s, p, **e), structs, state,
                                        structs, extra)
            self._udtypes[key] = {i: np.dtype(u.dtype).name for i, u in enumerate(jax.tree.leaves(updates))}
        return self._udtypes[key]

    # ------------------------------------------------------------------ init

    def init(self, params) -> ZeroState:
        return self.build(params, None)

    def build(self, params, full_state) -> ZeroState:
        """The state for `params`: fresh from the inner `init`, or sliced from a plain optax `full_state`."""
        cfg = self.cfg
        layout = _plan.build_layout(cfg, params)
        values = [x.astype(cfg.inner_dtype(x.dtype)) for x in jax.tree.leaves(params)]
        ranks = self._ranks(layout)
        rank = ranks[layout.axes]
        sliced = [i for i, leaf in enumerate(layout.leaves) if leaf.sliced]
        slices = {i: _sliced.own_slice(values[i], layout.leaves[i], ranks[layout.zero_axes(layout.leaves[i])])
                  for i in sliced}
        full = None if full_state is None else _full_entries(layout, full_state)
        inner_state = self._build_sliced(layout, slices, full, ranks)
        buffers = self._build_owned(layout, values, full, rank)
        master = None
        if cfg.master_dtype is not None:
            master = _masked_tree(layout, slices)
        local = None
        if layout.accumulate == _accumulate.LOCAL:
            local = _accumulate.init_local(layout, params, layout.axes)
        state = ZeroState(inner_state, buffers, master, layout, local)
        return _offload.to_host(state, cfg.bucket_bytes) if cfg.offload else state

    def _build_sliced(self, layout: Layout, slices: dict[int, jax.Array], full: list | None, ranks) -> Any:
        """The stored inner state of the sliced view: the inner `init` on this device's slices, or the entries of
        a plain optax state (`full`) cut to them."""
        a_entries = list(layout.unpacked_entries)
        if full is None:
            state_a = self.cfg.inner.init(_masked_tree(layout, slices))
            a_values = jax.tree.leaves(state_a)
        else:
            a_values = []
            for j in a_entries:
                e = layout.entries[j]
                x = jnp.asarray(full[j], e.dtype)
                if e.leaf is not None:
                    leaf = layout.leaves[e.leaf]
                    x = _sliced.own_slice(x, leaf, ranks[layout.zero_axes(leaf)])
                a_values.append(x)
        return jax.tree_util.tree_unflatten(self._view(layout, None), self._to_storage(layout, a_entries, a_values,
                                                                                        ranks))

    def _build_owned(self, layout: Layout, values: list, full: list | None, rank) -> dict[str, jax.Array]:
        """The packed buffers of the owned leaves: row `r` holds the state (and master copies) of the leaves device
        `r` owns, from the inner `init` on them or from a plain optax state (`full`). Empty when no leaf is owned."""
        cfg = self.cfg
        packing = layout.state_packing
        if not packing.sizes:
            return {}

        def branch(r):
            def run(values, full):
                owned = {i for i, leaf in enumerate(layout.leaves) if leaf.owner == r}
                if full is None:
                    b_entries = self._owned_entries(layout, r)
                    self._view(layout, r)  # checks the entry order this device packs
                    state = cfg.inner.init(_tree(layout, _layout.masked_view(values, owned)))
                    got = dict(zip(b_entries, jax.tree.leaves(state)))
                else:
                    got = {j: full[j] for j in layout.rank_entries(r) if layout.entries[j].role != MASTER}
                for j in layout.rank_entries(r):
                    if layout.entries[j].role == MASTER:
                        got[j] = values[layout.entries[j].leaf]
                items = {j: got[j] for j in layout.rank_entries(r)}
                return _compat.pvary(_owned.pack(items, packing.offsets[r], packing.sizes), layout.axes)
            return run

        buffers = _owned.switch(rank, [branch(r) for r in range(layout.world_size)], values, full)
        return {d: b[None] for d, b in buffers.items()}

    @staticmethod
    def _to_storage(layout: Layout, entries: list[int], values: list, ranks) -> list:
        """Inner-state values -> stored blocks: sliced histories keep their `(slots,)` (padding zeroed), shared
        entries gain a leading device axis."""
        out = []
        for j, x in zip(entries, values):
            e = layout.entries[j]
            if e.leaf is None:
                out.append(x[None])
            else:
                leaf = layout.leaves[e.leaf]
                out.append(_sliced.zero_padding(x, leaf, ranks[layout.zero_axes(leaf)]))
        return out

    @staticmethod
    def _from_storage(layout: Layout, entries: list[int], values: list, invariant: bool) -> list:
        """Stored blocks -> inner-state values.

        Shared entries are identical on every device but stored one copy per device, so they come back typed
        varying. With `invariant`, they are made invariant again, as the inner transformation had them, by one tiny
        all-gather per dtype: some transformations (`reduce_on_plateau`'s `lax.cond`s) need that, which `update`
        learns the first time their trace fails without it.
        """
        out = [x[0] if layout.entries[j].leaf is None else x for j, x in zip(entries, values)]
        shared = [k for k, j in enumerate(entries) if layout.entries[j].leaf is None]
        if not invariant or not shared or not _compat.vma_enabled(layout.axes):
            return out
        by_dtype: dict = {}
        for k in shared:
            by_dtype.setdefault(np.dtype(out[k].dtype).name, []).append(k)
        for ks in by_dtype.values():
            flat = jnp.concatenate([out[k].reshape(-1) for k in ks])
            first = _compat.all_gather_invariant(flat, layout.axes)[0]
            cuts = np.cumsum([out[k].size for k in ks])[:-1]
            for k, piece in zip(ks, jnp.split(first, cuts)):
                out[k] = piece.reshape(out[k].shape)
        return out

    # ------------------------------------------------------------------ update

    def checked(self, state, grads) -> tuple[Layout, list[jax.Array]]:
        """The state's layout and the gradient leaves, after `check_layout` and `check_tree`."""
        layout = check_layout(state, self.cfg.axis_name)
        return layout, check_tree(grads, layout, "gradients")

    def update(self, grads, state, params=None, *, weight=None, hooks: _accumulate.Hooks | None = None, **extra):
        """One `update` call. With `accumulate_steps > 1` it is one micro-batch (`_accumulate.update`), which
        calls back here with `hooks`: run `hooks.inner` on the reduced sums, and gather only on a step."""
        cfg = self.cfg
        if cfg.offload and hooks is None:  # the stored state comes to the device for the step, and goes back
            return _offload.update(self.on_device, grads, state, params, bucket_bytes=cfg.bucket_bytes,
                                   weight=weight, **extra)
        return self.on_device(grads, state, params, weight=weight, hooks=hooks, **extra)

    def on_device(self, grads, state, params=None, *, weight=None, hooks: _accumulate.Hooks | None = None,
                  **extra):
        """`update` on a state whose arrays are in device memory."""
        cfg = self.cfg
        if cfg.accumulating is not None and hooks is None:
            return _accumulate.update(self, grads, state, params, weight, extra)
        inner = cfg.inner if hooks is None else hooks.inner
        stepping = hooks is None or hooks.step
        layout, g_leaves, p_leaves = self._check_step(grads, state, params, weight, extra,
                                                      hooks is None or hooks.checked)
        ranks = self._ranks(layout)
        rank = ranks[layout.axes]
        denom = _reduce.denominator(weight, layout.axes, layout.world_size) if hooks is None else hooks.denom
        inner_dt = ({i: np.dtype(cfg.inner_dtype(g.dtype)).name for i, g in enumerate(g_leaves)} if hooks is None
                    else hooks.grad_dtypes)
        sum_dt = {i: np.dtype(cfg.reduce_dtype or cfg.master_dtype or g.dtype).name for i, g in enumerate(g_leaves)}
        sliced = [i for i, leaf in enumerate(layout.leaves) if leaf.sliced]
        owned = [i for i, leaf in enumerate(layout.leaves) if not leaf.sliced]

        # Sliced view: every device, its own coordinates.
        g_sl = self._reduce_sliced(layout, sliced, g_leaves, denom, inner_dt, sum_dt, ranks)
        m_sl, p_sl = self._sliced_params(layout, sliced, p_leaves, state, ranks)
        u_a, new_inner, shared_old = self._update_sliced(layout, sliced, g_sl, p_sl, state, denom.ok, ranks, extra,
                                                         inner)

        # Owned views: one switch branch per device.
        new_buffers, u_owned = dict(state.buffers), {}
        if owned:
            new_buffers, u_owned = self._update_owned(layout, owned, g_leaves, p_leaves, state, shared_old, denom,
                                                      inner_dt, sum_dt, extra, rank, inner, stepping)
        if not stepping:  # a micro-batch that only accumulates: nothing moves, nothing is gathered
            return None, ZeroState(new_inner, new_buffers, state.master, layout, state.local)

        # New parameters (master copies) or updates, gathered to every device.
        updates, new_master = self._gather_sliced(layout, sliced, u_a, m_sl, p_leaves, state, denom.ok, ranks)
        updates.update(u_owned)
        if cfg.master_dtype is not None:  # every device moves its parameters onto the gathered, rounded master copy
            md = cfg.master_dtype
            updates = {i: t.astype(md) - p_leaves[i].astype(md) for i, t in updates.items()}
            if denom.ok is not None:
                updates = {i: jnp.where(denom.ok, u, jnp.zeros_like(u)) for i, u in updates.items()}
        new_state = ZeroState(new_inner, new_buffers, new_master, layout, state.local)
        return _tree(layout, [updates[i] for i in range(len(layout.leaves))]), new_state

    def _check_step(self, grads, state, params, weight, extra, semantics: bool = True
                    ) -> tuple[Layout, list, list | None]:
        """The state's layout and the leaves of `grads` and `params`, after checking every argument of `update`
        (with `semantics`, also whether the gradients are per-device as the reduction expects)."""
        cfg = self.cfg
        layout = check_layout(state, cfg.axis_name)
        g_leaves = check_tree(grads, layout, "gradients")
        p_leaves = None if params is None else check_tree(params, layout, "parameters")
        if cfg.master_dtype is not None and p_leaves is None:
            raise ZeroStructureError(
                "zero1(master_dtype=...) needs the parameters: call tx.update(grads, opt_state, params), so that "
                "the returned updates move them onto the master copy.")
        reducing = cfg.reduce is not None
        if semantics:
            _reduce.check_semantics(g_leaves, layout.paths, [layout.zero_axes(leaf) for leaf in layout.leaves],
                                    reducing)
        if weight is not None and not reducing:
            raise WeightError(
                "`weight=` weighs each device's gradient (a loss sum) in the reduction, but with reduce=False the "
                "gradients are already the global mean. Pass weight to zo.reduce_gradients instead, or use "
                "reduce=True.")
        _check_extra(extra, layout.axes)
        return layout, g_leaves, p_leaves

    def _sliced_params(self, layout: Layout, sliced: list[int], p_leaves: list | None, state: ZeroState, ranks
                       ) -> tuple[dict[int, jax.Array], dict[int, jax.Array] | None]:
        """This device's master slices (empty without `master_dtype`) and the parameter slices the inner update
        sees: the master slices, this device's slices of `params`, or None without parameters."""
        master = self.cfg.master_dtype is not None
        m_sl = {}
        if master:
            m_sl = dict(zip(sliced, jax.tree.leaves(state.master)))
        p_sl = None
        if p_leaves is not None:
            p_sl = m_sl if master else {i: _sliced.own_slice(p_leaves[i], layout.leaves[i],
                                                              ranks[layout.zero_axes(layout.leaves[i])])
                                        for i in sliced}
        return m_sl, p_sl

    def _update_sliced(self, layout: Layout, sliced: list[int], g_sl, p_sl, state: ZeroState, ok, ranks, extra,
                       inner) -> tuple[dict[int, jax.Array], Any, dict[int, jax.Array]]:
        """The inner update on the sliced view, which every device runs on its own coordinates.

        Returns the updates of the sliced leaves (this device's slices), the new stored inner state (the old one
        where the step is skipped) and the old values of the shared entries, which the owned views read.
        """
        a_entries = list(layout.unpacked_entries)
        g_view = _masked_tree(layout, g_sl)
        stored = jax.tree.leaves(state.inner_state)
        p_view = None if p_sl is None else _masked_tree(layout, p_sl)
        a_old, old_a, u_a, new_a = self._run_sliced_view(layout, a_entries, stored, g_view, p_view, extra, inner)
        _check_returned(u_a, new_a, g_view, old_a, "sliced leaves")
        new_a_values = self._to_storage(layout, a_entries, jax.tree.leaves(new_a), ranks)
        u_a = dict(zip(sliced, jax.tree.leaves(u_a)))
        new_inner = jax.tree_util.tree_unflatten(
            self._view(layout, None), _reduce.skip_if_empty(ok, new_a_values, jax.tree.leaves(state.inner_state)))
        shared_old = {j: x for j, x in zip(a_entries, a_old) if layout.entries[j].leaf is None}
        return u_a, new_inner, shared_old

    def _run_sliced_view(self, layout: Layout, a_entries: list[int], stored: list, g_view, p_view, extra, inner):
        """Runs the inner update on the sliced view's stored state; returns the old state's values, the old state,
        the updates and the new state.

        The shared entries come back from storage typed varying. Some inner updates need them invariant (a
        `lax.cond`'s branches must agree on their types: `reduce_on_plateau`); the first such failure switches this
        layout to invariant shared entries for good, and the update is traced again.
        """
        invariant = self._invariant.get(layout, False)
        a_old = self._from_storage(layout, a_entries, stored, invariant)
        old_a = jax.tree_util.tree_unflatten(self._view(layout, None), a_old)
        try:
            u_a, new_a = inner.update(g_view, old_a, p_view, **extra)
        except TypeError as e:  # the inner update needs invariant shared state (a lax.cond's branches must agree)
            if invariant or "manual axis types" not in str(e):
                raise
            self._invariant[layout] = True
            a_old = self._from_storage(layout, a_entries, stored, invariant=True)
            old_a = jax.tree_util.tree_unflatten(self._view(layout, None), a_old)
            u_a, new_a = inner.update(g_view, old_a, p_view, **extra)
        return a_old, old_a, u_a, new_a

    def _gather_sliced(self, layout: Layout, sliced: list[int], u_a: dict, m_sl: dict, p_leaves: list | None,
                       state: ZeroState, ok, ranks) -> tuple[dict[int, jax.Array], Any]:
        """The sliced leaves' full results, all-gathered in buckets to every device, and the new master slices.

        With `master_dtype` each device adds its updates to its master slices and every device receives the new
        master values rounded to the parameter dtype; otherwise every device receives the updates (zero where the
        step is skipped).
        """
        cfg = self.cfg
        updates = {}
        new_master = state.master
        if not sliced:
            return updates, new_master
        if cfg.master_dtype is not None:
            m_new = {i: _sliced.zero_padding((m_sl[i] + u_a[i]).astype(m_sl[i].dtype), layout.leaves[i],
                                             ranks[layout.zero_axes(layout.leaves[i])]) for i in sliced}
            m_new = _reduce.skip_if_empty(ok, m_new, m_sl)
            new_master = jax.tree.unflatten(jax.tree.structure(state.master), [m_new[i] for i in sliced])
            rounded = {i: m_new[i].astype(p_leaves[i].dtype) for i in sliced}
            buckets = _sliced.plan_buckets(layout, sliced, [np.dtype(p_leaves[i].dtype).name for i in sliced],
                                           cfg.bucket_bytes)
            updates.update(_sliced.gather(rounded, layout, buckets))
        else:
            u_a = _reduce.skip_if_empty(ok, u_a, jax.tree.map(jnp.zeros_like, u_a))
            buckets = _sliced.plan_buckets(layout, sliced, [np.dtype(u_a[i].dtype).name for i in sliced],
                                           cfg.bucket_bytes)
            updates.update(_sliced.gather(u_a, layout, buckets))
        return updates, new_master

    def _reduce_sliced(self, layout, sliced, g_leaves, denom, inner_dt, sum_dt, ranks) -> dict[int, jax.Array]:
        """Each device's `(slots,)` block of every sliced leaf's reduced gradient, in the inner's dtype."""
        if not sliced:
            return {}
        cfg = self.cfg
        grads = {i: g_leaves[i] for i in sliced}
        if cfg.reduce is None:  # already the global mean
            return {i: _sliced.own_slice(g.astype(inner_dt[i]), layout.leaves[i],
                                         ranks[layout.zero_axes(layout.leaves[i])]) for i, g in grads.items()}
        buckets = _sliced.plan_buckets(layout, sliced, [sum_dt[i] for i in sliced], cfg.bucket_bytes)
        if cfg.reduce == "psum":
            return _sliced.all_reduce_slices(grads, layout, buckets, denom, inner_dt, ranks)
        return _sliced.reduce_scatter(grads, layout, buckets, denom, inner_dt)

    def _update_owned(self, layout, owned, g_leaves, p_leaves, state, shared_old, denom, inner_dt, sum_dt, extra,
                      rank, inner, stepping=True):
        """The inner update on every device's owned view, in one `lax.switch` on the device index.

        Gradients reach the owners (`_owned_gradients`), each device updates the state packed in its row of the
        buffers, and the owned leaves' updates (or new master values, rounded) return to every device by an
        all-gather of one packing. Returns the new buffers and those updates.
        """
        cfg = self.cfg
        n = layout.world_size
        master = cfg.master_dtype is not None
        mode, plan_g, grad_input = self._owned_gradients(layout, owned, g_leaves, denom, inner_dt, sum_dt)
        u_dtypes = ({i: np.dtype(p_leaves[i].dtype).name for i in owned} if master else
                    {i: d for i, d in self._update_dtypes(layout, extra).items() if i in owned})
        plan_u = _owned.leaf_plan(layout, u_dtypes)
        packing = layout.state_packing
        shapes = {i: layout.leaves[i].shape for i in owned}
        old_buffers = {d: b[0] for d, b in state.buffers.items()}

        def branch(r):
            mine = [i for i in owned if layout.leaves[i].owner == r]

            def run(grad_input, buffers, p_leaves):
                if mode == "psum_scatter":
                    got = _owned.unpack(grad_input, plan_g.offsets[r], shapes)
                    g = {i: _reduce.divide(x, denom, inner_dt[i]) for i, x in got.items()}
                else:
                    g = {i: grad_input[i] for i in mine}
                values, u = self._owned_view_update(layout, r, mine, g, buffers, p_leaves, shared_old, extra, inner,
                                                    stepping)
                new_buffers = _owned.pack(values, packing.offsets[r], packing.sizes, base=buffers if n > 1 else None)
                if not stepping:
                    return _compat.pvary(new_buffers, layout.axes) if n > 1 else new_buffers
                if n == 1:
                    return new_buffers, u
                u_buffers = _owned.pack(u, plan_u.offsets[r], plan_u.sizes)
                return _compat.pvary((new_buffers, u_buffers), layout.axes)
            return run

        if not stepping:
            new = _owned.switch(rank, [branch(r) for r in range(n)], grad_input, old_buffers, p_leaves)
            return {d: b[None] for d, b in new.items()}, {}
        new, u_out = _owned.switch(rank, [branch(r) for r in range(n)], grad_input, old_buffers, p_leaves)
        new = _reduce.skip_if_empty(denom.ok, new, old_buffers)
        new_buffers = {d: b[None] for d, b in new.items()}
        u = _gather_owned(layout, u_out, plan_u)
        if not master:
            u = _reduce.skip_if_empty(denom.ok, u, jax.tree.map(jnp.zeros_like, u))
        return new_buffers, u

    def _owned_view_update(self, layout: Layout, r: int, mine: list[int], g: dict[int, jax.Array], buffers,
                           p_leaves: list | None, shared_old: dict[int, jax.Array], extra, inner, stepping=True):
        """Inside device `r`'s branch: the inner update of its owned view, the leaves `mine` with gradients `g`.

        The old state is the entries stored in `r`'s row of `buffers` and the shared entries' old values. Returns
        the new values of `r`'s stored entries (master copies included) and what every device must receive for
        `mine`: the updates, or with `master_dtype` the new master values rounded to the parameter dtype.
        """
        cfg = self.cfg
        master = cfg.master_dtype is not None
        entries = layout.rank_entries(r)
        stored = _owned.unpack(buffers, layout.state_packing.offsets[r], {j: layout.entries[j].shape for j in entries})
        b_entries = self._owned_entries(layout, r)
        old = jax.tree_util.tree_unflatten(self._view(layout, r), [shared_old[j] if j in shared_old
                                                                    else stored[j] for j in b_entries])
        masters = {layout.entries[j].leaf: stored[j] for j in entries if layout.entries[j].role == MASTER}
        if p_leaves is None:
            p_view = None
        else:
            p = masters if master else {i: p_leaves[i] for i in mine}
            p_view = _masked_tree(layout, p)
        g_view = _masked_tree(layout, g)
        u, new = inner.update(g_view, old, p_view, **extra)
        _check_returned(u, new, g_view, old, f"leaves device {r} owns")
        u = dict(zip(mine, jax.tree.leaves(u)))
        values = {j: v for j, v in zip(b_entries, jax.tree.leaves(new)) if j not in shared_old}
        if master and stepping:
            u = _step_masters(layout, entries, masters, u, values, p_leaves)
        elif master:  # a micro-batch that only accumulates: the master copies stay as they are
            values.update({j: stored[j] for j in entries if layout.entries[j].role == MASTER})
        return values, u

    def _owned_gradients(self, layout, owned, g_leaves, denom, inner_dt, sum_dt):
        """How the owned leaves' gradients reach their owners, and the switch operand that carries them.

        `"psum_scatter"`: owner-packed rows, reduce-scattered (each owner receives its row, still to be divided);
        `"psum"`: every owned leaf all-reduced and divided; otherwise (the gradients already are the global mean)
        the leaves as they are. Returns the mode, the gradients' packing and the operand.
        """
        cfg = self.cfg
        n = layout.world_size
        plan_g = _owned.leaf_plan(layout, {i: sum_dt[i] for i in owned})
        nbytes = sum(g_leaves[i].size * np.dtype(sum_dt[i]).itemsize for i in owned)
        mode = _owned.choose_reduce("auto" if cfg.reduce == "default" else cfg.reduce, plan_g, nbytes, n)
        axes = layout.axes
        if mode == "psum_scatter":
            rows = _owned.scatter_rows({i: g_leaves[i].astype(sum_dt[i]) for i in owned}, plan_g, n)
            grad_input = {d: _compat.psum_scatter(b, axes) for d, b in rows.items()}
        elif mode == "psum":
            grad_input = {i: _reduce.divide(jax.lax.psum(g_leaves[i].astype(sum_dt[i]), axes), denom, inner_dt[i])
                          for i in owned}
        else:
            grad_input = {i: g_leaves[i].astype(inner_dt[i]) for i in owned}
        return mode, plan_g, grad_input


def _step_masters(layout: Layout, entries, masters: dict[int, jax.Array], u: dict[int, jax.Array], values: dict,
                  p_leaves: list) -> dict[int, jax.Array]:
    """Inside an owner's branch: adds its updates `u` to its master copies (written into `values`, to be packed)
    and returns the new master values rounded to the parameter dtype, which every device then receives."""
    for j in entries:
        if layout.entries[j].role == MASTER:
            i = layout.entries[j].leaf
            values[j] = (masters[i] + u[i]).astype(masters[i].dtype)
    return {i: values[j].astype(p_leaves[i].dtype) for j in entries
            if layout.entries[j].role == MASTER for i in [layout.entries[j].leaf]}


def _gather_owned(layout: Layout, u_out: dict[str, jax.Array], plan_u) -> dict[int, jax.Array]:
    """The owners' results, packed by `plan_u` (or, on one device, per leaf), on every device, per leaf."""
    axes = layout.axes
    if layout.world_size == 1:
        return {i: jax.lax.psum(x, axes) for i, x in u_out.items()}  # retypes as replicated; XLA drops it
    gathered = {d: _compat.all_gather_invariant(b, axes) for d, b in u_out.items()}
    return _owned.gathered_leaves(gathered, plan_u, layout)
