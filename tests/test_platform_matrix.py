"""The platform matrix: every Libra primitive (`libra_psum`, the fused bucket, start/done)
lowers on every platform with a Libra all-reduce to Libra's calls, carrying the planned block
counts, and never to XLA's `all_reduce`; where a platform's path does not serve a psum, it
lowers to XLA's all-reduce with a one-time notice.

Everything here is lowering, so it runs on this machine for `cuda` too. On `cuda` the matrix
runs once per data path `LIBRA_JAX_CUDA` selects: ``xla`` (the default) expects XLA's
all-reduce, ``p2p`` Libra's P2P calls, ``nccl`` libra's NCCL call where NCCL loads (here: the
stub, tests/test_nccl.py), else XLA's with a notice. In a build without CUDA (`_ffi.HAS_CUDA` false) every `cuda` case
expects the fallback instead.
"""
from __future__ import annotations

import re
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _compat, _ffi, dropins, rewrite

from conftest import mesh_of, shard

pytestmark = pytest.mark.usefixtures("jax_8")

PROFILES = {"cpu": "cpu-host", "cuda": "h100"}
MODES = rewrite.OVERLAP_MODES
CALL = re.compile(r"stablehlo\.custom_call @(libra_allreduce_\w+)\(.*?blocks = (\d+) : i64"
                  r"|stablehlo\.custom_call @(libra_allreduce_\w+_done)\(")


def two_dtype_step(mesh):
    """A check_vma data-parallel step whose gradients are f32 and bf16 (one fused bucket of
    two dtypes under the GPU and CPU profiles), with a forward pmean of the loss."""
    def local(params, x):
        def loss(params):
            h = x
            for w in params:
                h = jnp.tanh((h.astype(w.dtype) @ w).astype(jnp.float32))
            return jax.lax.pmean(jnp.mean(h * h), "x")
        value, grads = jax.value_and_grad(loss)(params)
        return value, [w - (0.1 * g).astype(w.dtype) for w, g in zip(params, grads)]

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()),
                         check_vma=True)


def step_args(mesh, abstract: bool):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal((16, 32)).astype(np.float32),
              rng.standard_normal((32, 8)).astype(jnp.bfloat16)]
    x = rng.standard_normal((8 * mesh.shape["x"], 16)).astype(np.float32)
    if abstract:
        return ([jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=jax.NamedSharding(mesh, P()))
                 for p in params],
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.NamedSharding(mesh, P("x"))))
    return params, shard(x, mesh, P("x"))


def lower(platform, mode, fused, *, mesh=None):
    """(HLO text, report) of the optimized step lowered for `platform`."""
    mesh = mesh if mesh is not None else mesh_of((8,), ("x",))
    abstract = isinstance(mesh, jax.sharding.AbstractMesh)
    opt = libra_jax.optimize(two_dtype_step(mesh), profile=PROFILES[platform], fusion=fused,
                             overlap=mode)
    text = jax.jit(opt).trace(*step_args(mesh, abstract)).lower(
        lowering_platforms=(platform,)).as_text()
    return text, opt.last_report


def planned_calls(report, members, platform):
    """The Libra calls the plan asks for: (target, blocks) per dtype of each planned
    all-reduce (start/done: a start with the blocks and a done; done carries none). On CUDA
    (the P2P kernels) a member that is not whole 16-byte vectors (the loss's pmean, planned
    with the gradients) is its own one call, and a dtype left with no other member makes no
    bucket call (no start, no done)."""
    out = Counter()
    for plan in report.plans:
        by_dtype: dict[str, list[int]] = {}
        for dtype, nbytes in members(plan):
            by_dtype.setdefault(dtype, []).append(nbytes)
        for sizes in by_dtype.values():
            odd = [n for n in sizes if n % 16] if platform == "cuda" else []
            out[(f"libra_allreduce_{platform}", plan.blocks)] += len(odd)
            if len(odd) == len(sizes):
                continue
            if plan.overlap == "start-done":
                out[(f"libra_allreduce_{platform}_start", plan.blocks)] += 1
                out[(f"libra_allreduce_{platform}_done", None)] += 1
            else:
                out[(f"libra_allreduce_{platform}", plan.blocks)] += 1
    return +out


def lowered_calls(text):
    out = Counter()
    for m in CALL.finditer(text):
        if m.group(3):
            out[(m.group(3), None)] += 1
        else:
            out[(m.group(1), int(m.group(2)))] += 1
    return out


def dtypes_of(mesh):
    """plan -> the set of dtypes of its members, read from the traced step's jaxpr."""
    abstract = isinstance(mesh, jax.sharding.AbstractMesh)
    closed = jax.make_jaxpr(two_dtype_step(mesh))(*step_args(mesh, abstract))

    def scope_eqns(scope):
        jaxpr = closed.jaxpr
        for name in scope.split("/")[1:]:
            eqn = next(e for e in jaxpr.eqns if e.primitive.name == name)
            sub, = _compat.jaxprs_in_params(eqn.params)
            jaxpr = getattr(sub, "jaxpr", sub)
        return jaxpr.eqns

    def dtypes(plan):
        return {dtype for dtype, _ in members(plan)}

    def members(plan):
        eqns = scope_eqns(plan.scope)
        avals = [eqns[i].invars[0].aval for i in plan.members]
        return [(np.dtype(a.dtype).name, a.size * np.dtype(a.dtype).itemsize) for a in avals]
    dtypes.members = members
    return dtypes


def cuda_serves(path: str) -> bool:
    return _ffi.HAS_CUDA and path == "p2p"


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr("libra_jax.ops.base._warned", set())


@pytest.mark.parametrize("fused", [False, True], ids=["single", "fused"])
@pytest.mark.parametrize("mode", MODES)
def test_cpu_lowers_every_primitive_to_libra_calls_with_the_planned_blocks(mode, fused):
    mesh = mesh_of((8,), ("x",))
    text, report = lower("cpu", mode, fused, mesh=mesh)
    if fused:  # the case bug 1 was about: one bucket of two dtypes
        assert any(len(dtypes_of(mesh)(p)) == 2 for p in report.plans), report.plan_lines()
    if mode == "start-done":
        assert all(p.overlap == "start-done" for p in report.plans if p.kind == "gradient")
    assert lowered_calls(text) == planned_calls(report, dtypes_of(mesh).members, "cpu")
    assert "all_reduce" not in text


@pytest.mark.parametrize("fused", [False, True], ids=["single", "fused"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", ["xla", "p2p", "nccl"])
def test_cuda_lowers_by_the_data_path(monkeypatch, fresh_warnings, path, mode, fused):
    """p2p: Libra's calls with the planned blocks, no XLA all-reduce. xla (the default), and
    nccl where NCCL does not load: XLA's all-reduce, no Libra call, a notice naming why.
    Without a CUDA build: the fallback for every path."""
    monkeypatch.setenv("LIBRA_JAX_CUDA", path)
    monkeypatch.setenv("LIBRA_JAX_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    mesh = mesh_of((8,), ("x",))
    if cuda_serves(path):
        text, report = lower("cuda", mode, fused, mesh=mesh)
        if fused:
            assert any(len(dtypes_of(mesh)(p)) == 2 for p in report.plans), report.plan_lines()
        assert lowered_calls(text) == planned_calls(report, dtypes_of(mesh).members, "cuda")
        assert "all_reduce" not in text
        return
    # A build without CUDA falls back on every path, p2p included, for that reason.
    reason = ("built without CUDA" if not _ffi.HAS_CUDA else
              {"xla": "LIBRA_JAX_CUDA=xla, the default", "nccl": "cuda without NCCL"}[path])
    with pytest.warns(UserWarning, match=re.escape(reason)):
        text, report = lower("cuda", mode, fused, mesh=mesh)
    assert report.plans  # planned and reported all the same
    assert "libra_allreduce" not in text and "all_reduce" in text


@pytest.mark.parametrize("mode", MODES)
def test_cuda_p2p_delegates_more_than_8_gpus_to_xla(monkeypatch, fresh_warnings, mode):
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    mesh = jax.sharding.AbstractMesh((16,), ("x",))
    reason = ("more than 8 GPUs" if _ffi.HAS_CUDA else "built without CUDA")
    with pytest.warns(UserWarning, match=reason):
        text, report = lower("cuda", mode, True, mesh=mesh)
    assert report.plans and "libra_allreduce" not in text and "all_reduce" in text


@pytest.mark.parametrize("mode", MODES)
def test_cuda_p2p_delegates_a_dtype_the_kernels_do_not_serve(monkeypatch, fresh_warnings, mode):
    # An s64 count psum'd beside f32 gradients: XLA takes the s64, Libra the rest.
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    mesh = mesh_of((8,), ("x",))

    def local(w, x, n):
        def loss(w):
            return jax.lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2), "x")
        value, g = jax.value_and_grad(loss)(w)
        return value, w - 0.1 * g, jax.lax.psum(n, "x")

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x"), P("x")),
                         out_specs=(P(), P(), P()), check_vma=True)
    with jax.enable_x64(True):
        args = (np.ones((16, 8), np.float32), shard(np.ones((64, 16), np.float32), mesh, P("x")),
                shard(np.arange(8, dtype=np.int64), mesh, P("x")))
        opt = libra_jax.optimize(step, profile="h100", overlap=mode)
        reason = "cuda int64" if _ffi.HAS_CUDA else "built without CUDA"
        with pytest.warns(UserWarning, match=reason):
            text = jax.jit(opt).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "all_reduce" in text
    if _ffi.HAS_CUDA:
        assert lowered_calls(text), text  # the f32 gradient and loss: Libra's
        # XLA's all-reduce reduces only 64-bit integers (its reduction body's argument type).
        ar_types = re.findall(r'"stablehlo.all_reduce".*\n\s*\^bb0\(%\w+: tensor<(\w+)>', text)
        assert ar_types and set(ar_types) == {"i64"}, ar_types


def test_every_libra_primitive_has_a_cpu_and_a_cuda_lowering():
    """Read from JAX's lowering table: a primitive registered without a platform's rule
    silently takes the default (XLA's all-reduce) there -- bug 1 of the platform matrix."""
    from jax._src.interpreters import mlir

    from libra_jax import ops
    prims = [dropins.libra_psum_p, rewrite.libra_bucket_p, ops.libra_start_p,
             ops.libra_done_p, ops.libra_reduce_scatter_p, ops.libra_all_gather_p]
    for platform in ("cpu", "cuda"):
        table = mlir._platform_specific_lowerings[platform]
        missing = [p.name for p in prims if p not in table]
        assert not missing, (platform, missing)


# --- The sharded pair: reduce-scatter and all-gather -------------------------------------

SHARDED_CALL = re.compile(r"stablehlo\.custom_call @(libra_(?:reduce_scatter|all_gather)_cpu"
                          r"(?:_start)?)\(.*?blocks = (\d+) : i64")


def sharded_step(form, mesh):
    """A reduce-scatter of a gradient-like value and an all-gather of a parameter shard, with
    5 blocks, as one call each or as start/done pairs."""
    from test_sharded import split_pair

    def body(g, w):
        if form == "one-call":
            return (libra_jax.psum_scatter(g, "x", tiled=True, blocks=5),
                    libra_jax.all_gather(w, "x", tiled=True, blocks=5))
        return (split_pair("psum_scatter", g, ("x",), dimension=0, tiled=True, blocks=5,
                           call_id=3),
                split_pair("all_gather", w, ("x",), dimension=0, tiled=True, blocks=5,
                           call_id=4))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                                 out_specs=(P("x"), P("x")), check_vma=False))


def sharded_args(mesh):
    rng = np.random.default_rng(1)
    return (shard(rng.standard_normal((8 * 16, 4)).astype(np.float32), mesh, P("x")),
            shard(rng.standard_normal((8 * 2, 4)).astype(np.float32), mesh, P("x")))


@pytest.mark.parametrize("form", ["one-call", "start-done"])
def test_cpu_lowers_the_sharded_pair_to_libra_calls_with_their_blocks(form):
    mesh = mesh_of((8,), ("x",))
    text = sharded_step(form, mesh).trace(*sharded_args(mesh)).lower(
        lowering_platforms=("cpu",)).as_text()
    suffix = "_start" if form == "start-done" else ""
    assert Counter(SHARDED_CALL.findall(text)) == Counter(
        {(f"libra_reduce_scatter_cpu{suffix}", "5"): 1, (f"libra_all_gather_cpu{suffix}", "5"): 1})
    assert text.count("custom_call @libra_allreduce_cpu_done(") == (2 if suffix else 0)
    assert "stablehlo.reduce_scatter" not in text and "stablehlo.all_gather" not in text


@pytest.mark.parametrize("form", ["one-call", "start-done"])
@pytest.mark.parametrize("path", ["xla", "p2p", "nccl"])
def test_cuda_lowers_the_sharded_pair_to_xla_with_a_notice(monkeypatch, fresh_warnings, path,
                                                            form):
    """libra's GPU reduce-scatter, all-gather and all-to-all are NCCL's: on the xla and p2p
    paths, and on nccl where NCCL does not load, XLA's collectives, one call or start/done,
    no libra call, and the notice naming why (with NCCL: tests/test_nccl.py)."""
    monkeypatch.setenv("LIBRA_JAX_CUDA", path)
    monkeypatch.setenv("LIBRA_JAX_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    mesh = mesh_of((8,), ("x",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = sharded_step(form, mesh).trace(*sharded_args(mesh)).lower(
            lowering_platforms=("cuda",)).as_text()
    said = " ".join(str(w.message) for w in caught)
    why = ("cuda without NCCL" if path == "nccl" and _ffi.HAS_CUDA else
           "built without CUDA" if not _ffi.HAS_CUDA else
           f"LIBRA_JAX_CUDA={path}: libra's GPU reduce-scatter, all-gather and all-to-all are "
           "NCCL's")
    for kind in ("reduce-scatter", "all-gather"):
        assert f"no Libra {kind} for cuda" in said and why in said, said
    assert "libra_" not in text
    assert "stablehlo.reduce_scatter" in text and "stablehlo.all_gather" in text
