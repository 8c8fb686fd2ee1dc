"""`libra-jax calibrate`: measure the contention model on the running backend and fit a profile.

What is measured (CPU host devices; the "blocks" are the engine's worker tasks)
-------------------------------------------------------------------------------
XLA:CPU runs one multi-device execution at a time, so every measurement is one program, timed by
the engine's per-call records (`libra_jax._ffi.recording`, one clock for all devices):

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
* **calls** -- wall-clock time of a small MLP train step written ``pmean(jax.grad(loss))``
  (``T`` gradient tensors, ``S`` bytes per device) through ``optimize`` at 2 blocks a call,
  start/done pairs: one call per gradient, each issued where its gradient is ready, minus one
  call for all after the backward pass, paired per repetition (``CALL_REPEATS`` pairs each);
  once with few big tensors (8 MiB in 8), once with many small ones (1 MiB in 64). The plans
  ``optimize`` made of them are recorded, so the model can predict the same difference.
Every configuration is repeated ``reps`` times; each repetition runs all configurations once in
a shuffled order (interleaved, so drift and noise spread over all of them). Medians come with
bootstrap 95% confidence intervals.

What is fitted (the ``fair-share`` form of `libra_jax.model`)
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
* calls: with the rest of the profile fitted, ``call_us`` (what one more call costs the compute
  stream beside its latency) and ``overlap_block_efficiency`` (the fraction of a worker's fair
  share kept beside compute) that make the model's difference of the two plans the measured one
  for both shapes (`build.call_terms`); ``base_latency_us`` is the alone fit's intercept.
  Nothing is packed (the engine takes a bucket's members as they are): the fusion copy is null.
Least squares are on relative (log) residuals (scipy.optimize.least_squares); the fit error is
the RMS and max relative error over the medians, and bootstrap fits give 95% intervals for the
parameters. The NIC and the inter-node latency cannot be measured on one host and stay
assumptions.

Where the profile goes
----------------------
`libra_jax.model.calibrated_profile_path`: ``$LIBRA_JAX_PROFILE_DIR/<backend>.json`` if
that variable is set, else ``$XDG_CACHE_HOME/libra_jax/profiles/<backend>.json`` (``~/.cache``
without ``XDG_CACHE_HOME``). ``optimize`` and ``psum(blocks=None)`` use it by default
(`libra_jax.model.default_profile`).

Layout: `fit` (pure fits, no JAX), `measure` (the budget and the timed programs), `build` (the
analysis and the profile document); this module runs them (`calibrate`, `run`) and re-exports
their public names. Layer (the tools'): may import `model`, `config`, `planner`, and JAX and
`libra_jax._ffi` when it measures; `fit` imports only `model` and numpy (scipy when it fits).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from libra_jax import config, model
from libra_jax.calibrate.build import (
    GATE_LIMITS,
    analyse,
    build_profile,
    call_terms,
    host_meta,
    quality,
    summary,
)
from libra_jax.calibrate.fit import (
    CalibrationError,
    Fit,
    alone_time_s,
    fit_alone,
    fit_call_terms,
    fit_fair_share,
    fit_memory_traffic,
    fit_overlap,
    fit_slowdown_units,
    host_cores,
    median_ci,
    slowdown_from_windows,
)
from libra_jax.calibrate.measure import (
    FULL,
    KIB,
    MIB,
    QUICK,
    TINY,
    Budget,
    Conditions,
    Samples,
    measure,
    reference_seconds,
)
from libra_jax.calibrate.probe import sync_stagger, xla_rates

__all__ = [
    "CalibrationError", "Budget", "QUICK", "FULL", "TINY", "calibrate", "run", "fit_alone",
    "fit_overlap", "fit_slowdown_units", "fit_memory_traffic", "fit_fair_share",
    "slowdown_from_windows", "fit_call_terms", "call_terms", "host_cores", "build_profile",
    "median_ci", "alone_time_s", "Fit", "Samples", "measure", "analyse", "summary", "KIB", "MIB",
    "quality", "GATE_LIMITS", "Conditions", "reference_seconds",
]


def calibrate(budget: Budget = QUICK, *, devices: int | None = 8, progress: bool = True,
              out: str | os.PathLike | None = None, seed: int = 0,
              install: bool | None = None) -> tuple[Path, dict[str, Any]]:
    """Measure, fit, validate and write the profile; returns (path, document).

    Where it goes: `out` if given. Else the default profile's path
    (`model.calibrated_profile_path`), where `optimize` finds it, if it is installed: it
    passes the quality gate (`build.quality`: fit error, interval widths, compute threads, the
    host's steal time and a reference computation before and after) and the budget is not a
    smoke test (`Budget.smoke`, e.g. `QUICK`) unless `install` is True. A profile that is not
    installed is written beside the default as ``<backend>.rejected.json`` (failed the gate) or
    ``<backend>.quick.json`` (a smoke test), with a warning naming why. The document records
    the gate's verdict and the host's conditions (``calibration.quality``)."""
    import jax

    t0 = time.perf_counter()
    conditions = Conditions()
    conditions.start()
    samples, workers = measure(budget, devices=devices, progress=progress, seed=seed)
    host = conditions.finish()
    analysis = analyse(samples, workers, budget, seed=seed, cores=host_cores())
    backend = jax.default_backend()
    meta = host_meta(backend)
    meta["measure_seconds"] = round(time.perf_counter() - t0, 1)
    failures = quality(analysis, workers, host)
    meta["quality"] = {"passed": not failures, "failures": failures, "limits": GATE_LIMITS,
                       "conditions": host}
    xla = xla_rates(devices=devices) if backend == "cpu" else None  # XLA's own: the plain step
    if xla is not None:  # and how far apart the devices reach its blocking calls
        xla = dataclasses.replace(xla, sync_stagger=sync_stagger(xla.call_s, devices=devices))
    doc = build_profile(analysis, workers=workers, budget=budget, samples=samples, backend=backend,
                        meta=meta, xla=xla)
    if out is not None:
        path = Path(out)
        if failures:
            config.notice("calibration-gate-failed",
                          f"libra-jax calibrate: the profile at {path} fails the quality gate: "
                          + "; ".join(failures), stacklevel=2)
    else:
        path = model.calibrated_profile_path(backend)
        if failures:
            path = path.with_name(f"{backend}.rejected.json")
            config.notice("calibration-rejected",
                          "libra-jax calibrate: not installed as the default profile (it fails the "
                          f"quality gate: {'; '.join(failures)}); written to {path}", stacklevel=2)
        elif budget.smoke and not install:
            path = path.with_name(f"{backend}.quick.json")
            config.notice("calibration-smoke-test",
                          "libra-jax calibrate: a quick calibration is a smoke test, not installed as "
                          f"the default profile (--install installs it); written to {path}",
                          stacklevel=2)
    model.profile_from_dict(doc, origin=repr(str(path)))  # never write a profile that will not load
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path, doc


def run(*, quick: bool = False, out: str | None = None, devices: int | None = 8, progress: bool = True,
        budget: Budget | None = None, install: bool = False) -> int:
    """The ``calibrate`` subcommand's body."""
    budget = budget or (QUICK if quick else FULL)
    path, doc = calibrate(budget, devices=devices, progress=progress, out=out, install=install)
    print(summary(doc))
    print(f"profile   wrote {path}")
    return 0
