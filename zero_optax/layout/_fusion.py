"""Which sliced leaves run as one group and which owned leaves as one stack: leaves whose update runs the same
program on the same kind of state."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax

from zero_optax.analysis import _inner, _programs
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCouplingError, ZeroError, ZeroStructureError
from zero_optax.layout import _attribution, _layout
from zero_optax.layout._config import Config
from zero_optax.layout._layout import Group, Layout
from zero_optax.layout._stored import MASTER, ParamLeaf, StateEntry

SHAPE_HELP = """\
The inner transformation does something different on the 1-D coordinate slices that zero1 gives it than on the
full parameters, so its result would be silently wrong. Usually a mask or label function reads the parameter
shapes (for example `mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)`): compute it once from the real
parameters and pass the tree instead, e.g. `mask=jax.tree.map(lambda x: x.ndim > 1, params)`. Or use
partition="leaf" (or "auto"), which gives the inner transformation whole parameters."""


def sources(traced: _programs.Traced, treedef, entries: tuple[StateEntry, ...]) -> tuple[tuple, tuple]:
    """`sources` and `out_sources` of the traced update for the analyses: leaf indices, the entries' leaves."""
    leaves = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    state = jax.tree_util.tree_unflatten(jax.tree.structure(traced.args[1]), [e.leaf for e in entries])
    return (leaves, state, leaves, None), (leaves, state)


def _shape_error(path: str, real: tuple[str, ...], part: tuple[str, ...]) -> ZeroCouplingError:
    i = next((i for i, (a, b) in enumerate(zip(real, part)) if a != b), min(len(real), len(part)))
    return ZeroCouplingError(
        f"zero1: the inner update applies {len(real)} operations to the parameters but {len(part)} to coordinate "
        f"slices (at `{path}`; first difference at operation {i}: {real[i] if i < len(real) else 'none'} vs "
        f"{part[i] if i < len(part) else 'none'}).\n{SHAPE_HELP}")


@dataclasses.dataclass(frozen=True)
class Views:
    """What tracing views of the sliced leaves needs (`reductions`: a norm of a group would mix its members, so
    each leaf is a group of its own)."""

    cfg: Config
    treedef: Any
    leaves: tuple[ParamLeaf, ...]
    extra: dict
    names: dict[str, str]
    reductions: bool = False


FUSE_BYTES = 1 << 14
"""Sliced leaves of at most this many bytes per device are fused into groups; larger ones keep arrays of their own
(a fused leaf is copied into and out of the group's buffer every step: `benchmarks/RESULTS.md`)."""


def leaf_programs(traced: _programs.Traced, treedef, entries: tuple[StateEntry, ...],
                  names: dict[str, str], reductions: bool = False) -> dict[int | None, tuple[str, ...]]:
    """Each leaf's program in the traced update (on the parameters, or on a view); key None the shared state's."""
    ins, outs = sources(traced, treedef, entries)
    return _programs.leaf_programs(traced, sources=ins, out_sources=outs, names=names, collective=reductions)


def init_programs(cfg: Config, tree: Any, entries: tuple[StateEntry, ...], traced: _programs.Traced | None = None
                  ) -> dict[int | None, tuple[str, ...]]:
    """Each leaf's program in the inner `init` on the parameters `tree` (`entries`: its state's leaves; `traced`:
    that `init` traced already, if it was); key None the shared state's."""
    traced = _programs.trace(cfg.inner.init if traced is None else traced, tree)
    treedef = jax.tree.structure(tree)
    leaves = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    state = jax.tree_util.tree_unflatten(jax.tree.structure(traced.out_shape), [e.leaf for e in entries])
    return _programs.leaf_programs(traced, sources=(leaves,), out_sources=state, names={})


def _entries_by_leaf(entries: tuple[StateEntry, ...]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Each leaf's inner-state entries (its histories, in state order) and its master-copy entry."""
    histories: dict[int, list[int]] = {}
    masters: dict[int, int] = {}
    for j, e in enumerate(entries):
        if e.leaf is not None and e.role == MASTER:
            masters[e.leaf] = j
        elif e.leaf is not None:
            histories.setdefault(e.leaf, []).append(j)
    return histories, masters


def groups(views: Views, entries: tuple[StateEntry, ...], programs: dict, inits: dict) -> tuple[Group, ...]:
    """The sliced leaves grouped by the program their inner update runs (`_layout.Group`), after checking that
    each runs on its slots what it runs on the parameter (a candidate group's first member holding it whole);
    `inits`: each leaf's program in the inner `init` (`init_programs`), part of what `Group.program` names."""
    cfg, leaves, reductions = views.cfg, views.leaves, views.reductions
    own, master_of = _entries_by_leaf(entries)
    histories = {i: own.get(i, []) for i, leaf in enumerate(leaves) if leaf.sliced}
    masters = {i: master_of[i] for i in histories if i in master_of}
    candidates = [[i] for i in histories] if reductions else _candidates(cfg, leaves, entries, histories, programs)
    found = _view_programs(views, candidates)
    groups, alone = [], []
    for members in candidates:
        if len(members) > 1 and found.get(members[0]) == programs.get(members[0]) and found.get(None) == \
                programs[None]:
            groups.append(members)
        else:
            alone += members
    if any(len(m) > 1 for m in candidates if m[0] in alone):
        found = _view_programs(views, [[i] for i in alone])
    for i in alone:
        if i in programs and found.get(i) != programs[i]:
            raise _shape_error(leaves[i].path, programs[i], found.get(i) or ())
    groups += [[i] for i in alone]
    out = []
    numbers: dict[tuple[str, ...], int] = {}
    for members in sorted(groups):
        offsets = np.cumsum([0] + [leaves[i].slots for i in members]).tolist()
        leaf = leaves[members[0]]  # a lone leaf that one device holds whole keeps its shape, unless offloaded
        own_shape = len(members) == 1 and leaf.group == 1 and len(leaf.shape) >= 2 and not cfg.offload \
            and all(len(entries[j].shape) == 1 for j in histories[members[0]])  # (or it has a stacked history)
        out.append(Group(tuple(members), tuple(tuple(histories[i]) for i in members),
                         tuple(masters[i] for i in members) if masters else (), tuple(offsets[:-1]), offsets[-1],
                         leaf.shape if own_shape else None, _program_number(members[0], programs, inits, numbers)))
    return tuple(out)


def _program_number(leaf: int, programs: dict, inits: dict, numbers: dict) -> int | None:
    """`Group.program` of a group whose first member is `leaf`: the number in `numbers` (added if new) of its
    programs in the inner update and `init`; None without one, or for one reading an operand it does not name
    (`c?`, an array constant: its value may differ between leaves)."""
    update, init = programs.get(leaf), inits.get(leaf)
    if update is None or init is None or any("?" in op for op in update + init):
        return None
    return numbers.setdefault((update, init), len(numbers))


STACK_BYTES = 1 << 24
"""Owned leaves stacked for one vectorised update bring at most this many bytes (a stack is a transient copy)."""


def stacks(cfg: Config, leaves: tuple[ParamLeaf, ...], entries: tuple[StateEntry, ...],
            programs: dict) -> tuple[tuple[int, ...], ...]:
    """The owned leaves with the same owner, shape, dtype, entries and program, in stacks of `STACK_BYTES`."""
    shared = [j for j, e in enumerate(entries) if e.leaf is None]
    own, _ = _entries_by_leaf(entries)
    keyed: dict[Any, list[int]] = {}
    nbytes: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        if leaf.sliced or i not in programs or leaf.tp_owned:  # (a tensor-parallel leaf's view is its whole tensor)
            continue
        view = tuple((entries[j].leaf is None, entries[j].shape, entries[j].dtype)
                     for j in sorted(shared + own.get(i, [])))  # the entries of its view, in order
        nbytes[i] = sum(entries[j].nbytes for j in own.get(i, [])) + \
            2 * leaf.size * np.dtype(cfg.inner_dtype(leaf.dtype)).itemsize
        keyed.setdefault((leaf.owner, programs[i], leaf.shape, leaf.dtype, view), []).append(i)
    stacks: list[tuple[int, ...]] = []
    for members in keyed.values():
        chunk, total = [], 0
        for i in members:
            if chunk and total + nbytes[i] > STACK_BYTES:
                stacks.append(tuple(chunk))
                chunk, total = [], 0
            chunk.append(i)
            total += nbytes[i]
        stacks.append(tuple(chunk))
    return tuple(sorted(s for s in stacks if len(s) > 1))


def _candidates(cfg: Config, leaves: tuple[ParamLeaf, ...], entries: tuple[StateEntry, ...],
                histories: dict[int, list[int]], programs: dict) -> list[list[int]]:
    """The sliced leaves keyed by program, axes, dtype and entries: small ones together, large ones alone."""
    keyed: dict[Any, list[int]] = {}
    for i, own in histories.items():
        leaf = leaves[i]
        small = leaf.slots * np.dtype(cfg.inner_dtype(leaf.dtype)).itemsize <= FUSE_BYTES
        program = programs.get(i, i) if small else i  # a leaf without a program of its own stays alone
        key = (program, leaf.axes, leaf.blocks, leaf.group, leaf.dtype,
               tuple((entries[j].dtype, entries[j].shape[:-1]) for j in own))  # (a stacked history's lead too)
        keyed.setdefault(key, []).append(i)
    return list(keyed.values())


def _view_programs(views: Views, groups: list[list[int]]) -> dict[int | None, tuple[str, ...]]:
    """The programs on one view of the sliced leaves, each group's first member holding all its members' slots."""
    cfg, treedef, leaves = views.cfg, views.treedef, views.leaves
    structs: list[Any] = [optax.MaskedNode()] * len(leaves)
    for members in groups:
        first = members[0]
        structs[first] = jax.ShapeDtypeStruct((sum(leaves[i].slots for i in members),),
                                              cfg.inner_dtype(leaves[first].dtype))
    tree = jax.tree_util.tree_unflatten(treedef, structs)
    try:
        entries, marked = _attribution.discover_entries(cfg.inner.init, treedef, structs,
                                                        sliced=[m[0] for m in groups])
        state = jax.tree.unflatten(jax.tree.structure(marked), [jax.ShapeDtypeStruct(e.shape, e.dtype)
                                                                for e in entries])
        traced = _programs.trace(_inner.update_fn(cfg.inner), tree, state, tree, views.extra)
        return leaf_programs(traced, treedef, entries, views.names, views.reductions)
    except ZeroError:
        raise
    except Exception as e:  # the user's transformation failed: refused, naming its error
        raise ZeroCouplingError(
            f"zero1: the inner update runs on the parameters but fails on their 1-D coordinate slices (the "
            f"sliced leaves, `{leaves[groups[0][0]].path}` among them): {type(e).__name__}: {e}\n"
            f"{SHAPE_HELP}") from e


def view_treedef(cfg: Config, layout: Layout, present: set[int], expected: list[int], what: str):
    """The inner state's treedef on the view holding the leaves `present`, whose leaves must be `expected`."""
    structs = [jax.ShapeDtypeStruct(layout.view_shape(leaf), cfg.inner_dtype(leaf.dtype)) for leaf in layout.leaves]
    tree = jax.tree_util.tree_unflatten(layout.treedef, _layout.masked_view(structs, present))
    state = jax.eval_shape(cfg.inner.init, tree)
    paths = _names.leaf_paths(state)
    want = [layout.entries[j].path for j in expected]
    if paths != want:
        raise ZeroStructureError(
            f"The inner optimizer's state {what} has leaves {paths}, but the layout expects {want}: its state order "
            "changes when leaves are masked, which zero1 cannot pack.")
    return jax.tree.structure(state)
