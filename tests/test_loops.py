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
from libra_jax import _ffi, loops

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
        loop_plans = [p for p in report.plans if p.kind == "loop"]
        if mode == "in-loop":
            assert len(loop_plans) == 2 and {p.blocks for p in loop_plans} == {
                report.loops[0].blocks}
        else:  # every layer's weight and bias gradient: planned with the other gradients
            assert not loop_plans, report.plan_lines()
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


def test_a_shared_weight_stays_in_the_loop_with_the_loops_block_count():
    step, args = stacked(shared=True)
    opt = libra_jax.optimize(step)
    assert_codegen_close(jax.jit(opt)(*args), jax.jit(step)(*args))
    report = opt.last_report
    loop, = report.loops
    assert loop.choice == "hoist" and loop.psums == 2 and loop.kept == 1
    assert [p.kind for p in report.plans].count("loop") == 1


def test_loops_argument_is_checked_and_explain_shows_the_choice():
    step, args = stacked()
    with pytest.raises(ValueError, match="loops must be one of 'auto', 'hoist', 'in-loop'"):
        libra_jax.optimize(step, loops="unroll")
    text = str(libra_jax.explain(step, *args, file=None))
    assert re.search(r"scan of 6, 2 psum\(s\) of [\d.]+ KiB per iteration: hoisted", text), text
    text = str(libra_jax.explain(step, *args, loops="in-loop", file=None))
    assert "kept in the loop, " in text


# --- Lowered for cuda on each opted-in path --------------------------------------------------

@pytest.mark.parametrize("mode", ["hoist", "in-loop"])
def test_lowers_for_cuda_on_the_p2p_path(monkeypatch, mode):
    if not _ffi.HAS_CUDA:
        pytest.skip("built without CUDA: the cuda lowering falls back to XLA's all-reduce")
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    step, args = flax_scan()
    opt = libra_jax.optimize(step, profile="h100", loops=mode)
    text = jax.jit(opt).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "libra_allreduce_cuda" in text and "all_reduce" not in text


NCCL_LOOP = """
    import re, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import libra_jax
    sys.path.insert(0, sys.argv[1])
    from test_loops import flax_scan
    step, args = flax_scan()
    for mode in ("hoist", "in-loop"):
        opt = libra_jax.optimize(step, profile="h100", loops=mode)
        text = jax.jit(opt).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        print(mode, sorted(set(re.findall(r"custom_call @(libra_allreduce_\\w+)", text))),
              "all_reduce" in text)
"""


def test_lowers_for_cuda_on_the_nccl_path(stub_env):
    """In the loop, libra's NCCL call is one call per iteration (never a start/done pair: a
    loop body has one call id); hoisted, the buckets are start/done pairs as elsewhere."""
    if not _ffi.HAS_CUDA:
        pytest.skip("built without CUDA: the cuda lowering falls back to XLA's all-reduce")
    stub_env["LIBRA_JAX_CUDA"] = "nccl"
    out = run(NCCL_LOOP, stub_env, str(__import__("pathlib").Path(__file__).parent))
    # (libra_allreduce_nccl: the loss's pmean, one call)
    assert ("hoist ['libra_allreduce_cuda_done', 'libra_allreduce_nccl', "
            "'libra_allreduce_nccl_start'] False") in out, out
    assert ("in-loop ['libra_allreduce_cuda_done', 'libra_allreduce_nccl', "
            "'libra_allreduce_nccl_start'] False") in out, out
