"""Demo: one data-parallel training step on 8 host CPU devices, with jax.lax.psum
and with libra_jax.psum: the same parameters within class 3's bound, and the time of each.

Every psum returns jax.lax.psum's bits, but the two steps are two programs, which XLA may
compile differently around the all-reduce (docs/bitwise.md, class 3): the
parameters are compared with `libra_jax.testing.codegen_error`, and are often bitwise too.

    python examples/demo.py [--steps 20] [--hidden 1024]
"""
from __future__ import annotations

import argparse
import os
import time

from libra_jax.config import xla_flags  # noqa: E402  (pure Python: JAX does not start)

os.environ["XLA_FLAGS"] = xla_flags(8)  # the caller's flags kept

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import libra_jax  # noqa: E402
from libra_jax import testing  # noqa: E402


def init_params(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
            for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def loss_fn(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean(jnp.sum((logits - y) ** 2, axis=-1))


def make_step(mesh, psum, lr: float = 1e-2):
    """A data-parallel SGD step: local gradients, all-reduced with `psum`."""
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jax.tree.map(lambda g: psum(g, "data") / 8, grads)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return params, psum(loss, "data") / 8
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                 out_specs=(P(), P()), check_vma=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="per device")
    args = parser.parse_args()

    mesh = jax.make_mesh((8,), ("data",))
    sizes = [256, args.hidden, args.hidden, 16]
    params = init_params(jax.random.key(0), sizes)
    rng = np.random.default_rng(0)
    batch = NamedSharding(mesh, P("data"))
    x = jax.device_put(rng.standard_normal((8 * args.batch, sizes[0]), np.float32), batch)
    y = jax.device_put(rng.standard_normal((8 * args.batch, sizes[-1]), np.float32), batch)
    n_params = sum(p.size for layer in params for p in layer.values())
    print(f"8 host devices, MLP {sizes}: {n_params / 1e6:.2f}M parameters, "
          f"{4 * n_params / 2**20:.1f} MiB of gradients all-reduced per step")

    steps = {"jax.lax.psum": make_step(mesh, jax.lax.psum),
             "libra_jax.psum": make_step(mesh, libra_jax.psum)}
    state = {name: params for name in steps}
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.steps + 2):  # two warm-up steps (compilation), then interleaved
        for name, step in steps.items():
            t0 = time.perf_counter()
            state[name], loss = step(state[name], x, y)
            loss = float(loss)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)

    errors = testing.codegen_errors(state["libra_jax.psum"], state["jax.lax.psum"])
    worst = max(errors.values())
    bitwise = all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in
                  zip(jax.tree.leaves(state["jax.lax.psum"]), jax.tree.leaves(state["libra_jax.psum"])))
    for name in steps:
        ts = np.array(times[name]) * 1e3
        print(f"{name:>15}: loss {losses[name][0]:.4f} -> {losses[name][-1]:.4f}, "
              f"step {np.median(ts):.2f} ms median (IQR {np.percentile(ts, 25):.2f}-"
              f"{np.percentile(ts, 75):.2f}) over {len(ts)} steps")
    print(f"parameters after {args.steps + 2} steps: largest difference {worst:.3g} x eps x "
          f"max|leaf|, within class 3's bound of {testing.CODEGEN_ULPS} (two programs: "
          f"docs/bitwise.md); {'bitwise' if bitwise else 'not bitwise'} jax.lax.psum's step")
    if not worst <= testing.CODEGEN_ULPS:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
