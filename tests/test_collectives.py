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
