"""What the collectives cost each program of an example's step: plain and optimized, each beside
itself with every collective made local (issue 73).

    python benchmarks/collective_share.py [--example mlp|cnn|transformer|fsdp|flax] [--rounds 15] [--steps 3] [--out FILE]

Four arms in one process, in paired interleaved rounds (`report.interleaved_steps`): plain (the
step jitted as written, without `optimize`: XLA's collectives; for the FSDP example the route's
program, as `explain` prices it), plain with its collectives made local (the same
compute, no rendezvous, no bytes between devices: `fsdp_gspmd.without_communication`),
optimized, and optimized made local. Plain less its local arm is what XLA's collectives cost
the step as it runs; the two local arms' ratio says whether the programs' compute differs
(the model prices it alike). `explain`'s prediction prices plain's collectives from the
probe's XLA terms (`planner.step`); this measures them in the step.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_gspmd import common, without_communication  # noqa: E402
from report import interleaved_steps, paired_run, publish, ratio_rows  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import libra_jax  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="mlp",
                        choices=("mlp", "cnn", "transformer", "fsdp", "flax"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    before = os.getloadavg()
    if a.example == "flax":  # step_prediction's Flax Linen AdamW step, used in no fit
        from step_prediction import flax_adamw

        step, args = flax_adamw()
    else:
        step, args = common.load_example(a.example).build(False)
    optimized = libra_jax.optimize(step)
    plain = step  # the program `optimize` rewrites, as `explain` prices it (for the FSDP
    # example the route with XLA's collectives, not GSPMD's step, whose collectives XLA's
    # partitioner inserts after tracing, where no arm can make them local)
    arms = {"plain": plain, "plain, collectives local": without_communication(plain, *args),
            "optimized": optimized,
            "optimized, collectives local": without_communication(optimized, *args)}
    arms = {name: jax.jit(fn, donate_argnums=0) for name, fn in arms.items()}
    state = {k: common.copy_tree(args[0]) for k in arms}
    times = interleaved_steps(arms, state, args[1:], a.rounds, a.steps, common.WARMUP)
    after = os.getloadavg()
    med = {arm: float(np.median(values)) for arm, values in times.items()}
    xla = med["plain"] - med["plain, collectives local"]
    libra = med["optimized"] - med["optimized, collectives local"]
    price = optimized.last_report.step
    predicted = (f"; `explain` prices plain's {price.plain_collectives_s * 1e3:.2f} ms"
                 if price is not None else "")
    publish([
        f"Command: `python benchmarks/collective_share.py --example {a.example} "
        f"--rounds {a.rounds} --steps {a.steps}`", "",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; jax "
        f"{jax.__version__}; Python {platform.python_version()}; {os.cpu_count()} CPU cores; "
        f"{len(jax.devices())} host devices; profile `{libra_jax.model.default_profile('cpu')}`.",
        *paired_run(before, after, a.rounds, a.steps, common.WARMUP), "",
        f"| {a.example} arm | median ms | p10-p90 ms | ratio to plain (95% CI) |",
        "|---|---|---|---|", *ratio_rows(times, "plain"), "",
        f"- XLA's collectives cost plain {xla * 1e3:.1f} ms of its step (medians' difference)"
        f"{predicted}; libra's cost the optimized step {libra * 1e3:.1f} ms."], a.out)


if __name__ == "__main__":
    main()
