"""The machine probe's measuring side (`libra_jax.model.probe` rescales the shipped CPU profile
with it): about a second of calibration's own measurements, nothing of its own.

What it measures, and why so: the two rates the profile's rate fields mean, as calibration
measures them (`measure._Programs.overlapped` without an all-reduce, timed by
`measure.marker_window` between its marker all-reduces, rates by `measure.chain_flop` and
`measure.chain_bytes`, `analyse`'s formulas): the sustained matmul FLOP/s of a device (a chain
of ``FULL.matmul_n``-square f32 matmuls, ``device.peak_dense_tflop_per_s`` at
``compute_efficiency`` 1) and its streaming bytes/s (``a * c + 1`` over a buffer larger than
the caches, ``device.memory_gbyte_per_s``), with every CPU device of this process running, as
in data-parallel training. The chains are `FULL`'s, those the shipped profile was fitted
with, so that probe/shipped compares one quantity; the medians of `PROBE_REPS` interleaved
repetitions after a warm-up (compiles included, about a second on a 2-core host).

It runs in a thread of its own: the default profile is resolved while a step is traced or
lowered, where JAX would stage the probe's programs into the step; a fresh thread has no trace
of the caller's. A probe that takes longer than `PROBE_TIMEOUT_S` is abandoned (RuntimeError:
the model then plans with the shipped profile).
"""
from __future__ import annotations

import dataclasses
import random
import statistics
import threading
from typing import Any

from libra_jax.calibrate.fit import CalibrationError
from libra_jax.calibrate.measure import (
    FULL,
    Budget,
    _Programs,
    _records,
    chain_bytes,
    chain_flop,
    marker_window,
)
from libra_jax.model.probe import Rates

#: Timed runs of each chain (after one warm-up run that compiles).
PROBE_REPS = 5
#: The longest a probe may take before the shipped profile plans instead.
PROBE_TIMEOUT_S = 60.0
#: Calibration's full budget with its chains only: no all-reduce sizes, no block counts.
PROBE_BUDGET = dataclasses.replace(FULL, sizes=(), overlap_sizes=(), blocks=(), reps=PROBE_REPS,
                                   smoke=True)


def context() -> tuple[int, str, str]:
    """(CPU devices of this process, JAX's version, why the probe is off here or "")."""
    import jax

    if jax.process_count() > 1:
        return 0, jax.__version__, "a multi-process run: every process plans with the shipped profile"
    devices = len(jax.devices("cpu"))
    if devices < 2:
        return devices, jax.__version__, "fewer than 2 CPU devices: no all-reduce to plan"
    return devices, jax.__version__, ""


def rates(budget: Budget = PROBE_BUDGET, seed: int = 0) -> Rates:
    """The two rates, measured in the calling thread (`measure` runs it in a thread of its own)."""
    import jax

    programs = _Programs(jax.devices("cpu"), budget)
    windows: dict[str, list[float]] = {"matmul": [], "stream": []}
    order = list(windows)
    rng = random.Random(seed)
    for rep in range(budget.reps + 1):  # repetition 0 compiles and warms up
        rng.shuffle(order)
        for workload in order:
            window = marker_window(_records(programs.overlapped(workload, None, None)))
            if rep and window is not None and window[1] > window[0]:
                windows[workload].append((window[1] - window[0]) * 1e-6)
    if not all(windows.values()):
        raise CalibrationError("the probe's chains left no compute window (no marker records)")
    return Rates(chain_flop(budget) / statistics.median(windows["matmul"]),
                 chain_bytes(budget) / statistics.median(windows["stream"]))


def measure(timeout_s: float = PROBE_TIMEOUT_S) -> Rates:
    """`rates`, in a fresh thread (no trace of the caller's), within `timeout_s`."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["rates"] = rates()
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=run, name="libra_jax-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RuntimeError(f"the probe took more than {timeout_s:g} s")
    if "error" in result:
        raise result["error"]
    probed: Rates = result["rates"]
    return probed
