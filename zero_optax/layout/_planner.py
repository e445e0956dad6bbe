"""What `init` decides once, inside `shard_map`: how each parameter leaf is sharded and where its state lives."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from zero_optax.analysis import _coupling, _inner, _programs
from zero_optax.core import _compat, _names
from zero_optax.core._errors import (
    ZeroAxisError,
    ZeroCouplingError,
    ZeroError,
    ZeroStructureError,
)
from zero_optax.layout import _attribution, _fusion, _keys, _specs, _stored
from zero_optax.layout._config import Config
from zero_optax.layout._layout import Layout
from zero_optax.layout._stored import AUTO, FLAT, LEAF, MASTER, MASTER_PREFIX, ParamLeaf, StateEntry

FLAT_HELP = """\
Flat slices are exact only for transformations that act coordinate by coordinate. Either
  * use partition="leaf" (every parameter updated as a whole tensor on one owner device: Muon, Adafactor, LAMB,
    Shampoo) or partition="auto" (whole tensors only for the leaves that need them), or
  * move the global operation before zero1, on the reduced gradient:
        optax.chain(zo.reduce_gradients("{axis}"), optax.clip_by_global_norm(1.0),
                    zo.zero1(inner, axis_name="{axis}", reduce=False))
If you know the operation is elementwise (a custom kernel, say), zero1(..., assume_elementwise=True) skips this
check; the result is then your responsibility."""

LEAF_HELP = """\
Each leaf is updated on its owner device, so the inner transformation may not combine different leaves.
Move global operations before zero1, on the reduced gradient:
    optax.chain(zo.reduce_gradients("{axis}"), optax.clip_by_global_norm(1.0),
                zo.zero1(inner, axis_name="{axis}", partition="{partition}", reduce=False))"""

TENSOR_PARALLEL_HELP = """\
zero1 updates `{path}` as a whole tensor on one owner (it is {why}), but the parameter is sharded over
mesh axis `{axis}`: its owner gathers the blocks over `{axis}` and updates the whole tensor, for which zero1 must
know which dimension `{axis}` cuts, and inside your shard_map it sees only the local block. Either
  * bind zero1 to the mesh, zero1(..., mesh=mesh), and call init and update outside shard_map (under jax.jit):
    it reads the dimensions from the parameters' shardings; or
  * pass the parameters' PartitionSpecs, the in_specs of your shard_map: zero1(..., param_specs=param_specs)
    (zo.state_specs(tx, params, param_specs) reads them too); or
  * keep the leaf replicated over `{axis}` (in_specs P() for it), or give it an elementwise optimizer so that it
    can be sliced (partition="flat", or "auto" decides per leaf)."""

TENSOR_PARALLEL_SPEC_HELP = """\
zero1 updates `{path}` as a whole tensor on one owner and reads from its PartitionSpec {spec} which mesh axes cut
which dimension, but inside shard_map the parameter's local block (shape {shape}) varies over the mesh axes
{axes}: the spec must name exactly those axes, each cutting one dimension of the parameter. Pass the
PartitionSpecs the parameters are laid out by (your shard_map's in_specs)."""

PLACEMENT_SPEC_HELP = """\
zero1 records from the PartitionSpec {spec} of `{path}` which mesh axes cut which dimension (checkpoints keep it
to move the state between meshes), but inside shard_map the parameter's local block (shape {shape}) varies over
the mesh axes {axes}: the spec must name exactly those axes, each cutting one dimension of the parameter. Pass the
PartitionSpecs the parameters are laid out by (your shard_map's in_specs)."""

def _placement(params_leaves, paths, cfg: Config) -> tuple[list[tuple[tuple[str, ...], int, int]], dict]:
    """Per leaf: (mesh axes its blocks differ along, number of blocks, ZeRO group size); and the axis sizes."""
    sizes = {a: _compat.axis_size(a) for a in cfg.axes}
    manual = _compat.manual_axes()
    manual.update((a, sizes[a]) for a in cfg.axes if a not in manual)
    vma = _compat.vma_enabled(cfg.axes)
    others = [a for a, s in manual.items() if a not in cfg.axes + cfg.replica_axes and s > 1]
    if not vma and others:
        raise ZeroAxisError(
            f"zero1 runs in a shard_map with check_vma=False over a mesh that also has axes {others}: it cannot "
            "tell which parameters are sharded over them. Run the shard_map with check_vma=True (the default).")
    out = []
    for x, path in zip(params_leaves, paths):
        varying = _compat.varying_axes(x) if vma else frozenset()
        replicated = [a for a in cfg.replica_axes if a in varying]
        if replicated:
            raise ZeroStructureError(
                f"The parameter `{path}` differs between the devices of replica axis `{replicated[0]}` (it is typed "
                "varying there), but every replica holds the same parameters and the same optimizer state. Pass "
                "the parameters replicated over that axis (in_specs P() for them), not zo.as_local(params) or "
                "per-device values.")
        axes = tuple(a for a in manual if a in varying)
        if set(cfg.axes) <= set(axes):
            raise ZeroStructureError(
                f"The parameter `{path}` differs between the devices of `{cfg.axis_name}` (it is typed varying "
                "there), but zero1 shards optimizer state over data-parallel axes, whose devices hold identical "
                "parameters. Pass the parameters replicated over that axis (in_specs P() for them), not "
                "zo.as_local(params) or per-device values.")
        blocks = math.prod(manual[a] for a in axes)
        group = math.prod(sizes[a] for a in cfg.axes if a not in axes)
        out.append((axes, blocks, group))
    return out, {a: manual[a] for a in manual if a in cfg.axes or any(a in p[0] for p in out)}


REDUCTIONS_HELP = """\
zero1 computes full reductions of sliced leaves (a global norm, a trust ratio) exactly, with a collective over
the devices, but a leaf that needs whole tensors on an owner cannot join the collective of the sliced ones.
Either move the global operation before zero1, on the reduced gradient:
    optax.chain(zo.reduce_gradients("{axis}"), optax.clip_by_global_norm(1.0),
                zo.zero1(inner, axis_name="{axis}", partition="auto", reduce=False))
or give those leaves an elementwise optimizer, or use partition="leaf" on a transformation that does not combine
leaves."""


@dataclasses.dataclass(frozen=True)
class Coupling:
    """What the analysis of the inner update decides: the leaves that need an owner, whether the sliced leaves run
    in one view (`Layout.joint`), and the inner entries whose new value is not per coordinate (novograd's norm)."""

    coupled: frozenset[int]
    joint: bool = False
    invariant: frozenset[int] = frozenset()
    stacked: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)


def stacked_histories(entries, shapes: list[tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Entry index -> the leading axes of a leaf's stacked history (`_stacked`: its shape is the leaf's after them,
    L-BFGS's `(memory, *param.shape)`), for the entries of `entries` (on the parameters) that are such."""
    out = {}
    for k, e in enumerate(entries):
        shape = None if e.leaf is None else shapes[e.leaf]
        if shape is not None and len(e.shape) > len(shape) and tuple(e.shape[len(e.shape) - len(shape):]) == shape:
            out[k] = tuple(e.shape[:len(e.shape) - len(shape)])
    return out


def _flat_inputs(n: int, entries, stacked: Mapping[int, tuple[int, ...]], untainted: frozenset[int]
                 ) -> _coupling.Inputs:
    """What the flat analysis knows of the update's state inputs (after the `n` gradients) from `entries`."""
    shared = frozenset(n + k for k, e in enumerate(entries) if e.leaf is None) - untainted
    return _coupling.Inputs(shared, {n + k: len(lead) for k, lead in stacked.items()})


def _flat_coupling(cfg: Config, traced: _programs.Traced, treedef, state, entries, keys: dict[str, str]
                   ) -> Coupling:
    """`_coupled_leaves` under `"flat"` (`entries`: the state's with every leaf sliced, or None where unknown)."""
    shapes = [tuple(x.shape) for x in jax.tree.leaves(traced.args[0])]
    stacked = stacked_histories(entries or (), shapes)
    if cfg.assume_elementwise:
        return Coupling(frozenset(), stacked=stacked)
    # (a PRNG key's data is no parameter data; a scalar parameter is, as sliced as any other)
    n, n_state = treedef.num_leaves, len(jax.tree.leaves(traced.args[1]))
    untainted = frozenset(n + k for k, path in enumerate(_names.leaf_paths(state)) if path in keys)
    scalars = frozenset(k + off for off in (0, n + n_state) for k, x in enumerate(jax.tree.leaves(traced.args[0]))
                        if np.size(x) == 1)
    inputs = None if entries is None else _flat_inputs(n, entries, stacked, untainted)
    try:
        slices = _coupling.on_slices(traced, untainted=untainted, scalar_leaves=scalars, inputs=inputs)
    except ZeroCouplingError as e:
        raise ZeroCouplingError(
            f"zero1(partition=\"flat\") cannot run this inner transformation on coordinate slices: it applies "
            f"{e}.\n{FLAT_HELP.format(axis=cfg.axes[0])}") from None
    return Coupling(frozenset(), slices.joint,
                    frozenset(k for k, c in enumerate(slices.coordinate_outputs[n:]) if not c), stacked)


def _coupled_leaves(cfg: Config, traced: _programs.Traced, treedef, state, entries, keys: dict[str, str]
                    ) -> Coupling:
    """What the inner update needs (`Coupling`), or a `ZeroCouplingError` where the partition cannot run it
    (`entries`: the state's on the parameters; under `"flat"`, with every leaf sliced, or None where unknown)."""
    if cfg.partition == FLAT:
        return _flat_coupling(cfg, traced, treedef, state, entries, keys)
    axis = cfg.axes[0]
    shapes = [tuple(x.shape) for x in jax.tree.leaves(traced.args[0])]
    stacked = stacked_histories(entries, shapes)
    n_leaves = treedef.num_leaves
    ins, outs = _fusion.sources(traced, treedef, entries)
    try:
        found = _coupling.analyze_leaves(traced, sources=ins, out_sources=outs, collective=cfg.partition == AUTO,
                                         leads={n_leaves + k: len(lead) for k, lead in stacked.items()})
    except ZeroCouplingError as e:
        raise ZeroCouplingError(
            f"zero1(partition=\"{cfg.partition}\") cannot split this inner transformation across owner devices: it "
            f"applies {e}. Either it combines several parameter leaves (a global norm, for example), or it draws "
            f"random numbers that devices holding different leaves would not draw as one device does.\n"
            f"{LEAF_HELP.format(axis=axis, partition=cfg.partition)}") from None
    outputs = zip(_names.leaf_paths(state), found.output_taints[n_leaves:], entries)
    for path, taint, entry in outputs:
        if entry.leaf is None and taint:
            raise ZeroCouplingError(
                f"zero1(partition=\"{cfg.partition}\"): the inner state `{path}` is shared by all parameters (it "
                f"belongs to none), but its new value depends on parameter leaves {sorted(taint)}: devices that update "
                f"different leaves would disagree on it.\n{LEAF_HELP.format(axis=axis, partition=cfg.partition)}")
    if cfg.partition == LEAF:
        return Coupling(frozenset(range(n_leaves)))
    # A leaf with state not per coordinate is sliced where that state is computed from the leaf's full reductions
    # (novograd's per-leaf norm), else kept whole on an owner (Adafactor's unfactored `v_row`).
    invariant = frozenset(k for k, (c, r) in enumerate(zip(found.output_coords[n_leaves:],
                                                            found.output_reductions[n_leaves:]))
                          if not c and entries[k].leaf in r)
    kept = frozenset(e.leaf for k, e in enumerate(entries)  # (they need an owner)
                     if e.leaf is not None and tuple(e.shape) != shapes[e.leaf] and k not in invariant | stacked.keys())
    # An invariant entry's leaf is in `found.reductions`, so it makes the view joint unless it is owned already.
    coupled = found.coupled | kept
    _check_reductions(cfg, found, coupled, state, entries)
    return Coupling(coupled, bool(found.reductions - coupled) or bool(found.draws), invariant, stacked)


def _check_reductions(cfg: Config, found: _coupling.LeafAnalysis, coupled: frozenset[int], state, entries) -> None:
    """`partition="auto"`: refuses full reductions that owned leaves would have to join."""
    axis = cfg.axes[0]
    if found.crossing is not None and coupled and found.reductions:
        raise ZeroCouplingError(
            f"zero1(partition=\"auto\") cannot run this inner transformation: it applies {found.crossing}, "
            f"while leaves {sorted(coupled)} need whole tensors on an owner (the first applies "
            f"{found.reasons.get(min(coupled), 'state that is not per coordinate')}).\n"
            f"{REDUCTIONS_HELP.format(axis=axis)}")
    n_leaves = len(found.output_taints) - len(entries)
    for path, reduced, entry in zip(_names.leaf_paths(state), found.output_reductions[n_leaves:], entries):
        if entry.leaf is None and reduced & coupled:
            raise ZeroCouplingError(
                f"zero1(partition=\"auto\"): the inner state `{path}` is shared by all parameters, but its new "
                f"value depends on reductions of leaves {sorted(reduced & coupled)}, which need whole tensors on an "
                f"owner: devices would disagree on it.\n{REDUCTIONS_HELP.format(axis=axis)}")
    if found.draws and coupled:
        raise ZeroCouplingError(
            f"zero1(partition=\"auto\") cannot run this inner transformation: it adds random numbers to leaves "
            f"{sorted(found.draws)} (optax.add_noise, optax.noisy_sgd) from one key split over every leaf, which "
            f"devices reproduce only when they hold slices of every leaf, while leaves {sorted(coupled)} need whole "
            f"tensors on an owner (the first applies "
            f"{found.reasons.get(min(coupled), 'state that is not per coordinate')}). Use partition=\"flat\" with "
            f"an elementwise optimizer, or add the noise outside zero1.")


def _replicas(cfg: Config, found: Coupling, entries: tuple[StateEntry, ...], owned: list[bool], slots: list[int],
              paths: list[str]) -> tuple[tuple[int, int], ...]:
    """`Layout.replicas`: the sliced leaves' entries that are no per-coordinate history (not shaped like the slots),
    which every device computes alike (in a joint view); refuses any other such entry."""
    out = []
    for k, e in enumerate(entries):
        if e.leaf is None or owned[e.leaf] or e.shape == (*found.stacked.get(k, ()), slots[e.leaf]):
            continue
        if not (found.joint and k in found.invariant):
            raise ZeroCouplingError(
                f"zero1: the inner state `{e.path}` of leaf `{paths[e.leaf]}` has shape {e.shape} on a slice of "
                f"{slots[e.leaf]} coordinates, so it is not a per-coordinate history.\n"
                f"{FLAT_HELP.format(axis=cfg.axes[0])}")
        out.append((k, e.leaf))
    return tuple(out)


def _real_entries(cfg: Config, real: list, real_tree, traced_init: _programs.Traced | None, traced_on: tuple
                  ) -> tuple[tuple[StateEntry, ...], Any, tuple[StateEntry, ...] | None]:
    """The inner state's entries on the parameters `real` (none under `"flat"`, which attributes no state to
    leaves), its abstract state, and the entries the analysis reads (`"flat"`: every leaf sliced, for the shared
    state and the stacked histories; None where unknown)."""
    treedef = jax.tree.structure(real_tree)
    if cfg.partition == FLAT:
        real_state = jax.eval_shape(cfg.inner.init, real_tree) if traced_init is None else traced_init.out_shape
        return (), real_state, remembered(("sliced entries", cfg.inner, traced_on),
                                          lambda: _sliced_entries(cfg, treedef, real))
    real_entries, real_state = remembered(("entries", cfg.inner, traced_on), lambda: _attribution.discover_entries(
        cfg.inner.init, treedef, real))
    return real_entries, real_state, real_entries


def _sliced_entries(cfg: Config, treedef, real: list) -> tuple[StateEntry, ...] | None:
    """The inner state's entries with every leaf sliced, in the parameters' shapes (`flat`); None where the inner
    `init` cannot run on partial trees (the analysis then reads every state leaf as parameter data)."""
    try:
        return _attribution.discover_entries(cfg.inner.init, treedef, real, sliced=range(len(real)))[0]
    except ZeroCouplingError:
        return None


def _check_stacked(cfg: Config, found: Coupling, entries, owned: list[bool], paths: list[str]) -> None:
    """Refuses stacked histories of sliced leaves (`_stacked`) with `offload=True`, which streams 1-D ones."""
    stacked = [e for k, e in enumerate(entries) if k in found.stacked and e.leaf is not None and not owned[e.leaf]]
    if stacked and cfg.offload:
        raise ZeroCouplingError(
            f"zero1(offload=True) streams the sliced leaves' 1-D histories through the device in chunks, but the "
            f"inner state `{stacked[0].path}` of leaf `{paths[stacked[0].leaf]}` stacks a history per coordinate "
            f"along leading axes (shape {stacked[0].shape} on a slice). Use offload=False.")


def _typed_keys(cfg: Config, treedef, params) -> tuple[dict[str, str], _programs.Traced | None]:
    """The typed PRNG keys the inner state holds (path -> implementation), and the inner `init` traced on `params`
    where the trace that found them is it (None otherwise). Refuses a key per parameter."""
    typed_init = cfg.typed_init
    impls, traced = ({}, None) if typed_init is None else _keys.impls(typed_init, params)
    if cfg.accumulating is not None:  # (`typed_init` initialises the accumulation too: another program)
        traced = None
    if typed_init is not None and impls:
        masked = jax.tree_util.tree_unflatten(treedef, [optax.MaskedNode()] * treedef.num_leaves)
        shared = set(_names.leaf_paths(jax.eval_shape(typed_init, masked)))
        for path, impl in impls.items():
            if path not in shared:
                raise ZeroCouplingError(
                    f"The inner optimizer's state `{path}` holds a typed PRNG key ({impl}) for one parameter; "
                    "zero1 keeps typed keys in state shared by all parameters (optax.noisy_sgd's), the same on "
                    "every device. Keep one key for all parameters, or keep this transformation outside zero1.")
    return impls, traced


def _small_elementwise(cfg: Config, real, coupled: frozenset[int], placement) -> set[int]:
    """`partition="auto"`: elementwise leaves smaller than every leaf that needs an owner get one too (a rule of
    the leaves alone, so that a checkpoint restores at any world size)."""
    if cfg.partition != AUTO or not coupled:
        return set()
    smallest = min(math.prod(real[i].shape) for i in coupled)
    return {i for i, x in enumerate(real)
            if i not in coupled and not placement[i][0] and math.prod(x.shape) < smallest}


_REMEMBERED: collections.OrderedDict = collections.OrderedDict()
REMEMBERED = 8
"""How many layouts and traces of inner transformations `build_layout` keeps: `state_specs`, `init` and `zo.plan`
each build the layout of the same transformation and shapes, and tracing the inner update is most of it."""


def remembered(key: Any, compute: Callable[[], Any], kept: collections.OrderedDict = _REMEMBERED) -> Any:
    """`compute()`, kept in `kept` under `key` for the last `REMEMBERED` keys (computed each time where `key` is
    unhashable)."""
    try:
        found = kept.get(key)
    except TypeError:  # (a transformation holding an unhashable value)
        return compute()
    if found is None:
        found = kept[key] = compute()
        while len(kept) > REMEMBERED:
            kept.popitem(last=False)
    kept.move_to_end(key)
    return found


def build_layout(cfg: Config, params) -> Layout:
    """The layout of `cfg` for `params` (local blocks, inside `shard_map` over `cfg.axis_name`), kept for the last
    keys as the traces are: it depends on the parameters' shapes, dtypes and placement, the mesh and the specs."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [_names.key_path(p) for p, _ in flat]
    values = [x for _, x in flat]
    replica_sizes = _compat.axis_sizes(cfg.replica_axes)  # (bound: a clear error otherwise)
    placement, axis_sizes = _placement(values, paths, cfg)
    specs = cfg.param_specs if _specs.DECLARED.get() is None else _specs.DECLARED.get()
    spec_leaves, spec_tree = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
    if not any(p[0] for p in placement) and all(not tuple(s) for s in spec_leaves):
        spec_leaves, spec_tree = [], None  # (no spec, or none naming an axis: the same layout)
    key = ("layout", cfg, treedef, tuple((np.shape(x), str(x.dtype)) for x in values),
           tuple(_compat.manual_axes().items()), tuple(placement), replica_sizes, spec_tree, tuple(spec_leaves))
    return remembered(key, lambda: _build_layout(cfg, params, treedef, paths, values, replica_sizes, placement,
                                                  axis_sizes))


def _build_layout(cfg: Config, params, treedef, paths: list[str], values: list, replica_sizes,
                  placement: list[tuple[tuple[str, ...], int, int]], axis_sizes: dict) -> Layout:
    n = _compat.axis_size(cfg.axes)
    real = [jax.ShapeDtypeStruct(np.shape(x), cfg.inner_dtype(x.dtype)) for x in values]
    real_tree = jax.tree_util.tree_unflatten(treedef, real)
    keys, traced_init = _typed_keys(cfg, treedef, real_tree)
    traced_on = (treedef, tuple((x.shape, x.dtype) for x in real), tuple(_compat.manual_axes().items()))
    real_entries, real_state, analysed = _real_entries(cfg, real, real_tree, traced_init, traced_on)
    traced, extra = remembered(("update", cfg.inner, traced_on),
                                lambda: _inner.trace_update(cfg.inner, real_tree, real_state, real_tree))
    found = _coupled_leaves(cfg, traced, treedef, real_state, analysed, keys)
    if found.joint and cfg.offload:
        raise ZeroCouplingError(
            "zero1(offload=True) streams the sliced leaves' state through the device in chunks, but the inner "
            "transformation reduces whole leaves to scalars (a global norm, a trust ratio) or draws random "
            "numbers in their shapes, which a chunk cannot compute. Use offload=False, or move the global "
            "operation before zero1 (zo.reduce_gradients, then zero1(..., reduce=False)).")
    owned = [i in found.coupled or i in _small_elementwise(cfg, real, found.coupled, placement)
             for i in range(len(values))]
    specs = _leaf_specs(cfg, params, owned, placement, paths, real)
    dims = [(specs[i] or ()) if owned[i] and placement[i][0] else () for i in range(len(values))]  # (given: needed)
    slots = [math.prod(x.shape) if owned[i] else _stored.slot_count(math.prod(np.shape(x)), placement[i][2])
             for i, x in enumerate(real)]
    mixed = [jax.ShapeDtypeStruct(_stored.whole_shape(x.shape, dims[i], axis_sizes), x.dtype) if owned[i]
             else jax.ShapeDtypeStruct((slots[i],), x.dtype) for i, x in enumerate(real)]
    entries = real_entries if all(owned) and not any(dims) else \
        _entries_on_slices(cfg, treedef, mixed, real_state, owned)
    replicas = _replicas(cfg, found, entries, owned, slots, paths)
    _check_stacked(cfg, found, entries, owned, paths)
    by_leaf = entries  # (a replica's program is its leaf's, as the views trace it)
    entries = tuple(dataclasses.replace(e, leaf=None) if (k, e.leaf) in replicas else e for k, e in enumerate(entries))
    entries = tuple(dataclasses.replace(e, key_impl=keys[e.path]) if e.path in keys else e for e in entries)
    owners = _leaf_owners(cfg, entries, mixed, owned, n, paths)  # (owned leaves' costs at their whole sizes)
    leaves = tuple(ParamLeaf(paths[i], tuple(np.shape(x)), np.dtype(x.dtype).name, slots[i],
                             owners[i] if owned[i] else None, *placement[i], dims[i], specs[i])
                   for i, x in enumerate(values))
    views = _fusion.Views(cfg, treedef, leaves, extra, {}, found.joint)
    programs = _fusion.leaf_programs(traced, treedef, by_leaf, views.names, found.joint)
    entries = entries + _master_entries(cfg, leaves, axis_sizes)
    inits = remembered(("init", cfg.inner, traced_on, by_leaf), lambda: _fusion.init_programs(
        cfg, real_tree, by_leaf, traced_init))
    groups = () if all(owned) else _fusion.groups(views, entries, programs, inits)
    return Layout(
        partition=cfg.partition, axis_name=cfg.axis_name, world_size=n, leaves=leaves, entries=entries,
        treedef=treedef, state_tree=_names.tree_signature(real_state), state_treedef=jax.tree.structure(real_state),
        master_dtype=None if cfg.master_dtype is None else np.dtype(cfg.master_dtype).name,
        axis_sizes=tuple(axis_sizes.items()), accumulate=cfg.accumulate, accumulate_steps=cfg.accumulate_steps,
        memory_kind="pinned_host" if cfg.offload else "device", groups=groups,
        stacks=_fusion.stacks(cfg, leaves, entries, programs), joint=found.joint and bool(groups),
        replicas=replicas, replica_sizes=replica_sizes,
        programs=tuple((programs[i], inits[i], leaf.shape, leaf.dtype)
                       if i in programs and i in inits and not leaf.sliced and not leaf.tp_owned else None
                       for i, leaf in enumerate(leaves)),
        reads=None if traced_init is None else tuple(_programs.value_dependent(traced_init.closed)))


def _leaf_specs(cfg: Config, params, owned: list[bool], placement: list, paths: list[str], real: list
                ) -> list[tuple[tuple[str, ...], ...] | None]:
    """Per leaf, its `ParamLeaf.spec`, read from the parameters' `PartitionSpec`s (declared, else `param_specs`):
    every dimension uncut for a leaf sharded over no other axis; None where no spec is given."""
    need = [i for i, o in enumerate(owned) if o and placement[i][0]]
    unknown = [None if placement[i][0] else ((),) * len(x.shape) for i, x in enumerate(real)]
    specs = cfg.param_specs if _specs.DECLARED.get() is None else _specs.DECLARED.get()
    if specs is None:
        if need:
            i = need[0]
            why = "partition=\"leaf\"" if cfg.partition == LEAF else "not elementwise"
            raise ZeroCouplingError(TENSOR_PARALLEL_HELP.format(path=paths[i], why=why, axis=placement[i][0][0]))
        return unknown
    try:
        per_leaf = jax.tree.leaves(_specs.broadcast_specs(specs, params), is_leaf=lambda x: isinstance(x, P))
    except ZeroError:
        if need:
            raise
        return unknown  # (specs of another tree: what the layout needs is known without them)
    out = []
    for i, x in enumerate(real):
        spec, axes, ndim = tuple(per_leaf[i]), placement[i][0], len(x.shape)
        cut = _stored.spec_axes(spec)
        named = [a for c in cut for a in c]
        if len(cut) > ndim or sorted(named) != sorted(axes):
            text = TENSOR_PARALLEL_SPEC_HELP if owned[i] else PLACEMENT_SPEC_HELP
            raise ZeroStructureError(text.format(path=paths[i], spec=P(*spec), shape=tuple(x.shape), axes=list(axes)))
        out.append(tuple(cut) + ((),) * (ndim - len(cut)))
    return out


def _entries_on_slices(cfg: Config, treedef, mixed: list, real_state, owned: list[bool]) -> tuple[StateEntry, ...]:
    """The inner state's entries on the `mixed` tree (sliced leaves as 1-D slices), structured as on the parameters."""
    entries, marked = _attribution.discover_entries(cfg.inner.init, treedef, mixed,
                                                    sliced=[i for i in range(len(mixed)) if not owned[i]])
    if jax.tree.structure(real_state) != jax.tree.structure(marked):
        raise ZeroCouplingError(
            f"zero1: the inner state on coordinate slices has the structure "
            f"{_names.tree_signature(marked)}, but on the parameters {_names.tree_signature(real_state)}.\n"
            f"{_fusion.SHAPE_HELP}")
    return entries


def _leaf_owners(cfg: Config, entries, real, owned: list[bool], n: int, paths: list[str]) -> list[int | None]:
    """Every leaf's owner: `cfg.owners` (checked), or balanced over each owned leaf's state and master bytes."""
    if cfg.owners is not None:
        return list(_attribution.check_owners(cfg.owners, len(real), n, paths))
    costs = list(entries)
    if cfg.master_dtype is not None:
        costs += [StateEntry("", i, x.shape, cfg.inner_dtype(x.dtype).name, MASTER) for i, x in enumerate(real)]
    return _attribution.owners_for_entries(costs, owned, n)


def _master_entries(cfg: Config, leaves: tuple[ParamLeaf, ...], sizes: dict[str, int]) -> tuple[StateEntry, ...]:
    """With `master_dtype`, one master-copy entry per leaf: a slice for sliced leaves, the whole for owned ones."""
    if cfg.master_dtype is None:
        return ()
    return tuple(StateEntry(MASTER_PREFIX + leaf.path, i, (leaf.slots,) if leaf.sliced else
                            _stored.whole_shape(leaf.shape, leaf.dims, sizes), np.dtype(cfg.master_dtype).name,
                            MASTER) for i, leaf in enumerate(leaves))


