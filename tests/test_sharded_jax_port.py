"""JAX's own psum_scatter and all_gather tests, run with libra_jax's drop-ins.

Ported from jax v0.10.2 (tag ``jax-v0.10.2``): ``tests/shard_map_test.py`` (ShardMapTest:
test_all_gather, test_all_gather_invariant_basic, test_all_gather_invariant_complex,
test_all_gather_with_axis_index_groups, test_matmul_reduce_scatter,
test_reduce_scatter_with_axis_index_groups, test_all_gather_with_vma_in_types) and
``tests/pmap_test.py`` (PythonPmapTest: testGather, testGatherBool, testGatherNegativeAxis,
testGatherTiled, testGatherTiledNegativeAxis, testVmapOf, testReduceScatter,
testReduceScatterTiled, testReduceScatterReplicaGroupsTiled, testGatherReplicaGroups,
testGatherReplicaGroupsInterleaved, testGradOf), Apache-2.0. Changed: `lax.psum_scatter` and
`lax.all_gather` are libra_jax's (`lax` below); unittest assertions are numpy's; JAX's test
utilities (`jtu.create_mesh`, `jtu.check_grads`) are their public equivalents
(`mesh_of`, `jax.test_util.check_grads`). Each test also checks that libra's call is the one
lowered where libra serves it (axis_index_groups is delegated to JAX, with its notice).
"""
from __future__ import annotations

import itertools as it
import math
import types
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of
from jax import pmap, vmap
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import libra_jax

pytestmark = [pytest.mark.usefixtures("jax_8"),
              pytest.mark.filterwarnings("ignore:libra_jax.*axis_index_groups")]

lax = types.SimpleNamespace(psum_scatter=libra_jax.psum_scatter,
                            all_gather=libra_jax.all_gather)
shard_map = jax.shard_map


def create_inputs(a_sharding, b_sharding, dtype=None):
    mesh = mesh_of((2, 2, 2), ("x", "y", "z"))
    b, e, f = 8, 8, 8
    m1 = jax.device_put(jnp.arange(b * e, dtype=dtype).reshape((b, e)),
                        NamedSharding(mesh, a_sharding))
    m2 = jax.device_put(jnp.arange(e * f, dtype=dtype).reshape((e, f)),
                        NamedSharding(mesh, b_sharding))
    return mesh, m1, m2


def assert_close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def check_gathered(c, d, a):
    """test_all_gather's and test_all_gather_invariant_complex's checks of their results."""
    assert c.addressable_data(0).shape == (8, 2)
    for i, a_shard in enumerate(np.split(a, 4, axis=1)):
        assert_close(c.addressable_data(2 * i), a_shard)
    assert d.addressable_data(0).shape == (4, 8)
    for i, a_shard in enumerate(np.split(a, 2, axis=0)):
        assert_close(d.addressable_data(i), a_shard)


def libra_lowers(f, *args, target):
    assert target in f.lower(*args).as_text(), f"{target} not lowered"


# --- tests/shard_map_test.py ------------------------------------------------------------

def test_all_gather():
    mesh, a, _ = create_inputs(P("z", ("x", "y")), P(None, None))
    assert a.addressable_data(0).shape == (4, 2)

    @jax.jit
    @partial(shard_map, mesh=mesh, in_specs=(P("z", ("x", "y")),),
             out_specs=P("z", ("x", "y")))
    def fwd(a):
        return (lax.all_gather(a, "z", axis=0, tiled=True),
                lax.all_gather(a, ("x", "y"), axis=-1, tiled=True))

    c, d = fwd(a)
    libra_lowers(fwd, a, target="libra_all_gather_cpu")
    check_gathered(c, d, a)


def test_all_gather_invariant_basic():
    mesh = mesh_of((4,), ("x",))
    arr = jnp.arange(8.)

    @jax.jit
    @partial(shard_map, mesh=mesh, in_specs=P("x"), out_specs=P())
    def f(a):
        out = lax.all_gather(a, "x", tiled=True, to="invarying")
        assert out.aval.mat.varying == set()
        return out

    out = f(arr)
    libra_lowers(f, arr, target="libra_all_gather_cpu")
    np.testing.assert_array_equal(out, arr)
    check_grads(f, (arr,), order=2)

    def g(x):
        return f(x).sum()
    out = jax.jit(jax.grad(g))(arr)
    assert out.shape == (8,)
    assert out.sharding == NamedSharding(mesh, P("x"))


def test_all_gather_invariant_complex():
    mesh, a, _ = create_inputs(P("z", ("x", "y")), P(None, None), dtype=np.float32)
    assert a.addressable_data(0).shape == (4, 2)

    @jax.jit
    @partial(shard_map, mesh=mesh, in_specs=(P("z", ("x", "y")),),
             out_specs=(P(None, ("x", "y")), P("z")))
    def f(a):
        c = lax.all_gather(a, "z", axis=0, tiled=True, to="invarying")
        assert jax.typeof(c).mat.varying == {"x", "y"}
        d = lax.all_gather(a, ("x", "y"), axis=-1, tiled=True, to="invarying")
        assert jax.typeof(d).mat.varying == {"z"}
        return c, d

    c, d = f(a)
    check_gathered(c, d, a)

    def g(x):
        return f(x)[0].sum()
    out1 = jax.jit(jax.grad(g))(a)
    assert out1.shape == (8, 8)
    assert out1.sharding == NamedSharding(mesh, P("z", ("x", "y")))
    out2 = jax.grad(g)(a)
    assert out2.shape == (8, 8)
    assert out2.sharding == NamedSharding(mesh, P("z", ("x", "y")))


def test_all_gather_with_axis_index_groups():
    mesh, a, _ = create_inputs(P("x", ("y", "z")), P(None, None))

    @jax.jit
    @partial(shard_map, mesh=mesh, in_specs=(P("x", ("y", "z")),),
             out_specs=P("x", ("y", "z")))
    def fwd(a):
        return lax.all_gather(a, ("y", "z"), axis_index_groups=((0, 1), (2, 3)), axis=-1,
                              tiled=True)

    c = fwd(a)
    assert c.addressable_data(0).shape == (4, 4)
    for i, row_block in enumerate(np.split(a, 2, axis=0)):
        for j, block in enumerate(np.split(row_block, 2, axis=-1)):
            assert_close(c.addressable_data(4 * i + 2 * j), block)


def test_matmul_reduce_scatter():
    mesh, a, b = create_inputs(P("z", "y"), P("y", None))
    assert a.addressable_data(0).shape == (4, 4)

    @jax.jit
    @partial(shard_map, mesh=mesh, in_specs=(P("z", "y"), P("y", None)),
             out_specs=P(("z", "y"), None))
    def fwd(a, b):
        c = jnp.matmul(a, b)  # [B.z, F] {y.unreduced}
        return (lax.psum_scatter(c, "y", scatter_dimension=0, tiled=True),
                lax.psum_scatter(c, ("z", "y"), scatter_dimension=0, tiled=True))

    expected = jnp.matmul(a, b)
    c, d = fwd(a, b)
    libra_lowers(fwd, a, b, target="libra_reduce_scatter_cpu")
    assert c.addressable_data(0).shape == (2, 8)
    assert_close(expected, c)
    assert d.addressable_data(0).shape == (1, 8)
    assert_close(expected[:4] + expected[4:], d)


def test_reduce_scatter_with_axis_index_groups():
    axis_index_groups = ((0, 2, 4, 6), (1, 3, 5, 7))
    mesh, a, _ = create_inputs(P(None, ("x", "y", "z")), P(None, None))
    assert a.addressable_data(0).shape == (8, 1)

    @jax.jit
    @partial(shard_map, mesh=mesh, in_specs=(P(None, ("x", "y", "z")),),
             out_specs=P(None, ("x", "y", "z")))
    def fwd(a):
        return lax.psum_scatter(a, ("x", "y", "z"), scatter_dimension=0,
                                axis_index_groups=axis_index_groups, tiled=True)

    c = fwd(a)
    assert c.addressable_data(0).shape == (2, 1)
    sum_of_even_columns = np.sum(a[..., axis_index_groups[0]], -1)
    for i, sums in enumerate(np.split(sum_of_even_columns, 4, 0)):
        assert_close(np.squeeze(c.addressable_data(2 * i), -1), sums)
    sum_of_odd_columns = np.sum(a[..., axis_index_groups[1]], -1)
    for i, sums in enumerate(np.split(sum_of_odd_columns, 4, 0)):
        assert_close(np.squeeze(c.addressable_data(2 * i + 1), -1), sums)


def test_all_gather_with_vma_in_types():
    mesh = mesh_of((2,), ("x",))
    x = np.arange(8.)

    def f(x):
        assert x.aval.mat.varying == frozenset()
        out = lax.all_gather(x, "x")
        assert out.aval.mat.varying == frozenset({"x"})
        return out

    f = jax.jit(shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("x")))
    jaxpr = f.trace(x).jaxpr
    assert "pvary[axes=('x',)" in str(jaxpr)
    f(x)  # doesn't crash


# --- tests/pmap_test.py -----------------------------------------------------------------

def test_gather():
    f = pmap(lambda x: lax.all_gather(x, "i"), axis_name="i")
    shape = (jax.device_count(), 4)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    assert_close(f(x), np.array([x] * jax.device_count()))


def test_gather_bool():
    f = pmap(lambda x: lax.all_gather(x, "i"), axis_name="i")
    shape = (jax.device_count(), 4)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    x = (x % 2).astype(np.bool_)
    np.testing.assert_array_equal(f(x), np.array([x] * jax.device_count()))


def test_gather_negative_axis():
    f = pmap(lambda x: lax.all_gather(x, "i", axis=-1), axis_name="i")
    shape = (jax.device_count(), 4)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    assert_close(f(x), np.array([x.T] * jax.device_count()))


def test_gather_tiled():
    f = pmap(lambda x: lax.all_gather(x, "i", tiled=True), axis_name="i")
    device_count = jax.device_count()
    shape = (device_count, 4)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    assert_close(f(x), np.array([x] * device_count).reshape(device_count, -1))


def test_gather_tiled_negative_axis():
    f = pmap(lambda x: lax.all_gather(x, "i", tiled=True, axis=-1), axis_name="i")
    device_count = jax.device_count()
    shape = (device_count, 4, 3)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    assert_close(f(x), np.array([x.transpose(1, 0, 2).reshape(4, -1)] * device_count))


@pytest.mark.parametrize("prim", [lax.all_gather, lax.psum_scatter],
                         ids=["Gather", "ReduceScatter"])
def test_vmap_of(prim):
    f = pmap(partial(prim, axis_name="i"), axis_name="i")
    device_count = jax.device_count()
    shape = (4, device_count, device_count)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    assert_close(vmap(f)(x), jnp.stack([f(xs) for xs in x], axis=0))


def test_reduce_scatter():
    f = pmap(lambda x: lax.psum_scatter(x, "i"), axis_name="i")
    device_count = jax.device_count()
    shape = (device_count, device_count)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    expected = np.sum(x, axis=0)
    for i, actual in enumerate(f(x)):
        assert_close(actual, expected[i])


def test_reduce_scatter_tiled():
    f = pmap(lambda x: lax.psum_scatter(x, "i", tiled=True), axis_name="i")
    device_count = jax.device_count()
    shape = (device_count, 4 * device_count)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    expected = np.sum(x, axis=0)
    scatter_len = len(expected) // device_count
    for i, actual in enumerate(f(x)):
        assert_close(actual, expected[i * scatter_len:(i + 1) * scatter_len])


def test_reduce_scatter_replica_groups_tiled():
    replicas = jax.device_count()
    axis_index_groups = [[i for i in range(replicas) if i % 2 == 0],
                         [i for i in range(replicas) if i % 2 != 0]]
    f = pmap(lambda x: lax.psum_scatter(x, "i", axis_index_groups=axis_index_groups,
                                        tiled=True), axis_name="i")
    shape = (replicas, 4 * replicas)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    ans = f(x)
    group_1_result = np.sum(x[0::2, :], axis=0)
    group_2_result = np.sum(x[1::2, :], axis=0)
    scatter_len = len(group_1_result) * 2 // replicas  # the group size is half the replicas
    for i, actual in enumerate(ans):
        expected = group_1_result if i % 2 == 0 else group_2_result
        assert_close(actual, expected[(i // 2) * scatter_len:(i // 2 + 1) * scatter_len])


def test_gather_replica_groups():
    replicas = jax.device_count()
    axis_index_groups = np.arange(replicas, dtype=np.int32).reshape((replicas // 2, 2)).T
    f = pmap(lambda x: lax.all_gather(x, "i", axis_index_groups=axis_index_groups.tolist()), "i")
    shape = (replicas, 4)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    expected = np.empty((replicas, replicas // 2, x.shape[1]))
    expected[0::2] = x[0::2]
    expected[1::2] = x[1::2]
    assert_close(f(x), expected)


def test_gather_replica_groups_interleaved():
    replicas = jax.device_count()
    indexes = np.arange(replicas)
    indexes = np.concatenate([indexes[::2], indexes[1::2]])
    axis_index_groups = indexes.reshape(2, replicas // 2).tolist()
    f = pmap(lambda x: lax.all_gather(x, "i", axis_index_groups=axis_index_groups), "i")
    shape = (replicas, 4)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    expected = np.zeros((replicas, replicas // 2, x.shape[1]))
    expected[::2] = x[::2]
    expected[1::2] = x[1::2]
    assert_close(f(x), expected)


@pytest.mark.parametrize("prim, tiled, use_axis_index_groups", list(it.chain.from_iterable(
    [(prim, False, False), (prim, True, False), (prim, False, True)]
    for prim in (lax.all_gather, lax.psum_scatter))),
    ids=["Gather", "GatherTiled", "GatherIndexGroups", "ReduceScatter", "ReduceScatterTiled",
         "ReduceScatterIndexGroups"])
def test_grad_of(prim, tiled, use_axis_index_groups):
    axis_index_groups = None
    devices = jax.devices()
    if use_axis_index_groups:
        axis_index_groups = [(l.id, r.id) for l, r in np.asarray(devices).reshape(-1, 2)]

    @partial(pmap, axis_name="i")
    def f(x):
        return prim(x, axis_name="i", tiled=tiled, axis_index_groups=axis_index_groups)

    shape = (len(devices), 2 if axis_index_groups else jax.device_count())
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_grads(f, (x,), 2, ["fwd", "rev"], 1e-2, 1e-2, eps=1.)
