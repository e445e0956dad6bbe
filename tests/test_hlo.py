"""Tests for the HLO accounting (`benchmarks.hlo`) the tests and benchmarks count collectives with."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.hlo import (
    collective_bytes,
    collective_ops,
    entry_traffic,
    replica_groups,
    shape_bytes,
    wire_volume,
)

N = 8


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) >= N
    return jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


def _put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def test_shape_bytes():
    assert shape_bytes("f32[16,4]{1,0}") == 256
    assert shape_bytes("bf16[3]{0}") == 6
    assert shape_bytes("s32[]") == 4
    assert shape_bytes("(f32[2]{0}, (bf16[4]{0}, u8[3]{0}))") == 8 + 8 + 3
    assert shape_bytes("pred[10]") == 10
    assert shape_bytes("f8e4m3fn[7]") == 7
    assert shape_bytes("f32[<=5]") == 20


def test_shard_map_collectives(mesh):
    def f(a, y, z, w, k):
        r1 = jax.lax.psum(a, "data")  # all-reduce, f32[8,4] local: 128 B
        r2 = jax.lax.psum(k, "data")  # all-reduce, s32[32] local: 128 B
        g = jax.lax.all_gather(y, "data", tiled=True)  # all-gather, full f32[64,4]: 1024 B
        # all-gather of bf16[128,2] (512 B); XLA:CPU upcasts 16-bit collectives to f32 (1024 B).
        gb = jax.lax.all_gather(w, "data", tiled=True)
        s = jax.lax.psum_scatter(z, "data", tiled=True)  # reduce-scatter, full f32[64,4]: 1024 B
        t = jax.lax.all_to_all(z, "data", 0, 0, tiled=True)  # all-to-all, f32[64,4]: 1024 B
        p = jax.lax.ppermute(y, "data", [(i, (i + 1) % N) for i in range(N)])  # 128 B
        return r1, r2, g, gb, s, t, p

    a = _put(mesh, jnp.ones((N * 8, 4)), P("data"))
    y = _put(mesh, jnp.ones((N * 8, 4)), P("data"))
    z = _put(mesh, jnp.ones((N * 64, 4)), P("data"))
    w = _put(mesh, jnp.ones((N * 16, 2), jnp.bfloat16), P("data"))
    k = _put(mesh, jnp.ones((N * 32,), jnp.int32), P("data"))
    out_specs = (P(), P(), P("data"), P("data"), P("data"), P("data"), P("data"))
    fn = jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=(P("data"),) * 5, out_specs=out_specs)
    )
    compiled = fn.lower(a, y, z, w, k).compile()
    got = collective_bytes(compiled)
    bf16_gather = N * 16 * 2 * (4 if jax.default_backend() == "cpu" else 2)
    assert got == {
        "all-reduce": 128 + 128,
        "all-gather": 1024 + bf16_gather,
        "reduce-scatter": 1024,
        "all-to-all": 1024,
        "collective-permute": 128,
    }
    # Same answer from the raw text, and the values are actually computed.
    assert collective_bytes(compiled.as_text()) == got
    r1, r2, *_ = fn(a, y, z, w, k)
    assert float(r1[0, 0]) == N and int(r2[0]) == N


def test_data_parallel_wire_volume_is_two(mesh):
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
    pbytes = 64 * 32 * 4 + 32 * 4
    grads = jax.tree_util.tree_map(lambda x: _put(mesh, jnp.ones((N, *x.shape)), P("data")), params)
    params = jax.tree_util.tree_map(lambda x: _put(mesh, x, P()), params)

    def step(p, g):
        g = jax.tree_util.tree_map(lambda x: jax.lax.pmean(x[0], "data"), g)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    got = collective_bytes(fn.lower(params, grads).compile())
    assert got["all-reduce"] == pbytes
    assert wire_volume(got, pbytes) == pytest.approx(2.0)


def test_while_trip_count_and_conditional(mesh):
    def f(x):
        x = jax.lax.fori_loop(0, 37, lambda i, x: x + jnp.sin(jax.lax.psum(x, "data")), x)
        return jax.lax.cond(x.sum() > 0, lambda x: x + jax.lax.psum(x, "data"), lambda x: x, x)

    x = _put(mesh, jnp.ones((N * 8, 4)), P("data"))
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    text = fn.lower(x).compile().as_text()
    got = collective_bytes(text)
    # 37 loop iterations of a 128 B all-reduce (unless XLA unrolled it: same total) + one branch.
    assert got["all-reduce"] == 38 * 128
    assert all(op["trip_count_known"] for op in collective_ops(text))


ASYNC_HLO = """
HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%async_computation (param_0: f32[64]) -> f32[8] {
  %param_0 = f32[64]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[8]{0} reduce-scatter(f32[64]{0} %param_0), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[8,4], q: bf16[16], r: f32[64], s: f32[10]) -> f32[64,4] {
  %p = f32[8,4]{1,0} parameter(0)
  %q = bf16[16]{0} parameter(1)
  %r = f32[64]{0} parameter(2)
  %s = f32[10]{0} parameter(3)
  %all-gather-start = (f32[8,4]{1,0}, f32[64,4]{1,0}) all-gather-start(f32[8,4]{1,0} %p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %all-gather-done = f32[64,4]{1,0} all-gather-done((f32[8,4]{1,0}, f32[64,4]{1,0}) %all-gather-start)
  %all-reduce-start = bf16[16]{0} all-reduce-start(bf16[16]{0} %q), channel_id=2, to_apply=%add
  %all-reduce-done = bf16[16]{0} all-reduce-done(bf16[16]{0} %all-reduce-start)
  %reduce-scatter-start = ((f32[64]{0}), f32[8]{0}) async-start(f32[64]{0} %r), calls=%async_computation
  %reduce-scatter-done = f32[8]{0} async-done(((f32[64]{0}), f32[8]{0}) %reduce-scatter-start)
  %collective-permute-start = (f32[10]{0}, f32[10]{0}, u32[], u32[]) collective-permute-start(%s), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[10]{0} collective-permute-done(%collective-permute-start)
  %tup = (f32[10]{0}, bf16[16]{0}) all-reduce(%collective-permute-done, %all-reduce-done), channel_id=5, to_apply=%add
  ROOT %out = f32[64,4]{1,0} copy(%all-gather-done)
}
"""


def test_async_and_tuple_forms():
    got = collective_bytes(ASYNC_HLO)
    assert got == {
        "all-reduce": 32 + (40 + 32),
        "all-gather": 1024,
        "reduce-scatter": 256,
        "all-to-all": 0,
        "collective-permute": 40,
    }
    opcodes = sorted(op["opcode"] for op in collective_ops(ASYNC_HLO))
    assert opcodes == [
        "all-gather-start",
        "all-reduce",
        "all-reduce-start",
        "collective-permute-start",
        "reduce-scatter",
    ]


def test_wire_volume_weights():
    b = {"all-reduce": 100, "all-gather": 100, "reduce-scatter": 0}
    assert wire_volume(b, 100) == pytest.approx(3.0)
    assert wire_volume({"reduce-scatter": 50, "all-gather": 50}, 50) == pytest.approx(2.0)


def test_replica_groups_in_every_printed_form():
    """Explicit lists (JAX 0.10), the iota form, and the named-axes form of the XLA that JAX 0.12 ships."""
    by_data = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert replica_groups("x, replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}") == by_data
    assert replica_groups("x, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}") == by_data
    assert replica_groups("x, replica_groups=mesh['data'=4,'model'=2] {'data'}, use_global_device_ids=true") == by_data
    assert replica_groups("x, replica_groups=mesh['data'=4,'model'=2] {'model'}, x") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replica_groups("x, replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}, x") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert replica_groups("x, dimensions={0}") == []


def test_placement_transfers_and_host_entry_buffers():
    from benchmarks.hlo import host_entry_buffers, placement_transfers

    stablehlo = """
  func.func public @main(%arg0: tensor<8xf32>) -> (tensor<8xf32>) {
    %0 = sdy.manual_computation(%arg0) in_shardings=[] out_shardings=[] manual_axes={"data"} (%arg1: tensor<2xf32>) {
      %1 = stablehlo.custom_call @annotate_device_placement(%arg1) {has_side_effect = true, mhlo.frontend_attributes = {_xla_buffer_placement = "device"}} : (tensor<2xf32>) -> tensor<2xf32>
      %2 = stablehlo.custom_call @annotate_device_placement(%1) {has_side_effect = true, mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}} : (tensor<2x3xbf16>) -> tensor<2x3xbf16>
      sdy.return %2 : tensor<2xf32>
    } : (tensor<8xf32>) -> tensor<8xf32>
    %3 = stablehlo.custom_call @annotate_device_placement(%0) {has_side_effect = true, mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}} : (tensor<8xi32>) -> tensor<8xi32>
    return %3 : tensor<8xf32>
  }
"""
    assert placement_transfers(stablehlo) == [
        {"to": "device", "bytes": 8, "in_shard_map": True},
        {"to": "pinned_host", "bytes": 12, "in_shard_map": True},
        {"to": "pinned_host", "bytes": 32, "in_shard_map": False}]
    hlo = ("HloModule m, entry_computation_layout={(f32[2]{0:S(5)}, f32[4,3]{1,0}, s32[7]{0:S(5)})"
           "->(f32[2]{0:S(5)}, bf16[6]{0})}, num_partitions=4\n")
    assert host_entry_buffers(hlo) == {"parameters": [8, 28], "results": [8]}
    assert host_entry_buffers("HloModule m, entry_computation_layout={(f32[2]{0})->f32[2]{0:S(5)}}\n") == {
        "parameters": [], "results": [8]}


def test_entry_traffic_counts_what_each_kernel_writes_and_reads():
    """A step that adds a full-size pass (a copy of its result) shows it as one more kernel writing those bytes."""
    x = jnp.ones((16, 16))
    plain = entry_traffic(jax.jit(lambda x: x * 2).lower(x).compile().as_text())
    assert plain == {"fusion:kLoop": {"count": 1, "written": 1024, "read": 1024}}
    donated = jax.jit(lambda x: (x * 2, x), donate_argnums=0).lower(x).compile().as_text()
    total = entry_traffic(donated)
    assert sum(r["written"] for r in total.values()) == 2 * 1024  # x is written back: its buffer went to x * 2
    with pytest.raises(ValueError, match="ENTRY"):
        entry_traffic("HloModule m")
