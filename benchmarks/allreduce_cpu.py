"""jax.lax.psum vs libra_jax.psum on 8 host CPU devices (not a test: a measurement).

For each per-device size, every variant is run once per repetition, in a
shuffled order, after warm-up; the table gives each variant's median time, its
interquartile range, and its ratio to psum: the median of the per-repetition
ratios (variant / psum of the same repetition) with their 10th-90th percentiles, and the
median of the process's page faults per call (fresh output pages are first touched in the
call: at 64 MiB each of XLA's outputs is a fresh mapping).

    python benchmarks/allreduce_cpu.py [--reps 15] [--sizes 1KiB,1MiB,16MiB,64MiB]
        [--dtypes bfloat16,float16] [--dtype-sizes 1MiB,16MiB] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import time

from libra_jax.config import xla_flags  # noqa: E402  (pure Python: JAX does not start)

os.environ["XLA_FLAGS"] = xla_flags(8)  # the caller's flags kept

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import libra_jax  # noqa: E402
import report  # noqa: E402  (benchmarks/report.py)

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def variants(mesh):
    """name -> (jitted fn, donates its input)."""
    def replicated(psum):
        return jax.jit(jax.shard_map(psum, mesh=mesh, in_specs=P("x"), out_specs=P()))

    def in_place(psum):
        # Output aliases the donated input: psum's result, cast back to varying.
        body = lambda v: jax.lax.pcast(psum(v), "x", to="varying")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")),
                       donate_argnums=0)

    out = {"psum": (replicated(lambda v: jax.lax.psum(v, "x")), False),
           "libra default": (replicated(lambda v: libra_jax.psum(v, "x")), False)}
    for k in (1, 2, 4, 8):
        out[f"libra k={k}"] = (replicated(lambda v, k=k: libra_jax.psum(v, "x", blocks=k)), False)
    out["psum donated"] = (in_place(lambda v: jax.lax.psum(v, "x")), True)
    out["libra in place default"] = (
        in_place(lambda v: libra_jax.psum(v, "x", inplace=True)), True)
    out["libra in place k=4"] = (
        in_place(lambda v: libra_jax.psum(v, "x", blocks=4, inplace=True)), True)
    return out


def floors(size: int, reps: int) -> dict[str, float]:
    """This machine's floor for an all-reduce of `size` bytes per device over 8 devices, in
    seconds, measured now with numpy (one thread): in place, the 8 inputs read and the 8
    results written at the stream bandwidth of ``np.add(a, b, out=c)``; not in place, the 8
    reads at that bandwidth plus writing 8 fresh ``np.empty`` buffers of `size` (their pages
    are first touched, as a fresh output's are). numpy asks the kernel for transparent huge
    pages on large arrays; XLA's allocator does not (a 64 MiB output takes 16384 page faults
    here), so that is switched off while the fresh buffers are written."""
    n = size // 4
    a, b, c = (np.ones(max(n, 1), np.float32) for _ in range(3))
    src = np.ones(max(n, 1), np.float32)
    adds, fresh = [], []
    multiarray = getattr(np, "_core", getattr(np, "core", None)).multiarray
    hugepages = multiarray._set_madvise_hugepage(False)
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            np.add(a, b, out=c)
            adds.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            outs = [np.empty_like(src) for _ in range(8)]
            for o in outs:
                np.copyto(o, src)
            fresh.append(time.perf_counter() - t0)
            del outs
    finally:
        multiarray._set_madvise_hugepage(hugepages)
    bandwidth = 3 * 4 * max(n, 1) / float(np.median(adds))
    return {"bandwidth": bandwidth, "in place": 16 * size / bandwidth,
            "not in place": 8 * size / bandwidth + float(np.median(fresh))}


def measure(size: int, reps: int, warmup: int = 2, only: str | None = None,
            dtype: str = "float32") -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """(seconds per call, page faults per call) of each variant, over `reps` rounds, on
    `size` bytes per device of `dtype`."""
    mesh = jax.make_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    itemsize = np.dtype(jax.numpy.dtype(dtype)).itemsize
    host = np.random.default_rng(0).standard_normal((8, size // itemsize)).astype(
        jax.numpy.dtype(dtype))
    shared = jax.device_put(host, sharding)
    fns = variants(mesh)
    if only:
        keep = {"psum", *only.split(",")}
        fns = {k: v for k, v in fns.items() if k in keep}
    expected = np.asarray(fns["psum"][0](shared))[0]
    times: dict[str, list[float]] = {name: [] for name in fns}
    faults: dict[str, list[int]] = {name: [] for name in fns}
    for rep in range(warmup + reps):
        order = list(fns)
        random.Random(rep).shuffle(order)
        for name in order:
            fn, donates = fns[name]
            x = jax.device_put(host, sharding) if donates else shared
            x.block_until_ready()
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            out = fn(x)
            out.block_until_ready()
            elapsed = time.perf_counter() - t0
            faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
            if rep == 0:  # Every variant computes the same bits.
                assert np.asarray(out)[0].tobytes() == expected.tobytes(), name
            if rep >= warmup:
                times[name].append(elapsed)
                faults[name].append(faulted)
            del out, x
    return times, faults


def summarize(size_label: str, times: dict[str, list[float]], faults: dict[str, list[int]]
              ) -> list[str]:
    base = np.array(times["psum"])
    rows = []
    for name, ts in times.items():
        ts = np.array(ts)
        ratios = ts / base
        q1, q3 = np.percentile(ts * 1e3, [25, 75])
        r10, r50, r90 = np.percentile(ratios, [10, 50, 90])
        rows.append(f"| {size_label} | {name} | {np.median(ts) * 1e3:.3f} | {q1:.3f}-{q3:.3f} | "
                    f"{r50:.2f} | {r10:.2f}-{r90:.2f} | {np.median(faults[name]):.0f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sizes", default="1KiB,1MiB,16MiB,64MiB")
    parser.add_argument("--only", default=None, help="comma-separated variants (psum always)")
    parser.add_argument("--dtypes", default="bfloat16,float16",
                        help="16-bit dtypes measured after the float32 table (psum and libra "
                             "default, at --dtype-sizes); empty for none")
    parser.add_argument("--dtype-sizes", default="1MiB,16MiB")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args()
    lines = report.header(f"; 8 host devices (XLA_FLAGS={os.environ['XLA_FLAGS']}).") + [
        f"{args.reps} interleaved repetitions after 2 warm-ups; float32; times per call in ms.",
        "",
        "| per device | variant | median ms | IQR ms | ratio to psum | ratio p10-p90 | page faults |",
        "|---|---|---|---|---|---|---|",
    ]
    floor_rows = ["", "The floor, measured in the same run (`floors`): in place, 8 reads and 8 writes "
                  "at numpy's one-thread add bandwidth; not in place, the 8 reads plus writing 8 "
                  "fresh buffers. Ratio: the variant's median over the floor.", "",
                  "| per device | bandwidth GB/s | floor in place ms | floor not in place ms | "
                  "default / floor | in place default / floor |", "|---|---|---|---|---|---|"]
    for label in args.sizes.split(","):
        size = parse_size(label)
        times, faults = measure(size, args.reps, only=args.only)
        rows = summarize(label, times, faults)
        lines += rows
        print("\n".join(rows), flush=True)
        floor = floors(size, args.reps)
        default = np.median(times["libra default"]) if "libra default" in times else float("nan")
        inplace = (np.median(times["libra in place default"])
                   if "libra in place default" in times else float("nan"))
        floor_rows.append(f"| {label} | {floor['bandwidth'] / 1e9:.1f} | "
                          f"{floor['in place'] * 1e3:.3f} | {floor['not in place'] * 1e3:.3f} | "
                          f"{default / floor['not in place']:.2f} | "
                          f"{inplace / floor['in place']:.2f} |")
        print(floor_rows[-1], flush=True)
    dtype_rows = []
    if args.dtypes:
        dtype_rows = ["", "Other dtypes (the same bytes per device, psum and libra default only, "
                      "interleaved as above):", "",
                      "| per device | dtype | variant | median ms | IQR ms | ratio to psum | "
                      "ratio p10-p90 | page faults |", "|---|---|---|---|---|---|---|---|"]
        for dtype in args.dtypes.split(","):
            for label in args.dtype_sizes.split(","):
                times, faults = measure(parse_size(label), args.reps, only="libra default",
                                        dtype=dtype)
                rows = [row.replace(f"| {label} |", f"| {label} | {dtype} |", 1)
                        for row in summarize(label, times, faults)]
                dtype_rows += rows
                print("\n".join(rows), flush=True)
    report.publish(lines + floor_rows + dtype_rows, args.out)


if __name__ == "__main__":
    main()
