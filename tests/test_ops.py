"""Tests of libra_jax.ops' wiring (base.register_op, lowering.rule and its seam);
the ops' values: tests/test_allreduce.py (psum), test_rewrite.py (fused), test_overlap.py
(start/done), test_platform_matrix.py (every op on every platform)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bitwise, copied_operands, mesh_of, shard
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import ops
from libra_jax.ops import base, lowering


def test_every_op_is_registered_once_with_an_xla_twin():
    prims = [ops.libra_psum_p, ops.libra_bucket_p, ops.libra_reduce_scatter_p,
             ops.libra_all_gather_p, ops.libra_start_p, ops.libra_done_p,
             ops.libra_all_to_all_p]
    assert sorted(ops.XLA_TWINS, key=str) == sorted(prims, key=str)
    for prim in prims:
        twin = ops.XLA_TWINS[prim]
        assert twin.name == f"{prim.name}_xla"
        assert twin.multiple_results == prim.multiple_results


def test_a_new_op_gets_every_platforms_rule_and_a_twin(monkeypatch):
    monkeypatch.setattr(base, "XLA_TWINS", {})
    asked = []

    def lowering_of(platform):
        asked.append(platform)
        return lambda ctx, x: [x]

    prim = base.register_op("libra_test_identity", abstract_eval=lambda a: (a, set()),
                            lowering=lowering_of)
    assert asked == [None, "cpu", "cuda", "xla"]
    assert base.XLA_TWINS[prim].name == "libra_test_identity_xla"
    mesh_of((8,), ("x",))  # the CPU backend starts with 8 devices, as everywhere in tests
    x = np.arange(4.0, dtype=np.float32)
    assert_bitwise(jax.jit(prim.bind)(x), x)


def test_an_unknown_platform_has_no_rule():
    with pytest.raises(ValueError, match="no collective rule for platform 'tpu'"):
        lowering.rule("tpu")


def _step(v):
    return libra_jax.psum(v * 2.0, "x")


def _lowered(fn):
    mesh = mesh_of((8,), ("x",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P())).lower(
        np.ones((8, 4), np.float32)).as_text()


def test_replaced_rule_reaches_every_op_and_is_undone():
    # The seam benchmarks/model_fidelity.py uses in place of patching private rules.
    def fused(v):
        return ops.libra_bucket_p.bind(v, v * 2.0, collective="psum", axes=("x",), blocks=2,
                                       invariant=False)

    assert "libra_allreduce_cpu" in _lowered(_step)
    with lowering.replaced_rule("cpu", lambda ctx, x, **_: [x]):
        assert "libra_allreduce_cpu" not in _lowered(_step)
        assert "libra_allreduce_cpu" not in _lowered(fused)
    assert "libra_allreduce_cpu" in _lowered(_step)
    assert "libra_allreduce_cpu" in _lowered(fused)


def test_the_timeout_attribute_is_built_in_one_place(monkeypatch):
    monkeypatch.setenv("LIBRA_JAX_TIMEOUT_S", "4")
    start_done = jax.jit(jax.shard_map(
        lambda v: ops.libra_done_p.bind(
            *ops.libra_start_p.bind(v, collective="psum", axes=("x",), blocks=1,
                                    invariant=False, call_id=5),
            collective="psum", out_avals=(jax.typeof(v),), axes=("x",), blocks=1,
            call_id=5)[0],
        mesh=mesh_of((8,), ("x",)), in_specs=P("x"), out_specs=P("x"), check_vma=False)).lower(
        np.ones((8, 4), np.float32)).as_text()
    for text in (_lowered(_step), start_done):
        assert "timeout_ms = 4000 : i64" in text


def test_default_blocks_matches_the_planners_rule():
    from libra_jax import collectives, model, planner

    all_reduce = collectives.BY_KIND["all-reduce"]
    for nbytes in (1 << 10, 1 << 20, 64 << 20):
        d = model.derive("cpu-host", 8)
        key = planner.no_overlap_allocation(d.cost, nbytes, lambda k: d.launch_shape(k)[0],
                                            all_reduce)
        assert lowering.default_blocks(nbytes, 8, "cpu-host", all_reduce) == min(
            lowering.MAX_BLOCKS, d.launch_shape(key)[0])
        # The public form: the all-reduce, the CPU's built-in profile, by default.
        assert libra_jax.default_blocks(nbytes, 8) == lowering.default_blocks(
            nbytes, 8, "cpu-host", all_reduce)
    assert (lowering.default_blocks(0, 8, "cpu-host", all_reduce)
            == lowering.default_blocks(1 << 20, 1, "cpu-host", all_reduce) == 1)


def test_jax_roofline_counts_libra_all_reduces_as_psums(jax_8) -> None:
    """`jax.experimental.roofline` sees a Libra psum, a fused bucket and a start/done pair as
    the all-reduces they are: the ICI bytes of XLA's psum of the same operands (a done adds
    nothing); before, it skipped them and reported none."""
    roofline = pytest.importorskip("jax.experimental.roofline")
    mesh = mesh_of((8,), ("x",))
    a = jax.ShapeDtypeStruct((8, 64), np.float32)
    b = jax.ShapeDtypeStruct((8, 32), np.float32)

    def split_pair(u, v):
        flats = ops.libra_start_p.bind(u, v, collective="psum", axes=("x",), blocks=2,
                                       invariant=False, call_id=7)
        return tuple(ops.libra_done_p.bind(*flats, collective="psum",
                                           out_avals=(jax.typeof(u), jax.typeof(v)),
                                           axes=("x",), blocks=2, call_id=7))

    bodies = {
        "xla": lambda u, v: (jax.lax.psum(u, "x"), jax.lax.psum(v, "x")),
        "psum": lambda u, v: (libra_jax.psum(u, "x", blocks=2), libra_jax.psum(v, "x", blocks=3)),
        "fused": lambda u, v: tuple(ops.libra_bucket_p.bind(
            u, v, collective="psum", axes=("x",), blocks=2, invariant=False)),
        "start-done": split_pair,
    }
    got = {}
    for name, body in bodies.items():
        _, result = roofline.roofline(body, mesh=mesh, in_specs=(P("x"), P("x")),
                                      out_specs=(P("x"), P("x")))(a, b)
        got[name] = dict(result.ici_bytes)
    assert got["xla"] and sum(got["xla"].values()) > 0
    for name in ("psum", "fused", "start-done"):
        assert got[name] == got["xla"], (name, got)


def test_jax_roofline_flops_of_a_libra_step_are_xlas(jax_8) -> None:
    """The roofline's FLOPs of a step with a Libra psum equal XLA's cost_analysis() of the
    compiled step (FLOPs only: XLA counts bytes after fusion, the roofline before). Both count
    the two matmuls and nothing for libra's all-reduce (a custom call to XLA); the roofline's
    psum rule counts no FLOPs either, where XLA counts its all-reduce's additions."""
    roofline = pytest.importorskip("jax.experimental.roofline")
    mesh = mesh_of((8,), ("x",))
    x = shard(np.ones((64, 128), np.float32), mesh, P("x"))
    w = shard(np.ones((128, 256), np.float32), mesh, P())

    def body(x, w):
        return libra_jax.psum(x.T @ (x @ w), "x", blocks=2)

    specs = dict(mesh=mesh, in_specs=(P("x"), P()), out_specs=P())
    _, result = roofline.roofline(body, **specs)(x, w)
    cost = jax.jit(jax.shard_map(body, **specs)).lower(x, w).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    matmuls = 2 * (2 * 8 * 128 * 256)  # per device: its 8 rows of x
    assert result.unfused_flops == matmuls
    assert cost["flops"] == matmuls


@pytest.mark.parametrize("overlap, target, primitive", [
    ("sync", "libra_allreduce_cpu", "libra_bucket"),
    ("start-done", "libra_allreduce_cpu_start", "libra_start")])
def test_a_cpu_bucket_is_one_engine_call_over_its_members_as_they_are(overlap, target,
                                                                      primitive):
    """A fused bucket on CPU is one engine call (or start, and its done) per dtype whose
    operands and results are the members themselves (the engine's variadic targets): no
    concatenate, slice or pad of the bucket in the compiled program (the packed form's
    concatenate cost 1.0-2.4 s a step on the MLP example), each member in place; bitwise
    its XLA control and the one-by-one psums."""
    import json
    import re

    from conftest import mlp_step
    from libra_jax import model

    step, args = mlp_step(sizes=(16, 24, 40, 8))
    doc = json.loads((model.PROFILE_DIR / "cpu-host.json").read_text())
    doc["network"]["base_latency_us"]["value"] = 1e6  # a call costs 1 s: one bucket
    opt = libra_jax.optimize(step, profile=doc, overlap=overlap)
    hlo = jax.jit(opt).lower(*args).compile().as_text()
    bucket, = [p for p in opt.last_report.plans if len(p.members) > 1]
    assert len(bucket.members) == 4  # every layer's weight gradient, and the loss's pmean
    calls = [line for line in hlo.splitlines()
             if f'custom_call_target="{target}"' in line and primitive in line]
    assert len(calls) == 1, calls
    operands = re.search(r"custom-call\(([^)]*)\)", calls[0]).group(1).split(", ")
    assert len(operands) == 1 + len(bucket.members), calls[0]  # (rank, group), then members
    aliases = ", ".join(f"{{{i}}}: ({i + 1}, {{}})" for i in range(len(bucket.members)))
    assert f"output_to_operand_aliasing={{{aliases}}}" in calls[0], calls[0]  # in place
    if overlap == "start-done":  # its done: (rank, group), token, the members, the latest token
        done, = [line for line in hlo.splitlines()
                 if 'custom_call_target="libra_allreduce_cpu_done"' in line]
        operands = re.search(r"custom-call\(([^)]*)\)", done).group(1).split(", ")
        assert len(operands) == 3 + len(bucket.members), done
        aliases = ", ".join(f"{{{i}}}: ({i + 2}, {{}})" for i in range(len(bucket.members)))
        assert f"output_to_operand_aliasing={{{aliases}}}" in done, done
    packing = [line for line in hlo.splitlines() if "libra_psum_" in line
               and re.search(r"= \S+ (concatenate|slice|pad|dynamic-update-slice)\(", line)]
    assert not packing, packing
    control = libra_jax.optimize(step, profile=doc, overlap=overlap, collectives="xla")
    assert_bitwise(jax.jit(opt)(*args), jax.jit(control)(*args))
    assert_bitwise(jax.jit(opt)(*args), jax.jit(step)(*args))


#: Libra's CPU all-reduces, as compiled: the one call (a psum, a bucket) and the start.
CPU_ALL_REDUCES = r'custom_call_target="libra_allreduce_cpu(_start)?"'


@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("overlap", ["sync", "start-done"])
def test_xla_copies_no_gradient_for_an_in_place_cpu_all_reduce(overlap, fusion):
    """Each gradient of a layer's weight and bias (a dot, a reduce) is the CPU all-reduce's
    operand itself, in place: XLA copies none for the call. (With the row-major layout
    constraints `jax.ffi.ffi_lowering` sets, XLA's layout assignment copied every aliased
    operand that was not a dot's result, in the fusion that computed it: a copy a gradient,
    and code fused otherwise than in the XLA control, which was then not bitwise at
    --xla_cpu_max_isa=AVX2.) Bitwise its control and the plain step."""
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(3)
    params = {f"{k}{i}": rng.standard_normal(s).astype(np.float32) * 0.1
              for i in range(2) for k, s in (("w", (12, 12)), ("b", (12,)))}
    x = shard(rng.standard_normal((8 * 4, 12)).astype(np.float32), mesh, P("x"))

    def loss(p, x):
        for i in range(2):
            x = jnp.tanh(x @ p[f"w{i}"] + p[f"b{i}"])
        return jnp.mean(x ** 2)

    def body(p, x):
        grads = jax.lax.pmean(jax.grad(loss)(p, x), "x")
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

    step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                         check_vma=False)
    opt = libra_jax.optimize(step, overlap=overlap, fusion=fusion)
    hlo = jax.jit(opt).lower(params, x).compile().as_text()
    assert re.search(CPU_ALL_REDUCES, hlo), hlo
    assert "output_to_operand_aliasing" in hlo  # in place
    assert copied_operands(hlo, CPU_ALL_REDUCES) == [], hlo
    control = libra_jax.optimize(step, overlap=overlap, fusion=fusion, collectives="xla")
    assert_bitwise(jax.jit(opt)(params, x), jax.jit(control)(params, x))
    assert_bitwise(jax.jit(opt)(params, x), jax.jit(step)(params, x))


def test_one_bucket_primitive_for_every_kind_and_the_old_names_still_bind():
    """`libra_bucket` is every kind's bucket (each kind's row's "bucket" form, one rule); the
    former names bind it with their kind and their params as they were, saying so
    (DeprecationWarning), for a release; a kind without a bucket form is refused by name
    (`collectives.NoForm`), and a name of no kind by `collectives.row_of`."""
    from libra_jax import collectives

    assert [r.kind for r in collectives.ROWS if r.has("bucket")] == ["all-reduce",
                                                                     "reduce-scatter",
                                                                     "all-gather"]
    mesh = mesh_of((8,), ("x",))
    x = shard(np.arange(8 * 16, dtype=np.float32).reshape(8 * 8, 2), mesh, P("x"))

    def both(v):
        new = ops.libra_bucket_p.bind(v, v * 2, collective="psum", axes=("x",), blocks=1,
                                      invariant=False)
        with pytest.warns(DeprecationWarning, match="libra_psum_fused_p is libra_bucket_p"):
            old = ops.libra_psum_fused_p.bind(v, v * 2, axes=("x",), blocks=1, invariant=False)
        scattered = ops.libra_bucket_p.bind(v, collective="psum_scatter", axes=("x",),
                                            axis_size=8, tiled=(True,), blocks=1)
        with pytest.warns(DeprecationWarning, match="libra_reduce_scatter_fused_p"):
            old_scattered = ops.libra_reduce_scatter_fused_p.bind(
                v, axis_name=("x",), axis_size=8, tiled=(True,), blocks=1)
        return (*new, *old, *scattered, *old_scattered)
    f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    a, b, c, d, e, g = f(x)
    assert_bitwise(a, c)
    assert_bitwise(b, d)
    assert_bitwise(e, g)
    # Bound by its name (a hand-bound primitive's boundary) the param holds the row.
    closed = jax.make_jaxpr(jax.shard_map(
        lambda v: ops.libra_bucket_p.bind(v, collective="psum", axes=("x",), blocks=1,
                                          invariant=False),
        mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)
    bucket, = closed.jaxpr.eqns[0].params["jaxpr"].eqns
    assert bucket.params["collective"] is collectives.BY_KIND["all-reduce"]
    assert "collective=psum" in str(bucket)  # printed as its jax.lax name, as before
    for kind in ("all_to_all", collectives.BY_KIND["all-to-all"]):
        with pytest.raises(collectives.NoForm, match=r"all-to-all collective \(all_to_all\) "
                                                     "has no bucket"):
            jax.make_jaxpr(jax.shard_map(
                lambda v: ops.libra_bucket_p.bind(v, collective=kind, axes=("x",)),
                mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)
    with pytest.raises(ValueError, match="no collective kind 'ppermute'"):
        ops.libra_bucket_p.bind(x, collective="ppermute", axes=("x",))


def test_one_start_done_pair_for_every_kind_and_the_old_names_still_bind():
    """`libra_start` / `libra_done` are every kind's pair (each kind's row's "pair" form, the
    sharded kinds' one): the former names (`libra_psum_start_p`..., `libra_sharded_done_p`)
    bind them with their kind and their params as they were, saying so (DeprecationWarning),
    for a release; the results are the one-call collectives' bits; a kind without a pair is
    refused by name (`collectives.NoForm`)."""
    from libra_jax import collectives

    rs, ag = collectives.BY_KIND["reduce-scatter"], collectives.BY_KIND["all-gather"]
    assert [r.kind for r in collectives.ROWS if r.has("pair")] == ["all-reduce",
                                                                   "reduce-scatter",
                                                                   "all-gather"]
    assert rs.form("pair") is ag.form("pair")
    mesh = mesh_of((8,), ("x",))
    x = shard(np.arange(8 * 16, dtype=np.float32).reshape(8 * 8, 2), mesh, P("x"))
    sharded = dict(dimension=0, axis_size=8, tiled=True, blocks=1)

    def pairs(v):
        psum = dict(axes=("x",), blocks=1)
        new, = ops.libra_done_p.bind(
            *ops.libra_start_p.bind(v, collective="psum", invariant=False, call_id=31, **psum),
            collective="psum", out_avals=(jax.typeof(v),), call_id=31, **psum)
        with pytest.warns(DeprecationWarning, match="libra_psum_start_p is libra_start_p"):
            started = ops.libra_psum_start_p.bind(v, invariant=False, call_id=32, **psum)
        with pytest.warns(DeprecationWarning, match="libra_psum_done_p is libra_done_p"):
            old, = ops.libra_psum_done_p.bind(*started, out_avals=(jax.typeof(v),),
                                              call_id=32, **psum)
        rs_aval = jax.typeof(jax.lax.psum_scatter(v, "x", tiled=True))
        flat, token = ops.libra_start_p.bind(v, collective="psum_scatter", axes=("x",),
                                             call_id=33, **sharded)
        scattered, = ops.libra_done_p.bind(flat, token, collective="psum_scatter",
                                           axes=("x",), call_id=33, out_avals=(rs_aval,),
                                           **sharded)
        with pytest.warns(DeprecationWarning, match="libra_sharded_start_p is libra_start_p"):
            flat, token = ops.libra_sharded_start_p.bind(
                v, collective="psum_scatter", axis_name=("x",), call_id=34, **sharded)
        with pytest.warns(DeprecationWarning, match="libra_sharded_done_p is libra_done_p"):
            old_scattered = ops.libra_sharded_done_p.bind(  # one result, as it was
                flat, token, collective="psum_scatter", axis_name=("x",), call_id=34,
                out_aval=rs_aval, **sharded)
        return new, old, jax.lax.psum(v, "x"), scattered, old_scattered, jax.lax.psum_scatter(
            v, "x", tiled=True)
    specs = (P("x"),) * 6
    f = jax.jit(jax.shard_map(pairs, mesh=mesh, in_specs=P("x"), out_specs=specs,
                              check_vma=False))
    new, old, psum, scattered, old_scattered, reference = f(x)
    assert_bitwise(new, psum)
    assert_bitwise(old, psum)
    assert_bitwise(scattered, reference)
    assert_bitwise(old_scattered, reference)
    text = str(jax.make_jaxpr(f)(x))
    assert text.count("libra_start[") == text.count("libra_done[") == 4
    with pytest.raises(collectives.NoForm, match=r"all-to-all collective \(all_to_all\) "
                                                 "has no pair"):
        jax.make_jaxpr(jax.shard_map(
            lambda v: ops.libra_start_p.bind(v, collective=collectives.BY_KIND["all-to-all"],
                                             axes=("x",)),
            mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)
    with pytest.raises(ValueError, match="no collective kind 'ppermute'"):
        ops.libra_start_p.bind(x, collective="ppermute", axes=("x",))


def test_a_pairs_start_and_done_are_one_call_in_two_phases_with_one_key():
    """A start and its done are one `lowering.Call` in two phases (`Call.phase`), emitted by
    `lowering.PairCall.emit` under the call's key: the lowered start and done carry the same
    ``call_id``, the pair's `start_done.call_key`, for the all-reduce's pair (a dtype group
    each) and a sharded kind's; a phase that is no half of a pair is refused by name."""
    from libra_jax import collectives
    from libra_jax.ops import start_done

    assert lowering.PHASES == ("one", "start", "done")
    mesh = mesh_of((8,), ("x",))
    x = shard(np.arange(8 * 16, dtype=np.float32).reshape(8 * 8, 2), mesh, P("x"))
    psum, rs = collectives.BY_KIND["all-reduce"], collectives.BY_KIND["reduce-scatter"]

    def pairs(v):
        kw = dict(axes=("x",), blocks=1)
        summed, = ops.libra_done_p.bind(
            *ops.libra_start_p.bind(v, collective=psum, invariant=False, call_id=5, **kw),
            collective=psum, out_avals=(jax.typeof(v),), call_id=5, **kw)
        sharded = dict(dimension=0, axis_size=8, tiled=True, call_id=6, **kw)
        flat, token = ops.libra_start_p.bind(v, collective=rs, **sharded)
        scattered, = ops.libra_done_p.bind(
            flat, token, collective=rs, out_avals=(jax.typeof(jax.lax.psum_scatter(
                v, "x", tiled=True)),), **sharded)
        return summed, scattered

    text = jax.jit(jax.shard_map(pairs, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")),
                                 check_vma=False)).lower(x).as_text()
    keys = re.findall(r"custom_call @(\w+)\(.*call_id = (\d+) : i64", text)
    assert keys == [("libra_allreduce_cpu_start", str(start_done.call_key(5, psum))),
                    ("libra_allreduce_cpu_done", str(start_done.call_key(5, psum))),
                    ("libra_reduce_scatter_cpu_start", str(start_done.call_key(6, rs))),
                    ("libra_allreduce_cpu_done", str(start_done.call_key(6, rs)))], keys
    split = lowering.PairCall("start", None, "done", {}, "cpu")
    with pytest.raises(ValueError, match="not 'one'"):
        split.emit(None, lowering.Call(psum, ("x",), 1, lowering.mirrored), [])


def test_a_sharded_pair_over_members_of_two_dtypes_is_one_start_per_dtype():
    """Every kind's start takes its members per dtype, as the all-reduce's always did (one
    start rule for every kind): an all-gather pair over an f32 and a bf16 member is bitwise
    `jax.lax.all_gather` of each (before, its one engine call refused the second dtype at run
    time: "every member must have the first's element type")."""
    from libra_jax import collectives

    mesh = mesh_of((8,), ("x",))
    a = shard(np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3), mesh, P("x"))
    b = shard(np.arange(8 * 2, dtype=jnp.bfloat16), mesh, P("x"))

    def body(u, v):
        kw = dict(collective=collectives.BY_KIND["all-gather"], axes=("x",), dimension=(0, 0),
                  axis_size=8, tiled=True, blocks=1, call_id=7)
        *flats, token = ops.libra_start_p.bind(u, v, **kw)
        wanted = (jax.lax.all_gather(u, "x", tiled=True), jax.lax.all_gather(v, "x", tiled=True))
        got = ops.libra_done_p.bind(*flats, token, out_avals=tuple(map(jax.typeof, wanted)),
                                    **kw)
        return (*got, *wanted)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P(),) * 4,
                              check_vma=False))
    got_a, got_b, want_a, want_b = f(a, b)
    assert_bitwise(got_a, want_a)
    assert_bitwise(got_b, want_b)
    text = f.lower(a, b).as_text()
    assert text.count("custom_call @libra_all_gather_cpu_start") == 2
