"""Scan-over-layers models on 8 host CPU devices: plain vs optimized (the loop's gradient psums
hoisted, `libra_jax.loops`) vs optimized with them kept in the loop (``loops="in-loop"``).

    python benchmarks/scan_loops.py [--rounds 15] [--steps 4] [--out benchmarks/results/scan_loops.md]

Models (`shard_map` with `check_vma`, so autodiff's weight-gradient psums sit in the backward
scan's body; Adam, state donated):
* ``lax.scan``: 8 stacked tanh layers of width 256, batch 512 per step;
* ``flax nn.scan``: 6 stacked residual blocks (LayerNorm, Dense 256 -> 512 -> 256), batch 256.

Per model and arm: the plan (gradient buckets after the loop, all-reduces in the loop body and
how often they run), the Libra calls in the lowered program, and the step time: `--rounds`
interleaved rounds of `--steps` steps per arm after warm-up (the order rotates each round); the
median per-step time, its IQR, and the median and p10-p90 of the per-round ratio to plain.
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


MODELS = {"lax.scan": lax_scan_model, "flax nn.scan": flax_scan_model}


def train_step(mesh, loss_fn, tx):
    def local(state, *batch):
        loss, grads = jax.value_and_grad(
            lambda p: jax.lax.pmean(loss_fn(p, *batch), "data"))(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))


def plan_text(report) -> str:
    gradient = [p for p in report.plans if p.kind == "gradient"]
    in_loop = [p for p in report.plans if p.kind == "loop"]
    lengths = [lp.length for lp in report.loops]
    runs = sum(lengths) // max(len(lengths), 1)
    loop = (f"; {len(in_loop)} in the loop x {runs} iterations (blocks "
            f"{sorted({p.blocks for p in in_loop})})" if in_loop else "")
    return (f"{len(gradient)} gradient buckets after the loop, "
            f"{sum(p.nbytes for p in gradient) / 2**20:.2f} MiB{loop}")


def bench(name: str, rounds: int, steps: int) -> list[str]:
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    params, batch, loss_fn = MODELS[name](mesh)
    tx = optax.adam(1e-3)
    step = train_step(mesh, loss_fn, tx)
    batch = tuple(jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batch)
    state0 = {"params": params, "opt": tx.init(params)}
    opts = {"optimized (hoisted)": libra_jax.optimize(step),
            "optimized, loops=in-loop": libra_jax.optimize(step, loops="in-loop")}
    arms = {"plain": jax.jit(step, donate_argnums=0),
            **{k: jax.jit(f, donate_argnums=0) for k, f in opts.items()}}
    calls = {k: len(re.findall(r"custom_call @libra_allreduce_\w+",
                               f.lower(jax.tree.map(np.array, state0), *batch).as_text()))
             for k, f in arms.items()}
    state = {k: jax.tree.map(np.array, state0) for k in arms}
    times = interleaved_steps(arms, state, batch, rounds, steps, WARMUP)
    names = list(arms)
    base = np.asarray(times["plain"])
    rows = []
    for k in names:
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
    a = parser.parse_args()
    load_before = os.getloadavg()
    rows = [row for name in MODELS for row in bench(name, a.rounds, a.steps)]
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
