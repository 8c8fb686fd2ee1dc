"""Tests of libra_jax.ops.start_done and optimize(overlap="start-done"): the split all-reduce computes
the same values bit for bit; done waits until a result is needed; the CUDA lowering is the
start/done custom-call pair (checked by lowering for cuda here; run by benchmarks/gpu_check.sh)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _compat, _ffi, model, ops
from libra_jax.rewrite import optimize, rewrite_jaxpr
from libra_jax.config import xla_flags

from conftest import (assert_bitwise, assert_codegen_close, check_start_done_pairs, mesh_of,
                      mlp_step, run_abandoned_starts, shard)
from test_allreduce import TIMEOUT_SCRIPT

pytestmark = pytest.mark.usefixtures("jax_8")


def eqn_names(jaxpr):
    """Primitive names of the innermost jaxpr that holds a start (the shard_map body)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is ops.libra_start_p:
            return [e.primitive.name for e in jaxpr.eqns]
        for sub in _compat.jaxprs_in_params(eqn.params):
            names = eqn_names(sub)
            if names:
                return names
    return []


def test_start_done_equals_sync_bitwise_and_plain_within_the_bound():
    step, args = mlp_step()
    plain = jax.jit(step)(*args)
    sync = jax.jit(optimize(step, overlap="sync"))(*args)
    split = optimize(step, overlap="start-done")
    got = jax.jit(split)(*args)
    jax.tree.map(assert_bitwise, got, sync)  # the same plan; only the collective's form differs
    assert_codegen_close(got, plain)
    assert split.last_report.num_psums >= 5  # four weight gradients and the loss
    hlo = jax.jit(split).lower(*args).as_text()
    starts = re.findall(r"custom_call @libra_allreduce_cpu_start\(", hlo)
    assert starts and len(starts) == len(re.findall(r"custom_call @libra_allreduce_cpu_done\(", hlo))
    # No single call: the loss's pmean, which nothing reads, is a member of a gradient
    # bucket (`sites.value_sites`), split as they are.
    kinds = sorted(p.kind for p in split.last_report.plans if p.kind != "gradient")
    assert kinds == [] and len(re.findall(r"libra_allreduce_cpu\(", hlo)) == 0


def test_done_waits_until_a_result_is_needed():
    step, args = mlp_step()
    closed = jax.make_jaxpr(step)(*args)
    rewritten, report = rewrite_jaxpr(closed, fusion=False, overlap="start-done")
    names = eqn_names(rewritten.jaxpr)
    starts = [i for i, n in enumerate(names) if n == "libra_start"]
    dones = [i for i, n in enumerate(names) if n == "libra_done"]
    gradient_buckets = [p for p in report.plans if p.kind == "gradient"]
    assert len(starts) == len(dones) == len(gradient_buckets) >= 2
    # Every start comes before the first done, and so does all the backward pass: the
    # matmuls run while the all-reduces are in flight; only the update waits.
    assert max(starts) < min(dones)
    assert max(i for i, n in enumerate(names) if n == "dot_general") < min(dones)
    # The loss's pmean is a gradient bucket's member (`sites.value_sites`), split as they
    # are: no single call, no gradient left unsplit.
    assert names.count("libra_psum") == 0 and "libra_bucket" not in names
    assert [p.kind for p in report.plans if p.kind != "gradient"] == []


def with_pending_cost(pending_us, compute_threads=1.0, call_us=0.0):
    """The CPU host profile with another cost of a pending all-reduce (None: not known), on a
    host whose backward pass leaves cores idle (`compute_threads` of its 2 cores busy: half
    the deferred work is what the backward pass would have hidden), and a call costing
    `call_us` (0: the pair's extra call is free, so that the deferral and the wait decide;
    these steps' compute is a few microseconds)."""
    doc = model.profile_to_dict(model.load_profile("cpu-host"))
    if pending_us is None:
        del doc["fair_share"]["pending_allreduce_us"]
    else:
        doc["fair_share"]["pending_allreduce_us"]["value"] = pending_us
    doc["fair_share"]["compute_threads"]["value"] = compute_threads
    doc["fair_share"]["call_us"]["value"] = call_us
    return model.profile_from_dict(
        doc, origin=f"pending {pending_us}, D {compute_threads}, call {call_us}")


def test_auto_splits_the_buckets_whose_deferred_update_costs_less_than_pending():
    # Layers of 16x512 and 512x8 f32 weights (32 KiB and 16 KiB) and two small ones: their
    # SGD updates, as one fused region each, move about 3 x their bytes at the profile's
    # memory rate (21.6 GB/s): ~4.5 us and ~2.3 us, of which the backward pass would hide
    # half (one compute thread on 2 cores): ~2.3 us and ~1.1 us. A one-call bucket's wait
    # costs at most the compute left after it (`planner.pending_at`): the 16x512 weight's
    # gradient, the backward pass's last, has none left, and is one call whatever the wait.
    step, args = mlp_step(sizes=(16, 512, 8, 8, 8))
    closed = jax.make_jaxpr(step)(*args)

    def modes(pending_us, call_us=0.0):
        _, report = rewrite_jaxpr(closed, profile=with_pending_cost(pending_us, call_us=call_us),
                                  fusion=False, overlap="auto")
        return {p.nbytes: p.overlap for p in report.plans if p.kind == "gradient"}

    waits = modes(1e6)
    assert waits.pop(16 * 512 * 4) == "sync"  # ready at the end: nothing to hide a wait
    assert set(waits.values()) == {"start-done"}
    assert set(modes(0).values()) == {"sync"}
    assert set(modes(None).values()) == {"sync"}  # not known: one call, as before
    mixed = modes(1.75)
    assert mixed[16 * 512 * 4] == "sync" and mixed[512 * 8 * 4] == "start-done"
    assert mixed[8 * 8 * 4] == "start-done"
    # A pair makes one call more: priced above the compute a wait could take, none pays.
    assert set(modes(1e6, call_us=1e3).values()) == {"sync"}
    # The GPU profiles do not know the cost: one call each until a GPU has measured start/done.
    _, report = rewrite_jaxpr(closed, profile="h200", fusion=False, overlap="auto")
    assert {p.overlap for p in report.plans if p.kind == "gradient"} == {"sync"}
    # A mixed plan computes the same values as plain JAX.
    auto = optimize(step, profile=with_pending_cost(1.75), fusion=False, overlap="auto")
    assert_codegen_close(jax.jit(auto)(*args), jax.jit(step)(*args))
    assert {p.overlap for p in auto.last_report.plans if p.kind == "gradient"} == \
        {"sync", "start-done"}


def test_auto_pairs_every_bucket_where_the_compute_threads_fill_the_cores():
    # 8 host devices on 2 cores (cpu-host): the optimizer work a pair defers takes the same
    # cores beside the backward pass as after it, so deferring costs nothing and every bucket
    # is a pair. The MLP example's 4 MiB buckets (their Adam updates ~1.4 ms at the profile's
    # memory rate, above pending_allreduce_us) were one call each, and that plan measured 8-15%
    # slower than the same buckets as pairs (benchmarks/results/planning_quality.md).
    import plan_fixture

    lines = plan_fixture.example_plan("mlp", small=False)
    gradient = [line for line in lines if "kind=gradient" in line]
    assert gradient and all("overlap=start-done" in line for line in gradient), lines
    profile = model.load_profile("cpu-host").fair_share
    assert profile.compute_threads >= profile.cores
    # The same buckets on a host with idle cores: the big updates' deferral is priced again.
    step, args = mlp_step(sizes=(16, 512, 8, 8, 8))
    _, report = rewrite_jaxpr(jax.make_jaxpr(step)(*args), fusion=False, overlap="auto",
                              profile=with_pending_cost(1e-3, compute_threads=9.0))
    modes = {p.nbytes: p.overlap for p in report.plans if p.kind == "gradient"}
    assert modes.pop(16 * 512 * 4) == "sync"  # the last, with no compute left to hide a wait
    assert set(modes.values()) == {"start-done"}
    _, report = rewrite_jaxpr(jax.make_jaxpr(step)(*args), fusion=False, overlap="auto",
                              profile=with_pending_cost(1e-3, compute_threads=1.0))
    # (The loss's pmean, a bucket of its own here, defers nothing: nothing reads it.)
    assert {p.overlap for p in report.plans if p.kind == "gradient" and p.nbytes > 4} == {"sync"}


def test_the_fsdp_examples_reduce_scatters_are_one_bucket():
    # A bucket of psum_scatters has no start/done pair: each is one call, which waits for the
    # last rank where it is ready (`planner.pending_at`). The FSDP example's stream was split
    # in two for overlap (priced 0.7% ahead without the wait, measured behind one bucket:
    # benchmarks/results/planning_quality_probe.md); the planner now weighs the wait.
    import plan_fixture

    lines = plan_fixture.example_plan("fsdp", small=False)
    scatters = [line for line in lines if "kind=gradient" in line and "reduce-scatter" in line]
    assert len(scatters) == 1 and "psums=15 " in scatters[0], lines
    assert "overlap=sync" in scatters[0]


def test_a_retrace_gives_the_same_program():
    # Start/done call ids come from the program, not a random source: JAX's compilation
    # cache can serve a second process (test_rewrite.test_persistent_compilation_cache).
    step, args = mlp_step()
    texts = [jax.jit(optimize(step, overlap="start-done")).lower(*args).as_text()
             for _ in range(2)]
    assert "libra_allreduce_cpu_start" in texts[0] and texts[0] == texts[1]
    other = jax.jit(optimize(mlp_step(sizes=(16, 32, 8))[0], overlap="start-done")).lower(
        *mlp_step(sizes=(16, 32, 8))[1]).as_text()
    ids = lambda text: set(re.findall(r"call_id = (\d+)", text))  # noqa: E731
    assert ids(texts[0]) and not ids(texts[0]) & ids(other)


def test_start_and_done_pack_mixed_dtypes_with_padding():
    # One bucket of an f32 (5 elements: padded to 8) and a bf16 (3 elements: padded to 8),
    # packed per dtype, all-reduced, split back: psum's values bit for bit.
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(3)
    a = shard(rng.standard_normal((8, 5)).astype(np.float32), mesh, P("x"))
    b = shard(rng.standard_normal((8, 3)).astype(jnp.bfloat16), mesh, P("x"))
    avals = [jax.core.ShapedArray((1, 5), np.float32), jax.core.ShapedArray((1, 3), jnp.bfloat16)]
    flat = ops.packing.packed_avals(avals)
    assert [(f.shape, f.dtype) for f in flat] == [((8,), np.float32), ((8,), jnp.bfloat16)]

    call_id = 12345

    def body(a, b):
        started = ops.libra_start_p.bind(a, b, collective="psum", axes=("x",), blocks=2,
                                         invariant=False, call_id=call_id)
        assert len(started) == 3  # a buffer per dtype, and the token
        return tuple(ops.libra_done_p.bind(*started, collective="psum", out_avals=tuple(avals),
                                           axes=("x",), blocks=2, call_id=call_id))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=(P("x"), P("x")), check_vma=False))
    g = jax.jit(jax.shard_map(lambda a, b: (jax.lax.psum(a, "x"), jax.lax.psum(b, "x")),
                              mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")),
                              check_vma=False))
    jax.tree.map(assert_bitwise, f(a, b), g(a, b))


def test_overlap_mode_is_validated(monkeypatch):
    step, args = mlp_step()
    with pytest.raises(ValueError, match="overlap must be one of"):
        optimize(step, overlap="async")
    monkeypatch.setenv("LIBRA_JAX_OVERLAP", "streams")
    with pytest.raises(ValueError, match="LIBRA_JAX_OVERLAP"):
        optimize(step)
    monkeypatch.setenv("LIBRA_JAX_OVERLAP", "start-done")
    assert "libra_start" in str(jax.make_jaxpr(optimize(step))(*args))
    monkeypatch.setenv("LIBRA_JAX_OVERLAP", "sync")
    assert "libra_start" not in str(jax.make_jaxpr(optimize(step))(*args))
    # The decorator form passes overlap on too.
    assert "libra_start" in str(jax.make_jaxpr(optimize(overlap="start-done")(step))(*args))


@pytest.mark.skipif(not _ffi.HAS_CUDA, reason="libra_jax built without CUDA")
def test_cuda_lowering_is_a_start_done_pair(monkeypatch):
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    _ffi.ensure_cuda_registered()
    step, args = mlp_step()
    text = jax.jit(optimize(step, fusion=False, overlap="start-done")).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    # Each done reads its own start's in-flight buffer (aliased to its output) and waits for
    # the same call id; its other operand is the latest start's token (orders it after it).
    assert check_start_done_pairs(text, "libra_allreduce_cuda_start", None) >= 2


@pytest.mark.skipif(not _ffi.HAS_CUDA, reason="libra_jax built without CUDA")
def test_a_gpu_bucket_is_one_start_over_the_members_the_kernels_take_as_they_are(monkeypatch):
    """On a GPU a start/done bucket is one start and one done over its members, each on its
    own buffer (the kernels take a table of their pointers: no packed copy); a member the P2P
    kernels cannot take as it is (12 bytes: not whole 16-byte vectors) is all-reduced in
    start by the one-call kernel (padded), and its done passes it through. (One start per
    member was lowered before.)"""
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    _ffi.ensure_cuda_registered()
    mesh = mesh_of((8,), ("x",))

    def bucket(a, b, c):
        avals = tuple(jax.core.ShapedArray(s, jnp.float32) for s in ((4, 8), (3,), (16,)))
        return tuple(ops.libra_done_p.bind(
            *ops.libra_start_p.bind(a, b, c, collective="psum", axes=("x",), blocks=2,
                                    invariant=False, call_id=77),
            jnp.zeros((1,), jnp.int32),
            collective="psum", out_avals=avals, axes=("x",), blocks=2, call_id=77))
    f = jax.jit(jax.shard_map(bucket, mesh=mesh, in_specs=(P(),) * 3, out_specs=(P(),) * 3,
                              check_vma=False))
    args = [np.ones(s, np.float32) for s in ((4, 8), (3,), (16,))]
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    start, = re.findall(r"custom_call @libra_allreduce_cuda_start\(([^)]*)\)", text)
    assert len(start.split(", ")) == 2, start  # the (4, 8) and (16,) members
    assert len(re.findall(r"custom_call @libra_allreduce_cuda_done\(", text)) == 1, text
    assert len(re.findall(r"custom_call @libra_allreduce_cuda\(", text)) == 1, text
    assert "stablehlo.concatenate" not in text


@pytest.mark.skipif(not _ffi.HAS_CUDA, reason="libra_jax built without CUDA")
def test_cuda_start_falls_back_to_xla_where_the_kernels_cannot(monkeypatch):
    _ffi.ensure_cuda_registered()
    monkeypatch.setenv("LIBRA_JAX_CUDA", "xla")
    monkeypatch.setattr("libra_jax.ops.base._warned", set())  # an earlier test may have warned
    step, args = mlp_step()
    with pytest.warns(UserWarning, match="XLA's all-reduce"):
        text = jax.jit(optimize(step, overlap="start-done")).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "libra_allreduce_cuda" not in text and "all_reduce" in text


# test_allreduce's script (rank 2 never arrives), with the psum split into start and done.
START_TIMEOUT_SCRIPT = TIMEOUT_SCRIPT.replace("def body(v):", textwrap.dedent("""\
    from libra_jax import ops
    call_id = 12345
    def split_psum(u):
        flat = ops.libra_start_p.bind(u, collective="psum", axes=("x",), blocks=1,
                                      invariant=False, call_id=call_id)
        return ops.libra_done_p.bind(*flat, collective="psum", out_avals=(jax.typeof(u),),
                                     axes=("x",), blocks=1, call_id=call_id)[0]
    def body(v):""")).replace('lambda u: libra_jax.psum(u, "x"), v)', "split_psum, v)")


def test_cpu_start_whose_rank_never_arrives_fails_at_done():
    proc = subprocess.run([sys.executable, "-c", START_TIMEOUT_SCRIPT], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "XLA_FLAGS": xla_flags(None)})
    out = proc.stdout
    assert "split_psum, v)" in START_TIMEOUT_SCRIPT
    assert "DEADLINE_EXCEEDED" in out and "waiting for ranks [2] of 4" in out, out + proc.stderr
    assert float(re.search(r"elapsed ([\d.]+)", out).group(1)) < 60
    assert "after [4.0, 4.0, 4.0]" in out  # a complete all-reduce works afterwards


# A start whose execution fails before its done (here: another all-reduce, which rank 2 never
# reaches, times out in between) leaves its in-flight entry behind (conftest.run_abandoned_starts).
ABANDONED_PROGRAM = """
    aval = jax.core.ShapedArray((1, 4), np.float32)

    def body(a, v, fail):
        started = ops.libra_start_p.bind(a, collective="psum", axes=("x",), blocks=1,
                                         invariant=False, call_id=77)
        if fail:
            i = jax.lax.axis_index("x")
            v = jax.lax.cond(i == 2, lambda u: u, lambda u: libra_jax.psum(u, "x"), v)
        started, v = jax.lax.optimization_barrier((started, v))  # done after v's psum
        done, = ops.libra_done_p.bind(*started, collective="psum", out_avals=(aval,),
                                      axes=("x",), blocks=1, call_id=77)
        return done + v.sum()

    def program(fail):
        return jax.jit(jax.shard_map(lambda a, v: body(a, v, fail), mesh=mesh,
                                     in_specs=(P("x"), P("x")), out_specs=P("x"),
                                     check_vma=False))
    x = jax.device_put(np.ones((4, 4), np.float32), jax.NamedSharding(mesh, P("x")))

    def summary(out):
        return np.asarray(out).ravel().tolist()[:4]
"""


def test_starts_abandoned_by_a_failed_execution_expire():
    abandoned, result = run_abandoned_starts(ABANDONED_PROGRAM)
    assert abandoned == 3  # ranks 0, 1, 3 never reached their done
    assert result == "[8.0, 8.0, 8.0, 8.0]"  # 4 (the sum) + 4 (v.sum())


def test_xla_copies_no_in_flight_buffer():
    # Compiled by XLA (CPU): each done's buffer operand is its start's result itself, never a
    # copy that XLA would make (and fill while the all-reduce may still write the buffer) for a
    # second reader; its tokens are its own start's and the latest start's; it has a side
    # effect (XLA keeps it).
    step, args = mlp_step()
    hlo = jax.jit(optimize(step, fusion=False, overlap="start-done")).lower(*args).compile().as_text()
    starts = re.findall(r"(%\S+) = \(\S+, s32\[1\]\{0\}\) custom-call\(.*?"
                        r'custom_call_target="libra_allreduce_cpu_start"', hlo)
    elements = {name: (tuple_, index) for name, tuple_, index in re.findall(
        r"(%get-tuple-element\S*) = \S+ get-tuple-element\((%\S+?)\), index=(\d)", hlo)}
    # done's operands: (rank, group), its token, its buffer, the latest start's token.
    dones = re.findall(r"custom-call\(\S+?, (%\S+?), (%\S+?), (%\S+?)\), "
                       r'custom_call_target="libra_allreduce_cpu_done", [^\n]*'
                       r"custom_call_has_side_effect=true", hlo)
    assert len(starts) >= 2 and len(dones) == len(starts), hlo
    for token, buffer, after in dones:
        assert elements[buffer][0] in starts and elements[buffer][1] == "0", (buffer, hlo)
        assert elements[token] == (elements[buffer][0], "1"), token
        assert elements[after][0] in starts and elements[after][1] == "1", after


# --- A start never loses its done (issue: silently wrong gradients when a step drops a
# reduced gradient). Each in a subprocess: a lost done lets the engine write into a buffer XLA
# has reused, which corrupts the heap or changes results from run to run.

DROPPED_PROGRAM = """
import os, sys, json
import jax, jax.numpy as jnp, numpy as np, optax
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import Mesh, PartitionSpec as P
import libra_jax
from libra_jax import testing
mesh = Mesh(np.array(jax.devices()), ("data",))
WIDTH = 256

def loss(p, x):
    h = x
    for i in range(3):
        h = jnp.tanh(h @ p[f"w{i}"])
    return jnp.mean(h ** 2)

def frozen(p, x):  # a frozen parameter: its reduced gradient zeroed after the pmean
    g = jax.lax.pmean(jax.grad(loss)(p, x), "data")
    g["w2"] = jnp.zeros_like(g["w2"])
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

masked_tx = optax.chain(optax.masked(optax.set_to_zero(),
                                     {"w0": False, "w1": False, "w2": True}),
                        optax.sgd(0.1))
split_tx = optax.multi_transform({"train": optax.sgd(0.1), "frozen": optax.set_to_zero()},
                                 {"w0": "train", "w1": "train", "w2": "frozen"})

def with_optax(tx):
    def step(p, x):
        g = jax.lax.pmean(jax.grad(loss)(p, x), "data")
        updates, _ = tx.update(g, tx.init(p), p)
        return optax.apply_updates(p, updates)
    return step

def metric(p, x):  # a psum'd metric nobody returns: the gradients' norm
    g = jax.grad(loss)(p, x)
    jax.lax.pmean(optax.global_norm(g), "data")
    g = jax.lax.pmean(g, "data")
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

def sharded(p, x):  # a reduce-scatter's shard and an all-gather's result, one of each dropped
    g = jax.grad(loss)(p, x)
    shards = {k: jax.lax.psum_scatter(v, "data", tiled=True) for k, v in g.items()}
    shards["w1"] = jnp.zeros_like(shards["w1"])
    full = {k: jax.lax.all_gather(v, "data", tiled=True) for k, v in shards.items()}
    del full["w2"]
    return {k: p[k] - 0.1 * full[k] if k in full else p[k] for k in p}

def frozen_autodiff(p, x):  # the same with autodiff's psums (check_vma): the loss's pmean
    g = jax.grad(lambda p: jax.lax.pmean(loss(p, x), "data"))(p)
    g["w2"] = jnp.zeros_like(g["w2"])
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

STEPS = {"frozen": (frozen, False), "frozen-autodiff": (frozen_autodiff, True),
         "frozen-pmap": (frozen, None), "masked": (with_optax(masked_tx), False),
         "multi_transform": (with_optax(split_tx), False), "metric": (metric, False),
         "sharded": (sharded, False)}
name, overlaps = sys.argv[1], sys.argv[2:]
fn, vma = STEPS[name]
keys = jax.random.split(jax.random.key(0), 4)
p = {f"w{i}": jax.random.normal(keys[i], (WIDTH, WIDTH)) * 0.05 for i in range(3)}
x = jax.random.normal(keys[3], (64, WIDTH))
if vma is None:  # pmap: the batch split along a leading axis of the devices
    step = jax.pmap(fn, axis_name="data", in_axes=(None, 0))
    x = x.reshape(8, 8, WIDTH)
else:
    step = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                         check_vma=vma)
plain = jax.jit(step)(p, x)
for overlap in overlaps:
    opts = dict(overlap=overlap, fusion=False)
    if name == "sharded" and overlap == "start-done":
        opts["prefetch"] = 1  # its all-gathers issued ahead, as start/done pairs
    optimized = jax.jit(libra_jax.optimize(step, **opts))
    control = jax.jit(libra_jax.optimize(step, collectives="xla", **opts))(p, x)
    hlo = optimized.lower(p, x).compile().as_text()
    starts = sum(hlo.count(f'custom_call_target="libra_{k}_cpu_start"')
                 for k in ("allreduce", "reduce_scatter", "all_gather"))
    dones = hlo.count('custom_call_target="libra_allreduce_cpu_done"')
    first = optimized(p, x)
    differ = sum(any(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(optimized(p, x)), jax.tree.leaves(first))) for _ in range(20))
    control_bitwise = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first),
                                                                jax.tree.leaves(control)))
    try:
        testing.assert_codegen_close(first, plain)
        close = True
    except AssertionError:
        close = False
    print("RESULT", overlap, json.dumps(dict(starts=starts, dones=dones, differ=differ,
                                             control_bitwise=control_bitwise,
                                             close_to_plain=close)))
"""


def _run(source: str, *args: str) -> str:
    import subprocess
    import sys
    # The caller's flags (CI's ISA stage sets one), less the device count: the program asks
    # for its own (jax_num_cpu_devices).
    env = {**os.environ, "XLA_FLAGS": xla_flags(None)}
    proc = subprocess.run([sys.executable, "-c", source, *args], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("name", ["frozen", "frozen-autodiff", "frozen-pmap", "masked",
                                  "multi_transform", "metric", "sharded"])
def test_a_step_that_drops_a_reduced_value_keeps_every_done(name):
    overlaps = ["auto", "start-done", "sync"]
    out = _run(DROPPED_PROGRAM, name, *overlaps)
    results = {line.split()[1]: json.loads(line.split(" ", 2)[2])
               for line in out.splitlines() if line.startswith("RESULT ")}
    assert list(results) == overlaps, out
    for overlap, result in results.items():
        assert result["starts"] == result["dones"], (overlap, result)  # no start loses its done
        if overlap == "start-done":
            assert result["starts"] >= 1, (overlap, result)  # a pair to lose
        assert result["differ"] == 0, (overlap, result)  # the same every run
        assert result["control_bitwise"] and result["close_to_plain"], (overlap, result)


def test_optimize_removes_and_reports_collectives_whose_results_are_unused():
    mesh = mesh_of((8,), ("data",))

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["a"]) @ p["b"])

    def step(p, x):
        g = jax.lax.pmean(jax.grad(loss)(p, x), "data")
        g["b"] = jnp.zeros_like(g["b"])
        jax.lax.psum(jnp.sum(x), "data")  # a metric nobody returns
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    sm = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                       check_vma=False)
    p = {"a": np.ones((8, 8), np.float32), "b": np.ones((8, 1), np.float32)}
    x = np.ones((16, 8), np.float32)
    closed = jax.make_jaxpr(sm)(p, x)
    _, report = rewrite_jaxpr(closed, overlap="start-done")
    assert report.dropped == ["psum (x2)"]
    assert report.num_psums == 1
    assert "psum (x2)" in str(libra_jax.explain(sm, p, x, file=None))


RAW_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 4)
from jax.sharding import Mesh, PartitionSpec as P
import libra_jax
from libra_jax import ops
mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4), jax.NamedSharding(mesh, P("x")))
smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                       check_vma=False))
sharded = dict(axes=("x",), dimension=0, axis_size=4, tiled=True, blocks=1)
cases = {
    "psum start, buffer returned": lambda v: ops.libra_start_p.bind(
        v, collective="psum", axes=("x",), blocks=1, invariant=False,
        call_id=901)[0].reshape(v.shape),
    "psum_scatter start, buffer returned": lambda v: ops.libra_start_p.bind(
        v, collective="psum_scatter", call_id=902, **sharded)[0].reshape(v.shape),
    "all_gather start, buffer read without its done": lambda v: v + ops.libra_start_p.bind(
        v, collective="all_gather", call_id=903, **sharded)[0][:v.size].reshape(v.shape),
}
for name, f in cases.items():
    for run in range(10):
        try:
            jax.block_until_ready(smap(f)(x))
            print("RAN", name)
        except ValueError as e:
            assert "has no libra_" in str(e) and "call_id=90" in str(e), e
            if run == 0:
                print("REFUSED", name)

def unused_done(v):  # a pair whose done's result nobody reads: XLA keeps the done
    flat = ops.libra_start_p.bind(v, collective="psum", axes=("x",), blocks=1, invariant=False,
                                  call_id=905)
    ops.libra_done_p.bind(*flat, collective="psum", out_avals=(jax.typeof(v),), axes=("x",),
                          blocks=1, call_id=905)
    return v * 2
hlo = smap(unused_done).lower(x).compile().as_text()
print("UNUSED DONE", hlo.count("libra_allreduce_cpu_start"), hlo.count("libra_allreduce_cpu_done"))
for _ in range(10):
    jax.block_until_ready(smap(unused_done)(x))
total = smap(lambda v: libra_jax.psum(v, "x"))(x)
print("LATER", bool(np.array_equal(np.asarray(total), np.tile(np.asarray(x).reshape(4, 4, 4).sum(0), (4, 1)))))
"""


def test_a_start_without_its_done_is_refused_and_a_later_collective_is_right():
    out = _run(RAW_PROGRAM)
    for case in ("psum start, buffer returned", "psum_scatter start, buffer returned",
                 "all_gather start, buffer read without its done"):
        assert f"REFUSED {case}" in out and f"RAN {case}" not in out, out
    assert "UNUSED DONE 1 1" in out, out
    assert "LATER True" in out, out


def test_a_call_id_out_of_range_is_refused_by_name():
    """Start/done keys are ``call_id * 4096 + slot`` in an int64: a hand-bound call id of
    2**48 or more (or negative) is refused when lowered, naming the range (not a silent
    overflow that could pair two calls)."""
    mesh = mesh_of((8,), ("x",))

    def pair(a):
        *buffers, token = ops.libra_start_p.bind(a, collective="psum", axes=("x",), blocks=1,
                                                 invariant=False, call_id=2**48)
        return ops.libra_done_p.bind(*buffers, token, token, collective="psum",
                                     out_avals=(buffers[0].aval,), axes=("x",), blocks=1,
                                     call_id=2**48)[0]
    f = jax.jit(jax.shard_map(pair, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    with pytest.raises(ValueError, match=r"call_id must be in \[0, 2\*\*48\)"):
        f.lower(np.ones((4,), np.float32))
