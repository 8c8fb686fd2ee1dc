"""Calibration's measurements: the budget (sizes, block counts, repetitions) and the programs that
time all-reduces alone and beside compute on this host's devices, read from the engine's own call
records (`libra_jax._ffi.recording`). Imports JAX when it measures, not before."""
from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from libra_jax.calibrate.fit import CalibrationError

KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Budget:
    """What one calibration run measures. A ``smoke`` budget (`QUICK`, `TINY`) checks that
    calibration works; its profile is not installed as the default unless asked."""

    sizes: tuple[int, ...]            # bytes per device of the solo all-reduces
    overlap_sizes: tuple[int, ...]    # bytes per device of the overlapped all-reduces
    blocks: tuple[int, ...]
    reps: int
    matmul_n: int = 256
    matmul_iters: int = 16
    stream_bytes: int = 8 * MIB
    stream_iters: int = 12
    bootstrap: int = 40
    calls_bytes: int = 8 * MIB        # gradient bytes per device of the calls train step, few big tensors
    calls_tensors: int = 8            # its gradient tensors
    calls_small_bytes: int = 1 * MIB  # the same with many small tensors
    calls_small_tensors: int = 64
    smoke: bool = False


FULL = Budget(sizes=(64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB), overlap_sizes=(4 * MIB, 16 * MIB),
              blocks=(1, 2, 3, 4, 6, 8), reps=9)


QUICK = Budget(sizes=(256 * KIB, 1 * MIB, 4 * MIB), overlap_sizes=(4 * MIB,), blocks=(1, 2, 4), reps=10,
               calls_bytes=4 * MIB, calls_small_bytes=512 * KIB, calls_small_tensors=32, smoke=True)


#: For tests: seconds, not minutes.
TINY = Budget(sizes=(64 * KIB, 512 * KIB), overlap_sizes=(256 * KIB,), blocks=(1, 2), reps=2,
              matmul_n=128, matmul_iters=6, stream_bytes=1 * MIB, stream_iters=4, bootstrap=8,
              calls_bytes=256 * KIB, calls_tensors=4, calls_small_bytes=64 * KIB, calls_small_tensors=8,
              smoke=True)


# --- What the host was doing -------------------------------------------------------------------
#
# On a shared VM the load average need not show co-tenants: the hypervisor's steal time
# (/proc/stat) and a fixed computation timed before and after the measurements do; the threads
# runnable besides this one (procs_running) show a competing process on this host.

def _cpu_jiffies() -> tuple[int, int] | None:
    """(steal, total) CPU time of the host so far, in jiffies (/proc/stat); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    values = [int(v) for v in fields[1:]]
    return values[7], sum(values[:8])  # user nice system idle iowait irq softirq steal


def _others_runnable(samples: int = 9, pause_s: float = 0.02) -> float | None:
    """Median count of runnable threads other than this one (/proc/stat ``procs_running``,
    sampled): a process competing for the cores shows here at once, where the load average
    lags by a minute."""
    counts = []
    for _ in range(samples):
        try:
            with open("/proc/stat") as f:
                line = next((l for l in f if l.startswith("procs_running")), "")
        except OSError:
            return None
        if not line:
            return None
        counts.append(int(line.split()[1]) - 1)  # this thread, reading
        time.sleep(pause_s)
    return float(np.median(counts))


def _load_average() -> list[float] | None:
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def reference_seconds(repeat: int = 9) -> float:
    """Fastest of `repeat` timings of a fixed single-threaded computation (twenty streaming
    passes over 4 MiB with numpy; no BLAS, whose threads would react to other work): the same
    on a quiet host, slower when something takes its core or memory bandwidth. The fastest,
    not the median: noise only ever adds time."""
    v = np.ones(1 << 19)
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(20):
            float(np.multiply(v, 1.0001).sum())
        best = min(best, time.perf_counter() - t)
    return best


class Conditions:
    """The host's conditions over a calibration: `start` before the measurements, `finish`
    after; `finish` returns what is recorded in the profile (`build.quality` judges it)."""

    def __init__(self) -> None:
        self._jiffies: tuple[int, int] | None = None
        self._before: dict[str, Any] = {}

    def start(self) -> None:
        self._before = {"load_average": _load_average(), "others_runnable": _others_runnable(),
                        "reference_s": reference_seconds()}
        self._jiffies = _cpu_jiffies()

    def finish(self) -> dict[str, Any]:
        jiffies = _cpu_jiffies()
        time.sleep(0.5)  # XLA's and the engine's threads go idle after the last measurement
        steal = None
        if self._jiffies is not None and jiffies is not None and jiffies[1] > self._jiffies[1]:
            steal = (jiffies[0] - self._jiffies[0]) / (jiffies[1] - self._jiffies[1])
        after = {"load_average": _load_average(), "others_runnable": _others_runnable(),
                 "reference_s": reference_seconds()}
        ref0, ref1 = self._before.get("reference_s"), after["reference_s"]
        return {"before": self._before, "after": after, "steal_fraction": steal,
                "reference_drift": (abs(ref1 / ref0 - 1.0) if ref0 else None)}


def _progress(total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar if tqdm is installed, else plain lines every 10%.

    tqdm stays optional (the [calibrate] extra) rather than a dependency: the package itself
    needs only jax and numpy, and the fallback is these few lines."""
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
        self.call_plans: dict[tuple[bool, bool], dict[str, Any]] = {}

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


    def calls(self, fused: bool, small: bool = False) -> Callable[[], Any]:
        """A data-parallel train step as users write it, ``pmean(jax.grad(loss))`` of a small
        MLP (``calls_tensors`` weight and bias gradients, ``calls_bytes`` in all per device, or
        the ``calls_small_`` pair), then an SGD update, through `libra_jax.optimize` at
        ``CALL_BLOCKS`` blocks per call, each a start/done pair: with one call per gradient,
        each issued where its gradient is ready in the backward pass (``fusion=False``), or
        with every gradient in one call after it (``fused``). Both run as `optimize` runs a plan, so their difference
        is what calls cost a step as they run in it; the model's prediction of the same two
        plans (``self.call_plans[(fused, small)]``: the layers and buckets `optimize` planned,
        priced by ``CALL_PROFILE``) leaves the per-call term (`fit.call_cost`)."""
        key = ("calls", fused, small)
        if key not in self._cache:
            jax, P = self.jax, self.P
            jnp = jax.numpy
            import libra_jax

            b = self.budget
            nbytes, tensors = ((b.calls_small_bytes, b.calls_small_tensors) if small
                               else (b.calls_bytes, b.calls_tensors))
            layers = max(1, tensors // 2)
            width = max(8, int(math.sqrt(nbytes / 4 / layers)))
            batch = 32

            def loss(params: Any, x: Any) -> Any:
                for w, c in params:
                    x = jnp.tanh(x @ w + c)
                return jnp.mean(x * x)

            def body(m: Any, x: Any, params: Any) -> Any:
                grads = jax.lax.pmean(jax.grad(loss)(params, x * m[0]), "c")
                return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

            rng = np.random.default_rng(0)
            params = [(jax.numpy.asarray(rng.standard_normal((width, width), np.float32) / width),
                       jax.numpy.zeros((width,), jax.numpy.float32)) for _ in range(layers)]
            params = jax.device_put(params, jax.sharding.NamedSharding(self.mesh, P()))
            x = jax.device_put(rng.standard_normal((self.n * batch, width)).astype(np.float32), self.sharding)
            step = jax.shard_map(body, mesh=self.mesh, in_specs=(P("c"), P("c"), P()), out_specs=P(),
                                 check_vma=False)
            profile = one_call_profile(CALL_PROFILE) if fused else CALL_PROFILE
            optimized = libra_jax.optimize(step, blocks=CALL_BLOCKS, fusion=fused, profile=profile,
                                           overlap="start-done")
            fn = jax.jit(optimized)
            fn.lower(self.marker, x, params)  # traced now: its plan is in the report
            (entry,) = optimized.last_report.predicted
            self.call_plans[(fused, small)] = {
                "layers": [[layer.compute_s, layer.grad_bytes] for layer in entry["layers"]],
                "buckets": [[bk.first, bk.last, bk.blocks] for bk in entry["buckets"]],
                "bytes": sum(w.size + c.size for w, c in params) * 4, "tensors": 2 * layers}
            self._cache[key] = lambda: fn(self.marker, x, params)
        return self._cache[key]


#: The profile `_Programs.calls` plans with (the layers' compute is this profile's roofline of
#: the step), and the block count of its calls.
CALL_PROFILE = "cpu-host"
CALL_BLOCKS = 2
#: Each calls step runs this many times per repetition (pairs within a repetition): their
#: differences are a few percent of a step, and the steps take milliseconds.
CALL_REPEATS = 8


def one_call_profile(name: str) -> dict[str, Any]:
    """Profile `name`'s document with a call priced at a second: `optimize` plans every
    gradient in one bucket with it."""
    from libra_jax import model

    doc = model.profile_to_dict(model.load_profile(name))
    doc["network"]["base_latency_us"]["value"] = 1e6
    return doc


def chain_flop(budget: Budget) -> float:
    """FLOP one device's matmul chain does (`_Programs.overlapped`'s ``matmul``): its rate over
    the chain's window is the profile's ``device.peak_dense_tflop_per_s`` (sustained, all
    devices running)."""
    return budget.matmul_iters * 2.0 * budget.matmul_n**3


def chain_bytes(budget: Budget) -> float:
    """Bytes one device's streaming chain (``a * c + 1``) reads and writes: its rate over the
    chain's window is the profile's ``device.memory_gbyte_per_s``."""
    return budget.stream_iters * 2.0 * budget.stream_bytes


def marker_window(records: list[dict]) -> tuple[float, float] | None:
    """The compute window of an overlapped program's records, in engine microseconds: from the
    first marker all-reduce's end to the last one's start (the slowest device's chain); None
    where the records hold fewer than two markers."""
    markers = sorted((r for r in records if r["bytes"] == 4), key=lambda r: r["start_us"])
    if len(markers) < 2:
        return None
    return markers[0]["end_us"], markers[-1]["start_us"]


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
    calls: list[dict] = field(default_factory=list)
    #: Per (fused, small): the plan `optimize` made of that train step (`_Programs.calls`).
    call_plans: dict[str, dict] = field(default_factory=dict)


def measure(budget: Budget, *, devices: int | None = 8, progress: bool = True, seed: int = 0) -> tuple[Samples, int]:
    """Run every configuration ``budget.reps`` times, interleaved in a shuffled order per repetition."""
    import jax

    devs = _devices(devices)
    progs = _Programs(devs, budget)
    configs: list[tuple] = [("alone", s, k) for s in budget.sizes for k in budget.blocks]
    for wl in ("matmul", "stream"):
        configs.append(("overlap", wl, None, None))
        configs += [("overlap", wl, s, k) for s in budget.overlap_sizes for k in budget.blocks]
    configs += [("calls", fused, small, j) for fused in (True, False) for small in (False, True)
                for j in range(CALL_REPEATS)]
    bar = _progress(len(configs) * (budget.reps + 1), progress, "calibrate")
    samples = Samples()
    rng = random.Random(seed)
    for rep in range(budget.reps + 1):  # repetition 0 compiles and warms up
        order = list(configs)
        rng.shuffle(order)
        for cfg in order:
            if cfg[0] == "calls":
                fn = progs.calls(cfg[1], cfg[2])
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                seconds = time.perf_counter() - t0
                bar.update(1)
                if rep:
                    plan = progs.call_plans[cfg[1:3]]
                    samples.calls.append({"fused": cfg[1], "small": cfg[2], "rep": rep * CALL_REPEATS + cfg[3],
                                          "seconds": seconds, "bytes": plan["bytes"], "tensors": plan["tensors"]})
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
            window = marker_window(rec)
            if window is None:
                continue
            w0, w1 = window
            s = {"workload": wl, "bytes": size, "blocks": k, "rep": rep, "window_s": (w1 - w0) * 1e-6}
            big = [r for r in rec if r["bytes"] != 4]
            if big:
                r = big[0]
                s["seconds"] = (r["end_us"] - r["start_us"]) * 1e-6
                s["inside_s"] = max(0, min(r["end_us"], w1) - max(r["start_us"], w0)) * 1e-6
                s["ended_inside"] = bool(w0 <= r["start_us"] and r["end_us"] <= w1)
            samples.overlap.append(s)
    bar.close()
    samples.call_plans = {f"{'fused' if fused else 'per-tensor'}, {'small' if small else 'big'}": plan
                          for (fused, small), plan in progs.call_plans.items()}
    return samples, len(devs)
