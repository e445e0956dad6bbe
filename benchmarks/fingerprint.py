"""Fingerprints of zero1's compiled steps, to prove a refactoring changed no program: `python -m
benchmarks.fingerprint OUT.json` in each checkout, then `python -m benchmarks.fingerprint --compare OLD.json NEW.json`.

For each configuration (AdamW and the Muon recipe; flat, leaf, auto, mesh-bound, Flax; master copies, int8
collectives, accumulation, offload) on a GPT-like tree with leaves that do not divide 8 and a scalar, 8 simulated
CPU devices: the sha256 of the optimized HLO with its source locations stripped, the collective bytes, XLA's
`memory_analysis()`, the state bytes per device, and the sha256 of the parameters and state after two steps.
Equal fingerprints mean the same compiled program and the same bits.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import argparse
import hashlib
import json
import re
import sys
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

import zero_optax as zo
from benchmarks import variants
from benchmarks.hlo import collective_bytes
from benchmarks.model import per_device_grads
from tests._models import gpt_params, muon_recipe

_LOCATIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_MEMORY = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")


def program_text(compiled: Any) -> str:
    """The optimized HLO without metadata and source-location tables (which name the checkout's files)."""
    blocks = [b for b in compiled.as_text().split("\n\n") if not b.startswith(_LOCATIONS)]
    text = re.sub(r",? ?metadata=\{[^}]*\}", "", "\n\n".join(blocks))
    return re.sub(r",? ?stack_frame_id=\d+", "", text)


def _digest(tree: Any) -> str:
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()[:16]


def fingerprint(built: variants.Built, params: Any, grads: Any) -> dict[str, Any]:
    """One configuration's fingerprint, from its compiled step and two steps run."""
    p = jax.device_put(jax.tree.map(np.array, params), built.param_sharding)
    g = jax.device_put(jax.tree.map(np.array, grads), built.grad_sharding)
    state = built.init(p)
    state_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state)
                      if hasattr(x, "addressable_shards"))
    compiled = built.step.lower(p, g, state).compile()
    memory = compiled.memory_analysis()
    for _ in range(2):
        p, state = built.step(p, g, state)
    return {"hlo": hashlib.sha256(program_text(compiled).encode()).hexdigest()[:16],
            "collectives": collective_bytes(compiled),
            "memory": None if memory is None else {k: int(getattr(memory, k)) for k in _MEMORY},
            "state_bytes": int(state_bytes), "params": _digest(p), "state": _digest(state)}


def configurations() -> dict[str, tuple[variants.Built, Any, Any]]:
    """Every configuration fingerprinted: name -> (the built variant, its parameters, per-device gradients)."""
    mesh = variants.make_mesh(8)
    params = dict(gpt_params(101, 20, 2), scale=jnp.full((), 0.5, jnp.float32))
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    f32_grads, bf16_grads = per_device_grads(params, mesh), per_device_grads(bf16, mesh)
    out = {}
    for name, tx in (("adamw", optax.adamw(1e-3, weight_decay=0.1)), ("muon", muon_recipe())):
        for v in variants.VARIANTS + variants.FLAX_VARIANTS:
            if v.zero1 and (name == "adamw" or v.name in ("zero1_leaf", "zero1_auto")):
                out[f"{name}-{v.name}"] = (v.build(tx, mesh, params), params, f32_grads)
    options = {
        "master_bf16": dict(partition="flat", master_dtype=jnp.float32),
        "quantize": dict(partition="flat", master_dtype=jnp.float32,
                         quantize=zo.Quantize(params="int8", grads="int8", block_size=256)),
        "accumulate": dict(partition="flat", accumulate_steps=2),
        "offload": dict(partition="flat", offload=True),
        "leaf_master": dict(partition="leaf", master_dtype=jnp.float32),
        "auto_accumulate": dict(partition="auto", accumulate_steps=2),
    }
    for name, kwargs in options.items():
        tx = muon_recipe() if kwargs["partition"] == "auto" else optax.adamw(1e-3)
        p, g = (bf16, bf16_grads) if "master_dtype" in kwargs else (params, f32_grads)
        out[f"x-{name}"] = (variants._zero1_builder(**kwargs)(tx, mesh, p), p, g)
    return out


def compare(old: dict, new: dict) -> list[str]:
    """The configurations whose fingerprints differ, each with the fields that do."""
    return [f"{name}: {', '.join(k for k in old[name] if old[name][k] != new.get(name, {}).get(k))}"
            for name in old if old[name] != new.get(name)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="where to write this checkout's fingerprints (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two fingerprint files")
    args = parser.parse_args(argv)
    if args.compare:
        old, new = (json.load(open(f)) for f in args.compare)
        differ = compare(old, new)
        print("\n".join(differ) or f"all {len(old)} configurations identical")
        return 1 if differ else 0
    prints = {}
    for name, (built, params, grads) in configurations().items():
        prints[name] = fingerprint(built, params, grads)
        print(name, prints[name], flush=True)
    with open(args.out, "w") as f:
        json.dump(prints, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
