"""libra_jax.testing: the class-3 comparison catches a wrong result, and says where."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from libra_jax import testing

from conftest import assert_codegen_close, mesh_of, shard


def test_a_gradient_off_by_one_part_in_ten_thousand_fails_the_bound():
    """The wrong-result check: a real GSPMD gradient and the route's (two programs, class 3)
    pass; the route's scaled by 1 + 1e-4, or with one entry off by 1e-4 of the leaf's
    scale, fail."""
    import libra_jax

    mesh = mesh_of((8,), ("data",))
    rng = np.random.default_rng(0)
    w = shard(rng.standard_normal((16, 8)).astype(np.float32) / 4, mesh, P())
    x = shard(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("data"))

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    want = jax.jit(jax.value_and_grad(loss))(w, x)
    got = jax.jit(libra_jax.value_and_grad(loss, axis_name="data", mesh=mesh))(w, x)
    assert_codegen_close(got, want)  # recorded for benchmarks/codegen_bounds.py
    value, grad = got
    with pytest.raises(AssertionError, match=r"\[1\] differs by 8\d\d x eps .*bound 16"):
        testing.assert_codegen_close((value, grad * np.float32(1 + 1e-4)), want)
    with pytest.raises(AssertionError, match=r"\[0\] differs"):
        testing.assert_codegen_close((value * np.float32(1 + 1e-4), grad), want)
    g = np.array(grad)
    g[3, 2] += 1e-4 * np.max(np.abs(g))
    with pytest.raises(AssertionError):
        testing.assert_codegen_close((value, g), want)
    assert 800 < testing.codegen_error(np.asarray(grad) * np.float32(1 + 1e-4), want[1]) < 900


def test_the_error_is_in_units_of_the_leafs_scale_and_its_dtype():
    want = np.array([1.0, 1e-6, -2.0], np.float32)
    eps = np.finfo(np.float32).eps
    assert testing.codegen_error(want, want) == 0
    # A near-zero entry off by 100% is one eps of the leaf's scale (2.0) away, not a failure.
    near_zero = want.copy()
    near_zero[1] += 1e-6
    assert testing.codegen_error(near_zero, want) == pytest.approx(1e-6 / (2 * eps), rel=1e-3)
    bf16 = np.array([1.0, 0.5], jnp.bfloat16)
    off = np.array([1.0078125, 0.5], jnp.bfloat16)  # one bf16 ulp at 1.0: eps 2**-7
    assert testing.codegen_error(off, bf16) == pytest.approx(1.0)


@pytest.mark.parametrize("got, want", [
    (np.array([np.nan, 1.0]), np.array([1.0, np.nan])),          # NaN moved
    (np.array([np.inf, 1.0]), np.array([-np.inf, 1.0])),         # infinity's sign
    (np.array([np.nan, 1.0]), np.array([1.0, 1.0])),             # a NaN that should not be
    (np.array([1, 2], np.int32), np.array([1, 3], np.int32)),    # integers: equal or not
    (np.array([1e-30], np.float32), np.array([0.0], np.float32)),  # want all zero
    (np.zeros(2, np.float32), np.zeros(3, np.float32)),           # shapes
    (np.zeros(2, np.float32), np.zeros(2, np.float64)),           # dtypes
])
def test_what_is_never_close(got, want):
    assert testing.codegen_error(got, want) == np.inf
    with pytest.raises(AssertionError):
        testing.assert_codegen_close(got, want)


def test_nans_and_infinities_in_the_same_places_are_close():
    want = np.array([np.nan, np.inf, 3.0], np.float32)
    testing.assert_codegen_close(want.copy(), want)
    testing.assert_bitwise(want.copy(), want)


def test_assert_bitwise_names_the_leaf_and_the_tree():
    a = {"w": np.float32([1.0, 2.0]), "b": np.int32([1])}
    testing.assert_bitwise(a, {k: v.copy() for k, v in a.items()})
    with pytest.raises(AssertionError, match=r"\['w'\]: not bitwise"):
        testing.assert_bitwise({**a, "w": np.nextafter(a["w"], 3)}, a)
    with pytest.raises(AssertionError, match="different trees"):
        testing.assert_bitwise({"w": a["w"]}, a)
    with pytest.raises(AssertionError, match=r"\['b'\]: float32\[1\] against int32\[1\]"):
        testing.assert_bitwise({**a, "b": np.float32([1])}, a)
