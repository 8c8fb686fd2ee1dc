"""`libra_jax.loops` and `optimize(loops=...)`: a scan's gradient psums leave the loop bitwise.

Scan-over-layers models (a stacked-weights `lax.scan`, Flax `nn.scan`) under `shard_map` with
`check_vma`: the weight-gradient psums sit in the backward scan's body. `optimize` hoists the
stacked weights' psums after the loop (planned with the other gradients) where the model
prices that lower, keeps a shared weight's psum (accumulated in the carry) in the body, and
either way the gradients are bitwise those of the plain step.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _compat, _ffi, loops

from conftest import assert_bitwise, assert_codegen_close, mesh_of, shard
from test_nccl import run, stub_env, stub_library  # noqa: F401  (the stub's fixtures)

pytestmark = pytest.mark.usefixtures("jax_8")

L, D = 6, 16


def stacked(shared: bool = False, seed: int = 0):
    """A grads-returning step over stacked layers (and, with `shared`, one weight every layer
    uses), and its arguments."""
    rng = np.random.default_rng(seed)
    params = {"layers": {"w": (rng.standard_normal((L, D, D)) * 0.2).astype(np.float32),
                         "b": (rng.standard_normal((L, D)) * 0.1).astype(np.float32)},
              "head": (rng.standard_normal((D, 1)) * 0.2).astype(np.float32)}
    if shared:
        params["shared"] = (rng.standard_normal((D, D)) * 0.2).astype(np.float32)
    mesh = mesh_of((8,), ("data",))

    def local(params, x):
        def loss_fn(p):
            def layer(h, w):
                out = jnp.tanh(h @ w["w"] + w["b"])
                return (out + 0.1 * (h @ p["shared"]) if shared else out), None
            h, _ = jax.lax.scan(layer, x, p["layers"])
            return jax.lax.pmean(jnp.mean((h @ p["head"]) ** 2), "data")
        return jax.value_and_grad(loss_fn)(params)

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    x = shard(rng.standard_normal((64, D)).astype(np.float32), mesh, P("data"))
    return step, (params, x)


def flax_scan(seed: int = 1):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(D)(h)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=L)()(x, None)
            return nn.Dense(1)(h)

    net, mesh = Net(), mesh_of((8,), ("data",))
    x = np.random.default_rng(seed).standard_normal((64, D)).astype(np.float32)
    params = net.init(jax.random.key(seed), x[:1])["params"]

    def local(params, x):
        return jax.value_and_grad(
            lambda p: jax.lax.pmean(jnp.mean(net.apply({"params": p}, x) ** 2), "data"))(params)

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    return step, (params, shard(x, mesh, P("data")))


def backward_scan(step, args):
    """The backward scan equation of `step`'s shard_map (the scan whose body has psums)."""
    closed = jax.make_jaxpr(step)(*args)
    body = next(e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map").params["jaxpr"]
    scans = [e for e in body.eqns if e.primitive.name == "scan"]
    return next(e for e in scans if any(x.primitive.name.startswith("psum")
                                        for x in e.params["jaxpr"].jaxpr.eqns))


def body_psums(closed) -> int:
    """psum-like equations inside scan bodies of a (rewritten) closed jaxpr, at any depth."""
    def visit(jaxpr, in_scan):
        n = 0
        for e in jaxpr.eqns:
            if in_scan and ("psum" in e.primitive.name):
                n += 1
            for sub in _compat_subs(e):
                n += visit(sub, in_scan or e.primitive.name == "scan")
        return n
    return visit(closed.jaxpr, False)


def _compat_subs(eqn):
    from libra_jax import _compat
    return [getattr(j, "jaxpr", j) for j in _compat.jaxprs_in_params(eqn.params)]


# --- What may leave the loop ---------------------------------------------------------------

def test_stacked_weights_are_hoistable_a_shared_weight_is_not():
    hoists = loops.hoistable(backward_scan(*stacked()))
    # w's cotangent psum goes straight to the stacked output; b's through a reshape and a
    # sum over a size-1 axis (data movement).
    assert len(hoists) == 2 and all(h.axes == ("data",) for h in hoists), hoists
    assert sorted(h.nbytes for h in hoists) == [D * 4, D * D * 4]
    with_shared = backward_scan(*stacked(shared=True))
    body = with_shared.params["jaxpr"].jaxpr
    n_psums = sum(e.primitive.name.startswith("psum") for e in body.eqns)
    assert n_psums == 3 and len(loops.hoistable(with_shared)) == 2  # the shared one stays


def test_a_psum_read_by_the_body_or_into_the_carry_stays():
    mesh = mesh_of((8,), ("data",))

    def local(w, x):
        def body(c, wi):
            g = jax.lax.psum(x * wi, "data")      # read by the carry's update: stays
            s = jax.lax.psum(x * wi * 2.0, "data")  # only a ys output: hoistable
            t = jax.lax.psum(x * wi * 3.0, "data").T.reshape(-1)  # through data movement
            return c + g, (s, t)
        return jax.lax.scan(body, jnp.zeros_like(x), w)

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                         check_vma=False)
    closed = jax.make_jaxpr(step)(np.ones((4, 2), np.float32), np.ones((8, 2), np.float32))
    scan = next(e for e in closed.jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "scan")
    hoists = loops.hoistable(scan)
    # the ys outputs; the carry's psum is not listed
    assert [(h.output, len(h.chain)) for h in hoists] == [(1, 0), (2, 2)], hoists
    args = (np.arange(8, dtype=np.float32).reshape(4, 2), np.ones((8, 2), np.float32))
    opt = libra_jax.optimize(step)
    assert_codegen_close(jax.jit(opt)(*args), jax.jit(step)(*args))
    assert [p.choice for p in opt.last_report.loops] == ["hoist"]


# --- optimize hoists ---------------------------------------------------------------------------

@pytest.mark.parametrize("build", [stacked, flax_scan], ids=["lax-scan", "flax-nn-scan"])
def test_hoisted_gradients_match_the_in_loop_and_plain_ones(build):
    """Each mode is bitwise its XLA control (the same rewritten program, XLA's all-reduce).
    Hoisted, in-loop and plain are three programs (class 3): the psums sum the same values
    elementwise, but XLA compiles the loop bodies around them differently."""
    step, args = build()
    plain = jax.jit(step)(*args)
    outs = {}
    for mode in ("auto", "hoist", "in-loop"):
        opt = libra_jax.optimize(step, loops=mode)
        outs[mode] = jax.jit(opt)(*args)
        control = jax.jit(libra_jax.optimize(step, loops=mode, collectives="xla"))(*args)
        jax.tree.map(assert_bitwise, outs[mode], control)
        assert_codegen_close(outs[mode], plain)
        report = opt.last_report
        assert [p.choice for p in report.loops] == ["in-loop" if mode == "in-loop" else "hoist"]
        loop, = report.loops
        in_body = [p for p in report.plans if p.scope == loop.body]
        if mode == "in-loop":  # planned in the body, for one iteration
            assert loop.gradient == 2 and loop.calls == len(in_body) >= 1, report.plan_lines()
            assert {p.kind for p in in_body} == {"gradient"}
            assert {p.overlap for p in in_body} == {"sync"}  # no start/done pair in a body
        else:  # every layer's weight and bias gradient: planned with the other gradients
            assert not in_body and loop.gradient == 0, report.plan_lines()
            gradient_bytes = sum(p.nbytes for p in report.plans if p.kind == "gradient")
            assert gradient_bytes >= L * (D * D + D) * 4


def test_the_rewritten_loop_has_no_psum_left_and_lowers_to_libra_calls():
    step, args = stacked()
    closed = jax.make_jaxpr(step)(*args)
    assert body_psums(closed) == 2
    rewritten, report = libra_jax.rewrite_jaxpr(closed, loops="hoist")
    assert body_psums(rewritten) == 0
    for mode in ("hoist", "in-loop"):
        text = jax.jit(libra_jax.optimize(step, loops=mode)).lower(*args).as_text()
        assert "libra_allreduce_cpu" in text and "all_reduce" not in text, mode


def test_a_shared_weight_stays_in_the_loop_planned_for_each_iteration():
    """Its cotangent is psum'd per iteration and accumulated in the carry: it stays in the
    body, where it is the body's one gradient psum (the stacked slices are hoisted)."""
    step, args = stacked(shared=True)
    opt = libra_jax.optimize(step)
    assert_codegen_close(jax.jit(opt)(*args), jax.jit(step)(*args))
    report = opt.last_report
    loop, = report.loops
    assert loop.choice == "hoist" and loop.psums == 2 and loop.kept == 0
    assert loop.gradient == 1 and loop.calls == 1, report.plan_lines()
    assert [p.kind for p in report.plans if p.scope == loop.body] == ["gradient"]


def test_loops_argument_is_checked_and_explain_shows_the_choice():
    step, args = stacked()
    with pytest.raises(ValueError, match="loops must be one of 'auto', 'hoist', 'in-loop'"):
        libra_jax.optimize(step, loops="unroll")
    text = str(libra_jax.explain(step, *args, file=None))
    assert re.search(r"6 iterations: no gradient psum left in the body; 2 stacked slice psums "
                     r"of [\d.]+ KiB per iteration hoisted", text), text
    text = str(libra_jax.explain(step, *args, loops="in-loop", file=None))
    assert re.search(r"6 iterations: each iteration 2 gradient psums in 1 call \(scope "
                     r"\S+/scan#2\); 2 stacked slice psums .* kept in the body", text), text
    # The body's plan is a scope of its own, its gradients named by their parameters.
    assert re.search(r"scope \S+/scan#2 \(a loop body: each iteration\)", text), text
    assert re.search(r"layers\.[bw], layers\.[bw]", text), text


# --- A train step inside a loop: its body planned for each iteration ------------------------

SUBSTEPS = 4


def substeps(loop: str, seed: int = 3):
    """A step that runs 4 SGD substeps in a loop (`scan`; `fori_loop` with a trip count known
    at trace time, a scan; or one passed in, a `while` loop), each a whole train step: the loss
    pmean'd inside `jax.value_and_grad` (`check_vma`: autodiff psums each gradient)."""
    rng = np.random.default_rng(seed)
    params = {"w1": (rng.standard_normal((12, 24)) * 0.3).astype(np.float32),
              "b1": np.zeros(24, np.float32),
              "w2": (rng.standard_normal((24, 3)) * 0.3).astype(np.float32),
              "b2": np.zeros(3, np.float32)}
    mesh = mesh_of((8,), ("data",))

    def local(params, x, y, n):
        xs, ys = x.reshape(SUBSTEPS, -1, 12), y.reshape(SUBSTEPS, -1, 3)

        def one(p, i):
            def loss_fn(p):
                h = jnp.tanh(xs[i] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
                return jax.lax.pmean(jnp.mean((h - ys[i]) ** 2), "data")
            loss, grads = jax.value_and_grad(loss_fn)(p)
            return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss
        if loop == "scan":
            params, losses = jax.lax.scan(one, params, jnp.arange(SUBSTEPS))
            return params, losses[-1]
        trips = SUBSTEPS if loop == "fori_loop" else n
        return jax.lax.fori_loop(0, trips, lambda i, p: one(p, i)[0], params), jnp.float32(0)

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                         out_specs=(P(), P()))
    x = shard(rng.standard_normal((8 * SUBSTEPS * 8, 12)).astype(np.float32), mesh, P("data"))
    y = shard(rng.standard_normal((8 * SUBSTEPS * 8, 3)).astype(np.float32), mesh, P("data"))
    return step, (params, x, y, jnp.int32(SUBSTEPS))


def _keeps_a_scalar_psum(jaxpr) -> bool:
    """Whether a loop body in `jaxpr` (at any depth) psums a scalar (the loss)."""
    for eqn in jaxpr.eqns:
        for sub in _compat.jaxprs_in_params(eqn.params):
            body = getattr(sub, "jaxpr", sub)
            if eqn.primitive.name in ("scan", "while") and any(
                    "psum" in e.primitive.name and e.invars[0].aval.shape == ()
                    for e in body.eqns):
                return True
            if _keeps_a_scalar_psum(body):
                return True
    return False


@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while"])
def test_a_train_step_inside_a_loop_is_planned_for_each_iteration(loop):
    """The body's gradient psums (one per parameter) are planned as a scope of their own:
    fused into fewer calls than psums, each a call of its own (no start/done pair in a body),
    the same plan every iteration. Bitwise: the fused body is its unfused form (one call per
    psum) and the optimized step its XLA control; within the bound of the plain step."""
    step, args = substeps(loop)
    opt = libra_jax.optimize(step)
    got = jax.jit(opt)(*args)
    report = opt.last_report
    loop_plan, = report.loops
    assert loop_plan.length == (None if loop == "while" else SUBSTEPS), loop_plan
    # The 4 gradients, and the loss's pmean where the body keeps it after the dead-code pass
    # `optimize` runs first (scan's ys; the while body's, unused: JAX 0.10 keeps it there,
    # newer JAX drops it, as from the fori_loop's scan), planned with them
    # (`rewrite.sites.value_sites`).
    psums = 4 + _keeps_a_scalar_psum(_compat.dce(jax.make_jaxpr(step)(*args).jaxpr))
    assert loop_plan.gradient == psums and loop_plan.calls < 4, report.plan_lines()
    in_body = [p for p in report.plans if p.scope == loop_plan.body]
    assert [p.kind for p in in_body if p.kind != "loop"] == ["gradient"] * loop_plan.calls
    assert {p.overlap for p in in_body} == {"sync"}
    jax.tree.map(assert_bitwise, got, jax.jit(libra_jax.optimize(step, collectives="xla"))(*args))
    unfused = libra_jax.optimize(step, fusion=False)
    jax.tree.map(assert_bitwise, got, jax.jit(unfused)(*args))
    assert [p.calls for p in unfused.last_report.loops] == [psums]
    assert_codegen_close(got, jax.jit(step)(*args))
    text = jax.jit(opt).lower(*args).as_text()
    assert "libra_allreduce_cpu" in text and "all_reduce" not in text


# --- Lowered for cuda on each opted-in path --------------------------------------------------

@pytest.mark.parametrize("mode", ["hoist", "in-loop", "substeps-while"])
def test_lowers_for_cuda_on_the_p2p_path(monkeypatch, mode):
    if not _ffi.HAS_CUDA:
        pytest.skip("built without CUDA: the cuda lowering falls back to XLA's all-reduce")
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    step, args = flax_scan() if mode != "substeps-while" else substeps("while")
    opt = libra_jax.optimize(step, profile="h100", loops=mode.replace("substeps-while", "auto"))
    text = jax.jit(opt).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "libra_allreduce_cuda" in text and "all_reduce" not in text


NCCL_LOOP = """
    import re, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import libra_jax
    sys.path.insert(0, sys.argv[1])
    from test_loops import flax_scan
    from test_loops import substeps
    for mode, (step, args) in (("hoist", flax_scan()), ("in-loop", flax_scan()),
                               ("while", substeps("while"))):
        opt = libra_jax.optimize(step, profile="h100", loops=mode.replace("while", "auto"))
        text = jax.jit(opt).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        print(mode, sorted(set(re.findall(r"custom_call @(libra_allreduce_\\w+)", text))),
              "all_reduce" in text)
"""


def test_lowers_for_cuda_on_the_nccl_path(stub_env):
    """In a loop body each bucket is one NCCL call per iteration (never a start/done pair);
    hoisted, the buckets are start/done pairs as elsewhere."""
    if not _ffi.HAS_CUDA:
        pytest.skip("built without CUDA: the cuda lowering falls back to XLA's all-reduce")
    stub_env["LIBRA_JAX_CUDA"] = "nccl"
    out = run(NCCL_LOOP, stub_env, str(__import__("pathlib").Path(__file__).parent))
    # Hoisted: the loss's pmean a member of the gradients' pairs (no single call); in the
    # loop (libra_allreduce_nccl: the body's bucket, one call a iteration).
    assert ("hoist ['libra_allreduce_cuda_done', "
            "'libra_allreduce_nccl_start'] False") in out, out
    assert ("in-loop ['libra_allreduce_cuda_done', 'libra_allreduce_nccl', "
            "'libra_allreduce_nccl_start'] False") in out, out
    # A whole step in a while loop: each iteration's fused bucket one NCCL call, in the body.
    assert "while ['libra_allreduce_nccl'] False" in out, out


def written_stacked(seed: int = 5):
    """`stacked`'s model written ``pmean(jax.grad(...))`` (``check_vma=False``): the
    stacked weights' gradient psums come after the backward scan, of the stacks it returns."""
    rng = np.random.default_rng(seed)
    params = {"layers": {"w": (rng.standard_normal((L, D, D)) * 0.2).astype(np.float32),
                         "b": (rng.standard_normal((L, D)) * 0.1).astype(np.float32)},
              "head": (rng.standard_normal((D, 1)) * 0.2).astype(np.float32)}
    mesh = mesh_of((8,), ("data",))

    def local(params, x):
        def loss_fn(p):
            def layer(h, w):
                return jnp.tanh(h @ w["w"] + w["b"]), None
            h, _ = jax.lax.scan(layer, x, p["layers"])
            return jnp.mean((h @ p["head"]) ** 2)
        return jax.lax.pmean(jax.grad(loss_fn)(params), "data")

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                         check_vma=False)
    x = shard(rng.standard_normal((64, D)).astype(np.float32), mesh, P("data"))
    return step, (params, x)


@pytest.mark.parametrize("mode", ["auto", "hoist", "in-loop"])
def test_the_written_form_s_stacked_slices_are_ready_per_iteration(mode):
    """pmean after jax.grad over scanned layers: each psum of a stacked slice moves into the
    backward scan's body (`loops.sink`), where `optimize` keeps it (in-loop: one psum per
    iteration, planned in the body) or hoists it back, as it does autodiff's; the values are
    bitwise the XLA control's and within class 3 of plain. Before, the psums stayed after
    the loop with no loop plan (`ready="written"`)."""
    step, args = written_stacked()
    opt = libra_jax.optimize(step, loops=mode)
    got = jax.jit(opt)(*args)
    jax.tree.map(assert_bitwise, got,
                 jax.jit(libra_jax.optimize(step, loops=mode, collectives="xla"))(*args))
    assert_codegen_close(got, jax.jit(step)(*args))
    loop, = opt.last_report.loops
    assert loop.psums == 2 and loop.choice == ("in-loop" if mode == "in-loop" else "hoist")
    if mode == "in-loop":
        assert loop.gradient == 2 and loop.calls >= 1, opt.last_report.plan_lines()
    old = libra_jax.optimize(step, loops=mode, ready="written")
    jax.jit(old).lower(*args)
    assert old.last_report.loops == []
