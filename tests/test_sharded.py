"""Tests of libra_jax.ops.sharded and its drop-ins (`libra_jax.psum_scatter`, `all_gather`)
against `jax.lax`'s, bit for bit: dtypes, shapes, dimensions, meshes, transforms, errors,
delegation, and a participant that never arrives."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import (assert_bitwise, cpu_start_done_pairs, lower_for, mesh_of, run_abandoned_starts,
                      shard)
from jax.sharding import PartitionSpec as P
from test_allreduce import _NAN_BITS, DTYPES, random_array

import libra_jax
from libra_jax import _libra_ffi
from libra_jax.dropins import MAX_BLOCKS, default_blocks
from libra_jax.config import xla_flags

pytestmark = pytest.mark.usefixtures("jax_8")

SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 2.0 ** -24, 3e38, -3e38]


def with_specials(rng, x, fraction=0.2):
    if not np.issubdtype(x.dtype, np.floating) and x.dtype != jnp.bfloat16:
        return x
    mask = rng.random(x.shape) < fraction
    with np.errstate(over="ignore"):  # 3e38 is inf in 16 bits: a special too
        return np.where(mask, rng.choice(SPECIALS, size=x.shape), x).astype(x.dtype)


def both(mesh, ours, theirs, spec_in, spec_out, check_vma=True):
    """A jitted shard_map returning (ours(x), theirs(x))."""
    return jax.jit(jax.shard_map(lambda x: (ours(x), theirs(x)), mesh=mesh, in_specs=spec_in,
                                 out_specs=(spec_out, spec_out), check_vma=check_vma))


def lowered_targets(f, *args):
    return set(re.findall(r"custom_call @(\w+)", f.lower(*args).as_text()))


# --- Bits ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_psum_scatter_bitwise(dtype, tiled, dim):
    """Every scatter dimension, tiled or not, odd sizes, specials: jax.lax's bits (the
    rank-order sum from +0, as XLA:CPU's reduce-scatter is the slice of its psum)."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(1)
    per = 8 * 3 if tiled else 8  # the scattered dimension, per device
    shape = {0: (per, 5, 3), 1: (5, per, 3), -1: (5, 3, per)}[dim]
    x = with_specials(rng, random_array(rng, (8 * shape[0], *shape[1:]), dtype))
    f = both(mesh, lambda v: libra_jax.psum_scatter(v, "x", scatter_dimension=dim, tiled=tiled),
             # jax 0.10.2 lowers a negative dimension as is, which XLA refuses; newer JAX
             # (and libra) count it from the end.
             lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=dim % 3, tiled=tiled),
             P("x"), P("x"), check_vma=False)
    with jax.enable_x64(True):
        xs = shard(x, mesh, P("x"))
        ours, theirs = f(xs)
        assert "libra_reduce_scatter_cpu" in lowered_targets(f, xs)
    assert_bitwise(ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_xla_reduce_scatter_is_the_slice_of_its_psum(dtype):
    """The premise of the reduce-scatter's bits, pinned on every CI leg (the newest JAX is the
    canary): XLA:CPU's psum_scatter is the matching slice of its psum (the rank-order sum from
    +0), NaN, inf and -0 included, tiled or not, so the engine's summation of a rank's range
    matches it."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(13)
    x = with_specials(rng, random_array(rng, (8 * 16, 3), dtype), 0.3)
    def body(v):
        full = jax.lax.psum(v, "x")
        i = jax.lax.axis_index("x")
        return (jax.lax.psum_scatter(v, "x", tiled=True),
                jax.lax.dynamic_slice_in_dim(full, i * 2, 2, axis=0),
                jax.lax.psum_scatter(v[:8], "x"), full[i][None])
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    with jax.enable_x64(True):
        tiled, sliced, untiled, row = f(shard(x, mesh, P("x")))
    assert_bitwise(tiled, sliced)
    assert_bitwise(untiled, np.asarray(row).reshape(untiled.shape))


GATHER_DTYPES = DTYPES + [np.bool_, np.int8, np.uint32, np.complex64, ml_dtypes.float8_e4m3fn]


@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_all_gather_bitwise_any_dtype(dtype, tiled, axis):
    """A copy: every dtype of whole bytes by its bytes (bool, int8, fp8, complex ...), NaN
    payloads kept."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, size=(8 * 2, 3, 5 * np.dtype(dtype).itemsize), dtype=np.uint8)
    x = raw.view(dtype) if dtype != np.bool_ else raw[..., :5] % 2 == 1
    if not tiled and axis == 2:
        axis = -1
    f = both(mesh, lambda v: libra_jax.all_gather(v, "x", axis=axis, tiled=tiled),
             lambda v: jax.lax.all_gather(v, "x", axis=axis, tiled=tiled), P("x"), P("x"),
             check_vma=False)
    with jax.enable_x64(True):
        xs = shard(x, mesh, P("x"))
        ours, theirs = f(xs)
        assert "libra_all_gather_cpu" in lowered_targets(f, xs)
    assert_bitwise(ours, theirs)


@pytest.mark.parametrize("tiled", [True, False])
def test_a_bucket_of_all_gathers_is_one_call_bitwise_each_gather(tiled):
    """`libra_bucket` of the all-gather (`optimize`'s group of forward gathers): members
    gathered along different dimensions, invariant or not, with NaN payloads and bf16, one
    engine call per dtype over them as they are, each result bitwise its own
    `jax.lax.all_gather` and typed as it."""
    from libra_jax import ops
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(74)
    xs = [with_specials(rng, rng.standard_normal((8 * 2, 3, 4)).astype(np.float32)),
          with_specials(rng, rng.standard_normal((8 * 2, 8 * 3)).astype(np.float32)),
          rng.standard_normal((8 * 2, 5)).astype(jnp.bfloat16)]
    specs = (P("x"), P(None, "x"), P("x"))
    dims = (0, 1, 0) if tiled else (0, 0, 1)  # untiled: a new dimension there
    invariant = (False, True, False)

    def local(a, b, c):
        if not tiled:
            a, b, c = a[0], b[:, 0], c[0]
        ours = ops.libra_bucket_p.bind(a, b, c, collective="all_gather", axes=("x",),
                                       axis_size=8, tiled=tiled, dimension=dims,
                                       invariant=invariant, blocks=2)
        theirs = [jax.lax.all_gather(v, "x", axis=d, tiled=tiled, to="invarying" if inv
                                     else "varying")
                  for v, d, inv in zip((a, b, c), dims, invariant)]
        return (*ours, *theirs)
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("x"),
                              check_vma=False))
    args = [shard(x, mesh, s) for x, s in zip(xs, specs)]
    out = f(*args)
    for ours, theirs in zip(out[:3], out[3:]):
        assert_bitwise(ours, theirs)
    closed = jax.make_jaxpr(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("x"),
                                          check_vma=True))(*args)
    body = closed.jaxpr.eqns[0].params["jaxpr"]
    bucket = next(e for e in body.eqns if e.primitive is ops.libra_bucket_p)
    theirs = [e for e in body.eqns if "all_gather" in e.primitive.name]
    assert [v.aval for v in bucket.outvars] == [e.outvars[0].aval for e in theirs]
    text = f.lower(*args).compile().as_text()
    # One call for the two float32 members, one for the bf16 (one dtype a call).
    assert text.count('custom_call_target="libra_all_gather_cpu"') == 2


@pytest.mark.parametrize("axes", ["a", "b", ("a", "b"), ("b", "a")])
def test_2d_mesh_bitwise(axes):
    mesh = mesh_of((2, 4), ("a", "b"))
    rng = np.random.default_rng(3)
    x = random_array(rng, (8 * 8, 3), np.float32)
    def ours(v):
        return libra_jax.all_gather(libra_jax.psum_scatter(v, axes, tiled=True), axes,
                                    tiled=True)
    def theirs(v):
        return jax.lax.all_gather(jax.lax.psum_scatter(v, axes, tiled=True), axes, tiled=True)
    f = both(mesh, ours, theirs, P(("a", "b")), P(("a", "b")), check_vma=False)
    assert_bitwise(*f(shard(x, mesh, P(("a", "b")))))


def test_one_element_per_shard_and_size_one_axis():
    mesh = mesh_of((8, 1), ("x", "one"))
    x = np.arange(64, dtype=np.float32).reshape(64, 1) * 0.1
    f = both(mesh, lambda v: libra_jax.psum_scatter(v[:, 0], ("x", "one"), tiled=True),
             lambda v: jax.lax.psum_scatter(v[:, 0], ("x", "one"), tiled=True),
             P("x"), P("x"), check_vma=False)
    assert_bitwise(*f(shard(x, mesh, P("x"))))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("to", ["varying", "invarying"])
def test_types_match_jax_under_check_vma(check_vma, to):
    """The output types (shape, dtype, varying axes) are jax.lax's, also for an operand that
    is invariant (made varying first, as jax.lax <= 0.11 does; jax 0.12 refuses an invariant
    operand to to="invarying" under check_vma, calling it a bug of its own with check_vma=False
    as the workaround: there the operand made varying by hand is the reference)."""
    mesh = mesh_of((8,), ("x",))
    def body(v, w):
        got = (libra_jax.psum_scatter(v, "x", tiled=True), libra_jax.all_gather(v, "x", to=to),
               libra_jax.all_gather(w, "x", tiled=True, to=to))
        try:
            gathered_w = jax.lax.all_gather(w, "x", tiled=True, to=to)
        except ValueError as refusal:
            assert "must be applied to a device-varying" in str(refusal)
            assert check_vma and to == "invarying"
            gathered_w = jax.lax.all_gather(jax.lax.pcast(w, "x", to="varying"), "x",
                                            tiled=True, to=to)
        want = (jax.lax.psum_scatter(v, "x", tiled=True), jax.lax.all_gather(v, "x", to=to),
                gathered_w)
        assert [jax.typeof(a) for a in got] == [jax.typeof(b) for b in want]
        return got, want
    spec = P() if to == "invarying" and check_vma else P("x")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()),
                              out_specs=((P("x"), spec, spec),) * 2, check_vma=check_vma))
    x = shard(np.random.default_rng(4).standard_normal((64, 3)).astype(np.float32), mesh, P("x"))
    w = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
    got, want = f(x, w)
    assert_bitwise(got, want)


def test_inside_scan_cond_pmap_vmap_and_eager():
    mesh = mesh_of((8,), ("x",))
    x = shard(np.random.default_rng(6).standard_normal((8 * 16, 4)).astype(np.float32), mesh,
              P("x"))
    def program(scatter, gather):
        def body(v):
            def step(c, _):
                c = gather(scatter(c, "x", tiled=True), "x", tiled=True) * 0.125
                return c, c.sum()
            c, sums = jax.lax.scan(step, v, None, length=3)
            c = jax.lax.cond(c.sum() > 0, lambda u: scatter(u, "x", tiled=True),
                             lambda u: -scatter(u, "x", tiled=True), c)
            batched = jax.vmap(lambda r: gather(r, "x"))(c)  # vmap inside shard_map
            return c, sums, batched
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"),
                                     out_specs=(P("x"), P("x"), P("x"))))
    ours = program(libra_jax.psum_scatter, libra_jax.all_gather)
    assert {"libra_reduce_scatter_cpu", "libra_all_gather_cpu"} <= lowered_targets(ours, x)
    assert_bitwise(ours(x), program(jax.lax.psum_scatter, jax.lax.all_gather)(x))
    # pmap, and an eager (un-jitted) shard_map.
    y = np.random.default_rng(7).standard_normal((8, 8, 3)).astype(np.float32)
    def pm(scatter, gather):
        return jax.pmap(lambda v: (scatter(v, "i"), gather(v, "i", axis=1)), axis_name="i")(y)
    assert_bitwise(pm(libra_jax.psum_scatter, libra_jax.all_gather),
                   pm(jax.lax.psum_scatter, jax.lax.all_gather))
    eager = jax.shard_map(lambda v: libra_jax.psum_scatter(v, "x", tiled=True), mesh=mesh,
                          in_specs=P("x"), out_specs=P("x"))(x)
    assert_bitwise(eager, jax.jit(jax.shard_map(
        lambda v: jax.lax.psum_scatter(v, "x", tiled=True), mesh=mesh, in_specs=P("x"),
        out_specs=P("x")))(x))


def test_compositions_eqx_filter_jit_and_jit_with_statics():
    """The drop-ins under the wrappers people write: eqx.filter_jit (an Equinox module's
    array leaves sharded, its static fields not) and jax.jit with static arguments."""
    eqx = pytest.importorskip("equinox")
    mesh = mesh_of((8,), ("x",))

    class Layer(eqx.Module):
        w: jax.Array
        scale: float = eqx.field(static=True)

    layer = Layer(w=shard(np.random.default_rng(14).standard_normal((16, 4)).astype(
        np.float32), mesh, P("x")), scale=0.5)
    x = shard(np.ones((8 * 3, 4), np.float32), mesh, P("x"))

    def make(gather, scatter):
        def loss(w, xb, scale):
            full = gather(w, "x", tiled=True)  # FSDP: gathered for use
            return scale * jnp.sum(jnp.tanh(xb @ full.T) ** 2)

        def step(layer, xb):
            g = jax.shard_map(lambda w, b: jax.grad(loss)(w, b, layer.scale), mesh=mesh,
                              in_specs=(P("x"), P("x")), out_specs=P("x"))(layer.w, xb)
            return eqx.tree_at(lambda m: m.w, layer, layer.w - g)
        return eqx.filter_jit(step)

    ours, theirs = (make(libra_jax.all_gather, libra_jax.psum_scatter),
                    make(jax.lax.all_gather, jax.lax.psum_scatter))
    assert_bitwise(ours(layer, x).w, theirs(layer, x).w)

    def scaled(v, k, *, mode):
        out = libra_jax.psum_scatter(v * k, "x", tiled=True)
        return out if mode == "sum" else libra_jax.all_gather(out, "x", tiled=True)
    def reference(v, k, *, mode):
        out = jax.lax.psum_scatter(v * k, "x", tiled=True)
        return out if mode == "sum" else jax.lax.all_gather(out, "x", tiled=True)
    for mode in ("sum", "gather"):
        f = jax.jit(jax.shard_map(partial(scaled, mode=mode), mesh=mesh, in_specs=(P("x"), P()),
                                  out_specs=P("x")), static_argnums=1)
        want = jax.jit(jax.shard_map(partial(reference, mode=mode), mesh=mesh,
                                     in_specs=(P("x"), P()), out_specs=P("x")), static_argnums=1)
        y = shard(np.arange(64 * 4, dtype=np.float32).reshape(64, 4), mesh, P("x"))
        assert_bitwise(f(y, 3), want(y, 3))


@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_through_all_gather_is_libras_reduce_scatter(check_vma):
    """FSDP's pattern: parameters sharded, all-gathered for use; their gradient is the
    all-gather's transpose: libra's reduce-scatter, bitwise jax.lax's."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(8)
    w = shard(rng.standard_normal((8 * 3, 5)).astype(np.float32), mesh, P("x"))
    batch = shard(rng.standard_normal((8 * 4, 5)).astype(np.float32), mesh, P("x"))
    def make(gather):
        def loss(w, b):
            full = gather(w, "x", tiled=True)  # (24, 5) on every device
            return jnp.sum(jnp.tanh(b @ full.T) ** 2)
        return jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P("x"), P("x")),
                                     out_specs=P("x"), check_vma=check_vma))
    ours = make(libra_jax.all_gather)
    assert {"libra_all_gather_cpu", "libra_reduce_scatter_cpu"} <= lowered_targets(ours, w, batch)
    assert "reduce_scatter" not in ours.lower(w, batch).as_text().replace(
        "libra_reduce_scatter", "")
    assert_bitwise(ours(w, batch), make(jax.lax.all_gather)(w, batch))
    # And psum_scatter's transpose is libra's all-gather (jvp/vjp of a linear map).
    def vjp(scatter):
        def f(v):
            out, pull = jax.vjp(lambda u: scatter(u, "x", tiled=True), v)
            return pull(out * 2.0)[0]
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                     check_vma=check_vma))
    z = shard(rng.standard_normal((8 * 16, 2)).astype(np.float32), mesh, P("x"))
    assert "libra_all_gather_cpu" in lowered_targets(vjp(libra_jax.psum_scatter), z)
    assert_bitwise(vjp(libra_jax.psum_scatter)(z), vjp(jax.lax.psum_scatter)(z))


def test_invarying_gather_gradient_is_jax_slice():
    """to='invarying': the gradient is a slice of an invariant cotangent (JAX's rule); its
    all-reduce is the psum JAX puts before it."""
    mesh = mesh_of((8,), ("x",))
    w = shard(np.random.default_rng(9).standard_normal((16, 3)).astype(np.float32), mesh, P("x"))
    def make(gather):
        def loss(w):
            return jnp.sum(jnp.sin(gather(w, "x", tiled=True, to="invarying")) ** 2)
        return jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P("x"),
                                     out_specs=P("x")))
    assert_bitwise(make(libra_jax.all_gather)(w), make(jax.lax.all_gather)(w))


def test_property_bitwise_with_nan_inf_and_negative_zero():
    """Hypothesis over dtypes, shapes, dimensions, tiling, block counts and payloads of
    specials (NaN, inf, -0): both collectives bitwise jax.lax's. 25 derandomized examples."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    mesh = mesh_of((8,), ("x",))

    @settings(max_examples=25, derandomize=True, deadline=None)
    @given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 3),
           rest=st.lists(st.integers(1, 5), min_size=0, max_size=2), tiled=st.booleans(),
           blocks=st.one_of(st.none(), st.integers(1, MAX_BLOCKS)),
           special=st.floats(0, 0.6), seed=st.integers(0, 2**16))
    def check(dtype, rows, rest, tiled, blocks, special, seed):
        rng = np.random.default_rng(seed)
        lead = 8 * rows if tiled else 8
        rest = rest if tiled or rest else [2]  # an untiled scatter drops the lead dimension
        x = with_specials(rng, random_array(rng, (8 * lead, *rest), dtype), special)
        def ours(v):
            s = libra_jax.psum_scatter(v, "x", tiled=tiled, blocks=blocks)
            return s, libra_jax.all_gather(s, "x", tiled=tiled, blocks=blocks)
        def theirs(v):
            s = jax.lax.psum_scatter(v, "x", tiled=tiled)
            return s, jax.lax.all_gather(s, "x", tiled=tiled)
        f = both(mesh, ours, theirs, P("x"), (P("x"), P("x")), check_vma=False)
        got, want = f(shard(x, mesh, P("x")))
        assert_bitwise(got, want)

    with jax.enable_x64(True):
        check()


# --- Block counts, records ------------------------------------------------------------

def test_default_blocks_rule_and_block_counts_in_hlo():
    """blocks=None: the model's choice for the collective (its latency and traffic, the
    all-reduce's tables), chosen at lowering; an explicit count is in the HLO."""
    from libra_jax import collectives, model, planner
    derivation = model.derive("cpu-host", 8)
    for nbytes in (1 << 10, 1 << 20, 16 << 20, 64 << 20):
        for collective, kind in (("psum_scatter", "reduce-scatter"), ("all_gather", "all-gather")):
            key = planner.no_overlap_allocation(derivation.cost, nbytes,
                                                lambda k: derivation.launch_shape(k)[0],
                                                collectives.BY_KIND[kind])
            assert default_blocks(nbytes, 8, collective=collective) == key
    # A ring (h200) prices either half at half the all-reduce's bytes and steps: the
    # all-reduce's choice for half the buffer, where latency does not decide.
    assert default_blocks(256 << 20, 8, "h200", "psum_scatter") == default_blocks(128 << 20, 8, "h200")
    mesh = mesh_of((8,), ("x",))
    x = shard(np.zeros((8 * 8 * 4096, 16), np.float32), mesh, P("x"))  # 2 MiB per device
    f = jax.jit(jax.shard_map(lambda v: libra_jax.all_gather(
        libra_jax.psum_scatter(v, "x", tiled=True), "x", tiled=True, blocks=5), mesh=mesh,
        in_specs=P("x"), out_specs=P("x")))
    text = f.lower(x).as_text()
    rs_blocks = default_blocks(8 * 4096 * 16 * 4, 8, "cpu-host", "psum_scatter")
    assert re.search(rf"libra_reduce_scatter_cpu.*blocks = {rs_blocks} ", text)
    assert re.search(r"libra_all_gather_cpu.*blocks = 5 ", text)


def test_call_records_name_the_kind():
    mesh = mesh_of((8,), ("x",))
    x = shard(np.ones((64, 5), np.float32), mesh, P("x"))
    f = jax.jit(jax.shard_map(lambda v: libra_jax.all_gather(
        libra_jax.psum_scatter(v, "x", tiled=True), "x", tiled=True), mesh=mesh,
        in_specs=P("x"), out_specs=P("x")))
    f(x).block_until_ready()
    _libra_ffi.set_call_recording(64)
    try:
        np.testing.assert_array_equal(f(x), np.full((64, 5), 8.0, np.float32))
        records = _libra_ffi.take_call_records()
    finally:
        _libra_ffi.set_call_recording(0)
    kinds = {(r["collective"], r["bytes"], r["world"]) for r in records}
    assert kinds == {("reduce-scatter", 8 * 5 * 4, 8), ("all-gather", 8 * 5 * 4, 8)}, kinds


# --- Delegation, errors --------------------------------------------------------------

@pytest.fixture
def fresh_notices():
    saved = set(libra_jax.ops.base._warned)
    libra_jax.ops.base._warned.clear()
    yield
    libra_jax.ops.base._warned |= saved


@pytest.mark.usefixtures("fresh_notices")
@pytest.mark.parametrize("case", ["groups", "dtype", "reduced"])
def test_what_is_not_served_is_delegated_with_a_notice(case):
    mesh = mesh_of((8,), ("x",))
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    x = np.arange(64 * 4, dtype=np.int8 if case == "dtype" else np.float32).reshape(64, 4)
    ours, theirs, match = {
        "groups": (lambda v: libra_jax.psum_scatter(v, "x", axis_index_groups=groups, tiled=True),
                   lambda v: jax.lax.psum_scatter(v, "x", axis_index_groups=groups, tiled=True),
                   "axis_index_groups is not supported"),
        "dtype": (lambda v: libra_jax.psum_scatter(v, "x", tiled=True),
                  lambda v: jax.lax.psum_scatter(v, "x", tiled=True), "dtype int8"),
        "reduced": (lambda v: libra_jax.all_gather(v, "x", tiled=True, to="reduced"), None,
                    "to='reduced'"),
    }[case]
    if case == "groups":  # shard_map has no axis_index_groups: pmap has
        y = x.reshape(8, 8, 4)
        with pytest.warns(UserWarning, match=match):
            got = jax.pmap(lambda v: ours(v), axis_name="x")(y)
        assert_bitwise(got, jax.pmap(theirs, axis_name="x")(y))
        return
    if theirs is None:
        # JAX refuses to_='reduced' of a varying operand; libra passes it through. Whatever
        # JAX raises (its type is JAX's to choose, across the CI's JAX versions).
        with pytest.warns(UserWarning, match=match), pytest.raises(Exception):  # noqa: B017
            jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
                shard(x, mesh, P("x")))
        return
    f = both(mesh, ours, theirs, P("x"), P("x"), check_vma=False)
    with pytest.warns(UserWarning, match=match):
        got, want = f(shard(x, mesh, P("x")))
    assert_bitwise(got, want)
    with pytest.raises(TypeError, match="blocks=3 cannot be honoured"):
        jax.jit(jax.shard_map(lambda v: libra_jax.psum_scatter(v, "x", tiled=True, blocks=3),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
            shard(x, mesh, P("x")))


def test_errors_are_jaxs_with_a_note():
    mesh = mesh_of((8,), ("x",))
    x = shard(np.ones((8 * 7, 3), np.float32), mesh, P("x"))
    run = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"),  # noqa: E731
                                           out_specs=P("x"), check_vma=False))(x)
    with pytest.raises(ValueError, match="must be divisible by") as info:
        run(lambda v: libra_jax.psum_scatter(v, "x", tiled=True))
    assert any("libra_jax.psum_scatter:" in n and "[7,3]" in n and "must be divisible by the "
               "axis size" in n for n in info.value.__notes__), info.value.__notes__
    with pytest.raises(ValueError, match="must match shard count"):
        run(lambda v: libra_jax.psum_scatter(v, "x"))
    with pytest.raises(NameError) as info:
        run(lambda v: libra_jax.all_gather(v, "y"))
    assert any("axis named 'y'" in n for n in info.value.__notes__)
    for blocks, error in ((0, ValueError), (MAX_BLOCKS + 1, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="libra_jax.all_gather: blocks"):
            run(partial(libra_jax.all_gather, axis_name="x", blocks=blocks))
    with pytest.raises(ValueError, match="Allowed `to`"):
        run(lambda v: libra_jax.all_gather(v, "x", to="sideways"))


def test_patch_lax_covers_them():
    names = ("psum", "pmean", "psum_scatter", "all_gather")
    before = [getattr(jax.lax, n) for n in names]
    with libra_jax.patch_lax():
        assert [getattr(jax.lax, n) for n in names] == [getattr(libra_jax, n) for n in names]
        mesh = mesh_of((8,), ("x",))
        f = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(jax.lax.psum_scatter(
            v, "x", tiled=True), "x", tiled=True), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        x = shard(np.ones((64, 2), np.float32), mesh, P("x"))
        assert {"libra_reduce_scatter_cpu", "libra_all_gather_cpu"} <= lowered_targets(f, x)
    assert [getattr(jax.lax, n) for n in names] == before


@pytest.mark.usefixtures("fresh_notices")
def test_other_platforms_lower_to_xla_with_a_notice():
    mesh = jax.sharding.AbstractMesh((8,), ("x",))
    f = jax.jit(jax.shard_map(lambda v: libra_jax.all_gather(libra_jax.psum_scatter(
        v, "x", tiled=True, blocks=4), "x", tiled=True), mesh=mesh, in_specs=P("x"),
        out_specs=P("x")))
    text = lower_for("tpu", f, mesh, (64, 4), P("x"), "no Libra reduce-scatter for tpu")
    assert "reduce_scatter" in text and "all_gather" in text and "libra_" not in text


def test_xla_twins_and_optimize_leave_them_named():
    """optimize(collectives="xla") lowers libra's reduce-scatter and all-gather to XLA's,
    quietly (their twins); optimize itself plans the psum_scatter (no backward pass shows:
    a terminal one is planned, as a psum would be) and gives the all-gather the model's
    blocks (kind forward): nothing is left unplanned."""
    mesh = mesh_of((8,), ("x",))
    x = shard(np.random.default_rng(12).standard_normal((64, 4)).astype(np.float32), mesh, P("x"))
    step = jax.shard_map(lambda v: libra_jax.all_gather(
        libra_jax.psum_scatter(v, "x", tiled=True), "x", tiled=True), mesh=mesh,
        in_specs=P("x"), out_specs=P("x"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unplanned-collectives notice, checked below
        control = libra_jax.optimize(step, collectives="xla")
        text = jax.jit(control).lower(x).as_text()
        got = jax.jit(control)(x)
    assert "libra_" not in text and "reduce_scatter" in text and "all_gather" in text
    assert_bitwise(got, jax.jit(step)(x))
    opt = libra_jax.optimize(step)
    jax.jit(opt)(x)
    assert opt.last_report.unplanned == []
    assert sorted((p.collective.kind, p.kind) for p in opt.last_report.plans) == [
        ("all-gather", "forward"), ("reduce-scatter", "gradient")]


# --- A participant that never arrives --------------------------------------------------

MISSING_SCRIPT = textwrap.dedent("""
    import os, time
    os.environ["LIBRA_JAX_TIMEOUT_S"] = "1.5"
    import jax, numpy as np
    jax.config.update("jax_num_cpu_devices", 4)
    from jax.sharding import PartitionSpec as P
    import libra_jax
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    x = jax.device_put(np.ones((16, 3), np.float32), jax.NamedSharding(mesh, P("x")))
    calls = {"psum_scatter": lambda u: libra_jax.psum_scatter(u, "x", tiled=True),
             "all_gather": lambda u: libra_jax.all_gather(u, "x", tiled=True)[:1]}
    for name, call in calls.items():
        def body(v):  # rank 2 skips the collective: it never arrives
            i = jax.lax.axis_index("x")
            return jax.lax.cond(i == 2, lambda u: u[:1] * 0, call, v)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                  check_vma=False))
        t0 = time.time()
        try:
            np.asarray(f(x))
            print(name, "NO ERROR")
        except Exception as e:
            print(name, type(e).__name__, str(e).replace("\\n", " "))
        print(name, "elapsed", time.time() - t0)
        g = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        print(name, "after", np.asarray(g(x)).ravel().tolist()[:3])
""")


def test_a_participant_that_never_arrives_is_named_and_the_next_call_works():
    proc = subprocess.run([sys.executable, "-c", MISSING_SCRIPT], capture_output=True,
                          text=True, timeout=180, env={**os.environ, "XLA_FLAGS": xla_flags(None)})
    out = proc.stdout
    for name, kind, after in (("psum_scatter", "reduce-scatter", "[4.0, 4.0, 4.0]"),
                              ("all_gather", "all-gather", "[1.0, 1.0, 1.0]")):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"{name} ")), "")
        assert "DEADLINE_EXCEEDED" in line and f"libra_jax {kind}" in line, out + proc.stderr
        assert "waiting for ranks [2] of 4" in line, line
        elapsed = float(re.search(rf"{name} elapsed ([\d.]+)", out).group(1))
        assert elapsed < 60
        assert f"{name} after {after}" in out, out


def test_bf16_all_gather_makes_nans_canonical_as_xla_does():
    """XLA:CPU gathers bf16 through f32, so a NaN's payload comes back canonical (sign |
    0x7fc0); libra's gather does the same, to stay bitwise (its other dtypes are copies)."""
    mesh = mesh_of((8,), ("x",))
    x = np.array([0x7FD0, 0xFFD1, 0x7F81, 0x7FC0, 0x3F80, 0x0001, 0x8000, 0x7F80] * 8,
                 np.uint16).view(jnp.bfloat16).reshape(64, 1)
    f = both(mesh, lambda v: libra_jax.all_gather(v, "x", tiled=True),
             lambda v: jax.lax.all_gather(v, "x", tiled=True), P("x"), P("x"), check_vma=False)
    ours, theirs = f(shard(x, mesh, P("x")))
    assert_bitwise(ours, theirs)
    assert np.asarray(theirs).view(np.uint16)[:8, 0].tolist() == [
        0x7FC0, 0xFFC0, 0x7FC0, 0x7FC0, 0x3F80, 0x0001, 0x8000, 0x7F80]


def test_composition_nnx_jit():
    """Under nnx.jit: an NNX model's sharded parameter all-gathered in a shard_map, its
    gradient reduce-scattered by autodiff, and the update written back in place."""
    nnx = pytest.importorskip("flax.nnx")
    mesh = mesh_of((8,), ("x",))

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(shard(np.random.default_rng(15).standard_normal((16, 4)).astype(
                np.float32), mesh, P("x")))

    x = shard(np.ones((8 * 3, 4), np.float32), mesh, P("x"))

    def make(gather):
        def loss(w, xb):
            return jnp.sum(jnp.tanh(xb @ gather(w, "x", tiled=True).T) ** 2)

        @nnx.jit
        def step(model, xb):
            g = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=P("x"))(model.w[...], xb)
            model.w[...] = model.w[...] - 0.1 * g
        return step

    ours, theirs = Model(), Model()
    make(libra_jax.all_gather)(ours, x)
    make(jax.lax.all_gather)(theirs, x)
    assert_bitwise(ours.w[...], theirs.w[...])


# --- Start/done (libra_jax.ops.start_done: the sharded pair) ----------------------------

def split_pair(collective, v, axes, *, dimension, tiled, blocks=None, call_id=5, between=None):
    """`collective` of `v` as a start/done pair (what `optimize` will place around compute);
    with `between`, (the result, between()), that compute ordered between start and done."""
    from libra_jax import ops

    n = jax.lax.axis_size(axes)
    if collective == "psum_scatter":
        out_aval, _ = ops.libra_reduce_scatter_p.abstract_eval(
            jax.typeof(v), axis_name=axes, scatter_dimension=dimension, axis_size=n,
            tiled=tiled, blocks=blocks)
    else:
        out_aval, _ = ops.libra_all_gather_p.abstract_eval(
            jax.typeof(v), axis_name=axes, all_gather_dimension=dimension, axis_size=n,
            tiled=tiled, invariant=False, blocks=blocks)
    params = dict(collective=collective, axes=axes, dimension=dimension, axis_size=n,
                  tiled=tiled, blocks=blocks, call_id=call_id)
    flat, token = ops.libra_start_p.bind(v, **params)
    if between is None:
        return ops.libra_done_p.bind(flat, token, out_avals=(out_aval,), **params)[0]
    (flat, token), extra = jax.lax.optimization_barrier(((flat, token), between()))
    return ops.libra_done_p.bind(flat, token, out_avals=(out_aval,), **params)[0], extra


SPLIT_CASES = [("psum_scatter", 0, True), ("psum_scatter", 1, True), ("psum_scatter", 0, False),
               ("psum_scatter", 2, False), ("all_gather", 0, True), ("all_gather", 1, True),
               ("all_gather", 0, False), ("all_gather", 2, False)]


@pytest.mark.parametrize("collective, dim, tiled", SPLIT_CASES)
@pytest.mark.parametrize("dtype", DTYPES + [np.int8], ids=lambda d: np.dtype(d).name)
def test_start_done_is_bitwise_the_one_call_form(collective, dim, tiled, dtype):
    """Start/done on CPU: the engine's start (in place in one flat buffer) and done; the
    result bitwise the one-call form's, at odd shapes and every dimension."""
    if collective == "psum_scatter" and dtype == np.int8:
        pytest.skip("int8 is not summed by the engine (delegated)")
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(16)
    if collective == "psum_scatter":
        shape = [3, 5, 7]
        shape[dim] = 8 * 3 if tiled else 8
    else:
        shape = [3, 5, 7][:2] if not tiled and dim == 2 else [3, 5, 7]
    x = with_specials(rng, random_array(rng, (8 * shape[0], *shape[1:]), dtype)) \
        if dtype != np.int8 else rng.integers(-100, 100, (8 * shape[0], *shape[1:]), np.int8)
    one = (partial(libra_jax.psum_scatter, scatter_dimension=dim, tiled=tiled)
           if collective == "psum_scatter" else partial(libra_jax.all_gather, axis=dim,
                                                        tiled=tiled))
    f = both(mesh, lambda v: split_pair(collective, v, ("x",), dimension=dim, tiled=tiled,
                                        blocks=3),
             lambda v: one(v, "x"), P("x"), P("x"), check_vma=False)
    with jax.enable_x64(True):
        xs = shard(x, mesh, P("x"))
        ours, theirs = f(xs)
        text = f.lower(xs).as_text()
    start = {"psum_scatter": "libra_reduce_scatter_cpu_start",
             "all_gather": "libra_all_gather_cpu_start"}[collective]
    assert re.search(rf"custom_call @{start}\(.*blocks = 3 ", text), text
    assert "custom_call @libra_allreduce_cpu_done(" in text
    assert_bitwise(ours, theirs)


@pytest.mark.parametrize("axes", ["a", "b", ("a", "b")])
@pytest.mark.parametrize("check_vma", [True, False])
def test_start_done_on_2d_meshes_one_element_per_shard(axes, check_vma):
    mesh = mesh_of((2, 4), ("a", "b"))
    n = 8 if axes == ("a", "b") else {"a": 2, "b": 4}[axes]
    rng = np.random.default_rng(18)
    x = with_specials(rng, random_array(rng, (8 * n, 1), np.float32))  # one element a shard
    def ours(v):
        s = split_pair("psum_scatter", v, tuple(axes) if isinstance(axes, tuple) else (axes,),
                       dimension=0, tiled=True, call_id=1)
        return s, split_pair("all_gather", s, tuple(axes) if isinstance(axes, tuple) else (axes,),
                             dimension=0, tiled=True, call_id=2)
    def theirs(v):
        s = jax.lax.psum_scatter(v, axes, tiled=True)
        return s, jax.lax.all_gather(s, axes, tiled=True)
    f = jax.jit(jax.shard_map(lambda v: (ours(v), theirs(v)), mesh=mesh,
                              in_specs=P(("a", "b")), out_specs=((P(("a", "b")),) * 2,) * 2,
                              check_vma=check_vma))
    got, want = f(shard(x, mesh, P(("a", "b"))))
    assert_bitwise(got, want)


def test_start_done_with_compute_between_and_xla_copies_no_in_flight_buffer():
    """Compute between start and done (the overlap), and in the compiled program each done's
    buffer is its start's result itself (no copy of an in-flight buffer), its token the
    latest start's; a reduce-scatter's start works in place (its result aliases its operand),
    an all-gather's writes a fresh buffer."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(17)
    x = shard(rng.standard_normal((8 * 16, 8)).astype(np.float32), mesh, P("x"))
    w = shard(rng.standard_normal((8 * 8, 8)).astype(np.float32), mesh, P("x"))

    def body(v, u):
        grads, a = split_pair("psum_scatter", v * 2.0, ("x",), dimension=0,
                              tiled=True, call_id=11, between=lambda: jnp.sin(v) @ v.T)
        full, b = split_pair("all_gather", u * 3.0, ("x",), dimension=0, tiled=True,
                             call_id=12, between=lambda: jnp.cos(v))
        return grads, full, a, b

    def reference(v, u):
        # Operands computed exactly (no transcendental whose last bit depends on fusion).
        return (jax.lax.psum_scatter(v * 2.0, "x", tiled=True),
                jax.lax.all_gather(u * 3.0, "x", tiled=True), jnp.sin(v) @ v.T, jnp.cos(v))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=(P("x"),) * 4, check_vma=False))
    g = jax.jit(jax.shard_map(reference, mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=(P("x"),) * 4, check_vma=False))
    got, want = f(x, w), g(x, w)
    assert_bitwise(got[:2], want[:2])  # the collectives; the compute between is XLA's either way
    hlo = f.lower(x, w).compile().as_text()
    starts, dones, _ = cpu_start_done_pairs(hlo)  # each done: its own start's buffer and token
    assert sorted(starts.values()) == ["libra_all_gather_cpu_start",
                                       "libra_reduce_scatter_cpu_start"], hlo
    assert len(dones) == 2, hlo
    rs_line = next(line for line in hlo.splitlines()
                   if 'custom_call_target="libra_reduce_scatter_cpu_start"' in line)
    ag_line = next(line for line in hlo.splitlines()
                   if 'custom_call_target="libra_all_gather_cpu_start"' in line)
    assert "output_to_operand_aliasing" in rs_line and "output_to_operand_aliasing" not in ag_line


ABANDONED_SHARDED_PROGRAM = """
    from test_sharded import split_pair

    def body(a, v, fail):
        def between():
            if not fail:
                return v.sum()
            i = jax.lax.axis_index("x")  # rank 2 never reaches this psum: the execution fails
            return jax.lax.cond(i == 2, lambda u: u, lambda u: libra_jax.psum(u, "x"), v).sum()
        scattered, extra = split_pair("psum_scatter", a, ("x",), dimension=0, tiled=True,
                                      call_id=78, between=between)
        return (scattered + 0 * extra,
                split_pair("all_gather", a, ("x",), dimension=0, tiled=True, call_id=79))

    def program(fail):
        return jax.jit(jax.shard_map(lambda a, v: body(a, v, fail), mesh=mesh,
                                     in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")),
                                     check_vma=False))
    x = jax.device_put(np.ones((16, 4), np.float32), jax.NamedSharding(mesh, P("x")))

    def summary(out):
        scattered, gathered = out
        return np.asarray(scattered).ravel().tolist()[:2], np.asarray(gathered).shape
"""


def test_sharded_starts_abandoned_by_a_failed_execution_expire():
    """Sharded starts whose execution fails before their done leave their entries behind; a
    later start drops them once their round is over and the timeout has passed, as the
    all-reduce's starts (tests/test_overlap.py; conftest.run_abandoned_starts)."""
    abandoned, result = run_abandoned_starts(ABANDONED_SHARDED_PROGRAM)
    # Ranks 0, 1, 3 never reached their reduce-scatter's done, nor their all-gather's where XLA
    # ordered its start (independent of the psum) before the psum: 3 or 6 entries.
    assert abandoned in (3, 6)
    assert result == "([4.0, 4.0], (64, 4))"


# --- The reduce-scatter bucket (libra_jax.ops.libra_bucket_p, collective="psum_scatter") --

def with_nan_payloads(rng, x, fraction=0.05):
    """`x` with a `fraction` of its elements NaNs of distinct payloads and signs, and infs
    (test_allreduce's patterns per dtype), on top of `with_specials`'."""
    x = with_specials(rng, x)
    key = next((d for d in _NAN_BITS if np.dtype(d) == x.dtype), None)
    if key is None:
        return x
    bits, patterns = _NAN_BITS[key]
    raw = x.view(bits).copy()
    mask = rng.random(x.shape) < fraction
    raw[mask] = rng.choice(np.array(patterns, bits), size=int(mask.sum()))
    return raw.view(x.dtype)


class TestFusedReduceScatter:
    """One reduce-scatter per dtype for a bucket of psum_scatters along dimension 0 (members
    packed rank-contiguously: each viewed as (n, size / n), concatenated on the second axis),
    each result bitwise (and typed as) the member's own `jax.lax.psum_scatter`."""

    # (per-device shape as a function of the group size n, dtype, tiled): 1-D, 2-D and 3-D
    # members, leading dimension n (untiled, or tiled with k = 1) or k * n (tiled).
    MIXED = [(lambda n: (n * 3, 5), np.float32, True),
             (lambda n: (n * 2,), jnp.bfloat16, True),
             (lambda n: (n, 2, 3), np.float16, False),
             (lambda n: (n, 7), np.float64, False),
             (lambda n: (n, 3, 2), np.int32, True),
             (lambda n: (n * 5,), np.int64, True),
             (lambda n: (n, 1, 4), np.float32, False),  # a dtype seen before: same row
             (lambda n: (n, 3), jnp.bfloat16, False)]
    CASES = {
        "mixed": MIXED,
        "one-f32": [(lambda n: (n * 4, 3), np.float32, True)],
        "one-bf16-untiled": [(lambda n: (n, 6), jnp.bfloat16, False)],
        "one-i32-1d": [(lambda n: (n * 9,), np.int32, True)],
        "one-dtype-three-shapes": [(lambda n: (n * 2, 3, 2), np.float32, True),
                                   (lambda n: (n, 5), np.float32, False),
                                   (lambda n: (n * 3,), np.float32, True)],
    }

    @staticmethod
    def fused(axes, n, tiled, blocks=None):
        def call(*xs):
            return tuple(libra_jax.ops.libra_bucket_p.bind(
                *xs, collective="psum_scatter", axes=axes, axis_size=n, tiled=tuple(tiled),
                blocks=blocks))
        return call

    @staticmethod
    def unfused(axes, tiled):
        def call(*xs):
            return tuple(jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=t)
                         for x, t in zip(xs, tiled))
        return call

    def program(self, mesh, axes, members, blocks=None, check_vma=True, ours=None):
        """(a jitted shard_map returning (the bucket's results, jax.lax's), its arguments):
        every member sharded on all of the mesh's axes, of random data with specials."""
        n = int(np.prod([mesh.shape[a] for a in axes]))
        tiled = [t for _, _, t in members]
        ours = ours or self.fused(axes, n, tiled, blocks)
        theirs = self.unfused(axes, tiled)

        def body(*xs):
            got, want = ours(*xs), theirs(*xs)
            assert [jax.typeof(a) for a in got] == [jax.typeof(b) for b in want]
            return got, want

        spec = P(tuple(mesh.axis_names))
        rng = np.random.default_rng(len(members) * 100 + n)
        xs = [with_nan_payloads(rng, random_array(rng, (mesh.size * shape(n)[0],
                                                        *shape(n)[1:]), dtype))
              for shape, dtype, _ in members]
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(xs),
                                  out_specs=((spec,) * len(xs),) * 2, check_vma=check_vma))
        return f, [shard(x, mesh, spec) for x in xs]

    @pytest.mark.parametrize("case", list(CASES))
    @pytest.mark.parametrize("blocks", [None, 1, MAX_BLOCKS])
    def test_bitwise_lax_psum_scatter_per_member(self, case, blocks):
        mesh = mesh_of((8,), ("x",))
        with jax.enable_x64(True):
            f, xs = self.program(mesh, ("x",), self.CASES[case], blocks=blocks)
            got, want = f(*xs)
        assert_bitwise(got, want)

    @pytest.mark.parametrize("check_vma", [True, False])
    @pytest.mark.parametrize("axes", [("a",), ("b",), ("a", "b"), ("b", "a")])
    def test_2d_mesh_one_axis_and_both(self, axes, check_vma):
        mesh = mesh_of((4, 2), ("a", "b"))
        members = [m for m in self.MIXED if np.dtype(m[1]).itemsize < 8]
        f, xs = self.program(mesh, axes, members, check_vma=check_vma)
        got, want = f(*xs)
        assert_bitwise(got, want)
        assert "libra_reduce_scatter_cpu" in lowered_targets(f, *xs)

    def test_one_engine_call_per_dtype_no_xla_reduce_scatter_blocks_carried(self):
        mesh = mesh_of((8,), ("x",))
        tiled = [t for _, _, t in self.MIXED]
        with jax.enable_x64(True):
            _, xs = self.program(mesh, ("x",), self.MIXED)
            f = jax.jit(jax.shard_map(self.fused(("x",), 8, tiled, blocks=5), mesh=mesh,
                                      in_specs=(P("x"),) * len(xs),
                                      out_specs=(P("x"),) * len(xs)))
            lowered = f.lower(*xs)
            compiled = lowered.compile().as_text()
        calls = [line for line in compiled.splitlines()
                 if 'custom_call_target="libra_reduce_scatter_cpu"' in line]
        assert len(calls) == len({np.dtype(d) for _, d, _ in self.MIXED}) == 6, calls
        assert all("blocks = 5 " in line for line in calls), calls
        assert "reduce-scatter" not in compiled.replace("libra_reduce_scatter", ""), compiled
        # Each call takes its dtype's members as they are, each with its own segment (one
        # rank's shard): f32's two members, (24, 5) and (8, 1, 4), as two operands and two
        # results of one call; no member is packed or sliced.
        f32 = next(line for line in calls if "(f32[3,5]{1,0}, f32[1,4]{1,0})" in line)
        assert "segments = dense<[15, 4]>" in f32 and "f32[24,5]" in f32 and "f32[8,1,4]" in f32
        text = lowered.as_text()
        assert "stablehlo.concatenate" not in text and "stablehlo.slice" not in text
        # The only dynamic slices are of the (rank, group) table.
        assert all("x2xi32>" in line for line in text.splitlines() if "dynamic_slice" in line)

    def test_default_blocks_are_the_whole_rows(self):
        """blocks=None: `default_blocks` for the packed row (every member's bytes), chosen
        when lowered, as one psum_scatter of that row would get."""
        mesh = mesh_of((8,), ("x",))
        members = [(lambda n: (n * 4096, 8), np.float32, True),
                   (lambda n: (n, 4096 * 8), np.float32, False)]
        f, xs = self.program(mesh, ("x",), members)
        text = f.lower(*xs).as_text()
        row = 2 * 8 * 4096 * 8 * 4
        want = default_blocks(row, 8, "cpu-host", "psum_scatter")
        assert re.findall(r"libra_reduce_scatter_cpu.*blocks = (\d+) ", text) == [str(want)]

    def test_xla_twin_is_xlas_reduce_scatter_of_each_member_as_it_is(self):
        """optimize(collectives="xla") binds the bucket's XLA twin: jax.lax's reduce-scatter
        of each member as libra's call takes it, unpacked (so the code around it is the code
        around libra's: the control differs in the collective alone), no libra call,
        quietly; the same bits."""
        mesh = mesh_of((8,), ("x",))
        prim = libra_jax.ops.libra_bucket_p
        assert libra_jax.ops.XLA_TWINS[prim].name == "libra_bucket_xla"
        members = [m for m in self.MIXED if np.dtype(m[1]).itemsize < 8]
        tiled = [t for _, _, t in members]
        f, xs = self.program(mesh, ("x",), members)
        step = jax.shard_map(self.fused(("x",), 8, tiled, blocks=2), mesh=mesh,
                             in_specs=(P("x"),) * len(xs), out_specs=(P("x"),) * len(xs))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the twin is quiet
            control = jax.jit(libra_jax.optimize(step, collectives="xla"))
            text = control.lower(*xs).as_text()
            got = control(*xs)
        assert "libra_" not in text
        dtypes = {np.dtype(dtype) for _, dtype, _ in members}
        assert len(dtypes) < len(members)
        assert text.count("stablehlo.reduce_scatter") == len(members), text
        assert "stablehlo.concatenate" not in text
        assert_bitwise(got, f(*xs)[1])
        assert_bitwise(got, jax.jit(step)(*xs))

    @pytest.mark.usefixtures("fresh_notices")
    def test_dtype_the_engine_does_not_sum_is_xlas_per_member_with_a_notice(self):
        mesh = mesh_of((8,), ("x",))
        members = [(lambda n: (n * 2, 3), np.float32, True), (lambda n: (n, 4), np.int8, False),
                   (lambda n: (n * 3,), np.int8, True)]
        f, xs = self.program(mesh, ("x",), members)
        with pytest.warns(UserWarning, match="no Libra reduce-scatter for cpu int8"):
            text = f.lower(*xs).as_text()
        assert re.findall(r"custom_call @(libra_\w+)", text) == ["libra_reduce_scatter_cpu"]
        # jax.lax's two and the bucket's two int8 members.
        assert text.count("stablehlo.reduce_scatter") == 3 + 2, text
        got, want = f(*xs)
        assert_bitwise(got, want)

    @pytest.mark.usefixtures("fresh_notices")
    @pytest.mark.parametrize("platform, why", [("tpu", "no Libra reduce-scatter for tpu"),
                                               ("cuda", "LIBRA_JAX_CUDA=xla")])
    def test_other_platforms_are_xlas_per_member_with_a_notice(self, platform, why):
        mesh = jax.sharding.AbstractMesh((8,), ("x",))
        bucket = self.fused(("x",), 8, (True, False, True), blocks=4)
        f = jax.jit(jax.shard_map(
            lambda v: bucket(v, v[:8].astype(jnp.bfloat16), v[:, 0]), mesh=mesh,
            in_specs=P("x"), out_specs=(P("x"),) * 3))
        text = lower_for(platform, f, mesh, (8 * 16, 4), P("x"), re.escape(why))
        assert "libra_" not in text and text.count("stablehlo.reduce_scatter") == 3, text

    def test_bad_members_are_refused_with_jaxs_error_or_ours(self):
        mesh = mesh_of((8,), ("x",))
        x = shard(np.ones((8 * 16, 3), np.float32), mesh, P("x"))

        def run(*members, tiled):
            bucket = self.fused(("x",), 8, tiled)
            return jax.jit(jax.shard_map(lambda v: bucket(*(m(v) for m in members)), mesh=mesh,
                                         in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)
        whole, seven, four = (lambda v: v), (lambda v: v[:7]), (lambda v: v[:4])
        with pytest.raises(ValueError, match="7 must be divisible by shard_count 8"):
            run(whole, seven, tiled=(True, True))
        with pytest.raises(ValueError, match="4 must match shard count 8"):
            run(whole, four, tiled=(True, False))
        with pytest.raises(ValueError, match=r"tiled and dimension need one entry per operand "
                           r"\(2\), got 1 and 2"):
            run(whole, whole, tiled=(True,))
        with pytest.raises(ValueError, match="operand 1 is a scalar"):
            run(whole, lambda v: v.sum(), tiled=(True, True))
