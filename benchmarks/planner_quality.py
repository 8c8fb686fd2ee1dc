"""Planner quality: gap of ``plan`` to ``plan_exhaustive`` on random instances, and large-instance results.

Table 1: for each (layers, options, mode) cell, ``--instances`` random instances (log-normal
compute and sizes with some zero-compute and zero-byte layers, random physical cost models with
solo_bw >= overlap_bw, latency from 0 to a few layer times); gap = plan / exhaustive - 1.
The "mixed" modes draw each layer's collective (an all-reduce, or a reduce-scatter priced by
random `CollectiveTerms`: sharded data parallelism beside replicated parameters), so a bucket
holds one collective. Table 2: 1,000 layers x 8 options with the Libra artifact's fitted cost
model across regimes: ``plan`` against the best baseline, and against the same search without
pre-fusion (every layer boundary allowed), which isolates what pre-fusion costs; again with the
collectives mixed (`planner_speed.mixed`). Prints markdown tables.

    python3 benchmarks/planner_quality.py [--instances 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from planner_speed import libra_cost, mixed, random_layers  # siblings: the script's folder is on sys.path

from libra_jax import planner
from libra_jax.planner import (
    CollectiveTerms,
    CostModel,
    Layer,
    plan,
    plan_default,
    plan_exhaustive,
    plan_fusion_only,
    plan_mgwfbp,
)

MIB = 1 << 20


def random_instance(rng: np.random.Generator, n: int, options: int,
                    mix: bool = False) -> tuple[list[Layer], CostModel]:
    comp = rng.lognormal(0.0, 1.0, n) * (rng.random(n) > 0.15)
    size = np.round(rng.lognormal(3.0, 1.0, n) * (rng.random(n) > 0.15)).astype(int)
    kinds = rng.choice(["all-reduce", "reduce-scatter"], n) if mix else ["all-reduce"] * n
    layers = [Layer(float(c), int(b), str(k)) for c, b, k in zip(comp, size, kinds)]
    keys = sorted(rng.choice(np.arange(1, 17), options, replace=False).tolist())
    solo = {k: float(rng.uniform(5.0, 60.0)) for k in keys}
    overlap = {k: solo[k] * float(rng.uniform(0.1, 1.0)) for k in keys}
    slowdown = {k: float(rng.uniform(1.0, 3.0)) for k in keys}
    latency = float(rng.choice([0.0, rng.uniform(0.0, 0.3), rng.uniform(0.3, 3.0)]))
    others = ({"reduce-scatter": CollectiveTerms(latency * float(rng.uniform(0.3, 1.0)),
                                                 float(rng.uniform(0.3, 1.0)))} if mix else {})
    return layers, CostModel(latency, solo, overlap, slowdown, collectives=others)


def random_grouping(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    cuts = sorted(set(rng.integers(1, n, size=rng.integers(0, n)).tolist())) if n > 1 else []
    edges = [0, *cuts, n]
    return [(edges[i], edges[i + 1] - 1) for i in range(len(edges) - 1)]


def gap_table(count: int) -> None:
    print(f"### Gap of `plan` to `plan_exhaustive` ({count} random instances per row)\n")
    print("| layers | options | mode | max gap | median gap | exact (gap <= 1e-9) |")
    print("|---:|---:|:---|---:|---:|---:|")
    worst = []
    for n, options in ((4, 2), (4, 4), (6, 3), (8, 2), (8, 4)):
        for mode in ("fusion", "no fusion", "fixed grouping", "fusion, mixed", "no fusion, mixed"):
            rng = np.random.default_rng(1000 * n + options)
            gaps = []
            for _ in range(count):
                layers, cost = random_instance(rng, n, options, mix=mode.endswith("mixed"))
                if mode.startswith("fusion"):
                    p, e = plan(layers, cost), plan_exhaustive(layers, cost)
                elif mode.startswith("no fusion"):
                    p, e = plan(layers, cost, fusion=False), plan_exhaustive(layers, cost, fusion=False)
                else:
                    g = random_grouping(rng, n)
                    p, e = plan(layers, cost, buckets=g), plan_exhaustive(layers, cost, buckets=g)
                gaps.append(p.backward_s / e.backward_s - 1.0)
            worst += gaps
            exact = sum(g <= 1e-9 for g in gaps)
            print(f"| {n} | {options} | {mode} | {max(gaps):.2e} | {statistics.median(gaps):.2e} | "
                  f"{exact}/{count} |")
    print(f"\nAll {len(worst)} instances: max gap {max(worst):.2e}, median {statistics.median(worst):.2e}.\n")


def baselines(layers: list[Layer], cost: CostModel) -> dict[str, float]:
    out = {}
    for k in cost.keys:
        out[f"default k={k} per-layer"] = plan_default(layers, cost, blocks=k, fusion_bytes=0).backward_s
        out[f"default k={k} 64MiB"] = plan_default(layers, cost, blocks=k, fusion_bytes=64 * MIB).backward_s
        out[f"MG-WFBP k={k}"] = plan_mgwfbp(layers, cost, blocks=k).backward_s
        out[f"fusion-only k={k}"] = plan_fusion_only(layers, cost, blocks=k).backward_s
    return out


def large_table(mix: bool = False) -> None:
    print("### 1,000 layers x 8 options, Libra artifact cost model"
          + (", all-reduces and reduce-scatters mixed" if mix else "") + " (times in ms)\n")
    print("| comm / compute | plan | best baseline | plan vs best baseline | without pre-fusion "
          "| pre-fusion cost | time without pre-fusion |")
    print("|---:|---:|:---|---:|---:|---:|---:|")
    cost = libra_cost(8)
    for ratio in (0.25, 0.5, 1.0, 2.0, 4.0):
        layers = random_layers(1000, cost, comm_ratio=ratio)
        if mix:
            layers = mixed(layers)
        p = plan(layers, cost)
        base = baselines(layers, cost)
        name = min(base, key=base.get)
        saved = planner.dp.ATOMS
        planner.dp.ATOMS = 10**9
        try:
            t0 = time.perf_counter()
            full = plan(layers, cost)
            dt = time.perf_counter() - t0
        finally:
            planner.dp.ATOMS = saved
        print(f"| {ratio} | {p.backward_s * 1e3:.3f} | {name}: {base[name] * 1e3:.3f} | "
              f"{(p.backward_s / base[name] - 1) * 100:+.2f}% | {full.backward_s * 1e3:.3f} | "
              f"{(p.backward_s / full.backward_s - 1) * 100:+.3f}% | {dt:.1f} s |")
    print("\nBaselines: Horovod default (per layer and 64 MiB), MG-WFBP and fusion-only, each at every "
          "allocation; the best one is shown. 'without pre-fusion' is the same search over every layer "
          "boundary (FRONT_CAP still applies).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=30)
    args = ap.parse_args()
    gap_table(args.instances)
    large_table()
    print()
    large_table(mix=True)


if __name__ == "__main__":
    main()
