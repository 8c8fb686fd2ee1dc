"""The programs `optimize` makes of each example, as text, for comparing two trees (a refactor
that must not change them: issue 75).

    python tools/hlo_snapshot.py OUT_DIR [--compiled]

Writes, per example of `examples/` (MLP, CNN, transformer and its pmap variant, FSDP), the
lowered StableHLO of the optimized step (``<name>.lowered.txt``; with ``--compiled`` also XLA's
compiled HLO, ``<name>.compiled.txt``) and its plan (``<name>.plan.txt``, the report's plans).
Source locations and metadata are stripped (a refactor moves code). Run it in each tree with
the shipped profile (``LIBRA_JAX_PROFILE_PROBE=0``, set here) and compare the folders
(``diff -r``).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ["LIBRA_JAX_PROFILE_PROBE"] = "0"  # the shipped profile: machine-independent plans
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from report import load_file  # noqa: E402

common = load_file(ROOT / "examples" / "common.py", "common")  # (8 host devices)

import jax  # noqa: E402

import libra_jax  # noqa: E402

EXAMPLES = {"mlp": ("mlp", {}), "cnn": ("cnn", {}), "transformer": ("transformer", {}),
            "transformer-pmap": ("transformer", {"variant": "pmap"}), "fsdp": ("fsdp", {})}
#: MLIR location attributes and their table: they name source lines, which a refactor moves.
LOCATIONS = re.compile(r"\s*loc\(.*?\)(?=\s*$)|^#loc.*$", re.M)
#: XLA's compiled HLO names them too: its instructions' metadata and the tables of source
#: files, functions, locations and stack frames after the module's first line.
METADATA = re.compile(r", metadata=\{[^{}]*\}")
TABLES = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*\n", re.M)


def _compiled_text(text: str) -> str:
    return METADATA.sub("", TABLES.sub("", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (module, options) in EXAMPLES.items():
        step, step_args = common.load_example(module).build(False, **options)
        opt = libra_jax.optimize(step)
        lowered = jax.jit(opt).lower(*step_args)
        (out / f"{name}.lowered.txt").write_text(LOCATIONS.sub("", lowered.as_text()))
        (out / f"{name}.plan.txt").write_text(
            "\n".join(repr(plan) for plan in opt.last_report.plans) + "\n")
        if args.compiled:
            (out / f"{name}.compiled.txt").write_text(_compiled_text(lowered.compile().as_text()))
        print(name, "written", flush=True)


if __name__ == "__main__":
    main()
