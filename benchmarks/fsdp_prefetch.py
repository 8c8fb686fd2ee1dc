"""FSDP all-gathers on CPU: XLA's, libra's one call where each is used, and libra's issued ahead.

    python benchmarks/fsdp_prefetch.py [--rounds 15] [--out benchmarks/results/fsdp_prefetch.md]

On 8 host devices, per workload (the three FSDP steps of tests/corpus.py, and FSDP MLPs under
`shard_map` with every weight sharded over the data axis, all-gathered where a layer reads it,
each layer under `jax.checkpoint` so that the backward pass gathers it again, and one MLP
without remat, whose backward pass reuses the forward's gathered weights), jitted with
the state donated, interleaved (`report.interleaved_steps`: `--rounds` rounds of 4 steps per
arm, in rotating order):

* plain: the step as written (XLA's all-gathers and reduce-scatters);
* one call: ``optimize(step, prefetch="off")``: every all-gather libra's, one call where it
  is used;
* prefetch d: ``optimize(step, prefetch=d)``: gather i started when gather i - d is done
  (a start/done pair), remat's re-gathers taken out of their checkpoints to be started early;
* auto: ``optimize(step)``, the default (on CPU: one call each; the model's distance is shown).

Per arm: the median step time over rounds and its p10-p90, the median of the per-round ratio
to plain, and whether 4 steps train bitwise the state of its XLA control (the same program
with XLA's collectives, ``collectives="xla"``; required). The libra arms are different
programs, so XLA may compile their compute differently (docs/bitwise.md, class 3).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

from libra_jax.config import xla_flags

os.environ["XLA_FLAGS"] = xla_flags(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import libra_jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

corpus = report.load_file(report.ROOT / "tests" / "corpus.py", "corpus")


def mlp(layers: int, width: int, batch: int, remat: bool = True):
    """An FSDP MLP of `layers` width x width layers (under remat, or not), `batch` rows per
    device."""
    n = 8
    mesh = jax.make_mesh((n,), ("data",))
    rng = np.random.default_rng(5)
    params = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
              for _ in range(layers)]
    x = rng.standard_normal((n * batch, width)).astype(np.float32)

    def layer(w, h):
        return jnp.tanh(h @ jax.lax.all_gather(w, "data", tiled=True))
    if remat:
        layer = jax.checkpoint(layer)

    def local(params, x):
        def loss_fn(p):
            h = x
            for w in p:
                h = layer(w, h)
            return jax.lax.pmean(jnp.mean(h * h), "data")
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return [w - 0.1 * g for w, g in zip(params, grads)], loss

    step = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")),
                         out_specs=(P("data"), P()))
    sharding = NamedSharding(mesh, P("data"))
    return step, [jax.device_put(w, sharding) for w in params], (jax.device_put(x, sharding),)


def workloads() -> dict:
    out = {}
    for name in ("fsdp-remat", "fsdp-explicit-psum-scatter", "fsdp-mixed-replicated"):
        case = corpus.CASES[name]()
        out[f"corpus {name}"] = (case.step, case.state, case.batch)
    for layers, width, batch in ((8, 512, 32), (8, 1024, 32)):
        out[f"MLP {layers} x {width}x{width}, {batch} rows/device, remat"] = mlp(
            layers, width, batch)
    out["MLP 8 x 512x512, 32 rows/device, no remat"] = mlp(8, 512, 32, remat=False)
    return out


#: The libra arms: optimize's ``prefetch=``.
PREFETCH = {"one call": "off", "prefetch 1": 1, "prefetch 2": 2, "auto": None}


def arms(step, collectives: str = "libra") -> dict:
    def jit(f):
        return jax.jit(f, donate_argnums=0)
    out = {} if collectives == "xla" else {"plain": jit(step)}
    out.update({name: jit(libra_jax.optimize(step, prefetch=p, collectives=collectives))
                for name, p in PREFETCH.items()})
    return out


def bitwise_its_control(step, state, batch, steps: int = 4) -> dict[str, bool]:
    """Per libra arm, whether `steps` steps train bitwise the state of its XLA control (the
    same rewritten program with XLA's collectives: ``collectives="xla"``)."""
    def train(f):
        s = corpus.fresh(state)
        for _ in range(steps):
            s, _ = f(s, *batch)
        return [np.asarray(x) for x in jax.tree.leaves(s)]
    ours, control = arms(step), arms(step, "xla")
    return {k: all(np.array_equal(a, b) for a, b in zip(train(ours[k]), train(control[k])))
            for k in control}


def issued(step, state, batch, prefetch) -> str:
    """How ``optimize(step, prefetch=prefetch)`` issues the step's all-gathers."""
    plans = libra_jax.explain(step, state, *batch, prefetch=prefetch, file=None).report.plans
    gathers = [p for p in plans if p.collective == "all-gather"]
    ahead = collections.Counter(p.ahead for p in gathers)
    return ", ".join(f"{n} one call" if d == 0 else f"{n} issued {d} ahead"
                     for d, n in sorted(ahead.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = report.header(f"; 8 host devices (XLA_FLAGS={os.environ['XLA_FLAGS']}).") + [
        "", "Per step, median over rounds (p10-p90) in ms; ratio: median of per-round "
        "arm / plain.", ""]
    for name, (step, state, batch) in workloads().items():
        bitwise = bitwise_its_control(step, state, batch)
        fns = arms(step)
        states = {k: corpus.fresh(state) for k in fns}
        times = report.interleaved_steps(fns, states, batch, args.rounds, 4, 2)
        plain = np.array(times["plain"])
        how = "; ".join(f"{k}: {issued(step, state, batch, p)}" for k, p in PREFETCH.items())
        lines += [f"### {name}", "", f"all-gathers: {how}", "",
                  "| arm | step ms | p10-p90 | / plain (p10-p90) | bitwise its XLA control |",
                  "|---|---|---|---|---|"]
        for k, t in times.items():
            ratio = np.array(t) / plain
            same = "-" if k == "plain" else "yes" if bitwise[k] else "NO"
            lines.append(f"| {k} | {np.median(t) * 1e3:.2f} | {report.spread(t, scale=1e3)} | "
                         f"{np.median(ratio):.2f} ({report.spread(ratio)}) | {same} |")
        lines.append("")
        print("\n".join(lines[-9:]), flush=True)
    report.publish(lines, args.out)


if __name__ == "__main__":
    main()
