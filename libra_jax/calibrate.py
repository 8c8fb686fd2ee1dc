"""`libra-jax calibrate`: measure the contention model on the running backend and fit a profile.

What is measured (CPU host devices; the "blocks" are the engine's worker tasks)
-------------------------------------------------------------------------------
XLA:CPU runs one multi-device execution at a time, so every measurement is one program, timed by
the engine's per-call records (:func:`libra_jax._ffi.recording`, one clock for all devices):

* **alone** -- a program that is one ``libra_jax.psum(z, blocks=k, inplace=True)`` of ``S`` bytes
  per device, in place as ``optimize`` runs gradient all-reduces (XLA copies ``z`` first, outside
  the timed part). Its time is the engine's ``end - start`` (all ranks arrived -> all outputs
  written); the arrival skew ``start - first_arrival`` is recorded too.
* **overlapped** -- one program with a marker all-reduce (4 bytes) ``m1``, a compute chain that
  depends on ``m1``, a second marker ``m2`` that depends on the chain's result, and an all-reduce
  of ``S`` bytes with ``k`` blocks on independent data, which XLA issues beside the chain. The
  compute window is ``m2.start - m1.end`` (the slowest device's chain); the same program without
  the all-reduce gives the chain's solo time ``C``. Two chains: a **matmul-bound** one (square
  f32 matmuls) and a **memory-bound** one (a streaming ``a * c + 1`` over a buffer larger than
  the caches).
* **peak rates** -- the solo chains give the sustained matmul FLOP/s and the streaming bytes/s
  per device, with every device running (as in data-parallel training).
* **fusion** -- wall-clock time of a small MLP train step (``T`` gradient tensors, ``S`` bytes
  per device) whose gradients are all-reduced as one fused bucket (``libra_psum_fused``: packed
  into one buffer, split after) minus that of the same step with one all-reduce per tensor,
  paired per repetition; once with few big tensors (8 MiB in 8), once with many small ones
  (1 MiB in 64). Not only the copies: on a host whose cores the devices share, a fused bucket
  also waits for every device's whole backward pass (measured on a 2-core VM with 8 devices: an
  isolated 8 MiB pack costs ~2 ms, the same bytes fused in a train step ~10x more), and each
  all-reduce in a step costs more than alone (its ranks' threads hand off and wake up).

Every configuration is repeated ``reps`` times; each repetition runs all configurations once in
a shuffled order (interleaved, so drift and noise spread over all of them). Medians come with
bootstrap 95% confidence intervals.

What is fitted (the ``fair-share`` form of :mod:`libra_jax.model`)
------------------------------------------------------------------
The host's ``P`` cores (``cores``, the CPUs this process may run on) are shared by the devices'
compute threads and the engine's worker threads; a fair scheduler gives each runnable thread
``min(1, P / threads)`` of a core.

* alone: ``t = lat + S / (algo * softmin_p(min(k, P) * beta, L))`` -> ``beta``
  (per_block_gbyte_per_s), ``L`` (intra_node_gbyte_per_s), ``p`` (softmin_p), ``lat``
  (base_latency_us); ``algo = n / (2(n-1))`` as in the model. The arrival skew is *not* added to
  the latency: it is the devices' compute finishing at different times on shared cores, which a
  step's time contains whether or not it all-reduces.
* slowdown: while an all-reduce is active for ``D`` seconds of the window, compute runs at
  ``1/s`` of its speed, so ``W - C = D (1 - 1/s)``; a least-squares slope per ``k`` gives
  ``s_mm(k)`` and ``s_mem(k)``. Both fit one fair-share curve
  ``s(k) = max(1, (D_c + k)/P) / max(1, D_c/P)`` -> ``compute_threads`` ``D_c`` (the runnable
  compute threads the k workers compete with).
* overlapped: no new parameter -- the workers' share ``k min(1, P/(D_c + k))`` of the cores sets
  their rate -- and the all-reduces that ended inside the compute window check it (reported as
  the fit error of the overlapped prediction).
* fusion: ``t_fused - t_per_tensor = c S - (T - 1) h`` for both steps -> ``c`` (seconds per
  fused byte: ``fusion_copy_gbyte_per_s = 1 / c``) and ``h`` (seconds per further all-reduce in a
  train step: ``base_latency_us`` when it exceeds the intercept of the alone fit).
Least squares are on relative (log) residuals (scipy.optimize.least_squares); the fit error is
the RMS and max relative error over the medians, and bootstrap fits give 95% intervals for the
parameters. The NIC and the inter-node latency cannot be measured on one host and stay
assumptions.

Where the profile goes
----------------------
:func:`libra_jax.model.calibrated_profile_path`: ``$LIBRA_JAX_PROFILE_DIR/<backend>.json`` if
that variable is set, else ``$XDG_CACHE_HOME/libra_jax/profiles/<backend>.json`` (``~/.cache``
without ``XDG_CACHE_HOME``). ``optimize`` and ``psum(blocks=None)`` use it by default
(:func:`libra_jax.model.default_profile`).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from libra_jax import model

__all__ = ["CalibrationError", "Budget", "QUICK", "FULL", "TINY", "calibrate", "run", "fit_alone",
           "fit_overlap", "fit_slowdown_units", "fit_memory_traffic", "fit_fair_share", "slowdown_from_windows",
           "fusion_costs", "fusion_analysis", "host_cores", "build_profile"]

KIB, MIB = 1 << 10, 1 << 20


class CalibrationError(RuntimeError):
    """Calibration cannot measure on this backend (e.g. fewer than two devices)."""


@dataclass(frozen=True)
class Budget:
    """What one calibration run measures."""

    sizes: tuple[int, ...]            # bytes per device of the solo all-reduces
    overlap_sizes: tuple[int, ...]    # bytes per device of the overlapped all-reduces
    blocks: tuple[int, ...]
    reps: int
    matmul_n: int = 256
    matmul_iters: int = 16
    stream_bytes: int = 8 * MIB
    stream_iters: int = 12
    bootstrap: int = 40
    pack_bytes: int = 8 * MIB         # gradient bytes per device of the fusion train step, few big tensors
    pack_tensors: int = 8             # its gradient tensors
    pack_small_bytes: int = 1 * MIB   # the same with many small tensors
    pack_small_tensors: int = 64


FULL = Budget(sizes=(64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB), overlap_sizes=(4 * MIB, 16 * MIB),
              blocks=(1, 2, 3, 4, 6, 8), reps=9)
QUICK = Budget(sizes=(256 * KIB, 1 * MIB, 4 * MIB), overlap_sizes=(4 * MIB,), blocks=(1, 2, 4), reps=10,
               pack_bytes=4 * MIB, pack_small_bytes=512 * KIB, pack_small_tensors=32)
#: For tests: seconds, not minutes.
TINY = Budget(sizes=(64 * KIB, 512 * KIB), overlap_sizes=(256 * KIB,), blocks=(1, 2), reps=2,
              matmul_n=128, matmul_iters=6, stream_bytes=1 * MIB, stream_iters=4, bootstrap=8,
              pack_bytes=256 * KIB, pack_tensors=4, pack_small_bytes=64 * KIB, pack_small_tensors=8)


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


def median_ci(values: Sequence[float] | np.ndarray, n_boot: int = 200, seed: int = 0) -> tuple[float, float, float]:
    """Median and a bootstrap 95% interval of the median."""
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


# ----------------------------------------------------------------------------------------------
# Fits (pure numpy/scipy: testable on synthetic samples)
# ----------------------------------------------------------------------------------------------


@dataclass
class Fit:
    params: dict[str, float]
    rms_rel_error: float
    max_rel_error: float
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"params": self.params, "rms_rel_error": self.rms_rel_error, "max_rel_error": self.max_rel_error,
                "ci95": {k: list(v) for k, v in self.ci.items()}}


def _errors(pred: np.ndarray, meas: np.ndarray) -> tuple[float, float]:
    rel = pred / meas - 1.0
    return float(np.sqrt(np.mean(rel**2))), float(np.max(np.abs(rel)))


def alone_time_s(nbytes: np.ndarray, blocks: np.ndarray, workers: int, beta: float, link: float, p: float,
                 lat: float, eta: float = 1.0) -> np.ndarray:
    """The model's all-reduce time: ``lat + bytes / (algo * softmin_p(k * beta * eta, L))``.

    ``blocks`` may be fractional: the cores the workers get (the fair-share form passes them).
    """
    algo = model.ring_algo_factor(workers)
    return lat + nbytes / (algo * _softmin_np(blocks * beta * eta, np.full_like(nbytes, link, dtype=float), p))


def host_cores() -> int:
    """The CPUs this process may run on (the ``cores`` of the fair-share form)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def fit_alone(nbytes: Sequence[float], blocks: Sequence[float], seconds: Sequence[float], workers: int,
              cores: float | None = None) -> Fit:
    """Fit ``beta`` (bytes/s per block), ``link`` (bytes/s), ``p`` and ``lat`` (s) to solo all-reduce times.

    With ``cores``, ``k`` workers run on ``min(k, cores)`` cores (the fair-share form); without,
    on ``k`` (the nccl-style form, where blocks do not share).
    """
    least_squares = _least_squares()
    b, k, t = (np.asarray(a, float) for a in (nbytes, blocks, seconds))
    if cores is not None:
        k = np.minimum(k, float(cores))
    algo = model.ring_algo_factor(workers)
    big = b >= np.median(b)
    rate = float(np.median(b[big] / t[big] / algo))  # rough bus bandwidth
    x0 = np.log([rate / max(1.0, float(np.median(k))), rate * 2, 4.0, max(float(np.min(t)) * 0.3, 1e-6)])

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
    rms, mx = _errors(alone_time_s(b, k, workers, beta, link, p, lat), t)
    return Fit({"beta_bytes_per_s": beta, "link_bytes_per_s": link, "softmin_p": p, "latency_s": lat}, rms, mx)


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
    rms, mx = _errors(pred(eta), t)
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
    rms, mx = _errors(U_ / (U_ - k * u_), s)
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
    rms, mx = _errors(pred(m), s)
    return Fit({"memory_bytes_per_bus_byte": m}, rms, mx)


def fit_fair_share(blocks: Sequence[int], slowdowns: Sequence[float], cores: float) -> Fit:
    """``compute_threads`` ``D`` of the fair-share slowdown ``s(k) = max(1, (D + k)/P) / max(1, D/P)``
    (:func:`libra_jax.model.fair_share_slowdown`) on ``P = cores``, least squares on log residuals.

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
    rms, mx = _errors(pred(D), s)
    return Fit({"compute_threads": D, "cores": P}, rms, mx)


def fusion_costs(d_big: float, big: tuple[float, int], d_small: float, small: tuple[float, int]) -> tuple[float, float]:
    """``(c, h)`` from two train steps' fused-minus-unfused times ``d = c B - (T - 1) h``, one with
    ``big = (B, T)`` (few big tensors), one with ``small`` (many small ones): ``c`` seconds per
    fused byte, ``h`` seconds per further all-reduce. Both clipped at 0."""
    (Bb, Tb), (Bs, Ts) = big, small
    det = Bb * (Ts - 1) - Bs * (Tb - 1)
    if det == 0:
        raise ValueError("the two train steps must differ in bytes per tensor")
    c = (d_big * (Ts - 1) - d_small * (Tb - 1)) / det
    c = max(c, 0.0)
    h = max((c * Bb - d_big) / (Tb - 1), (c * Bs - d_small) / (Ts - 1), 0.0) if Tb > 1 and Ts > 1 else 0.0
    return c, h


def fusion_analysis(rows: Sequence[dict], n_boot: int = 40, seed: int = 0) -> dict[str, Any]:
    """Per-byte fusion cost and per-all-reduce cost from the paired train-step samples (see
    :func:`fusion_costs`), with bootstrap 95% intervals; rates are bytes per second (``inf``:
    no measurable cost)."""
    pairs: dict[bool, dict[int, dict[bool, float]]] = {False: {}, True: {}}
    shape: dict[bool, tuple[float, int]] = {}
    for r in rows:
        small = bool(r.get("small", False))
        pairs[small].setdefault(r["rep"], {})[r["fused"]] = r["seconds"]
        shape[small] = (float(r["bytes"]), int(r["tensors"]))
    diffs = {k: np.array([p[True] - p[False] for p in v.values() if True in p and False in p])
             for k, v in pairs.items()}
    out: dict[str, Any] = {"shapes": {("small" if k else "big"): list(v) for k, v in shape.items()},
                           "diff_s": {("small" if k else "big"): median_ci(d) for k, d in diffs.items() if d.size}}
    if not (diffs[False].size and diffs[True].size):
        out.update(bytes_per_s=[math.inf] * 3, per_all_reduce_s=[0.0] * 3)
        return out

    def solve(db: np.ndarray, ds: np.ndarray) -> tuple[float, float]:
        return fusion_costs(float(np.median(db)), shape[False], float(np.median(ds)), shape[True])

    c, h = solve(diffs[False], diffs[True])
    rng = np.random.default_rng(seed)
    boots = [solve(rng.choice(diffs[False], diffs[False].size), rng.choice(diffs[True], diffs[True].size))
             for _ in range(n_boot)]
    cs, hs = np.array([b[0] for b in boots]), np.array([b[1] for b in boots])

    def rate(x: float) -> float:
        return 1.0 / x if x > 0 else math.inf

    out["bytes_per_s"] = [rate(c), rate(float(np.percentile(cs, 97.5))), rate(float(np.percentile(cs, 2.5)))]
    out["per_all_reduce_s"] = [h, float(np.percentile(hs, 2.5)), float(np.percentile(hs, 97.5))]
    return out


# ----------------------------------------------------------------------------------------------
# Measurement (JAX)
# ----------------------------------------------------------------------------------------------


def _progress(total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar if tqdm is installed, else plain lines every 10%."""
    if not enabled:
        return _Silent()
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)
    except ImportError:
        return _Lines(total, desc)


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


class _Lines(_Silent):
    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done, self.shown = total, desc, 0, -1

    def update(self, n: int = 1) -> None:
        self.done += n
        tenth = 10 * self.done // max(1, self.total)
        if tenth != self.shown:
            self.shown = tenth
            print(f"{self.desc}: {self.done}/{self.total} runs", file=sys.stderr, flush=True)


def _devices(n: int | None) -> list[Any]:
    import jax

    backend = jax.default_backend()
    if backend != "cpu":
        raise CalibrationError(
            f"calibration measures CPU host devices; the default backend is {backend!r}, whose "
            "calibration is not implemented yet (benchmarks/gpu_check.sh measures GPU all-reduce times)")
    if n is not None:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except Exception:
            pass
    devices = jax.devices("cpu")
    if n is not None:
        devices = devices[:n]
    if len(devices) < 2:
        raise CalibrationError(
            f"calibration needs at least 2 devices to all-reduce among, found {len(devices)}; on CPU "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=8 (or jax_num_cpu_devices) before JAX starts")
    return devices


class _Programs:
    """The jitted measurement programs over ``n`` devices."""

    def __init__(self, devices: list[Any], budget: Budget) -> None:
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        import libra_jax

        self.jax, self.P, self.psum = jax, P, libra_jax.psum
        self.n = len(devices)
        self.mesh = Mesh(np.array(devices), ("c",))
        self.sharding = NamedSharding(self.mesh, P("c"))
        self.budget = budget
        n, b = self.n, budget
        put = lambda a: jax.device_put(a, self.sharding)  # noqa: E731
        self.marker = put(np.ones((n,), np.float32))
        self.w = put(np.tile(np.eye(b.matmul_n, dtype=np.float32), (n, 1)))
        self.stream = put(np.ones((n * (b.stream_bytes // 4),), np.float32))
        sizes = sorted(set(b.sizes) | set(b.overlap_sizes))
        self.z = {s: put(np.zeros((n * (s // 4),), np.float32)) for s in sizes}
        self._cache: dict[tuple, Any] = {}

    def _smap(self, body: Callable[..., Any], n_in: int, n_out: int) -> Any:
        P = self.P
        return self.jax.jit(self.jax.shard_map(body, mesh=self.mesh, in_specs=(P("c"),) * n_in,
                                               out_specs=(P(),) * n_out if n_out > 1 else P(), check_vma=False))

    def alone(self, size: int, k: int) -> Callable[[], Any]:
        key = ("alone", size, k)
        if key not in self._cache:
            fn = self._smap(lambda z: self.psum(z, "c", blocks=k, inplace=True), 1, 1)
            z = self.z[size]
            self._cache[key] = lambda: fn(z)
        return self._cache[key]

    def overlapped(self, workload: str, size: int | None, k: int | None) -> Callable[[], Any]:
        key = ("overlap", workload, size, k)
        if key in self._cache:
            return self._cache[key]
        jax, b, psum = self.jax, self.budget, self.psum

        def chain(m: Any, a: Any, w: Any) -> Any:
            if workload == "matmul":
                a = w * m[0]
                a = jax.lax.fori_loop(0, b.matmul_iters, lambda i, a: a @ w, a)
                return a[:1, :1].reshape(-1)
            a = a * m[0]
            a = jax.lax.fori_loop(0, b.stream_iters, lambda i, a: a * 0.5 + 1.0, a)
            return a[:1]

        if size is None:
            def body(m: Any, a: Any, w: Any) -> Any:
                m = psum(m, "c", blocks=1)
                return psum(chain(m, a, w), "c", blocks=1)
            fn = self._smap(body, 3, 1)
            self._cache[key] = lambda: fn(self.marker, self.stream, self.w)
        else:
            def body2(m: Any, a: Any, w: Any, z: Any) -> Any:
                m = psum(m, "c", blocks=1)
                return psum(chain(m, a, w), "c", blocks=1), psum(z, "c", blocks=k, inplace=True)
            fn2 = self._smap(body2, 4, 2)
            z = self.z[size]
            self._cache[key] = lambda: fn2(self.marker, self.stream, self.w, z)
        return self._cache[key]


    def pack(self, fused: bool, small: bool = False) -> Callable[[], Any]:
        """A data-parallel train step whose gradients (``pack_tensors`` of them, ``pack_bytes``
        in all per device, or the ``pack_small_`` pair: the weights and biases of an MLP) are
        all-reduced after the backward pass as one fused bucket (``libra_psum_fused``), or each on
        its own; then an SGD update. The difference of the two: what fusing costs per byte
        against what each further all-reduce costs in a train step. ``self.pack_layout[small]``
        is (layers, width, gradient bytes)."""
        key = ("pack", fused, small)
        if key not in self._cache:
            jax, P = self.jax, self.P
            jnp = jax.numpy
            from libra_jax.ops import libra_psum_fused_p

            b = self.budget
            nbytes, tensors = (b.pack_small_bytes, b.pack_small_tensors) if small else (b.pack_bytes, b.pack_tensors)
            layers = max(1, tensors // 2)
            width = max(8, int(math.sqrt(nbytes / 4 / layers)))
            batch = 32

            def loss(params: Any, x: Any) -> Any:
                for w, c in params:
                    x = jnp.tanh(x @ w + c)
                return jnp.mean(x * x)

            def body(m: Any, x: Any, params: Any) -> Any:
                grads = jax.grad(loss)(params, x * m[0])
                flat, tree = jax.tree.flatten(grads)
                if fused:
                    flat = libra_psum_fused_p.bind(*flat, axes=("c",), blocks=1, invariant=False)
                else:
                    flat = [self.psum(g, "c", blocks=1) for g in flat]
                grads = jax.tree.unflatten(tree, flat)
                return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

            rng = np.random.default_rng(0)
            params = [(jax.numpy.asarray(rng.standard_normal((width, width), np.float32) / width),
                       jax.numpy.zeros((width,), jax.numpy.float32)) for _ in range(layers)]
            params = jax.device_put(params, jax.sharding.NamedSharding(self.mesh, P()))
            x = jax.device_put(rng.standard_normal((self.n * batch, width)).astype(np.float32), self.sharding)
            fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P("c"), P("c"), P()), out_specs=P(),
                                       check_vma=False))
            if not hasattr(self, "pack_layout"):
                self.pack_layout = {}
            self.pack_layout[small] = (layers, width, sum(w.size + c.size for w, c in params) * 4)
            self._cache[key] = lambda: fn(self.marker, x, params)
        return self._cache[key]


def _records(fn: Callable[[], Any]) -> list[dict]:
    import jax

    from libra_jax import _ffi

    with _ffi.recording() as rec:
        jax.block_until_ready(fn())
    return rec


@dataclass
class Samples:
    """Raw samples: one dict per run (kept in the profile)."""

    alone: list[dict] = field(default_factory=list)
    overlap: list[dict] = field(default_factory=list)
    pack: list[dict] = field(default_factory=list)


def measure(budget: Budget, *, devices: int | None = 8, progress: bool = True, seed: int = 0) -> tuple[Samples, int]:
    """Run every configuration ``budget.reps`` times, interleaved in a shuffled order per repetition."""
    import jax

    devs = _devices(devices)
    progs = _Programs(devs, budget)
    configs: list[tuple] = [("alone", s, k) for s in budget.sizes for k in budget.blocks]
    for wl in ("matmul", "stream"):
        configs.append(("overlap", wl, None, None))
        configs += [("overlap", wl, s, k) for s in budget.overlap_sizes for k in budget.blocks]
    configs += [("pack", fused, small) for fused in (True, False) for small in (False, True)]
    bar = _progress(len(configs) * (budget.reps + 1), progress, "calibrate")
    samples = Samples()
    rng = random.Random(seed)
    for rep in range(budget.reps + 1):  # repetition 0 compiles and warms up
        order = list(configs)
        rng.shuffle(order)
        for cfg in order:
            if cfg[0] == "pack":
                fn = progs.pack(cfg[1], cfg[2])
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                seconds = time.perf_counter() - t0
                bar.update(1)
                if rep:
                    layers, width, nbytes = progs.pack_layout[cfg[2]]
                    samples.pack.append({"fused": cfg[1], "small": cfg[2], "rep": rep, "seconds": seconds,
                                         "bytes": nbytes, "tensors": 2 * layers, "width": width})
                continue
            fn = progs.alone(cfg[1], cfg[2]) if cfg[0] == "alone" else progs.overlapped(*cfg[1:])
            rec = _records(fn)
            bar.update(1)
            if rep == 0:
                continue
            if cfg[0] == "alone":
                r = max(rec, key=lambda r: r["bytes"])
                samples.alone.append({"bytes": cfg[1], "blocks": cfg[2], "rep": rep,
                                      "seconds": (r["end_us"] - r["start_us"]) * 1e-6,
                                      "skew_s": (r["start_us"] - r["first_arrival_us"]) * 1e-6})
                continue
            _, wl, size, k = cfg
            markers = sorted((r for r in rec if r["bytes"] == 4), key=lambda r: r["start_us"])
            if len(markers) < 2:
                continue
            w0, w1 = markers[0]["end_us"], markers[-1]["start_us"]
            s = {"workload": wl, "bytes": size, "blocks": k, "rep": rep, "window_s": (w1 - w0) * 1e-6}
            big = [r for r in rec if r["bytes"] != 4]
            if big:
                r = big[0]
                s["seconds"] = (r["end_us"] - r["start_us"]) * 1e-6
                s["inside_s"] = max(0, min(r["end_us"], w1) - max(r["start_us"], w0)) * 1e-6
                s["ended_inside"] = bool(w0 <= r["start_us"] and r["end_us"] <= w1)
            samples.overlap.append(s)
    bar.close()
    return samples, len(devs)


# ----------------------------------------------------------------------------------------------
# Fit everything and build the profile
# ----------------------------------------------------------------------------------------------


def _medians(rows: Iterable[dict], keys: Sequence[str], value: str) -> dict[tuple, list[float]]:
    out: dict[tuple, list[float]] = {}
    for r in rows:
        if value in r:
            out.setdefault(tuple(r[k] for k in keys), []).append(r[value])
    return out


def analyse(samples: Samples, workers: int, budget: Budget, seed: int = 0,
            cores: float | None = None) -> dict[str, Any]:
    """Fit the model to the samples; returns the parameters, fit errors, intervals and summaries.

    ``cores`` is the host's core count ``P`` (default: :func:`host_cores`).
    """
    rng = np.random.default_rng(seed)
    P = float(cores or host_cores())
    result: dict[str, Any] = {"cores": P}

    # Compute chains alone: window medians -> peak rates.
    base = {wl: median_ci([s["window_s"] for s in samples.overlap if s["workload"] == wl and s["bytes"] is None])
            for wl in ("matmul", "stream")}
    n_mm = budget.matmul_n
    flops = budget.matmul_iters * 2.0 * n_mm**3
    stream_traffic = budget.stream_iters * 2.0 * budget.stream_bytes
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

    def time_fit(pick: Callable[[int], float]) -> Fit:
        return fit_alone([p[1][0] for p in points], [p[3] for p in points], [pick(i) for i in range(len(points))],
                         workers)

    solo = time_fit(lambda i: med[i][0])
    boots = [time_fit(lambda i: float(np.median(rng.choice(points[i][2], len(points[i][2]))))).params
             for _ in range(budget.bootstrap)]
    solo.ci = {k: (float(np.percentile([b[k] for b in boots], 2.5)), float(np.percentile([b[k] for b in boots], 97.5)))
               for k in solo.params}
    sp = solo.params
    pred = alone_time_s(np.array([p[1][0] for p in points], float), np.array([p[3] for p in points]), workers,
                        sp["beta_bytes_per_s"], sp["link_bytes_per_s"], sp["softmin_p"], sp["latency_s"])

    def part(kind: str) -> tuple[list[dict], float, float]:
        idx = [i for i, p in enumerate(points) if p[0] == kind]
        rows_ = [{"bytes": points[i][1][0], "blocks": points[i][1][1], "cores": points[i][3],
                  "seconds": med[i][0], "ci95": list(med[i][1:]), "predicted_s": float(pred[i])} for i in idx]
        if not idx:
            return rows_, math.nan, math.nan
        return (rows_, *_errors(pred[idx], np.array([med[i][0] for i in idx])))

    skew = float(np.median([s["skew_s"] for s in samples.alone]))
    a_rows, a_rms, a_max = part("alone")
    o_rows, o_rms, o_max = part("overlap")
    result["alone"] = {"fit": solo.as_json(), "arrival_skew_s": skew, "medians": a_rows,
                       "rms_rel_error": a_rms, "max_rel_error": a_max}
    result["overlap"] = {"prediction": {"rms_rel_error": o_rms, "max_rel_error": o_max}, "medians": o_rows,
                         "ended_inside_fraction": len(inside) / max(1, sum("seconds" in s for s in samples.overlap))}

    # Fusion: paired (same repetition) train-step times, one fused bucket minus one all-reduce per
    # tensor, for few big and many small tensors: d = c B - (T - 1) h gives the cost c per fused
    # byte and the cost h of each further all-reduce in a train step (two equations, two unknowns).
    result["fusion_copy"] = fusion_analysis(samples.pack, n_boot=budget.bootstrap, seed=seed)
    return result


def _shipped_pending_allreduce_q() -> dict:
    """The shipped CPU profile's cost of a pending all-reduce (`optimize(overlap="auto")`),
    carried over: calibration does not measure it."""
    shipped = model.load_profile(model.PROFILE_DIR / "cpu-host.json").sources
    q = shipped["fair_share.pending_allreduce_us"]
    return _q(q.value, "assumption", f"not calibrated; from the shipped cpu-host profile: {q.ref}")


def _q(value: Any, source: str, ref: str) -> dict[str, Any]:
    return {"value": value, "source": source, "ref": ref}


#: Where calibration cannot measure the fusion copies (no positive cost): half the streaming
#: bandwidth, as a pack reads and writes each byte once.
FUSION_COPY_FALLBACK_TRAFFIC = 2.0


def build_profile(analysis: dict[str, Any], *, workers: int, budget: Budget, samples: Samples | None,
                  backend: str = "cpu", meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The profile document (``fair-share`` form; valid for :func:`libra_jax.model.profile_from_dict`)."""
    solo = analysis["alone"]["fit"]["params"]
    share = analysis["slowdown"]["fair_share_fit"]["params"]
    flop = analysis["peak"]["flop_per_s"][0]
    mem = analysis["peak"]["memory_bytes_per_s"][0]
    copy_rate, copy_lo, _ = analysis["fusion_copy"]["bytes_per_s"]
    fc = analysis["fusion_copy"]
    shapes = fc["shapes"]
    what = ("train steps with " + " and ".join(f"{int(b) >> 10} KiB in {t} gradients" for b, t in shapes.values())
            + ", one fused bucket vs one all-reduce per tensor, paired")
    if math.isfinite(copy_rate) and copy_rate > 0:
        copy_q = _q(copy_rate / model.BYTES_PER_GBYTE, "measured", what)
    elif math.isfinite(copy_lo) and copy_lo > 0:
        copy_q = _q(copy_lo / model.BYTES_PER_GBYTE, "measured",
                    f"{what}: no cost at the median; the lower end of the 95% interval")
    else:
        copy_q = _q(mem / FUSION_COPY_FALLBACK_TRAFFIC / model.BYTES_PER_GBYTE, "assumption",
                    "no measurable fusion cost: half the streaming bandwidth")
    h = analysis["fusion_copy"]["per_all_reduce_s"][0]
    if h > solo["latency_s"]:
        latency_q = _q(h * 1e6, "measured", f"cost of one more all-reduce in a train step (fusion train steps); "
                                            f"alone, the fitted intercept is {solo['latency_s'] * 1e6:.0f} us")
    else:
        latency_q = _q(solo["latency_s"] * 1e6, "measured", "fitted intercept (arrival skew excluded)")
    cal = "measured by libra-jax calibrate"
    doc = {
        "schema_version": model.SCHEMA_VERSION,
        "name": f"{backend}-calibrated",
        "form": "fair-share",
        "description": f"Calibrated on {workers} {backend} devices by `libra-jax calibrate` "
                       f"({(meta or {}).get('date', '')}).",
        "notes": [
            "Measured: in-place all-reduce time vs bytes x blocks alone and while compute runs, compute slowdown "
            "vs blocks (matmul-bound and memory-bound chains), sustained matmul FLOP/s and streaming bandwidth "
            "per device with every device running, and the cost of packing a fused bucket.",
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
            "softmin_p": _q(solo["softmin_p"], "measured", cal),
            "cores": _q(analysis["cores"], "measured", "CPUs this process may run on"),
            "compute_threads": _q(share["compute_threads"], "measured",
                                  "fitted: slowdown max(1, (D+k)/P) / max(1, D/P) of both chains"),
            "fusion_copy_gbyte_per_s": copy_q,
            "pending_allreduce_us": _shipped_pending_allreduce_q(),
        },
        "calibration": {
            **(meta or {}),
            "workers": workers,
            "budget": {"sizes": list(budget.sizes), "overlap_sizes": list(budget.overlap_sizes),
                       "blocks": list(budget.blocks), "reps": budget.reps, "pack_bytes": budget.pack_bytes,
                       "pack_tensors": budget.pack_tensors, "pack_small_bytes": budget.pack_small_bytes,
                       "pack_small_tensors": budget.pack_small_tensors},
            "analysis": analysis,
            "samples": ({"alone": samples.alone, "overlap": samples.overlap, "pack": samples.pack}
                        if samples else {}),
        },
    }
    return doc


def _meta(backend: str) -> dict[str, Any]:
    import jax

    import libra_jax

    return {"machine": {"node": platform.node(), "system": platform.system(), "machine": platform.machine(),
                        "processor": platform.processor(), "cpu_count": os.cpu_count(),
                        "python": platform.python_version()},
            "backend": backend, "jax_version": jax.__version__, "libra_jax_version": libra_jax.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def calibrate(budget: Budget = QUICK, *, devices: int | None = 8, progress: bool = True,
              out: str | os.PathLike | None = None, seed: int = 0) -> tuple[Path, dict[str, Any]]:
    """Measure, fit, validate and write the profile; returns (path, document)."""
    import jax

    t0 = time.perf_counter()
    samples, workers = measure(budget, devices=devices, progress=progress, seed=seed)
    analysis = analyse(samples, workers, budget, seed=seed, cores=host_cores())
    backend = jax.default_backend()
    meta = _meta(backend)
    meta["measure_seconds"] = round(time.perf_counter() - t0, 1)
    doc = build_profile(analysis, workers=workers, budget=budget, samples=samples, backend=backend, meta=meta)
    path = Path(out) if out is not None else model.calibrated_profile_path(backend)
    model.profile_from_dict(doc, origin=repr(str(path)))  # never write a profile that will not load
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path, doc


def summary(doc: dict[str, Any]) -> str:
    """Human-readable results of a calibration."""
    a = doc["calibration"]["analysis"]
    s, sf = a["alone"]["fit"]["params"], a["alone"]["fit"]
    ci = sf["ci95"]
    o = a["overlap"]["prediction"]
    fs = a["slowdown"]["fair_share_fit"]
    fc = a["fusion_copy"]
    rate, rlo, rhi = fc["bytes_per_s"]
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
        f"p {s['softmin_p']:.2f}, latency {s['latency_s'] * 1e6:.0f} us "
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
        "fusion    train steps, fused minus one all-reduce per tensor: "
        + ", ".join(f"{int(fc['shapes'][k][0]) >> 10} KiB in {fc['shapes'][k][1]} gradients "
                    f"{fc['diff_s'][k][0] * 1e3:+.2f} ms"
                    for k in fc.get("diff_s", {}))
        + f" -> fusion costs 1 s per {rate / 1e9:.2f} GB (95% CI {rlo / 1e9:.2f}-{rhi / 1e9:.2f}), one more "
        f"all-reduce {fc['per_all_reduce_s'][0] * 1e6:.0f} us ({fc['per_all_reduce_s'][1] * 1e6:.0f}-"
        f"{fc['per_all_reduce_s'][2] * 1e6:.0f})",
    ]
    return "\n".join(lines)


def run(*, quick: bool = False, out: str | None = None, devices: int | None = 8, progress: bool = True,
        budget: Budget | None = None) -> int:
    """The ``calibrate`` subcommand's body."""
    budget = budget or (QUICK if quick else FULL)
    path, doc = calibrate(budget, devices=devices, progress=progress, out=out)
    print(summary(doc))
    print(f"profile   wrote {path}")
    return 0
