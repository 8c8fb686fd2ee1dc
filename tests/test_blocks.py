"""A call's block count where none is given (libra_jax.ops.blocks): one rule, `resolve_blocks`,
that every site reads. A test patches it and sees each site follow: the public
`default_blocks`, the CPU engine's lowering, the CUDA kernels' lowering, and `optimize`'s
calls outside the planner's buckets (a loss's pmean, an all-to-all, an all-gather at its
place)."""
from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import _jax, mesh_of
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import collectives, model
from libra_jax.ops import blocks

jax = _jax()  # 8 host devices, before any JAX operation

#: A count the model would not choose for the small calls below (it picks 1 for them).
PATCHED = 5


@pytest.fixture
def patched(monkeypatch):
    """`resolve_blocks` replaced by one that returns `PATCHED`, recording its arguments."""
    seen = []

    def rule(row, nbytes, world, profile):
        seen.append((row, nbytes, world))
        return PATCHED

    monkeypatch.setattr(blocks, "resolve_blocks", rule)
    return seen


def test_the_rule_is_the_models_choice_without_overlap():
    row = collectives.row_of("psum")
    for nbytes in (1024, 1 << 20, 64 << 20):
        want = model.derive("cpu-host", 8).no_overlap_blocks(nbytes, row)
        assert blocks.resolve_blocks(row, nbytes, 8, "cpu-host") == want
        assert libra_jax.default_blocks(nbytes, 8, "cpu-host") == want
    assert blocks.resolve_blocks(row, 0, 8, "cpu-host") == 1  # nothing to move
    assert blocks.resolve_blocks(row, 1 << 20, 1, "cpu-host") == 1  # no peer
    assert {blocks.resolve_blocks(row, 64 << 20, 8, "h100")} != {1}


def test_the_cap_is_folded_in(monkeypatch):
    """On a data path that runs at most `block_cap` blocks, the rule never chooses more (the
    model prices only what can launch); CPU profiles have no cap."""
    row = collectives.row_of("psum")
    uncapped = blocks.resolve_blocks(row, 256 << 20, 8, "h100")
    assert uncapped > 2
    monkeypatch.setattr(blocks, "block_cap", lambda profile: (2, "a test's cap")
                        if profile.form != "fair-share" else (None, ""))
    assert blocks.resolve_blocks(row, 256 << 20, 8, "h100") <= 2
    assert "a test's cap" in " ".join(blocks.capped_derivation("h100", 8).dropped.values())
    assert blocks.resolve_blocks(row, 256 << 20, 8, "cpu-host") == \
        model.derive("cpu-host", 8).no_overlap_blocks(256 << 20, row)


def test_patching_the_rule_changes_the_public_default(patched):
    assert libra_jax.default_blocks(1 << 20, 8) == PATCHED
    assert patched == [(collectives.row_of("psum"), 1 << 20, 8)]


def _blocks_attrs(text: str) -> list[int]:
    return [int(b) for b in re.findall(r"blocks = (\d+) : i64", text)]


def test_patching_the_rule_changes_the_cpu_lowering(patched):
    f = jax.jit(jax.shard_map(lambda x: libra_jax.psum(x, "d"), mesh=mesh_of((8,), ("d",)),
                              in_specs=P("d"), out_specs=P()))
    text = f.lower(jnp.ones((8, 16), jnp.float32)).as_text()
    assert _blocks_attrs(text) == [PATCHED]
    assert patched and patched[0][1:] == (16 * 4, 8)


def test_patching_the_rule_changes_the_cuda_lowering(patched, monkeypatch):
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    mesh = jax.sharding.AbstractMesh((8,), ("d",))
    f = jax.jit(jax.shard_map(lambda x: libra_jax.psum(x, "d"), mesh=mesh, in_specs=P("d"),
                              out_specs=P()))
    try:
        traced = f.trace(jax.ShapeDtypeStruct((8, 16), np.float32,
                                              sharding=jax.NamedSharding(mesh, P("d"))))
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    except (TypeError, AttributeError) as e:  # pragma: no cover - API differs by version
        pytest.skip(f"cross-platform lowering unavailable: {e}")
    assert _blocks_attrs(text) == [PATCHED]


def _plans(step, *args, **options):
    opt = libra_jax.optimize(step, **options)
    jax.jit(opt).lower(*args)
    return opt.last_report.plans


def test_patching_the_rule_changes_optimizes_calls_outside_buckets(patched):
    # A loss's pmean the update reads (kind "forward": one nothing reads joins the gradients)
    # is issued at the rule's count; gradients are planned.
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        mean = jax.lax.pmean(loss, "d")
        return w - 0.1 * mean * jax.lax.pmean(g, "d"), mean

    f = jax.shard_map(step, mesh=mesh_of((8,), ("d",)), in_specs=(P(), P("d")),
                      out_specs=(P(), P()), check_vma=False)
    plans = _plans(f, jnp.ones((16, 16)), jnp.ones((32, 16)))
    assert {p.blocks for p in plans if p.kind == "forward"} == {PATCHED}

    # Every all-to-all of a mixture of experts' step: exchanges are never bucketed.
    from test_exchange import moe_step
    moe, args = moe_step()
    exchanged = [p for p in _plans(moe, *args) if p.collective.kind == "all-to-all"]
    assert exchanged and {p.blocks for p in exchanged} == {PATCHED}

    # An FSDP step's forward all-gathers issued at their place (no prefetch).
    def fsdp(w, x):
        def loss(w):
            full = jax.lax.all_gather(w, "d", tiled=True)
            return jnp.mean(jnp.tanh(x @ full) ** 2)
        g = jax.grad(loss)(w)
        return w - 0.1 * g

    f = jax.shard_map(fsdp, mesh=mesh_of((8,), ("d",)), in_specs=(P("d"), P("d")),
                      out_specs=P("d"), check_vma=False)
    gathers = [p for p in _plans(f, jnp.ones((16, 16)), jnp.ones((32, 16)), prefetch="off")
               if p.collective.kind == "all-gather"]
    assert gathers and {p.blocks for p in gathers} == {PATCHED}
