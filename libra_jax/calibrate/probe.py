"""The machine probe's measuring side (`libra_jax.model.probe` rescales the shipped CPU profile
with it): about a second of calibration's own measurements, XLA's all-reduce timed
(`xla_rates`, about 0.8 s, which calibration runs too), and how far apart the devices
reach a synchronization after compute (`sync_stagger`, about 1.2 s).

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
import time
from typing import Any

from libra_jax import config
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
from libra_jax.model.probe import Rates, XlaRates

#: Timed runs of each chain (after one warm-up run that compiles).
PROBE_REPS = 5
#: XLA's all-reduce (`xla_rates`): timed rounds, per-device f32 elements of the small and the
#: large operand (1 KiB: its call; 256 KiB, 4 MiB a device over the operands, 32 MiB over a
#: host's 8 devices, past their caches: its bytes), and the operands of a combined call.
XLA_REPS = 21
#: Timed rounds of the call's two arms (small psums, a few ms a round): its estimate is the
#: difference of two medians over 15 operands, which 21 rounds left at 81-171 us across
#: five probes on the 2-core VM and 61 at 158-181 (2026-12-07, 19:25), for 0.1 s more.
XLA_CALL_REPS = 61
XLA_SMALL_ELEMENTS = 256
XLA_LARGE_ELEMENTS = 1 << 16
XLA_OPERANDS = 16
#: The devices' stagger (`sync_stagger`): timed rounds (over 9, five probes on the 2-core VM
#: gave 447-607 us per root ms; over 21, 427-492, for 0.5 s more: 2026-12-07, 19:41), compute
#: segments (each a tanh of an f32 matmul of `SYNC_N` square a device: about 1.3 ms with 8
#: devices on 2 cores).
SYNC_REPS = 21
SYNC_SEGMENTS = 16
SYNC_N = 256
#: The longest a probe may take before the shipped profile plans instead.
PROBE_TIMEOUT_S = 60.0
#: How long a probe that overran is waited for once told to stop (it stops at its next
#: program: a run or a compile, well under a second on a 2-core host).
STOP_WAIT_S = 30.0


class ProbeStopped(Exception):
    """The probe was told to stop: it overran its time (`measure`)."""


#: Set by `measure` when its probe overruns; the probe's loops stop at their next program.
_stop = threading.Event()


def _go_on() -> None:
    """Raise `ProbeStopped` where `measure` has told the probe to stop. Why: an abandoned probe
    that went on dispatching programs would run them beside the step on the same devices,
    and collectives of two programs dispatched in different orders on different devices
    can wait on each other."""
    if _stop.is_set():
        raise ProbeStopped("the probe overran its time and was told to stop")
#: Calibration's full budget with its chains only: no all-reduce sizes, no block counts.
PROBE_BUDGET = dataclasses.replace(FULL, sizes=(), overlap_sizes=(), blocks=(), reps=PROBE_REPS,
                                   smoke=True)


def local_cpus() -> list[Any]:
    """This process's CPU devices: what the probe runs on. Under multi-process JAX,
    ``jax.devices()`` is every process's, and a collective over them waits for every process
    (gloo); one over this process's own runs alone (measured: process 0's probe beside an idle
    process 1, tests/test_multiprocess.py)."""
    import jax

    return list(jax.local_devices(backend="cpu"))


def context() -> tuple[int, str, str]:
    """(CPU devices of this process, JAX's version, why the probe is off here or "").

    In a multi-process run only process 0 probes: `rewrite.shared_profile` broadcasts the
    profile it plans with, so every process plans with process 0's probe. Where that broadcast
    is off (``LIBRA_JAX_NO_PROFILE_BROADCAST=1``), no process probes: each plans with the
    shipped profile, so that their plans agree."""
    import jax

    devices = len(local_cpus())
    if jax.process_count() > 1:
        if not config.profile_broadcast():
            return devices, jax.__version__, (f"a multi-process run with {config.NO_PROFILE_BROADCAST_ENV}"
                                              "=1: every process plans with the shipped profile")
        if jax.process_index() != 0:
            return devices, jax.__version__, (f"process {jax.process_index()} of a multi-process "
                                              "run: it plans with process 0's probe (broadcast)")
    if devices < 2:
        return devices, jax.__version__, "fewer than 2 CPU devices: no all-reduce to plan"
    return devices, jax.__version__, ""


def rates(budget: Budget = PROBE_BUDGET, seed: int = 0) -> Rates:
    """The two rates, measured in the calling thread (`measure` runs it in a thread of its own)."""
    programs = _Programs(local_cpus(), budget)
    windows: dict[str, list[float]] = {"matmul": [], "stream": []}
    order = list(windows)
    rng = random.Random(seed)
    for rep in range(budget.reps + 1):  # repetition 0 compiles and warms up
        rng.shuffle(order)
        for workload in order:
            _go_on()
            window = marker_window(_records(programs.overlapped(workload, None, None)))
            if rep and window is not None and window[1] > window[0]:
                windows[workload].append((window[1] - window[0]) * 1e-6)
    if not all(windows.values()):
        raise CalibrationError("the probe's chains left no compute window (no marker records)")
    return Rates(chain_flop(budget) / statistics.median(windows["matmul"]),
                 chain_bytes(budget) / statistics.median(windows["stream"]))


def psum_program(jax: Any, mesh: Any, elements: int, operands: int, reduce: bool) -> Any:
    """A jitted shard_map over `mesh` taking one f32 array of `elements` per device and psum-ing
    `operands` distinct arrays of that size (one all-reduce of `operands` operands, as XLA's
    combiner makes of a plain step's gradients), or none (`reduce` False: the same program's
    other costs, dispatch included). One input and one small output either way."""
    from jax.sharding import PartitionSpec as P

    def body(x: Any) -> Any:
        ys = [x * (1.0 + i / 1024) for i in range(operands)]
        if reduce:
            ys = jax.lax.psum(ys, "p")
        return sum(y[:1] for y in ys)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("p"), out_specs=P("p")))


def interleaved_times(programs: dict[Any, tuple[Any, Any]], reps: int, rng: random.Random
                      ) -> dict[Any, list[float]]:
    """Per key, the seconds of `reps` runs of its ``(program, argument)``, each whole
    (``block_until_ready``), the keys in a shuffled order each round, after a round that
    compiles and warms up."""
    import jax

    times: dict[Any, list[float]] = {key: [] for key in programs}
    order = list(programs)
    for rep in range(reps + 1):
        rng.shuffle(order)
        for key in order:
            _go_on()
            program, x = programs[key]
            start = time.perf_counter()
            jax.block_until_ready(program(x))
            if rep:
                times[key].append(time.perf_counter() - start)
    return times


def xla_rates(reps: int = XLA_REPS, seed: int = 0, devices: int | None = None,
              call_reps: int = XLA_CALL_REPS) -> XlaRates:
    """XLA's all-reduce on this machine's CPU devices (`XlaRates`), in the calling thread.

    Six programs (`psum_program`), timed whole (``block_until_ready``) in interleaved rounds
    after one that compiles, medians: one and `XLA_OPERANDS` operands of
    `XLA_SMALL_ELEMENTS` psum-ed over `call_reps` rounds (their difference over the operands
    added: an operand's call), and `XLA_OPERANDS` operands of `XLA_LARGE_ELEMENTS` against as
    many small ones, each less the same program without the psum, over `reps` rounds (the
    difference: their bytes). What programs share (dispatch, the multiplies) cancels in the
    differences. The bytes are timed over several operands because a plain step's combined
    all-reduce has several, and XLA:CPU moves a byte of one operand among several at about
    half the rate of a lone operand's (benchmarks/results/xla_operands.md). `devices`: the
    first that many CPU devices (None: all)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    chosen = local_cpus()[:devices]
    mesh = Mesh(np.array(chosen), ("p",))
    small, large, many = XLA_SMALL_ELEMENTS, XLA_LARGE_ELEMENTS, XLA_OPERANDS
    arms = {"one": (small, 1, True), "many": (small, many, True), "many_none": (small, many, False),
            "large": (large, many, True), "large_none": (large, many, False)}
    programs = {}
    for name, (elements, operands, reduce) in arms.items():
        x = jax.device_put(np.ones(elements * len(chosen), np.float32), NamedSharding(mesh, P("p")))
        programs[name] = (psum_program(jax, mesh, elements, operands, reduce), x)
    rng = random.Random(seed)
    # Two phases: the calls' arms apart from the large ones, whose long calls leave the device
    # threads slower to meet the next small call's rendezvous (measured: the call cost two to
    # six times itself when interleaved with them).
    calls = {k: statistics.median(v) for k, v in interleaved_times(
        {k: programs[k] for k in ("one", "many")}, call_reps, rng).items()}
    moved = {k: statistics.median(v) for k, v in interleaved_times(
        {k: programs[k] for k in ("many", "many_none", "large", "large_none")}, reps, rng).items()}
    call_s = max(0.0, (calls["many"] - calls["one"]) / (many - 1))
    bytes_s = (moved["large"] - moved["large_none"]) - (moved["many"] - moved["many_none"])
    if not bytes_s > 0:
        raise CalibrationError(f"XLA's psum of {many} operands of {large * 4} bytes took no longer "
                               f"than of {small * 4} bytes: no bytes rate")
    return XlaRates(call_s, many * (large - small) * 4 / bytes_s)


def sync_program(jax: Any, mesh: Any, segments: int, synced: bool, matmuls: int = 1) -> Any:
    """A jitted shard_map over `mesh` of `segments` compute segments, each `matmuls` of
    ``tanh(x @ w)`` on the device's square f32 block ``x`` (its side the input's columns):
    `synced`, each segment followed by a psum of a few of its values that the next segment
    reads (every device waits for the last at each: a blocking collective between compute, as
    a plain step's reduce-scatters are); else one psum of the same values after all of them."""
    from jax.sharding import PartitionSpec as P

    def body(x: Any) -> Any:
        w = x * 0.05
        picked = []
        for _ in range(segments):
            for _ in range(matmuls):
                x = jax.numpy.tanh(x @ w)
            if synced:
                x = x + 0.0 * jax.lax.psum(x[:1, :8], "p").sum()
            else:
                picked.append(x[:1, :8])
        if not synced:
            x = x + 0.0 * jax.lax.psum(jax.numpy.stack(picked), "p").sum()
        return x[:1]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("p"), out_specs=P("p")))


def stagger_of(synced: list[float], apart: list[float], segments: int, call_s: float) -> float:
    """The stagger (seconds per root second) that paired times of `sync_program`'s two forms
    say: the synced form's extra time less its ``segments - 1`` extra calls (`call_s` each),
    over the square roots its segments add, ``K * sqrt(T) - sqrt(K * T)`` (T the apart form's
    time over K). At least 0."""
    k = segments
    added = statistics.median(a - b for a, b in zip(synced, apart)) - (k - 1) * call_s
    segment = statistics.median(apart) / k
    roots = k * segment ** 0.5 - (k * segment) ** 0.5
    return max(0.0, added / roots) if roots > 0 else 0.0


def sync_stagger(call_s: float, reps: int = SYNC_REPS, seed: int = 0,
                 devices: int | None = None) -> float:
    """How far behind the others the last device reaches a synchronization, per square root of
    the compute since the last one (seconds per root second: `FairShare.sync_stagger`).

    Why this form: where the devices' threads share the cores, the scheduler's time slices
    let each run ahead or fall behind, a random walk, so the last of them arrives about
    ``c * sqrt(T)`` after the others, T the compute since they last met; on a host where each
    has a core of its own, c is about 0. Measured on one 2-core VM with 8 devices
    (benchmarks/results/sync_stagger.md): c 354-630 us per root ms over segments of 0.18 to
    27 ms. Here: `sync_program` synced (`SYNC_SEGMENTS` segments, a psum after each) against
    apart (one psum after them all) in paired interleaved rounds, `stagger_of` their times
    (`call_s`: XLA's cost of a call, taken out for the synced form's extra calls)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    chosen = local_cpus()[:devices]
    mesh = Mesh(np.array(chosen), ("p",))
    block = np.random.default_rng(seed).standard_normal((SYNC_N * len(chosen), SYNC_N))
    x = jax.device_put((block * 0.1).astype(np.float32), NamedSharding(mesh, P("p")))
    times = interleaved_times({synced: (sync_program(jax, mesh, SYNC_SEGMENTS, synced), x)
                               for synced in (True, False)}, reps, random.Random(seed))
    return stagger_of(times[True], times[False], SYNC_SEGMENTS, call_s)


def time_limit_s() -> float:
    """How long a probe may take: `PROBE_TIMEOUT_S`, and in a multi-process run at most half of
    ``LIBRA_JAX_TIMEOUT_S``, the time the other processes wait for process 0's profile (a
    probe that overruns is abandoned and the shipped profile is broadcast, in time)."""
    import jax

    if jax.process_count() > 1:
        return min(PROBE_TIMEOUT_S, config.timeout_s() / 2)
    return PROBE_TIMEOUT_S


def measure(timeout_s: float | None = None) -> Rates:
    """`rates`, `xla_rates` and `sync_stagger`, in a fresh thread (no trace of the caller's),
    within `timeout_s` (None: `time_limit_s`). A probe that overruns is told to stop and
    waited for (`STOP_WAIT_S` at most) before this raises, so that none of its programs runs
    beside the caller's."""
    limit = time_limit_s() if timeout_s is None else timeout_s
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            xla = xla_rates()
            result["rates"] = dataclasses.replace(rates(), xla=dataclasses.replace(
                xla, sync_stagger=sync_stagger(xla.call_s)))
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=run, name="libra_jax-probe", daemon=True)
    _stop.clear()
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        _stop.set()
        thread.join(STOP_WAIT_S)
        still = "" if not thread.is_alive() else f" (and had not stopped {STOP_WAIT_S:g} s later)"
        if not still:
            _stop.clear()  # stopped: `xla_rates` and the others measure again when called
        raise RuntimeError(f"the probe took more than {limit:g} s{still}")
    if "error" in result:
        raise result["error"]
    probed: Rates = result["rates"]
    return probed
