"""The shared plan fixture: every plan libra_jax makes today, on a fixed set of inputs.

    python tests/plan_fixture.py --write     # regenerate tests/data/plans.json

What it records (`collect`): the planner's policies on the model zoo (`libra-jax simulate`'s
comparison) under three profiles; `optimize`'s `plan_lines()` on the examples (small sizes) and
the real-world corpus (tests/corpus.py); and the planner on seeded random instances. A
behaviour-preserving change (the redesign) must leave it identical (tests/test_plan_fixture.py);
a commit that means to change plans regenerates it and says why.
"""
from __future__ import annotations

import json
import os
import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "data" / "plans.json"
PROFILES = ("libra-testbed", "h200", "cpu-host")


def zoo_plans() -> dict[str, list[str]]:
    from libra_jax import model, planner, zoo

    out = {}
    for name in zoo.MODEL_NAMES:
        for profile_name in PROFILES:
            profile = model.load_profile(profile_name)
            derivation = model.derive(profile, 8)
            workload = zoo.training_workload(name, flop_per_s=profile.device.flop_per_s(),
                                             bytes_per_s=profile.device.bytes_per_s())
            comparison = planner.compare_policies(workload.layers, derivation.cost,
                                                  default_alloc=derivation.default_allocation())
            out[f"zoo/{name}/{profile_name}"] = [
                f"{policy}: " + " ".join(f"{b.first}-{b.last}@{b.blocks}" for b in plan.buckets)
                for policy, plan in sorted(comparison.plans.items())]
    return out


def random_plans(n: int = 40) -> dict[str, list[str]]:
    from libra_jax import planner

    rng = random.Random(20261201)
    out = {}
    for i in range(n):
        layers = [planner.Layer(rng.uniform(1e-5, 2e-3), rng.choice([4, 1 << 10, 1 << 16, 1 << 20,
                                                                     1 << 22]))
                  for _ in range(rng.randint(1, 24))]
        keys = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64], rng.randint(1, 5)))
        solo = {k: 1e9 * (1 + k) ** 0.5 for k in keys}
        cost = planner.CostModel(latency_s=rng.uniform(1e-6, 5e-4), solo_bw=solo,
                                 overlap_bw={k: v * rng.uniform(0.3, 1.0) for k, v in solo.items()},
                                 slowdown={k: 1 + 0.01 * k * rng.uniform(0.1, 2) for k in keys})
        plan = planner.plan(layers, cost)
        out[f"random/{i}"] = [" ".join(f"{b.first}-{b.last}@{b.blocks}" for b in plan.buckets)]
    return out


def _portable(lines: list[str]) -> list[str]:
    """Plan lines without the psums' equation positions, which differ between JAX versions
    (the jaxprs do): how many psums a bucket holds stays."""
    out = []
    for line in lines:
        if " loop=" in line:  # a loop's choice (`rewrite.LoopPlan`): its scan's position too
            out.append(re.sub(r" loop=\d+", " loop", line))
            continue
        head, rest = line.split(" psums=(", 1)
        members, tail = rest.split(")", 1)
        out.append(f"{head} psums={len([m for m in members.split(',') if m.strip()])}{tail}")
    return out


def example_plan(name: str, small: bool = True, **options: str) -> list[str]:
    """`optimize`'s plan lines (`_portable`) for example `name` of examples/ (``build(small,
    **options)``), profile cpu-host: the fixture's, and the README picture's
    (tools/plan_picture.py, at the demo's size)."""
    import jax

    import libra_jax

    sys.path.insert(0, str(HERE.parent / "examples"))
    import common

    step, args = common.load_example(name).build(small, **options)
    opt = libra_jax.optimize(step, profile="cpu-host")
    jax.jit(opt).trace(*args)
    return _portable(opt.last_report.plan_lines())


def optimize_plans() -> dict[str, list[str]]:
    import libra_jax

    sys.path.insert(0, str(HERE))
    from corpus import CASES

    out = {}
    for name, options in [("mlp", {}), ("cnn", {}), ("transformer", {}),
                          ("transformer", {"variant": "pmap"}), ("fsdp", {})]:
        out[f"example/{name}{''.join(f'/{v}' for v in options.values())}"] = \
            example_plan(name, **options)
    for name, build in CASES.items():
        case = build()
        with case.context():
            opt = libra_jax.optimize(case.step, profile="cpu-host",
                                     static_argnames=case.static_argnames)
            case.trace(opt)
        out[f"corpus/{name}"] = _portable(opt.last_report.plan_lines())
    return out


def collect() -> dict[str, list[str]]:
    return {**zoo_plans(), **random_plans(), **optimize_plans()}


if __name__ == "__main__":
    from libra_jax.config import xla_flags
    os.environ["XLA_FLAGS"] = xla_flags(8)
    if sys.argv[1:] != ["--write"]:
        print(__doc__)
        raise SystemExit(2)
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(collect(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
