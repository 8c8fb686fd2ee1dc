"""FSDP (ZeRO-3) transformer language model as GSPMD code (Flax + optax) on 8 host CPU devices:
plain vs libra_jax.optimize.

    python examples/fsdp.py [--steps 30] [--small]

The transformer of examples/transformer.py, trained fully sharded: every weight matrix is
sharded over the mesh's ``data`` axis along a dimension that 8 divides (`fsdp_spec`; norms
and biases stay replicated), AdamW's state is laid out as the parameters, and the batch
is split over ``data``. The step is GSPMD code: `jax.jit` over those shardings, no collective of
its own.

- plain: the step with `jax.value_and_grad`; XLA's partitioner inserts the all-gathers of the
  weights and the reduce-scatters of their gradients after tracing, where `optimize` cannot see
  them.
- optimized: the same step with `libra_jax.value_and_grad` in its place (the route: the
  weights enter a `shard_map` as shards and are gathered for the loss, their gradients leave as
  reduce-scatters, all in the traced program), then `jax.jit(libra_jax.optimize(step))`.

On an auto-sharding mesh a traced value carries no sharding, so the step tells the route the
parameters' layout (``in_specs``); on an explicit-sharding mesh it would read it.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets up 8 host devices before JAX starts)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import libra_jax  # noqa: E402
from transformer import language_model, lm_loss  # noqa: E402  (the data-parallel example's)


def fsdp_spec(shape: tuple[int, ...], shards: int, width: int) -> P:
    """A leaf's FSDP layout: sharded over ``data`` along its first dimension that `shards`
    divides and that is at least the model's `width` (the first: gradients sharded along
    dimension 0 share a reduce-scatter bucket); vectors, and small tensors such as the
    attention's per-head biases, replicated (their gathers would cost more hand-offs than the
    memory they save)."""
    dims = [d for d in range(len(shape)) if shape[d] % shards == 0 and shape[d] >= width]
    if len(shape) < 2 or not dims:
        return P()
    return P(*(("data" if d == dims[0] else None) for d in range(dims[0] + 1)))


def build(small: bool = False):
    """(step, args): step(state, tokens) -> (state, loss), state = (params, opt_state), the
    route's step; ``step.plain`` is the same step with `jax.value_and_grad` (GSPMD's)."""
    mesh = common.mesh()
    model, tokens = language_model(small)
    opt = optax.adamw(3e-3)
    params = model.init(jax.random.key(0), tokens[:1, :-1])["params"]
    state = (params, opt.init(params))
    # One rule by shape: AdamW's moments are laid out as their parameters, its count replicated.
    layout = jax.tree.map(
        lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), common.DEVICES, model.dim)), state)
    param_specs = jax.tree.map(lambda s: s.spec, layout[0])

    def loss_fn(p, tokens):
        return lm_loss(model, p, tokens)

    def make_step(value_and_grad):
        def step(state, tokens):
            params, opt_state = state
            loss, grads = value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = opt.update(grads, opt_state, params)
            new = (optax.apply_updates(params, updates), opt_state)
            return jax.lax.with_sharding_constraint(new, layout), loss
        return step

    step = make_step(lambda f: libra_jax.value_and_grad(f, in_specs=(param_specs, P("data"))))
    step.plain = make_step(jax.value_and_grad)
    return step, (jax.device_put(state, layout),
                  jax.device_put(tokens, NamedSharding(mesh, P("data"))))


if __name__ == "__main__":
    common.main(__doc__, build)
