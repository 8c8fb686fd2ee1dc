"""jax.lax.psum_scatter / all_gather vs libra_jax's on 8 host CPU devices (a measurement).

The sibling of `allreduce_cpu.py` for sharded data parallelism's pair. Sizes are the full
(unsharded) buffer per device: a reduce-scatter takes that buffer on every device and leaves
1/8 of its sum on each; an all-gather takes 1/8 on each and leaves the whole on every device.
All four variants (XLA's and libra's at default blocks, of both collectives) run once per
repetition in a shuffled order, after warm-up, from one process; the table gives each
variant's median time per call, its interquartile range, and libra's ratio to XLA's: the
median of the per-repetition ratios with their 10th-90th percentiles. Floors beside them,
measured in the same run with numpy (one thread): the 9 x size bytes either collective reads
and writes, at numpy's add bandwidth (`floors`).

A second table is the model's input (`libra_jax.model`, the fair-share form's
``reduce_scatter_traffic`` / ``all_gather_traffic``): libra's reduce-scatter and all-gather
against libra's all-reduce (``libra_jax.psum``) of the same full buffer, at the same block
count (``--blocks``; default: each call's own default), as per-repetition ratios.

    python benchmarks/sharded_cpu.py [--reps 15] [--sizes 1MiB,16MiB,64MiB] [--blocks N] [--out FILE]
"""
from __future__ import annotations

import argparse
import functools
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

#: variant -> (collective, whose)
VARIANTS = {"XLA psum_scatter": ("psum_scatter", "xla"),
            "libra psum_scatter": ("psum_scatter", "libra"),
            "XLA all_gather": ("all_gather", "xla"),
            "libra all_gather": ("all_gather", "libra"),
            "libra psum": ("psum", "libra")}  # the full buffer all-reduced: the model's unit


def programs(mesh, blocks: int | None = None):
    """variant -> jitted fn of its operand (tiled, along the first dimension); libra's at
    `blocks`."""
    ops = {"xla": {"psum_scatter": jax.lax.psum_scatter, "all_gather": jax.lax.all_gather},
           "libra": {"psum_scatter": functools.partial(libra_jax.psum_scatter, blocks=blocks),
                     "all_gather": functools.partial(libra_jax.all_gather, blocks=blocks),
                     "psum": functools.partial(libra_jax.psum, blocks=blocks)}}
    out = {}
    for name, (collective, whose) in VARIANTS.items():
        f = ops[whose][collective]
        body = ((lambda v, f=f: f(v, "x")) if collective == "psum"
                else (lambda v, f=f: f(v, "x", tiled=True)))
        out[name] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                          check_vma=False))
    return out


def floors(size: int, reps: int) -> dict[str, float]:
    """The memory-traffic floor, in seconds, for `size` bytes (the full buffer) per device over
    8 devices: either collective reads and writes 9 x `size` in all (a reduce-scatter reads 8
    full inputs and writes 8 shards; an all-gather reads 8 shards and writes 8 full outputs),
    taken at numpy's one-thread ``np.add`` stream bandwidth (its reads and write counted
    alike), measured now. Page faults of fresh outputs are not in it."""
    n = max(size // 4, 8)
    a, b, c = (np.ones(n, np.float32) for _ in range(3))
    adds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.add(a, b, out=c)
        adds.append(time.perf_counter() - t0)
    bandwidth = 3 * 4 * n / float(np.median(adds))
    floor = 9 * size / bandwidth
    return {"bandwidth": bandwidth, "psum_scatter": floor, "all_gather": floor}


def measure(size: int, reps: int, warmup: int = 2, blocks: int | None = None
            ) -> dict[str, list[float]]:
    """Seconds per call of each variant over `reps` interleaved rounds (float32)."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = NamedSharding(mesh, P("x"))
    n = size // 4
    rng = np.random.default_rng(0)
    operands = {"psum_scatter": jax.device_put(
                    rng.standard_normal((8 * n,)).astype(np.float32), sharding),
                "all_gather": jax.device_put(
                    rng.standard_normal((n,)).astype(np.float32), sharding)}
    operands["psum"] = operands["psum_scatter"]
    fns = programs(mesh, blocks)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(warmup + reps):
        order = list(fns)
        random.Random(rep).shuffle(order)
        results = {}
        for name in order:
            collective = VARIANTS[name][0]
            x = operands[collective]
            t0 = time.perf_counter()
            out = fns[name](x)
            out.block_until_ready()
            elapsed = time.perf_counter() - t0
            if rep == 0:
                results[name] = np.asarray(out)
            if rep >= warmup:
                times[name].append(elapsed)
            del out
        if rep == 0:  # libra's bits are XLA's
            for collective in ("psum_scatter", "all_gather"):
                assert results[f"libra {collective}"].tobytes() == \
                    results[f"XLA {collective}"].tobytes(), collective
    return times


def rows(label: str, times: dict[str, list[float]], floor: dict[str, float]) -> list[str]:
    out = []
    for collective in ("psum_scatter", "all_gather"):
        base = np.array(times[f"XLA {collective}"])
        for whose in ("XLA", "libra"):
            ts = np.array(times[f"{whose} {collective}"])
            q1, q3 = np.percentile(ts * 1e3, [25, 75])
            r10, r50, r90 = np.percentile(ts / base, [10, 50, 90])
            out.append(f"| {label} | {collective} | {whose} | {np.median(ts) * 1e3:.3f} | "
                       f"{q1:.3f}-{q3:.3f} | {r50:.2f} | {r10:.2f}-{r90:.2f} | "
                       f"{floor[collective] * 1e3:.3f} | "
                       f"{np.median(ts) / floor[collective]:.2f} |")
    return out


def traffic_rows(label: str, times: dict[str, list[float]]) -> list[str]:
    """libra's reduce-scatter and all-gather over libra's all-reduce of the same full buffer:
    median and 10th-90th percentiles of the per-repetition ratios."""
    base = np.array(times["libra psum"])
    out = []
    for collective in ("psum_scatter", "all_gather"):
        r10, r50, r90 = np.percentile(np.array(times[f"libra {collective}"]) / base, [10, 50, 90])
        out.append(f"| {label} | {collective} | {np.median(base) * 1e3:.3f} | {r50:.2f} | "
                   f"{r10:.2f}-{r90:.2f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sizes", default="1MiB,16MiB,64MiB")
    parser.add_argument("--blocks", type=int, default=None,
                        help="libra's block count (default: each call's default_blocks)")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args()
    lines = report.header(f"; 8 host devices (XLA_FLAGS={os.environ['XLA_FLAGS']}).") + [
        f"{args.reps} interleaved repetitions after 2 warm-ups; float32, tiled along the first "
        "dimension; sizes are the full (unsharded) buffer per device; times per call in ms; "
        + ("libra at default blocks (`default_blocks`: the model's choice for the collective)."
         if args.blocks is None else f"libra at {args.blocks} blocks."),
        "",
        "| full buffer per device | collective | whose | median ms | IQR ms | ratio to XLA | "
        "ratio p10-p90 | floor ms | median / floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    traffic = ["", "libra's collectives against libra's all-reduce of the same full buffer (the "
               "model's `traffic`: ratios per repetition, median and p10-p90):", "",
               "| full buffer per device | collective | libra psum median ms | ratio to libra psum "
               "| ratio p10-p90 |", "|---|---|---|---|---|"]
    for label in args.sizes.split(","):
        size = parse_size(label)
        times = measure(size, args.reps, blocks=args.blocks)
        table = rows(label, times, floors(size, args.reps))
        lines += table
        traffic += traffic_rows(label, times)
        print("\n".join(table + traffic[-2:]), flush=True)
    report.publish(lines + traffic, args.out)


if __name__ == "__main__":
    main()
