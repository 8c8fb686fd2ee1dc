"""XLA:CPU's all-reduce by operand size and count: what the machine probe's XLA terms
(`libra_jax.calibrate.probe.xla_rates`) stand for, and why they are timed over several operands.

    python benchmarks/xla_operands.py [--rounds 9] [--out FILE]

Each arm is `jax.lax.psum` of K operands of S bytes a device in one jitted `jax.shard_map` over
the 8 host devices (XLA's combiner makes one all-reduce of K operands, as of a plain step's
gradients), less the same program without the psum; interleaved rounds, medians, the p10-p90
of the difference over rounds. The table gives the time and the bytes a device a second.
"""
from __future__ import annotations

import argparse
import os
import random

from report import header, publish, spread

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from libra_jax.calibrate.probe import interleaved_times, psum_program

MIB = 1 << 20
#: (bytes an operand a device, operands): one operand up to 16 MiB, then 4 and 16 of them.
GRID = [(1024, 1), (1024, 16), (MIB, 1), (4 * MIB, 1), (8 * MIB, 1), (16 * MIB, 1),
        (MIB // 4, 4), (MIB, 4), (2 * MIB, 4), (4 * MIB, 4), (MIB // 4, 16), (MIB, 16)]


def _size(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB" if nbytes >= MIB // 4 else f"{nbytes / 1024:g} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    devices = jax.devices("cpu")
    mesh = Mesh(np.array(devices), ("p",))
    load_before = os.getloadavg()
    arms = {}
    for nbytes, operands in GRID:
        x = jax.device_put(np.ones(nbytes // 4 * len(devices), np.float32),
                           NamedSharding(mesh, P("p")))
        for reduce in (True, False):
            arms[(nbytes, operands, reduce)] = (
                psum_program(jax, mesh, nbytes // 4, operands, reduce), x)
    times = interleaved_times(arms, args.rounds, random.Random(0))  # after a round that compiles
    lines = header(f"; {len(devices)} host devices")
    lines += [f"Load average (1/5/15 min) before: {'/'.join(f'{v:.1f}' for v in load_before)}, "
              f"after: {'/'.join(f'{v:.1f}' for v in os.getloadavg())}.",
              f"{args.rounds} interleaved rounds after one that compiles; per arm the psum's "
              "program less the same program without it.", "",
              "| a device's operand | operands | a device's bytes | psum ms (median) | p10-p90 ms "
              "| GB/s a device |", "|---|---|---|---|---|---|"]
    for nbytes, operands in GRID:
        diff = np.asarray(times[(nbytes, operands, True)]) - np.asarray(times[(nbytes, operands, False)])
        median = float(np.median(diff))
        total = nbytes * operands
        lines.append(f"| {_size(nbytes)} | {operands} | {_size(total)} | {median * 1e3:.2f} | "
                     f"{spread(diff, scale=1e3)} | {total / median / 1e9:.2f} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
