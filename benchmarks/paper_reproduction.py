"""Reproduce the Libra paper's evaluation in simulation.

    python3 benchmarks/paper_reproduction.py            # writes results/paper_reproduction.{md,png}

Data-parallel training of VGG16, ResNet152, Xception and BERT-large (exact per-layer gradient
sizes and FLOPs from ``libra_jax.zoo``) on the ``libra-testbed`` profile (the artifact's fits),
under five policies (``libra_jax.planner.POLICIES``):

* default      -- Horovod-NCCL: 2048 threads for every bucket, Horovod 0.20.3's 64 MiB fusion;
* mgwfbp       -- MG-WFBP merging at 2048 threads (the paper's "fusion only" baseline);
* fusion-only  -- the planner's own fusion search at 2048 threads (a stronger fusion baseline);
* libra-alloc  -- Libra's allocation with the default's grouping;
* libra        -- Libra: allocation co-optimised with fusion.

Settings: 8 workers at 50 Gb/s, then 100 Gb/s, then 8 to 128 workers at both speeds, then a batch
sweep (the compute-to-communication ratio). Backward time is the planner's ``simulate``; an
iteration adds forward and optimizer time at full speed (see ``libra_jax.zoo.Workload``).
The markdown is fully generated, including the discussion of gaps, so rerunning it regenerates
every number.

    python3 benchmarks/paper_reproduction.py --fsdp     # writes results/paper_reproduction_fsdp.md

The same comparison for sharded training (FSDP, ZeRO-3), which the paper did not study: the
zoo's models with every weight sharded over the workers (`zoo.fsdp_workload`: gathered before
each op's forward and again before its backward, gradients reduce-scattered) on the GPU profiles
(`h100`, `h200`, `libra-testbed`), 8 to 128 workers, under `planner.FSDP_POLICIES`: XLA's
defaults on NCCL (NCCL's CTAs, each gather issued one ahead, XLA's 30 MiB combiner), fusion only,
and Libra (`planner.compare_fsdp`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from libra_jax import collectives, model, planner, zoo

PROFILE = "libra-testbed"
MODELS = ("vgg16", "resnet152", "xception", "bert-large")
LABELS = {"vgg16": "VGG16", "resnet152": "ResNet152", "xception": "Xception", "bert-large": "BERT-large"}
LINKS_GBPS = (50, 100)
SCALE_WORKERS = (8, 16, 32, 64, 128)
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PAPER = {"vs_default": (10, 20), "vs_fusion": (6, 13), "speedup_at_scale": 1.2}
PAPER_BASELINES = ("default", "mgwfbp")  # the paper's: Horovod-NCCL and fusion-only (MG-WFBP)
ALL_BASELINES = ("default", "mgwfbp", "fusion-only")
COLORS = {"vgg16": "tab:blue", "resnet152": "tab:orange", "xception": "tab:green", "bert-large": "tab:red"}


@dataclass(frozen=True)
class Run:
    model: str
    workers: int
    link_gbps: float
    batch: int
    backward_s: dict[str, float]
    buckets: dict[str, int]
    fixed_s: float  # forward + optimizer
    compute_s: float  # backward compute at full speed
    solo_comm_s: float  # gradient bytes at the default allocation's solo bandwidth, + latency
    plan_s: float

    def reduction(self, policy: str, versus: str) -> float:
        """Percent lower backward time of ``policy`` than ``versus``."""
        return (1 - self.backward_s[policy] / self.backward_s[versus]) * 100

    def best_baseline(self, baselines: tuple[str, ...] = PAPER_BASELINES) -> str:
        return min(baselines, key=self.backward_s.__getitem__)

    def speedup(self, versus: str | None = None, baselines: tuple[str, ...] = PAPER_BASELINES) -> float:
        """Iteration-time speedup of Libra over ``versus`` (default: the best of ``baselines``)."""
        versus = versus or self.best_baseline(baselines)
        return (self.fixed_s + self.backward_s[versus]) / (self.fixed_s + self.backward_s["libra"])


def run_one(args: tuple[str, int, float, int | None]) -> Run:
    name, workers, link, batch = args
    profile = model.load_profile(PROFILE)
    derivation = model.derive(profile, workers, link_gbit_per_s=link)
    w = zoo.training_workload(name, flop_per_s=profile.device.flop_per_s(), bytes_per_s=profile.device.bytes_per_s(),
                              batch=batch)
    alloc = derivation.default_allocation()
    t0 = time.perf_counter()
    comparison = planner.compare_policies(w.layers, derivation.cost, default_alloc=alloc)
    elapsed = time.perf_counter() - t0
    return Run(name, workers, link, w.batch,
               {k: p.backward_s for k, p in comparison.plans.items()},
               {k: len(p.buckets) for k, p in comparison.plans.items()},
               w.forward_s + w.optimizer_s, w.backward_compute_s,
               derivation.cost.latency_s + w.grad_bytes / derivation.cost.solo_bw[alloc], elapsed)


def run_all(jobs: list[tuple[str, int, float, int | None]], processes: int) -> list[Run]:
    if processes <= 1:
        return [run_one(j) for j in jobs]
    with ProcessPoolExecutor(processes) as pool:
        return list(pool.map(run_one, jobs))


def fmt_range(values: list[float], digits: int = 1) -> str:
    return f"{min(values):.{digits}f} to {max(values):.{digits}f}"


def main_table(runs: list[Run]) -> list[str]:
    lines = ["| model | batch | backward compute ms | default comm ms | default | MG-WFBP | fusion-only | "
             "Libra alloc | Libra | vs default | vs MG-WFBP | vs fusion-only | buckets (default / Libra) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        b = r.backward_s
        lines.append(
            f"| {LABELS[r.model]} | {r.batch} | {r.compute_s * 1e3:.1f} | {r.solo_comm_s * 1e3:.1f} | "
            f"{b['default'] * 1e3:.1f} | {b['mgwfbp'] * 1e3:.1f} | {b['fusion-only'] * 1e3:.1f} | "
            f"{b['libra-alloc'] * 1e3:.1f} | {b['libra'] * 1e3:.1f} | {r.reduction('libra', 'default'):.1f}% | "
            f"{r.reduction('libra', 'mgwfbp'):.1f}% | {r.reduction('libra', 'fusion-only'):.1f}% | "
            f"{r.buckets['default']} / {r.buckets['libra']} |")
    return lines


def scale_table(runs: list[Run]) -> list[str]:
    head = "| link | model | " + " | ".join(f"{w} workers" for w in SCALE_WORKERS) + " |"
    lines = [head, "|---|---|" + "---:|" * len(SCALE_WORKERS)]
    for link in LINKS_GBPS:
        for name in MODELS:
            cells = []
            for w in SCALE_WORKERS:
                r = next(x for x in runs if x.model == name and x.workers == w and x.link_gbps == link)
                cells.append(f"{r.speedup():.3f}x / {r.speedup(baselines=ALL_BASELINES):.3f}x / "
                             f"{r.speedup('default'):.3f}x")
            lines.append(f"| {link} Gb/s | {LABELS[name]} | " + " | ".join(cells) + " |")
    return lines


def sweep_table(runs: list[Run]) -> list[str]:
    lines = ["| model | " + " | ".join(f"batch {b}" for b in SWEEP_BATCHES) + " |",
             "|---|" + "---:|" * len(SWEEP_BATCHES)]
    for name in MODELS:
        cells = []
        for b in SWEEP_BATCHES:
            r = next(x for x in runs if x.model == name and x.batch == b)
            cells.append(f"{r.compute_s / r.solo_comm_s:.2f}: {r.reduction('libra', 'default'):.1f}% / "
                         f"{r.reduction('libra', 'mgwfbp'):.1f}%")
        lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    return lines


def plot(main50: list[Run], main100: list[Run], scale: list[Run], sweep: list[Run], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    x = range(len(MODELS))
    width = 0.2
    series = [(main50, "default", "vs default, 50 Gb/s"), (main50, "mgwfbp", "vs MG-WFBP, 50 Gb/s"),
              (main100, "default", "vs default, 100 Gb/s"), (main100, "mgwfbp", "vs MG-WFBP, 100 Gb/s")]
    for i, (runs, versus, label) in enumerate(series):
        ax.bar([j + (i - 1.5) * width for j in x], [r.reduction("libra", versus) for r in runs], width, label=label)
    ax.axhspan(*PAPER["vs_default"], color="gray", alpha=0.15, label="paper: 10-20% vs Horovod-NCCL")
    ax.axhspan(*PAPER["vs_fusion"], color="green", alpha=0.1, label="paper: 6-13% vs fusion only")
    ax.set_xticks(list(x), [LABELS[m] for m in MODELS])
    ax.set_ylabel("Libra's backward time reduction (%)")
    ax.set_title("8 workers, artifact batch sizes")
    ax.legend(fontsize=7)
    ax = axes[1]
    for link, style in zip(LINKS_GBPS, ("-", "--")):
        for name in MODELS:
            rs = [next(r for r in scale if r.model == name and r.workers == w and r.link_gbps == link)
                  for w in SCALE_WORKERS]
            ax.plot(SCALE_WORKERS, [r.speedup() for r in rs], style, marker="o", color=COLORS[name],
                    label=f"{LABELS[name]}, {link} Gb/s")
    ax.axhline(PAPER["speedup_at_scale"], color="gray", linestyle=":", label="paper: 1.2x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("iteration speedup over Horovod-NCCL / MG-WFBP")
    ax.set_title("Scaling (simulation)")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[2]
    for name in MODELS:
        rs = [next(r for r in sweep if r.model == name and r.batch == b) for b in SWEEP_BATCHES]
        ax.plot([r.compute_s / r.solo_comm_s for r in rs], [r.reduction("libra", "default") for r in rs],
                marker="o", color=COLORS[name], label=LABELS[name])
    ax.axhspan(*PAPER["vs_default"], color="gray", alpha=0.15)
    ax.set_xscale("log")
    ax.set_xlabel("backward compute / default all-reduce time (batch 1..64)")
    ax.set_ylabel("reduction vs default (%)")
    ax.set_title("Batch sweep, 8 workers, 50 Gb/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def exact_check(name: str = "bert-large") -> tuple[float, float, float]:
    """Libra's backward time with and without pre-fusion, and the exact planner's runtime (8 workers, 50 Gb/s)."""
    from libra_jax import planner

    profile = model.load_profile(PROFILE)
    cost = model.derive(profile, 8, link_gbit_per_s=50).cost
    w = zoo.training_workload(name, flop_per_s=profile.device.flop_per_s(), bytes_per_s=profile.device.bytes_per_s())
    alloc = model.derive(profile, 8, link_gbit_per_s=50).default_allocation()
    coarse = planner.compare_policies(w.layers, cost, default_alloc=alloc).backward_s("libra")
    t0 = time.perf_counter()
    exact = planner.plan(list(w.layers), cost, fusion=True).backward_s
    return coarse, exact, time.perf_counter() - t0


def discussion(main50: list[Run], main100: list[Run], scale: list[Run], sweep: list[Run],
               check: tuple[float, float, float]) -> list[str]:
    vs_default = [r.reduction("libra", "default") for r in main50]
    vs_mg = [r.reduction("libra", "mgwfbp") for r in main50]
    vs_fo = [r.reduction("libra", "fusion-only") for r in main50]
    balanced = [r for r in sweep if 0.5 <= r.compute_s / r.solo_comm_s <= 2.0]
    bal_default = [r.reduction("libra", "default") for r in balanced]
    bal_mg = [r.reduction("libra", "mgwfbp") for r in balanced]
    at_max = [r for r in scale if r.workers == max(SCALE_WORKERS)]
    best_scale = max(scale, key=lambda r: r.speedup())
    best_vs_default = max(scale, key=lambda r: r.speedup("default"))
    bert = next(r for r in main50 if r.model == "bert-large")
    vgg = next(r for r in main50 if r.model == "vgg16")
    alloc_share = [r.reduction("libra-alloc", "default") / max(r.reduction("libra", "default"), 1e-9) * 100
                   for r in main50 if r.reduction("libra", "default") > 1]
    iteration_share = [r.compute_s / (r.fixed_s + r.backward_s["libra"]) * 100 for r in main50]
    faster = []
    for r50, r100 in zip(main50, main100):
        faster.append(f"{LABELS[r50.model]} {r50.compute_s / r50.solo_comm_s:.2f} -> "
                      f"{r100.compute_s / r100.solo_comm_s:.2f} ({r50.reduction('libra', 'default'):.1f}% -> "
                      f"{r100.reduction('libra', 'default'):.1f}%)")
    coarse, exact, exact_s = check
    return [
        "## Headline numbers vs the paper",
        "",
        f"* Backward time vs Horovod-NCCL (8 workers, 50 Gb/s, artifact batches): Libra is "
        f"{fmt_range(vs_default)}% lower (paper: 10-20%).",
        f"* vs fusion only: {fmt_range(vs_mg)}% lower than MG-WFBP (the paper's fusion-only baseline) and "
        f"{fmt_range(vs_fo)}% lower than the planner's own fusion search at the default allocation "
        "(paper: 6-13%).",
        f"* At 100 Gb/s: {fmt_range([r.reduction('libra', 'default') for r in main100])}% vs default, "
        f"{fmt_range([r.reduction('libra', 'mgwfbp') for r in main100])}% vs MG-WFBP.",
        f"* Iteration speedup over the better of Horovod-NCCL and MG-WFBP at {max(SCALE_WORKERS)} workers: "
        f"{fmt_range([r.speedup() for r in at_max], 3)}x; the largest in the scaling sweep is "
        f"{best_scale.speedup():.3f}x ({LABELS[best_scale.model]}, {best_scale.workers} workers, "
        f"{best_scale.link_gbps:g} Gb/s); over Horovod-NCCL alone up to {best_vs_default.speedup('default'):.3f}x "
        f"({LABELS[best_vs_default.model]}, {best_vs_default.workers} workers, {best_vs_default.link_gbps:g} Gb/s) "
        "(paper: 1.2x over the best baseline).",
        f"* Where backward compute and the default all-reduce are within 2x of each other (batch sweep), Libra is "
        f"{fmt_range(bal_default)}% below default and {fmt_range(bal_mg)}% below MG-WFBP: the paper's ranges.",
        "",
        "## Why the numbers differ from the paper's",
        "",
        "1. **The compute-to-communication ratio is ours, not the testbed's.** The paper does not give per-model "
        "compute times, its GPU, or its batch sizes. We take the artifact simulator's batches (VGG16 32, ResNet152 8, "
        "Xception 8, BERT 2), compute time from FLOPs at an assumed 30% of an RTX 3090's 35.6 TFLOP/s "
        "(the artifact's hard-coded 1695 MHz clock is an RTX 3090/A10 boost clock), and fp32 gradients. "
        f"With these, BERT-large at batch 2 needs {bert.compute_s * 1e3:.0f} ms of backward compute but "
        f"{bert.solo_comm_s * 1e3:.0f} ms of all-reduce: compute is over long before the all-reduce, and the only "
        "lever left is the solo bandwidth, which 2048 threads already nearly saturate (7.05 vs 7.10 MiB/ms at "
        f"4096). Hence only {bert.reduction('libra', 'default'):.1f}% for BERT. Contention-aware allocation pays "
        "when compute and communication overlap for long: the batch sweep (table and third panel) shows the "
        "reduction peaking where the two are comparable and shrinking at both extremes (communication-bound: "
        "nothing to overlap; compute-bound: the all-reduce hides anyway).",
        "2. **The contention curves come from one 2-GPU fit.** The artifact fitted several parameter sets (VGG16, "
        "Xception, BERT-large, ResNet152); we use the VGG16 'fixed' set for every model, as the issue specifies. "
        "Per-model curves would move the optimal allocations and the size of the gains.",
        "3. **'Horovod-NCCL' is modelled, not run.** The default policy is one fixed allocation (2048 threads, the "
        "artifact's choice) with Horovod's 64 MiB byte-threshold fusion; it ignores Horovod's 5 ms cycle time, "
        "NCCL's own per-size channel choice and framework overheads that a testbed measurement includes.",
        "4. **Fusion-only baselines.** The paper's exact fusion-only baselines are not stored; MG-WFBP is the "
        "artifact's. We also report the planner's own fusion search at a fixed allocation: it is stronger than "
        "MG-WFBP, so the gain over it isolates allocation. Libra's allocation with the default's grouping "
        f"already gives {fmt_range(alloc_share)}% of the co-optimised gain (where that gain exceeds 1%).",
        "5. **'1.2x at scale'.** Scale is simulated with the artifact's rule: more workers change only the ring's "
        "2(n-1)/n traffic (which saturates near 2) and the (2n-2) x 5 us latency; the contention curves stay the "
        "2-GPU ones, so the gains barely move from 8 to 128 workers, except where latency grows with the "
        "number of buckets (BERT's 25 default buckets). An iteration also contains the forward pass and the "
        "optimizer, which Libra does not shorten: backward compute is only "
        f"{fmt_range(iteration_share)}% of our iterations, so a 10-14% shorter backward pass gives well under "
        "1.2x. The paper's scale, models and iteration breakdown for that figure are not stored; a 1.2x "
        "iteration speedup means saving 17% of the baseline's whole iteration in the backward pass alone.",
        "6. **Faster networks.** At 100 Gb/s the artifact's rule doubles the thread options; 8192 threads is past "
        "the slowdown fit's pole (T = 5457) and dropped, and the default's 2048 threads now sit at the fit's "
        "1024-thread bandwidth. Communication halves, which moves each model's compute/comm ratio "
        f"(and Libra's gain vs default): {'; '.join(faster)}. Models pushed past the balanced point gain less; "
        "those pushed toward it gain more, and so do communication-bound ones, because the default's 2048 "
        "threads no longer come close to saturating the faster link.",
        f"7. **Planning granularity.** Like the artifact (40 pre-fused groups), the fusion-searching policies plan "
        f"over at most {planner.DEFAULT_PREFUSE} pre-fused layer groups, then are evaluated on the exact layers. "
        f"For BERT-large (8 workers, 50 Gb/s) planning all {len(zoo.training_workload('bert-large', flop_per_s=1e12, bytes_per_s=1e12).layers)} "
        f"layers gives {exact * 1e3:.2f} ms vs {coarse * 1e3:.2f} ms pre-fused ({(coarse / exact - 1) * 100:.2f}% apart; "
        f"the exact plan took {exact_s:.2f} s). Planning every layer is now fast too (under a second for "
        "ResNet152's 311 layers: `libra-jax simulate --prefuse 0`); the sweep keeps the artifact's pre-fusion "
        "so that its numbers compare with the artifact's.",
        f"8. **Fidelity of the zoo.** Gradient sizes are exact (parameter counts match the published ones); compute "
        f"is a roofline of FLOPs and activation bytes, not a measured profile, so per-layer times (e.g. VGG16's "
        f"{vgg.compute_s * 1e3:.0f} ms backward at batch 32) are estimates.",
    ]


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


FSDP_PROFILES = ("h100", "h200", "libra-testbed")


@dataclass(frozen=True)
class FsdpRun:
    profile: str
    model: str
    workers: int
    batch: int
    iteration_s: dict[str, float]
    ahead: tuple[int, int]  # Libra's gathers: distance ahead, forward and backward
    buckets: dict[str, int]  # reduce-scatter buckets
    compute_s: float  # forward + backward at full speed
    comm_s: float  # every collective alone, one at a time, at the default allocation

    def speedup(self) -> float:
        """Libra's iteration speedup over the better baseline."""
        return min(self.iteration_s["default"], self.iteration_s["fusion-only"]) / self.iteration_s["libra"]


def run_fsdp(args: tuple[str, str, int]) -> FsdpRun:
    profile_name, name, workers = args
    profile = model.load_profile(profile_name)
    derivation = model.derive(profile, workers)
    w = zoo.fsdp_workload(name, flop_per_s=profile.device.flop_per_s(), bytes_per_s=profile.device.bytes_per_s(),
                          workers=workers)
    alloc = derivation.default_allocation()
    plans = planner.compare_fsdp(w.step, derivation.cost, default_alloc=alloc)
    cost = derivation.cost

    def alone(kind: str, nbytes: int) -> float:
        terms = cost.terms(collectives.BY_KIND[kind])
        return terms.latency_s + nbytes * terms.traffic / cost.solo_bw[alloc]
    comm = (sum(alone("all-gather", g.nbytes) for g in (*w.step.forward, *w.step.backward))
            + sum(alone("reduce-scatter", layer.grad_bytes) for layer in w.step.layers))
    return FsdpRun(profile_name, name, workers, w.batch,
                   {k: p.forward_s + p.backward_s + w.optimizer_s for k, p in plans.items()},
                   (plans["libra"].forward.distance, plans["libra"].backward.distance),
                   {k: len(p.buckets) for k, p in plans.items()}, w.compute_s, comm)


def fsdp_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The FSDP comparison (module docstring), written to results/paper_reproduction_fsdp.md."""
    started = time.perf_counter()
    jobs = [(p, m, w) for p in FSDP_PROFILES for m in MODELS for w in SCALE_WORKERS]
    if args.processes <= 1:
        runs = [run_fsdp(j) for j in jobs]
    else:
        with ProcessPoolExecutor(args.processes) as pool:
            runs = list(pool.map(run_fsdp, jobs))
    elapsed = time.perf_counter() - started
    command = " ".join(["python3", "benchmarks/paper_reproduction.py", *(argv if argv is not None else sys.argv[1:])])
    by = {(r.profile, r.model, r.workers): r for r in runs}
    md = [
        "# Libra for FSDP, in simulation",
        "",
        f"Command: `{command}` (from the repository root)  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}  ",
        f"Machine: {machine_description()}  ",
        f"Runtime: {elapsed:.0f} s for {len(runs)} settings x 3 policies ({args.processes} processes)",
        "",
        "Every weight of the zoo's models sharded over the workers (ZeRO-3): gathered before its op's "
        "forward and again before its backward (no activations recomputed), its gradient "
        "reduce-scattered; the optimizer updates the rank's shard. Iteration = forward pass with its "
        "gathers + backward pass with its re-gathers and reduce-scatters + optimizer "
        "(`libra_jax.planner.compare_fsdp`). Policies: **default**, XLA's defaults on NCCL (NCCL's CTAs, "
        "the profile's fixed allocation; each gather issued one ahead, as XLA's latency-hiding "
        "scheduler does; reduce-scatters combined up to 30 MiB, XLA's `ReduceScatterCombiner` "
        "threshold); **fusion only**, the planner's grouping of the reduce-scatters at the fixed "
        "allocation; **Libra**, each pass's gathers planned (how far ahead, at which allocation, "
        "within 1 GiB held ahead) and the reduce-scatters' allocation co-optimised with fusion.",
        "",
    ]
    for profile_name in FSDP_PROFILES:
        md += [f"## `{profile_name}`, 8 workers", "",
               "| model | batch | compute ms | collectives alone ms | compute / comm | default ms | "
               "fusion only ms | Libra ms | Libra speedup | gathers ahead fwd / bwd | RS buckets (default / Libra) |",
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name in MODELS:
            r = by[(profile_name, name, 8)]
            t = r.iteration_s
            md.append(f"| {LABELS[name]} | {r.batch} | {r.compute_s * 1e3:.1f} | {r.comm_s * 1e3:.1f} | "
                      f"{r.compute_s / r.comm_s:.2f} | {t['default'] * 1e3:.1f} | {t['fusion-only'] * 1e3:.1f} | "
                      f"{t['libra'] * 1e3:.1f} | {r.speedup():.3f}x | {r.ahead[0]} / {r.ahead[1]} | "
                      f"{r.buckets['default']} / {r.buckets['libra']} |")
        md.append("")
    md += ["## Scaling: Libra's iteration speedup over the better baseline (compute / comm)", "",
           "| profile | model | " + " | ".join(f"{w} workers" for w in SCALE_WORKERS) + " |",
           "|---|---|" + "---:|" * len(SCALE_WORKERS)]
    for profile_name in FSDP_PROFILES:
        for name in MODELS:
            cells = [f"{by[(profile_name, name, w)].speedup():.3f}x "
                     f"({by[(profile_name, name, w)].compute_s / by[(profile_name, name, w)].comm_s:.2f})"
                     for w in SCALE_WORKERS]
            md.append(f"| `{profile_name}` | {LABELS[name]} | " + " | ".join(cells) + " |")
    speedups = [r.speedup() for r in runs]
    best = max(runs, key=FsdpRun.speedup)
    md += ["", "## Reading", "",
           f"- Libra's speedup over the better baseline spans {min(speedups):.3f}x to {max(speedups):.3f}x "
           f"over the {len(runs)} settings (largest: {LABELS[best.model]} on `{best.profile}` at "
           f"{best.workers} workers, compute / comm {best.compute_s / best.comm_s:.2f}). It is never below "
           "1 by construction: Libra's plans include the baselines' (one ahead at the fixed allocation, "
           "and the baselines' re-gathers where those leave the shorter backward pass).",
           *fsdp_reading(runs),
           "- Where the gains are: where compute and communication take comparable time (compute / comm "
           "of about 0.3 to 2: the testbed's 50 Gb/s ring under its (assumed) RTX 3090-class compute, VGG16 within one "
           "H100/H200 node), allocation and prefetch move time off the critical path, as the paper found "
           "for the all-reduce. Where the collectives dominate (BERT-large at batch 2, every model past one "
           "node on `h100`/`h200`: compute / comm below 0.3) the step is the collectives' time and the "
           "gain shrinks to a few percent; at 128 workers ResNet152's 155 per-layer gathers and "
           "reduce-scatters are latency, which allocation cannot buy back.",
           "",
           "## What is assumed",
           "",
           "- **The contention curves were fitted for the all-reduce** (the artifact's, and the profiles' "
           "measured or derived ones); the model takes the same compute slowdown per allocation for an "
           "in-flight all-gather or reduce-scatter, and their bytes at the ring bus fractions "
           "(`libra_jax.model.COLLECTIVE_SHAPES`: each moves half an all-reduce's bytes per byte). What "
           "carries over: NCCL's ring all-reduce is a reduce-scatter followed by an all-gather on the same "
           "channels, so CTAs and memory traffic per byte are alike. What may not: the all-gather reduces "
           "nothing (a copy), so its slowdown per CTA may be lower than the curve says.",
           "- **A gather and a reduce-scatter in flight together do not slow each other** "
           "(`planner.regathered_layers`: the backward pass's re-gathers, then its reduce-scatters on the "
           "compute they leave); on one communicator they would share the link, so the backward times here "
           "are optimistic for every policy alike.",
           "- **One gather per parameterised op**, not per FSDP unit (PyTorch's FSDP and MaxText gather a "
           "block's weights at once); no activation recomputation; fp32 weights and gradients; the "
           "optimizer (SGD with momentum) on the rank's shard. The baselines issue each gather one ahead "
           "(XLA's latency-hiding scheduler) and do not combine gathers.",
           "- **What a GPU run would have to measure** is listed at the top of `benchmarks/gpu_check.sh`: "
           "the reduce-scatter's and all-gather's time vs CTAs across ranks, a GEMM's slowdown beside each, "
           "and whether the two share the link. None has run: no GPU has been lent.",
           ""]
    (args.out_dir / "paper_reproduction_fsdp.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


def fsdp_reading(runs: list[FsdpRun]) -> list[str]:
    """The generated part of the reading: where the gains are, against compute / comm."""
    out = []
    for profile_name in FSDP_PROFILES:
        mine = [r for r in runs if r.profile == profile_name]
        top = max(mine, key=FsdpRun.speedup)
        low = min(mine, key=FsdpRun.speedup)
        out.append(f"- `{profile_name}`: {min(r.speedup() for r in mine):.3f}x to "
                   f"{max(r.speedup() for r in mine):.3f}x; the most at {LABELS[top.model]}, "
                   f"{top.workers} workers (compute / comm {top.compute_s / top.comm_s:.2f}), the least at "
                   f"{LABELS[low.model]}, {low.workers} workers ({low.compute_s / low.comm_s:.2f}).")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--processes", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--fsdp", action="store_true",
                        help="the FSDP comparison instead (results/paper_reproduction_fsdp.md)")
    args = parser.parse_args(argv)
    if args.fsdp:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        return fsdp_main(args, argv)
    started = time.perf_counter()

    main_jobs = [(m, 8, link, None) for link in LINKS_GBPS for m in MODELS]
    scale_jobs = [(m, w, link, None) for link in LINKS_GBPS for m in MODELS for w in SCALE_WORKERS if w != 8]
    sweep_jobs = [(m, 8, 50, b) for m in MODELS for b in SWEEP_BATCHES if b != zoo.DEFAULT_BATCH[m]]
    runs = run_all(main_jobs + scale_jobs + sweep_jobs, args.processes)
    main_runs = runs[:len(main_jobs)]
    main50 = [r for r in main_runs if r.link_gbps == 50]
    main100 = [r for r in main_runs if r.link_gbps == 100]
    scale = main_runs + [r for r in runs if r.workers != 8]
    sweep = main50 + runs[len(main_jobs) + len(scale_jobs):]
    elapsed = time.perf_counter() - started

    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / "paper_reproduction.png"
    plotted = plot(main50, main100, scale, sweep, png)
    dropped100 = model.derive(PROFILE, 8, link_gbit_per_s=100).dropped
    profile = model.load_profile(PROFILE)
    command = " ".join(["python3", "benchmarks/paper_reproduction.py", *(argv if argv is not None else sys.argv[1:])])
    md = [
        "# Libra paper reproduction (simulation)",
        "",
        f"Command: `{command}` (from the repository root)  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}  ",
        f"Machine: {machine_description()}  ",
        f"Runtime: {elapsed:.0f} s for {len(runs)} settings x 5 policies ({args.processes} processes)",
        "",
        f"Profile `{PROFILE}` (the artifact's fits; 2048 threads for the baselines; Horovod 64 MiB fusion). "
        "Times are simulated backward passes (`libra_jax.planner.simulate`); 'default comm' is the whole gradient "
        "at the default allocation's solo bandwidth plus latency. Reductions are Libra's (co-optimised) backward "
        "time below each baseline.",
        "",
        "Assumptions (all stated in `libra_jax/profiles/libra-testbed.json` and `libra_jax/zoo.py`): compute "
        f"{profile.device.flop_per_s() / 1e12:.1f} TFLOP/s and memory {profile.device.bytes_per_s() / 1e9:.0f} GB/s "
        "sustained (roofline per op); per-worker batches from the artifact's simulator "
        f"({', '.join(f'{LABELS[m]} {zoo.DEFAULT_BATCH[m]}' for m in MODELS)}); BERT sequence length "
        f"{zoo.DEFAULT_BERT_SEQ_LEN}; fp32 gradients; forward pass at full speed; optimizer = SGD with momentum, "
        f"{zoo.OPTIMIZER_BYTES_PER_PARAM} bytes of memory traffic per parameter.",
        "",
        "## 8 workers, 50 Gb/s",
        "",
        *main_table(main50),
        "",
        "## 8 workers, 100 Gb/s",
        "",
        "Options are 128..8192 threads; dropped: "
        + "; ".join(f"{k}: {why}" for k, why in dropped100.items()) + ".",
        "",
        *main_table(main100),
        "",
        "## Scaling: iteration speedup of Libra",
        "",
        "Each cell: over the better of Horovod-NCCL and MG-WFBP (the paper's baselines) / over the best "
        "baseline including the planner's fusion-only / over Horovod-NCCL.",
        "",
        "Iteration = forward + backward + optimizer (forward and optimizer at full speed, batch as above).",
        "",
        *scale_table(scale),
        "",
        "## Batch sweep (8 workers, 50 Gb/s): compute/comm ratio: reduction vs default / vs MG-WFBP",
        "",
        *sweep_table(sweep),
        "",
        *discussion(main50, main100, scale, sweep, exact_check()),
        "",
        "![plot](paper_reproduction.png)" if plotted else "(plot skipped: matplotlib is not installed)",
        "",
    ]
    (args.out_dir / "paper_reproduction.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
