"""Where the block count changes a step on CPU: host device counts x block counts (issue 73).

The paper's trade-off needs compute and the collective to share a resource: on a 2-core VM
with 8 host devices no core is ever idle, so the allocation cannot matter there. This sweep
runs the examples on 2, 4 and 8 host devices (a child process per count: XLA's host device
count is fixed when JAX starts; `LIBRA_JAX_EXAMPLE_DEVICES`, examples/common.py) and times,
interleaved, per step: plain (`jax.jit(step)`, XLA's collectives), optimized (`optimize`'s
plan) and optimized with every bucket at a fixed block count k (`optimize(blocks=k)`, the
plan's fusion for that count), k in `--blocks`.

Per (device count, example) the table gives each arm's median per-step time and its per-round
ratio to plain (median, p10-p90) beside the model's predicted ratio (`explain(step,
blocks=k).predicted_ratio`, this machine's default profile), then three readings: whether the
block count matters (the slowest fixed count over the fastest, p10 above 1: beyond the
spread), what the model says of it (its slowest fixed count over its fastest), and whether
the plan is within the interval of the best fixed count (optimized over the fastest fixed
count, p10 at or below 1).

    python benchmarks/contention_sweep.py [--devices 2,4,8] [--only mlp,transformer]
        [--blocks 1,2,4,8] [--rounds 10] [--steps 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULT = "@@RESULT "


def child(name: str, blocks: list[int], rounds: int, steps: int) -> dict:
    """One example on this process's host devices: every arm's per-step seconds per round,
    the plan's block counts, and the model's predicted ratio to plain of each optimized arm
    (`explain(...).predicted_ratio`, this machine's default profile)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import interleaved_steps, load_file

    common = load_file(ROOT / "examples" / "common.py", "common")
    import jax

    import libra_jax

    step, args = common.load_example(name).build(False)
    planned = libra_jax.optimize(step)
    arms = {"plain": jax.jit(common.plain_step(step), donate_argnums=0),
            "optimized": jax.jit(planned, donate_argnums=0)}
    predicted = {"optimized": libra_jax.explain(step, *args, file=None).predicted_ratio}
    for k in blocks:
        arms[f"blocks={k}"] = jax.jit(libra_jax.optimize(step, blocks=k), donate_argnums=0)
        predicted[f"blocks={k}"] = libra_jax.explain(step, *args, blocks=k, file=None).predicted_ratio
    state = {k: common.copy_tree(args[0]) for k in arms}
    per_step = interleaved_steps(arms, state, args[1:], rounds, steps, common.WARMUP)
    plan = sorted({p.blocks for p in planned.last_report.plans if p.kind == "gradient"})
    return {"per_step": per_step, "plan": plan, "devices": len(jax.devices()),
            "predicted": predicted}


def _ratio_cells(num: list[float], den: list[float]) -> tuple[float, float, float]:
    r = np.asarray(num) / np.asarray(den)
    return float(np.median(r)), float(np.percentile(r, 10)), float(np.percentile(r, 90))


def table(results: dict[tuple[int, str], dict], blocks: list[int]) -> list[str]:
    arms = ["plain", "optimized"] + [f"blocks={k}" for k in blocks]
    lines = ["| host devices | example | plan's blocks | " + " | ".join(
        f"{a} ms (x plain, p10-p90; model)" for a in arms) + " | block count matters | the "
        "model's worst / best fixed count | plan within the best's interval |",
        "|" + "---|" * (len(arms) + 6)]
    for (n, name), res in sorted(results.items()):
        t = res["per_step"]
        cells = []
        model = res.get("predicted", {})
        for a in arms:
            med, lo, hi = _ratio_cells(t[a], t["plain"])
            said = f"; {model[a]:.3f}" if model.get(a) is not None else ""
            cells.append(f"{np.median(t[a]) * 1e3:.2f} ({med:.3f}, {lo:.3f}-{hi:.3f}{said})")
        fixed = {a: float(np.median(t[a])) for a in arms[2:]}
        best, worst = min(fixed, key=fixed.get), max(fixed, key=fixed.get)
        _, lo_w, hi_w = _ratio_cells(t[worst], t[best])
        matters = (f"yes: {worst} / {best} {lo_w:.3f}-{hi_w:.3f}" if lo_w > 1 else
                   f"no: {worst} / {best} {lo_w:.3f}-{hi_w:.3f}")
        said = {a: model[a] for a in arms[2:] if model.get(a) is not None}
        model_cell = (f"{max(said, key=said.get)} / {min(said, key=said.get)} "
                      f"{max(said.values()) / min(said.values()):.3f}" if said else "-")
        med_p, lo_p, hi_p = _ratio_cells(t["optimized"], t[best])
        within = (f"yes: / {best} {med_p:.3f} ({lo_p:.3f}-{hi_p:.3f})" if lo_p <= 1 else
                  f"no: / {best} {med_p:.3f} ({lo_p:.3f}-{hi_p:.3f})")
        lines.append(f"| {n} | {name} | {res['plan']} | " + " | ".join(cells)
                     + f" | {matters} | {model_cell} | {within} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--only", default="mlp,transformer", help="examples, comma-separated")
    parser.add_argument("--blocks", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="steps per arm per round")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    blocks = [int(k) for k in a.blocks.split(",")]
    if a.child:
        print(RESULT + json.dumps(child(a.child, blocks, a.rounds, a.steps)), flush=True)
        return
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results: dict[tuple[int, str], dict] = {}
    for n in (int(d) for d in a.devices.split(",")):
        for name in a.only.split(","):
            env = dict(os.environ, LIBRA_JAX_EXAMPLE_DEVICES=str(n))
            run = subprocess.run(
                [sys.executable, __file__, "--child", name, "--blocks", a.blocks,
                 "--rounds", str(a.rounds), "--steps", str(a.steps)],
                env=env, capture_output=True, text=True, timeout=1800)
            if run.returncode != 0:
                raise RuntimeError(f"{name} on {n} devices failed:\n{run.stderr[-3000:]}")
            line = next(x for x in run.stdout.splitlines() if x.startswith(RESULT))
            res = json.loads(line[len(RESULT):])
            assert res["devices"] == n, (res["devices"], n)
            results[(n, name)] = res
            print(f"{name} on {n} devices done", file=sys.stderr, flush=True)
    import jax
    head = [f"Command: `python benchmarks/contention_sweep.py {' '.join(sys.argv[1:])}`", "",
            f"Date: {datetime.date.today()}; jax {jax.__version__}; Python "
            f"{platform.python_version()}; {os.cpu_count()} CPU cores; load average {load} "
            f"before; {a.rounds} interleaved rounds of {a.steps} steps per arm, after "
            "warm-up; ms per step (median over rounds), then the per-round ratio to plain "
            "(median, p10-p90).", ""]
    text = "\n".join(head + table(results, blocks)) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
