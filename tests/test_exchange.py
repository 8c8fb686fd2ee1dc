"""`libra_jax.all_to_all` and its op (`libra_jax.ops.exchange`, the fourth kind, issue 72):
bit for bit `jax.lax.all_to_all` on CPU in every form (split and concat axes, tiled or not),
dtype and device count, its transpose under autodiff, on libra's engine with a block count;
and `optimize` issuing an expert-parallel step's all-to-alls as libra's."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _compat, _ffi
from libra_jax.ops.exchange import arrange

from conftest import assert_bitwise, assert_trees_close, mesh_of

pytestmark = pytest.mark.usefixtures("jax_8")


def forms(n):
    """(shape, split_axis, concat_axis, tiled) of a device's block, every form JAX takes."""
    for shape in [(2 * n, 3), (3, n, 2), (n, 5), (2, 3, 2 * n)]:
        for split, concat in itertools.product(range(len(shape)), repeat=2):
            for tiled in (True, False):
                if shape[split] % n == 0 and (tiled or shape[split] == n):
                    yield shape, split, concat, tiled


def mapped(f, n):
    mesh = mesh_of((n,), ("x",))
    return jax.jit(jax.shard_map(lambda v: f(v[0])[None], mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x")))


def test_arrange_is_the_primitives_layout():
    """The engine's result (this rank's segment of every rank, in the operand's shape) made
    the primitive's by `arrange`, computed from the definition in NumPy, for every split and
    concat axis (the primitive always splits and concatenates: its ``tiled`` is layout-free)."""
    n = 4
    for shape in [(2 * n, 3), (3, n, 2), (1, n, 1), (2, 3, 2 * n)]:
        for split, concat in itertools.product(range(len(shape)), repeat=2):
            if shape[split] % n:
                continue
            xs = np.random.default_rng(0).standard_normal((n, *shape)).astype(np.float32)
            want = mapped(lambda v: _compat.all_to_all_p.bind(
                v, axis_name=("x",), split_axis=split, concat_axis=concat,
                axis_index_groups=None, tiled=True), n)(xs)
            k = shape[split] // n
            for d in range(n):
                y = np.concatenate([np.take(xs[s], range(d * k, (d + 1) * k), axis=split)
                                    for s in range(n)], axis=split)
                np.testing.assert_array_equal(arrange(jnp.asarray(y), n, split, concat), want[d])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bitwise_jax_in_every_form(n):
    """Every split/concat/tiled form on 2, 4 and 8 devices: the same bits as
    jax.lax.all_to_all, and libra's call in the CPU program."""
    assert _ffi.has_target("all-to-all", "cpu")
    rng = np.random.default_rng(n)
    for shape, split, concat, tiled in forms(n):
        xs = rng.standard_normal((n, *shape)).astype(np.float32)
        ours = mapped(lambda v: libra_jax.all_to_all(v, "x", split, concat, tiled=tiled), n)
        want = mapped(lambda v: jax.lax.all_to_all(v, "x", split, concat, tiled=tiled), n)(xs)
        assert_bitwise(ours(xs), want)
        text = ours.lower(xs).as_text()
        assert "libra_all_to_all_cpu" in text and "stablehlo.all_to_all" not in text, (
            shape, split, concat, tiled)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, jnp.bfloat16, np.int8, np.int64,
                                   np.bool_, np.float16])
@pytest.mark.parametrize("blocks", [None, 1, 3, 8])
def test_every_dtype_and_block_count(dtype, blocks):
    """A copy by bytes: every dtype of whole bytes, the same bits at every block count."""
    n = 8
    xs = (np.random.default_rng(1).standard_normal((n, 4 * n, 5)) * 50).astype(dtype)
    ours = mapped(lambda v: libra_jax.all_to_all(v, "x", 0, 1, tiled=True, blocks=blocks), n)
    want = mapped(lambda v: jax.lax.all_to_all(v, "x", 0, 1, tiled=True), n)(xs)
    assert_bitwise(ours(xs), want)
    assert "libra_all_to_all_cpu" in ours.lower(xs).as_text()


def test_transpose_is_the_all_to_all_back():
    """jax.grad through libra's all-to-all is libra's all-to-all with the axes swapped: the
    same gradient as through JAX's, and libra's call in the backward pass too."""
    n = 8
    mesh = mesh_of((n,), ("x",))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n * 16, 3)).astype(np.float32)
    w = rng.standard_normal((16 // n, 3 * n)).astype(np.float32)

    def loss_with(all_to_all):
        def local(v):
            y = all_to_all(v, "x", 0, 1, tiled=True)
            return jnp.sum(jnp.tanh(y) * w)[None]
        f = jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return jax.jit(jax.grad(lambda v: jnp.sum(f(v))))
    ours, want = loss_with(libra_jax.all_to_all), loss_with(jax.lax.all_to_all)
    assert_bitwise(ours(x), want(x))
    assert ours.lower(x).as_text().count("libra_all_to_all_cpu") == 2


def test_pytrees_and_refusals():
    n = 4
    mesh = mesh_of((n,), ("x",))
    tree = {"a": np.ones((n * n, 2), np.float32), "b": np.arange(n * n * 2, dtype=np.int32)}
    f = jax.jit(jax.shard_map(lambda t: libra_jax.all_to_all(t, "x", 0, 0, tiled=True),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    g = jax.jit(jax.shard_map(lambda t: jax.lax.all_to_all(t, "x", 0, 0, tiled=True),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    jax.tree.map(assert_bitwise, f(tree), g(tree))
    with pytest.raises(ValueError, match="blocks"):
        libra_jax.all_to_all(np.ones(4), "x", 0, 0, blocks=0)
    with pytest.raises(ValueError, match="has to be divisible by the size of the named axis"):
        jax.jit(jax.shard_map(lambda v: libra_jax.all_to_all(v, "x", 0, 0, tiled=True),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x")))(np.ones((n * 3,)))


# --- optimize: an expert-parallel layer's dispatch and combine --------------------------------

def moe_step():
    """tests/corpus.py's expert-parallel step, jitted, and its arguments."""
    import corpus
    step, params, x = corpus.moe_step()
    return jax.jit(step), (params, x)


def test_optimize_issues_each_all_to_all_as_libras():
    """Every all-to-all of plain's program is libra's call in the optimized one (none of
    XLA's left), at a priced block count; values bitwise the XLA control, class 3 of plain."""
    step, args = moe_step()
    plain_hlo = step.lower(*args).compile().as_text()
    fast = jax.jit(libra_jax.optimize(step))
    control = jax.jit(libra_jax.optimize(step, collectives="xla"))
    hlo = fast.lower(*args).compile().as_text()
    xla_all_to_alls = plain_hlo.count(" all-to-all(")
    assert xla_all_to_alls == 4  # dispatch and combine, forward and backward
    assert hlo.count("libra_all_to_all_cpu") == xla_all_to_alls and " all-to-all(" not in hlo
    jax.tree.map(assert_bitwise, fast(*args), control(*args))
    assert_trees_close(fast(*args), step(*args))
    opt = libra_jax.optimize(step)
    opt(*args)
    exchanged = [p for p in opt.last_report.plans if p.collective.kind == "all-to-all"]
    assert len(exchanged) == 4 and all(p.blocks >= 1 for p in exchanged)
    assert {p.kind for p in exchanged} == {"forward", "backward"}
