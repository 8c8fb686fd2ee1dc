"""Peak memory of the FSDP example's step as XLA compiles it (issue 74): a fused forward
all-gather keeps several layers' gathered weights alive at once, which FSDP exists to avoid,
so `optimize` bounds a fused gather's bytes (``prefetch_bytes``); this says what that costs.

    python benchmarks/fsdp_memory.py [--small] [--out FILE]

Per arm, XLA's memory stats of the compiled step (`jax.stages.Compiled.memory_analysis`, 8
host devices, a device's program): ``temp_size_in_bytes`` (the temporaries XLA's buffer
assignment packs by liveness: the step's working memory beyond its arguments and outputs),
arguments and outputs. Arms: GSPMD's own step (`jax.value_and_grad`), the route's program
(`libra_jax.value_and_grad`, jitted plain), and `optimize` of it with prefetch off (every
gather issued at its place), with the default bound, with 64 KiB (smaller than the example's
weights: the fused gather split) and with no bound (``prefetch_bytes`` 2**40). The forward
all-gather calls are the report's (members of one call counted once). No timing: the numbers
are XLA's.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from report import header, load_file, publish

ROOT = Path(__file__).resolve().parents[1]
common = load_file(ROOT / "examples" / "common.py", "common")  # (8 host devices)

import jax  # noqa: E402

import libra_jax  # noqa: E402


def arms(step) -> dict:
    return {"GSPMD (jax.value_and_grad)": common.plain_step(step),
            "route, plain": step,
            "optimize, prefetch off": libra_jax.optimize(step, prefetch="off"),
            "optimize (default: prefetch auto, prefetch_bytes 1 GiB)": libra_jax.optimize(step),
            "optimize, prefetch_bytes 64 KiB": libra_jax.optimize(step, prefetch_bytes=64 << 10),
            "optimize, prefetch_bytes 2**40": libra_jax.optimize(step, prefetch_bytes=1 << 40)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the example's small variant")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    step, step_args = common.load_example("fsdp").build(args.small)
    lines = header(f"; {len(jax.devices())} host devices; profile probe "
                   f"{os.environ.get('LIBRA_JAX_PROFILE_PROBE', 'on')}")
    lines += ["", "| arm | temp bytes | arguments | outputs | forward all-gather calls |",
              "|---|---|---|---|---|"]
    for name, f in arms(step).items():
        compiled = jax.jit(f, donate_argnums=0).lower(*step_args).compile()
        stats = compiled.memory_analysis()
        calls = "-"
        report = getattr(f, "last_report", None)
        if report is not None and report.plans:
            forward = [p for p in report.plans
                       if p.collective.kind == "all-gather" and p.kind == "forward"]
            calls = f"{len(forward)} ({sum(len(p.members) for p in forward)} gathers)"
        lines.append(f"| {name} | {stats.temp_size_in_bytes:,} | {stats.argument_size_in_bytes:,} "
                     f"| {stats.output_size_in_bytes:,} | {calls} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
