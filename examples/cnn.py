"""Data-parallel CNN (Flax + optax) on synthetic images, 8 host CPU devices: plain vs
libra_jax.optimize.

    python examples/cnn.py [--steps 30] [--small]

The step is a `jax.shard_map` with check_vma=True: the parameters are replicated, so autodiff
itself inserts the gradient psums (no explicit pmean); `libra_jax.optimize` plans and fuses them.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets up 8 host devices before JAX starts)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


class CNN(nn.Module):
    features: tuple[int, ...] = (16, 32)
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        for f in self.features:
            x = nn.relu(nn.Conv(f, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(self.classes)(x)


def build(small: bool = False):
    """(step, args): step(state, images, labels) -> (state, loss), state = (params, opt_state)."""
    size, features, batch = (8, (4, 8), 2) if small else (32, (32, 64), 16)
    mesh = common.mesh()
    model = CNN(features=features)
    opt = optax.adamw(1e-3)

    def local_step(state, x, y):
        params, opt_state = state

        def loss_fn(p):
            logits = model.apply({"params": p}, x)
            local = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return jax.lax.pmean(local, "data")

        # check_vma: the gradients of the replicated params are psummed by autodiff.
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    step = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=(P(), P()), check_vma=True)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((common.DEVICES * batch, size, size, 3)).astype(np.float32)
    y = (x.mean(axis=(1, 2)) @ rng.standard_normal((3, 10))).argmax(-1).astype(np.int32)
    params = model.init(jax.random.key(0), x[:1])["params"]
    data = NamedSharding(mesh, P("data"))
    return step, (common.replicate((params, opt.init(params)), mesh), jax.device_put(x, data), jax.device_put(y, data))


if __name__ == "__main__":
    common.main(__doc__, build)
