"""The machine's real NCCL under libra's CTA limits (one GPU): the check the stub cannot be.

    python benchmarks/gpu_nccl_check.py            # on a GPU machine (benchmarks/gpu_check.sh)
    python benchmarks/gpu_nccl_check.py --plan     # anywhere: which NCCL, which checks would run

Prints one line per check, ``nccl-<what> PASS|FAIL|SKIP|INFO <detail>`` (gpu_check.sh copies
them into its summary), and NCCL's own log lines about channels and CTAs after each.

* ``nccl-version``: the NCCL libra loads (``libra_jax._nccl.library``: ``$LIBRA_JAX_NCCL_LIBRARY``,
  else the libnccl.so.2 already in the process, else the loader's; here, if neither is set, the
  ``nvidia-nccl-cu13`` wheel's), its version and the CTA route that version gets.
* ``nccl-<route>``: for each route the version allows (per-collective needs NCCL >= 2.31;
  per-communicator, forced with ``LIBRA_JAX_NCCL_CTA_ROUTE``, any NCCL >= 2.17), in a fresh
  process: a
  1-rank communicator on GPU 0 and the ``libra_allreduce_nccl`` custom call, XLA's own handler
  path (the communicator made at XLA's initialize stage, the call on libra's stream), and the
  same as ``libra_allreduce_nccl_start`` + ``libra_allreduce_cuda_done``, with ctas 1, 4 and
  16 on a 1 MiB f32 buffer; a 1-rank sum returns its input, checked bit for bit; and a
  start/done bucket of three f32 members (one start: one NCCL group, one done), each its
  input bit for bit, timed against the same members packed into one call (median of 5), and a
  bucket of eight 16 KiB members likewise (launch-bound: where one launch per member would
  show), each printed as it is measured (``BUCKET`` lines). The same
  for NCCL's reduce-scatter and all-gather (``libra_reduce_scatter_nccl``,
  ``libra_all_gather_nccl`` and their starts), timed (median of 5): on one rank each is a copy
  of its input, as `jax.lax`'s are on one device, so this proves the handlers, the CTA routes
  and the in-place start layout on a real NCCL, not a sum or a gather across GPUs (that needs
  two). ``NCCL_DEBUG=INFO`` lines naming channels or CTAs are printed after it.
* ``nccl-route-group``: both buckets' group times on each route, side by side per block count.
  NCCL >= 2.32 isolates a call with a per-call CTA configuration from group aggregation
  (``ncclCollConfigNeedAggIsolate``), so a bucket on the per-collective route may launch a
  kernel per member where the per-communicator route (a communicator whose config pins the
  CTAs) launches one: this is the measurement that decides the default (auto is unchanged
  until it is made).
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
import threading
import time
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
        # Start/done buckets, one start (one NCCL group) and one done over their members
        # where they are (aliased), as optimize lowers them: three members of one dtype, then
        # eight 16 KiB ones (launch-bound: where NCCL >= 2.32 launching a per-call-configured
        # member alone would show). Each bitwise, then timed against the same members packed
        # into one buffer and one call (median of 5, after a warm-up): printed at once.
        buckets = {3: (x, x[:1000] * 2, x[:7] * 3),
                   8: tuple(x[:4096] * (i + 1) for i in range(8))}
        group_ms, group_ok = {}, True
        for n, parts in buckets.items():
            part_avals = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts)
            aliased = {i: i for i in range(len(parts))}
            start_n = jax.ffi.ffi_call(_ffi.target("all-reduce", "nccl", "start"),
                                       (*part_avals, token), input_output_aliases=aliased)
            done_n = jax.ffi.ffi_call(_ffi.target("all-reduce", "cuda", "done"), part_avals,
                                      input_output_aliases=aliased)
            cid = np.int64(4 + n)
            def grouped(*vs, start_n=start_n, done_n=done_n, cid=cid):
                *buffers, started = start_n(*(v + 0 for v in vs), call_id=cid, **attrs)
                return done_n(*buffers, started, started, call_id=cid)
            packed_call = jax.ffi.ffi_call(_ffi.target("all-reduce", "nccl"),
                                           jax.ShapeDtypeStruct((sum(p.size for p in parts),),
                                                                x.dtype))
            def packed(*vs, parts=parts, packed_call=packed_call):
                flat = packed_call(jax.numpy.concatenate([v.ravel() for v in vs]), **attrs)
                ends = np.cumsum([p.size for p in parts])[:-1]
                return tuple(jax.numpy.split(flat, ends))
            on_gpu = [jax.device_put(p, gpu) for p in parts]
            got = jax.jit(grouped)(*on_gpu)
            good = all(np.asarray(a).tobytes() == p.tobytes() for a, p in zip(got, parts))
            group_ok = group_ok and good
            for name, fn in (("group", jax.jit(grouped)), ("packed", jax.jit(packed))):
                jax.block_until_ready(fn(*on_gpu))
                times = []
                for _ in range(5):
                    t0 = time.perf_counter(); jax.block_until_ready(fn(*on_gpu))
                    times.append(time.perf_counter() - t0)
                group_ms[(n, name)] = sorted(times)[2] * 1e3
            print("BUCKET", ctas, n, "OK" if good else "WRONG",
                  f"{group_ms[(n, 'group')]:.3f}ms", f"packed {group_ms[(n, 'packed')]:.3f}ms",
                  flush=True)
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
              "groups of 3 and 8", "OK" if group_ok else "WRONG",
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


def run_route(route: str, script: str, env: dict[str, str],
              timeout_s: float) -> tuple[int | None, list[str]]:
    """The one-rank script on CTA route `route` in a fresh process: its exit status (None: killed
    after `timeout_s`) and its output lines (stdout and stderr). Each ``BUCKET`` line is printed
    as it comes, so a run cut short still leaves the numbers it measured in the log."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env={**env, "LIBRA_JAX_NCCL_CTA_ROUTE": route, "LIBRA_JAX_CUDA": "nccl",
             "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,TUNING,ENV",
             "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            if line.startswith("BUCKET"):
                print(f"    {route} {line}", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    reader.join(timeout=10)
    return rc, lines


def bucket_times(lines: list[str]) -> dict[tuple[int, int], str]:
    """The group times a route's ``BUCKET <ctas> <members> OK <ms> ...`` lines give, by (ctas,
    members); a WRONG bucket is left out (its time is not a bucket's)."""
    times = {}
    for line in lines:
        words = line.split()
        if len(words) >= 5 and words[0] == "BUCKET" and words[3] == "OK":
            times[(int(words[1]), int(words[2]))] = words[4]
    return times


def route_comparison(times: dict[str, dict[tuple[int, int], str]]) -> str:
    """One line: each block count's bucket group times on each route that measured them."""
    keys = sorted({key for measured in times.values() for key in measured})
    cells = []
    for ctas in sorted({c for c, _ in keys}):
        members = [
            f"{n} members " + " / ".join(f"{r} {times[r].get((ctas, n), '-')}" for r in times)
            for c, n in keys if c == ctas]
        cells.append(f"ctas {ctas}: " + ", ".join(members))
    return "; ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", action="store_true",
                        help="load NCCL and say what would run; run nothing on a GPU")
    parser.add_argument("--timeout-s", type=float, default=60, help="per route (default 60)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="for every route together: each gets at most an equal share of "
                             "what is left, so the last one still runs (default: no budget)")
    args = parser.parse_args(argv)
    began = time.monotonic()

    env = dict(os.environ)
    if not env.get("LIBRA_JAX_NCCL_LIBRARY") and (wheel := nccl_wheel_library()):
        env["LIBRA_JAX_NCCL_LIBRARY"] = wheel
    probe = subprocess.run(
        [sys.executable, "-c", "from libra_jax import _nccl; l = _nccl.library(); "
                               "print(l.path, l.version_code, l.version, l.route)"],
        env={**env, "LIBRA_JAX_NCCL_CTA_ROUTE": "auto"}, capture_output=True, text=True,
        timeout=60)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        say("version", "SKIP", f"no usable NCCL: {tail}")
        return 0
    path, code, version, route = probe.stdout.split()
    say("version", "INFO", f"NCCL {version} ({path}); default CTA route {route}")
    routes = [r for r in ROUTES if r != "per-collective" or int(code) >= PER_COLLECTIVE_VERSION
              and route == "per-collective"]
    failed = False
    times: dict[str, dict[tuple[int, int], str]] = {}
    script = textwrap.dedent(ONE_RANK).replace("__CTAS__", repr(CTAS))
    for r in ROUTES:
        if r not in routes:
            say(r, "SKIP", f"NCCL {version} has no per-collective CTA limit (>= 2.31 has)")
            continue
        if args.plan:
            compile(script, "<nccl one-rank check>", "exec")  # a dry run still parses it
            say(r, "SKIP", f"--plan: would run a 1-rank all-reduce, reduce-scatter and "
                           f"all-gather with ctas {CTAS}, and time buckets of 3 and 8 members")
            continue
        timeout = args.timeout_s
        if args.budget_s is not None:
            left = routes[routes.index(r):]
            timeout = min(timeout, (args.budget_s - (time.monotonic() - began)) / len(left))
        if timeout < 5:
            say(r, "SKIP", f"budget: {args.budget_s:g} s for every route is spent")
            continue
        rc, lines = run_route(r, script, env, timeout)
        times[r] = bucket_times(lines)
        good = [line for line in lines if line.startswith("CTAS") and "WRONG" not in line]
        if rc is None:
            say(r, "FAIL", f"no answer in {timeout:.0f} s ({len(times[r])} bucket timings "
                           "before that, above)")
            failed = True
        elif rc == 0 and len(good) == len(CTAS) and f"ROUTE {r}" in lines:
            comms = good[-1].split()[-1]
            say(r, "PASS", f"1 rank, ctas {CTAS}, all-reduce, reduce-scatter and all-gather, "
                           f"one call and start/done, grouped buckets of 3 and 8: bitwise, "
                           f"{comms} communicator(s)")
            for line in good:  # each block count's reduce-scatter and all-gather times
                print("   ", line)
        else:
            mine = [line for line in lines if "NCCL INFO" not in line]
            say(r, "FAIL", f"rc {rc}: {' | '.join(mine[-3:])}")
            failed = True
        for line in nccl_log_lines("\n".join(lines)):
            print("   ", line.strip())
    timed = [r for r in routes if times.get(r)]
    if len(timed) == 2:
        say("route-group", "INFO", "bucket as one group, median ms per route: "
                                   f"{route_comparison(times)} (NCCL >= 2.32 launches a "
                                   "member with a per-call CTA limit apart from the group)")
    elif len(routes) < 2:
        say("route-group", "SKIP", f"NCCL {version} has one CTA route: nothing to compare "
                                   "(per-collective needs NCCL >= 2.31)")
    elif args.plan:
        say("route-group", "SKIP", "--plan: would compare the buckets' times on both routes")
    else:
        say("route-group", "SKIP", f"bucket timings on {len(timed)} of 2 routes: nothing to "
                                   "compare (see the routes' lines above)")
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
