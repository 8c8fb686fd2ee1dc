"""Planner speed: wall time of ``plan`` against the number of layers and of allocation options.

Instances: random layers (log-normal compute and gradient sizes, 100 ms of compute, gradients
sized so the all-reduce at the best solo bandwidth takes as long as the compute, the hardest
regime) and the cost model of the Libra artifact's fitted curves (8 workers; options are total
thread counts). Each cell is the median of ``--repeat`` runs. Prints a markdown table.

    python3 benchmarks/planner_speed.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time


import numpy as np

from libra_jax.planner import CostModel, Layer, plan

MIB = 1 << 20
THREADS = (64, 128, 256, 512, 1024, 1536, 2048, 3072)  # option ladder, subsets taken from the end
# Libra artifact fits (gpu_resource/scripts): bandwidth b - a exp(-c n^0.6) MiB/ms, compute slowdown
# 1 / (b - c n); see /work/shared/reference notes, section 1.3.
OVERLAP_FIT = (8.2216991, 6.53459963, 0.0290902)
SOLO_FIT = (10.01228313, 7.10248977, 0.05409201)
SLOWDOWN_FIT = (0.876321235, 1.6058919e-4)


def libra_cost(options: int = 8, workers: int = 8) -> CostModel:
    """Cost model from the artifact's fitted curves, on the ``options`` largest thread counts."""
    keys = THREADS[len(THREADS) - options:]

    def bw(fit: tuple[float, float, float], n: int) -> float:
        a, b, c = fit
        return (b - a * math.exp(-c * n ** 0.6)) * MIB * 1000.0

    return CostModel(latency_s=(2 * workers - 2) * 5e-6,
                     solo_bw={n: bw(SOLO_FIT, n) for n in keys},
                     overlap_bw={n: bw(OVERLAP_FIT, n) for n in keys},
                     slowdown={n: 1.0 / (SLOWDOWN_FIT[0] - SLOWDOWN_FIT[1] * n) for n in keys})


def random_layers(n: int, cost: CostModel, *, comm_ratio: float = 1.0, compute_s: float = 0.1,
                  seed: int = 0) -> list[Layer]:
    """``n`` layers; ``comm_ratio`` = all-reduce time at the best solo rate / compute time."""
    rng = np.random.default_rng(seed)
    comp = rng.lognormal(0.0, 1.0, n)
    size = rng.lognormal(0.0, 1.5, n)
    comp *= compute_s / comp.sum()
    size *= comm_ratio * compute_s * max(cost.solo_bw.values()) / size.sum()
    return [Layer(float(c), int(b)) for c, b in zip(comp, size)]


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    sizes = (10, 50, 100, 200, 500, 1000, 2000)
    print("### Time of `plan` (ms, median of %d runs), balanced compute/communication\n" % args.repeat)
    print("| layers | options | fusion | no fusion |")
    print("|---:|---:|---:|---:|")
    for options in (2, 4, 8):
        cost = libra_cost(options)
        for n in sizes:
            layers = random_layers(n, cost)
            with_f = median_time(lambda: plan(layers, cost), args.repeat)
            without = median_time(lambda: plan(layers, cost, fusion=False), args.repeat)
            print(f"| {n} | {options} | {with_f * 1e3:.1f} | {without * 1e3:.1f} |")
    print("\n### 1,000 layers x 8 options across regimes (ms, median of %d runs)\n" % args.repeat)
    print("| communication / compute | fusion | no fusion | buckets (fusion) |")
    print("|---:|---:|---:|---:|")
    cost = libra_cost(8)
    for ratio in (0.25, 0.5, 1.0, 2.0, 4.0):
        layers = random_layers(1000, cost, comm_ratio=ratio)
        with_f = median_time(lambda: plan(layers, cost), args.repeat)
        without = median_time(lambda: plan(layers, cost, fusion=False), args.repeat)
        print(f"| {ratio} | {with_f * 1e3:.1f} | {without * 1e3:.1f} | {len(plan(layers, cost).buckets)} |")


if __name__ == "__main__":
    main()
