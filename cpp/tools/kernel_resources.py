#!/usr/bin/env python3
"""The P2P kernels' resource use, checked against the limits chosen for them.

Compiles cpp/libra/cuda/allreduce.cu for each built architecture (sm_80, sm_90) with
``nvcc --resource-usage`` and ``-ptx`` and asserts, per kernel:

* registers per thread within what ``kMinBlocksPerSm`` blocks of ``kThreads`` threads allow
  (65536 / (512 x 2) = 64 for the per-rank kernels; the virtual-rank kernel, the harness's,
  has 1 block per SM: 128), so a Libra block takes at most half an SM's register file and
  compute can share its SM (the contention model prices what it takes);
* no spills, no stack frame (local memory: slow, and a sign of dynamically indexed arrays);
* co-resident blocks per SM, computed from registers, threads and shared memory as the
  occupancy calculator does, at least the chosen number;
* in the PTX, the copy loops (copy-in from the input, all-gather from peers' results) keep
  ``kCopyUnroll`` 16-byte loads in flight: a basic block with that many ``ld.global.v4``
  (input) and that many ``ld.global.cg.v4`` with as many ``st.global.v4`` (the all-gather;
  a sum over ranks stores one vector per group of loads).

The limits are read from cpp/libra/cuda/protocol.h, where they are chosen and explained.
Prints a table; exits 1 naming each violation. No GPU needed.

Usage: kernel_resources.py [--nvcc PATH] [--source allreduce.cu] [--arch 80 --arch 90]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTOCOL = REPO / "cpp/libra/cuda/protocol.h"

# Per-SM limits of the built architectures (CUDA occupancy calculator).
SM_LIMITS = {
    "80": dict(registers=65536, threads=2048, blocks=32, shared=164 * 1024),
    "90": dict(registers=65536, threads=2048, blocks=32, shared=228 * 1024),
}
REGISTER_GRANULE = 256  # registers are allocated per warp in units of 256


@dataclass
class Kernel:
    name: str
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared: int = 0


def constant(text: str, name: str) -> int:
    m = re.search(rf"inline constexpr int {name} = (\d+);", text)
    if not m:
        raise SystemExit(f"kernel_resources: no {name} in {PROTOCOL}")
    return int(m.group(1))


def demangle(names: list[str]) -> list[str]:
    if not shutil.which("c++filt"):
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines() if out.returncode == 0 else names


def short(name: str) -> str:
    name = re.sub(r"libra::cuda::(\(anonymous namespace\)::)?", "", name)
    return re.sub(r"\(.*\)$", "", name)


def resource_usage(nvcc: str, source: Path, arch: str) -> list[Kernel]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-std=c++17", f"-arch=sm_{arch}", "--resource-usage", "-diag-suppress=940,2473",
               f"-I{REPO / 'cpp'}", "-c", str(source), "-o", f"{tmp}/k.o"]
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"kernel_resources: nvcc failed:\n{out.stderr}")
    kernels: list[Kernel] = []
    for line in (out.stdout + out.stderr).splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            kernels.append(Kernel(m.group(1)))
            continue
        if not kernels:
            continue
        k = kernels[-1]
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            k.stack, k.spill_stores, k.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            k.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            k.shared = int(s.group(1)) if s else 0
    kernels = [k for k in kernels if "AllReduceKernel" in k.name]
    for k, d in zip(kernels, demangle([k.name for k in kernels])):
        k.name = short(d)
    return kernels


def blocks_per_sm(k: Kernel, arch: str, threads: int) -> int:
    lim = SM_LIMITS[arch]
    warps = -(-threads // 32)
    per_warp = -(-max(k.registers, 1) * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    by_registers = (lim["registers"] // per_warp) // warps
    by_threads = lim["threads"] // threads
    by_shared = lim["shared"] // k.shared if k.shared else lim["blocks"]
    return min(by_registers, by_threads, by_shared, lim["blocks"])


def ptx_copy_loops(nvcc: str, source: Path, arch: str) -> dict[str, tuple[int, int]]:
    """Per kernel (mangled name): the most plain ``ld.global.v4`` in one basic block, and
    the most ``ld.global.cg.v4`` in a basic block that stores as many vectors."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-std=c++17", f"-arch=sm_{arch}", "-ptx", "-diag-suppress=940,2473",
               f"-I{REPO / 'cpp'}", str(source), "-o", f"{tmp}/k.ptx"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"kernel_resources: nvcc -ptx failed:\n{out.stderr}")
        ptx = Path(f"{tmp}/k.ptx").read_text()
    found: dict[str, tuple[int, int]] = {}
    for m in re.finditer(r"\.entry (\S+)\(.*?\n}\n", ptx, re.S):
        name = m.group(1)
        best_in = best_gather = 0
        # Basic blocks: split at labels and branches.
        for block in re.split(r"\n\$L__\w+:|\n\s*@?%?\w*\s*bra(?:\.uni)?\s", m.group(0)):
            plain = len(re.findall(r"ld\.global\.v4\.", block))
            cg = len(re.findall(r"ld\.global\.cg\.v4\.", block))
            stores = len(re.findall(r"st\.global\.v4\.", block))
            best_in = max(best_in, min(plain, stores))
            best_gather = max(best_gather, min(cg, stores))
        found[name] = (best_in, best_gather)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    ap.add_argument("--source", type=Path, default=REPO / "cpp/libra/cuda/allreduce.cu")
    ap.add_argument("--arch", action="append", choices=sorted(SM_LIMITS))
    args = ap.parse_args()
    text = PROTOCOL.read_text()
    threads = constant(text, "kThreads")
    min_blocks = constant(text, "kMinBlocksPerSm")
    unroll = constant(text, "kCopyUnroll")
    # The virtual-rank kernel's own choice (allreduce.cu: kVirtualBlocksPerSm).
    src = args.source.read_text()
    m = re.search(r"inline constexpr int kVirtualBlocksPerSm = (\d+);", src)
    virtual_blocks = int(m.group(1)) if m else min_blocks
    problems: list[str] = []
    print(f"limits: {threads} threads a block; per-rank kernels >= {min_blocks} blocks a SM "
          f"(<= {65536 // (threads * min_blocks)} registers), virtual-rank kernel >= "
          f"{virtual_blocks}; no spills, no stack; {unroll} copy loads in flight")
    print(f"{'arch':5} {'kernel':44} {'regs':>4} {'stack':>5} {'spill':>7} {'blocks/SM':>9}")
    for arch in args.arch or ["80", "90"]:
        kernels = resource_usage(args.nvcc, args.source, arch)
        if not kernels:
            problems.append(f"sm_{arch}: no AllReduceKernel in the ptxas report")
        for k in kernels:
            want = virtual_blocks if k.name.startswith("void Virtual") else min_blocks
            per_sm = blocks_per_sm(k, arch, threads)
            print(f"sm_{arch} {k.name[5:49]:44} {k.registers:4} {k.stack:5} "
                  f"{k.spill_stores:3}/{k.spill_loads:<3} {per_sm:9}")
            if k.spill_stores or k.spill_loads:
                problems.append(f"sm_{arch} {k.name}: spills ({k.spill_stores} bytes stored, "
                                f"{k.spill_loads} loaded)")
            if k.stack:
                problems.append(f"sm_{arch} {k.name}: a {k.stack}-byte stack frame (local memory)")
            if per_sm < want:
                problems.append(f"sm_{arch} {k.name}: {per_sm} blocks per SM at {k.registers} "
                                f"registers, fewer than the {want} chosen")
        loops = {k: v for k, v in ptx_copy_loops(args.nvcc, args.source, arch).items()
                 if "AllReduceKernel" in k}
        names = dict(zip(loops, (short(d) for d in demangle(list(loops)))))
        for mangled, (copy_in, gather) in sorted(loops.items()):
            name = names[mangled]
            if copy_in < unroll:
                problems.append(f"sm_{arch} {name}: the copy-in keeps {copy_in} input load(s) in "
                                f"flight, not {unroll}")
            if gather < unroll:
                problems.append(f"sm_{arch} {name}: the all-gather keeps {gather} peer load(s) in "
                                f"flight, not {unroll}")
        if loops:
            print(f"sm_{arch}: PTX, 16-byte loads in flight in the copy loops (least over "
                  f"{len(loops)} kernels): copy-in {min(v[0] for v in loops.values())}, "
                  f"all-gather {min(v[1] for v in loops.values())}")
        else:
            problems.append(f"sm_{arch}: no AllReduceKernel in the PTX")
    for p in problems:
        print("FAIL:", p)
    print("kernel resources:", "FAIL" if problems else "ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
