"""Which mechanism lets libra's CUDA all-reduce run beside XLA's compute (one GPU).

    python benchmarks/gpu_overlap.py [--out DIR] [--mib 256] [--reps 7]
    python benchmarks/gpu_overlap.py --lower-only     # anywhere: lowers for cuda, runs nothing

One jitted step holds a chain of matmuls and, independent of it, libra's
all-reduce kernel over a 1-GPU team (the FFI target called directly: a psum
over one device is no call at all). Mechanisms, each with blocks 1, 8 and 32:
  sync        the plain custom call on XLA's compute stream (the baseline)
  annotated   the same call under jax.experimental.compute_on("gpu_stream:1"),
              with --xla_gpu_experimental_stream_annotation=true
  start/done  libra_allreduce_cuda_start launches on libra's own stream,
              libra_allreduce_cuda_done makes XLA's stream wait; optimization
              barriers put the matmuls between them
For each: the step's median time against compute alone and all-reduce alone,
and overlap = (compute + all-reduce - both) / min(compute, all-reduce): 0 when
the two run one after the other, 1 when the shorter one is hidden. The outputs
are checked (a 1-rank all-reduce returns its input).

Then the same through `libra_jax.optimize`: an MLP train step on a mesh of the
one GPU (its psums become 1-rank kernel calls), overlap="sync" against
overlap="start-done", and the step written ``pmean(jax.grad(...))`` with its psums
planned where ready (the default) against where written (``ready="written"``): step
time, whether the results are bitwise equal, and, from XLA's scheduled HLO, how many
GEMMs run between each start and its done (0: XLA pulled done up to its start, and
nothing can overlap).
Results go to DIR/overlap.md as they come.

    python benchmarks/gpu_overlap.py --command-buffers   # on a GPU: what command buffers take

compiles a step with the kernel call beside a fusion under XLA's command buffers for fusions,
cuBLAS and custom calls, and prints `cmdbuf-*` lines (benchmarks/gpu_check.sh notes them):
whether this jaxlib makes command buffers at all there, and whether libra's call (not
command-buffer compatible: its errors and signatures are the handler's, per call) stays out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# libra's GPU data paths are opt-in (LIBRA_JAX_CUDA, default xla): this measures the P2P
# kernels, so it opts in unless told otherwise.
os.environ.setdefault("LIBRA_JAX_CUDA", "p2p")
if "--command-buffers" in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL"
                               + " --xla_gpu_graph_min_graph_size=1")
elif "--lower-only" not in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_experimental_stream_annotation=true")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from libra_jax import _compat, _ffi  # noqa: E402

BLOCKS = (1, 8, 32)


def allreduce(x: jax.Array, blocks: int) -> jax.Array:
    """libra's kernel on XLA's stream, team of one GPU."""
    return jax.ffi.ffi_call(_ffi.target("all-reduce", "cuda"), jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, devices=np.array([0], np.int32), world=np.int64(1), blocks=np.int64(blocks),
        algorithm=np.int64(0), timeout_ms=np.int64(60_000))


TOKEN = jax.ShapeDtypeStruct((1,), np.int32)  # start's second result, done's second operand


def start(x: jax.Array, blocks: int, call_id: int) -> tuple[jax.Array, jax.Array]:
    """The kernel on libra's stream, in place on `x`: (the buffer in flight, its token)."""
    return jax.ffi.ffi_call(_ffi.target("all-reduce", "cuda", "start"),
                            (jax.ShapeDtypeStruct(x.shape, x.dtype), TOKEN),
                            input_output_aliases={0: 0})(
        x, devices=np.array([0], np.int32), world=np.int64(1), blocks=np.int64(blocks),
        algorithm=np.int64(0), timeout_ms=np.int64(60_000), call_id=np.int64(call_id))


def done(started: jax.Array, token: jax.Array, call_id: int) -> jax.Array:
    """XLA's stream waits for the kernel; the buffer is read by done only (no copy)."""
    return jax.ffi.ffi_call(_ffi.target("all-reduce", "cuda", "done"),
                            jax.ShapeDtypeStruct(started.shape, started.dtype),
                            input_output_aliases={0: 0})(started, token, call_id=np.int64(call_id))


def matmuls(a: jax.Array, n: int) -> jax.Array:
    for _ in range(n):
        a = jnp.tanh(a @ a) * 0.5
    return a


def steps(n_matmul: int) -> dict:
    """name -> (blocks -> jitted fn(a, x) -> (compute result, all-reduce result))."""
    def compute_only(blocks):
        return jax.jit(lambda a, x: (matmuls(a, n_matmul), x))

    def comm_only(blocks):
        return jax.jit(lambda a, x: (a, allreduce(x, blocks)))

    def sync(blocks):
        return jax.jit(lambda a, x: (matmuls(a, n_matmul), allreduce(x, blocks)))

    def annotated(blocks):
        on_stream_1 = _compat.on_stream(lambda v: allreduce(v, blocks), 1)
        return jax.jit(lambda a, x: (matmuls(a, n_matmul), on_stream_1(x)))

    def start_done(blocks):
        def f(a, x):
            s, token = start(x, blocks, call_id=blocks)
            s, token, a = jax.lax.optimization_barrier((s, token, a))  # compute after start
            c = matmuls(a, n_matmul)
            c, token = jax.lax.optimization_barrier((c, token))        # done after compute
            return c, done(s, token, call_id=blocks)
        return jax.jit(f)

    return {"compute": compute_only, "allreduce": comm_only, "sync": sync,
            "annotated": annotated, "start/done": start_done}


def command_buffer_lines() -> list[str]:
    """`cmdbuf-*` lines: the optimized HLO of a step with libra's call beside a fusion, under
    command buffers for fusions, cuBLAS and custom calls (XLA_FLAGS set at import)."""
    a = jnp.ones((256, 256), jnp.float32)
    x = jnp.arange(1 << 16, dtype=jnp.float32)
    step = jax.jit(lambda a, x: (jnp.tanh(a @ a) * 2, allreduce(x, 8) + 1))
    compiled = step.lower(a, x).compile()
    hlo = compiled.as_text()
    # Computations, each "name (...) -> ... {" up to its closing "}" at the line start.
    bodies = [c for c in hlo.split("\n}\n") if "command_buffer" in c.split("{", 1)[0]]
    inside = [c for c in bodies if _ffi.target("all-reduce", "cuda") in c]
    c, y = step(a, x)
    right = bool(jnp.array_equal(y, x + 1))  # a 1-GPU sum is its input
    return [f"cmdbuf-made INFO {len(bodies)} command-buffer computation(s) in the step "
            f"(jax {jax.__version__}, FUSION,CUBLAS,CUSTOM_CALL)",
            f"cmdbuf-libra {'FAIL' if inside else 'PASS'} libra_allreduce_cuda "
            f"{'inside a command buffer' if inside else 'outside every command buffer'}; "
            f"output {'right' if right else 'WRONG'}"]


def optimize_steps(width: int, layers: int, batch: int) -> tuple[dict, tuple]:
    """{overlap mode: jitted optimized MLP step} and the step's arguments, on a 1-GPU mesh."""
    import libra_jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def loss(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean(x * x)

    def local_step(params, x):
        # check_vma: autodiff psums each replicated weight's gradient where it is produced.
        grads = jax.grad(loss)(params, x)
        return [p - 0.01 * g for p, g in zip(params, grads)]

    def written_step(params, x):
        # The common form: pmean after jax.grad (every psum written after the backward pass).
        grads = jax.lax.pmean(jax.grad(loss)(params, x), "data")
        return [p - 0.01 * g for p, g in zip(params, grads)]

    step = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                         check_vma=True)
    written = jax.shard_map(written_step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                            check_vma=False)
    keys = jax.random.split(jax.random.key(1), layers + 1)
    params = [jax.random.normal(k, (width, width), jnp.float32) / width ** 0.5
              for k in keys[:-1]]
    x = jax.device_put(jax.random.normal(keys[-1], (batch, width), jnp.float32),
                       NamedSharding(mesh, P("data")))
    arms = {mode: jax.jit(libra_jax.optimize(step, overlap=mode))
            for mode in ("sync", "start-done")}
    # The written form planned where its operands are ready (the default) and where the code
    # wrote them (the old placement): the start/done order XLA compiles, and the step time.
    for ready in ("dataflow", "written"):
        arms[f"start-done, pmean(grad), ready={ready}"] = jax.jit(
            libra_jax.optimize(written, overlap="start-done", ready=ready))
    return arms, (params, x)


def gemms_between_start_and_done(hlo: str) -> list[int]:
    """Per start/done pair, in schedule order: GEMMs XLA scheduled between the two."""
    lines = [line for line in hlo.splitlines() if "=" in line]
    starts = [i for i, line in enumerate(lines) if _ffi.target("all-reduce", "cuda", "start") in line]
    dones = [i for i, line in enumerate(lines) if _ffi.target("all-reduce", "cuda", "done") in line]
    out = []
    for i in starts:
        j = next((d for d in dones if d > i), len(lines))
        out.append(sum(1 for line in lines[i:j] if "gemm" in line.lower() or " dot(" in line))
    return out


def optimize_rows(args: argparse.Namespace) -> list[str]:
    fns, (params, x) = optimize_steps(args.width, args.layers, args.batch)
    results, times, text = {}, {k: [] for k in fns}, {}
    for mode, f in fns.items():
        results[mode] = jax.block_until_ready(f(params, x))
        text[mode] = f.lower(params, x).compile().as_text()
    for _ in range(args.reps):
        for mode, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(params, x))
            times[mode].append((time.perf_counter() - t0) * 1e3)
    same = all(bool(jnp.array_equal(a, b))
               for mode in fns for a, b in zip(results["sync"], results[mode]))
    rows = []
    for mode in fns:
        between = gemms_between_start_and_done(text[mode]) if mode != "sync" else []
        spread = np.percentile(times[mode], [10, 90])
        rows.append(f"| {mode} | {statistics.median(times[mode]):.2f} ({spread[0]:.2f}-"
                    f"{spread[1]:.2f}) | {same} | {between if between else '-'} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--mib", type=int, default=256, help="all-reduce buffer (MiB)")
    parser.add_argument("--matmul", type=int, default=4096, help="matmul size")
    parser.add_argument("--chain", type=int, default=8, help="matmuls per step")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--width", type=int, default=4096, help="optimize: MLP width")
    parser.add_argument("--layers", type=int, default=8, help="optimize: MLP layers")
    parser.add_argument("--batch", type=int, default=8192, help="optimize: batch")
    parser.add_argument("--lower-only", action="store_true")
    parser.add_argument("--command-buffers", action="store_true")
    args = parser.parse_args()
    if args.command_buffers:
        if jax.devices()[0].platform != "gpu":
            print("needs a GPU")
            return 2
        _ffi.ensure_cuda_registered()
        lines = command_buffer_lines()
        print("\n".join(lines))
        return 1 if any(" FAIL " in line for line in lines) else 0

    n = args.mib * (1 << 20) // 4
    a_spec = jax.ShapeDtypeStruct((args.matmul, args.matmul), jnp.bfloat16)
    x_spec = jax.ShapeDtypeStruct((n,), jnp.float32)
    fns = steps(args.chain)
    if args.lower_only:
        # Each step must lower to the calls it measures (exit 1 otherwise): a dry run of
        # what the GPU run would time.
        _ffi.ensure_cuda_registered()
        sync_calls = [_ffi.target("all-reduce", "cuda")]
        pair = sorted([_ffi.target("all-reduce", "cuda", "done"), _ffi.target("all-reduce", "cuda", "start")])
        expected = {"compute": [], "allreduce": sync_calls, "sync": sync_calls,
                    "annotated": sync_calls, "start/done": pair,
                    "optimize overlap=sync": sync_calls, "optimize overlap=start-done": pair,
                    "optimize overlap=start-done, pmean(grad), ready=dataflow": pair,
                    "optimize overlap=start-done, pmean(grad), ready=written": pair}
        opt, (params, x) = optimize_steps(256, 3, 64)
        lowerings = {name: (lambda make=make: make(8).trace(a_spec, x_spec))
                     for name, make in fns.items()}
        lowerings.update({f"optimize overlap={mode}": (lambda f=f: f.trace(params, x))
                          for mode, f in opt.items()})
        wrong = 0
        for name, trace in lowerings.items():
            try:
                text = trace().lower(lowering_platforms=("cuda",)).as_text()
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name:11s} does not lower for cuda: {type(e).__name__}: {e}"[:300])
                wrong += 1
                continue
            calls = sorted({w.split("(")[0] for w in text.split("custom_call @")[1:]})
            # libra's calls, exactly; JAX's own (jax 0.11's stream annotation is the
            # custom call annotate_device_placement) may come with them.
            ok = [c for c in calls if c.startswith("libra_")] == expected.get(name, calls)
            wrong += not ok
            print(f"{name:11s} lowers: custom calls {calls}" + ("" if ok else
                  f" -- UNEXPECTED, wanted {expected[name]} (LIBRA_JAX_CUDA="
                  f"{os.environ.get('LIBRA_JAX_CUDA')})"))
        return 1 if wrong else 0

    if not jax.devices()[0].platform == "gpu":
        print("needs a GPU (use --lower-only elsewhere)")
        return 2
    _ffi.ensure_cuda_registered()
    out = Path(args.out) / "overlap.md"
    a = jax.random.normal(jax.random.key(0), a_spec.shape, a_spec.dtype) * 0.01
    x = jnp.arange(n, dtype=jnp.float32)
    lines = [f"# libra CUDA all-reduce beside compute on one {jax.devices()[0].device_kind}",
             f"\n`python benchmarks/gpu_overlap.py --mib {args.mib} --matmul {args.matmul} "
             f"--chain {args.chain} --reps {args.reps}`, {time.strftime('%Y-%m-%d')}, "
             f"jax {jax.__version__}. Median ms of {args.reps} interleaved runs (p10-p90 over "
             "the step).\n",
             "| mechanism | blocks | compute ms | all-reduce ms | both ms | overlap | output ok |",
             "|---|---|---|---|---|---|---|"]
    out.write_text("\n".join(lines) + "\n")
    for blocks in BLOCKS:
        compiled = {}
        for name, make in fns.items():
            try:
                f = make(blocks)
                r = f(a, x)
                jax.block_until_ready(r)
                ok = bool(jnp.array_equal(r[1], x))
                compiled[name] = (f, ok)
            except Exception as e:  # noqa: BLE001 - a mechanism that fails is a result
                compiled[name] = (None, f"{type(e).__name__}: {str(e)[:120]}")
        times: dict[str, list[float]] = {k: [] for k, (f, _) in compiled.items() if f}
        for _ in range(args.reps):  # interleaved
            for name in times:
                f = compiled[name][0]
                t0 = time.perf_counter()
                jax.block_until_ready(f(a, x))
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        for name in ("sync", "annotated", "start/done"):
            f, ok = compiled[name]
            if f is None:
                row = f"| {name} | {blocks} | | | | failed | {ok} |"
            else:
                c, r, both = med["compute"], med["allreduce"], med[name]
                overlap = (c + r - both) / min(c, r)
                spread = np.percentile(times[name], [10, 90])
                row = (f"| {name} | {blocks} | {c:.2f} | {r:.2f} | {both:.2f} "
                       f"({spread[0]:.2f}-{spread[1]:.2f}) | {overlap:.2f} | {ok} |")
            print(row, flush=True)
            with out.open("a") as fh:
                fh.write(row + "\n")

    head = [f"\n`libra_jax.optimize` of an MLP step ({args.layers} x {args.width}^2 f32, batch "
            f"{args.batch}) on a mesh of this GPU: median ms of {args.reps} interleaved steps "
            "(p10-p90); GEMMs that XLA's schedule puts between each start and its done.\n",
            "| overlap | step ms | results bitwise equal | GEMMs between start and done |",
            "|---|---|---|---|"]
    with out.open("a") as fh:
        fh.write("\n".join(head) + "\n")
    try:
        rows = optimize_rows(args)
    except Exception as e:  # noqa: BLE001 - a failure is a result
        rows = [f"| failed | {type(e).__name__}: {str(e)[:200]} | | |"]
    for row in rows:
        print(row, flush=True)
        with out.open("a") as fh:
            fh.write(row + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
