"""What a compiled program moves, read from its HLO text: collective bytes, memory-kind transfers, kernel traffic.

The accounting behind the wire and memory claims of the tests and of `benchmarks/` (it runs nothing and imports
nothing else of zero_optax).

``collective_bytes`` parses ``compiled.as_text()`` (the post-SPMD-partitioning HLO of
``jax.jit(f).lower(...).compile()``), so every shape in it is a *per-device* shape. For each
collective it records the bytes of the op's full tensor: the all-reduced buffer, the gathered
result of an all-gather, the un-scattered operand of a reduce-scatter. Summed per kind.

Notes on the format this handles:

* Operands may be printed bare (``all-gather(%param.4)``, the CPU/GPU default) or with shapes
  (``all-gather(f32[8,4]{1,0} %param.4)``); bare names are resolved through a module-wide
  name -> result-shape table (HLO instruction names are unique within a module).
* Tuple-shaped (combined) collectives such as ``(f32[16,4], bf16[64,4]) all-reduce(a, b)`` are
  summed over their elements.
* Async forms: ``all-reduce-start``, ``all-gather-start``, ``collective-permute-start`` are counted;
  their ``-done`` halves are not. ``all-gather-start`` returns ``(operands, results)``, so its
  full tensor is ``result - operand``. Collectives wrapped in ``async-start(..., calls=%comp)``
  are counted once, from the plain op inside ``%comp``.
* Counting follows the call graph from ENTRY: a collective inside a ``while`` body is multiplied
  by the loop's ``known_trip_count`` (once if XLA does not know it; ``trip_count_known`` is then
  False on the op), every branch of a ``conditional`` counts once (an upper bound).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

import zero_optax  # noqa: F401  (sets NPROC before the CPU backend starts, as importing this module from inside
# the package did in 0.4: benchmarks that import it run with the same XLA thread pool as before)

KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

# Wire-volume weights in units of the op's full tensor: a ring all-reduce moves ~2x the buffer
# per device (reduce-scatter + all-gather), an all-gather / reduce-scatter ~1x. all-to-all and
# collective-permute are weighted 1x of the (per-device) tensor they move.
WIRE_WEIGHTS: dict[str, float] = {
    "all-reduce": 2.0,
    "all-gather": 1.0,
    "reduce-scatter": 1.0,
    "all-to-all": 1.0,
    "collective-permute": 1.0,
}

_DTYPE_BITS: dict[str, int] = {
    "pred": 8,
    "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "token": 0,
}  # fmt: skip

_SHAPE_RE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([^\]]*)\]")
_DEF_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=(]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_NAME_RE = re.compile(r"%?([A-Za-z_][\w.\-]*)\s*$")
_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_CALLEE_RE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES_RE = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_GROUPS_RE = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# XLA with JAX >= 0.12 names the mesh axes: replica_groups=mesh['data'=4,'model'=2] {'data'}
_MESH_GROUPS_RE = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')

_COUNTED: dict[str, str] = {k: k for k in KINDS} | {
    "all-reduce-start": "all-reduce",
    "all-gather-start": "all-gather",
    "collective-permute-start": "collective-permute",
}


def _dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    m = re.match(r"^f(\d+)e", dtype)  # f8e4m3fn, f8e5m2, f4e2m1fn, ...
    if m:
        return int(m.group(1))
    raise ValueError(f"unknown HLO element type {dtype!r}")


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape string; tuples (possibly nested) are summed over their arrays."""
    total_bits = 0
    for dtype, dims in _SHAPE_RE.findall(shape_text):
        dims = dims.replace("<=", "").strip()
        n = int(np.prod([int(d) for d in dims.split(",")])) if dims else 1
        total_bits += n * _dtype_bits(dtype)
    return (total_bits + 7) // 8


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at ``text[start] == '('``."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced parentheses in HLO line: {text!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas not nested inside (), [], {}."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts]


def _parse_instruction(line: str) -> tuple[str, str, str, str] | None:
    """``(name, result_shape, opcode, operands_text)`` of one HLO instruction line, else None."""
    m = _DEF_RE.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    rest = rest.lstrip()
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        sp = rest.find(" ")
        if sp < 0:
            return None
        end = sp
    shape, after = rest[:end], rest[end:]
    om = _OPCODE_RE.match(after)
    if not om:
        return None
    open_idx = om.end() - 1
    close = _balanced(after, open_idx)
    return name, shape, om.group(1), after[open_idx + 1 : close - 1]


def _operand_bytes(operands: str, shapes: dict[str, str]) -> int:
    total = 0
    for op in _split_top(operands):
        if not op:
            continue
        if _SHAPE_RE.search(op):
            total += shape_bytes(op)
            continue
        m = _NAME_RE.search(op)
        if m is None or m.group(1) not in shapes:
            raise ValueError(f"cannot resolve HLO operand {op!r}")
        total += shape_bytes(shapes[m.group(1)])
    return total


def _multipliers(
    calls: dict[str, list[tuple[str, int, bool]]], entry: str | None, comps: list[str]
) -> tuple[dict[str, int], dict[str, bool]]:
    """How many times each computation runs per execution of ENTRY, and whether that is exact."""
    if entry is None:
        return {c: 1 for c in comps}, {c: True for c in comps}
    indeg: dict[str, int] = {c: 0 for c in comps}
    reach, stack = {entry}, [entry]
    while stack:  # only edges reachable from ENTRY count
        for callee, _, _ in calls.get(stack.pop(), []):
            if callee not in reach:
                reach.add(callee)
                stack.append(callee)
    for c in reach:
        for callee, _, _ in calls.get(c, []):
            indeg[callee] = indeg.get(callee, 0) + 1
    mult = {entry: 1}
    exact = {entry: True}
    ready = [entry]
    while ready:  # Kahn's algorithm over the (acyclic) call graph
        c = ready.pop()
        for callee, weight, known in calls.get(c, []):
            mult[callee] = mult.get(callee, 0) + mult[c] * weight
            exact[callee] = exact.get(callee, True) and exact[c] and known
            indeg[callee] -= 1
            if indeg[callee] == 0:
                ready.append(callee)
    return mult, exact


def collective_ops(hlo_text: str) -> list[dict[str, Any]]:
    """Every collective in the module, reachable from ENTRY.

    Each is ``{"name", "kind", "opcode", "computation", "bytes", "multiplier",
    "trip_count_known", "replica_groups"}``; ``bytes`` is the full-tensor size of one execution, ``multiplier`` how
    many times it runs per step (while-loop trip counts).
    """
    shapes: dict[str, str] = {}
    found: list[tuple[str, tuple[str, str, str, str]]] = []
    calls: dict[str, list[tuple[str, int, bool]]] = {}
    comps: list[str] = []
    entry: str | None = None
    current = "<module>"
    for line in hlo_text.splitlines():
        cm = _COMP_RE.match(line)
        if cm:
            current = cm.group(2)
            comps.append(current)
            if cm.group(1):
                entry = current
            continue
        parsed = _parse_instruction(line)
        if parsed is None:
            continue
        name, shape, opcode, operands = parsed
        shapes[name] = shape
        if opcode in _COUNTED:
            found.append((current, parsed, line))
        edges = calls.setdefault(current, [])
        for attr, callee in _CALLEE_RE.findall(line):
            weight, known = 1, True
            if opcode == "while" and attr in ("body", "condition"):
                tm = _TRIP_RE.search(line)
                known = tm is not None
                weight = int(tm.group(1)) + (attr == "condition") if known else 1
            edges.append((callee, weight, known))
        bm = _BRANCHES_RE.search(line)
        if bm:
            for callee in bm.group(1).split(","):
                edges.append((callee.strip().lstrip("%"), 1, True))

    mult, exact = _multipliers(calls, entry, comps)
    ops = []
    for comp, (name, shape, opcode, operands), line in found:
        if comp not in mult:  # not reachable from ENTRY
            continue
        kind = _COUNTED[opcode]
        res = shape_bytes(shape)
        opnd = _operand_bytes(operands, shapes)
        if opcode == "all-gather-start":
            full = max(opnd, res - opnd)  # result tuple is (operands, gathered results)
        elif kind in ("all-reduce", "collective-permute"):
            full = opnd
        else:  # all-gather, reduce-scatter, all-to-all: the larger side is the unsharded tensor
            full = max(opnd, res)
        ops.append(
            {
                "name": name,
                "kind": kind,
                "opcode": opcode,
                "computation": comp,
                "bytes": full,
                "multiplier": mult[comp],
                "trip_count_known": exact[comp],
                "replica_groups": replica_groups(line),
            }
        )
    return ops


def _mesh_groups(mesh_text: str, axes_text: str) -> list[list[int]]:
    """Device groups of a collective over the named axes of a mesh (device ids row-major over the mesh)."""
    sizes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'\s*=\s*(\d+)", mesh_text)]
    axes = re.findall(r"'([^']+)'", axes_text)
    names = [name for name, _ in sizes]
    ids = np.arange(int(np.prod([size for _, size in sizes]))).reshape([size for _, size in sizes])
    others = [names.index(a) for a in names if a not in axes]
    ids = ids.transpose(others + [names.index(a) for a in axes])
    return ids.reshape(-1, int(np.prod([dict(sizes)[a] for a in axes]))).tolist()


def replica_groups(line: str) -> list[list[int]]:
    """The device groups of a collective (`replica_groups={{0,2},{1,3}}`, the iota form `[2,2]<=[4]`, or the
    named-axes form `mesh['data'=2,'model'=2] {'data'}`); empty when the line has none."""
    m = _GROUPS_RE.search(line)
    if m is None:
        named = _MESH_GROUPS_RE.search(line)
        if named is not None:
            return _mesh_groups(named.group(1), named.group(2))
        iota = _IOTA_GROUPS_RE.search(line)
        if iota is None:
            return []
        shape = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    return [[int(d) for d in g.split(",") if d.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]


def collective_bytes(compiled: Any) -> dict[str, int]:
    """Full-tensor bytes per collective kind (all of ``KINDS``, zeros included).

    ``compiled`` is a ``jax.stages.Compiled`` (anything with ``as_text()``) or HLO text.
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    out = {k: 0 for k in KINDS}
    for op in collective_ops(text):
        out[op["kind"]] += op["bytes"] * op["multiplier"]
    return out


def wire_volume(bytes_by_kind: dict[str, int], param_bytes: int) -> float:
    """Collective traffic per device in units of the parameter bytes.

    ``sum(WIRE_WEIGHTS[kind] * bytes) / param_bytes``: all-reduce counts 2x, all-gather and
    reduce-scatter 1x of their full tensor. Plain data parallelism (one all-reduce of the
    gradient) is ~2.0; ZeRO-1 done as reduce-scatter + all-gather is also ~2.0, and
    all-reduce + all-gather is ~3.0. (The ring factor (N-1)/N is ignored.)
    """
    total = sum(WIRE_WEIGHTS[k] * b for k, b in bytes_by_kind.items() if k in WIRE_WEIGHTS)
    return float(total) / float(param_bytes)


def _call_graph(hlo_text: str) -> tuple[dict[str, set[str]], list[tuple[str, list[str]]]]:
    """Computation -> the computations it calls; and every conditional as (its computation, its branches)."""
    calls: dict[str, set[str]] = {}
    conds: list[tuple[str, list[str]]] = []
    current = "<module>"
    for line in hlo_text.splitlines():
        cm = _COMP_RE.match(line)
        if cm:
            current = cm.group(2)
            continue
        parsed = _parse_instruction(line)
        if parsed is None:
            continue
        callees = [c for _, c in _CALLEE_RE.findall(line)]
        bm = _BRANCHES_RE.search(line)
        branches = [c.strip().lstrip("%") for c in bm.group(1).split(",")] if bm else []
        if parsed[2] == "conditional":
            tf = dict(_CALLEE_RE.findall(line))
            branches = branches or [tf[k] for k in ("true_computation", "false_computation") if k in tf]
            conds.append((current, branches))
        calls.setdefault(current, set()).update(callees + branches)
    return calls, conds


def _branches(hlo_text: str) -> tuple[list[dict[str, Any]], list[tuple[str, list[set[str]]]], set[str]]:
    """The module's collectives; per conditional, its computation and the computations each branch reaches; and
    every computation some branch reaches."""
    calls, conds = _call_graph(hlo_text)

    def reach(start: str) -> set[str]:
        seen, stack = {start}, [start]
        while stack:
            for c in calls.get(stack.pop(), ()):
                if c not in seen:
                    seen.add(c)
                    stack.append(c)
        return seen

    branch_sets = [(comp, [reach(b) for b in branches]) for comp, branches in conds]
    in_branch = set().union(*[s for _, sets in branch_sets for s in sets]) if branch_sets else set()
    return collective_ops(hlo_text), branch_sets, in_branch


def branch_collectives(hlo_text: str, weights: dict[str, float] | None = None) -> dict[str, Any]:
    """Wire bytes per execution path of a module whose collectives sit in `conditional` branches.

    `collective_bytes` counts every branch of a conditional (an upper bound); a step that branches on its
    position in an accumulation cycle executes one branch. Returns ``{"outside": bytes, "branches": [[bytes per
    branch] per conditional with collectives in a branch], "kinds": [[{kind: count} per branch] ...]}``, bytes
    weighted by `weights` (default `WIRE_WEIGHTS`); ``outside`` counts the collectives in no branch. Nested
    conditionals are attributed to the outermost branch that reaches them.
    """
    weights = WIRE_WEIGHTS if weights is None else weights
    ops, branch_sets, in_branch = _branches(hlo_text)
    outside = sum(op["bytes"] * op["multiplier"] * weights[op["kind"]] for op in ops
                  if op["computation"] not in in_branch)
    result: dict[str, Any] = {"outside": outside, "branches": [], "kinds": []}
    for comp, sets in branch_sets:
        if comp in in_branch:
            continue  # nested: counted within the outer branch
        per, kinds = [], []
        for s in sets:
            mine = [op for op in ops if op["computation"] in s]
            per.append(sum(op["bytes"] * weights[op["kind"]] for op in mine))
            kinds.append({k: sum(op["kind"] == k for op in mine) for k in KINDS if any(op["kind"] == k for op in mine)})
        if any(per):
            result["branches"].append(per)
            result["kinds"].append(kinds)
    return result


def heaviest_path(hlo_text: str) -> list[dict[str, Any]]:
    """The collectives of one execution: those in no `conditional` branch, and of each outermost conditional the
    branch that moves the most bytes (`collective_ops` counts every branch)."""
    ops, branch_sets, in_branch = _branches(hlo_text)
    out = [op for op in ops if op["computation"] not in in_branch]
    for comp, sets in branch_sets:
        if comp not in in_branch:
            per = [[op for op in ops if op["computation"] in s] for s in sets]
            out += max(per, key=lambda mine: sum(op["bytes"] * op["multiplier"] for op in mine))
    return out


# ------------------------------------------------------------------ memory-kind transfers (offload)

_PLACEMENT_RE = re.compile(
    r"custom_call @annotate_device_placement\((?P<arg>[^)]*)\)[^\n]*?_xla_buffer_placement = \"(?P<kind>\w+)\""
    r"[^\n]*?:\s*\((?P<types>[^)]*)\)\s*->")
_TENSOR_RE = re.compile(r"tensor<(?P<dims>(?:\d+x)*)(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)>")
_MLIR_DTYPES = {"f64": "f64", "f32": "f32", "bf16": "bf16", "f16": "f16", "i64": "s64", "i32": "s32",
                "i16": "s16", "i8": "s8", "ui64": "u64", "ui32": "u32", "ui16": "u16", "ui8": "u8", "i1": "pred"}


def tensor_bytes(tensor_type: str) -> int:
    """Bytes of one StableHLO `tensor<...>` type (`tensor<3x4xf32>` is 48)."""
    m = _TENSOR_RE.search(tensor_type)
    if m is None:
        raise ValueError(f"not a tensor type: {tensor_type!r}")
    dims = [int(d) for d in m.group("dims").split("x") if d]
    dtype = _MLIR_DTYPES.get(m.group("dtype"), m.group("dtype"))
    return (int(np.prod(dims)) * _dtype_bits(dtype) + 7) // 8 if dims else (_dtype_bits(dtype) + 7) // 8


def placement_transfers(stablehlo_text: str) -> list[dict[str, Any]]:
    """Every memory-kind move in a lowered StableHLO module, in program order: `{"to", "bytes", "in_shard_map"}`.

    JAX lowers `jax.device_put(x, jax.memory.Space.Host / Device)` inside `jit` on GPU and TPU to a
    `custom_call @annotate_device_placement` whose `_xla_buffer_placement` names the destination (`"pinned_host"`
    or `"device"`); XLA turns each into a host<->device copy (or nothing, where the value is already there). On
    CPU JAX emits none (host and device memory are one RAM), so lower with
    `jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))` to see what a GPU runs. Moves inside a
    `shard_map` body (`in_shard_map`) have per-device shapes; outside it, `jit` annotates the memory kinds of its
    results with global shapes.
    """
    out = []
    body_indent = None
    for line in stablehlo_text.splitlines():
        indent = len(line) - len(line.lstrip())
        if body_indent is not None and indent <= body_indent and line.lstrip().startswith("}"):
            body_indent = None
        if "sdy.manual_computation(" in line or "shard_map" in line and "func.func" in line:
            body_indent = indent
            continue
        m = _PLACEMENT_RE.search(line)
        if m:
            out.append({"to": m.group("kind"), "bytes": tensor_bytes(m.group("types")),
                        "in_shard_map": body_indent is not None})
    return out


def host_entry_buffers(hlo_text: str) -> dict[str, list[int]]:
    """Bytes of the entry computation's parameters and results that live in host memory (layout `S(5)`).

    XLA marks an array in `pinned_host` memory with memory space 5 in its layout (`f32[8]{0:S(5)}`); the entry
    computation layout of a compiled module (`compiled.as_text()`) lists every parameter and result.
    """
    start = hlo_text.find("entry_computation_layout={")
    if start < 0:
        raise ValueError("no entry_computation_layout in this HLO text")
    start += len("entry_computation_layout={")
    depth, end = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(hlo_text[end], 0)
        end += 1
    layout = hlo_text[start:end - 1]
    close = _balanced(layout, 0)
    params, results = layout[1:close - 1], layout[close + 2:]
    if results.startswith("("):
        results = results[1:-1]

    def host(text: str) -> list[int]:
        return [shape_bytes(part) for part in _split_top(text) if ":S(5)" in part]

    return {"parameters": host(params), "results": host(results)}


_BOOKKEEPING = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "partition-id",
                          "replica-id", "after-all", "opt-barrier"})


def entry_traffic(hlo_text: str) -> dict[str, dict[str, int]]:
    """What the top-level instructions of the entry computation move, by opcode (a fusion by its kind,
    `fusion:kLoop`): `{"count", "written", "read"}`, the bytes of their results and of their operands.

    Each top-level instruction is one kernel (or one collective) that reads its operands from memory and writes
    its result; instructions that only rename a buffer (parameters, tuples, bitcasts) are left out. Two steps
    that compute the same thing differ here by the copies and passes one of them adds.
    """
    shapes: dict[str, str] = {}
    out: dict[str, dict[str, int]] = {}
    in_entry, seen = False, False
    for line in hlo_text.splitlines():
        cm = _COMP_RE.match(line)
        if cm:
            in_entry = bool(cm.group(1))
            seen |= in_entry
            continue
        parsed = _parse_instruction(line) if in_entry else None
        if parsed is None:
            continue
        name, shape, opcode, operands = parsed
        shapes[name] = shape
        if opcode in _BOOKKEEPING:
            continue
        if opcode == "fusion":
            kind = re.search(r"\bkind=(\w+)", line)
            opcode = f"fusion:{kind.group(1) if kind else '?'}"
        row = out.setdefault(opcode, {"count": 0, "written": 0, "read": 0})
        row["count"] += 1
        row["written"] += shape_bytes(shape)
        row["read"] += _operand_bytes(operands, shapes)
    if not seen:
        raise ValueError("no ENTRY computation in this HLO text")
    return out
