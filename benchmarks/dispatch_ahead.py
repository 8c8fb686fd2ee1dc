"""Dispatching collective steps without waiting for them, on 8 host devices.

    python benchmarks/dispatch_ahead.py [--steps 20,40,100,150] [--timeout-s 5] [--out FILE]

Each case is a fresh process that jits a one-psum step (64 KiB per device, each step reading the
last one's result), runs it once, then dispatches N steps without waiting and waits for the
last: `jax.lax.psum` against `libra_jax.psum`. A process gets 60 s, then it is killed (XLA's own
rendezvous aborts the process by itself after about a minute when it is stuck). libra's runs
use LIBRA_JAX_TIMEOUT_S=--timeout-s.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

CASE = """
import os, sys, time
import jax, numpy as np
from jax.sharding import PartitionSpec as P
import libra_jax
from libra_jax.config import xla_flags
which, n = sys.argv[1], int(sys.argv[2])
mesh = jax.make_mesh((8,), ("x",))
psum = libra_jax.psum if which == "libra" else jax.lax.psum
f = jax.jit(jax.shard_map(lambda v: psum(v * 1.0001, "x") / 8.0, mesh=mesh,
                          in_specs=P("x"), out_specs=P("x")))
x = jax.device_put(np.ones((8, 1 << 14), np.float32), jax.NamedSharding(mesh, P("x")))
jax.block_until_ready(f(x))
t = time.time()
try:
    for _ in range(n):
        x = f(x)
    jax.block_until_ready(x)
    print("OUTCOME ok in", round(time.time() - t, 2), "s")
except Exception as e:
    text = str(e).replace("\\n", " ")
    print("OUTCOME error after", round(time.time() - t, 2), "s:",
          text[text.find("libra_jax all-reduce"):][:230] if "libra_jax" in text else text[-200:])
"""


def run(which: str, n: int, timeout_s: float) -> str:
    env = {**os.environ, "XLA_FLAGS": xla_flags(8),
           "LIBRA_JAX_TIMEOUT_S": str(timeout_s)}
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", CASE, which, str(n)], env=env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "no answer in 60 s (killed)"
    took = time.time() - t0
    line = [x for x in proc.stdout.splitlines() if x.startswith("OUTCOME ")]
    if line:
        return line[0][len("OUTCOME "):]
    stuck = "stuck" in proc.stderr or "waiting for" in proc.stderr
    return (f"process ended with status {proc.returncode} after {took:.0f} s"
            + (" (XLA's rendezvous reported itself stuck)" if stuck else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="20,40,100,150")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    load0 = os.getloadavg()
    rows = [(n, run("xla", n, args.timeout_s), run("libra", n, args.timeout_s)) for n in steps]
    import jax

    load1 = os.getloadavg()
    lines = [f"Command: `python benchmarks/dispatch_ahead.py --steps {args.steps} "
             f"--timeout-s {args.timeout_s:g}" + (f" --out {args.out}`" if args.out else "`"), "",
             f"Date: {datetime.date.today()}; jax {jax.__version__}; Python "
             f"{platform.python_version()}; {os.cpu_count()} CPU cores; 8 host devices. Load "
             f"average before {'/'.join(f'{x:.1f}' for x in load0)}, after "
             f"{'/'.join(f'{x:.1f}' for x in load1)}. One run per cell.", "",
             "| steps dispatched ahead | `jax.lax.psum` | `libra_jax.psum` |", "|---|---|---|"]
    lines += [f"| {n} | {a} | {b} |" for n, a, b in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
