"""The model's predicted optimized/plain step ratio against the measured one, per example (issue
73): `libra_jax.explain(step).predicted_ratio` (`planner.StepPrice`: the whole step priced both
ways, plain's XLA collectives included) next to the ratio of the jitted steps, timed.

Examples: those of `examples/` (MLP, CNN, transformer, its pmap variant, FSDP) and one step no
fit has seen: a Flax Linen MLP data-parallel step with optax AdamW under `jax.shard_map`, built
here (`flax_adamw`).

    python benchmarks/step_prediction.py [--rounds 15] [--steps 4] [--only mlp,flax]
        [--optimization-level O1] [--out FILE]

``--optimization-level`` sets ``jax_optimization_level`` for every arm (plain and optimized
alike), so that libra composes with XLA's own setting: libra + O1 against O1 alone. The
predictions are the same (the model knows no optimization level): the table says how far XLA's
setting moves the measurement from them.

Each round times `--steps` consecutive steps of the plain and the optimized step in an order
that alternates from round to round (interleaved: drift hits both alike); per round, the ratio
optimized/plain. The table gives the predicted ratio, the median measured ratio with its p10-p90
over rounds and a bootstrap 95% interval of the median, the error |predicted - median| in
points, and whether the prediction lies inside the p10-p90 and the 95% interval. The machine's
load average is recorded before and after: on a shared machine it says what the numbers are
worth. Plain is the step jitted without `optimize`, the program the model prices. For the FSDP
example that is the route's program (`libra_jax.value_and_grad`: 15 all-gathers, 15
reduce-scatters and one combined all-reduce of XLA's); its GSPMD twin (`step.plain`,
`jax.value_and_grad`: XLA's partitioner inserts 15 all-gathers and one combined all-reduce of
every gradient, and lays the compute out its own way) is timed as a third arm in the same
rounds and reported beside it, not priced (issue 74 compares the two).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from report import header, interleaved_steps, load_file, publish  # noqa: E402

common = load_file(ROOT / "examples" / "common.py", "common")  # (8 host devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import libra_jax  # noqa: E402

EXAMPLES = {"mlp": ("mlp", {}), "cnn": ("cnn", {}), "transformer": ("transformer", {}),
            "transformer (pmap)": ("transformer", {"variant": "pmap"}), "fsdp": ("fsdp", {})}


def flax_adamw(width: int = 512, depth: int = 3, batch: int = 32):
    """(step, args): a Flax Linen MLP classifier, optax AdamW, data-parallel under
    `jax.shard_map` with its gradients `pmean`ed, as a user writes it; used in no fit."""
    import flax.linen as nn
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(depth):
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(10)(x)

    mesh = common.mesh()
    net, tx = Net(), optax.adamw(1e-3, weight_decay=1e-4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((common.DEVICES * batch, 256)).astype(np.float32)
    y = rng.integers(0, 10, common.DEVICES * batch).astype(np.int32)
    params = net.init(jax.random.key(0), x[:1])

    def local(state, x, y):
        params, opt_state = state

        def loss_fn(p):
            logits = net.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jax.lax.pmean(loss, "data")

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=(P(), P()), check_vma=False)
    data = NamedSharding(mesh, P("data"))
    state = common.replicate((params, tx.init(params)), mesh)
    return step, (state, jax.device_put(x, data), jax.device_put(y, data))


def build(name: str):
    if name == "flax (AdamW, no fit)":
        return flax_adamw()
    module, options = EXAMPLES[name]
    return common.load_example(module).build(False, **options)


def bootstrap_median(values: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, (n, len(values))), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def row(name: str, rounds: int, steps: int) -> str:
    step, args = build(name)
    e = libra_jax.explain(step, *args, file=None)
    price = e.step
    predicted = e.predicted_ratio
    arms = {"plain": jax.jit(step, donate_argnums=0),
            "optimized": jax.jit(libra_jax.optimize(step), donate_argnums=0)}
    twin = common.plain_step(step)
    if twin is not step:
        arms["gspmd"] = jax.jit(twin, donate_argnums=0)
    state = {k: common.copy_tree(args[0]) for k in arms}
    times = interleaved_steps(arms, state, args[1:], rounds, steps, common.WARMUP)
    ratios = np.asarray(times["optimized"]) / np.asarray(times["plain"])
    median = float(np.median(ratios))
    p10, p90 = (float(np.percentile(ratios, q)) for q in (10, 90))
    lo, hi = bootstrap_median(ratios)
    if predicted is None or price is None:
        return f"| {name} | - | {median:.3f} | {p10:.3f}-{p90:.3f} | {lo:.3f}-{hi:.3f} | - | - | - |"
    error = abs(predicted - median) * 100
    terms = (f"compute {price.compute_s * 1e3:.1f} ms; plain +{price.plain_collectives_s * 1e3:.2f}"
             f" ms ({price.plain_calls} calls, {price.plain_operands} operands) "
             f"+{price.plain_stagger_s * 1e3:.2f} ms stagger; optimized "
             f"+{price.optimized_collectives_s * 1e3:.2f} ms ({price.optimized_calls} calls, "
             f"{price.optimized_stagger_s * 1e3:.2f} of it stagger); "
             f"measured plain {np.median(times['plain']) * 1e3:.1f} ms")
    if "gspmd" in times:
        gspmd = np.asarray(times["optimized"]) / np.asarray(times["gspmd"])
        terms += (f"; GSPMD's own step (not priced) {np.median(times['gspmd']) * 1e3:.1f} ms, "
                  f"optimized/GSPMD {np.median(gspmd):.3f} (p10-p90 "
                  f"{np.percentile(gspmd, 10):.3f}-{np.percentile(gspmd, 90):.3f})")
    return (f"| {name} | {predicted:.3f} | {median:.3f} | {p10:.3f}-{p90:.3f} | {lo:.3f}-{hi:.3f} "
            f"| {error:.1f} | {'yes' if p10 <= predicted <= p90 else 'no'} "
            f"| {'yes' if lo <= predicted <= hi else 'no'} | {terms} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4)
    names = [*EXAMPLES, "flax (AdamW, no fit)"]
    parser.add_argument("--only", default="", help="comma-separated names' prefixes "
                        f"({', '.join(names)})")
    parser.add_argument("--optimization-level", default=None,
                        help="jax_optimization_level for every arm (e.g. O1); default: JAX's")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    level = ""
    if a.optimization_level:
        jax.config.update("jax_optimization_level", a.optimization_level)
        level = f"; jax_optimization_level={a.optimization_level} in every arm"
    if a.only:
        names = [n for n in names if any(n.startswith(p) for p in a.only.split(","))]
    before = os.getloadavg()
    rows = [row(name, a.rounds, a.steps) for name in names]
    after = os.getloadavg()
    profile = libra_jax.model.default_profile("cpu")
    lines = header(f"; {common.DEVICES} host devices; profile `{profile}`{level}") + [
        f"Load average (1/5/15 min) before: {'/'.join(f'{v:.1f}' for v in before)}, after: "
        f"{'/'.join(f'{v:.1f}' for v in after)}.",
        f"{a.rounds} interleaved rounds of {a.steps} steps per arm after {common.WARMUP} warm-up "
        "steps; ratio optimized/plain per round.", "",
        "| example | predicted | measured median | p10-p90 | median 95% CI | error (points) "
        "| inside p10-p90 | inside CI | terms |",
        "|---|---|---|---|---|---|---|---|---|", *rows]
    publish(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
