"""How far apart the devices reach a blocking collective after compute, against the compute's
length (issue 73): the form of the step price's stagger term (`planner.stagger_s`).

    python benchmarks/sync_stagger.py [--rounds 20] [--out FILE]

Per segment length (a segment: `matmuls` of ``tanh(x @ w)`` on an `n`-square f32 block a
device), the probe's two programs (`libra_jax.calibrate.probe.sync_program`): K segments with a
blocking psum after each against the same compute with one psum after all, and the same with
none (the compute alone), in paired interleaved rounds. The synced form's extra time, less
its K - 1 extra calls at XLA's call cost (measured here by `probe.xla_rates`), over the square
roots its segments add (``K * sqrt(T) - sqrt(K * T)``, T the apart form's time over K), is the
stagger c of `probe.stagger_of`: where the devices drift as a random walk (their threads'
time slices on shared cores), c is the same for every segment length; where it drifts
otherwise, c moves with T. The probe measures one of these rows (256-square, one matmul, 16
segments) on every machine.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from report import ROOT, device_run, header, load_file, load_line, publish

common = load_file(ROOT / "examples" / "common.py", "common")  # (8 host devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from libra_jax.calibrate import probe  # noqa: E402

#: (segments K, block side n, matmuls a segment): segments from about 0.2 to 30 ms here.
CASES = ((32, 128, 1), (16, 192, 1), (16, 256, 1), (16, 384, 1), (16, 512, 1), (8, 256, 8),
         (6, 256, 24))


def compute_alone(n_segments: int, matmuls: int, mesh: Mesh):
    """The same compute with no collective (what the step's rates are measured over)."""
    def body(x):
        w = x * 0.05
        for _ in range(n_segments * matmuls):
            x = jax.numpy.tanh(x @ w)
        return x[:1]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("p"), out_specs=P("p")))


def main() -> None:
    a, before, devices, mesh = device_run(__doc__, rounds=20)
    call_s = probe.xla_rates().call_s
    rows = []
    for k, n, matmuls in CASES:
        block = np.random.default_rng(0).standard_normal((n * len(devices), n)) * 0.1
        x = jax.device_put(block.astype(np.float32), NamedSharding(mesh, P("p")))
        programs = {"synced": (probe.sync_program(jax, mesh, k, True, matmuls), x),
                    "apart": (probe.sync_program(jax, mesh, k, False, matmuls), x),
                    "alone": (compute_alone(k, matmuls, mesh), x)}
        times = probe.interleaved_times(programs, a.rounds, random.Random(0))
        c = probe.stagger_of(times["synced"], times["apart"], k, call_s)
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        diffs = np.asarray(times["synced"]) - np.asarray(times["apart"])
        segment = med["apart"] / k
        per_call = np.percentile(diffs, [10, 50, 90]) * 1e3 / (k - 1)
        rows.append(f"| {k} x {matmuls} x {n}-square | {segment:.2f} | {med['alone']:.1f} | "
                    f"{med['apart']:.1f} | {med['synced']:.1f} | {per_call[1]:.3f} "
                    f"({per_call[0]:.3f}-{per_call[2]:.3f}) | "
                    f"{c * 1e6 * 1e-3 ** 0.5:.0f} |")
    after = os.getloadavg()
    lines = [*header(f"; {len(devices)} host devices; XLA's call cost {call_s * 1e6:.0f} us "
                     f"(probe.xla_rates)"),
             load_line(before, after),
             f"{a.rounds} paired interleaved rounds a case after one that compiles; medians.", "",
             "| segments x matmuls x block | segment T ms | compute alone ms | one psum after "
             "all ms | a psum after each ms | extra a call ms (p10-p90) | c us per root ms |",
             "|---|---|---|---|---|---|---|", *rows]
    publish(lines, a.out)


if __name__ == "__main__":
    main()
