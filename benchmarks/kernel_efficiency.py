"""How fast XLA:CPU runs the examples' kernels a FLOP, against the matmul rate the model prices
every contraction at (issue 73).

    python benchmarks/kernel_efficiency.py [--rounds 15] [--out FILE]

The model's compute is the roofline of a step's equations: a convolution's or a dot's FLOPs
at the probe's matmul rate (a chain of 256-square f32 matmuls). This times, on every CPU
device at once, each kernel of a list (the CNN example's two convolutions, forward, input
gradient and weight gradient; a weight gradient's contraction as autodiff writes it) against
a chain of 256-square matmuls of the same FLOPs, in paired rounds, and gives the time a FLOP
over the matmuls' (1: as priced; above: the roofline prices it too fast).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from report import ROOT, device_run, header, load_file, load_line, publish

common = load_file(ROOT / "examples" / "common.py", "common")  # (8 host devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

BATCH = 16  # the CNN example's images a device
MATMUL_N = 256
CALLS = 6  # kernel calls a timed round


def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def cases():
    """(name, function of (x, w), x's shape a device, w's shape, FLOPs a device)."""
    out = []
    for cin, cout, hw in ((3, 32, 32), (32, 64, 16)):  # the CNN example's convolutions
        flops = 2 * BATCH * hw * hw * cout * 9 * cin
        shape_x, shape_w = (BATCH, hw, hw, cin), (3, 3, cin, cout)
        label = f"conv {cin}->{cout} channels, {hw}x{hw}"
        out += [(f"{label}: forward", lambda x, w: conv(x, w)[:1, :1, :1], shape_x, shape_w, flops),
                (f"{label}: input gradient",
                 lambda x, w: jax.grad(lambda x: conv(x, w).sum())(x)[:1, :1, :1],
                 shape_x, shape_w, flops),
                (f"{label}: weight gradient",
                 lambda x, w: jax.grad(lambda w: conv(x, w).sum())(w)[None, :1, :1, :1, :1],
                 shape_x, shape_w, flops)]
    for rows, fin, fout in ((256, 128, 512), (256, 512, 128)):  # the transformer's MLP kernels
        flops = 2 * rows * fin * fout
        out.append((f"weight gradient {fin}x{fout} over {rows} rows, as autodiff writes it",
                    lambda x, dy: jax.lax.dot_general(dy, x, (((0,), (0,)), ((), ()))).T[None, :1],
                    (rows, fin), (rows, fout), flops))
        out.append((f"forward {rows}x{fin} @ {fin}x{fout}", lambda x, w: (x @ w)[:1],
                    (rows, fin), (fin, fout), flops))
    return out


def main() -> None:
    a, before, devices, mesh = device_run(__doc__, rounds=15)
    rng = np.random.default_rng(0)

    def put(shape, spec, per_device):
        full = (len(devices) * shape[0], *shape[1:]) if per_device else shape
        return jax.device_put((rng.standard_normal(full) * 0.1).astype(np.float32),
                              NamedSharding(mesh, spec))

    def matmuls(k):
        def body(x, w):
            for _ in range(k):
                x = jnp.tanh(x @ w)
            return x[:1, :1]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("p"), P()), out_specs=P("p")))

    mx, mw = put((MATMUL_N, MATMUL_N), P("p"), True), put((MATMUL_N, MATMUL_N), P(), False)
    rows = []
    for name, fn, shape_x, shape_w, flops in cases():
        sharded_w = len(shape_w) == 2 and shape_w[0] == shape_x[0]  # a gradient's dy: per device
        kernel = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("p"), P("p") if sharded_w else P()),
                                       out_specs=P("p"), check_vma=False))
        x, w = put(shape_x, P("p"), True), put(shape_w, P("p") if sharded_w else P(), sharded_w)
        k = max(1, round(flops * CALLS / (2 * MATMUL_N ** 3)))
        chain = matmuls(k)
        jax.block_until_ready(kernel(x, w))
        jax.block_until_ready(chain(mx, mw))
        ratios = []
        for r in range(a.rounds):
            order = [0, 1] if r % 2 else [1, 0]
            t = [0.0, 0.0]
            for i in order:
                start = time.perf_counter()
                if i == 0:
                    for _ in range(CALLS):
                        out = kernel(x, w)
                    jax.block_until_ready(out)
                else:
                    jax.block_until_ready(chain(mx, mw))
                t[i] = time.perf_counter() - start
            ratios.append((t[0] / (flops * CALLS)) / (t[1] / (k * 2 * MATMUL_N ** 3)))
        p10, mid, p90 = np.percentile(ratios, [10, 50, 90])
        rows.append(f"| {name} | {flops / 1e6:.1f} | {mid:.2f} ({p10:.2f}-{p90:.2f}) |")
    after = os.getloadavg()
    lines = [*header(f"; {len(devices)} host devices"),
             load_line(before, after),
             f"{a.rounds} paired interleaved rounds of {CALLS} kernel calls against a chain of "
             f"{MATMUL_N}-square matmuls of the same FLOPs, every device running; medians.", "",
             "| kernel (a device) | MFLOP a call | time a FLOP over the matmuls' (p10-p90) |",
             "|---|---|---|", *rows]
    publish(lines, a.out)


if __name__ == "__main__":
    main()
