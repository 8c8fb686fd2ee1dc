"""Calibration's fits: the cost model's parameters from measured times (pure: numpy, and scipy
when a fit runs; no JAX), so profiles can be refit anywhere from recorded samples."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from libra_jax import model
from libra_jax.model.probe import host_cores  # noqa: F401  (calibration's `cores`, one definition)


class CalibrationError(RuntimeError):
    """Calibration cannot measure on this backend (e.g. fewer than two devices)."""


def median_ci(values: Sequence[float] | np.ndarray, n_boot: int = 200, seed: int = 0) -> tuple[float, float, float]:
    """Median and a bootstrap 95% interval of the median (the percentile method).

    By hand, not `scipy.stats.bootstrap`: scipy's default interval is BCa, another method, which
    would move every committed calibration table and the quality gate's interval-width limits
    (calibrate.build) that were set on these intervals; and this module is pure (numpy only),
    while scipy is the optional [calibrate] extra's."""
    v = np.asarray(values, float)
    if v.size == 0:
        return math.nan, math.nan, math.nan
    med = float(np.median(v))
    if v.size == 1:
        return med, med, med
    rng = np.random.default_rng(seed)
    boots = np.median(rng.choice(v, size=(n_boot, v.size), replace=True), axis=1)
    return med, float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def _softmin_np(x: np.ndarray, y: np.ndarray, p: float) -> np.ndarray:
    hi = np.maximum(x, y)
    tiny = 1e-12  # ratios below it (absurd fit iterates) would overflow the power
    return hi * (np.maximum(x / hi, tiny) ** -p + np.maximum(y / hi, tiny) ** -p) ** (-1.0 / p)


def _least_squares() -> Callable[..., Any]:
    try:
        from scipy.optimize import least_squares
    except ImportError as exc:  # pragma: no cover - scipy is in the calibrate extra
        raise CalibrationError("fitting needs scipy: pip install scipy (or libra_jax[calibrate])") from exc
    return least_squares


@dataclass
class Fit:
    params: dict[str, float]
    rms_rel_error: float
    max_rel_error: float
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"params": self.params, "rms_rel_error": self.rms_rel_error, "max_rel_error": self.max_rel_error,
                "ci95": {k: list(v) for k, v in self.ci.items()}}


def relative_errors(pred: np.ndarray, meas: np.ndarray) -> tuple[float, float]:
    """(rms, max) of the relative errors of `pred` against the measured `meas`."""
    rel = pred / meas - 1.0
    return float(np.sqrt(np.mean(rel**2))), float(np.max(np.abs(rel)))


def alone_time_s(nbytes: np.ndarray, blocks: np.ndarray, workers: int, beta: float, link: float, p: float,
                 lat: float, eta: float = 1.0) -> np.ndarray:
    """The model's all-reduce time: ``lat + bytes / (algo * softmin_p(k * beta * eta, L))``.

    ``blocks`` may be fractional: the cores the workers get (the fair-share form passes them).
    """
    algo = model.ring_algo_factor(workers)
    return lat + nbytes / (algo * _softmin_np(blocks * beta * eta, np.full_like(nbytes, link, dtype=float), p))


def fit_alone(nbytes: Sequence[float], blocks: Sequence[float], seconds: Sequence[float], workers: int,
              cores: float | None = None, softmin_p: float | None = None) -> Fit:
    """Fit ``beta`` (bytes/s per block), ``link`` (bytes/s), ``p`` and ``lat`` (s) to solo all-reduce times.

    With ``cores``, ``k`` workers run on ``min(k, cores)`` cores (the fair-share form); without,
    on ``k`` (the nccl-style form, where blocks do not share). ``softmin_p`` fixes ``p``
    (the other three are fitted): see `SOFTMIN_P`.
    """
    least_squares = _least_squares()
    b, k, t = (np.asarray(a, float) for a in (nbytes, blocks, seconds))
    if cores is not None:
        k = np.minimum(k, float(cores))
    algo = model.ring_algo_factor(workers)
    big = b >= np.median(b)
    rate = float(np.median(b[big] / t[big] / algo))  # rough bus bandwidth
    x0 = np.log([rate / max(1.0, float(np.median(k))), rate * 2, 4.0, max(float(np.min(t)) * 0.3, 1e-6)])

    if softmin_p is not None:
        def resid3(x: np.ndarray) -> np.ndarray:
            beta, link, lat = np.exp(x)
            return np.log(alone_time_s(b, k, workers, beta, link, softmin_p, lat) / t)

        lo3, hi3 = np.log([1e3, 1e3, 1e-8]), np.log([1e13, 1e13, 1.0])
        r = least_squares(resid3, np.clip(x0[[0, 1, 3]], lo3 + 1e-9, hi3 - 1e-9), bounds=(lo3, hi3))
        beta, link, lat = (float(v) for v in np.exp(r.x))
        p = float(softmin_p)
    else:
        def resid(x: np.ndarray) -> np.ndarray:
            beta, link, p, lat = np.exp(x)
            return np.log(alone_time_s(b, k, workers, beta, link, p, lat) / t)

        lo = np.log([1e3, 1e3, 1.0, 1e-8])  # p >= 1: below, the soft-min falls under both rates
        hi = np.log([1e13, 1e13, 32.0, 1.0])
        best = None
        for p0 in (1.0, 4.0, 16.0):  # a few starts: p is weakly identified
            x = x0.copy()
            x[2] = math.log(p0)
            r = least_squares(resid, np.clip(x, lo + 1e-9, hi - 1e-9), bounds=(lo, hi))
            if best is None or r.cost < best.cost:
                best = r
        assert best is not None  # the loop ran at least once
        beta, link, p, lat = (float(v) for v in np.exp(best.x))
    rms, mx = relative_errors(alone_time_s(b, k, workers, beta, link, p, lat), t)
    return Fit({"beta_bytes_per_s": beta, "link_bytes_per_s": link, "softmin_p": p, "latency_s": lat}, rms, mx)


#: The soft-min's sharpness in calibration's all-reduce fit, fixed: on a host of few cores the
#: data pin the rate's curve over the cores a worker gets, not three shapes of it. With ``p``
#: free, runs on one quiet machine put the cap ``L`` at 2.8 to 6.9 GB/s and ``p`` at 32 or at its
#: bound 1 for the same error; fixed at 1 (the rate is ``1 / (1 / (c beta) + 1 / L)``: a cost per
#: byte of the worker's cores plus one of the memory), ``beta`` and ``L`` are pinned.
#: `libra_jax.calibrate.build.analyse` fits both ways and records the free fit's error beside.
SOFTMIN_P = 1.0


def fit_overlap(nbytes: Sequence[float], blocks: Sequence[int], seconds: Sequence[float], workers: int,
                solo: Fit) -> Fit:
    """Fit ``eta`` (overlap_block_efficiency, <= 1) with the solo fit's other parameters fixed."""
    least_squares = _least_squares()
    b, k, t = (np.asarray(a, float) for a in (nbytes, blocks, seconds))
    s = solo.params

    def pred(eta: float) -> np.ndarray:
        return alone_time_s(b, k, workers, s["beta_bytes_per_s"], s["link_bytes_per_s"], s["softmin_p"],
                            s["latency_s"], eta)

    r = least_squares(lambda x: np.log(pred(math.exp(x[0])) / t), [math.log(0.5)],
                      bounds=([math.log(1e-4)], [0.0]))
    eta = float(math.exp(r.x[0]))
    rms, mx = relative_errors(pred(eta), t)
    return Fit({"eta": eta}, rms, mx)


def slowdown_from_windows(extra_s: Sequence[float], overlap_s: Sequence[float]) -> float:
    """``s`` from ``W - C = D (1 - 1/s)``: the least-squares slope through the origin, as ``1/(1-slope)``.

    ``extra_s`` are window times minus the solo chain time, ``overlap_s`` the all-reduce seconds inside
    the window. Capped at 100 (a slope >= 0.99: compute all but stopped).
    """
    w, d = np.asarray(extra_s, float), np.asarray(overlap_s, float)
    if d.size == 0 or float(np.sum(d * d)) == 0.0:
        return 1.0
    slope = float(np.sum(w * d) / np.sum(d * d))
    slope = min(max(slope, 0.0), 0.99)
    return 1.0 / (1.0 - slope)


def fit_slowdown_units(blocks: Sequence[int], slowdowns: Sequence[float], *, max_units: int = 512,
                       max_per_block: int = 16) -> Fit:
    """Integers ``U`` (compute units) and ``u`` (units per block) for ``s(k) = U / (U - k u)`` (grid search)."""
    k = np.asarray(blocks, float)
    s = np.maximum(np.asarray(slowdowns, float), 1.0)
    best: tuple[float, int, int] | None = None
    for u in range(1, max_per_block + 1):
        U = np.arange(int(k.max()) * u + 1, max_units + 1, dtype=float)
        if U.size == 0:
            continue
        pred = U[:, None] / (U[:, None] - k[None, :] * u)
        cost = np.sum(np.log(pred / s[None, :]) ** 2, axis=1)
        i = int(np.argmin(cost))
        if best is None or cost[i] < best[0] - 1e-12:
            best = (float(cost[i]), int(U[i]), u)
    assert best is not None
    _, U_, u_ = best
    rms, mx = relative_errors(U_ / (U_ - k * u_), s)
    return Fit({"compute_units": U_, "units_per_block": u_}, rms, mx)


def fit_memory_traffic(blocks: Sequence[int], slowdowns: Sequence[float], bus_overlap_bytes_per_s: Sequence[float],
                       memory_bytes_per_s: float) -> Fit:
    """``m`` (memory bytes per bus byte) for ``s(k) = H / (H - m bus_overlap(k))`` (least squares)."""
    least_squares = _least_squares()
    s = np.maximum(np.asarray(slowdowns, float), 1.0)
    bus = np.asarray(bus_overlap_bytes_per_s, float)
    H = float(memory_bytes_per_s)
    m_max = 0.999 * H / float(bus.max())

    def pred(m: float) -> np.ndarray:
        return H / (H - m * bus)

    r = least_squares(lambda x: np.log(pred(x[0]) / s), [min(1.0, m_max / 2)], bounds=([0.0], [m_max]))
    m = float(r.x[0])
    rms, mx = relative_errors(pred(m), s)
    return Fit({"memory_bytes_per_bus_byte": m}, rms, mx)


def fit_fair_share(blocks: Sequence[int], slowdowns: Sequence[float], cores: float) -> Fit:
    """``compute_threads`` ``D`` of the fair-share slowdown ``s(k) = max(1, (D + k)/P) / max(1, D/P)``
    (`libra_jax.model.fair_share_slowdown`) on ``P = cores``, least squares on log residuals.

    ``blocks`` and ``slowdowns`` may hold several workloads' points (one ``D`` for all: the
    scheduler does not know what the compute threads compute). Slowdowns below 1 count as 1.
    """
    least_squares = _least_squares()
    k = np.asarray(blocks, float)
    s = np.maximum(np.asarray(slowdowns, float), 1.0)
    P = float(cores)

    def pred(D: float) -> np.ndarray:
        return np.maximum(1.0, (D + k) / P) / max(1.0, D / P)

    lo, hi = math.log(0.05), math.log(4096.0)
    best = None
    for d0 in (0.5, P, 4 * P, 32 * P):  # a few starts: the curve is flat in D below P
        x0 = min(max(math.log(d0), lo + 1e-9), hi - 1e-9)
        r = least_squares(lambda x: np.log(pred(math.exp(x[0])) / s), [x0], bounds=([lo], [hi]),
                          loss="soft_l1", f_scale=0.1)  # robust: one disturbed window is not a trend
        if best is None or r.cost < best.cost:
            best = r
    assert best is not None  # the loop ran at least once
    D = float(math.exp(best.x[0]))
    rms, mx = relative_errors(pred(D), s)
    return Fit({"compute_threads": D, "cores": P}, rms, mx)


#: The bounds of the call terms' fit: seconds per call, the overlapped workers' efficiency.
CALL_S_BOUNDS = (0.0, 5e-3)
EFFICIENCY_BOUNDS = (0.05, 1.0)


def call_differences(rows: Sequence[dict]) -> dict[str, np.ndarray]:
    """Per shape (``"big"``, ``"small"``), the paired (same repetition) differences of the
    calls train steps: one call per gradient minus one call for all."""
    pairs: dict[str, dict[int, dict[bool, float]]] = {}
    for r in rows:
        shape = "small" if r.get("small") else "big"
        pairs.setdefault(shape, {}).setdefault(r["rep"], {})[bool(r["fused"])] = r["seconds"]
    return {shape: np.array([p[False] - p[True] for p in reps.values() if len(p) == 2])
            for shape, reps in pairs.items()}


def fit_call_terms(diffs: dict[str, np.ndarray], predict: Callable[[str, float, float], float],
                   n_boot: int = 40, seed: int = 0,
                   efficiency: float | None = None) -> dict[str, Any]:
    """The two terms that price calls as they run in a train step, from the paired
    differences `diffs` (`call_differences`) of two steps (few big gradients, many small
    ones): ``call_s``, what one more call costs the compute stream beside its latency, and
    ``efficiency``, the fraction of a worker's rate kept beside compute. ``predict(shape,
    call_s, efficiency)`` is the model's difference of the same two plans; the fit makes it
    the measured median, least squares over the shapes (two equations, two unknowns, within
    `CALL_S_BOUNDS` and `EFFICIENCY_BOUNDS`), with bootstrap 95% intervals. A given
    `efficiency` is kept and ``call_s`` alone fitted (``"efficiency_fitted"`` False): where
    the model prices no worker beside running compute (`model.fair_share_oversubscribed`),
    the steps do not depend on it."""
    least_squares = _least_squares()
    shapes = sorted(d for d in diffs if diffs[d].size)
    if not shapes:
        raise CalibrationError("no paired calls train steps to fit the call terms")
    lo: tuple[float, ...] = (CALL_S_BOUNDS[0] * 1e6, EFFICIENCY_BOUNDS[0])
    hi: tuple[float, ...] = (CALL_S_BOUNDS[1] * 1e6, EFFICIENCY_BOUNDS[1])
    if efficiency is not None:  # call_s alone
        lo, hi = lo[:1], hi[:1]

    def solve(targets: dict[str, float]) -> tuple[float, float, float]:
        def resid(x: np.ndarray) -> np.ndarray:  # in ms, call_s in us: both of order 1
            eff = float(x[1]) if efficiency is None else efficiency
            return np.array([(predict(shape, x[0] * 1e-6, eff) - targets[shape]) * 1e3
                             for shape in shapes])
        x0 = np.array([20.0, 0.7] if efficiency is None else [20.0])
        r = least_squares(resid, x0=x0, bounds=(lo, hi), diff_step=1e-3)
        eff = float(r.x[1]) if efficiency is None else efficiency
        return float(r.x[0]) * 1e-6, eff, float(np.sqrt(np.mean(r.fun ** 2))) * 1e-3

    medians = {shape: float(np.median(diffs[shape])) for shape in shapes}
    call_s, eff, rms = solve(medians)
    rng = np.random.default_rng(seed)
    boots = np.array([solve({shape: float(np.median(rng.choice(diffs[shape], diffs[shape].size)))
                             for shape in shapes})[:2] for _ in range(n_boot)])
    predicted = {shape: predict(shape, call_s, eff) for shape in shapes}
    return {"call_s": [call_s, *map(float, np.percentile(boots[:, 0], [2.5, 97.5]))],
            "efficiency": [eff, *map(float, np.percentile(boots[:, 1], [2.5, 97.5]))],
            "diff_s": {shape: median_ci(diffs[shape]) for shape in shapes},
            "predicted_diff_s": predicted,
            "predicted_at_no_terms_s": {shape: predict(shape, 0.0, 1.0) for shape in shapes},
            "rms_error_s": rms, "efficiency_fitted": efficiency is None}
