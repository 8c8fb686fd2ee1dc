"""Planner speed: wall time of ``plan`` against the number of layers and of allocation options.

Instances: random layers (log-normal compute and gradient sizes, 100 ms of compute, gradients
sized so the all-reduce at the best solo bandwidth takes as long as the compute, the hardest
regime) and the cost model of the Libra artifact's fitted curves (8 workers; options are total
thread counts). Each cell is the median of ``--repeat`` runs. Prints a markdown table.

A third table plans a sharded-data-parallel backward pass (FSDP beside replicated parameters):
the same layers, the smallest 30% of the gradients all-reduced (norms, biases kept replicated)
and the rest reduce-scattered (a ring's terms: half the steps, half the bytes), so buckets hold
one collective and runs of each alternate.

``--baseline COMMIT`` also times that commit's ``libra_jax/planner.py`` (read with ``git show``,
imported on its own: the planner is pure Python) on the same instances, interleaved run by run
with this tree's, and checks that both return the same buckets.

    python3 benchmarks/planner_speed.py [--repeat 5] [--baseline COMMIT] [--out FILE]
"""
from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from libra_jax import planner
from libra_jax.planner import CollectiveTerms, CostModel, Layer, plan

import report  # noqa: E402  (benchmarks/report.py)

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
                     slowdown={n: 1.0 / (SLOWDOWN_FIT[0] - SLOWDOWN_FIT[1] * n) for n in keys},
                     collectives={"reduce-scatter": CollectiveTerms((workers - 1) * 5e-6, 0.5)})


def mixed(layers: list[Layer]) -> list[Layer]:
    """`layers` with the 30% smallest gradients all-reduced and the others reduce-scattered."""
    cut = float(np.percentile([l.grad_bytes for l in layers], 30))
    return [Layer(l.compute_s, l.grad_bytes,
                  "all-reduce" if l.grad_bytes <= cut else "reduce-scatter") for l in layers]


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


def baseline_planner(commit: str) -> ModuleType:
    """`commit`'s libra_jax/planner.py as its own module."""
    text = subprocess.run(["git", "show", f"{commit}:libra_jax/planner.py"], cwd=report.ROOT,
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "planner_baseline.py"
    path.write_text(text)
    return report.load_file(path, "planner_baseline")


def convert(module: ModuleType, layers: list[Layer], cost: CostModel) -> tuple[list, object]:
    """The same instance in another planner module's types."""
    return ([module.Layer(l.compute_s, l.grad_bytes) for l in layers],
            module.CostModel(latency_s=cost.latency_s, solo_bw=dict(cost.solo_bw),
                             overlap_bw=dict(cost.overlap_bw), slowdown=dict(cost.slowdown)))


def interleaved(fns: list, repeat: int) -> list[list[float]]:
    """Seconds of each of `fns`, run in turn `repeat` times (so load hits them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return times


def spread(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"


def buckets(p) -> list[tuple[int, int, int]]:
    return [(b.first, b.last, b.blocks) for b in p.buckets]


def compare(base: ModuleType, commit: str, repeat: int) -> list[str]:
    """The 1,000 x 8 instances, this tree against `base`, interleaved; plans must match."""
    lines = ["", f"### This tree against `{commit}` (1,000 layers x 8 options; ms, median (min-max) "
                 f"of {repeat} interleaved runs)", "",
             "| communication / compute | fusion | fusion, base | no fusion | no fusion, base | "
             "same plans |", "|---:|---:|---:|---:|---:|---|"]
    cost = libra_cost(8)
    for ratio in (0.25, 0.5, 1.0, 2.0, 4.0):
        layers = random_layers(1000, cost, comm_ratio=ratio)
        b_layers, b_cost = convert(base, layers, cost)
        f, fb, n, nb = interleaved([lambda: plan(layers, cost),
                                    lambda: base.plan(b_layers, b_cost),
                                    lambda: plan(layers, cost, fusion=False),
                                    lambda: base.plan(b_layers, b_cost, fusion=False)], repeat)
        same = (buckets(plan(layers, cost)) == buckets(base.plan(b_layers, b_cost))
                and buckets(plan(layers, cost, fusion=False))
                == buckets(base.plan(b_layers, b_cost, fusion=False)))
        lines.append(f"| {ratio} | {spread(f)} | {spread(fb)} | {spread(n)} | {spread(nb)} | "
                     f"{'yes' if same else 'NO'} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline", default=None, help="a commit whose planner to time alongside")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        load_before = " ".join(f.read().split()[:3])
    lines = report.header(f"; load average before {load_before}") + [
        "", f"### Time of `plan` (ms, median of {args.repeat} runs), balanced "
            "compute/communication", "", "| layers | options | fusion | no fusion |",
        "|---:|---:|---:|---:|"]
    sizes = (10, 50, 100, 200, 500, 1000, 2000)
    for options in (2, 4, 8):
        cost = libra_cost(options)
        for n in sizes:
            layers = random_layers(n, cost)
            with_f = median_time(lambda: plan(layers, cost), args.repeat)
            without = median_time(lambda: plan(layers, cost, fusion=False), args.repeat)
            lines.append(f"| {n} | {options} | {with_f * 1e3:.1f} | {without * 1e3:.1f} |")
    lines += ["", f"### 1,000 layers x 8 options across regimes (ms, median of {args.repeat} "
                  "runs)", "", "| communication / compute | fusion | no fusion | buckets (fusion) |",
              "|---:|---:|---:|---:|"]
    cost = libra_cost(8)
    for ratio in (0.25, 0.5, 1.0, 2.0, 4.0):
        layers = random_layers(1000, cost, comm_ratio=ratio)
        with_f = median_time(lambda: plan(layers, cost), args.repeat)
        without = median_time(lambda: plan(layers, cost, fusion=False), args.repeat)
        lines.append(f"| {ratio} | {with_f * 1e3:.1f} | {without * 1e3:.1f} | "
                     f"{len(plan(layers, cost).buckets)} |")
    lines += ["", f"### 1,000 layers x 8 options, all-reduces and reduce-scatters mixed (ms, median "
                  f"of {args.repeat} runs)", "",
              "| communication / compute | fusion | no fusion | buckets (fusion) | of them reduce-scatters |",
              "|---:|---:|---:|---:|---:|"]
    for ratio in (0.25, 0.5, 1.0, 2.0, 4.0):
        layers = mixed(random_layers(1000, cost, comm_ratio=ratio))
        with_f = median_time(lambda: plan(layers, cost), args.repeat)
        without = median_time(lambda: plan(layers, cost, fusion=False), args.repeat)
        found = plan(layers, cost).buckets
        scatters = sum(layers[b.first].collective.scatters for b in found)
        lines.append(f"| {ratio} | {with_f * 1e3:.1f} | {without * 1e3:.1f} | {len(found)} | "
                     f"{scatters} |")
    if args.baseline:
        lines += compare(baseline_planner(args.baseline), args.baseline, args.repeat)
    with open("/proc/loadavg") as f:
        lines.append(f"\nLoad average after: {' '.join(f.read().split()[:3])}. "
                     f"Planner: {planner.__file__.split('/libra_jax/')[-1]}.")
    report.publish(lines, args.out)


if __name__ == "__main__":
    main()
