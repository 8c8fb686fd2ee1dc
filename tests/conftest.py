"""Shared fixtures: 8 simulated CPU devices and meshes over any number of them."""
from __future__ import annotations

import os
import tempfile

# Before JAX starts its CPU backend (also for subprocesses spawned by tests).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# A user's calibrated profile must not change what the tests expect.
os.environ["LIBRA_JAX_PROFILE_DIR"] = tempfile.mkdtemp(prefix="libra_jax_test_profiles_")

import numpy as np
import pytest


def _jax():
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    return jax


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]):
    """A mesh over the first prod(shape) CPU devices."""
    jax = _jax()
    n = int(np.prod(shape))
    devices = np.array(jax.devices("cpu")[:n]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def shard(x, mesh, spec):
    jax = _jax()
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


def assert_bitwise(a, b) -> None:
    """Same dtype, shape and bytes (NaNs with the same payload compare equal)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), f"max |diff| = {np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))}"


@pytest.fixture(scope="session")
def jax_8():
    jax = _jax()
    assert len(jax.devices("cpu")) == 8, "tests need 8 host devices"
    return jax


def mlp_step(sizes=(16, 32, 32, 32, 8), dtype=np.float32, devices=8):
    """A check_vma data-parallel SGD step (autodiff psums each gradient where it is made) on
    the first `devices` CPU devices, and its arguments (a batch of 4 rows per device)."""
    jax = _jax()
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((m, n)) * 0.3).astype(dtype)
              for m, n in zip(sizes[:-1], sizes[1:])]
    mesh = mesh_of((devices,), ("x",))

    def local(params, x):
        def loss(params):
            h = x
            for w in params:
                h = jnp.tanh(h @ w)
            return jax.lax.pmean(jnp.mean(h * h), "x")
        loss_value, grads = jax.value_and_grad(loss)(params)
        return loss_value, [w - 0.1 * g for w, g in zip(params, grads)]

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()),
                         check_vma=True)
    x = shard(rng.standard_normal((devices * 4, sizes[0])).astype(dtype), mesh, P("x"))
    return step, (params, x)
