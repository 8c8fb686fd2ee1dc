"""Loops on 8 host CPU devices: scan-over-layers models (the loop's gradient psums hoisted,
`libra_jax.loops`, or kept in the body) and train steps inside loops (each iteration's gradient
psums planned as a scope of their own), against the plain step.

    python benchmarks/scan_loops.py [--rounds 15] [--steps 4] [--out benchmarks/results/scan_loops.md]

Models (Adam, state donated):
* ``lax.scan``: 8 stacked tanh layers of width 256, batch 512 per step (`shard_map` with
  `check_vma`: autodiff's weight-gradient psums sit in the backward scan's body);
* ``flax nn.scan``: 6 stacked residual blocks (LayerNorm, Dense 256 -> 512 -> 256), batch 256;
* ``pmap substeps``: a `jax.pmap` trainer whose call runs 4 optimizer steps, a `lax.scan`
  over substeps, each a whole train step with its gradient `pmean`ed (VDM-style); an MLP
  128 -> 256 -> 256 -> 256 -> 8, 32 examples per device per substep;
* ``accumulation``: gradient accumulation over 4 microbatches that `pmean`s each one's gradient
  (`shard_map`, no `check_vma`), one update after the loop; the same MLP, 32 examples per
  device per microbatch.

Arms: the plain step (XLA's all-reduces; XLA:CPU's combiner merges a loop body's all-reduces
into one); for the scans, optimized with the slices hoisted and with ``loops="in-loop"``; for
the steps in loops, optimized with ``fusion=False`` (one call per psum per iteration, as
libra_jax issued a loop body's psums before its bodies were planned) and optimized (the body's
gradient psums planned, fused). Per model and arm: the plan, the Libra calls in the lowered
program, and the step time: `--rounds` interleaved rounds of `--steps` steps per arm after
warm-up (the order rotates each round); the median per-step time, its IQR, and the median and
p10-p90 of the per-round ratio to plain.
"""
from __future__ import annotations

import argparse
import os
import re

from libra_jax.config import xla_flags  # noqa: E402  (pure Python: JAX does not start)

os.environ["XLA_FLAGS"] = xla_flags(8)  # the caller's flags kept

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from report import header, interleaved_steps, publish  # noqa: E402

import libra_jax  # noqa: E402

WARMUP = 2


def lax_scan_model(mesh):
    L, D, B = 8, 256, 512
    rng = np.random.default_rng(0)
    params = {"layers": {"w": (rng.standard_normal((L, D, D)) / np.sqrt(D)).astype(np.float32),
                         "b": np.zeros((L, D), np.float32)},
              "head": (rng.standard_normal((D, 1)) / np.sqrt(D)).astype(np.float32)}
    x = rng.standard_normal((B, D)).astype(np.float32)

    def loss_fn(p, x):
        def layer(h, w):
            return jnp.tanh(h @ w["w"] + w["b"]), None
        h, _ = jax.lax.scan(layer, x, p["layers"])
        return jnp.mean((h @ p["head"]) ** 2)
    return params, (x,), loss_fn


def flax_scan_model(mesh):
    import flax.linen as nn
    D, B = 256, 256

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(h)))), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=6)()(x, None)
            return nn.Dense(1)(h)

    net = Net()
    x = np.random.default_rng(1).standard_normal((B, D)).astype(np.float32)
    params = net.init(jax.random.key(1), x[:1])["params"]
    return params, (x,), lambda p, x: jnp.mean(net.apply({"params": p}, x) ** 2)


def mlp(rng, sizes=(128, 256, 256, 256, 8)):
    return {f"layer{i}": {"w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
                          "b": np.zeros(b, np.float32)}
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}


def mlp_loss(p, x, y):
    h = x
    for i in range(len(p)):
        h = h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
        h = jnp.tanh(h) if i < len(p) - 1 else h
    return jnp.mean((h - y) ** 2)


LOOP = 4  # substeps, microbatches
PER_DEVICE = 32


def scan_over_layers(name: str):
    def build(mesh, tx):
        params, batch, loss_fn = {"lax.scan": lax_scan_model,
                                  "flax nn.scan": flax_scan_model}[name](mesh)
        step = train_step(mesh, loss_fn, tx)
        batch = tuple(jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batch)
        arms = {"optimized (hoisted)": {}, "optimized, loops=in-loop": {"loops": "in-loop"}}
        return step, {"params": params, "opt": tx.init(params)}, batch, arms, False
    return build


def pmap_substeps(mesh, tx):
    rng = np.random.default_rng(2)
    params = mlp(rng)
    x = rng.standard_normal((8, LOOP, PER_DEVICE, 128)).astype(np.float32)
    y = rng.standard_normal((8, LOOP, PER_DEVICE, 8)).astype(np.float32)

    def step(state, x, y):
        def substep(carry, batch):
            params, opt = carry
            loss, grads = jax.value_and_grad(mlp_loss)(params, *batch)
            grads = jax.lax.pmean(grads, "batch")
            updates, opt = tx.update(grads, opt, params)
            return (optax.apply_updates(params, updates), opt), loss
        (params, opt), losses = jax.lax.scan(substep, (state["params"], state["opt"]), (x, y))
        return {"params": params, "opt": opt}, jax.lax.pmean(losses[-1], "batch")

    state = jax.tree.map(lambda a: np.broadcast_to(a, (8, *a.shape)),
                         {"params": params, "opt": tx.init(params)})
    # optimize(jax.pmap(step)), as the corpus's pmap steps: optimize sees the pmap's axis size.
    return jax.pmap(step, axis_name="batch", donate_argnums=0), state, (x, y), STEP_ARMS, True


def accumulation(mesh, tx):
    rng = np.random.default_rng(3)
    params = mlp(rng)
    x = rng.standard_normal((8 * LOOP * PER_DEVICE, 128)).astype(np.float32)
    y = rng.standard_normal((8 * LOOP * PER_DEVICE, 8)).astype(np.float32)

    def local(state, x, y):
        def micro(acc, batch):
            loss, grads = jax.value_and_grad(mlp_loss)(state["params"], *batch)
            return jax.tree.map(jnp.add, acc, jax.lax.pmean(grads, "data")), loss
        grads, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, state["params"]),
                                     (x.reshape(LOOP, -1, 128), y.reshape(LOOP, -1, 8)))
        updates, opt = tx.update(jax.tree.map(lambda g: g / LOOP, grads), state["opt"],
                                 state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt": opt},
                jax.lax.pmean(jnp.mean(losses), "data"))

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=(P(), P()), check_vma=False)
    batch = tuple(jax.device_put(b, NamedSharding(mesh, P("data"))) for b in (x, y))
    return step, {"params": params, "opt": tx.init(params)}, batch, STEP_ARMS, False


STEP_ARMS = {"optimized, fusion=False (one call per psum per iteration)": {"fusion": False},
             "optimized (the body planned)": {}}
MODELS = {"lax.scan": scan_over_layers("lax.scan"),
          "flax nn.scan": scan_over_layers("flax nn.scan"),
          "pmap substeps": pmap_substeps, "accumulation": accumulation}


def train_step(mesh, loss_fn, tx):
    def local(state, *batch):
        loss, grads = jax.value_and_grad(
            lambda p: jax.lax.pmean(loss_fn(p, *batch), "data"))(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))


def plan_text(report) -> str:
    bodies = {lp.body for lp in report.loops}
    after = [p for p in report.plans if p.kind == "gradient" and p.scope not in bodies]
    text = (f"{len(after)} gradient buckets outside loops, "
            f"{sum(p.nbytes for p in after) / 2**20:.2f} MiB")
    for lp in report.loops:
        if lp.gradient:
            text += (f"; in the loop: {lp.gradient} gradient psums in {lp.calls} calls x "
                     f"{lp.length} iterations")
        if lp.psums:
            text += f" ({lp.psums} stacked slice psums {lp.choice})"
    return text


def bench(name: str, rounds: int, steps: int) -> list[str]:
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    tx = optax.adam(1e-3)
    step, state0, batch, arm_options, pmapped = MODELS[name](mesh, tx)
    opts = {k: libra_jax.optimize(step, **o) for k, o in arm_options.items()}
    compiled = {"plain": jax.jit(step, donate_argnums=0),
                **{k: jax.jit(f, donate_argnums=0) for k, f in opts.items()}}
    calls = {k: len(re.findall(r"custom_call @libra_allreduce_\w+",
                               f.lower(jax.tree.map(np.array, state0), *batch).as_text()))
             for k, f in compiled.items()}

    def arm(f):  # (state, loss): a pmap step's loss, the first device's
        def run(state, *batch):
            state, loss = f(state, *batch)
            return state, loss[0] if pmapped else loss
        return run
    arms = {k: arm(f) for k, f in compiled.items()}
    state = {k: jax.tree.map(np.array, state0) for k in arms}
    times = interleaved_steps(arms, state, batch, rounds, steps, WARMUP)
    base = np.asarray(times["plain"])
    rows = []
    for k in arms:
        ts = np.asarray(times[k])
        ratio = ts / base
        plan = plan_text(opts[k].last_report) if k in opts else "XLA's all-reduces"
        rows.append(f"| {name} | {k} | {plan} | {calls[k]} | {np.median(ts) * 1e3:.1f} | "
                    f"{np.percentile(ts, 25) * 1e3:.1f}-{np.percentile(ts, 75) * 1e3:.1f} | "
                    f"{np.median(ratio):.2f} | {np.percentile(ratio, 10):.2f}-"
                    f"{np.percentile(ratio, 90):.2f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", action="append", choices=list(MODELS),
                        help="a model to run (repeatable; default: all)")
    a = parser.parse_args()
    load_before = os.getloadavg()
    rows = [row for name in a.model or MODELS for row in bench(name, a.rounds, a.steps)]
    load_after = os.getloadavg()
    publish(header(f"; 8 host devices; profile cpu-host; load average (1/5/15 min) before "
                   f"{'/'.join(f'{x:.1f}' for x in load_before)}, after "
                   f"{'/'.join(f'{x:.1f}' for x in load_after)}") + [
        "", f"{a.rounds} interleaved rounds of {a.steps} steps per arm after {WARMUP} warm-up "
        "steps; per-step times. Libra calls: custom calls in the lowered program (a call in "
        "the loop body is one call there and runs once per iteration).", "",
        "| model | arm | plan | Libra calls | median ms | IQR ms | ratio to plain | "
        "ratio p10-p90 |", "|---|---|---|---|---|---|---|---|", *rows], a.out)


if __name__ == "__main__":
    main()
