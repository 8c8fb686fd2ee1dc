"""Class 3's bound, measured: how far two programs' results are apart at each ISA.

    python benchmarks/codegen_bounds.py [--isa AVX2 --isa AVX] [--out benchmarks/results/codegen_bounds.md]

docs/bitwise.md class 3 (two different programs: the GSPMD route against GSPMD,
plain against optimized or the drop-in, hoisted against in-loop) is checked in the tests with
`libra_jax.testing.assert_codegen_close`. This runs those tests (`TESTS`) once per ISA the
machine offers (XLA's default for this CPU, ``--xla_cpu_max_isa=AVX2``, ``=AVX``: also no
FMA), each in its own pytest process with $CODEGEN_BOUNDS_RECORD set (tests/conftest.py
records every leaf's error before asserting), and tabulates the largest error per test in
units of eps x the leaf's largest magnitude, beside the bound (`CODEGEN_ULPS`) and what a
gradient off by a factor 1 + 1e-4 measures. Exits 1 if a pytest run failed: CI's ISA stage
is this script with ``--isa AVX2 --isa AVX`` (the default ISA runs in the README's command).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import report  # noqa: E402  (benchmarks/report.py)
from libra_jax.config import xla_flags
from libra_jax.testing import CODEGEN_ULPS

#: The tests whose results depend on XLA's code generation (CI's ISA stage runs the same): the
#: files that compare two programs, and of the corpus and the examples the comparisons only.
TESTS = ["tests/test_data_parallel.py", "tests/test_loops.py", "tests/test_overlap.py",
         "tests/test_rewrite.py", "tests/test_testing.py",
         "tests/test_corpus.py::test_optimized_equals_its_xla_control_and_plain_agrees",
         "tests/test_corpus.py::test_the_drop_in_runs_libra_calls",
         "tests/test_corpus.py::test_fsdp_steps_with_gathers_issued_ahead_equal_their_xla_control",
         "tests/test_examples.py::test_example_trains_with_matching_results",
         "tests/test_examples.py::test_demo_checks_its_parameters_against_the_bound"]
#: Left out for CI's time (about 50 s per ISA): the same programs as cases that stay (the
#: drop-in by patch_lax is the function swap's program; the pmap transformer, the jit one's).
DESELECT = ["-k", "not patch_lax", "--deselect",
            "tests/test_examples.py::test_example_trains_with_matching_results[transformer-options3]"]
ISAS = {"default": "", "AVX2": "--xla_cpu_max_isa=AVX2", "AVX": "--xla_cpu_max_isa=AVX"}


def cpu() -> str:
    """The CPU's model name and which of the vector extensions XLA picks from it has."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), "unknown CPU")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines()
                      if line.startswith("flags")), []))
    have = [f for f in ("avx", "avx2", "fma", "f16c", "avx512f") if f in flags]
    return f"{model} ({', '.join(have) or 'no AVX'})"


def run(flag: str, record: Path) -> tuple[bool, str, float]:
    """pytest over TESTS with `flag` added to XLA_FLAGS: whether it passed, its summary line
    and its seconds (its output is printed as it comes)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8, f"{os.environ.get('XLA_FLAGS', '')} {flag}"),
           "CODEGEN_BOUNDS_RECORD": str(record)}
    t0 = time.perf_counter()
    print(f"XLA_FLAGS='{env['XLA_FLAGS']}' pytest -n 2 {' '.join(DESELECT + TESTS)}", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p",
                             "no:cacheprovider", "--durations=10", *DESELECT, *TESTS],
                            cwd=report.ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.strip():
            lines.append(line.strip())
    passed = proc.wait() == 0
    summary = lines[-1].strip("= ") if lines else f"exit {proc.returncode}"
    return passed, summary, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", action="append", choices=list(ISAS),
                        help="an ISA to run (repeatable; default: all of them)")
    parser.add_argument("--out", default=None, help="write the table here too")
    args = parser.parse_args()
    isas = {label: ISAS[label] for label in (args.isa or ISAS)}
    load = os.getloadavg()
    worst: dict[str, dict[str, float]] = collections.defaultdict(dict)
    summaries, failed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for label, flag in isas.items():
            record = Path(tmp) / f"{len(summaries)}.jsonl"
            passed, summary, seconds = run(flag, record)
            summaries[label] = f"{summary} ({seconds:.0f} s)"
            if not passed:
                failed.append(label)
            for line in record.read_text().splitlines() if record.exists() else []:
                entry = json.loads(line)
                test = entry["test"].split("[")[0]  # parameters folded into the test
                worst[test][label] = max(worst[test].get(label, 0.0), float(entry["error"]))
    overall = {label: max((w.get(label, 0.0) for w in worst.values()), default=0.0)
               for label in isas}
    wrong = 1e-4 / float(np.finfo(np.float32).eps)

    def cell(x: float | None) -> str:
        return "-" if x is None else ("0 (bitwise)" if x == 0 else f"{x:.2f}")

    lines = report.header(f"; 8 host devices; CPU: {cpu()}.") + [
        f"Load average (1/5/15 min) before: {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}.", "",
        "Largest class-3 error per test (over its parameters and leaves), in units of eps x "
        "the leaf's largest magnitude (`libra_jax.testing.codegen_error`): the two programs "
        "of each comparison, compiled by XLA for the ISA of the column.", "",
        f"The bound (`CODEGEN_ULPS`): **{CODEGEN_ULPS}**. A float32 gradient off by a factor "
        f"1 + 1e-4 measures {wrong:.0f} (tests/test_testing.py checks it fails).", "",
        "| test | " + " | ".join(isas) + " |", "|---|" + "---|" * len(isas)]
    for test in sorted(worst, key=lambda t: -max(worst[t].values())):
        lines.append(f"| `{test}` | " + " | ".join(cell(worst[test].get(label))
                                                   for label in isas) + " |")
    lines.append("| **largest** | " + " | ".join(f"**{cell(overall[label])}**"
                                                 for label in isas) + " |")
    lines += ["", "pytest per ISA (every test of the files, the bound asserted):", ""]
    lines += [f"- {label} (`XLA_FLAGS` + `{isas[label] or 'nothing'}`): {summary}"
              for label, summary in summaries.items()]
    report.publish(lines, args.out)
    if failed:
        raise SystemExit(f"pytest failed at {', '.join(failed)}")


if __name__ == "__main__":
    main()
