"""Tests of libra_jax.ops.packing: a bucket's members grouped by dtype, and packed into one
buffer and split back where the call takes one buffer (XLA's collective standing in)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from libra_jax import ops
from libra_jax.ops import packing

from conftest import assert_bitwise, mesh_of, shard


def test_packed_layout_groups_by_dtype_in_first_appearance_order_and_pads():
    avals = [jax.core.ShapedArray((2, 3), np.float32), jax.core.ShapedArray((5,), jnp.bfloat16),
             jax.core.ShapedArray((1,), np.float32), jax.core.ShapedArray((0,), np.float32)]
    layout = packing.packed_layout(avals)
    assert [(np.dtype(d), idx, n) for d, idx, n in layout] == [
        (np.dtype(np.float32), [0, 2, 3], 8),       # 7 floats, padded to 2 16-byte vectors
        (np.dtype(jnp.bfloat16), [1], 8)]           # 5 bf16, padded to one vector
    assert [n for _, _, n in packing.packed_layout(avals, align_bytes=1)] == [7, 5]
    assert [(a.shape, a.dtype) for a in packing.packed_avals(avals)] == [
        ((8,), np.float32), ((8,), jnp.bfloat16)]


def test_a_bucket_whose_call_takes_one_buffer_is_packed_and_split_back_bitwise(monkeypatch):
    """Where the call a bucket is lowered to takes one buffer (here `lower_members` made to say
    so of the CPU engine; XLA's collective standing in for libra's is the case in use), a
    bucket of two dtypes is one packed call per dtype, split back: each result bitwise its own
    psum's."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(5)
    a = shard(rng.standard_normal((8, 5)).astype(np.float32), mesh, P("x"))
    b = shard(rng.standard_normal((8, 3)).astype(jnp.bfloat16), mesh, P("x"))
    c = shard(rng.standard_normal((16, 2)).astype(np.float32), mesh, P("x"))
    monkeypatch.setattr("libra_jax.ops.lowering.lower_members",
                        lambda ctx, xs, call, platform: None)

    def body(a, b, c):
        return tuple(ops.libra_bucket_p.bind(a, b, c, collective="psum", axes=("x",), blocks=2,
                                             invariant=False))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=(P("x"),) * 3,
                              check_vma=False))
    text = f.lower(a, b, c).as_text()
    assert text.count("stablehlo.concatenate") == 1  # the two f32 members; bf16 is one
    g = jax.jit(jax.shard_map(lambda *v: tuple(jax.lax.psum(x, "x") for x in v), mesh=mesh,
                              in_specs=(P("x"),) * 3, out_specs=(P("x"),) * 3, check_vma=False))
    jax.tree.map(assert_bitwise, f(a, b, c), g(a, b, c))
