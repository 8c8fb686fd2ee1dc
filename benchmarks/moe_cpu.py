"""jax.lax.all_to_all vs libra_jax.all_to_all on 8 host CPU devices, and an expert-parallel
train step plain vs optimized (a measurement).

First table: one all-to-all of a buffer per device (along its first dimension, tiled),
XLA's and libra's at default blocks, and libra's all-reduce (``libra_jax.psum``) of the same
buffer, the model's unit: the ratio libra all-to-all / libra psum per repetition is the
fair-share form's ``all_to_all_traffic`` (`libra_jax.model.collective_traffic`; without it
the model takes the ratio of the memory each moves, 1.0). Every variant runs once per
repetition in a shuffled order, after warm-up, from one process; the table gives each
variant's median time per call and interquartile range, and the ratios' medians with their
10th-90th percentiles.

Second table: a mixture-of-experts layer, one expert per device (tests/corpus.py's
`moe_step`, larger): tokens dispatched by an all-to-all and combined by another, forward and
backward, a replicated router's gradient all-reduced. Plain (XLA's collectives) against
``jax.jit(libra_jax.optimize(step))``, interleaved rounds (`report.interleaved_steps`).

    python benchmarks/moe_cpu.py [--reps 15] [--sizes 256KiB,4MiB,32MiB] [--rounds 12] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import random
import time

from libra_jax.config import xla_flags

os.environ["XLA_FLAGS"] = xla_flags(8)  # the caller's flags kept

import jax
import numpy as np
import report
from allreduce_cpu import parse_size
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import libra_jax

DEVICES = 8


def collective_programs(mesh):
    """variant -> jitted fn of its operand."""
    bodies = {"XLA all_to_all": lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True),
              "libra all_to_all": lambda v: libra_jax.all_to_all(v, "x", 0, 0, tiled=True),
              "libra psum": lambda v: libra_jax.psum(v, "x")}
    return {name: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            for name, body in bodies.items()}


def time_collectives(sizes, reps):
    mesh = jax.make_mesh((DEVICES,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    fns = collective_programs(mesh)
    rows = []
    for nbytes in sizes:
        per = nbytes // 4
        x = jax.device_put(np.random.default_rng(0).standard_normal(
            (DEVICES * per,)).astype(np.float32), NamedSharding(mesh, P("x")))
        for f in fns.values():
            for _ in range(3):
                f(x).block_until_ready()
        times = {k: [] for k in fns}
        order = list(fns)
        for _ in range(reps):
            random.shuffle(order)
            for k in order:
                t = time.perf_counter()
                fns[k](x).block_until_ready()
                times[k].append(time.perf_counter() - t)
        rows.append((nbytes, times))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sizes", default="256KiB,4MiB,32MiB")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    load = os.getloadavg()
    lines = report.header(f"; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}") + [""]
    lines += [f"### One all-to-all per device buffer (8 devices; ms per call, median (IQR) of "
              f"{args.reps} shuffled repetitions)", "",
              "| buffer | XLA all_to_all | libra all_to_all | libra / XLA (p10-p90) | "
              "libra all_to_all / libra psum (p10-p90) |", "|---|---|---|---|---|"]
    for nbytes, t in time_collectives(sizes, args.reps):
        def cell(v):
            q1, q3 = np.percentile(v, [25, 75]) * 1e3
            return f"{np.median(v) * 1e3:.3f} ({q1:.3f}-{q3:.3f})"
        vs_xla = np.array(t["libra all_to_all"]) / np.array(t["XLA all_to_all"])
        vs_psum = np.array(t["libra all_to_all"]) / np.array(t["libra psum"])
        lines.append(f"| {nbytes / 2**20:g} MiB | {cell(t['XLA all_to_all'])} | "
                     f"{cell(t['libra all_to_all'])} | {np.median(vs_xla):.2f} "
                     f"({report.spread(vs_xla)}) | {np.median(vs_psum):.2f} "
                     f"({report.spread(vs_psum)}) |")
    corpus = report.load_file(report.ROOT / "tests" / "corpus.py", "libra_corpus")
    step, params, x = corpus.moe_step(args.tokens, args.width)
    arms = {"plain": jax.jit(step),
            "optimized": jax.jit(libra_jax.optimize(step))}
    per_step = report.interleaved_steps(arms, {k: params for k in arms}, (x,), args.rounds,
                                        args.steps, warmup=2)
    ratio = np.array(per_step["optimized"]) / np.array(per_step["plain"])
    lines += ["", f"### Expert-parallel step ({args.tokens} tokens x {args.width} per device; "
              f"ms per step, median (p10-p90) of {args.rounds} interleaved rounds of "
              f"{args.steps} steps)", "", "| plain | optimized | optimized / plain (p10-p90) |",
              "|---|---|---|",
              f"| {np.median(per_step['plain']) * 1e3:.2f} "
              f"({report.spread(per_step['plain'], scale=1e3)}) | "
              f"{np.median(per_step['optimized']) * 1e3:.2f} "
              f"({report.spread(per_step['optimized'], scale=1e3)}) | {np.median(ratio):.3f} "
              f"({report.spread(ratio, digits=3)}) |"]
    report.publish(lines, args.out)


if __name__ == "__main__":
    main()
