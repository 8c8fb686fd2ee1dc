"""`libra-jax calibrate`: measure the contention model on the running backend and fit a profile.

What is measured (CPU host devices; the "blocks" are the engine's worker tasks)
-------------------------------------------------------------------------------
XLA:CPU runs one multi-device execution at a time, so every measurement is one program, timed by
the engine's per-call records (:func:`libra_jax._ffi.recording`, one clock for all devices):

* **alone** -- a program that is one ``libra_jax.psum(z, blocks=k)`` of ``S`` bytes per device.
  Its time is the engine's ``end - start`` (all ranks arrived -> all outputs written); the
  arrival skew ``start - first_arrival`` is recorded too.
* **overlapped** -- one program with a marker all-reduce (4 bytes) ``m1``, a compute chain that
  depends on ``m1``, a second marker ``m2`` that depends on the chain's result, and an all-reduce
  of ``S`` bytes with ``k`` blocks on independent data, which XLA issues beside the chain. The
  compute window is ``m2.start - m1.end`` (the slowest device's chain); the same program without
  the all-reduce gives the chain's solo time ``C``. Two chains: a **matmul-bound** one (square
  f32 matmuls) and a **memory-bound** one (a streaming ``a * c + 1`` over a buffer larger than
  the caches).
* **peak rates** -- the solo chains give the sustained matmul FLOP/s and the streaming bytes/s
  per device, with every device running (as in data-parallel training).

Every configuration is repeated ``reps`` times; each repetition runs all configurations once in
a shuffled order (interleaved, so drift and noise spread over all of them). Medians come with
bootstrap 95% confidence intervals.

What is fitted (the ``nccl-style`` form of :mod:`libra_jax.model`)
-----------------------------------------------------------------
* alone: ``t = lat + S / (algo * softmin_p(k * beta, L))`` -> ``beta`` (per_block_gbyte_per_s),
  ``L`` (intra_node_gbyte_per_s), ``p`` (softmin_p), ``lat`` (base_latency_us, plus the median
  arrival skew); ``algo = n / (2(n-1))`` as in the model.
* overlapped: the same with ``k * beta * eta`` -> ``eta`` (overlap_block_efficiency), from the
  all-reduces that ended inside the compute window.
* slowdown: while an all-reduce is active for ``D`` seconds of the window, compute runs at
  ``1/s`` of its speed, so ``W - C = D (1 - 1/s)``; a least-squares slope per ``k`` gives
  ``s_mm(k)`` and ``s_mem(k)``. ``s_mm(k) = U / (U - k u)`` -> ``compute_units`` ``U`` and
  ``units_per_block`` ``u`` (integers, grid search); ``s_mem(k) = H / (H - m bus_overlap(k))``
  with ``H`` the measured memory bandwidth -> ``memory_bytes_per_bus_byte`` ``m``.
Least squares are on relative (log) residuals (scipy.optimize.least_squares); the fit error is
the RMS and max relative error over the medians, and bootstrap fits give 95% intervals for the
parameters. ``memory_bound_fraction`` (a property of the workload, not the machine), the NIC and
the inter-node latency cannot be measured on one host and stay assumptions.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from libra_jax import model

__all__ = ["CalibrationError", "Budget", "QUICK", "FULL", "TINY", "calibrate", "run", "fit_alone",
           "fit_overlap", "fit_slowdown_units", "fit_memory_traffic", "slowdown_from_windows",
           "build_profile"]

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


FULL = Budget(sizes=(64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB), overlap_sizes=(4 * MIB, 16 * MIB),
              blocks=(1, 2, 3, 4, 6, 8), reps=9)
QUICK = Budget(sizes=(256 * KIB, 1 * MIB, 4 * MIB), overlap_sizes=(4 * MIB,), blocks=(1, 2, 4), reps=10)
#: For tests: seconds, not minutes.
TINY = Budget(sizes=(64 * KIB, 512 * KIB), overlap_sizes=(256 * KIB,), blocks=(1, 2), reps=2,
              matmul_n=128, matmul_iters=6, stream_bytes=1 * MIB, stream_iters=4, bootstrap=8)


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


def median_ci(values: Sequence[float], n_boot: int = 200, seed: int = 0) -> tuple[float, float, float]:
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
    return hi * ((x / hi) ** -p + (y / hi) ** -p) ** (-1.0 / p)


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
    """The model's all-reduce time: ``lat + bytes / (algo * softmin_p(k * beta * eta, L))``."""
    algo = model.ring_algo_factor(workers)
    return lat + nbytes / (algo * _softmin_np(blocks * beta * eta, np.full_like(nbytes, link, dtype=float), p))


def fit_alone(nbytes: Sequence[float], blocks: Sequence[int], seconds: Sequence[float], workers: int) -> Fit:
    """Fit ``beta`` (bytes/s per block), ``link`` (bytes/s), ``p`` and ``lat`` (s) to solo all-reduce times."""
    least_squares = _least_squares()
    b, k, t = (np.asarray(a, float) for a in (nbytes, blocks, seconds))
    algo = model.ring_algo_factor(workers)
    big = b >= np.median(b)
    rate = float(np.median(b[big] / t[big] / algo))  # rough bus bandwidth
    x0 = np.log([rate / max(1.0, float(np.median(k))), rate * 2, 4.0, max(float(np.min(t)) * 0.3, 1e-6)])

    def resid(x: np.ndarray) -> np.ndarray:
        beta, link, p, lat = np.exp(x)
        return np.log(alone_time_s(b, k, workers, beta, link, p, lat) / t)

    lo = np.log([1e3, 1e3, 0.5, 1e-8])
    hi = np.log([1e13, 1e13, 32.0, 1.0])
    best = None
    for p0 in (1.0, 4.0, 16.0):  # a few starts: p is weakly identified
        x = x0.copy()
        x[2] = math.log(p0)
        r = least_squares(resid, np.clip(x, lo + 1e-9, hi - 1e-9), bounds=(lo, hi))
        if best is None or r.cost < best.cost:
            best = r
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
        except Exception:  # noqa: BLE001 - the backend is up: keep what it has
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
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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
            fn = self._smap(lambda z: self.psum(z, "c", blocks=k), 1, 1)
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
                return psum(chain(m, a, w), "c", blocks=1), psum(z, "c", blocks=k)
            fn2 = self._smap(body2, 4, 2)
            z = self.z[size]
            self._cache[key] = lambda: fn2(self.marker, self.stream, self.w, z)
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


def measure(budget: Budget, *, devices: int | None = 8, progress: bool = True, seed: int = 0) -> tuple[Samples, int]:
    """Run every configuration ``budget.reps`` times, interleaved in a shuffled order per repetition."""
    devs = _devices(devices)
    progs = _Programs(devs, budget)
    configs: list[tuple] = [("alone", s, k) for s in budget.sizes for k in budget.blocks]
    for wl in ("matmul", "stream"):
        configs.append(("overlap", wl, None, None))
        configs += [("overlap", wl, s, k) for s in budget.overlap_sizes for k in budget.blocks]
    bar = _progress(len(configs) * (budget.reps + 1), progress, "calibrate")
    samples = Samples()
    rng = random.Random(seed)
    for rep in range(budget.reps + 1):  # repetition 0 compiles and warms up
        order = list(configs)
        rng.shuffle(order)
        for cfg in order:
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


def analyse(samples: Samples, workers: int, budget: Budget, seed: int = 0) -> dict[str, Any]:
    """Fit the model to the samples; returns the parameters, fit errors, intervals and summaries."""
    rng = np.random.default_rng(seed)
    result: dict[str, Any] = {}

    # Solo all-reduces: fit on the per-configuration medians.
    alone = _medians(samples.alone, ("bytes", "blocks"), "seconds")
    cfgs = sorted(alone)
    med = {c: median_ci(alone[c]) for c in cfgs}

    def solo_fit(pick: Callable[[tuple], float]) -> Fit:
        return fit_alone([c[0] for c in cfgs], [c[1] for c in cfgs], [pick(c) for c in cfgs], workers)

    solo = solo_fit(lambda c: med[c][0])
    boots = [solo_fit(lambda c: float(np.median(rng.choice(alone[c], len(alone[c]))))).params
             for _ in range(budget.bootstrap)]
    solo.ci = {k: (float(np.percentile([b[k] for b in boots], 2.5)), float(np.percentile([b[k] for b in boots], 97.5)))
               for k in solo.params}
    skew = float(np.median([s["skew_s"] for s in samples.alone]))
    result["alone"] = {"fit": solo.as_json(), "arrival_skew_s": skew,
                       "medians": [{"bytes": c[0], "blocks": c[1], "seconds": med[c][0], "ci95": med[c][1:]}
                                   for c in cfgs]}

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

    # Overlapped all-reduces (those that ended inside the compute window) -> eta.
    inside = [s for s in samples.overlap if s.get("ended_inside")]
    ov = _medians(inside, ("bytes", "blocks"), "seconds")
    if ov:
        ocfg = sorted(ov)
        overlap = fit_overlap([c[0] for c in ocfg], [c[1] for c in ocfg], [float(np.median(ov[c])) for c in ocfg],
                              workers, solo)
        boots = [fit_overlap([c[0] for c in ocfg], [c[1] for c in ocfg],
                             [float(np.median(rng.choice(ov[c], len(ov[c])))) for c in ocfg], workers, solo).params
                 for _ in range(budget.bootstrap)]
        overlap.ci = {"eta": (float(np.percentile([b["eta"] for b in boots], 2.5)),
                              float(np.percentile([b["eta"] for b in boots], 97.5)))}
        omed = [{"bytes": c[0], "blocks": c[1], "seconds": median_ci(ov[c])[0], "ci95": median_ci(ov[c])[1:]}
                for c in ocfg]
    else:
        overlap, omed = Fit({"eta": 1.0}, math.nan, math.nan), []
    result["overlap"] = {"fit": overlap.as_json(), "medians": omed,
                         "ended_inside_fraction": len(inside) / max(1, sum("seconds" in s for s in samples.overlap))}

    # Slowdown per workload and block count.
    slow: dict[str, dict[int, float]] = {}
    for wl in ("matmul", "stream"):
        C = base[wl][0]
        slow[wl] = {}
        for k in budget.blocks:
            rows = [s for s in samples.overlap if s["workload"] == wl and s["blocks"] == k and "inside_s" in s]
            slow[wl][k] = slowdown_from_windows([s["window_s"] - C for s in rows], [s["inside_s"] for s in rows])
    ks = list(budget.blocks)
    units = fit_slowdown_units(ks, [slow["matmul"][k] for k in ks])
    H = result["peak"]["memory_bytes_per_s"][0]
    sp = solo.params
    bus_o = [float(_softmin_np(np.array([k * sp["beta_bytes_per_s"] * overlap.params["eta"]]),
                               np.array([sp["link_bytes_per_s"]]), sp["softmin_p"])[0]) for k in ks]
    memory = fit_memory_traffic(ks, [slow["stream"][k] for k in ks], bus_o, H)
    result["slowdown"] = {"matmul": {str(k): v for k, v in slow["matmul"].items()},
                          "stream": {str(k): v for k, v in slow["stream"].items()},
                          "units_fit": units.as_json(), "memory_fit": memory.as_json()}
    return result


def _q(value: Any, source: str, ref: str) -> dict[str, Any]:
    return {"value": value, "source": source, "ref": ref}


def build_profile(analysis: dict[str, Any], *, workers: int, budget: Budget, samples: Samples | None,
                  backend: str = "cpu", meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The profile document (valid for :func:`libra_jax.model.profile_from_dict`)."""
    solo = analysis["alone"]["fit"]["params"]
    eta = analysis["overlap"]["fit"]["params"]["eta"]
    units = analysis["slowdown"]["units_fit"]["params"]
    m = analysis["slowdown"]["memory_fit"]["params"]["memory_bytes_per_bus_byte"]
    flop = analysis["peak"]["flop_per_s"][0]
    mem = analysis["peak"]["memory_bytes_per_s"][0]
    U, u = int(units["compute_units"]), int(units["units_per_block"])
    options = [k for k in budget.blocks if k * u < U] or [1]
    latency_us = (solo["latency_s"] + analysis["alone"]["arrival_skew_s"]) * 1e6
    cal = "measured by libra-jax calibrate"
    doc = {
        "schema_version": model.SCHEMA_VERSION,
        "name": f"{backend}-calibrated",
        "form": "nccl-style",
        "description": f"Calibrated on {workers} {backend} devices by `libra-jax calibrate` "
                       f"({(meta or {}).get('date', '')}).",
        "notes": [
            "Measured: all-reduce time vs bytes x blocks alone and while compute runs, compute slowdown vs "
            "blocks (matmul-bound and memory-bound chains), sustained matmul FLOP/s and streaming bandwidth "
            "per device with every device running.",
            "Peak rates are the sustained rates of XLA's kernels, so the efficiencies are 1.",
            f"Latency is for {workers} ranks (base_latency_us; the per-step latency is not separated).",
            "memory_bound_fraction, the NIC and inter-node latency cannot be measured on one host: assumptions.",
        ],
        "device": {
            "name": f"{backend} device ({platform.processor() or platform.machine()})",
            "compute_unit_kind": "core",
            "compute_units": _q(U, "measured", f"fitted: matmul slowdown s(k) = U/(U - k*u), u = {u}"),
            "peak_dense_tflop_per_s": {
                "fp32": _q(flop / model.FLOP_PER_TFLOP, "measured", f"{budget.matmul_n}^2 f32 matmul chain, all devices"),
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
            "base_latency_us": _q(latency_us, "measured", "fitted intercept plus median arrival skew"),
            "intra_node_step_latency_us": _q(0, "measured", "folded into base_latency_us"),
            "inter_node_step_latency_us": _q(15, "assumption", "not measurable on one host"),
        },
        "nccl_style": {
            "block_options": _q(options, "measured", "block counts calibrated (those leaving compute units)"),
            "threads_per_block": _q(1, "assumption", "one engine worker task per block"),
            "per_block_gbyte_per_s": _q(solo["beta_bytes_per_s"] / model.BYTES_PER_GBYTE, "measured", cal),
            "softmin_p": _q(solo["softmin_p"], "measured", cal),
            "overlap_block_efficiency": _q(min(1.0, eta), "measured", cal),
            "units_per_block": _q(u, "measured", cal),
            "memory_bytes_per_bus_byte": _q(m, "measured", cal),
            "memory_bound_fraction": _q(0.5, "assumption", "a workload property; 0.5 as the cpu-host profile"),
        },
        "calibration": {
            **(meta or {}),
            "workers": workers,
            "budget": {"sizes": list(budget.sizes), "overlap_sizes": list(budget.overlap_sizes),
                       "blocks": list(budget.blocks), "reps": budget.reps},
            "analysis": analysis,
            "samples": {"alone": samples.alone, "overlap": samples.overlap} if samples else {},
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
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def calibrate(budget: Budget = QUICK, *, devices: int | None = 8, progress: bool = True,
              out: str | os.PathLike | None = None, seed: int = 0) -> tuple[Path, dict[str, Any]]:
    """Measure, fit, validate and write the profile; returns (path, document)."""
    import jax

    t0 = time.perf_counter()
    samples, workers = measure(budget, devices=devices, progress=progress, seed=seed)
    analysis = analyse(samples, workers, budget, seed=seed)
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
    o = a["overlap"]["fit"]
    lines = [
        f"devices {doc['calibration']['workers']} ({doc['calibration']['backend']}), jax {doc['calibration']['jax_version']}",
        f"peak      matmul {a['peak']['flop_per_s'][0] / 1e9:.1f} GFLOP/s per device "
        f"(95% CI {a['peak']['flop_per_s'][1] / 1e9:.1f}-{a['peak']['flop_per_s'][2] / 1e9:.1f}), "
        f"stream {a['peak']['memory_bytes_per_s'][0] / 1e9:.2f} GB/s per device "
        f"({a['peak']['memory_bytes_per_s'][1] / 1e9:.2f}-{a['peak']['memory_bytes_per_s'][2] / 1e9:.2f})",
        f"alone     per block {s['beta_bytes_per_s'] / 1e9:.2f} GB/s "
        f"({ci['beta_bytes_per_s'][0] / 1e9:.2f}-{ci['beta_bytes_per_s'][1] / 1e9:.2f}), cap L "
        f"{s['link_bytes_per_s'] / 1e9:.2f} GB/s ({ci['link_bytes_per_s'][0] / 1e9:.2f}-{ci['link_bytes_per_s'][1] / 1e9:.2f}), "
        f"p {s['softmin_p']:.2f}, latency {s['latency_s'] * 1e6:.0f} us + skew {a['alone']['arrival_skew_s'] * 1e6:.0f} us; "
        f"fit error rms {sf['rms_rel_error'] * 100:.1f}%, max {sf['max_rel_error'] * 100:.1f}%",
        f"overlap   eta {o['params']['eta']:.3f} (95% CI {o.get('ci95', {}).get('eta', [math.nan] * 2)[0]:.3f}-"
        f"{o.get('ci95', {}).get('eta', [math.nan] * 2)[1]:.3f}); fit error rms {o['rms_rel_error'] * 100:.1f}%, "
        f"max {o['max_rel_error'] * 100:.1f}% ({a['overlap']['ended_inside_fraction'] * 100:.0f}% of overlapped "
        f"all-reduces ended inside the compute window)",
        "slowdown  matmul " + ", ".join(f"k={k}: {v:.2f}" for k, v in a["slowdown"]["matmul"].items())
        + f" -> U={a['slowdown']['units_fit']['params']['compute_units']}, u={a['slowdown']['units_fit']['params']['units_per_block']} "
        f"(fit error rms {a['slowdown']['units_fit']['rms_rel_error'] * 100:.1f}%)",
        "          stream " + ", ".join(f"k={k}: {v:.2f}" for k, v in a["slowdown"]["stream"].items())
        + f" -> m={a['slowdown']['memory_fit']['params']['memory_bytes_per_bus_byte']:.2f} "
        f"(fit error rms {a['slowdown']['memory_fit']['rms_rel_error'] * 100:.1f}%)",
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
