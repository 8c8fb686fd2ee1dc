"""Planning quality: Libra's plan against the fusion policies it competes with, per example.

For each example (`examples/`: mlp, cnn, transformer, the `pmap` transformer, fsdp) on 8 host
CPU devices, five arms side by side in one process, in paired interleaved rounds
(`report.interleaved_steps`: every round runs every arm, in an order that rotates):

- ``plain``: the step as written (`jax.jit`; the FSDP example's is GSPMD's);
- ``per-tensor``: `optimize(step, fusion=False)`, one call per gradient;
- ``25 MiB``: `optimize(step)` with its buckets cut as PyTorch DDP's default does (25 MiB,
  `planner.plan_default`), every bucket at the block count `psum(blocks=None)` gives a
  25 MiB buffer (`lowering.default_blocks`);
- ``one bucket``: `optimize(step)` planned with a call priced at 1 s (every gradient of a
  collective in one bucket, as XLA's combiner makes of the plain step's psums);
- ``libra``: `optimize(step)`, the plan of the model;
- ``libra, start-done``: the same plan with every bucket a start/done pair
  (``overlap="start-done"``): a diagnostic arm, not compared as a competitor, that separates
  the plan's fusion from ``overlap="auto"``'s choice of one call or a pair per bucket.

Each arm's ratio to Libra's plan is taken per round (the same round's step times: paired), its
median over rounds given with a bootstrap 95% confidence interval. The goal (issue "Buckets
without copies"): Libra's plan not worse than the best arm beyond that interval on any example.

    python benchmarks/planning_quality.py [--rounds 12] [--steps 3] [--only NAME] [--out FILE]

Plans are made with `optimize`'s default profile: the shipped `cpu-host`, or a host's own
calibration where ``LIBRA_JAX_PROFILE_DIR`` (or the default profile directory) holds one
(`libra-jax calibrate --out DIR/cpu.json`); the table's header names it.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from end_to_end import CONFIGS, label, one_bucket_profile  # noqa: E402
from report import interleaved_steps, load_file, median_ci  # noqa: E402

common = load_file(ROOT / "examples" / "common.py", "common")  # (8 host devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import libra_jax  # noqa: E402
from libra_jax import collectives, model, planner  # noqa: E402
from libra_jax.ops import lowering  # noqa: E402

#: PyTorch DDP's default bucket size.
DDP_BUCKET_BYTES = 25 * 2**20
ARMS = ("plain", "per-tensor", "25 MiB", "one bucket", "libra", "libra, start-done")
#: Diagnostic arms, not competitors: Libra's plan with every bucket a start/done pair (whether
#: `overlap="auto"`'s choice of one call or a pair is what separates the plan from an arm).
DIAGNOSTIC = ("libra, start-done",)


@contextlib.contextmanager
def ddp_buckets(world: int) -> Iterator[None]:
    """Within the block, `optimize`'s planner cuts buckets as DDP does (`plan_default`)."""
    saved = planner.plan
    blocks = lowering.default_blocks(DDP_BUCKET_BYTES, world, model.default_profile("cpu"),
                                     collectives.REFERENCE)

    def by_size(layers, cost, fusion=True, reach=None):  # type: ignore[no-untyped-def]
        key = min(cost.solo_bw, key=lambda k: abs(k - blocks))
        return planner.plan_default(layers, cost, blocks=key, fusion_bytes=DDP_BUCKET_BYTES)
    planner.plan = by_size
    try:
        yield
    finally:
        planner.plan = saved


def bench(name: str, options: dict, rounds: int, steps: int
          ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Per arm, its per-round step times, and how many gradient calls its plan makes."""
    step, args = common.load_example(name).build(False, **options)
    batch = args[1:]
    optimized = {"per-tensor": libra_jax.optimize(step, fusion=False),
                 "25 MiB": libra_jax.optimize(step),
                 "one bucket": libra_jax.optimize(step, profile=one_bucket_profile()),
                 "libra": libra_jax.optimize(step),
                 "libra, start-done": libra_jax.optimize(step, overlap="start-done")}
    arms = {"plain": jax.jit(common.plain_step(step), donate_argnums=0),
            **{arm: jax.jit(f, donate_argnums=0) for arm, f in optimized.items()}}
    state = {k: common.copy_tree(args[0]) for k in arms}
    with ddp_buckets(8):  # traced (and compiled) now, under the DDP planner
        state["25 MiB"], loss = arms["25 MiB"](state["25 MiB"], *batch)
        float(loss)
    times = interleaved_steps(arms, state, batch, rounds, steps, common.WARMUP)
    calls = {arm: sum(p.kind == "gradient" for p in f.last_report.plans)
             for arm, f in optimized.items()}
    return times, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default=None)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    load_before = os.getloadavg()
    rows, verdicts = [], []
    for name, options in CONFIGS:
        if a.only and a.only != name:
            continue
        times, calls = bench(name, options, a.rounds, a.steps)
        res = {k: np.asarray(v) for k, v in times.items()}
        base, plan = res["plain"], res["libra"]
        for arm in ARMS:
            to_plain = np.median(res[arm] / base)
            mid, lo, hi = median_ci(res[arm] / plan)
            rows.append(f"| {label(name, options)} | {arm} | {calls.get(arm, '')} | "
                        f"{np.median(res[arm]) * 1e3:.1f} | {to_plain:.2f} | "
                        f"{mid:.3f} ({lo:.3f}-{hi:.3f}) |")
            print(rows[-1], flush=True)
        others = [arm for arm in ARMS if arm not in ("libra", "plain", *DIAGNOSTIC)]
        best = min(others, key=lambda arm: np.median(res[arm] / plan))
        mid, lo, hi = median_ci(res[best] / plan)
        worse = hi < 1.0
        verdicts.append(f"- {label(name, options)}: best other arm {best} at {mid:.3f} of the "
                        f"plan's step (95% CI {lo:.3f}-{hi:.3f}): the plan is "
                        + ("**worse beyond the interval**" if worse else "not worse beyond it")
                        + f"; the plan against plain {np.median(plan / base):.2f}.")
        print(verdicts[-1], flush=True)
    load_after = os.getloadavg()
    env = os.environ.get("LIBRA_JAX_PROFILE_DIR")  # a calibrated profile: planned with it
    text = (f"Command: `{f'LIBRA_JAX_PROFILE_DIR={env} ' if env else ''}python "
            f"benchmarks/planning_quality.py {' '.join(sys.argv[1:])}`\n\n"
            f"Date: {datetime.date.today()}; jax {jax.__version__}; Python "
            f"{platform.python_version()}; {os.cpu_count()} CPU cores; 8 host devices; profile "
            f"`{model.default_profile('cpu')}`.\nLoad average (1/5/15 min) before: "
            f"{'/'.join(f'{x:.1f}' for x in load_before)}, after: "
            f"{'/'.join(f'{x:.1f}' for x in load_after)} (the run's own 8 device threads "
            "count in it).\n"
            f"{a.rounds} paired interleaved rounds of {a.steps} steps per arm after "
            f"{common.WARMUP} warm-up steps.\n\n"
            "`gradient calls`: the plan's gradient buckets (each one call or start/done).\n\n"
            "| example | arm | gradient calls | median ms | ratio to plain | "
            "ratio to Libra's plan (95% CI) |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n" + "\n".join(verdicts) + "\n")
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
