"""Where libra's calls run in an optimized step, against where the model puts them (issue 73).

    python benchmarks/call_timeline.py [--example mlp|cnn|transformer|flax] [--blocks K] [--steps 10] [--out FILE]

The model prices a step from one device's timeline (`planner.timeline`): each bucket's
collective starts at its last member's ready point and runs at the overlapped rate of its
block count beside the compute, which it slows (the fair share of the cores). This times the
optimized step with the engine's call records on (`libra_jax._ffi.recording`) and gives, per
planned call, what ran: when its first and its last rank arrived within the step (the arrival
skew: how far apart the devices' threads are when they reach it), how long its reduction ran
once the last rank was in, and the model's timeline of the same call (its start, its end, its
duration, the compute's slowdown while it runs) and its solo time (latency and bytes at the
solo rate of its block count). Medians over `--steps` steps after warm-up. ``--blocks K``
plans every bucket at K blocks (`optimize(blocks=K)`) in place of the plan's own counts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from report import ROOT, header, load_file, publish

common = load_file(ROOT / "examples" / "common.py", "common")  # (8 host devices)

import jax  # noqa: E402

import libra_jax  # noqa: E402
from libra_jax import _ffi, planner  # noqa: E402


def _model_rows(report: libra_jax.OptimizeReport) -> dict[int, tuple[float, float, float, float]]:
    """Per bucket of the planned scopes, by its bytes a rank: the model's start and end of its
    collective (ms from its backward pass's start), the compute's slowdown meanwhile, and its
    solo time (ms: latency and bytes at the solo rate of its blocks)."""
    rows = {}
    for entry in report.predicted:
        cost = entry["cost"]
        line = planner.timeline(entry["layers"], entry["buckets"], cost)
        for _, blocks, nbytes, phases in line.collectives:
            during = [c[4] for c in line.compute if c[0] < phases.end and c[1] > phases.start
                      and c[4] != float("inf")]
            solo = (cost.latency_s + nbytes / cost.solo_bw[blocks]) * 1e3
            rows[int(nbytes)] = (phases.start * 1e3, phases.end * 1e3, max(during, default=1.0),
                                 solo)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="mlp",
                        choices=("mlp", "cnn", "transformer", "flax"))
    parser.add_argument("--blocks", type=int, default=None,
                        help="every bucket at this block count (default: the plan's)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    before = os.getloadavg()
    if a.example == "flax":  # step_prediction's Flax Linen AdamW step, used in no fit
        from step_prediction import flax_adamw

        step, args = flax_adamw()
    else:
        step, args = common.load_example(a.example).build(False)
    optimized = libra_jax.optimize(step, blocks=a.blocks)
    run = jax.jit(optimized, donate_argnums=0)
    state = common.copy_tree(args[0])
    for _ in range(common.WARMUP + 1):
        state, loss = run(state, *args[1:])
        float(loss)
    steps = []
    with _ffi.recording() as records:
        for _ in range(a.steps):
            start = _ffi.now_us()
            state, loss = run(state, *args[1:])
            float(loss)
            steps.append((start, _ffi.now_us()))
    report = optimized.last_report
    calls: dict[tuple, list[dict]] = {}
    for r in records:
        calls.setdefault((r["label"], r["bytes"], r["blocks"]), []).append(r)

    def in_step(us: int) -> float | None:
        for s, e in steps:
            if s <= us <= e:
                return (us - s) / 1e3
        return None

    model = _model_rows(report)
    lines = [*header(f"; {len(jax.devices())} host devices; profile "
                     f"`{libra_jax.model.default_profile('cpu')}`"),
             f"Load average (1/5/15 min) before: {'/'.join(f'{x:.1f}' for x in before)}.",
             f"{a.example}{'' if a.blocks is None else f' at {a.blocks} blocks'}: {a.steps} "
             "optimized steps after warm-up, median step "
             f"{statistics.median((e - s) / 1e3 for s, e in steps):.1f} ms; the model's "
             f"backward pass {sum(x.compute_s for x in report.predicted[0]['layers']) * 1e3:.1f}"
             " ms of compute (one device).", "",
             "| call (bytes a rank, blocks) | first rank in (ms into the step) | last rank in "
             "| reduction ms | model: start-end ms (from the backward's start) | model "
             "duration ms | model compute slowdown | model solo ms |",
             "|---|---|---|---|---|---|---|---|"]
    for (label, nbytes, blocks), rs in sorted(
            calls.items(), key=lambda kv: statistics.median(r["first_arrival_us"] - steps[0][0]
                                                            for r in kv[1])):
        first = [in_step(r["first_arrival_us"]) for r in rs]
        last = [in_step(r["start_us"]) for r in rs]
        reduce_ms = statistics.median((r["end_us"] - r["start_us"]) / 1e3 for r in rs)
        m_start, m_end, slow, solo = model.get(int(nbytes), (float("nan"),) * 4)
        lines.append(
            f"| {label} {nbytes:,} B, {blocks} | "
            f"{statistics.median(x for x in first if x is not None):.1f} | "
            f"{statistics.median(x for x in last if x is not None):.1f} | {reduce_ms:.2f} | "
            f"{m_start:.1f}-{m_end:.1f} | {m_end - m_start:.2f} | {slow:.2f} | {solo:.2f} |")
    publish(lines, a.out)


if __name__ == "__main__":
    main()
