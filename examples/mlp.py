"""Data-parallel MLP (plain JAX + optax) on 8 host CPU devices: plain vs libra_jax.optimize.

    python examples/mlp.py [--steps 30] [--small]

The step is a `jax.shard_map` over the batch (check_vma=False) with an explicit
`jax.lax.pmean` of the gradients; `libra_jax.optimize` turns those psums into planned, fused
Libra all-reduces. Both steps train side by side from the same start.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets up 8 host devices before JAX starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def init_params(key: jax.Array, sizes: list[int]) -> dict[str, dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return {f"dense{i}": {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
            for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def loss_fn(params, x, y):
    n = len(params)
    for i in range(n):
        layer = params[f"dense{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < n - 1:
            x = jax.nn.gelu(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()


def build(small: bool = False):
    """(step, args): step(state, x, y) -> (state, loss), state = (params, opt_state)."""
    sizes = [32, 64, 64, 10] if small else [256, 1024, 1024, 1024, 10]
    batch = 4 if small else 32  # per device
    mesh = common.mesh()
    opt = optax.adam(1e-3)

    def local_step(state, x, y):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jax.lax.pmean(grads, "data")  # the gradient all-reduce
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jax.lax.pmean(loss, "data")

    step = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=(P(), P()), check_vma=False)

    params = init_params(jax.random.key(0), sizes)
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((sizes[0], sizes[-1])).astype(np.float32)
    x = rng.standard_normal((common.DEVICES * batch, sizes[0])).astype(np.float32)
    y = np.argmax(x @ teacher, axis=-1).astype(np.int32)
    data = NamedSharding(mesh, P("data"))
    return step, (common.replicate((params, opt.init(params)), mesh), jax.device_put(x, data), jax.device_put(y, data))


if __name__ == "__main__":
    common.main(__doc__, build)
