"""`libra_jax.rewrite.transposes`: a psum_scatter that reads a transpose alone (an FSDP weight's
gradient as autodiff writes it, ``transpose(dot_general(dy, x))``) is issued before the
transpose, along the dimension the transpose moves to the scattered one, and the shard is
transposed after; values bitwise the XLA control's and class 3 of the plain step's, the
operand a contraction's own result (XLA:CPU then fuses the dot as GSPMD's program does)."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from libra_jax import _compat
from libra_jax.rewrite import optimize, rewrite_jaxpr
from libra_jax.rewrite.transposes import scatter_before_transpose

from conftest import assert_bitwise, assert_codegen_close, mesh_of, shard

pytestmark = pytest.mark.usefixtures("jax_8")

ROOT = Path(__file__).resolve().parents[1]


def _fsdp_step(dims=(0, 1, 0)):
    """Three weights sharded along `dims` (as FSDP shards them), all-gathered for the loss;
    their full gradients psum_scatter-ed back along the same dimensions, each read through a
    transpose (the weight gradient's as autodiff writes it)."""
    mesh = mesh_of((8,), ("data",))

    def local(ws, x):
        full = [jax.lax.all_gather(w, "data", axis=d, tiled=True) for w, d in zip(ws, dims)]

        def loss(full):
            h = x
            for w in full:
                h = jnp.tanh(h @ w)
            return jnp.mean(h ** 2)
        grads = jax.grad(loss)(full)
        shards = [jax.lax.psum_scatter(g, "data", scatter_dimension=d, tiled=True)
                  for g, d in zip(grads, dims)]
        return [w - 0.1 * g for w, g in zip(ws, shards)]

    specs = [P(*([None] * d), "data") for d in dims]
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")),
                                 out_specs=specs, check_vma=False))
    rng = np.random.default_rng(0)
    ws = [shard(rng.standard_normal((64, 64)).astype(np.float32), mesh, s) for s in specs]
    x = shard(rng.standard_normal((8 * 16, 64)).astype(np.float32), mesh, P("data"))
    return step, (ws, x)


def _scatters(jaxpr):
    """(scatter_dimension, the producer's primitive name) of each psum_scatter, every scope."""
    found = []

    def walk(j):
        producer = {v: e for e in j.eqns for v in e.outvars if _compat.is_var(v)}
        for e in j.eqns:
            if e.primitive.name == "reduce_scatter":
                src = producer.get(e.invars[0])
                found.append((int(e.params["scatter_dimension"]),
                              src.primitive.name if src is not None else None))
            for sub in _compat.jaxprs_in_params(e.params):
                walk(sub)
    walk(jaxpr)
    return found


def test_a_scatter_of_a_transpose_moves_before_it():
    step, args = _fsdp_step()
    closed = jax.make_jaxpr(step)(*args)
    before = _scatters(closed.jaxpr)
    assert [src for _, src in before] == ["transpose"] * 3, before  # autodiff's form
    body = next(e for e in _all_eqns(closed.jaxpr) if e.primitive.name == "shard_map").params["jaxpr"]
    moved = scatter_before_transpose(body.eqns, body.outvars)
    assert len(moved) == len(body.eqns)
    producer = {v: e for e in moved for v in e.outvars if _compat.is_var(v)}
    scatters = [e for e in moved if e.primitive.name == "reduce_scatter"]
    # Each reads the contraction's result, along the other dimension (a 2-D transpose's),
    # and a transpose of its shard writes the old result.
    assert [producer[e.invars[0]].primitive.name for e in scatters] == ["dot_general"] * 3
    assert sorted(int(e.params["scatter_dimension"]) for e in scatters) == [0, 1, 1]
    readers = {v: e for e in moved for v in e.invars if _compat.is_var(v)}
    for e in scatters:
        t = readers[e.outvars[0]]
        assert t.primitive.name == "transpose"
        assert t.outvars[0].aval.shape == (8, 64) or t.outvars[0].aval.shape == (64, 8)


def test_nothing_else_moves():
    """A transpose read by another equation too, or a scatter not tiled, stays."""
    mesh = mesh_of((8,), ("data",))

    def twice(x):
        t = x.T
        return jax.lax.psum_scatter(t, "data", tiled=True), t * 2

    def untiled(x):
        return jax.lax.psum_scatter(x.T, "data", tiled=False)

    for f in (twice, untiled):
        body = jax.make_jaxpr(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("data"),
                                            check_vma=False))(jnp.ones((8, 8))).jaxpr
        inner = body.eqns[0].params["jaxpr"]
        assert scatter_before_transpose(inner.eqns, inner.outvars) == list(inner.eqns)


@pytest.mark.parametrize("dims", [(0, 1, 0), (1, 1, 1)])
def test_values_bitwise_the_control_and_class_3_of_plain(dims):
    step, args = _fsdp_step(dims)
    opt = optimize(step)
    got = jax.jit(opt)(*args)
    control = jax.jit(optimize(step, collectives="xla"))(*args)
    jax.tree.map(assert_bitwise, got, control)
    assert_codegen_close(got, step(*args))
    scatters = [p for p in opt.last_report.plans if p.collective.kind == "reduce-scatter"]
    assert sum(len(p.members) for p in scatters) == 3


def test_the_fsdp_examples_weight_gradients_are_scattered_as_contracted():
    """The FSDP example (examples/fsdp.py, the GSPMD route): before this pass every weight
    gradient's psum_scatter read a transpose; under `optimize` none does."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    common = _load(ROOT / "examples" / "common.py", "common")
    step, args = common.load_example("fsdp").build(True)
    plain = _scatters(jax.make_jaxpr(step)(*args).jaxpr)
    assert any(src == "transpose" for _, src in plain), plain
    rewritten, _ = rewrite_jaxpr(jax.make_jaxpr(step)(*args))
    libra = [e for e in _all_eqns(rewritten.jaxpr) if "scatter" in e.primitive.name
             or e.primitive.name == "libra_bucket"]
    producers = {v: e for e in _all_eqns(rewritten.jaxpr) for v in e.outvars
                 if _compat.is_var(v)}
    assert libra
    for e in libra:
        for v in filter(_compat.is_var, e.invars):
            src = producers.get(v)
            assert src is None or src.primitive.name != "transpose", e


def _load(path, name):
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in _compat.jaxprs_in_params(e.params):
            yield from _all_eqns(sub)


@pytest.mark.parametrize("permutation, dimension", [((1, 0, 2), 0), ((2, 0, 1), 1),
                                                    ((0, 2, 1), 2), ((2, 1, 0), 0)])
def test_any_permutation_and_scattered_dimension(permutation, dimension):
    """A 3-D array transposed by `permutation` and reduce-scattered along `dimension` (the
    moved scatter is along ``permutation[dimension]``): the same values as the program
    written, bitwise (only data moves between them), and the scatter reads the array as
    computed."""
    mesh = mesh_of((8,), ("data",))
    shape = [3, 5, 7]
    shape[permutation[dimension]] = 16  # the dimension scattered over 8 ranks, 2 each

    def local(x):
        y = jnp.sin(x) * 3.0
        return jax.lax.psum_scatter(jnp.transpose(y, permutation), "data",
                                    scatter_dimension=dimension, tiled=True)

    out_shape = [shape[p] for p in permutation]
    out_spec = P(*([None] * dimension), "data")
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=out_spec,
                                 check_vma=False))
    x = np.random.default_rng(sum(permutation) + dimension).standard_normal(shape).astype(
        np.float32)
    opt = optimize(step)
    got = jax.jit(opt)(x)
    assert got.shape == tuple(out_shape)
    assert_bitwise(got, step(x))
    assert_bitwise(got, jax.jit(optimize(step, collectives="xla"))(x))
    body = next(e for e in _all_eqns(jax.make_jaxpr(step)(x).jaxpr)
                if e.primitive.name == "shard_map").params["jaxpr"]
    moved = scatter_before_transpose(body.eqns, body.outvars)
    scatter, = [e for e in moved if e.primitive.name == "reduce_scatter"]
    assert int(scatter.params["scatter_dimension"]) == permutation[dimension]
