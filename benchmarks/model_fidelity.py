"""Model fidelity: predicted vs measured step time of several all-reduce plans on 8 host devices.

For each workload (the examples of ``examples/`` that define ``build(small)``, plus a deeper MLP
built here) and each plan -- ``default`` (Horovod-style 64 MiB fusion, the largest block option),
``fusion-only`` (planner fusion at the largest option), ``unfused-min`` (one all-reduce per psum,
the smallest option), ``libra`` (the planner) and a few seeded random plans (random bucket cuts and
block counts) -- the plan is applied with ``libra_jax.optimize`` (the planner call is replaced by
the plan) and:

* predicted step time = the model's backward time of the plan (``planner.simulate``, as
  ``optimize`` reports it: of the buckets that run, after ``planner.within_reach`` cut those that
  cannot be one fused all-reduce) minus the backward compute it assumes, plus the **measured** time
  of the same step with its psums removed (forward, backward compute and update): i.e. measured
  compute plus the model's prediction of exposed communication, packing and contention. The
  psum-free step is the optimized step itself with every Libra all-reduce lowered to the identity
  (so it works under ``shard_map(check_vma=True)`` too, and is the same program otherwise);
* measured step time = the jitted step, all plans and the psum-free step interleaved in a
  shuffled order per repetition, median with a bootstrap 95% interval.

It prints and writes the per-plan error, Spearman's rho between predicted and measured times, and
whether the measured-best plan is among the model's top 2 (plans whose measured intervals overlap
the best one's count as ties), plus a scatter plot.

    python benchmarks/model_fidelity.py [--profile PATH] [--reps 15] [--random 3] [--out-dir DIR]

The machine's load average (``os.getloadavg``) is recorded before and after and written with the
results: on a shared machine it says how much the numbers are worth.

Without ``--profile`` it uses the default profile (the calibrated one if ``libra-jax calibrate``
has run, else ``cpu-host``).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import random
import sys
import time
from pathlib import Path

from libra_jax.config import xla_flags  # noqa: E402  (pure Python: JAX does not start)

os.environ["XLA_FLAGS"] = xla_flags(8)  # the caller's flags kept
ROOT = Path(__file__).resolve().parents[1]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import libra_jax  # noqa: E402
from libra_jax import calibrate, model, planner  # noqa: E402

ORIGINAL_PLAN = planner.plan
SKIPPED: list[str] = []  # workloads that could not be measured, and why


# --- Workloads ------------------------------------------------------------------------------------

def deep_mlp(layers: int = 8, width: int = 768, batch: int = 32):
    """A deeper MLP with plain SGD (built here): many gradient tensors, ~18 MiB of gradients."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    sizes = [256] + [width] * layers + [16]
    keys = jax.random.split(jax.random.key(1), len(sizes) - 1)
    params = [{"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
              for k, m, n in zip(keys, sizes[:-1], sizes[1:])]

    def loss_fn(params, x, y):
        for layer in params[:-1]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return jnp.mean((x @ params[-1]["w"] + params[-1]["b"] - y) ** 2)

    def local(state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(state, x, y)
        g = jax.lax.pmean(g, "data")
        return jax.tree.map(lambda p, g: p - 1e-2 * g, state, g), jax.lax.pmean(loss, "data")

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()),
                         check_vma=False)
    rng = np.random.default_rng(0)
    data = NamedSharding(mesh, P("data"))
    x = jax.device_put(rng.standard_normal((8 * batch, sizes[0]), np.float32), data)
    y = jax.device_put(rng.standard_normal((8 * batch, sizes[-1]), np.float32), data)
    return step, (params, x, y)


def workloads(names: list[str] | None) -> dict[str, tuple]:
    out = {}
    try:
        from report import load_file

        common = load_file(ROOT / "examples" / "common.py", "common")
        found = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if p.stem not in ("common", "demo"))
        for name in found:
            if names and name not in names:
                continue
            try:
                out[name] = common.load_example(name).build(False)
            except Exception as exc:  # noqa: BLE001 - report and go on with the others
                print(f"skipping example {name}: {exc}", file=sys.stderr)
    except ImportError as exc:
        print(f"examples/common.py not importable ({exc}); using the benchmark's own workloads", file=sys.stderr)
    if not names or "deep_mlp" in names:
        out["deep_mlp"] = deep_mlp()
    return out


# --- Plans ----------------------------------------------------------------------------------------

def plan_makers(n_random: int, seed: int) -> dict[str, object]:
    def default(layers, cost, **_):
        return planner.plan_default(layers, cost, blocks=max(cost.keys), fusion_bytes=planner.HOROVOD_FUSION_BYTES)

    def fusion_only(layers, cost, **_):
        return planner.plan_fusion_only(layers, cost, blocks=max(cost.keys))

    def unfused_min(layers, cost, **_):
        return planner.Plan([planner.Bucket(i, i, min(cost.keys)) for i in range(len(layers))], 0.0)

    def rand(r):
        def make(layers, cost, **_):
            rng = random.Random(seed * 1000 + r)
            n = len(layers)
            cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(4, n - 1)))) if n > 1 else []
            edges = [0, *cuts, n]
            return planner.Plan([planner.Bucket(a, b - 1, rng.choice(cost.keys))
                                 for a, b in zip(edges[:-1], edges[1:])], 0.0)
        return make

    makers = {"default": default, "fusion-only": fusion_only, "unfused-min": unfused_min, "libra": None}
    for r in range(n_random):
        makers[f"random-{r}"] = rand(r)

    def unpatched(make):  # the baselines call planner.plan themselves: the real one
        def run(*a, **kw):
            with patched(planner, "plan", ORIGINAL_PLAN):
                return make(*a, **kw)
        return run
    return {k: (unpatched(v) if v else None) for k, v in makers.items()}


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def identity_all_reduces():
    """Lower every Libra all-reduce (single and fused) to the identity on CPU while inside
    (fused buckets still pack and split)."""
    from libra_jax.ops import lowering

    return lowering.replaced_rule("cpu", lambda ctx, x, **_: [x])


def compile_variants(step, args, profile, makers):
    """name -> (compiled fn, predicted exposure s or None, plan summary)."""
    out = {}
    for name, maker in makers.items():
        opt = libra_jax.optimize(step, profile=profile)
        ctx = patched(planner, "plan", maker) if maker else contextlib.nullcontext()
        with ctx:
            compiled = jax.jit(opt).lower(*args).compile()
        rep = opt.last_report
        exposure = sum(p["backward_s"] - sum(l.compute_s for l in p["layers"]) for p in rep.predicted)
        buckets = [b for p in rep.predicted for b in p["buckets"]]
        ks = [p.blocks for p in rep.plans if p.kind == "gradient"]
        out[name] = (compiled, exposure, f"{len(buckets)} buckets, blocks {'/'.join(map(str, ks))}")
    # The same optimized step with its all-reduces lowered to the identity. A reduce-scatter
    # or an all-gather has no identity of its shape: such a step (FSDP) is not measured here
    # (lowering it so is an invalid module, which jaxlib's verifier may hang on reporting).
    opt = libra_jax.optimize(step, profile=profile)
    jax.jit(opt).lower(*args)
    kinds = {p.collective for p in opt.last_report.plans} - {"all-reduce"}
    if kinds:
        raise ValueError(f"its {', '.join(sorted(kinds))}s have no identity stand-in "
                         "(the psum-free baseline replaces all-reduces only)")
    with identity_all_reduces():
        out["no-psum"] = (jax.jit(opt).lower(*args).compile(), None, "all-reduces removed (identity)")
    return out


# --- Measurement ----------------------------------------------------------------------------------

def measure(variants, args, reps: int, seed: int) -> dict[str, list[float]]:
    times = {k: [] for k in variants}
    rng = random.Random(seed)
    for rep in range(reps + 2):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            fn = variants[name][0]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
    return times


def spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic) if len(a) > 2 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="profile name or path (default: the default profile)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--random", type=int, default=3)
    ap.add_argument("--examples", default=None, help="comma-separated workloads (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ns = ap.parse_args()
    ns.load_before = os.getloadavg()
    jax.config.update("jax_num_cpu_devices", 8)
    profile = ns.profile or model.default_profile("cpu")
    prof = model.load_profile(profile)
    loads = workloads(ns.examples.split(",") if ns.examples else None)
    makers = plan_makers(ns.random, ns.seed)
    rows = []
    for wname, (step, args) in loads.items():
        print(f"== {wname}", file=sys.stderr, flush=True)
        try:
            variants = compile_variants(step, args, prof, makers)
        except ValueError as exc:  # report and go on with the others
            jax.clear_caches()
            SKIPPED.append(f"{wname}: {str(exc).splitlines()[0][:160]}")
            print(f"skipping {wname}: {exc}", file=sys.stderr)
            continue
        times = measure(variants, args, ns.reps, ns.seed)
        base = np.median(times["no-psum"])
        for name, (_, exposure, summary) in variants.items():
            med, lo, hi = calibrate.median_ci(times[name])
            if exposure is None:
                rows.append(dict(workload=wname, plan=name, summary=summary, pred=np.nan, meas=med, lo=lo, hi=hi,
                                 err=np.nan, exposure=np.nan))
                continue
            pred = base + exposure
            rows.append(dict(workload=wname, plan=name, summary=summary, pred=pred, meas=med, lo=lo, hi=hi,
                             err=pred / med - 1, exposure=exposure))
    ns.load_after = os.getloadavg()
    write(rows, ns, prof, profile)


def write(rows, ns, prof, profile) -> None:
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/model_fidelity.py " + " ".join(sys.argv[1:])
    lines = ["# Model fidelity: predicted vs measured step time", "",
             f"Command: `{cmd}`  ", f"Date: {datetime.date.today().isoformat()}  ",
             f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores "
             f"(shared, noisy), 8 host CPU devices, jax {jax.__version__}, Python {platform.python_version()}  ",
             f"Load average (1/5/15 min) before: {'/'.join(f'{x:.1f}' for x in ns.load_before)}, after: "
             f"{'/'.join(f'{x:.1f}' for x in ns.load_after)} (other jobs shared the 2 cores)  ",
             f"Profile: `{prof.name}` ({profile})", "",
             "Predicted = measured step with its all-reduces lowered to the identity + the model's exposed "
             "communication, packing and contention (`planner.simulate` backward time minus its compute). Measured: "
             "median of the step, bootstrap 95% interval; all variants interleaved.", ""]
    summary_lines = []
    abs_errs = []
    for wname in dict.fromkeys(r["workload"] for r in rows):
        wr = [r for r in rows if r["workload"] == wname]
        plans = [r for r in wr if np.isfinite(r["pred"])]
        lines += [f"## {wname}", "", "| plan | buckets / blocks | predicted ms | measured ms (95% CI) | error |",
                  "|---|---|---:|---:|---:|"]
        for r in wr:
            pred = f"{r['pred'] * 1e3:.2f}" if np.isfinite(r["pred"]) else "-"
            err = f"{r['err'] * 100:+.1f}%" if np.isfinite(r["err"]) else "-"
            lines.append(f"| {r['plan']} | {r['summary']} | {pred} | {r['meas'] * 1e3:.2f} "
                         f"({r['lo'] * 1e3:.2f}-{r['hi'] * 1e3:.2f}) | {err} |")
        rho = spearman([r["pred"] for r in plans], [r["meas"] for r in plans])
        best = min(plans, key=lambda r: r["meas"])
        ties = {r["plan"] for r in plans if r["lo"] <= best["hi"]}
        top2 = [r["plan"] for r in sorted(plans, key=lambda r: r["pred"])[:2]]
        hit = bool(ties & set(top2))
        med_err = float(np.median([abs(r["err"]) for r in plans]))
        abs_errs += [abs(r["err"]) for r in plans]
        s = (f"{wname}: median |error| {med_err * 100:.1f}%, Spearman rho {rho:.2f}, measured-best {best['plan']} "
             f"(ties: {', '.join(sorted(ties))}); model's top 2: {', '.join(top2)} -> "
             f"{'hit' if hit else 'miss'}")
        summary_lines.append(s)
        lines += ["", s, ""]
    overall = (f"Overall: median |error| {np.median(abs_errs) * 100:.1f}% over {len(abs_errs)} plans "
               f"(target <= 15%)")
    skipped = ["", "Not measured:", ""] + [f"- {s}" for s in SKIPPED] if SKIPPED else []
    lines = (lines[:10] + ["## Headline", "", overall, ""] + [f"- {s}" for s in summary_lines] + skipped + [""]
             + lines[10:])
    text = "\n".join(lines) + "\n"
    (out_dir / "model_fidelity.md").write_text(text)
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 5))
        for wname in dict.fromkeys(r["workload"] for r in rows):
            wr = [r for r in rows if r["workload"] == wname and np.isfinite(r["pred"])]
            x = np.array([r["meas"] for r in wr]) * 1e3
            y = np.array([r["pred"] for r in wr]) * 1e3
            xerr = np.array([[r["meas"] - r["lo"], r["hi"] - r["meas"]] for r in wr]).T * 1e3
            ax.errorbar(x, y, xerr=xerr, fmt="o", label=wname, capsize=2)
            for r, xi, yi in zip(wr, x, y):
                ax.annotate(r["plan"], (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points")
        lim = [0, max(max(r["meas"] for r in rows), np.nanmax([r["pred"] for r in rows])) * 1.1e3]
        ax.plot(lim, lim, "k--", lw=0.8, label="predicted = measured")
        ax.plot(lim, [v * 1.15 for v in lim], ":", color="grey", lw=0.8)
        ax.plot(lim, [v * 0.85 for v in lim], ":", color="grey", lw=0.8, label="+-15%")
        ax.set_xlabel("measured step time (ms, median, 95% CI)")
        ax.set_ylabel("predicted step time (ms)")
        ax.set_title(f"Model fidelity ({prof.name}, 8 host devices)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "model_fidelity.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no scatter plot", file=sys.stderr)


if __name__ == "__main__":
    main()
