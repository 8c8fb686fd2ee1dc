"""`libra_jax.rewrite.passes`: each pass alone on a small jaxpr (a shard_map's body), and
their order: the normalising ones (`NORMALISE`) with a stand-in for the rewrite's shared
state, the planning ones (`PLAN`) with a real `Rewriter` and the passes before them run."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from libra_jax.rewrite import passes
from libra_jax.rewrite.passes import NORMALISE, ScopeState, normalise

from conftest import mesh_of

pytestmark = pytest.mark.usefixtures("jax_8")


def body(fn, *shapes, check_vma=True):
    """The jaxpr of `fn`'s body in a shard_map over 8 devices (axis ``x``), arguments
    replicated (a first argument of `shapes[0]`) or split (the rest) over ``x``."""
    mesh = mesh_of((8,), ("x",))
    specs = (P(),) + (P("x"),) * (len(shapes) - 1)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=check_vma)
    args = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]
    closed = jax.make_jaxpr(mapped)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    return eqn.params["jaxpr"]


def state(jaxpr, **where):
    return ScopeState(list(jaxpr.eqns), jaxpr.outvars, {"x": 8}, "top/shard_map", **where)


def shared(ready="dataflow", prefetch=None):
    """A stand-in for the rewrite's shared state (`scope.Scope`) recording the walk's calls."""
    calls = []
    return types.SimpleNamespace(
        options=types.SimpleNamespace(ready=ready), renamed={}, prefetch=prefetch,
        report=types.SimpleNamespace(folded=[]), calls=calls,
        hoist_loops=lambda eqns, sizes, scope: calls.append(("loops", scope)) or list(eqns),
        sub_jaxprs=lambda eqn, i, sizes, scope, in_loop, in_backward: (
            calls.append(("sub", i, in_loop, in_backward)) or eqn))


def names(eqns):
    return [e.primitive.name for e in eqns]


def test_the_passes_run_in_the_documented_order():
    assert [name for name, _ in NORMALISE] == ["inline", "deferred", "shrink", "transposes",
                                               "loops", "regathers", "sub_jaxprs", "zeros",
                                               "sliced", "gathers"]
    seen = []
    order = tuple((name, (lambda n: lambda rw, st: seen.append(n) or st.eqns)(name))
                  for name, _ in NORMALISE)
    jaxpr = body(lambda w, x: jax.lax.psum(x @ w, "x"), (4, 4), (16, 4))
    saved = passes.NORMALISE
    passes.NORMALISE = order
    try:
        normalise(shared(), state(jaxpr))
    finally:
        passes.NORMALISE = saved
    assert seen == [name for name, _ in NORMALISE]


def test_inline_takes_a_jit_inside_the_scope_apart_under_dataflow_only():
    # A jit of the loss's compute (no collective in it: those stay calls) in a scope that
    # psums its gradient: a boundary only, its equations the scope's.
    inner = jax.jit(lambda v, w: jnp.tanh(v @ w))
    jaxpr = body(lambda w, x: jax.lax.psum(inner(x, w), "x"), (4, 4), (16, 4), check_vma=False)
    assert {"jit", "pjit"} & set(names(jaxpr.eqns))
    inlined = passes.inline(shared(), state(jaxpr))
    assert not {"jit", "pjit"} & set(names(inlined))
    assert {"tanh", "dot_general"} <= set(names(inlined))
    assert passes.inline(shared(ready="written"), state(jaxpr)) == list(jaxpr.eqns)
    # No psum in the scope: its calls stay.
    plain = body(lambda w, x: jnp.tanh(inner(x, w)), (4, 4), (16, 4), check_vma=False)
    assert passes.inline(shared(), state(plain)) == list(plain.eqns)


def test_deferred_moves_the_loss_pmean_into_the_backward_map_under_dataflow_only():
    mesh = mesh_of((8,), ("x",))
    mapped = jax.shard_map(lambda w, x: jax.lax.pmean(jnp.sum(x @ w), "x"), mesh=mesh,
                           in_specs=(P(), P("x")), out_specs=P())
    args = [jax.ShapeDtypeStruct((4, 4), np.float32), jax.ShapeDtypeStruct((16, 4), np.float32)]
    closed = jax.make_jaxpr(jax.value_and_grad(mapped))(*args)
    st = ScopeState(list(closed.jaxpr.eqns), closed.jaxpr.outvars, {"x": 8}, "top")

    def psums(eqns):
        return [len([e for e in m.params["jaxpr"].eqns if "psum" in e.primitive.name])
                for m in eqns if m.primitive.name == "shard_map"]
    assert psums(st.eqns) == [1, 1]
    assert psums(passes.deferred(shared(), st)) == [0, 2]
    assert passes.deferred(shared(ready="written"), st) == st.eqns


def test_shrink_issues_a_psum_after_the_sum_that_shrinks_it():
    jaxpr = body(lambda w, x: jax.lax.psum(x @ w, "x").sum(0), (4, 4), (16, 4),
                 check_vma=False)
    before = names(jaxpr.eqns)
    assert before.index("psum") < before.index("reduce_sum")
    after = names(passes.shrink(shared(), state(jaxpr)))
    assert after.index("reduce_sum") < after.index("psum")


def test_transposes_scatters_before_the_transpose():
    def fn(w, x):
        return jax.lax.psum_scatter(jnp.transpose(x.T @ x), "x", tiled=True).sum()
    jaxpr = body(fn, (4, 4), (16, 8), check_vma=False)
    rw = shared()
    eqns = passes.transposes(rw, state(jaxpr))
    scatter = next(e for e in eqns if e.primitive.name == "reduce_scatter")
    producer = {v: e for e in eqns for v in e.outvars}
    assert producer[scatter.invars[0]].primitive.name == "dot_general"
    assert rw.renamed  # the moved result, named by the program's own variable


def test_loops_and_sub_jaxprs_are_the_walks_own_steps():
    jaxpr = body(lambda w, x: jax.lax.psum(x @ w, "x"), (4, 4), (16, 4))
    rw = shared()
    assert passes.hoisted_loops(rw, state(jaxpr)) == list(jaxpr.eqns)
    assert rw.calls == [("loops", "top/shard_map")]
    rw = shared()
    passes.sub_jaxprs(rw, state(jaxpr, in_loop=True, in_backward=True))
    assert rw.calls == [("sub", i, True, True) for i in range(len(jaxpr.eqns))]


def test_regathers_only_outside_loops_with_a_prefetch_distance():
    jaxpr = body(lambda w, x: jax.lax.psum(x @ w, "x"), (4, 4), (16, 4))
    for rw, where in ((shared(prefetch=0), {}), (shared(prefetch=None), {"in_loop": True})):
        assert passes.regathers(rw, state(jaxpr, **where)) == list(jaxpr.eqns)


def test_zeros_folds_a_psum_of_zeros_and_says_so():
    jaxpr = body(lambda w, x: (jax.lax.psum(jnp.zeros((3,)), "x"), jax.lax.psum(x @ w, "x")),
                 (4, 4), (16, 4), check_vma=False)
    rw = shared()
    eqns = passes.zeros(rw, state(jaxpr))
    assert names(eqns).count("psum") == names(jaxpr.eqns).count("psum") - 1
    assert rw.report.folded == ["psum of zeros in top/shard_map"]


def test_sliced_makes_the_invarying_gathers_gradient_a_psum_scatter():
    # The gradient of all_gather(to="invarying") of a varying loss: a psum of the whole
    # cotangent, then this rank's slice of it.
    def fn(w, x):
        return jax.grad(lambda v: jnp.sum(jnp.sin(
            jax.lax.all_gather(v, "x", tiled=True, to="invarying") * w) ** 2))(x)
    mesh = mesh_of((8,), ("x",))
    closed = jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P("x")),
                                          out_specs=P("x")))(
        jax.ShapeDtypeStruct((128, 3), np.float32), jax.ShapeDtypeStruct((16, 3), np.float32))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    jaxpr = eqn.params["jaxpr"]
    assert "psum_invariant" in names(jaxpr.eqns) and "dynamic_slice" in names(jaxpr.eqns)
    eqns = passes.sliced(shared(), state(jaxpr))
    assert "reduce_scatter" in names(eqns) and "dynamic_slice" not in names(eqns)


def test_gathers_moves_an_all_gather_to_its_first_use():
    def fn(w, x):
        full = jax.lax.all_gather(x, "x", tiled=True)
        h = jnp.tanh(w @ w)
        return jnp.sum(full) + jnp.sum(h)
    jaxpr = body(fn, (4, 4), (16, 4), check_vma=False)
    before = names(jaxpr.eqns)
    assert before.index("all_gather") < before.index("tanh")
    after = names(passes.gathers(shared(), state(jaxpr)))
    assert after.index("tanh") < after.index("all_gather")


# --- PLAN: the passes that plan a normalised scope ---------------------------------------


def rewriter(jaxpr, **options):
    """A real `Rewriter` (the shared state) for the scope `jaxpr`, profile cpu-host."""
    from libra_jax import model
    from libra_jax.rewrite.report import OptimizeReport
    from libra_jax.rewrite.rewriter import Rewriter
    from libra_jax.rewrite.scope import Options

    opts = Options(profile="cpu-host", fusion=options.pop("fusion", True),
                   blocks=options.pop("blocks", None), **options)
    closed = jax.extend.core.ClosedJaxpr(jaxpr, [])
    return Rewriter(opts, OptimizeReport(), closed, model.load_profile("cpu-host"))


def dp_body(check_vma=False):
    """A data-parallel SGD step's body: two layers' gradients psummed after `jax.grad` (as
    written: after the whole backward pass), a loss pmean."""
    def fn(w, x):
        def loss(w):
            return jnp.mean(jnp.tanh(jnp.tanh(x @ w["a"]) @ w["b"]) ** 2)
        value, g = jax.value_and_grad(loss)(w)
        g = jax.tree.map(lambda t: jax.lax.psum(t, "x"), g)
        return jax.lax.pmean(value, "x"), jax.tree.map(lambda p, t: p - 0.1 * t, w, g)
    mesh = mesh_of((8,), ("x",))
    w = {"a": jax.ShapeDtypeStruct((16, 32), np.float32),
         "b": jax.ShapeDtypeStruct((32, 4), np.float32)}
    closed = jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("x")),
                                          out_specs=(P(), P()), check_vma=check_vma))(
        w, jax.ShapeDtypeStruct((64, 16), np.float32))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    return eqn.params["jaxpr"]


def planned(jaxpr, upto, **options):
    """The shared state and the scope's state after `NORMALISE` and `PLAN` up to `upto`."""
    rw = rewriter(jaxpr, **options)
    st = normalise(rw, ScopeState(list(jaxpr.eqns), jaxpr.outvars, {"x": 8}, "top/shard_map",
                                  invars=set(jaxpr.invars)))
    for name, step in passes.PLAN:
        if name == upto:
            return rw, st, step
        step(rw, st)
    raise AssertionError(upto)


def test_the_plan_passes_run_in_the_documented_order():
    assert [name for name, _ in passes.PLAN] == ["sites", "readiness", "unplanned",
                                                 "other_collectives", "classify", "singles",
                                                 "buckets"]


def test_sites_finds_the_psums_by_kind():
    rw, st, step = planned(dp_body(), "sites")
    step(rw, st)
    assert len(st.sites) == 3 and not st.gathers and not st.exchanges  # 2 gradients + loss
    assert all(names(st.eqns)[s.index] == "psum" for s in st.sites)


def test_readiness_moves_each_gradient_psum_to_its_ready_point_under_dataflow_only():
    rw, st, step = planned(dp_body(), "readiness")
    written = [s.index for s in st.sites]
    step(rw, st)
    assert [s.index for s in st.sites] != written  # each now right after its gradient
    assert set(rw.ready["top/shard_map"]) and rw.written["top/shard_map"]
    rw, st, step = planned(dp_body(), "readiness", ready="written")
    before = list(st.eqns)
    step(rw, st)
    assert st.eqns == before and not rw.ready


def test_unplanned_says_each_collective_no_rule_serves():
    def fn(w, x):
        return jax.lax.pmax(x @ w, "x").sum() + jax.lax.psum(x @ w, "x").sum()
    rw, st, step = planned(body(fn, (4, 4), (16, 4), check_vma=False), "unplanned")
    step(rw, st)
    assert rw.unplanned == ["pmax over ('x',) in top/shard_map"]


def test_classify_kinds_and_costs():
    rw, st, step = planned(dp_body(), "classify")
    step(rw, st)
    kinds = sorted(st.kinds[s.index] for s in st.sites)
    assert kinds == ["gradient", "gradient", "gradient"]  # the loss's pmean joins them
    rw_w, st_w, step_w = planned(dp_body(), "classify", ready="written")
    step_w(rw_w, st_w)
    assert sorted(st_w.kinds[s.index] for s in st_w.sites) == ["forward", "gradient",
                                                                "gradient"]
    assert len(st.costs) == len(st.eqns) and sum(st.costs) > 0
    # The update waits for the gradients: priced at nothing (it overlaps no collective).
    update = [i for i, e in enumerate(st.eqns) if e.primitive.name == "sub"][-2:]  # p - 0.1 t
    assert all(st.costs[i] == 0.0 for i in update)
    assert all(st.costs[i] > 0 for i, e in enumerate(st.eqns) if e.primitive.name == "tanh")


def test_singles_streams_the_gradients_and_the_loss_pmean_under_dataflow_only():
    rw, st, step = planned(dp_body(), "singles")
    step(rw, st)
    assert rw.report.plans == [] and not st.edits.replacements
    assert [len(members) for members in st.streams.values()] == [3]
    rw, st, step = planned(dp_body(), "singles", ready="written")  # the loss's pmean alone
    step(rw, st)
    assert [(p.kind, len(p.members)) for p in rw.report.plans] == [("forward", 1)]
    assert len(st.edits.replacements) == 1
    assert [len(members) for members in st.streams.values()] == [2]


def test_buckets_plans_the_stream_and_records_its_edits():
    rw, st, step = planned(dp_body(), "buckets")
    step(rw, st)
    gradient = [p for p in rw.report.plans if p.kind == "gradient"]
    assert sum(len(p.members) for p in gradient) == 3  # the loss's pmean with them
    assert rw.report.predicted and st.edits.replacements
    rw, st, step = planned(dp_body(), "buckets", fusion=False)
    step(rw, st)
    assert [len(p.members) for p in rw.report.plans if p.kind == "gradient"] == [1, 1, 1]
