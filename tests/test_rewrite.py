"""Tests of libra_jax.optimize: the rewritten step equals the original bit for bit, and its
HLO holds Libra all-reduces with the planned block counts instead of XLA's."""
from __future__ import annotations

import functools

import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _compat
from libra_jax.config import xla_flags
from libra_jax.rewrite import optimize, rewrite_jaxpr

from conftest import assert_bitwise, assert_codegen_close, cpu_start_done_pairs, mesh_of, shard

pytestmark = pytest.mark.usefixtures("jax_8")

MODES = ["check_vma", "no_check_vma", "pmap"]


def init(rng, sizes, dtype=np.float32):
    return {f"w{i}": (rng.standard_normal((m, n)) * 0.3).astype(dtype)
            for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))}


def mlp(params, x):
    for i in range(len(params)):
        x = jnp.tanh(x @ params[f"w{i}"].astype(x.dtype))
    return x


def data_parallel(mode, local_step, n_out=2):
    """Wrap `local_step(params, x, psum)` (psum is the gradient reduction of the mode)."""
    if mode == "pmap":
        return jax.pmap(lambda p, x: local_step(p, x, jax.lax.psum), axis_name="x",
                        in_axes=(None, 0))
    mesh = mesh_of((8,), ("x",))
    check_vma = mode == "check_vma"
    def body(p, x):
        # Under check_vma, AD already sums gradients of replicated parameters.
        return local_step(p, x, (lambda g, axis: g) if check_vma else jax.lax.psum)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")),
                                 out_specs=(P(),) * n_out, check_vma=check_vma))


def inputs(mode, rng, d_in=16, batch=4):
    x = rng.standard_normal((8, batch, d_in)).astype(np.float32)
    if mode == "pmap":
        return x
    return shard(x.reshape(8 * batch, d_in), mesh_of((8,), ("x",)), P("x"))


def sgd_step(loss_fn):
    def local_step(p, x, grad_psum):
        def total(p):
            return jax.lax.psum(loss_fn(p, x), "x")
        loss, grads = jax.value_and_grad(total)(p)
        grads = jax.tree.map(lambda g: grad_psum(g, "x"), grads)
        return loss, jax.tree.map(lambda w, g: w - 0.01 * g.astype(w.dtype), p, grads)
    return local_step


def check(step, *args, expect_calls=True):
    """Optimized == its XLA control bit for bit (the same rewritten program with XLA's
    all-reduce), and within class 3's bound of the original (another program); the HLO has
    Libra calls and no XLA all-reduce."""
    opt = optimize(step)
    expected = step(*args)
    got = jax.jit(opt)(*args)
    jax.tree.map(assert_bitwise, got, jax.jit(optimize(step, collectives="xla"))(*args))
    assert_codegen_close(got, expected)
    hlo = jax.jit(opt).lower(*args).as_text()
    report = opt.last_report
    if expect_calls:
        assert "libra_allreduce_cpu" in hlo
        assert "all_reduce" not in hlo, "an XLA all-reduce was left in the program"
        planned = sorted({p.blocks for p in report.plans})
        in_hlo = sorted({int(b) for b in re.findall(r"blocks = (\d+) : i64", hlo)})
        assert planned == in_hlo
    return report, hlo


@pytest.mark.parametrize("mode", MODES)
def test_mlp_step_fused_and_bitwise_its_control(mode):
    rng = np.random.default_rng(0)
    params = init(rng, [16, 32, 32, 8])
    step = data_parallel(mode, sgd_step(lambda p, x: jnp.sum(mlp(p, x) ** 2)))
    report, hlo = check(step, params, inputs(mode, rng))
    gradient = [p for p in report.plans if p.kind == "gradient"]
    assert sum(len(p.members) for p in gradient) >= 3  # three weight gradients (+ the loss)
    assert report.predicted and report.predicted[0]["backward_s"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_scan_over_microbatches(mode):
    rng = np.random.default_rng(1)
    params = init(rng, [16, 16, 4])
    def local_step(p, x, grad_psum):
        def micro(acc, xb):
            g = jax.grad(lambda p: jnp.sum(mlp(p, xb[None]) ** 2))(p)
            g = jax.tree.map(lambda v: grad_psum(v, "x"), g)
            return jax.tree.map(jnp.add, acc, g), None
        grads, _ = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, p), x)
        return jax.lax.psum(jnp.sum(x), "x"), jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)
    step = data_parallel(mode, local_step)
    report, _ = check(step, params, inputs(mode, rng))
    # Each microbatch's gradient psums (one per parameter): planned for one iteration, fused.
    loop, = report.loops
    assert loop.length == 4 and loop.gradient == len(params) and loop.calls < len(params), (
        report.plan_lines())
    assert [p.kind for p in report.plans if p.scope == loop.body] == ["gradient"] * loop.calls


@pytest.mark.parametrize("mode", MODES)
def test_cond_checkpoint_and_custom_vjp(mode):
    rng = np.random.default_rng(2)
    params = init(rng, [16, 24, 8])

    @jax.custom_vjp
    def scale(v):
        return v * 2.0
    scale.defvjp(lambda v: (v * 2.0, None), lambda _, g: (g * 2.0,))

    def loss_fn(p, x):
        h = jax.checkpoint(lambda p, x: jnp.tanh(x @ p["w0"]))(p, x)
        h = jax.lax.cond(jnp.sum(h) > 0, lambda h: h * 1.5, lambda h: h - 1.0, h)
        return jnp.sum(scale(h @ p["w1"]) ** 2)
    step = data_parallel(mode, sgd_step(loss_fn))
    check(step, params, inputs(mode, rng))


@pytest.mark.parametrize("mode", ["check_vma", "no_check_vma"])
def test_forward_psum_batch_norm_like(mode):
    rng = np.random.default_rng(3)
    params = init(rng, [16, 16, 4])
    def loss_fn(p, x):
        h = x @ p["w0"]
        mean = jax.lax.pmean(jnp.mean(h, axis=0), "x")       # forward psum (statistics)
        h = jnp.tanh(h - mean)
        return jnp.sum((h @ p["w1"]) ** 2)
    step = data_parallel(mode, sgd_step(loss_fn))
    report, _ = check(step, params, inputs(mode, rng))
    kinds = {p.kind for p in report.plans}
    assert "forward" in kinds and "gradient" in kinds


@pytest.mark.parametrize("mode", MODES)
def test_bf16_and_f32_gradients(mode):
    rng = np.random.default_rng(4)
    params = {"w0": (rng.standard_normal((16, 32)) * 0.3).astype(jnp.bfloat16),
              "w1": (rng.standard_normal((32, 8)) * 0.3).astype(np.float32)}
    step = data_parallel(mode, sgd_step(lambda p, x: jnp.sum(mlp(p, x) ** 2)))
    report, hlo = check(step, params, inputs(mode, rng))
    assert "bf16" in hlo


def test_2d_mesh():
    mesh = mesh_of((2, 4), ("a", "b"))
    rng = np.random.default_rng(5)
    params = init(rng, [8, 8, 4])
    x = shard(rng.standard_normal((16, 8)).astype(np.float32), mesh, P(("a", "b")))
    def body(p, x):
        loss, g = jax.value_and_grad(lambda p: jnp.sum(mlp(p, x) ** 2))(p)
        g = jax.lax.psum(g, ("a", "b"))
        h = jax.lax.psum(g["w0"], "b")  # a second axis set: never fused with the first
        return jax.lax.psum(loss, ("b", "a")), g, h
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(("a", "b"))),
                                 out_specs=(P(), P(), P("a")), check_vma=False))
    report, _ = check(step, params, x)
    for plan in report.plans:
        assert plan.axes in {("a", "b"), ("b",), ("b", "a")}


def test_function_without_psum_is_unchanged():
    f = jax.jit(lambda x: jnp.sin(x) * 2)
    closed = jax.make_jaxpr(f)(jnp.ones(3))
    new, report = rewrite_jaxpr(closed)
    assert str(new) == str(closed) and not report.plans
    assert_bitwise(optimize(f)(jnp.ones(3)), f(jnp.ones(3)))  # the same program


def test_optimize_builds_its_options_and_profile_once(monkeypatch):
    """`optimize` checks its options where it wraps and resolves the profile once a trace:
    the rewrite takes both as they are (issue 75: `Options` was built and checked again, and
    the profile resolved again, for every trace)."""
    from libra_jax import model
    from libra_jax.rewrite import rewriter

    built, resolved = [], []
    post_init = rewriter.Options.__post_init__
    monkeypatch.setattr(rewriter.Options, "__post_init__",
                        lambda self: (built.append(1), post_init(self))[1])
    resolve = model.resolve_profile
    monkeypatch.setattr(model, "resolve_profile",
                        lambda *a, **k: (resolved.append(1), resolve(*a, **k))[1])
    mesh = mesh_of((8,), ("x",))
    x = shard(np.ones((8, 64), np.float32), mesh, P("x"))
    f = optimize(jax.shard_map(lambda v: jax.lax.psum(v * 2, "x"), mesh=mesh, in_specs=P("x"),
                               out_specs=P()))
    assert len(built) == 1
    f(x)
    f(x * 2)  # cached: no trace
    assert len(built) == 1 and len(resolved) == 1


def test_explicit_blocks_kept_and_global_blocks():
    mesh = mesh_of((8,), ("x",))
    x = shard(np.ones((8, 64), np.float32), mesh, P("x"))
    def body(v):
        return libra_jax.psum(v * 2, "x", blocks=3), jax.lax.psum(v * 3, "x")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P(), P())))
    report, hlo = check(f, x)
    assert {p.kind: p.blocks for p in report.plans}["user"] == 3
    fixed = optimize(f, blocks=5)
    assert_codegen_close(jax.jit(fixed)(x), f(x))
    blocks = {p.kind: p.blocks for p in fixed.last_report.plans}
    assert blocks["user"] == 3 and blocks["gradient"] == 5


def test_enabled_false_and_environment_switch(monkeypatch):
    f = jax.jit(lambda x: x + 1)
    assert optimize(f, enabled=False) is f
    calls = []
    def g(x):
        calls.append(1)
        return x * 2
    opt = optimize(g)
    monkeypatch.setenv("LIBRA_JAX_DISABLE", "1")
    assert float(opt(jnp.float32(2))) == 4.0
    assert not opt.last_report and opt.last_report.report is None  # nothing planned
    with pytest.raises(ValueError, match="blocks must be in"):
        optimize(g, blocks=0)


def test_decorator_form_and_cache():
    @optimize(profile="cpu-host", fusion=False)
    def f(x):
        return jax.pmap(lambda v: jax.lax.psum(v * 2, "i"), axis_name="i")(x)
    x = np.arange(8.0, dtype=np.float32)
    np.testing.assert_array_equal(f(x), np.full(8, 56.0))
    first = f.last_report
    f(x)
    assert f.last_report is first  # the same argument types reuse the rewritten program


def test_unsupported_psum_left_with_warning():
    x = np.arange(8.0, dtype=np.float32)
    f = jax.pmap(lambda v: jax.lax.psum(v, "i", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]),
                 axis_name="i")
    with pytest.warns(UserWarning, match="axis_index_groups"):
        out = optimize(f)(x)
    assert_bitwise(out, f(x))  # the psum left as it was: the same program


PLAN_SCRIPT = textwrap.dedent("""
    import os
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from libra_jax.rewrite import optimize
    mesh = jax.make_mesh((8,), ("x",))
    params = {f"w{i}": jnp.ones((32 + i, 32 + i + 1)) for i in range(12)}
    def body(p, x):
        def loss(p):
            h = x[:, :32]
            for i in range(12):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.sum(h)
        return jax.grad(loss)(p)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P()))
    opt = optimize(f)
    x = jax.device_put(np.ones((64, 32), np.float32), jax.NamedSharding(mesh, P("x")))
    jax.jit(opt).lower(params, x)
    print(opt.last_report.plans)
""")


def test_plan_identical_in_two_fresh_processes():
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "XLA_FLAGS": xla_flags(8)}
        proc = subprocess.run([sys.executable, "-c", PLAN_SCRIPT], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout)
    assert outs[0] == outs[1] and "CallPlan" in outs[0]


def test_public_name():
    import libra_jax.rewrite  # noqa: F401 - importing the module must not shadow the function

    assert libra_jax.optimize is optimize


CACHE_SCRIPT = textwrap.dedent("""
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from jax.sharding import PartitionSpec as P
    import libra_jax
    mesh = jax.make_mesh((8,), ("x",))
    def body(p, x):
        return jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p) ** 2))(p)
    f = jax.jit(libra_jax.optimize(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")),
                                                 out_specs=P())))
    x = jax.device_put(np.arange(64.0, dtype=np.float32).reshape(16, 4) / 64,
                       jax.NamedSharding(mesh, P("x")))
    out = np.asarray(f(np.ones((4, 3), np.float32), x))
    print(len(os.listdir(sys.argv[1])), out.tobytes().hex())
""")


def test_persistent_compilation_cache(tmp_path):
    """A second process loads the optimized executable from JAX's cache and gets the same bits."""
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", CACHE_SCRIPT, str(tmp_path)],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "XLA_FLAGS": xla_flags(8)})
        assert proc.returncode == 0, proc.stderr
        runs.append(proc.stdout.split())
    (entries_1, bits_1), (entries_2, bits_2) = runs
    assert int(entries_1) >= 1 and entries_2 == entries_1  # nothing new compiled the 2nd time
    assert bits_1 == bits_2


def test_fusion_off_and_psum_hidden_in_a_later_jit():
    """fusion=False: one all-reduce per psum. A psum feeding a jitted function that itself
    all-reduces is a forward psum, not a gradient one."""
    mesh = mesh_of((8,), ("x",))
    x = shard(np.arange(64.0, dtype=np.float32).reshape(8, 8), mesh, P("x"))
    inner = jax.jit(lambda v: jax.lax.psum(v * 2.0, "x"))
    def body(v):
        a = jax.lax.psum(v, "x")       # feeds the jitted psum: forward
        b = jax.lax.psum(v * 3.0, "x")  # terminal
        c = jax.lax.psum(v * 5.0, "x")  # terminal
        return inner(a), b, c
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P(), P(), P()),
                              check_vma=False))
    report, _ = check(f, x)
    kinds = sorted(p.kind for p in report.plans if p.scope.endswith("shard_map"))
    assert kinds == ["forward", "gradient"]  # b and c fused
    opt = optimize(f, fusion=False, blocks=2)
    assert_codegen_close(jax.jit(opt)(x), f(x))
    plans = [p for p in opt.last_report.plans
             if p.kind == "gradient" and p.scope.endswith("shard_map")]
    assert len(plans) == 2 and all(len(p.members) == 1 and p.blocks == 2 for p in plans)


def test_update_compute_is_not_counted_as_overlap():
    """Compute that consumes the all-reduced gradients (the optimizer update) cannot overlap
    them: the planner sees the same backward stream with or without a heavy update."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(9)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    x = shard(rng.standard_normal((64, 64)).astype(np.float32), mesh, P("x"))
    def make(update_steps):
        def body(w, x):
            g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
            g = jax.lax.psum(g, "x")
            w = w - 0.1 * g  # used: a psum whose result is unused is dead code, not planned
            for _ in range(update_steps):  # depends on g
                w = jnp.tanh(w @ g)
            return w
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                                     check_vma=False))
    layers = []
    for steps in (0, 20):
        f = make(steps)
        opt = optimize(f)
        assert_codegen_close(jax.jit(opt)(w, x), f(w, x))
        (entry,) = opt.last_report.predicted
        layers.append(entry["layers"])
    assert layers[0] == layers[1]


def test_gradient_used_before_the_next_psum_is_still_fused():
    """A gradient all-reduce whose result is used at once (a reshape, a scale: what a bias
    gradient under check_vma gets) still shares a bucket with a later one: the uses move after
    the fused all-reduce. (`gb` feeds a later psum, so it is no gradient and runs alone.)"""
    mesh = mesh_of((8,), ("x",))

    def body(w, b, x):
        gw = jax.lax.psum(jnp.tanh(x @ w), "x")
        gw = gw.reshape(-1) * 0.5                  # used before the next psum...
        gb = jax.lax.psum(jnp.sum(x, 0) * b, "x")  # ...which does not depend on it
        chained = jax.lax.psum(gb * 2.0, "x")      # depends on gb: its own all-reduce
        return gw, chained

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("x")),
                                 out_specs=(P(), P()), check_vma=False))
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    x = shard(rng.standard_normal((8 * 4, 16)).astype(np.float32), mesh, P("x"))
    opt = optimize(step)
    assert_codegen_close(jax.jit(opt)(w, b, x), step(w, b, x))
    plans = sorted((len(p.members), p.kind) for p in opt.last_report.plans)
    assert plans == [(1, "forward"), (2, "gradient")], opt.last_report.plan_lines()


def test_fused_bucket_falls_back_to_xla_under_check_vma(monkeypatch):
    # A fused bucket's packed buffer carries no varying axes: where libra has no kernel (here
    # cuda with LIBRA_JAX_CUDA=xla), XLA's all-reduce must still take it.
    monkeypatch.setenv("LIBRA_JAX_CUDA", "xla")
    rng = np.random.default_rng(4)
    params = init(rng, [16, 8, 8, 4])
    step = data_parallel("check_vma", sgd_step(lambda p, x: jnp.sum(mlp(p, x) ** 2)))
    opt = optimize(step, blocks=1)
    with pytest.warns(UserWarning, match="XLA's all-reduce"):
        text = jax.jit(opt).trace(params, inputs("check_vma", rng)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert any(len(p.members) > 1 for p in opt.last_report.plans)  # a fused bucket
    assert "all_reduce" in text and "libra_allreduce" not in text


def test_optimize_with_a_profile_object_plans_forward_and_loop_psums():
    # A forward pmean (statistics) and a psum in a scan body are given the model's default
    # blocks, through dropins.default_blocks' cache: with a model.Profile object that
    # raised "unhashable type: 'dict'".
    from libra_jax import model

    rng = np.random.default_rng(7)
    mesh = mesh_of((8,), ("x",))

    def local(params, x):
        mu = jax.lax.pmean(jnp.mean(x, 0), "x")
        total, _ = jax.lax.scan(lambda c, row: (c + jax.lax.psum(row.sum(), "x"), None), 0.0, x)
        loss, grads = jax.value_and_grad(
            lambda p: jax.lax.pmean(jnp.mean(mlp(p, x - mu) ** 2), "x"))(params)
        return loss + total, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()))
    params = init(rng, [16, 8, 4])
    x = shard(rng.standard_normal((32, 16)).astype(np.float32), mesh, P("x"))
    by_name = optimize(step, profile="cpu-host")
    by_value = optimize(step, profile=model.load_profile("cpu-host"))
    assert_codegen_close(jax.jit(by_value)(params, x), jax.jit(step)(params, x))
    jax.jit(by_name)(params, x)
    kinds = {p.kind for p in by_value.last_report.plans}
    assert {"forward", "loop", "gradient"} <= kinds, by_value.last_report.plan_lines()
    assert by_value.last_report.plan_lines() == by_name.last_report.plan_lines()


# --- Code as people write it ---------------------------------------------------------------

def _dropout_step(mesh, key_kind):
    def local(w, x, key):
        def loss(w):
            k = jax.random.fold_in(key, jax.lax.axis_index("x"))
            h = x @ w
            keep = jax.random.bernoulli(k, 0.9, h.shape)
            return jax.lax.pmean(jnp.mean(jnp.where(keep, h, 0.0) ** 2), "x")
        value, g = jax.value_and_grad(loss)(w)
        return value, w - 0.1 * g
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x"), P()), out_specs=(P(), P()))


@pytest.mark.parametrize("key_kind", ["typed", "legacy"])
def test_a_step_with_random_keys(key_kind):
    # Dropout: a typed key (key<fry>, an extended dtype numpy cannot name) or a legacy one.
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    x = shard(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("x"))
    key = jax.random.key(3) if key_kind == "typed" else jax.random.PRNGKey(3)
    step = _dropout_step(mesh, key_kind)
    opt = optimize(step)
    assert_codegen_close(jax.jit(opt)(w, x, key), jax.jit(step)(w, x, key))
    assert opt.last_report.plans
    assert libra_jax.explain(step, w, x, key, file=None).scopes


@pytest.mark.parametrize("overlap", ["sync", "start-done"])
def test_a_shard_map_under_jax_set_mesh_with_fused_buckets(overlap):
    # The fused and start/done equations keep their member's context (the mesh JAX checks
    # psum types against); without it: "context mesh ... should match the aval mesh".
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(2)
    params = init(rng, [16, 32, 8])

    def local(params, x):
        loss, grads = jax.value_and_grad(
            lambda p: jax.lax.pmean(jnp.mean(mlp(p, x) ** 2), "x"))(params)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    with jax.set_mesh(mesh):
        x = jax.device_put(rng.standard_normal((64, 16)).astype(np.float32), P("x"))
        step = jax.shard_map(local, in_specs=(P(), P("x")), out_specs=(P(), P()))
        opt = optimize(step, overlap=overlap, blocks=1)
        got, want = jax.jit(opt)(params, x), jax.jit(step)(params, x)
    assert_codegen_close(got[0], want[0])
    assert any(len(p.members) > 1 for p in opt.last_report.plans), opt.last_report.plan_lines()
    assert all(p.overlap == overlap for p in opt.last_report.plans if p.kind == "gradient")


def _configured_step(mesh):
    def step(w, x, train, *, lr_fn, scale=1.0):
        def local(w, x):
            def loss(w):
                h = x @ w
                if train:  # a Python bool: must be static
                    h = h * scale
                return jax.lax.pmean(jnp.mean(h ** 2), "x")
            value, g = jax.value_and_grad(loss)(w)
            return value, w - lr_fn(0) * g
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()))(w, x)
    return step


def test_static_arguments_as_jax_jit_takes_them():
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(5)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    x = shard(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("x"))
    step = _configured_step(mesh)
    lr = lambda i: 0.1  # noqa: E731 - a schedule function, as optax passes them
    want = {train: jax.jit(step, static_argnums=2, static_argnames="lr_fn")(
        w, x, train, lr_fn=lr, scale=2.0) for train in (True, False)}
    opt = optimize(step, static_argnums=2, static_argnames="lr_fn")
    for train in (True, False):  # each value its own program
        assert_codegen_close(opt(w, x, train, lr_fn=lr, scale=2.0), want[train])
    outer = jax.jit(opt, static_argnums=2, static_argnames="lr_fn")
    assert_codegen_close(outer(w, x, True, lr_fn=lr, scale=2.0), want[True])
    # A jitted step's own static arguments are read from it.
    inner = optimize(jax.jit(step, static_argnums=2, static_argnames="lr_fn"))
    assert_codegen_close(inner(w, x, False, lr_fn=lr, scale=2.0), want[False])
    assert inner.last_report.plans
    with pytest.raises(ValueError, match=r"static argument 2 is not hashable \(list\)"):
        opt(w, x, [True], lr_fn=lr)
    with pytest.raises(TypeError, match="static_argnums must be ints"):
        optimize(step, static_argnums="train")
    # explain takes the same static arguments, and the step's keyword arguments.
    e = libra_jax.explain(step, w, x, True, lr_fn=lr, scale=2.0, static_argnums=2,
                          static_argnames="lr_fn", file=None)
    assert e.scopes
    assert libra_jax.explain(opt, w, x, True, lr_fn=lr, file=None).scopes


def test_an_outer_jits_static_arguments_stay_static():
    """Flax lm1b's form: ``jax.jit(optimize(train_step), static_argnums=(2, 3, 4))``. The
    outer jit hands its static arguments over as Python objects beside tracers; optimize
    traced them as arrays (a float used in Python control flow, a config, a schedule)."""
    import dataclasses

    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(6)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    x = shard(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("x"))

    @dataclasses.dataclass(frozen=True)
    class Config:
        depth: int = 2
        activation: str = "tanh"

    def train_step(w, x, config, learning_rate_fn, label_smoothing):
        def local(w, x):
            def loss(w):
                h = x
                for _ in range(config.depth):  # Python ints and strings: static
                    h = getattr(jnp, config.activation)(h @ w @ w.T)
                if label_smoothing > 0:  # a Python float in control flow
                    h = h * (1 - label_smoothing)
                return jax.lax.pmean(jnp.mean(h ** 2), "x")
            value, g = jax.value_and_grad(loss)(w)
            return value, w - learning_rate_fn(0) * g
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()))(w, x)

    lr = lambda i: 0.01  # noqa: E731 - a schedule function, as optax passes them
    want = jax.jit(train_step, static_argnums=(2, 3, 4))(w, x, Config(), lr, 0.1)
    opt = optimize(train_step)
    outer = jax.jit(opt, static_argnums=(2, 3, 4))
    got = outer(w, x, Config(), lr, 0.1)
    assert_codegen_close(got, want)
    jax.tree.map(assert_bitwise, got, jax.jit(optimize(train_step, collectives="xla"),
                                              static_argnums=(2, 3, 4))(w, x, Config(), lr, 0.1))
    assert opt.last_report.plans
    # Each static value is its own program (the cache key holds it).
    other = outer(w, x, Config(depth=1), lr, 0.0)
    assert_codegen_close(other, jax.jit(train_step, static_argnums=(2, 3, 4))(
        w, x, Config(depth=1), lr, 0.0))
    # static_argnums on optimize itself keeps working beside the outer jit's.
    both = jax.jit(optimize(train_step, static_argnums=(2, 3, 4)), static_argnums=(2, 3, 4))
    assert_codegen_close(both(w, x, Config(), lr, 0.1), want)


def test_a_static_leaf_that_cannot_key_the_cache_is_named():
    mesh = mesh_of((8,), ("x",))
    x = shard(np.ones((16, 4), np.float32), mesh, P("x"))

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

    def step(x, box):
        return jax.shard_map(lambda x: jax.lax.psum(x, "x"), mesh=mesh, in_specs=P("x"),
                             out_specs=P())(x)
    # A pytree that holds an unhashable object beside a traced array (eqx.filter_jit passes
    # such leaves through; plain jax.jit cannot).
    with pytest.raises(TypeError, match=r"argument leaf args\[1\]\['box'\] \(Unhashable\)"
                                        r".*not hashable"):
        jax.jit(lambda x: optimize(step)(x, {"box": Unhashable()}))(x)


def test_an_equinox_model_with_a_function_leaf_under_filter_jit():
    """``eqx.filter_jit(optimize(f))(model, x)``: `eqx.nn.MLP` holds its activation (a
    function) as a leaf, which filter_jit keeps static; optimize traced it."""
    eqx = pytest.importorskip("equinox")
    import optax

    mesh = mesh_of((8,), ("data",))
    model = eqx.nn.MLP(12, 3, 16, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    tx = optax.sgd(0.1)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    rng = np.random.default_rng(7)
    x = shard(rng.standard_normal((64, 12)).astype(np.float32), mesh, P("data"))
    y = shard(rng.standard_normal((64, 3)).astype(np.float32), mesh, P("data"))

    def train_step(model, opt_state, x, y):
        def local(x, y):
            def loss_fn(model):
                return jnp.mean((jax.vmap(model)(x) - y) ** 2)
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
            return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")
        loss, grads = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")),
                                    out_specs=P(), check_vma=False)(x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    want = eqx.filter_jit(train_step)(model, opt_state, x, y)
    opt = optimize(train_step)
    got = eqx.filter_jit(opt)(model, opt_state, x, y)
    control = eqx.filter_jit(optimize(train_step, collectives="xla"))(model, opt_state, x, y)
    arrays = lambda t: eqx.filter(t, eqx.is_array)  # noqa: E731
    jax.tree.map(assert_bitwise, arrays(got), arrays(control))
    assert_codegen_close(arrays(got), arrays(want))  # one SGD step: linear in the gradient
    assert got[0].activation is jax.nn.gelu
    assert any(p.kind == "gradient" for p in opt.last_report.plans), opt.last_report.plan_lines()


def _leaf_kinds(tree):
    """Each leaf's type, and an array's dtype and weak type: what an outer transformation
    made of it, compared between a step and its `optimize`d form."""
    return [(type(x), getattr(x, "dtype", None), getattr(x, "weak_type", None))
            for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("wrap", ["eager", "jax.jit", "eqx.filter_jit", "nnx.jit"])
def test_optimize_converts_no_output_leaf(wrap):
    """A Python bool, int or float the step returns (a string and a function, where the
    outer transformation allows them) leaves `optimize` as the step returned it, and the
    outer transformation makes of it what it makes of the plain step's: `jax.jit` and
    `nnx.jit` weak-typed arrays, `eqx.filter_jit` and an eager call the Python values.
    optimize made every number an array, so `eqx.filter_jit` returned an Equinox model's
    flag as one (issue 68)."""
    eqx = pytest.importorskip("equinox")
    from flax import nnx

    mesh = mesh_of((8,), ("x",))
    x = shard(np.arange(32, dtype=np.float32).reshape(8, 4), mesh, P("x"))

    def step(x, extras):
        total = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P())(x)
        return {"sum": total, "flag": True, "count": 3, "rate": 0.5, **extras}

    # jax.jit and nnx.jit return no string or function, of the plain step either.
    extras = {"name": "mlp", "act": jax.nn.gelu} if wrap in ("eager", "eqx.filter_jit") else {}
    outer = {"eager": lambda f: f, "jax.jit": jax.jit, "eqx.filter_jit": eqx.filter_jit,
             "nnx.jit": nnx.jit}[wrap]
    want, got = outer(step)(x, extras), outer(optimize(step))(x, extras)
    assert _leaf_kinds(got) == _leaf_kinds(want)
    assert len(_leaf_kinds(got)) == 4 + len(extras)
    if wrap in ("eager", "eqx.filter_jit"):
        assert got["flag"] is True and type(got["count"]) is int and got["rate"] == 0.5
        assert got["act"] is jax.nn.gelu and got["name"] == "mlp"
    jax.tree.map(assert_bitwise, eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array))


def test_an_equinox_model_with_dropout_trains_steps_under_filter_jit():
    """The README's Equinox pattern with an ``eqx.nn.Dropout(0.1, inference=True)`` in the
    model: ``eqx.filter_jit(optimize(train_step))`` returns the model with ``inference``
    the bool it was, as ``eqx.filter_jit(train_step)`` does, so its next step traces. It
    came back an array, whose truth step 2 asked of a tracer (TracerBoolConversionError)."""
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        mlp: eqx.nn.MLP
        dropout: eqx.nn.Dropout

        def __call__(self, x):
            return self.dropout(self.mlp(x))

    mesh = mesh_of((8,), ("data",))
    model = Model(eqx.nn.MLP(4, 1, 8, 1, activation=jax.nn.gelu, key=jax.random.key(0)),
                  eqx.nn.Dropout(0.1, inference=True))

    def train_step(model, x, y):
        def local(x, y):
            loss_fn = lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)  # noqa: E731
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
            return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")
        loss, grads = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")),
                                    out_specs=P(), check_vma=False)(x, y)
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), loss

    x = shard(np.linspace(-1, 1, 256, dtype=np.float32).reshape(64, 4), mesh, P("data"))
    y = shard(np.ones((64, 1), np.float32), mesh, P("data"))
    plain, fast = eqx.filter_jit(train_step), eqx.filter_jit(optimize(train_step))
    want, got = model, model
    for _ in range(3):
        want, want_loss = plain(want, x, y)
        got, got_loss = fast(got, x, y)
        assert _leaf_kinds(got) == _leaf_kinds(want)
        assert got.dropout.inference is True and got.mlp.activation is jax.nn.gelu
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    arrays = lambda t: eqx.filter(t, eqx.is_array)  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 arrays(got), arrays(want))


def test_a_psum_of_a_constant_zero_costs_no_call():
    """The gradient of a float leaf no derivative reaches (Equinox's ``Dropout.p``) is a
    constant zero; each pmean of it was an all-reduce of its own. Folded, it is bitwise
    jax.lax.psum's (XLA multiplies a constant's sum out: -0 stays -0); a nonzero constant
    stays a psum."""
    mesh = mesh_of((8,), ("data",))

    def local(params, x):
        def loss(params):  # p only decides which entries drop out: no derivative reaches it
            keep = jax.random.bernoulli(jax.random.key(0), 1 - params["p"], x.shape)
            return jnp.mean((jnp.where(keep, x, 0) @ params["w"]) ** 2)
        grads = jax.grad(loss)(params)
        return (jax.lax.pmean(grads, "data"), jax.lax.psum(jnp.full((3,), -0.0), "data"),
                jax.lax.psum(jnp.zeros((2, 2), jnp.int32), "data"),
                jax.lax.psum(jnp.full((3,), 0.5), "data"))

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                                 check_vma=False))
    params = {"w": np.ones((4, 2), np.float32), "p": np.float32(0.1)}
    x = shard(np.random.default_rng(9).standard_normal((32, 4)).astype(np.float32), mesh,
              P("data"))
    opt = optimize(step)
    got, want = jax.jit(opt)(params, x), step(params, x)
    jax.tree.map(assert_bitwise, got[1:], want[1:])  # the constants' sums: XLA's bits
    assert np.signbit(got[1]).all()
    assert_codegen_close(got[0], want[0])
    report = opt.last_report
    assert report.folded == ["psum of zeros in top/jit/shard_map"] * 3, report.folded
    # The nonzero constant's psum, a result only, joins the gradient's bucket
    # (`sites.value_sites`): one call.
    assert sorted(len(p.members) for p in report.plans) == [2], report.plan_lines()
    text = jax.jit(opt).lower(params, x).as_text()
    assert len(re.findall(r"custom_call @libra_allreduce_cpu(?:_start)?\(", text)) == 1


# --- Flax NNX: in-place updates ---------------------------------------------------------------

def test_an_nnx_step_keeps_its_in_place_updates_in_every_composition():
    """Wrapped in optimize, an NNX step updated nothing (the traced copies of its arguments
    were updated and dropped): eager, ``nnx.jit(optimize(step))`` and
    ``optimize(nnx.jit(step))`` each match ``nnx.jit(step)``: parameters, the optimizer's
    step count and moments, metrics, BatchNorm statistics and the dropout stream's count.
    The step is the corpus's NNX in-place one (docs style: `nnx.Optimizer`, `nnx.MultiMetric`,
    dropout `Rngs`, BatchNorm synchronised over the data axis)."""
    from flax import nnx

    from corpus import nnx_in_place

    def train(wrap, steps=2):
        case = nnx_in_place()  # new objects each time
        model, optimizer, metrics = case.state
        start = jax.tree.map(np.array, nnx.state(model, nnx.Param))
        fn = wrap(case.step)
        losses = [fn(case.state, *case.batch)[1] for _ in range(steps)]
        return {"losses": jnp.stack(losses), "metrics": metrics.compute(),
                "batch_stats": nnx.state(model, nnx.BatchStat),
                "rng_count": model.drop.rngs.count[...], "step": optimizer.step[...],
                "params": nnx.state(model, nnx.Param), "start": start, "fn": fn}

    want = train(nnx.jit)
    assert int(want["step"]) == 2 and int(want["rng_count"]) == 2
    compositions = {"eager": optimize,
                    "nnx.jit(optimize(step))": lambda f: nnx.jit(optimize(f)),
                    "optimize(nnx.jit(step))": lambda f: optimize(nnx.jit(f))}
    for name, wrap in compositions.items():
        got = train(wrap)
        assert int(got["step"]) == 2 and int(got["rng_count"]) == 2, name
        assert_codegen_close([got[k] for k in ("losses", "metrics", "batch_stats")],
                             [want[k] for k in ("losses", "metrics", "batch_stats")])
        moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                             got["params"], got["start"]))
        assert min(moved) > 1e-3, (name, moved)  # two Adam steps of 1e-2
    # The optimized step is bitwise its XLA control (class 2), and it planned the gradients.
    opt = train(optimize)
    control = train(lambda f: optimize(f, collectives="xla"))
    jax.tree.map(assert_bitwise, [opt[k] for k in ("losses", "params", "batch_stats")],
                 [control[k] for k in ("losses", "params", "batch_stats")])
    report = opt["fn"].last_report
    assert any(p.kind == "gradient" for p in report.plans), report.plan_lines()
    # explain plans such a step (and changes nothing).
    case = nnx_in_place()
    assert libra_jax.explain(case.step, case.state, *case.batch, file=None).scopes
    assert int(case.state[1].step[...]) == 0


def test_the_nnx_repro_of_the_issue():
    """The smallest form: a `pmean` inside a `jax.shard_map`, a parameter updated in place."""
    from flax import nnx

    mesh = mesh_of((8,), ("data",))

    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    def step(m, x):
        g = jax.shard_map(lambda x: jax.lax.pmean(x, "data"), mesh=mesh, in_specs=P("data"),
                          out_specs=P())(x)
        m.w[...] += g[:2]

    x = shard(jnp.ones(16), mesh, P("data"))
    for wrap in (optimize, lambda f: nnx.jit(optimize(f)), lambda f: optimize(nnx.jit(f))):
        m = M()
        wrap(step)(m, x)
        np.testing.assert_array_equal(m.w[...], [1.0, 1.0])


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients_are_the_psums_of_the_backward_pass_not_metrics_or_statistics(check_vma):
    # Metrics (loss, accuracy) and batch statistics feed no later psum either; they were
    # planned (fused, split) as gradients. A gradient psum is one of the backward pass.
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(8)

    def local(w, b, x, y):
        def loss(w, b):
            h = x @ w
            mu = jax.lax.pmean(jnp.mean(h, 0), "x")           # a batch statistic
            out = jnp.mean((h - mu + b - y) ** 2)
            return jax.lax.pmean(out, "x") if check_vma else out
        value, (gw, gb) = jax.value_and_grad(loss, argnums=(0, 1))(w, b)
        if not check_vma:  # local gradients, averaged by hand
            gw, gb = jax.lax.pmean((gw, gb), "x")
            value = jax.lax.pmean(value, "x")
        acc = jax.lax.pmean(jnp.mean(((x @ w) > 0) == (y > 0)), "x")  # a metric
        return value, acc, w - 0.1 * gw, b - 0.1 * gb

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("x"), P("x")),
                         out_specs=(P(), P(), P(), P()), check_vma=check_vma)
    args = (rng.standard_normal((4, 2)).astype(np.float32),
            rng.standard_normal(2).astype(np.float32),
            shard(rng.standard_normal((64, 4)).astype(np.float32), mesh, P("x")),
            shard(rng.standard_normal((64, 2)).astype(np.float32), mesh, P("x")))
    opt = optimize(step)
    assert_codegen_close(jax.jit(opt)(*args), jax.jit(step)(*args))
    body = jax.make_jaxpr(step)(*args).jaxpr.eqns[0].params["jaxpr"]
    # (kind, elements): JAX versions differ in unit axes ((1, 2) or (2,) for b's cotangent).
    kinds = sorted((p.kind, int(np.prod(body.eqns[i].invars[0].aval.shape)))
                   for p in opt.last_report.plans for i in p.members)
    # The loss and the accuracy, which nothing in the step reads, join the gradients'
    # bucket (`sites.value_sites`); the batch mean, which the loss reads, stays forward.
    assert kinds == sorted([
        ("forward", 2),            # the batch mean
        ("gradient", 1),           # the loss
        ("gradient", 1),           # the accuracy
        ("backward", 2),           # the batch mean's cotangent
        ("gradient", 8),           # w
        ("gradient", 2),           # b
    ]), opt.last_report.plan_lines()
    gradient_buckets = [p for p in opt.last_report.plans if p.kind == "gradient"]
    assert sum(len(p.members) for p in gradient_buckets) == 4
    # explain says how each psum was classified.
    text = str(libra_jax.explain(step, *args, file=None))
    assert "forward" in text and "backward" in text


def test_a_loss_pmean_nothing_reads_joins_the_gradients_bucket_bitwise():
    """The loss's pmean at the end of the forward pass was a call of its own, every device
    meeting mid-step; nothing reads it, so it joins the gradients' bucket (one call), the
    same sums by the same engine: bitwise ``ready="written"``, which keeps it apart. A loss
    the update reads stays where it is."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(3)
    params = init(rng, [16, 8, 4])
    x = shard(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("x"))

    def local(params, x, scale_by_loss=False):
        value, grads = jax.value_and_grad(lambda p: jnp.mean(mlp(p, x) ** 2))(params)
        grads, value = jax.lax.pmean((grads, value), "x")
        lr = 0.1 * value if scale_by_loss else 0.1
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), value

    def step(scale_by_loss=False):
        return jax.jit(jax.shard_map(functools.partial(local, scale_by_loss=scale_by_loss),
                                     mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                                     check_vma=False))  # (local gradients, averaged by hand)
    joined, apart = optimize(step()), optimize(step(), ready="written")
    got, want = jax.jit(joined)(params, x), jax.jit(apart)(params, x)
    jax.tree.map(assert_bitwise, got, want)
    assert [(p.kind, len(p.members)) for p in joined.last_report.plans] == [("gradient", 3)]
    assert sorted(p.kind for p in apart.last_report.plans) == ["forward", "gradient"]
    read = optimize(step(scale_by_loss=True))
    jax.jit(read)(params, x)
    assert sorted(p.kind for p in read.last_report.plans) == ["forward", "gradient"]


def test_every_scope_of_a_report_has_its_own_name():
    # Two shard_maps in one step (and a cond's two branches) were two scopes of one name.
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(9)
    params = init(rng, [16, 8, 4])

    def local(params, x):
        grads = jax.grad(lambda p: jax.lax.pmean(jnp.mean(mlp(p, x) ** 2), "x"))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    sm = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())

    def step(params, x, flag):
        params = sm(sm(params, x), x)
        return jax.lax.cond(flag, lambda p: sm(p, x), lambda p: sm(p, x * 2.0), params)

    x = shard(rng.standard_normal((32, 16)).astype(np.float32), mesh, P("x"))
    opt = optimize(step)
    assert_codegen_close(jax.jit(opt)(params, x, True), jax.jit(step)(params, x, True))
    scopes = [e["scope"] for e in opt.last_report.predicted]
    assert len(scopes) == 4 and len(set(scopes)) == 4, scopes
    assert "top/shard_map" in scopes and "top/shard_map#2" in scopes
    text = str(libra_jax.explain(step, params, x, True, file=None))
    assert all(f"scope {s}," in text for s in scopes)


@pytest.mark.parametrize("blocks, error", [(0, ValueError), (1000, ValueError),
                                           (1.5, TypeError), (True, TypeError)])
def test_explain_and_rewrite_jaxpr_validate_blocks_as_optimize_does(blocks, error):
    rng = np.random.default_rng(11)
    params = init(rng, [16, 8, 4])
    step = data_parallel("check_vma", sgd_step(lambda p, x: jnp.sum(mlp(p, x) ** 2)))
    x = inputs("check_vma", rng)
    with pytest.raises(error, match="blocks"):
        optimize(step, blocks=blocks)
    with pytest.raises(error, match="blocks"):
        libra_jax.explain(step, params, x, blocks=blocks, file=None)
    with pytest.raises(error, match="blocks"):
        rewrite_jaxpr(jax.make_jaxpr(step)(params, x), blocks=blocks)


def test_optimize_of_something_not_callable_is_a_type_error():
    with pytest.raises(TypeError, match="expected a function to optimize, got 3"):
        optimize(3)


def test_optimize_takes_a_profile_document_and_names_a_bad_profile_argument():
    from libra_jax import model

    rng = np.random.default_rng(12)
    params = init(rng, [16, 8, 4])
    step = data_parallel("check_vma", sgd_step(lambda p, x: jnp.sum(mlp(p, x) ** 2)))
    x = inputs("check_vma", rng)
    doc = model.profile_to_dict(model.load_profile("cpu-host"))
    by_doc, by_name = optimize(step, profile=doc), optimize(step, profile="cpu-host")
    jax.jit(by_doc)(params, x), jax.jit(by_name)(params, x)
    assert by_doc.last_report.plan_lines() == by_name.last_report.plan_lines()
    with pytest.raises(TypeError, match=r"profile must be a profile name, a path, a "
                                        r"model.Profile or its JSON document \(a dict\), got int"):
        optimize(step, profile=3)


#: Every option of `optimize` and `rewrite_jaxpr` typed bool, or a choice of strings, and the
#: values of the bad ones each takes (`prefetch` takes "off" and numbers of gathers, `overlap`
#: and `prefetch` None: the environment's default).
BOOL_OPTIONS = ("fusion", "enabled")
CHOICE_OPTIONS = {"overlap": (None,), "loops": (), "prefetch": (None, "off", 2, 0, 1), "ready": (),
                  "collectives": ()}
BAD_VALUES = ("off", "false", "no", "", 2, 0, 1, None, 1.0, True, np.array([True]))
OF_REWRITE_JAXPR = ("fusion", "overlap", "loops", "prefetch", "ready")


def _bad_option_cases():
    for option in (*BOOL_OPTIONS, *CHOICE_OPTIONS):
        allowed = CHOICE_OPTIONS.get(option, ())
        for value in BAD_VALUES:
            if option in BOOL_OPTIONS and value is True:
                continue
            if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
                yield pytest.param(option, value, id=f"{option}={value!r}")


@pytest.mark.parametrize("option, value", list(_bad_option_cases()))
def test_options_take_what_their_type_says(option, value):
    """A bool option takes a bool (Python's or NumPy's) and refuses anything else with a
    one-line TypeError naming it and the value: ``fusion="off"`` was fusion on (``bool("off")``)
    and 0/1 are no bools. A string option refuses a non-string and an unknown string with a
    one-line ValueError naming it; both in the decorator form, where ``enabled=False``, and in
    `rewrite_jaxpr` (whose fusion was not checked at all) and `explain`."""
    error, says = ((TypeError, rf"{option} must be True or False \(a bool\), got ")
                   if option in BOOL_OPTIONS else (ValueError, rf"{option} must be "))
    calls = [lambda: optimize(lambda x: x, **{option: value}),
             lambda: optimize(**{option: value})]
    if option != "enabled":
        calls.append(lambda: optimize(lambda x: x, enabled=False, **{option: value}))
    if option in OF_REWRITE_JAXPR:
        closed = jax.make_jaxpr(lambda x: x * 2)(np.ones(2, np.float32))
        calls.append(lambda: rewrite_jaxpr(closed, **{option: value}))
        calls.append(lambda: libra_jax.explain(lambda x: x * 2, np.ones(2, np.float32),
                                               file=None, **{option: value}))
    for call in calls:
        with pytest.raises(error, match=f"^libra_jax.optimize: {says}") as info:
            call()
        assert "\n" not in str(info.value) and repr(value) in str(info.value)


def test_numpy_bools_are_bools():
    """``fusion=np.bool_(False)`` is fusion off, as ``fusion=False`` (the same plan, and one
    program cached for both), and ``enabled=np.bool_(False)`` passes the step through."""
    from libra_jax.rewrite.rewriter import Options

    rng = np.random.default_rng(13)
    params = init(rng, [16, 8, 8, 4])
    step = data_parallel("check_vma", sgd_step(lambda p, x: jnp.sum(mlp(p, x) ** 2)))
    x = inputs("check_vma", rng)
    reports = {}
    for fusion in (True, False, np.True_, np.False_):
        opt = optimize(step, fusion=fusion, overlap="sync")
        jax.make_jaxpr(opt)(params, x)
        reports[fusion] = opt.last_report.plan_lines()
    assert reports[np.False_] == reports[False] != reports[True] == reports[np.True_]
    closed = jax.make_jaxpr(step)(params, x)
    assert (rewrite_jaxpr(closed, fusion=np.False_, overlap="sync")[1].plan_lines()
            == rewrite_jaxpr(closed, fusion=False, overlap="sync")[1].plan_lines())
    assert Options(profile=None, fusion=np.False_, blocks=None).cache_key() == Options(
        profile=None, fusion=False, blocks=None).cache_key()
    assert type(Options(profile=None, fusion=np.True_, blocks=None).fusion) is bool
    assert optimize(step, enabled=np.False_) is step
    assert optimize(step, enabled=np.True_) is not step


def test_the_default_profile_on_a_gpu_backend_is_the_gpu_one(monkeypatch):
    # jax.default_backend() says "gpu" on CUDA; optimize's table had only "cpu" and "cuda",
    # so a GPU step was planned with the CPU host profile.
    from libra_jax import model, rewrite

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    options = rewrite.rewriter.Options(profile=None, fusion=True, blocks=None)
    assert model.BUILTIN_PROFILES["gpu"] == "h100"
    assert options.resolved_profile() == model.load_profile("h100")  # resolved: a Profile


def test_a_gspmd_step_is_said_to_have_nothing_to_plan(monkeypatch):
    # jax.jit with sharded inputs and no psum: XLA's partitioner makes the all-reduces after
    # tracing. optimize passed it by in silence, and explain said only "no gradient psums".
    from libra_jax import dropins  # noqa: F401

    monkeypatch.setattr("libra_jax.ops.base._warned", set())
    mesh = mesh_of((8,), ("data",))
    rng = np.random.default_rng(13)
    params = init(rng, [16, 8, 4])
    x = jax.device_put(rng.standard_normal((64, 16)).astype(np.float32),
                       jax.NamedSharding(mesh, P("data")))

    def step(params, x):
        grads = jax.grad(lambda p: jnp.mean(mlp(p, x) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    opt = optimize(step)
    with pytest.warns(UserWarning, match="no psum and no jax.shard_map or jax.pmap.*GSPMD"):
        out = jax.jit(opt)(params, x)
    jax.tree.map(assert_bitwise, out, jax.jit(step)(params, x))  # nothing rewritten: one program
    assert opt.last_report.notes and not opt.last_report.plans
    assert "GSPMD" in str(libra_jax.explain(step, params, x, file=None))


# --- The rewriter's phases, each on a toy jaxpr -----------------------------------------

def _inner_jaxpr(fn, *args):
    """The body of `fn` under a shard_map over 8 devices (axis "i"), as the rewriter sees it."""
    mesh = mesh_of((8,), ("i",))
    closed = jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P(),
                                          check_vma=False))(*args)
    eqn, = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    return eqn.params["jaxpr"]


def _sites(jaxpr):
    from libra_jax import rewrite

    found = [rewrite.sites.find_site(i, e) for i, e in enumerate(jaxpr.eqns)]
    return [s for s in found if isinstance(s, rewrite.sites.Site) and s.collective.kind != "all-gather"]


def test_phase_sites_and_classification_on_a_toy_jaxpr():
    from libra_jax import rewrite

    def fn(x):
        a = jax.lax.psum(x * 2.0, "i")                   # feeds a later psum: not terminal
        b = jax.lax.psum(a * 3.0, "i")                   # terminal
        c = libra_jax.psum(x + 1.0, "i", blocks=5)       # explicit blocks
        return b + c

    jaxpr = _inner_jaxpr(fn, np.ones((8, 4), np.float32))
    sites = _sites(jaxpr)
    assert [s.explicit_blocks for s in sites] == [None, None, 5]
    gradient, backward = rewrite.sites.gradient_sites(jaxpr.eqns, sites, jaxpr.outvars)
    assert backward is None  # no transpose in sight: every terminal psum is a gradient one
    a, b, c = (s.index for s in sites)
    assert gradient == {b, c}
    assert rewrite.sites.site_kinds(sites, gradient, backward, in_loop=False) == {
        a: "forward", b: "gradient", c: "user"}
    assert rewrite.sites.site_kinds(sites, set(), None, in_loop=True) == {  # a forward loop body
        a: "loop", b: "loop", c: "user"}
    assert rewrite.sites.site_kinds(sites, {b}, {a, b}, in_loop=True) == {  # a body's backward pass
        a: "loop", b: "gradient", c: "user"}
    assert rewrite.sites.site_kinds(sites, {b}, {a, b}, in_loop=False) == {
        a: "backward", b: "gradient", c: "user"}


def test_phase_schedule_applies_edits_in_order():
    from libra_jax import rewrite

    def fn(x):
        a = jax.lax.psum(x * 2.0, "i")
        y = a + 1.0                     # uses a: must move after a bucket that takes a
        b = jax.lax.psum(x * 3.0, "i")
        return y + b

    jaxpr = _inner_jaxpr(fn, np.ones((8, 4), np.float32))
    eqns = list(jaxpr.eqns)
    assert rewrite.edits.schedule(eqns, rewrite.edits.Edits()) == eqns  # no edits: unchanged
    a, b = (s.index for s in _sites(jaxpr))
    uses = [i for i, e in enumerate(eqns) if a < i < b and e.primitive.name == "add"]
    edits = rewrite.edits.Edits(removed={a}, sink={b: uses})
    out = rewrite.edits.schedule(eqns, edits)
    assert eqns[a] not in out
    assert out.index(eqns[b]) < out.index(eqns[uses[0]])  # the use moved after the bucket
    assert len(out) == len(eqns) - 1


def test_bare_nnx_variables_are_written_back():
    """A step that updates bare `nnx.Variable`s passed to it (a `nnx.Param` trained in place,
    a step counter), as `nnx.jit` allows: wrapped in optimize their updates were dropped
    (the value came back, the variables stayed put). Each composition now matches
    ``nnx.jit(step)``; a variable inside an `nnx.State` stays a value, as before."""
    from flax import nnx

    mesh = mesh_of((8,), ("x",))
    x = shard(np.random.default_rng(47).standard_normal((16, 4)).astype(np.float32), mesh, P("x"))

    def step(count, w, x):
        def local(wv, x):
            return jax.lax.pmean(jax.grad(lambda v: jnp.mean((x * v) ** 2))(wv), "x")
        g = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                          check_vma=False)(w.get_value(), x)
        w.set_value(w.get_value() - 0.1 * g)
        count.set_value(count.get_value() + 1)
        return count.get_value()

    def train(wrap):
        count, w = nnx.Variable(jnp.zeros((), jnp.int32)), nnx.Param(jnp.ones((4,)))
        fn = wrap(step)
        for _ in range(2):
            fn(count, w, x)
        return int(count.get_value()), np.asarray(w.get_value())

    want = train(nnx.jit)
    assert want[0] == 2
    for name, wrap in {"eager": optimize, "nnx.jit(optimize(step))": lambda f: nnx.jit(optimize(f)),
                       "optimize(nnx.jit(step))": lambda f: optimize(nnx.jit(f))}.items():
        got = train(wrap)
        assert got[0] == 2, name
        assert_codegen_close(got[1], want[1])
    state = nnx.State({"w": nnx.Param(jnp.ones(2))})
    assert rewrite_nnx_objects(({"s": state}, nnx.Param(jnp.ones(2))), variables=True) == 1
    assert rewrite_nnx_objects(({"s": state}, nnx.Param(jnp.ones(2)))) == 0


def rewrite_nnx_objects(tree, **kwargs):
    from libra_jax import rewrite
    return len(rewrite.nnx_objects(tree, **kwargs))


# --- Sharded data parallelism: gradient psum_scatters (issue 44) -------------------------------


def _sharded_step(scatter, *, check_vma=False, n_params=3):
    """A shard_map step over ("x",) of 8 whose gradients leave by `scatter(g, i)` (explicit
    psum_scatters of locally computed full gradients), and its arguments."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(44)
    params = [shard((rng.standard_normal((16, 8)) * 0.3).astype(np.float32), mesh, P("x"))
              for _ in range(n_params)]
    x = shard(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("x"))

    def local(ws, x):
        full = [jax.lax.all_gather(w, "x", tiled=True) for w in ws]
        loss, grads = jax.value_and_grad(
            lambda fs: sum(jnp.mean(jnp.tanh(x @ f) ** 2) for f in fs))(full)
        grads = [scatter(g, i) for i, g in enumerate(grads)]
        return [w - 0.1 * g for w, g in zip(ws, grads)], jax.lax.pmean(loss, "x")

    step = jax.shard_map(local, mesh=mesh, in_specs=([P("x")] * n_params, P("x")),
                         out_specs=([P("x")] * n_params, P()), check_vma=check_vma)
    return step, (params, x)


def test_gradient_psum_scatters_are_planned_fused_and_bitwise():
    """Three explicit psum_scatters of gradients: gradient kind, one fused reduce-scatter
    bucket (one engine call), bitwise its XLA control (the same program with XLA's
    collectives: docs/bitwise.md, class 2) and within class 3's bound of the plain step."""
    step, args = _sharded_step(lambda g, i: jax.lax.psum_scatter(g, "x", tiled=True))
    opt = optimize(step, fusion=True, overlap="sync")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the all-gathers' notice (once per process)
        got = jax.jit(opt)(*args)
        control = jax.jit(optimize(step, overlap="sync", collectives="xla"))(*args)
    assert opt.last_report.unplanned == []  # the all-gathers are libra's too
    # The three forward gathers are one call over them (`prefetch_gathers`' groups).
    assert [(p.kind, len(p.members)) for p in opt.last_report.plans
            if p.collective.kind == "all-gather"] == [("forward", 3)]
    assert_bitwise(got, control)
    assert_codegen_close(got, jax.jit(step)(*args))
    plans = [p for p in opt.last_report.plans if p.kind == "gradient"]
    assert [(p.collective.kind, len(p.members)) for p in plans] == [("reduce-scatter", 3)]
    assert plans[0].nbytes == 3 * 16 * 8 * 4  # the unsharded buffers, per rank
    text = jax.jit(opt).lower(*args).compile().as_text()
    assert text.count("libra_reduce_scatter_cpu") == 1 and "reduce-scatter(" not in text
    assert text.count("libra_all_gather_cpu") == 1 and "all-gather(" not in text
    assert "collective=reduce-scatter" in opt.last_report.plan_lines()[-1]


def test_psum_scatter_blocks_kinds_and_what_stays_xla():
    """An explicit block count is kept ("user"); a psum_scatter the engine cannot serve
    (axis_index_groups, int8) stays XLA's and is reported, as a psum would be."""
    step, args = _sharded_step(lambda g, i: libra_jax.psum_scatter(g, "x", tiled=True, blocks=3))
    opt = optimize(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax.jit(opt)(*args)
    assert {(p.kind, p.blocks, p.collective.kind) for p in opt.last_report.plans
            if p.kind != "forward"} == {("user", 3, "reduce-scatter")}

    def odd(g, i):
        if i == 0:
            groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
            return jax.lax.psum_scatter(g, "x", tiled=True, axis_index_groups=groups)[:2]
        if i == 1:
            return jax.lax.psum_scatter(g.astype(jnp.int8), "x", tiled=True).astype(g.dtype)
        return jax.lax.psum_scatter(g, "x", tiled=True)
    step, args = _sharded_step(odd)
    _, report = rewrite_jaxpr(jax.make_jaxpr(step)(*args))
    assert report.skipped == ["psum_scatter with axis_index_groups in top/shard_map",
                              "psum_scatter of int8 in top/shard_map"]
    assert [p.collective.kind for p in report.plans if p.kind == "gradient"] == ["reduce-scatter"]


def test_a_bucket_holds_one_collective_and_one_class():
    """A bucket holds one `Site.bucket_class`: gradient psums and psum_scatters over the same
    axes are a stream each, each fused over the other's gradients (FSDP's reduce-scatters and
    all-reduces alternate in the backward pass; as one stream, no bucket reached past a
    gradient of the other kind); a psum_scatter along its second dimension shares a bucket with
    those along their first (the engine takes each member along its own dimension), bitwise
    the XLA control."""
    from libra_jax import rewrite

    def scatter(g, i):
        if i == 1:  # a replicated parameter's gradient: a psum
            return jax.lax.psum(g, "x")[:2]  # (as the shard's shape, to update it)
        if i == 2:
            return jax.lax.psum_scatter(g, "x", scatter_dimension=1, tiled=True).reshape(2, 8)
        return jax.lax.psum_scatter(g, "x", tiled=True)
    step, args = _sharded_step(scatter, n_params=4)
    opt = optimize(step, overlap="sync", profile="h200")  # a ring: fusion pays
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = jax.jit(opt)(*args)
        control = jax.jit(optimize(step, overlap="sync", profile="h200", collectives="xla"))(*args)
    assert_bitwise(got, control)
    assert_codegen_close(got, jax.jit(step)(*args))
    # In the order the backward pass makes them (the last parameter's first): a
    # psum_scatter, one along dimension 1, the psum, a psum_scatter. The three psum_scatters
    # are one bucket over the psum between them (one stream); the psum is the all-reduce
    # stream's, with the loss's pmean (`sites.value_sites`: ready before them all).
    plans = [p for p in opt.last_report.plans if p.kind == "gradient"]
    assert sorted((p.collective.kind, len(p.members)) for p in plans) == [
        ("all-reduce", 2), ("reduce-scatter", 3)]
    fused, = [p for p in plans if p.collective.kind == "reduce-scatter"]
    reduced = next(p.members for p in plans if p.collective.kind == "all-reduce")
    between = [m for m in reduced if min(fused.members) < m < max(fused.members)]
    assert len(between) == 1, plans  # the psum; the loss's is outside the backward pass
    # The class cut, directly: members of other classes never share a reach.
    from libra_jax.collectives import BY_KIND
    sites = [rewrite.sites.Site(i, ("x",), False, 64, None, None, BY_KIND["reduce-scatter"],
                                (d, 8, True)) for i, d in enumerate((0, 0, 1, 0))]
    sites.insert(2, rewrite.sites.Site(9, ("x",), True, 64, None, None, BY_KIND["all-reduce"]))
    assert rewrite.edits.within_class(sites, [4, 4, 4, 4, 4]) == [1, 1, 2, 4, 4]
    assert rewrite.edits.within_class(sites, None) == [1, 1, 2, 4, 4]


def test_plan_agreement_compares_the_collective(monkeypatch):
    """Two processes whose plans differ only in a bucket's collective (one reduce-scatters
    what the other all-reduces) fail with the error naming it: `plan_lines` carry it."""
    import json

    from libra_jax import _compat, rewrite
    from libra_jax.collectives import BY_KIND

    report = rewrite.OptimizeReport(plans=[rewrite.CallPlan(
        "top/shard_map", ("x",), (3, 5), 4096, 2, "gradient", "sync", BY_KIND["reduce-scatter"])])
    theirs = [line.replace("collective=reduce-scatter", "collective=all-reduce")
              for line in report.plan_lines() + rewrite.data_path_lines()]
    store: dict[str, str] = {}

    class Client:
        def key_value_set(self, key, value):
            store[key] = value

        def blocking_key_value_get(self, key, timeout_ms):
            return store[key] if key.endswith("/0") else json.dumps(theirs)

    monkeypatch.setattr(_compat, "distributed_client", lambda: Client())
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    with pytest.raises(RuntimeError, match=r"(?s)planned this step differently.*"
                                           r"here: .*collective=reduce-scatter.*"
                                           r"process 1: .*collective=all-reduce"):
        rewrite.check_plan_agreement(report, program="step")
    theirs[:] = report.plan_lines() + rewrite.data_path_lines()
    rewrite.check_plan_agreement(report, program="step")  # the same plan: agreement


@pytest.mark.parametrize("gather", ["jax", "libra"])
@pytest.mark.parametrize("tiled", [True, False])
def test_invarying_gathers_gradient_becomes_a_reduce_scatter(gather, tiled):
    """The gradient of ``all_gather(to='invarying')`` is a psum then this rank's slice: the
    rewrite makes it the reduce-scatter of that slice (half the bytes), planned as a gradient,
    bitwise its XLA control and within class 3's bound of plain; a psum whose result is read
    elsewhere too, or sliced at another rank's offset, stays a psum."""
    mesh = mesh_of((8,), ("x",))
    all_gather = jax.lax.all_gather if gather == "jax" else libra_jax.all_gather
    rng = np.random.default_rng(45)
    shape = (2, 8) if tiled else (8,)
    w = shard((rng.standard_normal((16 if tiled else 8, 8)) * 0.3).astype(np.float32),
              mesh, P("x"))
    x = shard(rng.standard_normal((64, 16 if tiled else 8)).astype(np.float32), mesh, P("x"))

    def local(w, x):
        def loss(w):
            full = all_gather(w if tiled else w[0], "x", tiled=tiled, to="invarying")
            return jax.lax.pmean(jnp.mean(jnp.tanh(x @ full.reshape(x.shape[1], -1)) ** 2), "x")
        g = jax.grad(loss)(w)
        return w - 0.1 * g

    step = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
    opt = optimize(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = jax.jit(opt)(w, x)
        control = jax.jit(optimize(step, collectives="xla"))(w, x)
    assert_bitwise(got, control)
    assert_codegen_close(got, jax.jit(step)(w, x))
    gradient = [p for p in opt.last_report.plans if p.kind == "gradient"]
    assert [(p.collective.kind, p.nbytes) for p in gradient] == [("reduce-scatter", 8 * 4 * math.prod(shape))]
    text = jax.jit(opt).lower(w, x).as_text()
    assert "libra_reduce_scatter_cpu" in text and "all_reduce" not in text

    # Not a slice of this rank's rows only: stays an all-reduce (a gradient psum).
    def other(w, x):
        total = jax.lax.psum(x[:, :8] * 0 + w.sum(), "x")
        i = (jax.lax.axis_index("x") + 1) % 8
        return jax.lax.dynamic_slice_in_dim(total, i * 2, 2), total.sum()
    step = jax.shard_map(other, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P()),
                         check_vma=False)
    _, report = rewrite_jaxpr(jax.make_jaxpr(step)(w, x))
    assert [p.collective.kind for p in report.plans] == ["all-reduce"]


@pytest.mark.parametrize("where", ["pmap", "shard_map"])
def test_optimize_inside_a_device_map_plans_for_its_axis(where):
    """``pmap(optimize(step))`` and a shard_map body wrapped in `optimize`: the step's axis is
    bound where it is traced, so it is planned for that axis' 8 ranks (before: for 1, every
    bucket at 1 block with no model), bitwise its XLA control."""
    rng = np.random.default_rng(46)
    params = init(rng, [16, 32, 8])

    def step(p, x):
        grads = jax.grad(lambda p: jnp.mean(mlp(p, x) ** 2))(p)
        grads = jax.lax.pmean(grads, "x")
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)

    def wrap(fn):
        if where == "pmap":
            return jax.pmap(fn, axis_name="x", in_axes=(None, 0))
        return jax.jit(jax.shard_map(fn, mesh=mesh_of((8,), ("x",)), in_specs=(P(), P("x")),
                                     out_specs=P(), check_vma=False))
    x = inputs("pmap" if where == "pmap" else "no_check_vma", rng)
    opt = optimize(step)
    got = wrap(opt)(params, x)
    assert_bitwise(got, wrap(optimize(step, collectives="xla"))(params, x))
    assert [entry["world"] for entry in opt.last_report.predicted] == [8]
    assert {p.kind for p in opt.last_report.plans} == {"gradient"}


# --- All-gathers issued ahead (prefetch) ----------------------------------------------------

def _eqns_named(jaxpr, name):
    """Every equation of `name` in `jaxpr` and its sub-jaxprs, with the jaxpr holding it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append((jaxpr, eqn))
        for sub in _compat.jaxprs_in_params(eqn.params):
            found += _eqns_named(getattr(sub, "jaxpr", sub), name)
    return found


def _gather_pair_eqns(jaxpr, name):
    """`_eqns_named` of an all-gather's start or done (`libra_start` / `libra_done` with
    ``collective="all_gather"``)."""
    return [(j, e) for j, e in _eqns_named(jaxpr, name) if e.params["collective"].lax == "all_gather"]


@pytest.mark.parametrize("name", ["fsdp-explicit-psum-scatter", "fsdp-gspmd-route"])
def test_gathers_made_up_front_move_to_their_first_use(name):
    """FSDP code that gathers every weight before the loss (and the GSPMD route, which does):
    each all-gather is moved to just before the equation that first reads it, so a weight is
    not held gathered from the scope's start and prefetch has compute to issue it ahead of."""
    from corpus import CASES
    case = CASES[name]()

    def placed(jaxpr, gather):
        """Per all-gather, whether the next equation of its scope reads its result."""
        return [body.eqns[body.eqns.index(e) + 1].invars.count(e.outvars[0]) > 0
                for body, e in _eqns_named(jaxpr, gather)]
    with case.context():
        before = placed(jax.make_jaxpr(case.step)(case.state, *case.batch).jaxpr, "all_gather")
        # One call each (fusion=False): each at its own first use (`sink_gathers`).
        after = placed(jax.make_jaxpr(optimize(case.step, fusion=False))(
            case.state, *case.batch).jaxpr, "libra_all_gather")
    assert len(before) == len(after) == 3 and not all(before), before
    assert all(after), after


def _train(fn, state, batch, steps=3):
    state = corpus_fresh(state)
    for _ in range(steps):
        state, loss = fn(state, *batch)
    return jax.tree.leaves((state, loss))


def corpus_fresh(tree):
    from corpus import fresh
    return fresh(tree)


@pytest.mark.parametrize("distance", [1, 2])
def test_prefetch_issues_each_gather_ahead_bitwise_its_control(distance):
    """FSDP under remat with ``prefetch=d``: the forward gathers and remat's re-gathers (taken
    out of their checkpoints) are start/done pairs in the step's scope; gather j starts right
    after gather j - d is done, reading that done's result (its order by data); no all_gather
    is left in a checkpoint; the plans say so; trained state bitwise its XLA control, and the
    kinds are the corpus's."""
    from corpus import fsdp_remat
    case = fsdp_remat()
    # One call each (fusion=False): each gather its own pair (groups: test_gathers_fused_...).
    opt = optimize(case.step, prefetch=distance, fusion=False)
    closed = jax.make_jaxpr(opt)(case.state, *case.batch)
    assert not _eqns_named(closed.jaxpr, "all_gather")
    assert not _eqns_named(closed.jaxpr, "libra_all_gather")
    starts = _gather_pair_eqns(closed.jaxpr, "libra_start")
    dones = _gather_pair_eqns(closed.jaxpr, "libra_done")
    assert len(starts) == len(dones) == 6
    body = starts[0][0]
    assert all(j is body for j, _ in starts + dones)  # one scope: forward and backward
    order = {id(e): i for i, e in enumerate(body.eqns)}
    producer = {v: e for e in body.eqns for v in e.outvars}
    dones = sorted((e for _, e in dones), key=lambda e: order[id(e)])
    by_token = {e.invars[1]: e for e in dones}
    for _, start in starts:
        done = by_token[start.outvars[1]]  # its own start's buffer and token
        assert done.invars[0] is start.outvars[0]
        j = dones.index(done)
        assert order[id(start)] < order[id(done)]
        if j >= distance:  # started right after gather j - d is done, reading its result
            assert start.invars[1:] == [dones[j - distance].outvars[0]]
            assert start.invars[0] not in producer  # the parameter's shard itself
            assert order[id(dones[j - distance])] < order[id(start)]
            assert all(order[id(d)] > order[id(start)] for d in dones[j - distance + 1:j + 1])
        else:
            assert len(start.invars) == 1
    gathers = [p for p in opt.last_report.plans if p.collective.kind == "all-gather"]
    assert [(p.kind, p.overlap, p.ahead) for p in gathers] == (
        [("forward", "prefetch", distance)] * 3 + [("backward", "prefetch", distance)] * 3)
    assert all(line.endswith(f"ahead={distance}") for line in opt.last_report.plan_lines()
               if "collective=all-gather" in line)
    control = optimize(case.step, prefetch=distance, fusion=False, collectives="xla")
    assert_bitwise(_train(jax.jit(opt), case.state, case.batch),
                   _train(jax.jit(control), case.state, case.batch))
    kinds = collections_counter(p.kind for p in opt.last_report.plans for _ in p.members)
    assert kinds == case.kinds


def collections_counter(items):
    import collections
    return dict(collections.Counter(items))


@pytest.mark.parametrize("prefetch", ["off", None])
def test_prefetch_off_and_auto_on_cpu_issue_one_call_where_used(prefetch):
    """``prefetch="off"``, and "auto" on CPU (one call measures as fast or faster there:
    benchmarks/results/fsdp_prefetch.md): every gather one call at its place, remat's
    re-gathers left in their checkpoints; the model's choice is still reported (for
    `explain`), with why it was not issued under "auto"."""
    from corpus import fsdp_remat
    case = fsdp_remat()
    opt = optimize(case.step, prefetch=prefetch)
    closed = jax.make_jaxpr(opt)(case.state, *case.batch)
    assert not _gather_pair_eqns(closed.jaxpr, "libra_start")
    assert not _eqns_named(closed.jaxpr, "optimization_barrier")
    regathers = [j for j, _ in _eqns_named(closed.jaxpr, "libra_all_gather")]
    assert len(regathers) == 3 and len({id(j) for j in regathers}) == 3  # in checkpoints
    # The forward's three: one call over them, where the first is used (in the step's scope).
    fused, = [(j, e) for j, e in _eqns_named(closed.jaxpr, "libra_bucket")
              if e.params["collective"].gathers]
    assert len(fused[1].invars) == 3 and fused[0] not in regathers
    gathers = [p for p in opt.last_report.plans if p.collective.kind == "all-gather"]
    assert {(p.overlap, p.ahead) for p in gathers} == {("sync", 0)}
    entry, = opt.last_report.gathers  # the forward pass's three (the re-gathers stay apart)
    assert entry["distance"] == 0 and len(entry["steps"]) == 3
    if prefetch is None:
        assert "measures as fast" in entry["why"] and "fsdp_prefetch.md" in entry["why"]
    else:
        assert entry["why"] == ""


def test_prefetch_auto_takes_the_models_distance_on_the_nccl_path_within_its_memory(monkeypatch):
    """"auto" issues the model's distance where libra's GPU all-gather runs (a GPU profile,
    ``LIBRA_JAX_CUDA=nccl``): the plan `planner.plan_gathers` makes for the scope's steps;
    ``prefetch_bytes`` smaller than any gathered buffer holds nothing ahead."""
    from libra_jax import planner
    from corpus import fsdp_remat
    monkeypatch.setenv("LIBRA_JAX_CUDA", "nccl")
    case = fsdp_remat()
    closed = jax.make_jaxpr(case.step)(case.state, *case.batch)
    _, report = rewrite_jaxpr(closed, profile="h200")
    entry, = report.gathers
    plan = planner.plan_gathers(entry["steps"], entry["cost"], one_call_blocks=entry["one_call"],
                                max_bytes=1 << 30, lead_s=entry["lead_s"], reach=entry["reach"],
                                group_blocks=entry["group_blocks"])
    assert plan == entry["plan"] and entry["distance"] == plan.distance >= 1
    gathers = [p for p in report.plans if p.collective.kind == "all-gather"]
    assert {(p.overlap, p.ahead) for p in gathers} == {("prefetch", plan.distance)}
    _, bounded = rewrite_jaxpr(closed, profile="h200", prefetch_bytes=1024)
    assert bounded.gathers[0]["distance"] == 0
    assert {p.overlap for p in bounded.plans if p.collective.kind == "all-gather"} == {"sync"}


def test_a_gather_whose_operand_is_computed_late_stays_one_call():
    """A gathered value computed from the previous layer's output cannot start before that
    layer: it stays one call where it is used, the others are issued ahead; bitwise its XLA
    control."""
    mesh = mesh_of((8,), ("data",))
    rng = np.random.default_rng(3)
    ws = [shard((rng.standard_normal((16, 16)) * 0.3).astype(np.float32), mesh, P("data"))
          for _ in range(3)]
    x = shard(rng.standard_normal((32, 16)).astype(np.float32), mesh, P("data"))

    def local(ws, x):
        h = x
        for i, w in enumerate(ws):
            if i == 1:
                w = w * jnp.mean(h)  # computed from layer 0's output
            h = jnp.tanh(h @ jax.lax.all_gather(w, "data", tiled=True))
        return h

    step = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    opt = optimize(step, prefetch=1)
    got = jax.jit(opt)(ws, x)
    gathers = [p for p in opt.last_report.plans if p.collective.kind == "all-gather"]
    assert [p.overlap for p in gathers] == ["prefetch", "sync", "prefetch"]
    assert_bitwise(got, jax.jit(optimize(step, prefetch=1, collectives="xla"))(ws, x))
    assert_codegen_close(got, jax.jit(step)(ws, x))


def test_prefetched_gathers_compile_with_no_copy_of_an_in_flight_buffer():
    """In the compiled CPU program each all-gather start's buffer is read by its own done only,
    with its own start's token (no copy of a buffer the engine is filling), and the starts
    issued after an earlier gather still read its result there (XLA kept the order: an
    `optimization_barrier` would have been dropped)."""
    from corpus import fsdp_remat
    case = fsdp_remat()
    hlo = jax.jit(optimize(case.step, prefetch=2, fusion=False)).lower(
        case.state, *case.batch).compile().as_text()  # one pair each (groups: test_gathers_...)
    starts, dones, elements = cpu_start_done_pairs(hlo)
    assert set(starts.values()) == {"libra_all_gather_cpu_start"} and len(starts) == 6, hlo
    assert len(dones) == 6, hlo
    for start in starts:
        readers = [name for name, (t, i) in elements.items() if t == start and i == "0"]
        assert len(readers) == 1 and len(re.findall(rf"{re.escape(readers[0])}\b", hlo)) == 2
    operands = re.findall(r"custom-call\(([^)]*)\), "
                          r'custom_call_target="libra_all_gather_cpu_start"', hlo)
    assert sorted(len(o.split(", ")) for o in operands) == [2, 2] + [3] * 4, operands


def test_prefetch_options_are_checked(monkeypatch):
    from corpus import fsdp_remat
    case = fsdp_remat()
    with pytest.raises(ValueError, match="prefetch must be 'auto', 'off' or a number"):
        optimize(case.step, prefetch="early")
    with pytest.raises(ValueError, match="prefetch must be"):
        optimize(case.step, prefetch=-1)
    with pytest.raises(ValueError, match="prefetch_bytes must be a number of bytes"):
        optimize(case.step, prefetch_bytes=-5)
    monkeypatch.setenv("LIBRA_JAX_PREFETCH", "sometimes")
    with pytest.raises(ValueError, match=r"\$LIBRA_JAX_PREFETCH must be"):
        optimize(case.step)
    monkeypatch.setenv("LIBRA_JAX_PREFETCH", "2")
    opt = optimize(case.step)
    jax.make_jaxpr(opt)(case.state, *case.batch)
    assert {p.ahead for p in opt.last_report.plans if p.collective.kind == "all-gather"} == {2}


def test_one_call_gathers_compile_as_xla_s_own_under_remat():
    """Under `jax.checkpoint` the backward pass gathers each weight again. XLA:CPU of jaxlib
    0.10.2 merges each re-gather with the forward's gather of the same shard (it drops
    remat's optimization barriers, its `prevent_cse`): its own all-gathers and libra's one call
    alike compile to 3 gathers of the 6 traced; jaxlib 0.12 keeps all 6, for both. A gather
    issued ahead (a start/done pair, its own call id) is never merged: remat runs as written
    (benchmarks/results/fsdp_prefetch.md)."""
    from corpus import fsdp_remat
    case = fsdp_remat()

    def gathers(fn, pattern):
        hlo = jax.jit(fn).lower(case.state, *case.batch).compile().as_text()
        return len(re.findall(pattern, hlo))
    xla = gathers(case.step, r"= \S+ all-gather(?:-start)?\(")
    assert xla == gathers(optimize(case.step, prefetch="off", fusion=False),
                          r'custom_call_target="libra_all_gather_cpu"')
    assert xla == (3 if _compat.jax_version < (0, 11) else 6)
    assert gathers(optimize(case.step, prefetch=1, fusion=False),
                   r'custom_call_target="libra_all_gather_cpu_start"') == 6
    # The forward's three as one call (the default, fusion): no re-gather is one of its
    # members alone, so XLA merges none, and remat runs as written: 1 + 3 calls.
    assert gathers(optimize(case.step, prefetch="off"),
                   r'custom_call_target="libra_all_gather_cpu"') == 4


# --- Forward all-gathers as one call over several (groups) ----------------------------------

def _fsdp_example():
    """The FSDP example (examples/fsdp.py, small): the GSPMD route's step and its arguments."""
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import common
    return common.load_example("fsdp").build(True)


def test_the_fsdp_examples_forward_gathers_are_fewer_calls_within_the_memory_bound():
    """The FSDP example's forward all-gathers (one per weight matrix): the plan before this
    (``prefetch_bytes=0``: nothing may be held ahead of its use, so one call each, as every
    plan was) issues one engine call per gather; within a bound of half their bytes, fewer
    calls, each holding at most the bound ahead of its later members' use; by default (1 GiB)
    one call. Trained state bitwise the one-call-each plan's and the XLA control's (an
    all-gather copies); XLA's peak temporary memory of the step not above the one-call-each
    plan's by more than the bound."""
    step, args = _fsdp_example()

    def issued(fn):
        compiled = jax.jit(fn).lower(*args).compile()
        calls = compiled.as_text().count('custom_call_target="libra_all_gather_cpu"')
        return calls, compiled.memory_analysis().temp_size_in_bytes

    def trained(fn, steps=2):
        state, tokens = args
        for _ in range(steps):
            state, loss = jax.jit(fn)(state, tokens)
        return jax.tree.leaves((state, loss))
    alone = optimize(step, prefetch_bytes=0)
    calls_alone, temp_alone = issued(alone)
    gathers = [p for p in alone.last_report.plans if p.collective.kind == "all-gather"]
    assert {(p.kind, len(p.members)) for p in gathers} == {("forward", 1)}
    assert calls_alone == len(gathers) >= 6
    budget = sum(p.nbytes for p in gathers) // 2
    bounded = optimize(step, prefetch_bytes=budget)
    calls, temp = issued(bounded)
    fused = [p for p in bounded.last_report.plans if p.collective.kind == "all-gather"]
    assert sum(len(p.members) for p in fused) == len(gathers)
    assert 1 < calls == len(fused) < len(gathers)
    sizes = {i: p.nbytes for p in gathers for i in p.members}
    for p in fused:  # each call holds its later members' bytes: at most the bound
        assert sum(sizes[i] for i in p.members[1:]) <= budget, p
        assert p.nbytes == sum(sizes[i] for i in p.members)
    assert temp <= temp_alone + budget, (temp, temp_alone, budget)
    default = optimize(step)
    assert issued(default)[0] == 1
    # The step's price counts the calls issued: one for the fused gathers, not one each.
    assert (default.last_report.step.optimized_calls
            == alone.last_report.step.optimized_calls - (len(gathers) - 1))
    assert bounded.last_report.gathers[0]["plan"].one_call_groups == \
        bounded.last_report.gathers[0]["groups"]
    want = trained(alone)
    assert_bitwise(trained(bounded), want)
    assert_bitwise(trained(default), want)
    assert_bitwise(trained(optimize(step, collectives="xla")), want)


def test_forward_gathers_issued_ahead_are_one_start_over_their_members():
    """FSDP under remat with ``prefetch=1``: the forward's three gathers are one start/done
    pair over them (the model's group: their calls cost more than the overlap they give),
    started at the scope's start, done where the first is used; remat's re-gathers one pair
    each, each started after the call before it is done. The compiled program starts the
    group once, its three buffers each read by its done only; trained state bitwise the XLA
    control's and the one-pair-each plan's (``fusion=False``)."""
    from corpus import fsdp_remat
    case = fsdp_remat()
    opt = optimize(case.step, prefetch=1)
    closed = jax.make_jaxpr(opt)(case.state, *case.batch)
    starts = [e for _, e in _gather_pair_eqns(closed.jaxpr, "libra_start")]
    dones = [e for _, e in _gather_pair_eqns(closed.jaxpr, "libra_done")]
    assert [len(e.outvars) - 1 for e in starts] == [3, 1, 1, 1]  # members (and a token)
    group, group_done = starts[0], next(e for e in dones if len(e.outvars) == 3)
    assert group.params["dimension"] == (0, 0, 0) and len(group.invars) == 3  # scope start
    assert group_done.invars[:4] == group.outvars  # its buffers and its token
    assert starts[1].invars[1:] == [group_done.outvars[0]]  # after the group is done
    gathers = [p for p in opt.last_report.plans if p.collective.kind == "all-gather"]
    assert [(p.kind, len(p.members), p.overlap, p.ahead) for p in gathers] == (
        [("forward", 3, "prefetch", 1)] + [("backward", 1, "prefetch", 1)] * 3)
    hlo = jax.jit(opt).lower(case.state, *case.batch).compile().as_text()
    assert hlo.count('custom_call_target="libra_all_gather_cpu_start"') == 4
    started = re.findall(r"(%\S+) = \((f32\[\S+\]\{[\d,]+\}, f32\[\S+\]\{[\d,]+\}, f32\[\S+\]"
                         r"\{[\d,]+\}), s32\[1\]\{0\}\) custom-call\(.*?"
                         r'custom_call_target="libra_all_gather_cpu_start"', hlo)
    assert len(started) == 1, hlo  # one start over the three members
    name = re.escape(started[0][0])
    for index in range(3):  # each in-flight buffer read once: by its done
        element, = re.findall(rf"(%\S+) = \S+ get-tuple-element\({name}\), index={index}\b", hlo)
        assert len(re.findall(rf"{re.escape(element)}\b", hlo)) == 2, element
    want = _train(jax.jit(optimize(case.step, prefetch=1, collectives="xla")), case.state,
                  case.batch)
    assert_bitwise(_train(jax.jit(opt), case.state, case.batch), want)
    assert_bitwise(_train(jax.jit(optimize(case.step, prefetch=1, fusion=False)), case.state,
                          case.batch), want)


def test_last_report_reads_through_jax_jit():
    """``jax.jit(libra_jax.optimize(step)).last_report`` was None for good: jit copied the
    attribute when it wrapped the function, before any call. The copy is a view of the
    latest plan: false before the first call, then the plan the optimized function made."""
    def step(x):
        return jax.pmap(lambda v: jax.lax.psum(v * 2, "i"), axis_name="i")(x)
    optimized = optimize(step)
    fast = jax.jit(optimized)
    assert not fast.last_report
    with pytest.raises(AttributeError, match="no plan yet to read 'plans'"):
        fast.last_report.plans
    fast(np.arange(8.0, dtype=np.float32))
    assert fast.last_report and fast.last_report == optimized.last_report
    assert fast.last_report.plans == optimized.last_report.plans and fast.last_report.plans
    assert fast.last_report.report is optimized.last_report
    fast(np.arange(16.0, dtype=np.float32).reshape(8, 2))  # a new plan: read through the view
    assert fast.last_report.report is optimized.last_report


@pytest.mark.parametrize("form", ["single", "bucket", "class"])
def test_a_kind_without_a_form_is_refused_by_name(form):
    """A site of a kind the rewrite has no form for (a fourth row, an all-to-all) was issued
    as an all-reduce, silently: `single_eqn` and `Site.bucket_class` fell back to the psum
    where `Site.scatter`/`Site.gather` were None. Each now raises, naming the kind."""
    from libra_jax.rewrite.edits import fused_eqn, single_eqn

    def f(x):
        return jax.lax.psum(x, "x")
    eqn = jax.make_jaxpr(jax.vmap(f, axis_name="x"))(jnp.ones((2, 3))).jaxpr.eqns[0]
    site = libra_jax.rewrite.sites.Site(0, ("x",), False, 12, None, eqn.outvars[0],
                                        libra_jax.collectives.BY_KIND["all-to-all"])
    with pytest.raises(libra_jax.collectives.NoForm,
                       match=r"the all-to-all collective \(all_to_all\) has no"):
        if form == "single":
            single_eqn(eqn, site, 2, set())
        elif form == "bucket":
            fused_eqn([eqn], [site], ("x",), False, 2)
        else:
            site.bucket_class
