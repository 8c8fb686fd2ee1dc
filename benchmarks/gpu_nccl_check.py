"""The machine's real NCCL under libra's CTA limits (one GPU): the check the stub cannot be.

    python benchmarks/gpu_nccl_check.py            # on a GPU machine (benchmarks/gpu_check.sh)
    python benchmarks/gpu_nccl_check.py --plan     # anywhere: which NCCL, which checks would run

Prints one line per check, ``nccl-<what> PASS|FAIL|SKIP|INFO <detail>`` (gpu_check.sh copies
them into its summary), and NCCL's own log lines about channels and CTAs after each.

* ``nccl-version``: the NCCL libra loads (``libra_jax._nccl.library``: ``$LIBRA_JAX_NCCL_LIBRARY``,
  else the libnccl.so.2 already in the process, else the loader's; here, if neither is set, the
  ``nvidia-nccl-cu13`` wheel's), its version and the CTA route that version gets.
* ``nccl-<route>``: for each route the version allows (per-collective needs NCCL >= 2.31;
  per-communicator, forced with ``LIBRA_JAX_NCCL_CTA_ROUTE``, any), in a fresh process: a
  1-rank communicator on GPU 0 and the ``libra_allreduce_nccl`` custom call, XLA's own handler
  path (the communicator made at XLA's initialize stage, the call on libra's stream), and the
  same as ``libra_allreduce_nccl_start`` + ``libra_allreduce_cuda_done``, with ctas 1, 4 and
  16 on a 1 MiB f32 buffer; a 1-rank sum returns its input, checked bit for bit; and a
  start/done bucket of three f32 members (one start: one NCCL group, one done), each its
  input bit for bit, timed against the same members packed into one call (median of 5). The same
  for NCCL's reduce-scatter and all-gather (``libra_reduce_scatter_nccl``,
  ``libra_all_gather_nccl`` and their starts), timed (median of 5): on one rank each is a copy
  of its input, as `jax.lax`'s are on one device, so this proves the handlers, the CTA routes
  and the in-place start layout on a real NCCL, not a sum or a gather across GPUs (that needs
  two). ``NCCL_DEBUG=INFO`` lines naming channels or CTAs are printed after it.
* ``nccl-2-ranks``: a 2-rank all-reduce needs two GPUs (one NCCL rank per GPU: NCCL refuses
  two ranks of one communicator on one device), so on one GPU it is a SKIP with that reason;
  with two, tests/test_nccl.py::test_two_processes_on_two_gpus is the check.

Exit status 0 unless a check FAILs.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

CTAS = (1, 4, 16)
ROUTES = ("per-collective", "per-communicator")
PER_COLLECTIVE_VERSION = 23100

ONE_RANK = """
    import os, sys, time
    import jax, numpy as np
    from libra_jax import _ffi, _nccl
    lib = _nccl.library()
    print("ROUTE", lib.route, flush=True)
    gpu = jax.devices("cuda")[0]
    _ffi.ensure_cuda_registered()
    x = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)  # 1 MiB
    for ctas in __CTAS__:
        comm = _nccl.communicator([gpu.id], blocks=ctas, holds_root=True, timeout_s=60)
        rows = 1 + int(gpu.local_hardware_id)
        comm_ids = np.full(rows, -1, np.int64); comm_ids[-1] = comm
        ranks = np.full(rows, -1, np.int32); ranks[-1] = 0
        attrs = dict(comm_ids=comm_ids, ranks=ranks, nranks=np.int64(1), ctas=np.int64(ctas),
                     timeout_ms=np.int64(60000))
        aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
        token = jax.ShapeDtypeStruct((1,), np.int32)
        call = jax.ffi.ffi_call(_ffi.target("all-reduce", "nccl"), aval)
        # The same as start/done: NCCL on libra's stream, then XLA's stream waits for it.
        start = jax.ffi.ffi_call(_ffi.target("all-reduce", "nccl", "start"), (aval, token),
                                 input_output_aliases={0: 0})
        done = jax.ffi.ffi_call(_ffi.target("all-reduce", "cuda", "done"), aval,
                                input_output_aliases={0: 0})
        f = jax.jit(lambda v: call(v, **attrs))
        g = jax.jit(lambda v: done(*start(v + 0, call_id=np.int64(1), **attrs),
                                   call_id=np.int64(1)))
        xs = jax.device_put(x, gpu)
        ok = np.asarray(f(xs)).tobytes() == x.tobytes()
        split = np.asarray(g(xs)).tobytes() == x.tobytes()
        # A start/done bucket of three members of one dtype, one start (one NCCL group) and
        # one done over their buffers where they are (aliased), as optimize lowers it.
        parts = (x, x[:1000] * 2, x[:7] * 3)
        part_avals = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts)
        aliased = {i: i for i in range(len(parts))}
        start3 = jax.ffi.ffi_call(_ffi.target("all-reduce", "nccl", "start"),
                                  (*part_avals, token), input_output_aliases=aliased)
        done3 = jax.ffi.ffi_call(_ffi.target("all-reduce", "cuda", "done"), part_avals,
                                 input_output_aliases=aliased)
        def grouped(*vs):
            *buffers, started = start3(*(v + 0 for v in vs), call_id=np.int64(4), **attrs)
            return done3(*buffers, started, started, call_id=np.int64(4))
        on_gpu = [jax.device_put(p, gpu) for p in parts]
        got = jax.jit(grouped)(*on_gpu)
        group = all(np.asarray(a).tobytes() == p.tobytes() for a, p in zip(got, parts))
        # Its time against the same members packed into one buffer and one call (median of
        # 5, after the compile above): what the group saves is the concatenate and the split.
        packed_call = jax.ffi.ffi_call(_ffi.target("all-reduce", "nccl"), jax.ShapeDtypeStruct(
            (sum(p.size for p in parts),), x.dtype))
        def packed(*vs):
            flat = packed_call(jax.numpy.concatenate([v.ravel() for v in vs]), **attrs)
            ends = np.cumsum([p.size for p in parts])[:-1]
            return tuple(jax.numpy.split(flat, ends))
        timed = {"group": jax.jit(grouped), "packed": jax.jit(packed)}
        group_ms = {}
        for name, fn in timed.items():
            jax.block_until_ready(fn(*on_gpu))
            times = []
            for _ in range(5):
                t0 = time.perf_counter(); jax.block_until_ready(fn(*on_gpu))
                times.append(time.perf_counter() - t0)
            group_ms[name] = sorted(times)[2] * 1e3
        # The sharded pair on the same communicator: NCCL's reduce-scatter and all-gather, one
        # call and start/done (in place in the flat row; done is the kernels'). On one rank
        # each is its input, bit for bit, as jax.lax's are on one device.
        sharded = []
        for role, call_id, aliases in (("nccl_reduce_scatter", 2, {0: 0}),
                                       ("nccl_all_gather", 3, {})):
            one = jax.ffi.ffi_call(_ffi.TARGETS[role], aval)
            begin = jax.ffi.ffi_call(_ffi.TARGETS[role + "_start"], (aval, token),
                                     input_output_aliases=aliases)
            f1 = jax.jit(lambda v, one=one: one(v, **attrs))
            g1 = jax.jit(lambda v, begin=begin, cid=call_id: done(
                *begin(v + 0, call_id=np.int64(cid * 16 + 8 + (cid == 3)), **attrs),
                call_id=np.int64(cid * 16 + 8 + (cid == 3))))
            times = []
            for _ in range(5):
                t0 = time.perf_counter(); r1 = f1(xs); r1.block_until_ready()
                times.append(time.perf_counter() - t0)
            good = (np.asarray(r1).tobytes() == x.tobytes()
                    and np.asarray(g1(xs)).tobytes() == x.tobytes())
            sharded.append(f"{role[5:]} {'OK' if good else 'WRONG'} "
                           f"{sorted(times)[2] * 1e3:.3f}ms")
        print("CTAS", ctas, "OK" if ok else "WRONG", "start/done", "OK" if split else "WRONG",
              "group of 3", "OK" if group else "WRONG",
              f"{group_ms['group']:.3f}ms (packed {group_ms['packed']:.3f}ms)",
              "|", " | ".join(sharded), "| communicators", _nccl.communicators_created(),
              flush=True)
"""


def nccl_wheel_library() -> str | None:
    """The nvidia-nccl-cu13 (or -cu12) wheel's libnccl.so.2, if installed."""
    try:
        import nvidia.nccl  # type: ignore[import-not-found]
    except ImportError:
        return None
    for base in getattr(nvidia.nccl, "__path__", []):
        path = Path(base) / "lib" / "libnccl.so.2"
        if path.is_file():
            return str(path)
    return None


def say(check: str, result: str, detail: str) -> None:
    print(f"nccl-{check} {result} {detail}", flush=True)


def nccl_log_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if "NCCL INFO" in line and re.search(r"channel|CTA|cta", line)][:12]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", action="store_true",
                        help="load NCCL and say what would run; run nothing on a GPU")
    parser.add_argument("--timeout-s", type=float, default=60, help="per route (default 60)")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    if not env.get("LIBRA_JAX_NCCL_LIBRARY") and (wheel := nccl_wheel_library()):
        env["LIBRA_JAX_NCCL_LIBRARY"] = wheel
    probe = subprocess.run(
        [sys.executable, "-c", "from libra_jax import _nccl; l = _nccl.library(); "
                               "print(l.path, l.version_code, l.version, l.route)"],
        env={**env, "LIBRA_JAX_NCCL_CTA_ROUTE": ""}, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        say("version", "SKIP", f"no usable NCCL: {tail}")
        return 0
    path, code, version, route = probe.stdout.split()
    say("version", "INFO", f"NCCL {version} ({path}); default CTA route {route}")
    routes = [r for r in ROUTES if r != "per-collective" or int(code) >= PER_COLLECTIVE_VERSION
              and route == "per-collective"]
    failed = False
    for r in ROUTES:
        if r not in routes:
            say(r, "SKIP", f"NCCL {version} has no per-collective CTA limit (>= 2.31 has)")
            continue
        script = textwrap.dedent(ONE_RANK).replace("__CTAS__", repr(CTAS))
        if args.plan:
            compile(script, "<nccl one-rank check>", "exec")  # a dry run still parses it
            say(r, "SKIP", f"--plan: would run a 1-rank all-reduce, reduce-scatter and "
                           f"all-gather with ctas {CTAS}")
            continue
        try:
            proc = subprocess.run(
                [sys.executable, "-c", script],
                env={**env, "LIBRA_JAX_NCCL_CTA_ROUTE": r, "LIBRA_JAX_CUDA": "nccl",
                     "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,TUNING,ENV",
                     "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
                capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            say(r, "FAIL", f"no answer in {args.timeout_s:g} s")
            failed = True
            continue
        lines = proc.stdout.splitlines()
        good = [line for line in lines if line.startswith("CTAS") and "WRONG" not in line]
        if proc.returncode == 0 and len(good) == len(CTAS) and f"ROUTE {r}" in lines:
            comms = good[-1].split()[-1]
            say(r, "PASS", f"1 rank, ctas {CTAS}, all-reduce, reduce-scatter and all-gather, "
                           f"one call and start/done, a grouped bucket of 3: bitwise, "
                           f"{comms} communicator(s)")
            for line in good:  # each block count's reduce-scatter and all-gather times
                print("   ", line)
        else:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            say(r, "FAIL", f"rc {proc.returncode}: {' | '.join(lines[-3:])} {tail}")
            failed = True
        for line in nccl_log_lines(proc.stdout + proc.stderr):
            print("   ", line.strip())
    gpus = 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        gpus = out.stdout.count("GPU ")
    except (OSError, subprocess.TimeoutExpired):
        pass
    if gpus < 2:
        say("2-ranks", "SKIP", f"{gpus} GPU(s): NCCL takes one GPU per rank of a communicator, "
                               "so two ranks need two GPUs (tests/test_nccl.py runs it there)")
    else:
        say("2-ranks", "SKIP", "two GPUs: tests/test_nccl.py::test_two_processes_on_two_gpus")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
