"""The corpus of real-world-style train steps (tests/corpus.py): trained state and step time.

    python benchmarks/corpus.py [--steps 8] [--rounds 12] [--out benchmarks/results/corpus.md]

Per step, on 8 host devices, jitted with the state donated, trained `--steps` steps from the
same start:
* Libra vs its XLA control (the same rewritten program with XLA's all-reduce in place of
  Libra's calls, ``optimize(collectives="xla")``): bitwise equal state and metrics, required;
* plain vs optimized, and plain vs the drop-in (function swap, `libra_jax.patch_lax`): the
  largest difference over the state's leaves, in float32 ulps and relative terms; reported,
  under XLA's default flags and with FMA contraction off (``--xla_cpu_max_isa=AVX``, no FMA
  instructions), each in its own process;
* Libra calls (all-reduces, reduce-scatters and all-gathers) and XLA collectives left in the
  optimized program;
* optimized / plain step time: `--rounds` interleaved rounds of 4 steps per arm after warm-up;
  the median of the per-round ratio and its p10-p90.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import platform
import subprocess
import sys
import time
from pathlib import Path

from libra_jax.config import xla_flags

ROOT = Path(__file__).resolve().parents[1]
FLAGS = {"default": "", "no FMA contraction": "--xla_cpu_max_isa=AVX"}


def ulps(a, b):
    """Largest distance in float32 ulps between two float arrays (0 for other dtypes' equality)."""
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != np.float32:
        return 0 if a.tobytes() == b.tobytes() else float("inf")

    def ordered(x):
        i = x.view(np.int32).astype(np.int64)
        return np.where(i < 0, -(2 ** 31) - i, i)
    return int(np.max(np.abs(ordered(a) - ordered(b)))) if a.size else 0


def compare(sa, sb):
    """(largest ulps, its leaf's largest relative and absolute differences, the leaf's path)
    over the float leaves. Near zero (a gradient that is rounding noise, e.g. an attention key
    bias's) ulps and relative terms are large for tiny absolute differences: read all three."""
    import jax
    import numpy as np

    worst = (0, 0.0, 0.0, "")
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(sa)[0],
                                 jax.tree_util.tree_flatten_with_path(sb)[0]):
        a, b = np.asarray(a), np.asarray(b)
        if not np.issubdtype(a.dtype, np.floating):
            continue
        u = ulps(a.astype(np.float32), b.astype(np.float32))
        diff = np.abs(a.astype(np.float64) - b)
        rel = float(np.max(diff / np.maximum(np.abs(a), 1e-30)))
        if u > worst[0]:
            worst = (u, rel, float(np.max(diff)), jax.tree_util.keystr(path))
    return worst


def measure(steps: int, rounds: int) -> dict:
    """Run in a process whose XLA_FLAGS are set: every case's numbers."""
    import jax
    import numpy as np

    import libra_jax
    from report import load_file

    CASES = load_file(ROOT / "tests" / "corpus.py", "libra_corpus").CASES

    def fresh(tree):
        return jax.tree.map(np.array, tree)

    def jitted(fn, case):
        return jax.jit(fn, donate_argnums=0, static_argnames=case.static_argnames or None)

    def train(fn, case, n):
        state, metrics = fresh(case.state), []
        for _ in range(n):
            state, m = fn(state, *case.batch, **case.kwargs)
            metrics.append(m)
        return jax.block_until_ready(state), metrics

    out = {}
    for name, build in CASES.items():
        case = build()
        if case.library_jit is not None:  # nnx.jit, eqx.filter_jit: no .lower, no donation
            print(f"{name}: compiled by its library, not measured here (tests/test_corpus.py "
                  "checks it)", file=sys.stderr)
            continue
        swap = build(pmean=libra_jax.pmean)
        with case.context():
            arms = {"plain": jitted(case.step, case),
                    "optimized": jitted(libra_jax.optimize(
                        case.step, static_argnames=case.static_argnames), case),
                    "control": jitted(libra_jax.optimize(
                        case.step, collectives="xla", static_argnames=case.static_argnames),
                        case),
                    "swap": jitted(swap.step, swap)}
            with libra_jax.patch_lax():
                arms["patch"] = jitted(case.step, case)
                arms["patch"].lower(fresh(case.state), *case.batch, **case.kwargs)  # traced here
                states = {"patch": train(arms["patch"], case, steps)}
            for arm in ("plain", "optimized", "control", "swap"):
                states[arm] = train(arms[arm], swap if arm == "swap" else case, steps)
            text = arms["optimized"].lower(fresh(case.state), *case.batch,
                                           **case.kwargs).as_text()
            ratios, times = [], {"plain": [], "optimized": []}
            live = {k: fresh(case.state) for k in times}
            for r in range(rounds):
                per = {}
                for arm in (list(times) if r % 2 == 0 else list(times)[::-1]):
                    t0 = time.perf_counter()
                    for _ in range(4):
                        live[arm], _ = arms[arm](live[arm], *case.batch, **case.kwargs)
                    jax.block_until_ready(live[arm])
                    per[arm] = (time.perf_counter() - t0) / 4
                    times[arm].append(per[arm])
                ratios.append(per["optimized"] / per["plain"])
        s = {k: v[0] for k, v in states.items()}
        m = {k: v[1] for k, v in states.items()}
        bitwise = (all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in
                       zip(jax.tree.leaves((s["optimized"], m["optimized"])),
                           jax.tree.leaves((s["control"], m["control"])))))
        out[name] = {
            "control_bitwise": bitwise,
            "plain_vs_optimized": compare(s["plain"], s["optimized"]),
            "plain_vs_swap": compare(s["plain"], s["swap"]),
            "plain_vs_patch": compare(s["plain"], s["patch"]),
            "libra_calls": len(re.findall(
                r"custom_call @libra_(?:allreduce|reduce_scatter|all_gather)_cpu", text)),
            "xla_collectives": len(re.findall(
                r'"?stablehlo\.(?:all_reduce|reduce_scatter|all_gather)"?[ (]', text)),
            "plain_ms": float(np.median(times["plain"]) * 1e3),
            "optimized_ms": float(np.median(times["optimized"]) * 1e3),
            "ratio": float(np.median(ratios)),
            "ratio_p10_p90": [float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90))],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default=None)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print("RESULT " + json.dumps(measure(args.steps, args.rounds)))
        return 0
    load0 = os.getloadavg()
    results = {}
    for label, flag in FLAGS.items():
        env = {**os.environ,
               "XLA_FLAGS": xla_flags(8, f"{os.environ.get('XLA_FLAGS', '')} {flag}")}
        proc = subprocess.run([sys.executable, __file__, "--measure", "--steps", str(args.steps),
                               "--rounds", str(args.rounds)], env=env, capture_output=True,
                              text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        results[label] = json.loads(line[0][7:])
    import jax

    load1 = os.getloadavg()
    fmt = lambda w: ("bitwise" if w[0] == 0 else  # noqa: E731
                     f"{w[0]} ulp, rel {w[1]:.1e}, abs {w[2]:.1e} `{w[3]}`")
    cmd = "python benchmarks/corpus.py" + "".join(
        f" --{k} {getattr(args, k)}" for k in ("steps", "rounds")) + (
        f" --out {args.out}" if args.out else "")
    lines = [f"Command: `{cmd}`", "",
             f"Date: {datetime.date.today()}; jax {jax.__version__}; Python "
             f"{platform.python_version()}; {os.cpu_count()} CPU cores; 8 host devices; profile "
             f"`cpu-host`; {args.steps} steps trained per arm.",
             f"Load average (1/5/15 min) before: {'/'.join(f'{x:.1f}' for x in load0)}, after: "
             f"{'/'.join(f'{x:.1f}' for x in load1)}.", "",
             "Trained state after the steps: the float leaf with the largest difference in "
             "float32 ulps, with its largest relative and absolute differences. Required: "
             "Libra = its XLA control, bit for bit. Reported: plain against optimized and the "
             "drop-ins.", "",
             "| step | flags | Libra vs XLA control | plain vs optimized | plain vs drop-in "
             "(swap) | plain vs drop-in (patch_lax) |", "|---|---|---|---|---|---|"]
    for name in results["default"]:
        for label in FLAGS:
            r = results[label][name]
            lines.append(f"| {name} | {label} | {'bitwise' if r['control_bitwise'] else '**DIFFERS**'}"
                         f" | {fmt(r['plain_vs_optimized'])} | {fmt(r['plain_vs_swap'])} | "
                         f"{fmt(r['plain_vs_patch'])} |")
    lines += ["", "Program and step time (default flags; medians of interleaved rounds of 4 "
                  "steps).", "",
              "| step | Libra calls | XLA collectives left | plain ms | optimized ms | "
              "optimized / plain | p10-p90 |", "|---|---|---|---|---|---|---|"]
    for name, r in results["default"].items():
        lines.append(f"| {name} | {r['libra_calls']} | {r['xla_collectives']} | "
                     f"{r['plain_ms']:.2f} | {r['optimized_ms']:.2f} | {r['ratio']:.2f}x | "
                     f"{r['ratio_p10_p90'][0]:.2f}-{r['ratio_p10_p90'][1]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(r["control_bitwise"] for res in results.values() for r in res.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
