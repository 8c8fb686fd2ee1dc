"""Trace-time cost of `libra_jax.optimize` on a data-parallel step with many gradient tensors.

Measures, for a stack of dense layers (a weight and a bias each) under shard_map on 8 host
devices: JAX's own tracing of the step (`jax.make_jaxpr`), and what `optimize` adds on top
(`rewrite_jaxpr`: finding the psums, the roofline, planning, fusion). Median of repeated runs.

    python benchmarks/optimize_overhead.py [--tensors 1000] [--reps 5] [--out FILE]
        [--baseline COMMIT]

``--route``: the step is a GSPMD step through `libra_jax.value_and_grad` instead (the same
layers, a frozen weight closed over), and what is timed is its whole trace, plain and under
`optimize` (`jax.make_jaxpr` of each, a fresh step each time: no trace cache).

``--baseline COMMIT`` also times that commit's `rewrite_jaxpr` (or, with ``--route``, its
traces) on the same step: the
commit is checked out in a temporary worktree and run in its own processes (its libra_jax
imported from there, this build's extension beside it), alternating with processes of this
tree, ``--rounds`` of each.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from libra_jax.config import xla_flags  # noqa: E402  (pure Python: JAX does not start)

os.environ["XLA_FLAGS"] = xla_flags(8)  # the caller's flags kept

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


def measure(tensors: int, reps: int) -> list[float]:
    """`rewrite_jaxpr`'s seconds on the step, `reps` times after one warm-up, in this process
    (whichever libra_jax it imports)."""
    step, params, x = make_step(tensors // 2, 32)
    closed = jax.make_jaxpr(step)(params, x)
    rewrite_jaxpr(closed, profile="cpu-host")
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        rewrite_jaxpr(closed, profile="cpu-host")
        times.append(time.perf_counter() - t)
    return times


def make_route_step(n_layers: int, width: int):
    """A GSPMD step of `n_layers` dense layers whose gradient is the route's, its loss
    closing over a frozen weight; its abstract arguments."""
    import libra_jax
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    frozen = jnp.ones((width,), np.float32)

    def loss(params, x):
        for w, b in params:
            x = jnp.tanh(x @ w + b + frozen)
        return jnp.mean(x ** 2)

    def step(params, x):
        value, grads = libra_jax.value_and_grad(loss, axis_name="x", mesh=mesh)(params, x)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    replicated = jax.NamedSharding(mesh, P())
    params = [(jax.ShapeDtypeStruct((width, width), np.float32, sharding=replicated),
               jax.ShapeDtypeStruct((width,), np.float32, sharding=replicated))
              for _ in range(n_layers)]
    x = jax.ShapeDtypeStruct((64, width), np.float32, sharding=jax.NamedSharding(mesh, P("x")))
    return step, params, x, mesh


def measure_route(tensors: int, reps: int) -> list[float]:
    """Seconds of the route step's trace plain and under `optimize`, interleaved, `reps` of
    each after one warm-up: ``[plain..., optimized...]``."""
    import libra_jax
    plain, optimized = [], []
    for rep in range(reps + 1):
        for which, times in (("plain", plain), ("optimized", optimized)):
            step, params, x, mesh = make_route_step(tensors // 2, 32)
            fn = step if which == "plain" else libra_jax.optimize(step)
            t = time.perf_counter()
            with jax.set_mesh(mesh):
                jax.make_jaxpr(fn)(params, x)
            if rep:
                times.append(time.perf_counter() - t)
    return plain + optimized


def worktree(commit: str) -> Path:
    """`commit` checked out in a temporary worktree, with this build's extension copied in."""
    import libra_jax._libra_ffi as ext  # this build's

    path = Path(tempfile.mkdtemp(prefix="libra_base_")) / "tree"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(path), commit],
                   cwd=report.ROOT, check=True)
    shutil.copy(ext.__file__, path / "libra_jax")
    return path


def in_process(tree: Path | None, tensors: int, reps: int, route: bool = False
               ) -> list[float]:
    """`measure` in a fresh process of `tree`'s libra_jax (None: this tree's). The base runs
    without site processing, so that this checkout's editable install does not shadow it."""
    site = next(p for p in sys.path if p.endswith("site-packages"))
    prefix = f"import sys; sys.path[:0] = [{str(tree)!r}, {site!r}]; " if tree else ""
    code = (prefix + f"sys.path.insert(0, {str(Path(__file__).parent)!r}); " if tree else
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); ")
    code += ("import json, optimize_overhead as o; "
             f"print('TIMES', json.dumps(o.{'measure_route' if route else 'measure'}"
             f"({tensors}, {reps})))")
    cmd = [sys.executable, *(["-S"] if tree else []), "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ).stdout
    return json.loads(out.split("TIMES", 1)[1])


def compare(commit: str, tensors: int, reps: int, rounds: int, route: bool = False
            ) -> list[str]:
    tree = worktree(commit)
    try:
        mine: list[float] = []
        base: list[float] = []
        for _ in range(rounds):  # alternate, so that load hits both alike
            mine += in_process(None, tensors, reps, route)
            base += in_process(tree, tensors, reps, route)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=report.ROOT,
                       check=False)
    med = lambda v: float(np.median(v))  # noqa: E731
    if route:
        def halves(v: list[float]) -> tuple[list[float], list[float]]:
            per = [v[i:i + 2 * reps] for i in range(0, len(v), 2 * reps)]
            return ([t for c in per for t in c[:reps]], [t for c in per for t in c[reps:]])
        rows = []
        for name, m, b in zip(("route, plain", "route under optimize"), halves(mine),
                              halves(base)):
            rows.append(f"| {name} | {med(m):.3f} ({min(m):.3f}-{max(m):.3f}) | "
                        f"{med(b):.3f} ({min(b):.3f}-{max(b):.3f}) | {med(m) / med(b):.2f} |")
        return ["", f"### Trace of the route's step ({tensors} gradient tensors), this tree "
                    f"against `{commit}` ({rounds} alternating processes of each, {reps} "
                    "traces of each form per process after a warm-up; s, median (min-max))", "",
                "| trace | this tree | base | this / base |", "|---|---|---|---|", *rows]
    return ["", f"### This tree against `{commit}` ({rounds} alternating processes of each, "
                f"{reps} rewrites per process after a warm-up; s, median (min-max))", "",
            "| gradient tensors | this tree | base | this / base |", "|---|---|---|---|",
            f"| {tensors} | {med(mine):.3f} ({min(mine):.3f}-{max(mine):.3f}) | "
            f"{med(base):.3f} ({min(base):.3f}-{max(base):.3f}) | {med(mine) / med(base):.2f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--baseline", default=None, help="a commit to time alongside")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--route", action="store_true",
                        help="time the trace of a step through libra_jax.value_and_grad")
    args = parser.parse_args()
    if args.route:
        if not args.baseline:
            parser.error("--route compares against --baseline COMMIT")
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        report.publish(report.header(f"; load average {load}.")
                       + compare(args.baseline, args.tensors, args.reps, args.rounds, True),
                       args.out)
        return
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
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
    lines = report.header(f"; load average {load}. Median (min-max) of {args.reps} runs.") + [
        "",
        "| gradient tensors | psums rewritten | buckets | JAX tracing s | optimize rewrite + plan s |",
        "|---|---|---|---|---|",
        f"| {args.tensors} | {n_psums} | {buckets} | {np.median(trace_s):.3f} "
        f"({min(trace_s):.3f}-{max(trace_s):.3f}) | {np.median(rewrite_s):.3f} "
        f"({min(rewrite_s):.3f}-{max(rewrite_s):.3f}) |",
    ]
    if args.baseline:
        lines += compare(args.baseline, args.tensors, args.reps, args.rounds)
    report.publish(lines, args.out)


if __name__ == "__main__":
    main()
