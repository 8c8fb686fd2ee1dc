"""Calibration's profile: the fits applied to the measured samples (`analyse`), and the profile
document built from them (`build_profile`), every number with its provenance; `summary` says it
in a few lines."""
from __future__ import annotations

import copy
import datetime
import functools
import math
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from libra_jax import collectives, model, planner
from libra_jax.calibrate.fit import (
    SOFTMIN_P,
    Fit,
    alone_time_s,
    call_differences,
    fit_alone,
    fit_call_terms,
    fit_fair_share,
    host_cores,
    median_ci,
    relative_errors,
    slowdown_from_windows,
)
from libra_jax.calibrate.measure import CALL_PROFILE, Budget, Samples, chain_bytes, chain_flop
from libra_jax.model.probe import XlaRates


def _medians(rows: Iterable[dict], keys: Sequence[str], value: str) -> dict[tuple, list[float]]:
    out: dict[tuple, list[float]] = {}
    for r in rows:
        if value in r:
            out.setdefault(tuple(r[k] for k in keys), []).append(r[value])
    return out


def analyse(samples: Samples, workers: int, budget: Budget, seed: int = 0,
            cores: float | None = None) -> dict[str, Any]:
    """Fit the model to the samples; returns the parameters, fit errors, intervals and summaries.

    ``cores`` is the host's core count ``P`` (default: `host_cores`).
    """
    rng = np.random.default_rng(seed)
    P = float(cores or host_cores())
    result: dict[str, Any] = {"cores": P}

    # Compute chains alone: window medians -> peak rates.
    base = {wl: median_ci([s["window_s"] for s in samples.overlap if s["workload"] == wl and s["bytes"] is None])
            for wl in ("matmul", "stream")}
    flops, stream_traffic = chain_flop(budget), chain_bytes(budget)
    result["peak"] = {
        "matmul_chain_s": base["matmul"], "stream_chain_s": base["stream"],
        "flop_per_s": [flops / base["matmul"][0], flops / base["matmul"][2], flops / base["matmul"][1]],
        "memory_bytes_per_s": [stream_traffic / base["stream"][0], stream_traffic / base["stream"][2],
                               stream_traffic / base["stream"][1]],
    }

    # Slowdown per workload and block count, then one fair-share curve for both workloads.
    ks = list(budget.blocks)
    rows = {(wl, k): [s for s in samples.overlap if s["workload"] == wl and s["blocks"] == k and "inside_s" in s]
            for wl in ("matmul", "stream") for k in ks}

    def slowdowns(pick: Callable[[list], list]) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for wl in ("matmul", "stream"):
            C = base[wl][0]
            out[wl] = {}
            for k in ks:
                chosen = pick(rows[(wl, k)])
                out[wl][k] = slowdown_from_windows([s["window_s"] - C for s in chosen],
                                                   [s["inside_s"] for s in chosen])
        return out

    def share_fit(slow: dict[str, dict[int, float]]) -> Fit:
        return fit_fair_share(ks * 2, [slow["matmul"][k] for k in ks] + [slow["stream"][k] for k in ks], P)

    slow = slowdowns(lambda r: r)
    share = share_fit(slow)
    boot_d = [share_fit(slowdowns(lambda r: [r[i] for i in rng.integers(0, len(r), len(r))] if r else r))
              .params["compute_threads"] for _ in range(budget.bootstrap)]
    share.ci = {"compute_threads": (float(np.percentile(boot_d, 2.5)), float(np.percentile(boot_d, 97.5)))}
    D = share.params["compute_threads"]
    result["slowdown"] = {"matmul": {str(k): v for k, v in slow["matmul"].items()},
                          "stream": {str(k): v for k, v in slow["stream"].items()},
                          "fair_share_fit": share.as_json()}

    # All-reduce times, alone and overlapped (those that ended inside the compute window), on
    # the cores their workers get: min(k, P) alone, k min(1, P / (D + k)) beside compute. One
    # fit of both: alone, one worker may already reach the cap L, so only the overlapped times
    # (a fraction of a core per worker) pin the per-worker rate beta.
    alone = _medians(samples.alone, ("bytes", "blocks"), "seconds")
    inside = [s for s in samples.overlap if s.get("ended_inside")]
    ov = _medians(inside, ("bytes", "blocks"), "seconds")
    points = [("alone", c, alone[c], min(float(c[1]), P)) for c in sorted(alone)]
    points += [("overlap", c, ov[c], c[1] * min(1.0, P / (D + c[1]))) for c in sorted(ov)]
    med = [median_ci(p[2]) for p in points]

    def time_fit(pick: Callable[[int], float], sharpness: float | None = SOFTMIN_P) -> Fit:
        return fit_alone([p[1][0] for p in points], [p[3] for p in points], [pick(i) for i in range(len(points))],
                         workers, softmin_p=sharpness)

    solo = time_fit(lambda i: med[i][0])
    free = time_fit(lambda i: med[i][0], None)  # p fitted too: what fixing it costs, same samples
    boots = [time_fit(lambda i: float(np.median(rng.choice(points[i][2], len(points[i][2]))))).params
             for _ in range(budget.bootstrap)]
    solo.ci = {k: (float(np.percentile([b[k] for b in boots], 2.5)), float(np.percentile([b[k] for b in boots], 97.5)))
               for k in solo.params if k not in FIXED_PARAMETERS}
    sp = solo.params
    pred = alone_time_s(np.array([p[1][0] for p in points], float), np.array([p[3] for p in points]), workers,
                        sp["beta_bytes_per_s"], sp["link_bytes_per_s"], sp["softmin_p"], sp["latency_s"])

    def part(kind: str) -> tuple[list[dict], float, float]:
        idx = [i for i, p in enumerate(points) if p[0] == kind]
        rows_ = [{"bytes": points[i][1][0], "blocks": points[i][1][1], "cores": points[i][3],
                  "seconds": med[i][0], "ci95": list(med[i][1:]), "predicted_s": float(pred[i])} for i in idx]
        if not idx:
            return rows_, math.nan, math.nan
        return (rows_, *relative_errors(pred[idx], np.array([med[i][0] for i in idx])))

    skew = float(np.median([s["skew_s"] for s in samples.alone]))
    a_rows, a_rms, a_max = part("alone")
    o_rows, o_rms, o_max = part("overlap")
    result["alone"] = {"fit": solo.as_json(), "arrival_skew_s": skew, "medians": a_rows,
                       "rms_rel_error": a_rms, "max_rel_error": a_max,
                       "free_softmin_p_fit": free.as_json()}
    result["overlap"] = {"prediction": {"rms_rel_error": o_rms, "max_rel_error": o_max}, "medians": o_rows,
                         "ended_inside_fraction": len(inside) / max(1, sum("seconds" in s for s in samples.overlap))}

    # Calls: paired (same repetition) train-step times, one call per gradient minus one call for
    # all, for few big and many small gradients, and the plans `optimize` made of them; the call
    # terms are fitted against the model's prediction of the same plans (`call_terms`), once the
    # rest of the profile is known (`build_profile`).
    result["calls"] = {"diffs_s": {k: v.tolist() for k, v in call_differences(samples.calls).items()},
                       "plans": dict(samples.call_plans)}
    return result


def call_terms(analysis: dict[str, Any], draft: dict[str, Any], workers: int, *, n_boot: int = 40,
               seed: int = 0) -> dict[str, Any]:
    """`fit.fit_call_terms` on the calls train steps of `analysis`, predicted by the profile
    `draft` (a document, its call terms to be fitted) for `workers` ranks. The plans' layers
    were priced by `measure.CALL_PROFILE`'s roofline: their compute is scaled to the draft's
    matmul rate (the steps are matmul-bound MLPs)."""
    plans = analysis["calls"]["plans"]
    scale = (model.load_profile(CALL_PROFILE).device.flop_per_s()
             / model.profile_from_dict(draft).device.flop_per_s())

    def plan_of(shape: str, fused: bool) -> tuple[list[planner.Layer], list[planner.Bucket]]:
        p = plans[f"{'fused' if fused else 'per-tensor'}, {shape}"]
        return ([planner.Layer(c * scale, int(b)) for c, b in p["layers"]],
                [planner.Bucket(*b) for b in p["buckets"]])

    arms = {(shape, fused): plan_of(shape, fused) for shape in ("big", "small") for fused in (False, True)
            if f"{'fused' if fused else 'per-tensor'}, {shape}" in plans}

    @functools.cache
    def cost(call_s: float, efficiency: float) -> planner.CostModel:
        doc = copy.deepcopy(draft)
        doc["fair_share"]["call_us"]["value"] = call_s * 1e6
        doc["fair_share"]["overlap_block_efficiency"]["value"] = efficiency
        return model.derive(model.profile_from_dict(doc), workers).cost

    def predict(shape: str, call_s: float, efficiency: float) -> float:
        c = cost(call_s, efficiency)
        return (planner.simulate(*arms[(shape, False)], c) - planner.simulate(*arms[(shape, True)], c))

    diffs = {k: np.asarray(v) for k, v in analysis["calls"]["diffs_s"].items()
             if (k, False) in arms and (k, True) in arms}
    fair = model.profile_from_dict(draft).fair_share
    assert fair is not None
    # Where the host's compute threads fill its cores, the model prices no worker beside
    # running compute (a reduction runs while the other devices wait): the efficiency is kept.
    kept = (fair.overlap_block_efficiency
            if model.fair_share_oversubscribed(fair.compute_threads, fair.cores) else None)
    return fit_call_terms(diffs, predict, n_boot=n_boot, seed=seed, efficiency=kept)


#: What calibration does not measure, carried over from the shipped CPU profile (as
#: assumptions, with its reference): the cost of a pending all-reduce (`optimize(overlap=
#: "auto")`), XLA's own all-reduce where it was not measured (`build_profile`'s ``xla``: the
#: plain step `planner.StepPrice` prices against), and each other kind's time against
#: the all-reduce's (its row's traffic key: `model.collective_traffic`, measured by
#: benchmarks/sharded_cpu.py).
CARRIED_OVER = ("pending_allreduce_us", "xla_allreduce_call_us", "xla_allreduce_gbyte_per_s",
                "sync_stagger_us_per_root_ms",
                *(row.traffic_key for row in collectives.ROWS if row.traffic_key is not None))


def _xla_terms(xla: XlaRates) -> dict[str, dict[str, Any]]:
    """The fair-share fields of XLA's all-reduce, as `xla` measured them."""
    how = ("measured by libra-jax calibrate (libra_jax.calibrate.probe.xla_rates: jax.lax.psum in "
           "a jitted shard_map over the calibrated devices; {0})")
    return {"xla_allreduce_call_us": _q(xla.call_s * 1e6, "measured", how.format(
                "one more operand of a combined all-reduce")),
            "xla_allreduce_gbyte_per_s": _q(xla.bytes_per_s / model.BYTES_PER_GBYTE, "measured",
                                            how.format("bytes per rank a second, output written")),
            **({} if xla.sync_stagger is None else {"sync_stagger_us_per_root_ms": _q(
                xla.sync_stagger / model.S_PER_US * model.S_PER_MS ** 0.5, "measured",
                "measured by libra-jax calibrate (libra_jax.calibrate.probe.sync_stagger: the "
                "last device's lag at a psum after compute, per root ms of that compute)")})}


def _shipped_q(key: str) -> dict | None:
    """The shipped CPU profile's ``fair_share.<key>``, carried over: calibration does not
    measure it; None where the shipped profile has none either (a kind's traffic not yet
    measured: derived from the memory it moves)."""
    shipped = model.load_profile(model.PROFILE_DIR / "cpu-host.json").sources
    q = shipped.get(f"fair_share.{key}")
    if q is None:
        return None
    return _q(q.value, "assumption", f"not calibrated; from the shipped cpu-host profile: {q.ref}")


def _q(value: Any, source: str, ref: str) -> dict[str, Any]:
    return {"value": value, "source": source, "ref": ref}


def build_profile(analysis: dict[str, Any], *, workers: int, budget: Budget, samples: Samples | None,
                  backend: str = "cpu", meta: dict[str, Any] | None = None,
                  xla: XlaRates | None = None) -> dict[str, Any]:
    """The profile document (``fair-share`` form; valid for `libra_jax.model.profile_from_dict`);
    XLA's all-reduce terms `xla` where measured (`probe.xla_rates`), else carried over."""
    solo = analysis["alone"]["fit"]["params"]
    share = analysis["slowdown"]["fair_share_fit"]["params"]
    flop = analysis["peak"]["flop_per_s"][0]
    mem = analysis["peak"]["memory_bytes_per_s"][0]
    latency_q = _q(solo["latency_s"] * 1e6, "measured",
                   "fitted intercept of the alone times (the engine's own latency; the ranks' arrival "
                   "and hand-offs in a step are call_us)")
    cal = "measured by libra-jax calibrate"
    doc: dict[str, Any] = {
        "schema_version": model.SCHEMA_VERSION,
        "name": f"{backend}-calibrated",
        "form": "fair-share",
        "description": f"Calibrated on {workers} {backend} devices by `libra-jax calibrate` "
                       f"({(meta or {}).get('date', '')}).",
        "notes": [
            "Measured: in-place all-reduce time vs bytes x blocks alone and while compute runs, compute slowdown "
            "vs blocks (matmul-bound and memory-bound chains), sustained matmul FLOP/s and streaming bandwidth "
            "per device with every device running, and what a call costs in a train step (call_us, "
            "overlap_block_efficiency: fitted against the model's prediction of the same plans).",
            "Peak rates are the sustained rates of XLA's kernels, so the efficiencies are 1.",
            f"Latency is for {workers} ranks (base_latency_us; the per-step latency is not separated); the ranks' "
            "arrival skew is not in it (a step's time contains it with or without all-reduces).",
            "The NIC and inter-node latency cannot be measured on one host: assumptions.",
        ],
        "device": {
            "name": f"{backend} device ({platform.processor() or platform.machine()})",
            "compute_unit_kind": "core",
            "compute_units": _q(max(1, round(analysis["cores"])), "measured", "cores this process may run on"),
            "peak_dense_tflop_per_s": {
                "fp32": _q(flop / model.FLOP_PER_TFLOP, "measured",
                           f"{budget.matmul_n}^2 f32 matmul chain, all devices"),
                "bf16": _q(flop / model.FLOP_PER_TFLOP, "assumption", "as fp32 (not measured)"),
            },
            "memory_gbyte_per_s": _q(mem / model.BYTES_PER_GBYTE, "measured", "streaming a*c+1 chain, all devices"),
            "compute_efficiency": _q(1.0, "measured", "the peak above is already sustained"),
            "memory_efficiency": _q(1.0, "measured", "the bandwidth above is already sustained"),
            "default_dtype": "fp32",
        },
        "network": {
            "devices_per_node": _q(workers, "measured", "devices of this host"),
            "intra_node_gbyte_per_s": _q(solo["link_bytes_per_s"] / model.BYTES_PER_GBYTE, "measured",
                                         "fitted bus bandwidth cap L"),
            "nic_gbit_per_s": _q(25, "assumption", "not measurable on one host"),
            "base_latency_us": latency_q,
            "intra_node_step_latency_us": _q(0, "measured", "folded into base_latency_us"),
            "inter_node_step_latency_us": _q(15, "assumption", "not measurable on one host"),
        },
        "fair_share": {
            "block_options": _q(list(budget.blocks), "measured", "block counts calibrated"),
            "threads_per_block": _q(1, "assumption", "one engine worker task per block"),
            "per_block_gbyte_per_s": _q(solo["beta_bytes_per_s"] / model.BYTES_PER_GBYTE, "measured", cal),
            "softmin_p": _q(solo["softmin_p"], "assumption",
                            "fixed (calibrate.fit.SOFTMIN_P): the data pin beta and L, not p as well"),
            "cores": _q(analysis["cores"], "measured", "CPUs this process may run on"),
            "compute_threads": _q(share["compute_threads"], "measured",
                                  "fitted: slowdown max(1, (D+k)/P) / max(1, D/P) of both chains"),
            "fusion_copy_gbyte_per_s": _q(None, "assumption", FUSION_COPY_NONE),
            "overlap_block_efficiency": _q(1.0, "assumption", "not fitted"),
            "call_us": _q(0.0, "assumption", "not fitted"),
            **{key: q for key in CARRIED_OVER if (q := _shipped_q(key)) is not None},
            **(_xla_terms(xla) if xla is not None else {}),
        },
        "calibration": {
            **(meta or {}),
            "workers": workers,
            "budget": {"sizes": list(budget.sizes), "overlap_sizes": list(budget.overlap_sizes),
                       "blocks": list(budget.blocks), "reps": budget.reps, "calls_bytes": budget.calls_bytes,
                       "calls_tensors": budget.calls_tensors, "calls_small_bytes": budget.calls_small_bytes,
                       "calls_small_tensors": budget.calls_small_tensors},
            "analysis": analysis,
            "samples": ({"alone": samples.alone, "overlap": samples.overlap, "calls": samples.calls}
                        if samples else {}),
        },
    }
    if analysis.get("calls", {}).get("plans"):
        fit = call_terms(analysis, doc, workers, n_boot=budget.bootstrap)
        analysis["calls"]["fit"] = fit
        what = ("train steps through optimize, one call per gradient (each issued where it is ready) "
                "against one call for all, " + " and ".join(
                    f"{int(b) >> 10} KiB in {t} gradients" for b, t in _call_shapes(budget))
                + ", paired; fitted against the model's prediction of the same plans")
        call_s, efficiency = fit["call_s"], fit["efficiency"]
        fair = doc["fair_share"]
        fair["call_us"] = _q(call_s[0] * 1e6, "measured", f"{what} (95% CI {call_s[1] * 1e6:.0f}-"
                                                            f"{call_s[2] * 1e6:.0f} us)")
        if fit.get("efficiency_fitted", True):
            fair["overlap_block_efficiency"] = _q(
                efficiency[0], "measured", f"{what} (95% CI {efficiency[1]:.2f}-{efficiency[2]:.2f})")
        else:
            fair["overlap_block_efficiency"] = _q(
                efficiency[0], "assumption", "not fitted: the compute threads fill the cores, "
                "where a reduction runs while the other devices wait, beside no running compute "
                "(libra_jax.model.fair_share_oversubscribed)")
    return doc


def _call_shapes(budget: Budget) -> list[tuple[int, int]]:
    return [(budget.calls_bytes, budget.calls_tensors), (budget.calls_small_bytes, budget.calls_small_tensors)]


#: The CPU engine takes a bucket's members where XLA put them: nothing is packed.
FUSION_COPY_NONE = ("nothing is copied: the engine takes a bucket's members where XLA put them "
                    "(one operand and result per member); what fusing costs a step otherwise is in "
                    "call_us and overlap_block_efficiency")


#: What a calibration must meet to be installed as the default profile (`quality`). A run that
#: fails is still written (with a warning naming what failed), next to the default, not as it.
GATE_LIMITS: dict[str, Any] = {
    # the joint fit of alone and overlapped all-reduce times (a bad run seen: 58%)
    "fit_rms_max": 0.35,
    # each fitted parameter's 95% interval, high / low (bad runs seen: 0.85-5501 and 0.30-inf GB/s)
    "interval_ratio_max": 8.0,
    # compute threads per device (one device runs one to two; bad runs seen: 0.1 and 5)
    "compute_threads_per_device": [0.5, 3.0],
    # the host's CPU time stolen by other tenants during the measurements
    "steal_fraction_max": 0.05,
    # the reference computation after the measurements against before
    "reference_drift_max": 0.25,
    # threads runnable besides calibration's, before or after it, per core
    "others_runnable_per_core_max": 0.5,
}


#: Parameters calibration does not fit (no interval to judge).
FIXED_PARAMETERS = frozenset({"softmin_p"})


def quality(analysis: dict[str, Any], workers: int,
            conditions: dict[str, Any] | None) -> list[str]:
    """Why the fitted profile should not become the default: one line per limit it exceeds
    (`GATE_LIMITS`), naming the quantity and the limit; empty when it meets them all."""
    lim = GATE_LIMITS
    failed = []
    fit = analysis["alone"]["fit"]
    if not fit["rms_rel_error"] <= lim["fit_rms_max"]:
        failed.append(f"all-reduce fit error rms {fit['rms_rel_error'] * 100:.0f}% > "
                      f"{lim['fit_rms_max'] * 100:.0f}%")
    share = analysis["slowdown"]["fair_share_fit"]
    intervals = {**fit["ci95"], **share["ci95"]}
    for name, (lo, hi) in intervals.items():
        if name in FIXED_PARAMETERS:
            continue
        ratio = hi / lo if lo > 0 else math.inf
        if not ratio <= lim["interval_ratio_max"]:
            failed.append(f"{name} 95% interval {lo:.3g}-{hi:.3g} (x{ratio:.3g}) wider than "
                          f"x{lim['interval_ratio_max']:g}")
    per_device = share["params"]["compute_threads"] / max(1, workers)
    lo, hi = lim["compute_threads_per_device"]
    if not lo <= per_device <= hi:
        failed.append(f"compute threads {share['params']['compute_threads']:.3g} for {workers} "
                      f"devices ({per_device:.2f} per device) outside {lo:g}-{hi:g} per device")
    if conditions:
        steal = conditions.get("steal_fraction")
        if steal is not None and steal > lim["steal_fraction_max"]:
            failed.append(f"{steal * 100:.1f}% of the host's CPU time was stolen by other tenants "
                          f"(> {lim['steal_fraction_max'] * 100:.0f}%)")
        cores = analysis.get("cores") or 1
        for when in ("before", "after"):
            others = (conditions.get(when) or {}).get("others_runnable")
            if others is not None and others / cores > lim["others_runnable_per_core_max"]:
                failed.append(f"{others:g} other threads were runnable on {cores:g} cores {when} "
                              "the measurements: something else was using the host")
                break
        drift = conditions.get("reference_drift")
        if drift is not None and drift > lim["reference_drift_max"]:
            failed.append(f"the reference computation ran {drift * 100:.0f}% apart before and after "
                          f"(> {lim['reference_drift_max'] * 100:.0f}%): the host was not quiet")
    return failed


def host_meta(backend: str) -> dict[str, Any]:
    import jax

    import libra_jax

    return {"machine": {"node": platform.node(), "system": platform.system(), "machine": platform.machine(),
                        "processor": platform.processor(), "cpu_count": os.cpu_count(),
                        "python": platform.python_version()},
            "backend": backend, "jax_version": jax.__version__, "libra_jax_version": libra_jax.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _calls_line(calls: dict[str, Any]) -> str:
    """`summary`'s line on the calls train steps and the call terms fitted to them."""
    fit = calls.get("fit")
    if fit is None:
        return "calls     not measured"
    c, e = fit["call_s"], fit["efficiency"]
    return ("calls     train steps, one call per gradient minus one for all: "
            + ", ".join(f"{shape} {d[0] * 1e3:+.2f} ms (model without the terms "
                        f"{fit['predicted_at_no_terms_s'][shape] * 1e3:+.2f})"
                        for shape, d in fit["diff_s"].items())
            + f" -> one more call {c[0] * 1e6:.0f} us of compute (95% CI {c[1] * 1e6:.0f}-{c[2] * 1e6:.0f}), "
            + (f"workers beside compute at {e[0]:.2f} of their rate ({e[1]:.2f}-{e[2]:.2f})"
               if fit.get("efficiency_fitted", True) else
               "no worker beside running compute (the compute threads fill the cores)"))


def summary(doc: dict[str, Any]) -> str:
    """Human-readable results of a calibration."""
    a = doc["calibration"]["analysis"]
    s, sf = a["alone"]["fit"]["params"], a["alone"]["fit"]
    ci = sf["ci95"]
    o = a["overlap"]["prediction"]
    fs = a["slowdown"]["fair_share_fit"]
    lines = [
        f"devices {doc['calibration']['workers']} ({doc['calibration']['backend']}), {a['cores']:g} cores, "
        f"jax {doc['calibration']['jax_version']}",
        f"peak      matmul {a['peak']['flop_per_s'][0] / 1e9:.1f} GFLOP/s per device "
        f"(95% CI {a['peak']['flop_per_s'][1] / 1e9:.1f}-{a['peak']['flop_per_s'][2] / 1e9:.1f}), "
        f"stream {a['peak']['memory_bytes_per_s'][0] / 1e9:.2f} GB/s per device "
        f"({a['peak']['memory_bytes_per_s'][1] / 1e9:.2f}-{a['peak']['memory_bytes_per_s'][2] / 1e9:.2f})",
        f"all-reduce per worker {s['beta_bytes_per_s'] / 1e9:.2f} GB/s "
        f"({ci['beta_bytes_per_s'][0] / 1e9:.2f}-{ci['beta_bytes_per_s'][1] / 1e9:.2f}), cap L "
        f"{s['link_bytes_per_s'] / 1e9:.2f} GB/s "
        f"({ci['link_bytes_per_s'][0] / 1e9:.2f}-{ci['link_bytes_per_s'][1] / 1e9:.2f}), "
        f"p {s['softmin_p']:.2f} (fixed; free: error rms "
        f"{a['alone'].get('free_softmin_p_fit', sf)['rms_rel_error'] * 100:.1f}%), "
        f"latency {s['latency_s'] * 1e6:.0f} us "
        f"(arrival skew {a['alone']['arrival_skew_s'] * 1e6:.0f} us, "
        f"not in the latency); one fit of alone and overlapped times: error rms {sf['rms_rel_error'] * 100:.1f}% "
        f"(alone {a['alone']['rms_rel_error'] * 100:.1f}%, max {a['alone']['max_rel_error'] * 100:.1f}%)",
        "slowdown  matmul " + ", ".join(f"k={k}: {v:.2f}" for k, v in a["slowdown"]["matmul"].items()),
        "          stream " + ", ".join(f"k={k}: {v:.2f}" for k, v in a["slowdown"]["stream"].items()),
        f"          fair share: compute threads D = {fs['params']['compute_threads']:.2f} "
        f"(95% CI {fs['ci95']['compute_threads'][0]:.2f}-{fs['ci95']['compute_threads'][1]:.2f}); "
        f"fit error rms {fs['rms_rel_error'] * 100:.1f}%, max {fs['max_rel_error'] * 100:.1f}%",
        f"overlap   all-reduces beside compute, on their fair share of the cores: "
        f"error rms {o['rms_rel_error'] * 100:.1f}%, "
        f"max {o['max_rel_error'] * 100:.1f}% ({a['overlap']['ended_inside_fraction'] * 100:.0f}% ended inside the "
        "compute window)",
        _calls_line(a.get("calls", {})),
    ]
    q = doc["calibration"].get("quality")
    if q is not None:
        cond = q.get("conditions") or {}
        steal = cond.get("steal_fraction")
        drift = cond.get("reference_drift")
        lines.append("host      " + ", ".join([
            f"steal {steal * 100:.1f}%" if steal is not None else "steal unknown",
            f"reference computation {drift * 100:.0f}% apart before/after"
            if drift is not None else "reference unknown"]))
        lines.append("quality   " + ("passed" if q["passed"] else
                                     "FAILED: " + "; ".join(q["failures"])))
    return "\n".join(lines)
