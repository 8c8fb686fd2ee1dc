"""libra_jax.rewrite.ready: a gradient collective is planned and issued where its operand is
ready in the backward pass, whichever way the step was written, and the compiled program runs
it there (the HLO's schedule, not only the jaxpr)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bitwise, assert_codegen_close, mesh_of, shard
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _compat, planner
from libra_jax.rewrite import optimize
from libra_jax.rewrite.ready import to_ready_points

pytestmark = pytest.mark.usefixtures("jax_8")

SIZES = (64, 128, 128, 128, 16)


def _params(rng, biases=True):
    return [((rng.standard_normal((m, n)) * 0.2).astype(np.float32),
             np.zeros(n, np.float32) if biases else None)
            for m, n in zip(SIZES[:-1], SIZES[1:])]


def _data(seed):
    """A mesh of 8 devices over "x", the MLP's parameters (with biases) and a sharded batch."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(seed)
    params = _params(rng)
    x = shard(rng.standard_normal((64, SIZES[0])).astype(np.float32), mesh, P("x"))
    return mesh, params, x


def _loss(params, x):
    for w, b in params:
        x = jnp.tanh(x @ w + (0.0 if b is None else b))
    return jnp.mean(x * x)


def written_step(check_vma: bool):
    """The 4-layer tanh MLP's SGD step on 8 ranks, written either way: ``pmean`` after
    `jax.grad` (``check_vma=False``: every psum after the backward pass), or the loss
    ``pmean``ed inside the differentiated function (``check_vma=True``: autodiff's psums,
    each where its cotangent is made)."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(0)
    params = _params(rng, biases=False)
    params = [w for w, _ in params]

    def loss(ws, x):
        return _loss([(w, None) for w in ws], x)

    if check_vma:
        def body(ws, x):
            grads = jax.grad(lambda ws: jax.lax.pmean(loss(ws, x), "x"))(ws)
            return [w - 0.1 * g for w, g in zip(ws, grads)]
    else:
        def body(ws, x):
            grads = jax.lax.pmean(jax.grad(loss)(ws, x), "x")
            return [w - 0.1 * g for w, g in zip(ws, grads)]
    step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                         check_vma=check_vma)
    x = shard(rng.standard_normal((8 * 16, SIZES[0])).astype(np.float32), mesh, P("x"))
    return step, (params, x)


def _fusion_priced(gbyte_per_s=0.4):
    """`cpu-host` with fusion priced at `gbyte_per_s` (0.4: its price while a bucket was packed,
    under which this MLP's plan has several buckets): the tests below check where buckets go
    in the backward pass, which needs more than one."""
    import json

    from libra_jax import model
    doc = json.loads((model.PROFILE_DIR / "cpu-host.json").read_text())
    doc["fair_share"]["fusion_copy_gbyte_per_s"]["value"] = gbyte_per_s
    return doc


def _entry(report):
    entry, = [e for e in report.predicted if not e["in_loop"]]
    return entry


def test_both_written_forms_get_the_same_plan():
    """pmean(jax.grad(...)) and autodiff's psums: the same buckets, in the same (backward)
    order, with the same block counts, ready times within 5%. Before, the written form had
    every gradient ready at the end of the backward pass, one bucket, the first layer first."""
    plans = {}
    for check_vma in (False, True):
        step, args = written_step(check_vma)
        opt = optimize(step, profile=_fusion_priced())
        jax.jit(opt).lower(*args)
        entry = _entry(opt.last_report)
        layers, buckets = entry["layers"], planner.plan(
            list(entry["layers"]), entry["cost"]).buckets
        ready = np.cumsum([layer.compute_s for layer in layers])
        plans[check_vma] = ([layer.grad_bytes for layer in layers],
                            [(b.first, b.last, b.blocks) for b in buckets], ready,
                            [p.blocks for p in opt.last_report.plans if p.kind == "gradient"])
    (written, autodiff) = plans[False], plans[True]
    assert written[0] == autodiff[0] == [128 * 16 * 4, 128 * 128 * 4, 128 * 128 * 4, 64 * 128 * 4]
    assert written[1] == autodiff[1] and written[3] == autodiff[3]
    np.testing.assert_allclose(written[2], autodiff[2], rtol=0.05)
    assert len(written[1]) > 1 and written[2][0] < 0.5 * written[2][-1]  # inside the pass


def test_written_order_is_kept_when_asked():
    step, args = written_step(False)
    opt = optimize(step, ready="written")
    jax.jit(opt).lower(*args)
    layers = _entry(opt.last_report)["layers"]
    assert [layer.grad_bytes for layer in layers] == [64 * 128 * 4, 128 * 128 * 4,
                                                      128 * 128 * 4, 128 * 16 * 4]
    assert all(layer.compute_s == 0.0 for layer in layers[1:])  # every psum after the pass
    with pytest.raises(ValueError, match="ready must be one of 'dataflow', 'written'"):
        optimize(step, ready="early")(*args)


def _dot_computations(text):
    """The names of the computations that hold a dot: XLA:CPU (jaxlib 0.12) wraps a dot in a
    fusion (YNNPACK's `__ynn_fusion`) whose called computation holds it."""
    names, current = set(), None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = header.group(1)
        elif current and re.search(r" dot\(", line):
            names.add(current)
    return names


def _schedule(text):
    """The compiled entry computation's instructions in scheduled order: (kind, line); a dot is
    a dot instruction or a fusion whose computation holds one."""
    entry = text[text.index("\nENTRY"):]
    with_dot = _dot_computations(text[:text.index("\nENTRY")])
    out = []
    for line in entry.splitlines():
        called = re.search(r"calls=%([\w.\-]+)", line)
        if re.search(r" dot\(", line) or (called and called.group(1) in with_dot):
            out.append(("dot", line))
        elif 'custom_call_target="libra_allreduce_cpu_start"' in line:
            out.append(("start", line))
        elif 'custom_call_target="libra_allreduce_cpu_done"' in line:
            out.append(("done", line))
    return out


@pytest.mark.parametrize("check_vma", [False, True])
def test_the_compiled_program_runs_the_plan(check_vma):
    """In the compiled CPU program's schedule: starts interleaved with the backward pass's
    dots (the first start before the last dot), every done after the last dot; the values
    bitwise the control's and within class 3's bound of plain. With ready="written" (what ran
    before) the written form's dones are pulled in between the backward pass's dots: XLA
    issues each start by data, but a done waits on the latest start's token, which in the
    written order is an early start's, so the step waits for all-reduces mid-pass."""
    step, args = written_step(check_vma)
    opt = optimize(step, overlap="start-done", profile=_fusion_priced())
    text = jax.jit(opt).lower(*args).compile().as_text()
    order = _schedule(text)
    kinds = [k for k, _ in order]
    last_dot = max(i for i, k in enumerate(kinds) if k == "dot")
    assert kinds.count("start") == kinds.count("done") >= 2, kinds
    assert kinds.index("start") < last_dot, kinds
    assert min(i for i, k in enumerate(kinds) if k == "done") > last_dot, kinds
    got = jax.jit(opt)(*args)
    control = jax.jit(optimize(step, overlap="start-done", collectives="xla",
                               profile=_fusion_priced()))(*args)
    jax.tree.map(assert_bitwise, got, control)
    assert_codegen_close(got, jax.jit(step)(*args))
    if not check_vma:
        old = _schedule(jax.jit(optimize(step, overlap="start-done", ready="written",
                                         profile=_fusion_priced()))
                        .lower(*args).compile().as_text())
        old_kinds = [k for k, _ in old]
        assert old_kinds.index("done") < max(i for i, k in enumerate(old_kinds) if k == "dot")


def test_to_ready_points_moves_each_collective_after_its_producer_and_keeps_values():
    mesh, params, x = _data(1)

    def body(params, x):
        grads = jax.grad(_loss)(params, x)
        # A cast and a scaling on the way: they travel with the psum.
        return [jax.lax.psum((g.astype(jnp.float32) * 0.5).astype(jnp.float32), "x")
                for pair in grads for g in pair]

    closed = jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")),
                                          out_specs=P(), check_vma=False))(params, x)
    inner = closed.jaxpr.eqns[-1].params["jaxpr"]
    eqns = list(inner.eqns)
    sites = [i for i, e in enumerate(eqns) if e.primitive.name == "psum"]
    dots = [i for i, e in enumerate(eqns) if e.primitive.name == "dot_general"]
    assert min(sites) > max(dots)  # all written after the backward pass
    moved, order, ready = to_ready_points(eqns, sites)
    assert sorted(order) == list(range(len(eqns)))
    new_sites = [i for i, e in enumerate(moved) if e.primitive.name == "psum"]
    assert new_sites[0] < len(eqns) // 2  # the last layer's gradients, early in the pass
    defined = set(inner.invars) | set(inner.constvars)
    for eqn in moved:  # every equation reads only what is defined before it
        assert all(v in defined for v in eqn.invars if _compat.is_var(v)), eqn
        defined.update(eqn.outvars)
    for i in new_sites:  # right after its producer, or after the moves leading to it
        r = ready[i]
        assert r.point < i and all(moved[j].primitive.name in ("transpose", "mul")
                                   for j in range(r.point + 1, i)), (r, moved[r.point:i + 1])
    # Values: the optimized step (reordered, then planned) against the plain one.
    got = jax.jit(optimize(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")),
                                         out_specs=P(), check_vma=False)))(params, x)
    want = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                                 check_vma=False))(params, x)
    assert_codegen_close(got, want)


def grads_through(grad_fn, seed):
    """A step whose gradients come from `grad_fn(params, x)` (a wrapped `jax.grad`), then
    `pmean`: the step, and its arguments."""
    mesh, params, x = _data(seed)

    def body(params, x):
        grads = jax.lax.pmean(grad_fn(params, x), "x")
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                         check_vma=False)
    return step, (params, x)


def test_readiness_stops_at_a_call_and_says_why():
    """Gradients computed inside a `jax.checkpoint`ed function that returns them all are
    ready after that call (readiness does not look into it); explain says so."""
    step, args = grads_through(jax.checkpoint(jax.grad(_loss)), seed=2)
    e = libra_jax.explain(step, *args, file=None)
    text = str(e)
    assert "ready (issued) in the backward pass:" in text
    assert "call, which readiness does not look into: ready after the call" in text, text


def test_a_gradient_with_a_second_reader_is_said_to_be_copied():
    """A local gradient read by a metric and by its psum: the psum alone (fusion off) is an
    in-place all-reduce, so XLA copies the operand first; the report and explain say so."""
    mesh, params, x = _data(3)

    def body(params, x):
        grads = jax.grad(_loss)(params, x)
        norm = jax.lax.pmean(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)), "x")
        grads = jax.lax.pmean(grads, "x")
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), norm

    step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()),
                         check_vma=False)
    opt = optimize(step, fusion=False, overlap="sync")
    jax.jit(opt).lower(params, x)
    assert len(opt.last_report.copied) == 8, opt.last_report.copied
    assert all("other reader(s), so XLA copies it" in line for line in opt.last_report.copied)
    text = str(libra_jax.explain(step, params, x, fusion=False, overlap="sync", file=None))
    assert "gradients copied before their in-place all-reduce" in text
    plain = optimize(jax.shard_map(lambda p, x: jax.tree.map(
        lambda p, g: p - g, p, jax.lax.pmean(jax.grad(_loss)(p, x), "x")), mesh=mesh,
        in_specs=(P(), P("x")), out_specs=P(), check_vma=False), fusion=False, overlap="sync")
    jax.jit(plain).lower(params, x)
    assert plain.last_report.copied == []


def test_pmap_written_form_is_planned_inside_the_backward_pass():
    """`optimize(jax.pmap(step))` with pmean after jax.grad: the buckets are ready inside
    the backward pass, as under shard_map."""
    rng = np.random.default_rng(4)
    params = [w for w, _ in _params(rng, biases=False)]
    x = rng.standard_normal((8, 16, SIZES[0])).astype(np.float32)

    def body(ws, x):
        grads = jax.lax.pmean(jax.grad(lambda ws: _loss([(w, None) for w in ws], x))(ws), "x")
        return [w - 0.1 * g for w, g in zip(ws, grads)]

    step = jax.pmap(body, axis_name="x", in_axes=(None, 0))
    opt = optimize(step)
    got = opt(params, x)
    assert_codegen_close(got, step(params, x))
    layers = _entry(opt.last_report)["layers"]
    ready = np.cumsum([layer.compute_s for layer in layers])
    assert [layer.grad_bytes for layer in layers][0] == 128 * 16 * 4  # the last layer's first
    assert ready[0] < 0.5 * ready[-1]


def test_a_jit_inside_the_step_is_seen_through():
    """`jax.jit(jax.grad(loss))` inside the step: the jit is a function boundary only, inlined
    before readiness, so its gradients are ready inside the backward pass (before: every one
    ready after the call, which readiness did not look into). A `checkpoint` still stops it
    (`test_readiness_stops_at_a_call_and_says_why`)."""
    step, args = grads_through(jax.jit(jax.grad(_loss)), seed=5)
    opt = optimize(step)
    assert_codegen_close(jax.jit(opt)(*args), jax.jit(step)(*args))
    layers = _entry(opt.last_report)["layers"]
    ready = np.cumsum([layer.compute_s for layer in layers])
    assert ready[0] < 0.5 * ready[-1], ready
    e = libra_jax.explain(step, *args, file=None)
    assert all(not r.ready_why for s in e.scopes for r in s.rows), str(e)
