"""Tests of the CUDA all-reduce: handlers, registration and the cuda lowering
(on any machine), and the kernels through JAX on GPUs (skipped without one)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _compat, _ffi, _libra_ffi, dropins
from libra_jax.config import xla_flags

from conftest import _jax

pytestmark = pytest.mark.usefixtures("jax_8")

needs_cuda_build = pytest.mark.skipif(not _ffi.HAS_CUDA,
                                      reason="libra_jax built without CUDA (no nvcc)")

CUDA_TARGET = "libra_allreduce_cuda"


def _gpus() -> list:
    _jax()  # 8 CPU devices first: listing GPUs starts the backends
    try:
        return jax.devices("cuda")
    except Exception:  # noqa: BLE001 - no CUDA backend (RuntimeError, or a plugin error)
        return []


GPUS = _gpus()
needs_gpu = pytest.mark.skipif(not (GPUS and _ffi.HAS_CUDA), reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(not (len(GPUS) >= 2 and _ffi.HAS_CUDA),
                                  reason="needs 2 CUDA GPUs")


@pytest.fixture(autouse=True)
def p2p_path(monkeypatch):
    """These tests are of libra's P2P kernels: opt in (XLA's all-reduce is the default)."""
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget the one-time notices, so each test sees its own."""
    monkeypatch.setattr("libra_jax.ops.base._warned", set())


def lower_for_cuda(body, shape=(8, 4), dtype=np.float32, mesh_shape=(8,), names=("x",),
                   in_spec=P("x"), out_spec=P(), check_vma=True) -> str:
    mesh = jax.sharding.AbstractMesh(mesh_shape, names)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                              check_vma=check_vma))
    traced = f.trace(jax.ShapeDtypeStruct(shape, dtype,
                                          sharding=jax.NamedSharding(mesh, in_spec)))
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(text: str) -> list[str]:
    return [line for line in text.splitlines() if f"custom_call @{CUDA_TARGET}" in line]


def attr(line: str, name: str) -> str:
    m = re.search(rf"{name} = (dense<[^>]*>|[-\w]+)", line)
    assert m, (name, line)
    return m.group(1)


# --- Build and registration (any machine) ------------------------------------

def test_module_reports_cuda_build():
    regs = _libra_ffi.cuda_registrations()
    if _ffi.HAS_CUDA:
        # NCCL's targets (the all-reduce's, the reduce-scatter's and the all-gather's, one
        # call and start; the all-to-all's, one call) also have an initialize stage
        # (communicators made before a program runs).
        nccl = {_ffi.TARGETS[role] for role in ("nccl", "nccl_start", "nccl_reduce_scatter",
                                                "nccl_reduce_scatter_start", "nccl_all_gather",
                                                "nccl_all_gather_start", "nccl_all_to_all")}
        assert set(regs) == {CUDA_TARGET, CUDA_TARGET + "_start", CUDA_TARGET + "_done"} | nccl
        assert all(type(r).__name__ == "PyCapsule" for n, r in regs.items() if n not in nccl)
        assert all(sorted(regs[n]) == ["execute", "initialize"] for n in nccl)
        assert _libra_ffi.CUDA_MAX_RANKS == _ffi.CUDA_MAX_RANKS == 8
    else:
        assert regs == {}


@needs_cuda_build
def test_cuda_pending_starts_are_counted():
    # libra's streams' pending map (libra/streams.h; its expiry is tested in C++:
    # cpp/tests/nccl_test.cc stale_starts_expire); nothing has started here.
    assert _libra_ffi.cuda_pending_starts() == 0


@needs_cuda_build
def test_cuda_target_registers_with_jax_for_cuda():
    assert _ffi.ensure_cuda_registered()
    assert _ffi.ensure_cuda_registered()  # idempotent
    state = _compat.ffi_target_registration(CUDA_TARGET, "CUDA")
    # Without a GPU backend jax queues the target for the CUDA platform.
    assert state in ("pending", "handled"), state
    if not GPUS:
        assert state == "pending"


@needs_cuda_build
def test_effective_blocks(monkeypatch):
    monkeypatch.setenv("LIBRA_JAX_CUDA_STAGING_MIB", "32")
    eff = _ffi.cuda_effective_blocks
    assert eff(16, 2, 1, 64) == 1                   # one vector
    assert eff(64 << 10, 2, 1, 64) == 8             # 4096 vectors = 8 tiles of 512
    assert eff(1 << 30, 8, 2, 64) == 64
    assert eff(1 << 30, 8, 0, 7) == 7
    assert eff(64 << 10, 8, 2, 64) == 1             # two-shot: 512 vectors per rank
    monkeypatch.setenv("LIBRA_JAX_CUDA_STAGING_MIB", "1")  # 65536 vectors per round
    assert eff(1 << 30, 8, 2, 64) == 16
    assert eff(1 << 30, 2, 1, 64) == 64
    for bad in ("inf", "1e30", "nan", "0", "lots"):  # a size cast out of range before
        monkeypatch.setenv("LIBRA_JAX_CUDA_STAGING_MIB", bad)
        with pytest.raises(ValueError, match=r"LIBRA_JAX_CUDA_STAGING_MIB must be a number of "
                                             r"MiB in \(0, 65536\]"):
            eff(1 << 20, 8, 2, 64)


# --- The cuda lowering, from this machine ------------------------------------

@needs_cuda_build
@pytest.mark.parametrize("blocks", [1, 7, 64])
def test_cuda_lowering_has_custom_call_with_block_count(blocks):
    text = lower_for_cuda(lambda v: libra_jax.psum(v * 2.0, "x", blocks=blocks))
    calls = custom_calls(text)
    assert len(calls) == 1, text
    assert attr(calls[0], "blocks") == str(blocks)
    assert attr(calls[0], "world") == "8"
    assert attr(calls[0], "devices") == "dense<[0, 1, 2, 3, 4, 5, 6, 7]>"
    assert attr(calls[0], "algorithm") == "0"
    assert "output_operand_alias" in calls[0]  # an intermediate: in place
    assert "all_reduce" not in text


@needs_cuda_build
def test_cuda_lowering_groups_of_a_2d_mesh():
    text = lower_for_cuda(lambda v: libra_jax.psum(v, "b", blocks=3), mesh_shape=(2, 4),
                          names=("a", "b"), in_spec=P(("a", "b")), out_spec=P("a"))
    call, = custom_calls(text)
    assert attr(call, "world") == "4"
    assert attr(call, "devices") == "dense<[0, 1, 2, 3, 4, 5, 6, 7]>"
    text = lower_for_cuda(lambda v: libra_jax.psum(v, "a", blocks=3), mesh_shape=(2, 4),
                          names=("a", "b"), in_spec=P(("a", "b")), out_spec=P("b"))
    call, = custom_calls(text)
    assert attr(call, "world") == "2"
    assert attr(call, "devices") == "dense<[0, 4, 1, 5, 2, 6, 3, 7]>"


@needs_cuda_build
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16, np.int32],
                         ids=lambda d: np.dtype(d).name)
def test_cuda_lowering_pads_to_16_bytes(dtype):
    text = lower_for_cuda(lambda v: libra_jax.psum(v, "x", blocks=2), shape=(8, 3), dtype=dtype)
    call, = custom_calls(text)
    itemsize = np.dtype(dtype).itemsize
    padded = -(-3 * itemsize // 16) * 16 // itemsize
    assert f"tensor<{padded}x" in call
    assert "stablehlo.pad" in text and "stablehlo.slice" in text


@needs_cuda_build
def test_cuda_lowering_no_padding_when_aligned():
    text = lower_for_cuda(lambda v: libra_jax.psum(v, "x", blocks=2), shape=(8, 4))
    assert "stablehlo.pad" not in text
    call, = custom_calls(text)
    assert "output_operand_alias" not in call  # an argument: not overwritten


@needs_cuda_build
def test_cuda_lowering_of_a_bucket_is_one_call_over_its_members():
    """A fused bucket on the P2P path is one kernel call whose operands and results are the
    members themselves (the kernels take a table of their pointers): no concatenate of the
    bucket and no slice of its result; a member that is not whole 16-byte vectors (3 floats)
    is padded on its own, an empty one is a constant; the blocks default from the bucket's
    bytes. The packed form (one concatenate, a slice per member) was lowered before."""
    from libra_jax import ops

    def body(v):
        members = (v * 2.0, jnp.tile(v, (3, 1)), v[0, :3], v[0, :0])
        return tuple(ops.libra_bucket_p.bind(*members, collective="psum", axes=("x",),
                                             blocks=5, invariant=False))
    text = lower_for_cuda(body, shape=(8, 8), out_spec=(P(),) * 4, check_vma=False)
    calls = custom_calls(text)
    assert len(calls) == 2, calls
    bucket, = [c for c in calls if "tensor<1x8xf32>, tensor<3x8xf32>)" in c]
    assert re.search(r"-> \(tensor<1x8xf32>, tensor<3x8xf32>\)", bucket), bucket
    assert attr(bucket, "blocks") == "5"
    assert "output_operand_aliases" in bucket  # intermediates: in place, each its own
    assert "stablehlo.concatenate" not in text
    padded, = [c for c in calls if c is not bucket]
    assert "tensor<4xf32>" in padded  # 3 floats padded to a 16-byte vector
    # The only slice of a result is the padded member's (back to its 3 floats).
    results = set(re.findall(r"(%\w+)(?::\d+)? = stablehlo.custom_call @libra_allreduce_cuda\(",
                             text))
    sliced = re.findall(r"stablehlo.slice (%\w+)", text)
    assert len([x for x in sliced if x in results]) == 1, text


@needs_cuda_build
@pytest.mark.parametrize("name,code", [("oneshot", 1), ("twoshot", 2), ("auto", 0)])
def test_cuda_algorithm_setting(monkeypatch, name, code):
    monkeypatch.setenv("LIBRA_JAX_CUDA_ALGORITHM", name)
    call, = custom_calls(lower_for_cuda(lambda v: libra_jax.psum(v * 1.0, "x", blocks=4)))
    assert attr(call, "algorithm") == str(code)


@needs_cuda_build
def test_cuda_bad_algorithm_setting(monkeypatch):
    monkeypatch.setenv("LIBRA_JAX_CUDA_ALGORITHM", "threeshot")
    with pytest.raises(ValueError, match="LIBRA_JAX_CUDA_ALGORITHM"):
        lower_for_cuda(lambda v: libra_jax.psum(v * 1.0, "x", blocks=4))


@needs_cuda_build
def test_cuda_lowering_of_grad_and_several_block_counts():
    def body(v):
        a = libra_jax.psum(v * 2.0, "x", blocks=3)
        b = libra_jax.psum(v * 3.0, "x", blocks=17)
        g = jax.grad(lambda u: libra_jax.psum(u * u, "x", blocks=5).sum())(v)
        return a + b + g
    calls = custom_calls(lower_for_cuda(body, out_spec=P("x"), check_vma=False))
    # grad keeps only the transposed psum (the forward value is unused).
    assert sorted(int(attr(c, "blocks")) for c in calls) == [3, 5, 17]


@needs_cuda_build
def test_cuda_export_with_disabled_custom_call_check():
    mesh = jax.sharding.AbstractMesh((8,), ("x",))
    f = jax.jit(jax.shard_map(lambda v: libra_jax.psum(v * 2.0, "x", blocks=9), mesh=mesh,
                              in_specs=P("x"), out_specs=P()))
    arg = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=jax.NamedSharding(mesh, P("x")))
    checks = [jax.export.DisabledSafetyCheck.custom_call(CUDA_TARGET)]
    exported = jax.export.export(f, platforms=["cuda"], disabled_checks=checks)(arg)
    call, = custom_calls(exported.mlir_module())
    assert attr(call, "blocks") == "9"
    with pytest.raises(ValueError, match=CUDA_TARGET):
        jax.export.export(f, platforms=["cuda"])(arg)  # not on the stable list


# --- Fallbacks to XLA's all-reduce --------------------------------------------

def _assert_xla_fallback(text):
    assert "all_reduce" in text and CUDA_TARGET not in text


def test_cuda_fallback_without_cuda_build(monkeypatch, fresh_warnings):
    monkeypatch.setattr(_ffi, "HAS_CUDA", False)
    with pytest.warns(UserWarning, match=r"no Libra all-reduce for cuda \(libra_jax was built "
                                         r"without CUDA\)"):
        _assert_xla_fallback(lower_for_cuda(lambda v: libra_jax.psum(v, "x", blocks=4)))


@needs_cuda_build
@pytest.mark.parametrize("setting", [None, "", "xla", " XLA "])
def test_cuda_default_path_is_xla_with_a_notice_naming_the_switch(monkeypatch, fresh_warnings,
                                                                 setting):
    if setting is None:
        monkeypatch.delenv("LIBRA_JAX_CUDA")
    else:
        monkeypatch.setenv("LIBRA_JAX_CUDA", setting)
    assert libra_jax.config.cuda_path() == "xla"
    with pytest.warns(UserWarning, match=r"LIBRA_JAX_CUDA=xla, the default.*not run on a GPU"
                                         r".*LIBRA_JAX_CUDA=p2p or LIBRA_JAX_CUDA=nccl"):
        _assert_xla_fallback(lower_for_cuda(lambda v: libra_jax.psum(v, "x", blocks=4)))
    # One-time: the same lowering again says nothing more.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_xla_fallback(lower_for_cuda(lambda v: libra_jax.psum(v * 3.0, "x", blocks=4)))


@needs_cuda_build
def test_cuda_nccl_path_on_an_abstract_mesh_is_xla_with_a_notice(monkeypatch, fresh_warnings):
    # LIBRA_JAX_CUDA=nccl lowered for export (an abstract mesh): NCCL's communicators need the
    # devices, so XLA's all-reduce. A concrete mesh without NCCL: test_platform_matrix; with
    # NCCL (the stub): tests/test_nccl.py.
    monkeypatch.setenv("LIBRA_JAX_CUDA", "nccl")
    with pytest.warns(UserWarning, match=r"LIBRA_JAX_CUDA=nccl on an abstract mesh"):
        _assert_xla_fallback(lower_for_cuda(lambda v: libra_jax.psum(v, "x", blocks=4)))


@pytest.mark.parametrize("setting", ["0", "1", "on", "gpu", "p2p,nccl"])
def test_cuda_path_setting_is_validated(monkeypatch, setting):
    monkeypatch.setenv("LIBRA_JAX_CUDA", setting)
    with pytest.raises(ValueError, match=r"LIBRA_JAX_CUDA must be one of xla, p2p, nccl"):
        libra_jax.config.cuda_path()
    if _ffi.HAS_CUDA:  # and a lowering for cuda says so, naming the variable
        with pytest.raises(ValueError, match=r"LIBRA_JAX_CUDA must be one of"):
            lower_for_cuda(lambda v: libra_jax.psum(v, "x", blocks=4))


@needs_cuda_build
def test_cuda_fallback_for_more_than_8_gpus(fresh_warnings):
    with pytest.warns(UserWarning, match="more than 8 GPUs"):
        _assert_xla_fallback(lower_for_cuda(lambda v: libra_jax.psum(v, "x", blocks=4),
                                            shape=(16, 4), mesh_shape=(16,)))


@needs_cuda_build
def test_cuda_fallback_without_peer_access(monkeypatch, fresh_warnings):
    # The kernels read their peers' memory: GPUs without P2P between them get XLA's
    # all-reduce, with a notice naming them (not an error from the handler at run time).
    asked = []
    monkeypatch.setattr(_ffi, "cuda_peer_access", lambda devices: asked.append(devices) or False)
    with pytest.warns(UserWarning, match=r"cuda GPUs \[0, 1, 2, 3, 4, 5, 6, 7\] without peer "
                                         r"access"):
        _assert_xla_fallback(lower_for_cuda(lambda v: libra_jax.psum(v, "x", blocks=4)))
    assert asked == [list(range(8))]


@needs_cuda_build
def test_cuda_peer_access_unknown_without_a_gpu():
    # No GPU here: CUDA cannot say, and the lowering keeps the kernels (the handler checks).
    if not GPUS:
        assert _ffi.cuda_peer_access([0, 1]) is None
    assert _ffi.cuda_peer_access([0]) in (True, None)


@needs_cuda_build
def test_p2p_handlers_are_not_command_buffer_compatible():
    # Read as XLA reads them (the FFI metadata call): a graph replay would neither refresh
    # a call's signature nor report its kernel's error, so the P2P calls must stay out of
    # command buffers (bit 0: XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE).
    traits = _ffi._libra_ffi.handler_traits()
    for target in (_ffi.target("all-reduce", "cuda"), _ffi.target("all-reduce", "cuda", "start")):
        assert target in traits
        assert traits[target] & 1 == 0, target


@needs_cuda_build
def test_cuda_fallback_for_s64(fresh_warnings):
    with jax.enable_x64(True):
        with pytest.warns(UserWarning, match="no Libra all-reduce for cuda int64"):
            _assert_xla_fallback(lower_for_cuda(lambda v: libra_jax.psum(v, "x", blocks=4),
                                                dtype=np.int64))


# --- On GPUs -------------------------------------------------------------------

def _gpu_mesh(n):
    return jax.sharding.Mesh(np.array(GPUS[:n]), ("x",))


def _reference(x, n):
    return np.asarray(x, np.float64).reshape(n, -1, *x.shape[1:]).sum(0)


def _tolerance(dtype, x, n):
    a = np.abs(np.asarray(x, np.float64)).reshape(n, -1, *x.shape[1:]).sum(0)
    if dtype == np.float64:
        return n * 2.0 ** -52 * a
    rel = {np.dtype(jnp.bfloat16): 2.0 ** -8, np.dtype(np.float16): 2.0 ** -11}.get(
        np.dtype(dtype), 0.0)
    return n * 2.0 ** -23 * a + rel * np.abs(_reference(x, n)) + 1e-30


def _random(rng, shape, dtype):
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-2 ** 20, 2 ** 20, size=shape, dtype=np.int32)
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 2, size=shape))).astype(dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16, np.float64, np.int32],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("count", [1, 7, 4096, 3 * (1 << 20) + 5])
def test_gpu_single_rank_custom_call(dtype, count):
    """One GPU: a 1-rank team (the front end skips size-1 axes, so bind the
    primitive). Exercises registration, the team, padding, several rounds
    (LIBRA_JAX_CUDA_STAGING_MIB), and the kernel's copy-through."""
    if dtype == np.float64 and jnp.zeros(1, np.float64).dtype != np.float64:
        pytest.skip("float64 needs jax_enable_x64")
    mesh = _gpu_mesh(1)
    x = _random(np.random.default_rng(count), (count,), dtype)

    def body(v):
        a = dropins.libra_psum_p.bind(v, axes=("x",), blocks=7, inplace=False,
                                        invariant=False)
        b = dropins.libra_psum_p.bind(v * 1, axes=("x",), blocks=64, inplace=True,
                                        invariant=False)
        return a, b
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P(), P()),
                              check_vma=False))
    hlo = f.lower(x).compile().as_text()
    assert CUDA_TARGET in hlo
    a, b = f(x)
    np.testing.assert_array_equal(np.asarray(a), x)
    np.testing.assert_array_equal(np.asarray(b), x)


@needs_2_gpus
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16, np.int32],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
def test_gpu_psum_matches_float64_reference(monkeypatch, dtype, algorithm):
    monkeypatch.setenv("LIBRA_JAX_CUDA_ALGORITHM", algorithm)
    n = min(len(GPUS), 8)
    mesh = _gpu_mesh(n)
    x = _random(np.random.default_rng(0), (n * 1000 + 0, 37), dtype)
    outs = []
    for blocks in (1, 5, 64):
        f = jax.jit(jax.shard_map(lambda v: libra_jax.psum(v, "x", blocks=blocks), mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x"), check_vma=False))
        assert CUDA_TARGET in f.lower(x).as_text()
        out = np.asarray(f(x)).reshape(n, -1, 37)
        for r in range(1, n):  # every rank bitwise identical
            assert out[r].tobytes() == out[0].tobytes()
        err = np.abs(out[0].astype(np.float64) - _reference(x, n))
        assert np.all(err <= _tolerance(dtype, x, n)), err.max()
        outs.append(out[0])
    for o in outs[1:]:  # independent of the block count
        assert o.tobytes() == outs[0].tobytes()


@needs_2_gpus
def test_gpu_data_parallel_grad_step():
    n = min(len(GPUS), 8)
    mesh = _gpu_mesh(n)
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    batch = np.random.default_rng(2).standard_normal((n * 8, 64)).astype(np.float32)

    def step(lib):
        def body(w, b):
            g = jax.grad(lambda w: jnp.mean(jnp.tanh(b @ w) ** 2))(w)
            return (libra_jax.pmean(g, "x", blocks=8) if lib else jax.lax.pmean(g, "x"))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P()))
    np.testing.assert_allclose(np.asarray(step(True)(w, batch)),
                               np.asarray(step(False)(w, batch)), rtol=1e-5, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("fusion", [True, False])
def test_gpu_optimize_start_done_equals_sync(fusion):
    # The start/done pair on libra's own stream (1..n GPUs of this process): the same bits as
    # the synchronous call, fused buckets (f32 + bf16, odd sizes: padded) and single ones.
    n = min(len(GPUS), 8)
    mesh = _gpu_mesh(n)
    rng = np.random.default_rng(3)
    params = [rng.standard_normal((33, 17)).astype(np.float32),
              rng.standard_normal((17, 5)).astype(jnp.bfloat16),
              rng.standard_normal((5,)).astype(np.float32)]
    x = jax.device_put(rng.standard_normal((n * 4, 33)).astype(np.float32),
                       jax.sharding.NamedSharding(mesh, P("x")))

    def local(params, x):
        def loss(p):
            h = jnp.tanh(x @ p[0])
            return jnp.sum((h.astype(jnp.bfloat16) @ p[1]).astype(jnp.float32) + p[2])
        return jax.grad(loss)(params)

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                         check_vma=True)
    sync = jax.jit(libra_jax.optimize(step, fusion=fusion, overlap="sync"))(params, x)
    split = libra_jax.optimize(step, fusion=fusion, overlap="start-done")
    got = jax.jit(split)(params, x)
    for a, b in zip(got, sync):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    text = jax.jit(split).lower(params, x).as_text()
    assert "libra_allreduce_cuda_start" in text and "libra_allreduce_cuda_done" in text


GPU_TIMEOUT_SCRIPT = textwrap.dedent("""
    import os, time
    os.environ["LIBRA_JAX_TIMEOUT_S"] = "0.5"
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    import libra_jax
    gpus = jax.devices("cuda")[:2]
    mesh = jax.sharding.Mesh(np.array(gpus), ("x",))
    def body(v):
        i = jax.lax.axis_index("x")  # rank 1 never arrives
        return jax.lax.cond(i == 1, lambda u: u, lambda u: libra_jax.psum(u, "x"), v)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    x = np.ones((2, 1024), np.float32)
    for attempt in range(3):
        try:
            np.asarray(f(x))
            print("call", attempt, "ok")
        except Exception as e:
            print("call", attempt, type(e).__name__, str(e).splitlines()[0][:300])
""")


@needs_2_gpus
def test_gpu_timeout_is_reported_at_the_next_call():
    proc = subprocess.run([sys.executable, "-c", GPU_TIMEOUT_SCRIPT], capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert "timed out waiting for rank 1" in out, out[-3000:]
    assert "DEADLINE_EXCEEDED" in out or "DeadlineExceeded" in out or "deadline" in out.lower()


@needs_cuda_build
def test_cuda_lowering_default_blocks_from_the_model():
    """blocks=None: the h100 profile's choice for this size and group, recorded in the HLO."""
    from libra_jax.dropins import DEFAULT_PROFILES, default_blocks

    text = lower_for_cuda(lambda v: libra_jax.psum(v * 2.0, "x"), shape=(8, 1 << 18))
    expected = default_blocks((1 << 18) * 4, 8, DEFAULT_PROFILES["cuda"])
    calls = custom_calls(text)
    assert calls and all(f"blocks = {expected} : i64" in line for line in calls)


# --- benchmarks/gpu_check.sh's budget (any machine with nvcc) ------------------

@pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="gpu_check.sh needs nvcc")
def test_gpu_check_skips_what_its_budget_has_no_room_for(tmp_path):
    """With 12 s for everything, the environment step runs and every later step is a SKIP
    naming the budget: the script ends at once, exits 0, and leaves at most 6 files (what
    comes back from the GPU machine). CI's dry run checks the full run's steps and files."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"),
           "PYTHON": sys.executable, "GPU_CHECK_BUDGET_S": "12"}
    proc = subprocess.run(["bash", str(root / "benchmarks/gpu_check.sh"), "--dry-run"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert re.search(r"^env +INFO", summary, re.M), summary
    assert re.search(r"^build +SKIP +budget: -?\d+s of 12s left", summary, re.M), summary
    assert not re.search(r"^\S+ +(PASS|FAIL)", summary, re.M), summary
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert len(files) <= 6, files


def test_build_info_says_what_the_build_has():
    # In a subprocess: build_info opens NCCL, once per process (here: one that does not load).
    code = "import json, libra_jax; print('INFO', json.dumps(libra_jax.build_info()))"
    env = {**os.environ, "LIBRA_JAX_NCCL_LIBRARY": "/nonexistent/libnccl.so.2", "XLA_FLAGS": xla_flags(None)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.split("INFO", 1)[1])
    assert info["version"] == libra_jax.__version__ and info["cuda"] == _ffi.HAS_CUDA
    assert info["cuda_path"] in ("xla", "p2p", "nccl")
    assert "cannot load /nonexistent/libnccl.so.2" in info["nccl"]["error"]
    assert info["gpus_visible"] == 0  # this CPU machine: says plainly what runs here
    built = "built with CUDA, no GPU visible, NCCL not found" if _ffi.HAS_CUDA else (
        "built without CUDA, no GPU visible")
    assert info["runs_here"] == f"{built}: the CPU path runs (libra's engine on the host devices)"
    if _ffi.HAS_CUDA:  # the compiler CMake used, its version and the archs built for
        assert info["cuda_compiler"].endswith("nvcc") and info["cuda_version"][:2].isdigit()
        assert "90" in info["cuda_architectures"]


@pytest.mark.parametrize("cuda, path, nccl, want", [
    (False, "xla", {"error": "x"}, "but this build has no CUDA calls: XLA's collectives run"),
    (True, "xla", {"version": "2.27.3"}, "NCCL 2.27.3 found: XLA's collectives run on them"),
    (True, "p2p", {"error": "x"}, "libra's P2P kernels run within a process"),
    (True, "nccl", {"error": "x"}, "NCCL not found: XLA's collectives run on them"),
    (True, "nccl", {"version": "2.27.3"}, "NCCL runs libra's collectives")])
def test_build_info_says_what_runs_on_a_gpu_machine(cuda, path, nccl, want):
    info = {"cuda": cuda, "cuda_path": path, "nccl": nccl, "gpus_visible": 1}
    said = _ffi._runs_here(info)
    assert said.startswith("1 GPU(s) visible") and want in said, said
