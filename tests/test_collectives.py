"""libra_jax.collectives: one row per collective kind, and every other place that knows the
kinds reads it (the engine's enum, the model's table, the lowering's, the FFI targets)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from libra_jax import _libra_ffi, collectives, model, planner
from libra_jax.ops import lowering

ROOT = Path(__file__).resolve().parents[1]


def test_rows_are_the_engines_enum_in_order():
    header = (ROOT / "cpp" / "libra" / "dtype.h").read_text()
    enum = re.search(r"enum class Collective : int \{([^}]*)\}", header).group(1)
    names = [n.split("=")[0].strip() for n in enum.split(",")]
    assert [row.enum for row in collectives.ROWS] == list(range(len(names)))
    # The C++ rows (libra::kLayouts, indexed by the enum): name, sums, shard_in, shard_out.
    rows = re.findall(r'\{"([\w-]+)", (true|false), (true|false), (true|false)\}',
                      header[header.index("kLayouts[]"):])
    assert [(name, sums == "true", shard_in == "true", shard_out == "true")
            for name, sums, shard_in, shard_out in rows] == [
        (row.kind, not row.gathers, row.layout == "gathered", row.layout == "scattered")
        for row in collectives.ROWS]


def test_every_table_of_kinds_is_the_rows():
    assert planner.COLLECTIVES == collectives.KINDS == tuple(model.COLLECTIVE_SHAPES)
    assert lowering.COLLECTIVES is collectives.BY_LAX
    assert [collectives.lax_name(k) for k in collectives.KINDS] == [
        "psum", "psum_scatter", "all_gather"]
    assert [row.gathers for row in collectives.ROWS] == [False, False, True]
    assert {row.layout for row in collectives.ROWS} == set(collectives.LAYOUTS)


def test_target_names_follow_one_rule():
    reduce_scatter = collectives.BY_KIND["reduce-scatter"]
    assert reduce_scatter.target("nccl", "start") == "libra_reduce_scatter_nccl_start"
    assert reduce_scatter.role("nccl", "start") == "nccl_reduce_scatter_start"
    assert collectives.BY_KIND["all-reduce"].role("cpu") == "cpu"
    assert collectives.done_target("nccl") == collectives.done_target("cuda") == (
        "libra_allreduce_cuda_done")
    assert collectives.done_target("cpu") == "libra_allreduce_cpu_done"
    with pytest.raises(ValueError, match="no all-gather target for engine 'tpu'"):
        collectives.BY_KIND["all-gather"].target("tpu")
    # The extension registers each by that rule (tests/test_bazel.py checks every one).
    assert set(_libra_ffi.TARGETS.values()) <= {
        row.target(e, p) for row in collectives.ROWS for e in collectives.ENGINES
        for p in collectives.PHASES}


def test_a_new_row_goes_through_the_table_to_a_lowering(monkeypatch, jax_8):
    """docs/architecture.md, "Adding a collective", steps 1, 2 and 4 with a fake fourth row (a
    replicated kind, so that JAX's psum can stand for it): its target names follow from the
    row; its op, wired by `register_op` over `lowering.rule`, lowers to XLA's collective with
    the notice naming the kind until the extension has its target, then to the engine's
    custom call with the engine's attributes. Nothing else in the package is told of it."""
    import re

    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from conftest import mesh_of
    from libra_jax import _compat, _ffi
    from libra_jax.ops import base

    # 1. Its row.
    fake = collectives.Collective("fake_sum", "fake-sum", len(collectives.ROWS), "replicated",
                                  "fake_sum", collectives.BY_KIND["all-reduce"].shape,
                                  traffic_key="fake_sum_traffic", label="FS")
    monkeypatch.setattr(collectives, "ROWS", collectives.ROWS + (fake,))
    monkeypatch.setitem(collectives.BY_LAX, fake.lax, fake)
    monkeypatch.setitem(collectives.BY_KIND, fake.kind, fake)
    assert fake.target("cpu") == "libra_fake_sum_cpu"
    assert fake.target("nccl", "start") == "libra_fake_sum_nccl_start"
    assert lowering.COLLECTIVES["fake_sum"] is fake  # the lowering's table is the rows
    assert not _ffi.has_target("fake-sum", "cpu")

    # 4. Its op: a primitive over the row, lowered by the platform's one rule.
    def lowering_of(platform):
        def rule(ctx, x, *, axes, blocks):
            call = lowering.Call(fake, axes, blocks, lambda aval: lowering.mirrored(False, axes))
            return lowering.lower(ctx, x, call, platform)
        return rule

    monkeypatch.setattr(base, "XLA_TWINS", dict(base.XLA_TWINS))  # ops.XLA_TWINS keeps its own
    fake_p = base.register_op(
        "libra_test_fake_sum", lowering=lowering_of,
        abstract_eval=lambda aval, *, axes, blocks: _compat.psum_p.abstract_eval(
            aval, axes=axes, axis_index_groups=None))
    mesh = mesh_of((8,), ("x",))

    def lowered():
        step = jax.jit(jax.shard_map(lambda v: fake_p.bind(v, axes=("x",), blocks=3),
                                     mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                     check_vma=False))
        return step.lower(np.ones((8, 4), np.float32)).as_text()

    # 2. Without the engine's target: XLA's collective, and the notice naming the kind.
    monkeypatch.setattr(base, "_warned", set())
    with pytest.warns(UserWarning, match=r"libra_jax\.fake_sum: no Libra fake-sum for cpu "
                                         r"\(the extension registers no fake-sum target\)"):
        text = lowered()
    assert "stablehlo.all_reduce" in text and "libra_fake_sum" not in text
    # With its target in the extension's table: the engine's call, with its attributes.
    monkeypatch.setattr(_ffi, "_NAMES", _ffi._NAMES | {fake.target("cpu")})
    text = lowered()
    call, = re.findall(r"custom_call @libra_fake_sum_cpu\(.*", text)
    assert "blocks = 3 : i64" in call and "world = 8 : i64" in call, call
    assert 'label = "fake_sum(\'x\',)"' in call, call
    assert "stablehlo.all_reduce" not in text
