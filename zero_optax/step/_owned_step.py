"""The owned leaves' part of a step: gradients reduced to their owners, one `lax.switch` branch per device, gather.

Device `r`'s branch runs the inner update on its owned view (its leaves whole, every other leaf masked; the shared
entries come from the group views); a stack's members run as one member's view under `jax.vmap`. A leaf sharded
over tensor-parallel axes is gathered whole on its owner's devices, which all update it and keep their own block.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.analysis import _programs
from zero_optax.core import _compat
from zero_optax.layout import _layout
from zero_optax.layout._config import Config
from zero_optax.layout._layout import Layout
from zero_optax.layout._stored import MASTER, Packing, ParamLeaf
from zero_optax.step import (
    _groups,
    _master,
    _offload,
    _packed,
    _reduce,
    _wire,
)


def tp_axes(layout: Layout, leaves: Sequence[int]) -> tuple[str, ...]:
    """The tensor-parallel axes the tensor-parallel owned `leaves` are sharded over, in mesh order."""
    cut = {a for i in leaves for a in layout.leaves[i].axes if layout.leaves[i].tp_owned}
    return tuple(a for a, _ in layout.axis_sizes if a in cut)


def gather_whole(wire: _wire.Wire, layout: Layout, leaf: ParamLeaf, x: jax.Array) -> jax.Array:
    """The whole parameter from every device's block `x` of it (one all-gather over `leaf.axes`)."""
    blocks = wire.gather_blocks(x, leaf.axes)
    return assemble(layout, leaf, blocks.reshape(_grid(layout, leaf.axes) + leaf.shape))


def _grid(layout: Layout, axes: Sequence[str]) -> tuple[int, ...]:
    """The sizes of the mesh `axes`: the leading shape of blocks gathered over them."""
    return tuple(dict(layout.axis_sizes)[a] for a in axes)


def assemble(layout: Layout, leaf: ParamLeaf, blocks: jax.Array) -> jax.Array:
    """The whole tensor from `blocks[k_1, ..., k_m]` along `leaf.axes` (row-major where axes share a dimension)."""
    m = len(leaf.axes)
    perm = []
    for d, cut in enumerate(leaf.dims):
        perm += [leaf.axes.index(a) for a in cut] + [m + d]
    return blocks.transpose(perm).reshape(layout.whole_shape(leaf))


def own_block(leaf: ParamLeaf, whole: jax.Array) -> jax.Array:
    """This device's block of the whole tensor `whole` (the inverse of `assemble`)."""
    for d, cut in enumerate(leaf.dims):
        if cut:
            n = leaf.shape[d]
            whole = lax.dynamic_slice_in_dim(whole, _compat.axis_index(cut) * n, n, d)
    return whole


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Rows of owner-packed blocks (dtype -> `[devices of axes, size]`) gathered over the tensor-parallel `axes`."""

    plan: Packing
    rows: dict[str, jax.Array]
    axes: tuple[str, ...]

    def whole(self, layout: Layout, r: int, i: int) -> jax.Array:
        """Leaf `i`'s whole value, on the devices of its owner `r`."""
        leaf = layout.leaves[i]
        dtype, off = self.plan.offsets[r][i]
        x = self.rows[dtype][:, off:off + leaf.size].reshape(_grid(layout, self.axes) + leaf.shape)
        # the leaf's blocks are the same along gathered axes it is not cut over: position 0 of those
        x = x[tuple(slice(None) if a in leaf.axes else 0 for a in self.axes)]
        return assemble(layout, leaf, x)


def owned_by(layout: Layout) -> list[tuple[int, ...]]:
    """Per device along the ZeRO axes, the leaves it owns: all of a device's branch depends on."""
    return [tuple(i for i, leaf in enumerate(layout.leaves) if leaf.owner == r) for r in range(layout.world_size)]


def own_row(layout: Layout, values: dict[int, jax.Array], plan: Packing, rank: jax.Array) -> dict[str, jax.Array]:
    """This device's row of `plan`: the blocks of the leaves its ZeRO rank owns, packed (a switch on the rank)."""
    varying = layout.axes + tp_axes(layout, list(values))

    def branch(r):
        return lambda v: _compat.pvary(_packed.pack({i: v[i] for i in plan.offsets[r]}, plan.offsets[r],
                                                   plan.sizes), varying)
    return _packed.switch(rank, [branch(r) for r in range(layout.world_size)], values, owns=owned_by(layout))


class _OwnedPlans(NamedTuple):
    """How the owned leaves' values move; `tp`: the static parts of the gathered tensor-parallel gradients, params."""

    mode: str | None
    g: Any
    u: Any
    tp_u: Any
    tp: tuple[Gathered, Gathered | None] | None
    summed: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class OwnedStep:
    """`init` and `update` of the owned leaves of one `Config`'s layouts, inside `shard_map`."""

    cfg: Config
    wire: _wire.Wire
    views: _groups.Views
    masters: _master.NoMasters

    def build(self, layout: Layout, values: list, full: list | None, rank, whole: dict | None = None
              ) -> dict[str, jax.Array]:
        """The packed buffers: row `r` holds the state and master copies of the leaves device `r` owns (or `full`'s);
        `whole`: shared values computed on the whole parameters (`_groups.value_shared`), in place of a view's."""
        packing = layout.state_packing
        if not packing.sizes:
            return {}
        values = [gather_whole(self.wire, layout, leaf, x) if leaf.tp_owned else x
                  for leaf, x in zip(layout.leaves, values)]

        def run(r, values, full):
            if full is None:
                owned = {i for i, leaf in enumerate(layout.leaves) if leaf.owner == r}
                self.views.owned(layout, r, owned)  # checks the entry order this device packs
                state = self.cfg.inner.init(_groups.tree(layout, _layout.masked_view(values, owned)))
                full = dict(zip(_groups.owned_entries(layout, owned), jax.tree.leaves(state)))
                full.update((j, x) for j, x in (whole or {}).items() if j in full)
            items = {j: values[layout.entries[j].leaf] if layout.entries[j].role == MASTER else full[j]
                     for j in layout.rank_entries(r)}
            return _compat.pvary(_packed.pack(items, packing.offsets[r], packing.sizes), layout.axes)

        mine = [[i for i, leaf in enumerate(layout.leaves) if leaf.owner == r] for r in range(layout.world_size)]
        keys = branch_keys(layout, mine, full is None and layout.accumulate is None)
        buffers = _packed.switch(rank, [functools.partial(run, r) for r in range(layout.world_size)],
                                 shared_operands(keys, mine, rank, values), full, owns=keys)
        return {d: b[None] for d, b in buffers.items()}

    def update(self, step: _groups.Step, owned: list[int], g_leaves: list, state) -> tuple[dict, dict]:
        """The inner update on every device's owned view in one `lax.switch`: new buffers, what devices receive."""
        layout, denom, n = step.layout, step.denom, step.layout.world_size
        mode, plan_g, grad_input = self._gradients(step, [i for i in owned if not layout.leaves[i].tp_owned],
                                                   g_leaves)
        tp, tp_rows = self._tp_inputs(step, [i for i in owned if layout.leaves[i].tp_owned], mode, g_leaves)
        u_dtypes = self.masters.sent_dtypes(self.views, step, owned)
        u_plan, tp_u_plan = (_packed.leaf_plan(layout, {i: d for i, d in u_dtypes.items()
                                                        if layout.leaves[i].tp_owned == t}) for t in (False, True))
        summed = (self.wire.sums_owned_results and not any(layout.leaves[i].tp_owned for i in owned)
                  and _packed.sums_results(layout, u_plan))
        plans = _OwnedPlans(mode, plan_g, u_plan, tp_u_plan, tp, summed)
        old_buffers = {d: b[0] for d, b in state.buffers.items()}
        mine = [[i for i in owned if layout.leaves[i].owner == r] for r in range(n)]
        keys = branch_keys(layout, mine, not step.streamed and layout.accumulate is None, (plans.g, plans.u))
        branches = [self._branch(step, plans, mine[r], r) for r in range(n)]
        if mode != "psum_scatter":  # (reduce-scattered, each device's gradients are its own row already)
            grad_input = shared_operands(keys, mine, step.rank, grad_input)
        p_leaves = shared_operands(keys, mine, step.rank, step.p_leaves)
        out = _packed.switch(step.rank, branches, grad_input, old_buffers, p_leaves, tp_rows, owns=keys)
        if not step.stepping:
            return {d: b[None] for d, b in out.items()}, {}
        new, u_out, t_out = out
        if not step.streamed:  # (streamed, each bucket keeps its old state where the step is skipped)
            new = _reduce.skip_if_empty(denom.ok, new, old_buffers)
        u = _gather_owned(self.wire, layout, u_out, plans.u, step.rank if plans.summed else None)
        u.update(_gather_owned(self.wire, layout, t_out, plans.tp_u))  # (on one device, `t_out` is empty)
        return {d: b[None] for d, b in new.items()}, u

    def _branch(self, step: _groups.Step, plans: _OwnedPlans, mine: list[int], r: int):
        """Device `r`'s branch: its owned view's update of `mine`; the new buffers and, stepping, the packed results."""
        layout, n = step.layout, step.layout.world_size
        packing = layout.state_packing
        shapes = {i: layout.leaves[i].shape for i in plans.g.offsets[r]}

        def run(grad_input, buffers, p_leaves, tp_rows):
            here = dataclasses.replace(step, p_leaves=p_leaves)  # (the branch's operand)
            if plans.mode == "psum_scatter":
                g = _packed.Row(grad_input, plans.g.offsets[r], shapes,
                               lambda x, i: _reduce.divide(x, step.denom, step.inner_dt[i]))
            else:
                g = {i: grad_input[i] for i in mine if i in grad_input}
            g, here = _tp_whole(here, plans, r, mine, g, tp_rows)
            if step.streamed:
                new_buffers, u = _offload.stream_owned(self, here, r, mine, g, buffers)
            else:
                stored = _packed.Row(buffers, packing.offsets[r],
                                    {j: layout.entries[j].shape for j in layout.rank_entries(r)})
                values, u = self.view_update(here, r, mine, g, stored)
                new_buffers = _packed.pack(values, packing.offsets[r], packing.sizes, base=buffers if n > 1 else None)
            if not step.stepping:
                return _compat.pvary(new_buffers, layout.axes) if n > 1 else new_buffers
            u = {k: own_block(layout.leaves[k], x) if isinstance(k, int) and layout.leaves[k].tp_owned
                 else x for k, x in u.items()}  # (each device keeps its block of a tensor-parallel leaf's result)
            if n == 1:
                return new_buffers, _packed.unstacked(u), {}
            tp_u = {i: x for i, x in u.items() if isinstance(i, int) and layout.leaves[i].tp_owned}
            u_buffers = _packed.pack({k: x for k, x in u.items() if k not in tp_u}, plans.u.offsets[r], plans.u.sizes)
            t_buffers = _packed.pack(tp_u, plans.tp_u.offsets[r], plans.tp_u.sizes)
            return (*_compat.pvary((new_buffers, u_buffers), layout.axes),
                    _compat.pvary(t_buffers, layout.axes + tp_axes(layout, range(len(layout.leaves)))))
        return run

    def _tp_inputs(self, step: _groups.Step, tp: list[int], mode: str | None, g_leaves: list
                   ) -> tuple[tuple | None, tuple]:
        """The tensor-parallel owned leaves' gradients (and parameters) gathered: `_OwnedPlans.tp` and the rows."""
        layout = step.layout
        if not tp:
            return None, ()
        axes = tp_axes(layout, tp)

        def gathered(values: dict) -> Gathered:  # (this device holds every leaf's blocks: its row of them)
            plan = _packed.leaf_plan(layout, {i: np.dtype(values[i].dtype).name for i in tp})
            return Gathered(plan, self.wire.gather_blocks(own_row(layout, values, plan, step.rank), axes), axes)
        _, plan, reduced = self._gradients(step, tp, g_leaves, mode)
        if mode == "psum_scatter":  # (already this device's row, reduce-scattered)
            grads = Gathered(plan, self.wire.gather_blocks(reduced, axes), axes)
        else:
            grads = gathered(reduced)
        p_leaves, params = step.p_leaves, None
        if p_leaves is not None and self.masters.gathers_tp_params and step.stepping:
            params = gathered({i: p_leaves[i] for i in tp})
        static = [None if x is None else dataclasses.replace(x, rows=None) for x in (grads, params)]
        return tuple(static), (grads.rows, None if params is None else params.rows)

    def view_update(self, step: _groups.Step, r: int, mine: list[int], g: _packed.Row | dict[int, jax.Array],
                    stored: _packed.Row | dict[int, jax.Array]) -> tuple[dict, dict]:
        """Device `r`'s update of `mine` from their `stored` entries: their new entries and what devices receive."""
        layout, p_leaves = step.layout, step.p_leaves
        present = set(mine)
        entries = [j for j in layout.rank_entries(r) if layout.entries[j].leaf in present]
        p = None  # (a micro-step only accumulates: it reads no parameters)
        if p_leaves is not None and step.stepping:
            p = self.masters.owner_params(_master.stored_masters(layout, entries, stored), p_leaves, mine)
        stacks = [s for s in ([i for i in stack if i in present] for stack in layout.stacks) if len(s) > 1]
        stacked = {i for s in stacks for i in s}
        rest = [i for i in mine if i not in stacked]
        u: dict[_packed.Key, jax.Array] = {}
        values: dict[_packed.Key, jax.Array] = {}
        for stack in stacks:
            done = self._stack_update(step, r, stack, g, stored, p)
            if done is None:  # a program `jax.vmap` cannot run: its members run one by one
                rest += stack
                continue
            u.update(done[0])
            values.update(done[1])
        rest.sort()
        if rest:  # (a device that owns no leaf has nothing to update: the group views compute the shared entries)
            u_rest, v_rest = self._view(step, r, rest, g, stored, p)
            u.update(zip(rest, u_rest))
            values.update(v_rest)
        return values, self.masters.owner_results(layout, entries, stored, u, values, step)

    def _view(self, step: _groups.Step, r: int, leaves: list[int], g, stored, p: dict | None) -> tuple[list, dict]:
        """Device `r`'s owned view of `leaves` updated: their updates and new entries (shared ones left out)."""
        layout, shared_old = step.layout, step.shared_old
        assert shared_old is not None  # (set by the group views)
        entries = _groups.owned_entries(layout, leaves)
        old = jax.tree_util.tree_unflatten(self.views.owned(layout, r, leaves),
                                           [shared_old[j] if j in shared_old else stored[j] for j in entries])
        g_view = _groups.masked_tree(layout, {i: g[i] for i in leaves})
        p_view = None if p is None else _groups.masked_tree(layout, {i: p[i] for i in leaves})
        u, new = _groups.run_inner(step, g_view, old, p_view)
        _groups.check_returned(u, new, g_view, old, f"leaves device {r} owns")
        return jax.tree.leaves(u), {j: v for j, v in zip(entries, jax.tree.leaves(new)) if j not in shared_old}

    def _stack_update(self, step: _groups.Step, r: int, stack: list[int], g, stored, p: dict[int, jax.Array] | None
                      ) -> tuple[dict, dict] | None:
        """The view of `stack[0]` under `jax.vmap` over `stack`: its updates and new entries (None where vmap cannot
        run it)."""
        first, shared_old = stack[0], step.shared_old
        assert shared_old is not None  # (set by the group views)
        views = [_groups.owned_entries(step.layout, [i]) for i in stack]
        own = [k for k, j in enumerate(views[0]) if j not in shared_old]
        keys = [tuple(view[k] for view in views) for k in own]

        def run(g1, histories, p1):
            u, new = self._view(step, r, [first], {first: g1}, {key[0]: h for key, h in zip(keys, histories)},
                                None if p1 is None else {first: p1})
            return u[0], [new[key[0]] for key in keys]

        args = (_packed.stacked(g, stack), [_packed.stacked(stored, key) for key in keys],
                None if p is None else jnp.stack([p[i] for i in stack]))
        if not _programs.vectorisable(jax.make_jaxpr(run)(*jax.tree.map(_member_type, args)).jaxpr):
            return None
        u, new = jax.vmap(run)(*args)
        return {tuple(stack): u}, dict(zip(keys, new))

    def _gradients(self, step: _groups.Step, owned: list[int], g_leaves: list, mode: str | None = "choose"
                   ) -> tuple[str | None, Any, dict]:
        """The owned leaves' gradient collective `mode` (chosen unless given), their packing and the switch operand."""
        layout, denom, inner_dt, sum_dt = step.layout, step.denom, step.inner_dt, step.sum_dt
        n = layout.world_size
        plan_g = _packed.leaf_plan(layout, {i: sum_dt[i] for i in owned})
        nbytes = sum(g_leaves[i].size * np.dtype(sum_dt[i]).itemsize for i in owned)
        if mode == "choose":
            reduce = "auto" if self.cfg.reduce == "default" else self.cfg.reduce
            mode = _packed.choose_reduce(reduce, plan_g, nbytes, n, self.wire.packs_owned_gradients)
        if mode == "psum_scatter":
            rows = _packed.scatter_rows({i: g_leaves[i].astype(sum_dt[i]) for i in owned}, plan_g, n)
            grad_input = self.wire.scatter_packed(rows)
        elif mode == "psum":
            grad_input = {i: _reduce.divide(self.wire.all_reduce(g_leaves[i].astype(sum_dt[i])), denom, inner_dt[i])
                          for i in owned}
        else:
            grad_input = {i: g_leaves[i].astype(inner_dt[i]) for i in owned}
        return mode, plan_g, grad_input


def _tp_whole(step: _groups.Step, plans: _OwnedPlans, r: int, mine: list[int], g, tp_rows: tuple):
    """Inside device `r`'s branch: `g` and `step`'s parameters with its tensor-parallel leaves' whole tensors."""
    layout = step.layout
    whole = [i for i in mine if layout.leaves[i].tp_owned]
    if not whole:
        return g, step
    assert plans.tp is not None  # (the leaves of `whole` were gathered)
    grads = dataclasses.replace(plans.tp[0], rows=tp_rows[0])
    g_whole = {i: grads.whole(layout, r, i) for i in whole}
    if plans.mode == "psum_scatter":
        g_whole = {i: _reduce.divide(x, step.denom, step.inner_dt[i]) for i, x in g_whole.items()}
    g = dataclasses.replace(g, values=g_whole) if isinstance(g, _packed.Row) else {**g, **g_whole}
    if plans.tp[1] is not None:
        assert step.p_leaves is not None  # (their gathered blocks are)
        params = dataclasses.replace(plans.tp[1], rows=tp_rows[1])
        p_leaves = [params.whole(layout, r, i) if i in whole else p for i, p in enumerate(step.p_leaves)]
        step = dataclasses.replace(step, p_leaves=p_leaves)
    return g, step


def _member_type(x: jax.Array):
    """The type (shape, dtype, varying axes) of one member of the stacked `x`."""
    aval = jax.typeof(x)
    return aval.update(shape=aval.shape[1:])


def _gather_owned(wire: _wire.Wire, layout: Layout, u_out: dict[Any, jax.Array], plan_u,
                  rank: jax.Array | None = None) -> dict[int, jax.Array]:
    """The owners' results, packed by `plan_u` (or, on one device, per leaf), on every device, per leaf: gathered
    row by row, or with `rank` summed (each device's row placed where `_packed.row_starts` says, zeros elsewhere)."""
    if layout.world_size == 1:  # a psum of one device only retypes the value as invariant
        return {i: wire.invariant(x) for i, x in u_out.items()} if _compat.vma_enabled(layout.axes) else u_out
    if rank is None:
        return _packed.gathered_leaves(wire.gather_packed(u_out), plan_u, layout)
    starts, length = _packed.row_starts(plan_u, layout)
    placed = {d: lax.dynamic_update_slice_in_dim(jnp.zeros((length[d],), row.dtype), row,
                                                 jnp.asarray([s[d] for s in starts], jnp.int32)[rank], 0)
              for d, row in u_out.items()}
    at = {i: (d, starts[r][d] + off) for r, offsets in enumerate(plan_u.offsets) for i, (d, off) in offsets.items()}
    row = _packed.Row(wire.sum_packed(placed), at, {i: layout.leaves[i].shape for i in at})
    return {i: row[i] for i in at}


SHARED_BRANCHES = 16
"""Above this many branches in the owners' switch (devices owning different leaves), devices whose leaves run one
program share a branch: XLA compiles every branch, which then dominates the time to the first step."""


def branch_keys(layout: Layout, mine: list[list[int]], shareable: bool, rows: Sequence[Packing] = ()) -> list[Any]:
    """Per device, what its branch of the owners' switch runs: the leaves it owns, or, past `SHARED_BRANCHES`, for
    leaves of one program, shape and dtype packed alike (in the state and in `rows`), a key devices share (their
    branch is the first's, run on their own leaves' values: `shared_operands`); never with tensor-parallel leaves,
    streamed or accumulated state."""
    owns = owned_by(layout)
    shareable = shareable and len(set(owns)) > SHARED_BRANCHES
    keys: list[Any] = []
    for r, leaves in enumerate(mine):
        programs = [layout.programs[i] if layout.programs else None for i in leaves]
        if not (leaves and shareable) or None in programs:
            keys.append(owns[r])
            continue
        entries = [layout.entries[j] for j in layout.rank_entries(r)]
        keys.append((tuple(programs),
                     tuple((e.role, leaves.index(e.leaf) if e.leaf in leaves else -1) for e in entries),
                     tuple(layout.state_packing.offsets[r][j] for j in layout.rank_entries(r)),
                     tuple(tuple(plan.offsets[r].get(i) for i in leaves) for plan in rows),
                     tuple(tuple(leaves.index(i) for i in s) for s in layout.stacks if s[0] in leaves)))
    return keys


def shared_operands(keys: list[Any], mine: list[list[int]], rank: jax.Array, values):
    """`values` (leaf -> array, a dict or a list; or None) with, where the first device of devices sharing a branch
    reads its leaves, each device's own leaves' values (a select on its place among them)."""
    sharing: dict[Any, list[int]] = {}
    for r, key in enumerate(keys):
        sharing.setdefault(key, []).append(r)
    sets = [ranks for ranks in sharing.values() if len(ranks) > 1 and mine[ranks[0]]]
    if values is None or not sets:
        return values
    place = np.zeros(len(keys), np.int32)
    for ranks in sets:
        place[ranks] = np.arange(len(ranks))
    which = jnp.asarray(place)[rank]
    out = dict(values) if isinstance(values, dict) else list(values)
    for ranks in sets:
        for k, first in enumerate(mine[ranks[0]]):
            out[first] = lax.select_n(jnp.minimum(which, len(ranks) - 1), *(values[mine[r][k]] for r in ranks))
    return out
