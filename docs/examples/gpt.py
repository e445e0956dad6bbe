"""A GPT-style decoder's parameters as a Flax NNX model, for `python -m zero_optax.plan` (no forward pass).

Attention and MLP projections are annotated for tensor parallelism over a mesh axis `model` (Megatron style:
column-parallel in, row-parallel out), so a mesh with a `model` axis shards them; `gpt_70b` is a Llama-2-70B-sized
configuration (80 layers, width 8192, grouped-query attention with 8 key/value heads, MLP 28672, vocabulary 32000).

    python -m zero_optax.plan --params-from docs/examples/gpt.py:gpt_70b --mesh data=64,model=8 \\
        --axis-name data --optimizer adamw --master-dtype float32
"""

import jax.numpy as jnp
from flax import nnx

COLUMN, ROW = (None, "model"), ("model", None)


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, spec, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.with_partitioning(nnx.initializers.normal(0.02), spec)(
            rngs.params(), (d_in, d_out), dtype))


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, mlp: int, dtype, rngs: nnx.Rngs):
        kv = width // heads * kv_heads
        self.attention_norm = nnx.RMSNorm(width, param_dtype=dtype, rngs=rngs)
        self.q = Linear(width, width, COLUMN, dtype, rngs)
        self.k = Linear(width, kv, COLUMN, dtype, rngs)
        self.v = Linear(width, kv, COLUMN, dtype, rngs)
        self.o = Linear(width, width, ROW, dtype, rngs)
        self.mlp_norm = nnx.RMSNorm(width, param_dtype=dtype, rngs=rngs)
        self.gate = Linear(width, mlp, COLUMN, dtype, rngs)
        self.up = Linear(width, mlp, COLUMN, dtype, rngs)
        self.down = Linear(mlp, width, ROW, dtype, rngs)


class GPT(nnx.Module):
    def __init__(self, layers: int, width: int, heads: int, kv_heads: int, mlp: int, vocab: int,
                 dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = Linear(vocab, width, ROW, dtype, rngs)
        self.blocks = nnx.List([Block(width, heads, kv_heads, mlp, dtype, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(width, param_dtype=dtype, rngs=rngs)
        self.head = Linear(width, vocab, COLUMN, dtype, rngs)


def gpt_70b() -> GPT:
    """About 69 billion parameters in bfloat16 (Llama-2-70B's shapes)."""
    return GPT(layers=80, width=8192, heads=64, kv_heads=8, mlp=28672, vocab=32000)


def gpt_small() -> GPT:
    """A 2-layer toy of the same structure, for tests."""
    return GPT(layers=2, width=64, heads=4, kv_heads=2, mlp=128, vocab=96)
