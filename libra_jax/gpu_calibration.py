"""A GPU profile from the CUDA harness's contention curves.

`libra_cuda_harness contend` (cpp/tools/harness.cc, run by
benchmarks/gpu_check.sh) measures, on one GPU, one rank's share of an
all-reduce with k blocks beside a GEMM and beside a memory-bound triad: the
compute's slowdown, the all-reduce's own slowdown, and the all-reduce's time
alone. This module fits the contention parameters of an ``nccl-style`` profile
(libra_jax.model) to those curves and writes them into the profile, marked
``measured`` with the run they came from:

==========================  ===============================================================
per_block_gbyte_per_s       alone rate / k, over the block counts before it saturates
overlap_block_efficiency    median over k of 1 / (all-reduce slowdown beside the GEMM)
units_per_block             SMs one block takes from a GEMM: SMs (1 - 1/s) / k, median over k
memory_bytes_per_bus_byte   HBM bytes per all-reduce byte that slow the triad:
                            HBM (1 - 1/s) / (overlapped rate), median over k
==========================  ===============================================================

What stays as it was: link bandwidths and latencies (virtual ranks read local
HBM, not NVLink or a NIC), the soft-min sharpness, and the memory-bound share of
a model's backward pass (a property of the model, not of the GPU).
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: Blocks below this many are taken as the linear (unsaturated) part of the rate curve.
LINEAR_BLOCKS = 8


@dataclasses.dataclass(frozen=True)
class ContendRow:
    """One `contend` line of the harness."""
    workload: str            # "gemm" or "triad"
    ranks: int
    bytes: int               # per input buffer (the all-reduce's bytes per rank)
    blocks: int
    compute_alone_us: float
    compute_slowdown: float
    allreduce_alone_us: float
    allreduce_slowdown: float


@dataclasses.dataclass(frozen=True)
class ContentionFit:
    """The fitted parameters (see the module docstring) and the points behind each."""
    per_block_gbyte_per_s: float
    overlap_block_efficiency: float
    units_per_block: float
    memory_bytes_per_bus_byte: float
    blocks: tuple[int, ...]


def read_contend_csv(path: str | Path) -> list[ContendRow]:
    """The `contend,...` rows of a harness CSV; ValueError naming a malformed line."""
    rows = []
    with open(path, newline="") as f:
        for number, line in enumerate(csv.reader(f), 1):
            if not line or line[0] != "contend":
                continue
            try:
                w, n, b, k, ca, cs, aa, as_ = line[1:9]
                rows.append(ContendRow(w, int(n), int(b), int(k), float(ca), float(cs),
                                       float(aa), float(as_)))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: not a contend line ({e}): {line}") from None
    if not rows:
        raise ValueError(f"{path}: no contend lines (run `libra_cuda_harness contend`)")
    return rows


def fit_contention(rows: Iterable[ContendRow], *, compute_units: int,
                   memory_gbyte_per_s: float) -> ContentionFit:
    """Fit the contention parameters to harness rows (both workloads needed)."""
    by_workload: dict[str, dict[int, ContendRow]] = {}
    for r in rows:
        by_workload.setdefault(r.workload, {})[r.blocks] = r
    missing = {"gemm", "triad"} - set(by_workload)
    if missing:
        raise ValueError(f"contention rows lack the {', '.join(sorted(missing))} workload")
    gemm, triad = by_workload["gemm"], by_workload["triad"]
    blocks = tuple(sorted(set(gemm) & set(triad)))
    if not blocks:
        raise ValueError("no block count was measured beside both workloads")

    def rate_gbyte_per_s(r: ContendRow) -> float:  # bytes per µs is MB/s
        return r.bytes / r.allreduce_alone_us / 1e3

    linear = [k for k in blocks if k <= LINEAR_BLOCKS] or list(blocks[:1])
    per_block = statistics.median(rate_gbyte_per_s(gemm[k]) / k for k in linear)
    efficiency = statistics.median(1.0 / gemm[k].allreduce_slowdown for k in blocks)
    units = statistics.median(compute_units * (1.0 - 1.0 / gemm[k].compute_slowdown) / k
                              for k in blocks)
    memory = statistics.median(
        memory_gbyte_per_s * (1.0 - 1.0 / triad[k].compute_slowdown)
        / (rate_gbyte_per_s(triad[k]) / triad[k].allreduce_slowdown)
        for k in blocks)
    return ContentionFit(per_block, efficiency, max(units, 0.0), max(memory, 0.0), blocks)


def apply_fit(profile: Mapping[str, Any], fit: ContentionFit, *, ref: str) -> dict[str, Any]:
    """A copy of an ``nccl-style`` profile dict with the fitted numbers, marked measured."""
    if profile.get("form") != "nccl-style":
        raise ValueError(f"profile {profile.get('name')!r} is not of the nccl-style form")
    out = copy.deepcopy(dict(profile))
    section = out["nccl_style"]
    for key, value in (("per_block_gbyte_per_s", fit.per_block_gbyte_per_s),
                       ("overlap_block_efficiency", fit.overlap_block_efficiency),
                       ("units_per_block", fit.units_per_block),
                       ("memory_bytes_per_bus_byte", fit.memory_bytes_per_bus_byte)):
        section[key] = {"value": round(value, 4), "source": "measured", "ref": ref}
    return out
