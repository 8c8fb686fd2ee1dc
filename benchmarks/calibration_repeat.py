"""Does calibration repeat, and does its gate refuse a run it should not trust?

Runs ``libra-jax calibrate`` (full budget) ``--runs`` times on a quiet machine, each in its own
process writing to a temporary file, then ``--noisy`` more with a competing process (busy
Python loops on every core, started before and stopped after), and tabulates per run: each
fitted parameter, the fit errors (the soft-min's sharpness fixed, as calibration fits, and
free, on the same samples), the host's measured conditions, and the quality gate's verdict.
The spread row gives each parameter's largest deviation from the quiet runs' median.

    python benchmarks/calibration_repeat.py [--runs 3] [--noisy 1] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import report  # noqa: E402  (benchmarks/report.py)
from libra_jax.config import xla_flags  # noqa: E402

PARAMS = [  # (column, where in the analysis, scale, format)
    ("D", ("slowdown", "fair_share_fit", "params", "compute_threads"), 1.0, "{:.2f}"),
    ("beta GB/s", ("alone", "fit", "params", "beta_bytes_per_s"), 1e-9, "{:.2f}"),
    ("L GB/s", ("alone", "fit", "params", "link_bytes_per_s"), 1e-9, "{:.2f}"),
    ("latency us", ("alone", "fit", "params", "latency_s"), 1e6, "{:.0f}"),
    ("call us", ("calls", "fit", "call_s", 0), 1e6, "{:.0f}"),
    ("workers beside compute", ("calls", "fit", "efficiency", 0), 1.0, "{:.2f}"),
]


def dig(d, path):
    for key in path:
        d = d[key]
    return d


def burn(stop: float) -> None:
    x = 0
    while time.time() < stop:
        x += 1


def calibrate_once(out: Path) -> dict:
    env = {**os.environ, "XLA_FLAGS": xla_flags(8)}
    cmd = [str(Path(sys.executable).parent / "libra-jax"), "calibrate", "--out", str(out),
           "--no-progress"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    doc = json.loads(out.read_text())
    doc["_wall_s"] = time.perf_counter() - t
    return doc


def row(label: str, doc: dict) -> tuple[list[float], str]:
    cal = doc["calibration"]
    a = cal["analysis"]
    values = [float(dig(a, path)) * scale for _, path, scale, _ in PARAMS]
    q = cal["quality"]
    cond = q["conditions"]
    steal = cond["steal_fraction"]
    cells = [label] + [fmt.format(v) for v, (_, _, _, fmt) in zip(values, PARAMS)] + [
        f"{a['alone']['fit']['rms_rel_error'] * 100:.1f}%",
        f"{a['alone']['free_softmin_p_fit']['rms_rel_error'] * 100:.1f}%",
        f"{a['slowdown']['fair_share_fit']['rms_rel_error'] * 100:.1f}%",
        f"{cond['before']['load_average'][0]:.2f}/{cond['after']['load_average'][0]:.2f}",
        "n/a" if steal is None else f"{steal * 100:.1f}%",
        f"{cond['reference_drift'] * 100:.0f}%",
        "passed" if q["passed"] else "refused: " + "; ".join(q["failures"]),
    ]
    return values, "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--noisy", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="libra_cal_"))
    lines = report.header(" (shared VM)") + [
        "", "| run | " + " | ".join(p[0] for p in PARAMS) + " | fit error (p fixed) | "
        "fit error (p free) | slowdown fit error | load 1-min before/after | steal | "
        "reference drift | gate |", "|" + "---|" * (len(PARAMS) + 8)]
    quiet = []
    for i in range(args.runs):
        values, line = row(f"quiet {i + 1}", calibrate_once(work / f"quiet{i}.json"))
        quiet.append(values)
        lines.append(line)
    medians = [statistics.median(v[j] for v in quiet) for j in range(len(PARAMS))]
    spread = [max(abs(v[j] / medians[j] - 1) for v in quiet) if medians[j] else 0.0
              for j in range(len(PARAMS))]
    lines.append("| largest deviation from the quiet median | "
                 + " | ".join(f"{s * 100:.0f}%" for s in spread) + " |" + " |" * 7)
    for i in range(args.noisy):
        stop = time.time() + 600
        hogs = [multiprocessing.Process(target=burn, args=(stop,), daemon=True)
                for _ in range(os.cpu_count() or 2)]
        for h in hogs:
            h.start()
        try:
            _, line = row(f"noisy {i + 1} ({len(hogs)} busy processes)",
                          calibrate_once(work / f"noisy{i}.json"))
        finally:
            for h in hogs:
                h.terminate()
        lines.append(line)
    report.publish(lines, args.out)


if __name__ == "__main__":
    main()
