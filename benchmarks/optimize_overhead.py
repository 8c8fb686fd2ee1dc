"""Trace-time cost of `libra_jax.optimize` on a data-parallel step with many gradient tensors.

Measures, for a stack of dense layers (a weight and a bias each) under shard_map on 8 host
devices: JAX's own tracing of the step (`jax.make_jaxpr`), and what `optimize` adds on top
(`rewrite_jaxpr`: finding the psums, the roofline, planning, fusion). Median of repeated runs.

    python benchmarks/optimize_overhead.py [--tensors 1000] [--reps 5] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from libra_jax.rewrite import rewrite_jaxpr  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py)


def make_step(n_layers: int, width: int):
    mesh = jax.make_mesh((8,), ("x",))
    def loss(params, x):
        for w, b in params:
            x = jnp.tanh(x @ w + b)
        return jnp.sum(x)
    def body(params, x):
        grads = jax.grad(loss)(params, x)
        return jax.tree.map(lambda g: jax.lax.psum(g, "x"), grads)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                                 check_vma=False))
    params = [(jax.ShapeDtypeStruct((width, width), np.float32),
               jax.ShapeDtypeStruct((width,), np.float32)) for _ in range(n_layers)]
    x = jax.ShapeDtypeStruct((64, width), np.float32,
                             sharding=jax.NamedSharding(mesh, P("x")))
    return step, params, x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    trace_s, rewrite_s = [], []
    for _ in range(args.reps):
        step, params, x = make_step(args.tensors // 2, args.width)  # fresh: no trace cache
        t0 = time.perf_counter()
        closed = jax.make_jaxpr(step)(params, x)
        t1 = time.perf_counter()
        _, rewritten = rewrite_jaxpr(closed, profile="cpu-host")
        t2 = time.perf_counter()
        trace_s.append(t1 - t0)
        rewrite_s.append(t2 - t1)
    n_psums = rewritten.num_psums
    buckets = len(rewritten.plans)
    lines = report.header(f". Median (min-max) of {args.reps} runs.") + [
        "",
        "| gradient tensors | psums rewritten | buckets | JAX tracing s | optimize rewrite + plan s |",
        "|---|---|---|---|---|",
        f"| {args.tensors} | {n_psums} | {buckets} | {np.median(trace_s):.3f} "
        f"({min(trace_s):.3f}-{max(trace_s):.3f}) | {np.median(rewrite_s):.3f} "
        f"({min(rewrite_s):.3f}-{max(rewrite_s):.3f}) |",
    ]
    report.publish(lines, args.out)


if __name__ == "__main__":
    main()
