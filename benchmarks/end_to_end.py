"""End-to-end step time on 8 host CPU devices: plain (`jax.jit(step)`, XLA's all-reduce) vs
optimized (`jax.jit(libra_jax.optimize(step))`), for the examples in `examples/`.

The FSDP example is GSPMD code: its plain arm is the step with `jax.value_and_grad` (XLA's
partitioner inserts the all-gathers and reduce-scatters), its optimized arms the step through
`libra_jax.value_and_grad`; two more arms, the route with XLA's collectives (optimize's
control: what the route costs apart from the engine), ``prefetch=1`` and ``prefetch_bytes=0``
(each forward all-gather one call: the plan before they were grouped).

    python benchmarks/end_to_end.py [--rounds 12] [--steps 5] [--out benchmarks/results/end_to_end.md [--append]]

Each round times `--steps` consecutive steps of every arm, in an order that rotates from round to
round (interleaved, so drift hits every arm alike); the table gives the median per-step time over
rounds, its IQR, and the median and p10-p90 of the per-round ratio to plain. A third arm,
`optimize(fusion=False)`, separates the effect of fusion from that of the engine.

`--one-bucket` adds an arm planned with the profile's per-all-reduce latency raised to 1 s: every
gradient psum in one fused bucket, as XLA's all-reduce combiner does with the plain step's psums
(a probe of the model's fusion trade-off on this host, not a Libra plan).

The optimized arm is `optimize`'s default, overlap="auto": per bucket, one call or a start/done
pair, whichever the model prices lower (libra_jax/rewrite/buckets.py). `--modes` adds one arm per forced
mode: overlap="sync" (one call per bucket) and overlap="start-done" (each all-reduce joins its
round mid-backward and is waited for after the backward pass, libra_jax/ops/start_done.py).

`--ready` adds the arm with the old placement, `optimize(ready="written")` (each gradient
psum planned where the code wrote it: after the backward pass in the examples, which write
`pmean(jax.grad(...))`); `--ablation` adds one arm per fixed block count, `optimize(blocks=k)`
for k = 1, 2, 4, 8 (the plan's fusion for that count, every bucket at k): whether the
allocation matters once the plan overlaps the backward pass.

`--overlap` also runs one step per example with `LIBRA_JAX_DEBUG=1` in a subprocess and reads the
engine's per-call log: an all-reduce whose first rank arrived before the previous all-reduce
ended means that rank computed (the backward pass) while that all-reduce was in flight.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from report import interleaved_steps, load_file, spread  # noqa: E402

common = load_file(ROOT / "examples" / "common.py", "common")  # (8 host devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import libra_jax  # noqa: E402
from libra_jax import model  # noqa: E402

CONFIGS = [("mlp", {}), ("cnn", {}), ("transformer", {}), ("transformer", {"variant": "pmap"}),
           ("fsdp", {})]
LOG = re.compile(r"\[libra_jax\] .*?bytes=(\d+) blocks=(\d+) .*?first_arrival_us=(-?\d+) "
                 r"start_us=(-?\d+) end_us=(-?\d+)")


#: The fixed block counts `--ablation` times against the plan.
ABLATION_BLOCKS = (1, 2, 4, 8)


def label(name: str, options: dict) -> str:
    return name + "".join(f" ({v})" for v in options.values())


def one_bucket_profile() -> str:
    """The default CPU profile with a 1 s latency per all-reduce, as a file: plans one bucket."""
    doc = model.profile_to_dict(model.load_profile(model.default_profile("cpu")))
    doc["name"] += "-one-bucket"
    doc["network"]["base_latency_us"]["value"] = 1e6
    path = Path(tempfile.mkdtemp(prefix="libra_e2e_")) / "one-bucket.json"
    path.write_text(json.dumps(doc))
    return str(path)


def bench(name: str, options: dict, rounds: int, steps: int, one_bucket: bool = False,
          modes: bool = False, ready: bool = False, ablation: bool = False) -> dict:
    step, args = common.load_example(name).build(False, **options)
    arms = {"plain": jax.jit(common.plain_step(step), donate_argnums=0),
            "optimized": jax.jit(libra_jax.optimize(step), donate_argnums=0),
            "optimized, fusion=False": jax.jit(libra_jax.optimize(step, fusion=False),
                                               donate_argnums=0)}
    if common.plain_step(step) is not step:
        # A GSPMD step: plain is GSPMD's program; this arm is the route's with XLA's
        # collectives (optimize's control), which separates the route from the engine.
        arms["route, XLA's collectives"] = jax.jit(
            libra_jax.optimize(step, collectives="xla"), donate_argnums=0)
        arms["optimized, prefetch=1"] = jax.jit(libra_jax.optimize(step, prefetch=1),
                                                donate_argnums=0)
        # The forward all-gathers one call each (nothing held ahead of its use: no group),
        # the plan before they were grouped (issue 74).
        arms["optimized, prefetch_bytes=0"] = jax.jit(
            libra_jax.optimize(step, prefetch_bytes=0), donate_argnums=0)
    if one_bucket:
        arms["optimized, one bucket"] = jax.jit(
            libra_jax.optimize(step, profile=one_bucket_profile()), donate_argnums=0)
    if modes:
        for mode in ("sync", "start-done"):
            arms[f"optimized, {mode}"] = jax.jit(libra_jax.optimize(step, overlap=mode),
                                                 donate_argnums=0)
    if ready:
        arms["optimized, ready=written"] = jax.jit(libra_jax.optimize(step, ready="written"),
                                                   donate_argnums=0)
    if ablation:
        for k in ABLATION_BLOCKS:
            arms[f"optimized, blocks={k}"] = jax.jit(libra_jax.optimize(step, blocks=k),
                                                     donate_argnums=0)
    state = {k: common.copy_tree(args[0]) for k in arms}
    batch = args[1:]
    return interleaved_steps(arms, state, batch, rounds, steps, common.WARMUP)


def overlap(name: str, options: dict) -> str:
    """Run one example under LIBRA_JAX_DEBUG=1 and summarise its all-reduce timestamps."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
            "import common, jax, libra_jax\n"
            f"step, args = common.load_example({name!r}).build(False, **{options!r})\n"
            "for fusion in (True, False):\n"
            "    f = jax.jit(libra_jax.optimize(step, fusion=fusion)); s = common.copy_tree(args[0])\n"
            "    for i in range(3):\n"
            "        if i == 2: print('@@STEP', fusion, file=sys.stderr, flush=True)\n"
            "        s, l = f(s, *args[1:]); float(l)\n"
            "        if i == 2: print('@@END', file=sys.stderr, flush=True)\n")
    env = dict(os.environ, LIBRA_JAX_DEBUG="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900)
    if run.returncode != 0:  # A silent empty section would read as "no all-reduces".
        raise RuntimeError(f"the debug-log run of {name} failed:\n{run.stderr[-2000:]}")
    err = run.stderr
    out = []
    for part in err.split("@@STEP")[1:]:
        fusion = part.split()[0]
        part = part.split("@@END")[0]
        calls = [tuple(int(g) for g in m.groups()) for m in LOG.finditer(part)]
        calls.sort(key=lambda c: c[2])
        early = sum(1 for a, b in zip(calls, calls[1:]) if b[2] < a[4])
        in_flight = [a[4] - b[2] for a, b in zip(calls, calls[1:]) if b[2] < a[4]]
        spans = ", ".join(f"{c[0] / 2**10:.0f}KiB k={c[1]}: first {c[2] - calls[0][2]}, start "
                          f"{c[3] - calls[0][2]}, end {c[4] - calls[0][2]}" for c in calls[:6])
        # Every engine call (an FSDP step's all-gathers and reduce-scatters too).
        out.append(f"- {label(name, options)}, fusion={fusion}: {len(calls)} collective calls in a step; "
                   f"{early} of {max(len(calls) - 1, 0)} next calls had a rank arrive before "
                   f"the previous one ended (by up to {max(in_flight, default=0)} us). First calls "
                   f"(us from the step's first arrival): {spans}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="steps per arm per round")
    parser.add_argument("--only", default=None, help="one example name")
    parser.add_argument("--overlap", action="store_true", help="also read the engine's debug log")
    parser.add_argument("--one-bucket", action="store_true",
                        help="add an arm with every gradient psum in one bucket")
    parser.add_argument("--modes", action="store_true",
                        help="add arms with overlap='sync' and overlap='start-done'")
    parser.add_argument("--ready", action="store_true",
                        help="add the arm with the old placement, optimize(ready='written')")
    parser.add_argument("--ablation", action="store_true",
                        help="add arms with every bucket at a fixed block count (1, 2, 4, 8)")
    parser.add_argument("--out", default=None, help="write a markdown table here")
    parser.add_argument("--append", action="store_true",
                        help="add the table to --out as a section of its own (with its command, "
                             "date and load) instead of replacing the file")
    a = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    for name, options in CONFIGS:
        if a.only and a.only != name:
            continue
        t0 = time.perf_counter()
        res = bench(name, options, a.rounds, a.steps, a.one_bucket, a.modes, a.ready,
                    a.ablation)
        base = np.asarray(res["plain"])
        for arm, ts in res.items():
            ts = np.asarray(ts)
            ratio = ts / base
            rows.append(f"| {label(name, options)} | {arm} | {np.median(ts) * 1e3:.1f} | "
                        f"{spread(ts, (25, 75), 1e3, 1)} | {np.median(ratio):.2f} | "
                        f"{spread(ratio)} |")
            print(rows[-1], flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    notes = ""
    if a.overlap:
        notes = "\n".join(overlap(n, o) for n, o in CONFIGS if not a.only or a.only == n)
        print(notes)
    load_after = os.getloadavg()
    if a.out:
        cmd = "python benchmarks/end_to_end.py " + " ".join(sys.argv[1:])
        profile = model.default_profile("cpu")
        text = (f"Command: `{cmd}`\n\nDate: {datetime.date.today()}; jax {jax.__version__}; Python "
                f"{platform.python_version()}; {os.cpu_count()} CPU cores; 8 host devices; profile `{profile}`.\n"
                f"Load average (1/5/15 min) before: {'/'.join(f'{x:.1f}' for x in load_before)}, after: "
                f"{'/'.join(f'{x:.1f}' for x in load_after)} (other jobs shared the cores).\n"
                f"{a.rounds} interleaved rounds of {a.steps} steps per arm after {common.WARMUP} "
                f"warm-up steps; per-step times.\n\n"
                "| example | arm | median ms | IQR ms | ratio to plain | ratio p10-p90 |\n"
                "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
        if notes:
            text += "\nEngine debug log (one steady-state step, LIBRA_JAX_DEBUG=1):\n\n" + notes + "\n"
        if a.append and Path(a.out).exists():
            title = f"## {a.only or 'all examples'} ({datetime.date.today()})"
            text = Path(a.out).read_text().rstrip("\n") + f"\n\n{title}\n\n" + text
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
