"""Write a GPU profile from the CUDA harness's contention curves.

    python benchmarks/gpu_profile.py harness.csv [--base h200] [--out h200-virtual-ranks.json]

Reads the `contend` lines of `libra_cuda_harness contend` (benchmarks/gpu_check.sh
writes them to harness.csv), fits the contention parameters of the base profile
(libra_jax.gpu_calibration) and writes them, marked measured, as a *separate,
labelled* profile (default name ``<base>-virtual-ranks``); prints the curves and the fit.

The curves are proxies, so the result never replaces the shipped ``h200.json``: the ranks
are virtual (local HBM, not NVLink), the contention kernel uses 32 registers per thread
where the real kernel uses 128, and the compute is a naive fp32 GEMM, not XLA's
tensor-core GEMMs. Commit it beside the run's results (date, GPU) as evidence; the shipped
profile changes when real multi-GPU numbers exist.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

from libra_jax import gpu_calibration, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="harness output with contend lines")
    parser.add_argument("--base", default="h200", help="nccl-style profile to update")
    parser.add_argument("--out", help="where to write the profile (default: stdout)")
    parser.add_argument("--gpu", default="", help="GPU name for the provenance note")
    parser.add_argument("--name", default=None,
                        help="the written profile's name (default: <base>-virtual-ranks)")
    args = parser.parse_args(argv)

    rows = gpu_calibration.read_contend_csv(args.csv)
    base_path = Path(model.PROFILE_DIR) / f"{args.base}.json"
    base = json.loads(base_path.read_text()) if base_path.exists() else json.loads(
        Path(args.base).read_text())
    device = model.profile_from_dict(base, origin=str(base_path)).device
    fit = gpu_calibration.fit_contention(
        rows, compute_units=device.compute_units,
        memory_gbyte_per_s=device.memory_bytes_per_s / model.BYTES_PER_GBYTE)
    ref = (f"libra_cuda_harness contend on {args.gpu or 'one GPU'}, {date.today()}, "
           f"{rows[0].ranks} virtual ranks x {rows[0].bytes >> 20} MiB (local HBM, not NVLink)")
    profile = gpu_calibration.apply_fit(base, fit, ref=ref)
    profile["name"] = args.name or f"{Path(args.base).stem}-virtual-ranks"
    profile["notes"] = list(profile.get("notes", [])) + [
        f"Contention parameters fitted to proxy curves ({ref}): virtual ranks share one GPU's "
        "HBM (no NVLink), the contention kernel uses 32 registers per thread (the real kernel "
        "128), the compute is a naive fp32 GEMM (not XLA's tensor-core GEMMs). Evidence, not "
        "a replacement for the shipped profile."]
    model.profile_from_dict(profile, origin="fitted")  # refuse to write an invalid profile

    print("| workload | blocks | compute slowdown | all-reduce alone µs | all-reduce slowdown |",
          file=sys.stderr)
    print("|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r.workload} | {r.blocks} | {r.compute_slowdown:.3f} | "
              f"{r.allreduce_alone_us:.1f} | {r.allreduce_slowdown:.3f} |", file=sys.stderr)
    print(f"fit: {fit}", file=sys.stderr)
    text = json.dumps(profile, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
