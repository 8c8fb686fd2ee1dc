"""Data-parallel transformer language model (Flax + optax) on synthetic tokens, 8 host CPU
devices: plain vs libra_jax.optimize.

    python examples/transformer.py [--steps 30] [--small] [--variant shard_map|pmap]

`--variant shard_map` (default): `jax.shard_map` with an explicit `jax.lax.pmean` of the
gradients; `--variant pmap`: the same step under `jax.pmap`. The tokens follow a fixed rule
(each token is the previous plus a per-sequence stride, modulo the vocabulary), so the loss falls.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets up 8 host devices before JAX starts)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

VARIANTS = ("shard_map", "pmap")


class Block(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.Dense(4 * self.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(nn.gelu(h))


class LM(nn.Module):
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.dim))
        for _ in range(self.layers):
            x = Block(self.dim, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def language_model(small: bool = False) -> tuple[LM, np.ndarray]:
    """The model and its synthetic tokens, ``DEVICES x batch`` sequences of ``seq + 1`` (each
    token the previous plus a per-sequence stride, modulo the vocabulary). Shared with
    examples/fsdp.py."""
    if small:
        vocab, dim, heads, layers, seq, batch = 16, 16, 2, 1, 8, 2
    else:
        vocab, dim, heads, layers, seq, batch = 256, 128, 4, 2, 64, 4
    rng = np.random.default_rng(0)
    n = common.DEVICES * batch
    start = rng.integers(0, vocab, (n, 1))
    stride = rng.integers(1, 4, (n, 1))
    tokens = ((start + stride * np.arange(seq + 1)) % vocab).astype(np.int32)
    return LM(vocab, dim, heads, layers, seq), tokens


def lm_loss(model: LM, params, tokens):
    """Next-token cross-entropy of `tokens` (the last position predicts nothing)."""
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def build(small: bool = False, variant: str = "shard_map"):
    """(step, args): step(state, tokens) -> (state, loss), state = (params, opt_state)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    mesh = common.mesh()
    model, tokens = language_model(small)
    opt = optax.adamw(3e-3)

    def local_step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: lm_loss(model, p, tokens))(params)
        grads = jax.lax.pmean(grads, "data")  # the gradient all-reduce
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jax.lax.pmean(loss, "data")

    params = model.init(jax.random.key(0), tokens[:1, :-1])["params"]
    state = (params, opt.init(params))
    if variant == "pmap":
        devices = jax.devices("cpu")[:common.DEVICES]
        step = jax.pmap(local_step, axis_name="data", in_axes=(None, 0), out_axes=None,
                        devices=devices)
        return step, (state, tokens.reshape(common.DEVICES, -1, tokens.shape[1]))
    step = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data")),
                         out_specs=(P(), P()), check_vma=False)
    return step, (common.replicate(state, mesh), jax.device_put(tokens, NamedSharding(mesh, P("data"))))


if __name__ == "__main__":
    common.main(__doc__, build, options={"variant": VARIANTS})
