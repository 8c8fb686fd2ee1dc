"""`libra_jax.rewrite.deferred`: a forward shard_map's reductions of its results (the loss's
pmean, aux's metrics) issued with the backward shard_map's gradients, and where they stay."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import libra_jax
from libra_jax.rewrite import deferred, passes
from libra_jax.rewrite.deferred import defer_reductions

from conftest import mesh_of

pytestmark = pytest.mark.usefixtures("jax_8")


def _loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def _inputs(n=16, d=8):
    rng = np.random.default_rng(0)
    mesh = mesh_of((8,), ("data",))
    w = jax.device_put(rng.standard_normal((d, d), np.float32), NamedSharding(mesh, P()))
    x = jax.device_put(rng.standard_normal((n, d), np.float32), NamedSharding(mesh, P("data")))
    return mesh, w, x


def _maps(closed):
    return [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]


def _psums(eqn):
    return [e.primitive.name for e in eqn.params["jaxpr"].eqns if "psum" in e.primitive.name]


def _pmean_loss(mesh):
    """The loss pmean'ed in a shard_map over ``data`` (weights replicated, batch split)."""
    return jax.shard_map(lambda w, x: jax.lax.pmean(_loss(w, x), "data"), mesh=mesh,
                         in_specs=(P(), P("data")), out_specs=P())


def _route_step(loss=_loss, has_aux=False, **kwargs):
    def step(w, x):
        out, g = libra_jax.value_and_grad(loss, has_aux=has_aux, **kwargs)(w, x)
        return out, w - 0.1 * g
    return step


def _without_pass(monkeypatch):
    monkeypatch.setattr(passes, "NORMALISE",
                        tuple(p for p in passes.NORMALISE if p[0] != "deferred"))


def test_the_routes_loss_psum_moves_into_the_backward_shard_map():
    _, w, x = _inputs()
    closed = jax.make_jaxpr(_route_step())(w, x)
    forward, backward = _maps(closed)
    assert _psums(forward) == ["psum_invariant"] and len(_psums(backward)) == 1
    moved = defer_reductions(closed.jaxpr.eqns)
    forward, backward = [e for e in moved if e.primitive.name == "shard_map"]
    assert _psums(forward) == []
    assert _psums(backward) == ["psum_invariant", "psum_invariant"]
    # The loss is now the backward map's result, the same variable the step returns.
    assert closed.jaxpr.outvars[0] in backward.outvars
    assert backward.params["in_specs"][-1] == P(("data",))
    assert forward.params["out_specs"][-1] == P(("data",))


def test_optimize_plans_the_loss_with_the_gradients_and_changes_no_bit(monkeypatch):
    _, w, x = _inputs()
    step = _route_step()
    opt = libra_jax.optimize(step)
    loss, new_w = jax.jit(opt)(w, x)
    scopes = {(p.scope, p.kind) for p in opt.last_report.plans}
    assert scopes == {("top/shard_map#2", "gradient")}  # one bucket: gradient and loss
    (plan,) = opt.last_report.plans
    assert plan.nbytes == 8 * 8 * 4 + 4
    _without_pass(monkeypatch)
    kept = libra_jax.optimize(step)
    loss_kept, w_kept = jax.jit(kept)(w, x)
    assert len(kept.last_report.plans) == 2  # before: the loss's psum a call of its own
    assert np.asarray(loss).tobytes() == np.asarray(loss_kept).tobytes()
    assert np.asarray(new_w).tobytes() == np.asarray(w_kept).tobytes()
    ref_loss, ref_w = jax.jit(step)(w, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(new_w, ref_w, rtol=1e-6)


def test_a_ratio_metric_moves_with_both_its_psums():
    _, w, x = _inputs()

    def loss(w, x):
        y = x @ w
        return jnp.mean(y ** 2), ((y > 0).sum().astype(jnp.float32), jnp.float32(y.size))

    step = _route_step(loss, has_aux=True, aux_reduce="ratio")
    closed = jax.make_jaxpr(step)(w, x)
    forward, _ = _maps(closed)
    assert len(_psums(forward)) == 3
    forward, backward = [e for e in defer_reductions(closed.jaxpr.eqns)
                         if e.primitive.name == "shard_map"]
    assert _psums(forward) == [] and len(_psums(backward)) == 4
    opt = libra_jax.optimize(step)
    (loss_o, ratio_o), w_o = jax.jit(opt)(w, x)
    (loss_p, ratio_p), w_p = jax.jit(step)(w, x)
    assert float(ratio_o) == float(ratio_p)
    np.testing.assert_allclose(loss_o, loss_p, rtol=1e-6)


def test_a_loss_the_backward_pass_reads_stays():
    mesh, w, x = _inputs()
    mapped = _pmean_loss(mesh)

    def step(w, x):
        loss, vjp = jax.vjp(lambda w: mapped(w, x), w)
        (g,) = vjp(loss)  # the cotangent is the loss: the backward map reads it
        return loss, g

    closed = jax.make_jaxpr(step)(w, x)
    moved = defer_reductions(closed.jaxpr.eqns)
    assert [_psums(e) for e in moved if e.primitive.name == "shard_map"] == [
        _psums(e) for e in _maps(closed)]


def test_what_reads_the_loss_before_the_backward_pass_waits_for_it():
    mesh, w, x = _inputs()
    mapped = _pmean_loss(mesh)

    def step(w, x):
        loss, vjp = jax.vjp(lambda w: mapped(w, x), w)
        scale = jnp.sqrt(loss)  # traced between the two maps
        (g,) = vjp(jnp.ones_like(loss))
        return scale, g * scale

    closed = jax.make_jaxpr(step)(w, x)
    names = [e.primitive.name for e in closed.jaxpr.eqns]
    assert names.index("sqrt") < len(names) - 1 - names[::-1].index("shard_map")
    moved = defer_reductions(closed.jaxpr.eqns)
    names = [e.primitive.name for e in moved]
    assert names.index("sqrt") > len(names) - 1 - names[::-1].index("shard_map")
    assert _psums(moved[0]) == []
    opt = libra_jax.optimize(step)
    np.testing.assert_allclose(jax.jit(opt)(w, x)[1], jax.jit(step)(w, x)[1], rtol=1e-6)


def test_large_reductions_program_order_and_untyped_maps_stay(monkeypatch):
    mesh, w, x = _inputs()

    def step(w, x, check_vma=True):
        mapped = jax.shard_map(
            lambda w, x: (jax.lax.pmean(_loss(w, x), "data"), jax.lax.psum(x.T @ x, "data")),
            mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=check_vma)
        (loss, gram), g = jax.value_and_grad(
            lambda w: mapped(w, x), has_aux=True)(w)
        return loss, gram, g

    monkeypatch.setattr(deferred, "MAX_BYTES", 8 * 8 * 4 - 1)  # the gram matrix: one over
    closed = jax.make_jaxpr(step)(w, x)
    forward = defer_reductions(closed.jaxpr.eqns)[0]
    assert _psums(forward) == ["psum_invariant"]  # the gram matrix's; the loss's moved
    untyped = jax.make_jaxpr(lambda w, x: step(w, x, check_vma=False))(w, x)
    assert _psums(defer_reductions(untyped.jaxpr.eqns)[0]) == _psums(_maps(untyped)[0])
    opt = libra_jax.optimize(step, ready="written")
    jax.jit(opt)(w, x)
    assert any(p.scope == "top/shard_map" for p in opt.last_report.plans)
