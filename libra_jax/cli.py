"""``libra-jax`` command line.

Subcommands register themselves in `SUBCOMMANDS`: each entry is a function that adds its
parser to the argparse sub-parser set and sets ``func`` (the handler, which returns an exit
status). To add ``plan`` or ``calibrate``, write ``_add_<name>(subparsers)`` and its handler and
append the function to `SUBCOMMANDS`.

``simulate`` compares the backward time of one model under Libra and the baselines, using a
hardware profile (``libra_jax.model``) and exact per-layer sizes (``libra_jax.zoo``):

    libra-jax simulate --model bert-large --profile libra-testbed --workers 8 --gantt out.png

It needs neither JAX nor the compiled extension; ``--gantt`` needs matplotlib.

``plan`` explains what ``libra_jax.optimize`` decides for an example script (a Python file that
defines ``build(small=False) -> (step, args)``, as the scripts in ``examples/`` do):

    libra-jax plan examples/transformer.py --gantt out.png

Exit status: 0; 2 for misuse, checked before the work where it can be (a bad option, a missing
file, a folder where a script is expected, a profile that does not load, an output folder that
does not exist, a script that does not keep ``plan``'s contract); 1 for an error while running,
the user's script raising included (importing it, or its ``build()``); 130 when interrupted.
Each error is one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from libra_jax import config, planner, zoo
from libra_jax import model as cost_models
from libra_jax.gantt import MissingDependencyError

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

BYTES_PER_MIB = 1 << 20
HOROVOD_FUSION_MIB = planner.HOROVOD_FUSION_BYTES // BYTES_PER_MIB  # --fusion-mib's default


class ScriptError(Exception):
    """The user's script raised (importing it, or its ``build()``): exit status 1, as for any
    error while running, not 2 (misuse). The message names the script's line and the
    exception."""


def _alloc_summary(buckets: Sequence[object]) -> str:
    """Allocations of non-empty runs, e.g. ``2048x3 1024 512x2``."""
    runs: list[list[int]] = []
    for b in buckets:
        if runs and runs[-1][0] == b.blocks:  # type: ignore[attr-defined]
            runs[-1][1] += 1
        else:
            runs.append([b.blocks, 1])  # type: ignore[attr-defined]
    text = " ".join(f"{k}x{n}" if n > 1 else f"{k}" for k, n in runs)
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------------------------------------
# simulate
# ----------------------------------------------------------------------------------------------


def _positive_float(text: str) -> float:
    """argparse type: a finite number >= 0 (argparse names the option in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _check_output(path: str | None, option: str) -> None:
    """Fail before the work when `path` cannot be written: its folder is missing, or it is a
    folder itself."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a directory; give a file name")
    if not target.parent.is_dir():
        raise ValueError(f"{option} {path}: no such directory {str(target.parent)!r}")


def _add_simulate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="compare Libra with the baselines for one model (no GPU needed)",
        description="Predict the backward time of one data-parallel training step of MODEL under "
                    "Libra and the baselines, using a hardware profile and exact per-layer sizes.")
    p.add_argument("--model", required=True, choices=zoo.MODEL_NAMES)
    p.add_argument("--profile", default="libra-testbed",
                   help=f"profile name ({', '.join(cost_models.list_profiles())}) or path to a JSON file "
                        "(default: %(default)s)")
    p.add_argument("--workers", type=int, default=8, help="data-parallel ranks (default: %(default)s)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="override the ring's bottleneck link, Gb/s per direction")
    p.add_argument("--batch", type=int, default=None, help="per-worker batch (default: the artifact's, per model)")
    p.add_argument("--seq-len", type=_positive_int, default=None,
                   help="BERT sequence length (default: 128)")
    p.add_argument("--dtype", default=None, help="compute dtype for peak FLOP/s (default: the profile's)")
    p.add_argument("--default-alloc", type=int, default=None,
                   help="the baselines' fixed allocation (default: 2048 threads, or the largest block option)")
    p.add_argument("--fusion-mib", type=_positive_float, default=None,
                   help=f"the default policy's fusion threshold in MiB (default: Horovod's "
                        f"{HOROVOD_FUSION_MIB}; with --fsdp, XLA's combiner, "
                        f"{planner.XLA_COMBINE_BYTES / BYTES_PER_MIB:.0f})")
    p.add_argument("--fsdp", action="store_true",
                   help="sharded training (FSDP, ZeRO-3): the weights gathered in the forward "
                        "pass and again in the backward pass, the gradients reduce-scattered; "
                        "Libra against XLA's defaults on NCCL and fusion only, per iteration")
    p.add_argument("--prefuse", type=int, default=planner.DEFAULT_PREFUSE,
                   help="plan fusion over at most this many pre-fused layer groups, as the Libra artifact "
                        "does; 0 plans the exact layers (slower) (default: %(default)s)")
    p.add_argument("--gantt", metavar="PNG", default=None, help="write a Gantt chart of Libra's plan")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    _check_output(args.gantt, "--gantt")
    profile = cost_models.load_profile(args.profile)
    derivation = cost_models.derive(profile, args.workers, link_gbit_per_s=args.link_gbps)
    workload = zoo.training_workload(args.model, flop_per_s=profile.device.flop_per_s(args.dtype),
                                     bytes_per_s=profile.device.bytes_per_s(), batch=args.batch,
                                     seq_len=args.seq_len)
    default_alloc = args.default_alloc if args.default_alloc is not None else derivation.default_allocation()
    if default_alloc not in derivation.cost.slowdown:
        raise ValueError(f"--default-alloc {default_alloc} is not an option; options: "
                         f"{', '.join(map(str, sorted(derivation.cost.slowdown)))}")
    if args.prefuse < 0:
        raise ValueError(f"--prefuse must be >= 0, got {args.prefuse}")
    if args.fusion_mib is not None and args.fusion_mib < 0:
        raise ValueError(f"--fusion-mib must be >= 0, got {args.fusion_mib}")
    if args.fsdp:
        return _run_simulate_fsdp(args, profile, derivation, default_alloc)
    if args.fusion_mib is None:
        args.fusion_mib = HOROVOD_FUSION_MIB
    comparison = planner.compare_policies(workload.layers, derivation.cost, default_alloc=default_alloc,
                                          fusion_bytes=round(args.fusion_mib * BYTES_PER_MIB), prefuse=args.prefuse)
    fixed = workload.forward_s + workload.optimizer_s
    base = comparison.backward_s("default")
    best_baseline = comparison.best_baseline()

    if args.json:
        out = {
            "model": args.model, "batch": workload.batch, "layers": len(workload.layers),
            "grad_bytes": workload.grad_bytes, "profile": profile.name, "workers": args.workers,
            "link_gbit_per_s": derivation.link_bytes_per_s * 8 / 1e9, "key_unit": derivation.key_unit,
            "latency_s": derivation.cost.latency_s, "dropped": {str(k): v for k, v in derivation.dropped.items()},
            "forward_s": workload.forward_s, "optimizer_s": workload.optimizer_s,
            "backward_compute_s": workload.backward_compute_s, "default_alloc": default_alloc,
            "policies": {name: {"backward_s": plan.backward_s, "buckets": len(plan.buckets),
                                "allocations": [b.blocks for b in plan.buckets]}
                         for name, plan in comparison.plans.items()},
        }
        print(json.dumps(out, indent=2))
    else:
        print(f"model     {args.model}: {len(workload.layers)} layers, {workload.grad_bytes / BYTES_PER_MIB:.1f} MiB "
              f"of gradients, batch {workload.batch}")
        print(f"compute   forward {workload.forward_s * 1e3:.2f} ms, "
              f"backward {workload.backward_compute_s * 1e3:.2f} ms, "
              f"optimizer {workload.optimizer_s * 1e3:.2f} ms (full speed, {profile.device.name})")
        print(f"profile   {profile.name} ({profile.form}), {args.workers} workers, link "
              f"{derivation.link_bytes_per_s * 8 / 1e9:g} Gb/s, latency {derivation.cost.latency_s * 1e6:.1f} us, "
              f"options ({derivation.key_unit}) {', '.join(map(str, sorted(derivation.cost.slowdown)))}")
        for key, why in derivation.dropped.items():
            print(f"dropped   {key}: {why}")
        for note in derivation.notes:
            print(f"note      {note}")
        print()
        header = (f"{'policy':<13} {'buckets':>7} {'allocations':<40} {'backward ms':>11} {'vs default':>10} "
                  f"{'iteration ms':>12}")
        print(header)
        print("-" * len(header))
        for name, plan in comparison.plans.items():
            print(f"{name:<13} {len(plan.buckets):>7} {_alloc_summary(plan.buckets):<40} "
                  f"{plan.backward_s * 1e3:>11.2f} "
                  f"{(plan.backward_s / base - 1) * 100:>+9.1f}% {(fixed + plan.backward_s) * 1e3:>12.2f}")
        libra = comparison.backward_s("libra")
        print()
        gain = (1 - libra / comparison.backward_s(best_baseline)) * 100
        print(f"Libra vs best baseline ({best_baseline}): backward {gain:.1f}% "
              f"lower, iteration speedup {(fixed + comparison.backward_s(best_baseline)) / (fixed + libra):.3f}x")
    if args.gantt:
        from libra_jax import gantt

        tl = gantt.timeline(list(workload.layers), comparison.plans["libra"].buckets, derivation.cost)
        path = gantt.draw(tl, args.gantt, key_unit=derivation.key_unit.replace("_", " "),
                          title=f"{args.model} on {profile.name}, {args.workers} workers: Libra's plan, "
                                f"{tl.backward_s * 1e3:.2f} ms backward")
        print(f"gantt     wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _run_simulate_fsdp(args: argparse.Namespace, profile: Any, derivation: Any,
                       default_alloc: int) -> int:
    """`simulate --fsdp`: the model's FSDP step (`zoo.fsdp_workload`) under each of
    `planner.FSDP_POLICIES` (`planner.compare_fsdp`), per iteration."""
    if args.gantt:
        raise ValueError("--gantt draws a data-parallel plan; it does not take --fsdp")
    workload = zoo.fsdp_workload(args.model, flop_per_s=profile.device.flop_per_s(args.dtype),
                                 bytes_per_s=profile.device.bytes_per_s(), workers=args.workers,
                                 batch=args.batch, seq_len=args.seq_len)
    fusion = (planner.XLA_COMBINE_BYTES if args.fusion_mib is None
              else round(args.fusion_mib * BYTES_PER_MIB))
    plans = planner.compare_fsdp(workload.step, derivation.cost, default_alloc=default_alloc,
                                 fusion_bytes=fusion, prefuse=args.prefuse)
    iteration = {name: p.forward_s + p.backward_s + workload.optimizer_s
                 for name, p in plans.items()}
    best = min(("default", "fusion-only"), key=iteration.__getitem__)
    if args.json:
        print(json.dumps({
            "model": args.model, "fsdp": True, "batch": workload.batch, "workers": args.workers,
            "profile": profile.name, "param_bytes": workload.param_bytes,
            "compute_s": workload.compute_s, "optimizer_s": workload.optimizer_s,
            "default_alloc": default_alloc, "fusion_bytes": fusion,
            "policies": {name: {"forward_s": p.forward_s, "backward_s": p.backward_s,
                                "iteration_s": iteration[name],
                                "forward_gathers": {"distance": p.forward.distance,
                                                    "blocks": list(p.forward.blocks)},
                                "backward_gathers": {"distance": p.backward.distance,
                                                     "blocks": list(p.backward.blocks)},
                                "buckets": len(p.buckets),
                                "allocations": [b.blocks for b in p.buckets]}
                         for name, p in plans.items()}}, indent=2))
        return 0
    step = workload.step
    print(f"model     {args.model} (FSDP over {args.workers} ranks): {len(step.layers)} sharded "
          f"layers, {workload.param_bytes / BYTES_PER_MIB:.1f} MiB of weights gathered twice "
          f"and reduce-scattered, batch {workload.batch}")
    print(f"compute   forward and backward {workload.compute_s * 1e3:.2f} ms, optimizer on the "
          f"shard {workload.optimizer_s * 1e3:.2f} ms (full speed, {profile.device.name})")
    print(f"profile   {profile.name} ({profile.form}), link "
          f"{derivation.link_bytes_per_s * 8 / 1e9:g} Gb/s, options ({derivation.key_unit}) "
          f"{', '.join(map(str, sorted(derivation.cost.slowdown)))}")
    print()
    header = (f"{'policy':<12} {'gathers ahead fwd/bwd':>21} {'RS buckets':>10} "
              f"{'forward ms':>10} {'backward ms':>11} {'iteration ms':>12} {'vs default':>10}")
    print(header)
    print("-" * len(header))
    for name, p in plans.items():
        print(f"{name:<12} {f'{p.forward.distance}/{p.backward.distance}':>21} "
              f"{len(p.buckets):>10} {p.forward_s * 1e3:>10.2f} {p.backward_s * 1e3:>11.2f} "
              f"{iteration[name] * 1e3:>12.2f} "
              f"{(iteration[name] / iteration['default'] - 1) * 100:>+9.1f}%")
    print()
    print(f"Libra vs best baseline ({best}): iteration speedup "
          f"{iteration[best] / iteration['libra']:.3f}x (what is assumed: "
          "benchmarks/results/paper_reproduction_fsdp.md)")
    return 0


# ----------------------------------------------------------------------------------------------
# calibrate
# ----------------------------------------------------------------------------------------------


def _add_calibrate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure the contention model on this backend and write a profile",
        description="Measure all-reduce time vs bytes x blocks (alone and while compute runs), compute "
                    "slowdown vs blocks, peak compute rate and memory bandwidth on the current backend; fit "
                    "the model and write a profile that optimize and psum(blocks=None) then use by default "
                    "(docs/calibration.md).")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes, blocks and repetitions (about 10-30 s): a smoke test, "
                        "written beside the default profile, not as it, unless --install")
    p.add_argument("--install", action="store_true",
                   help="install a --quick profile as the default (a full one is installed when it "
                        "passes the quality gate)")
    p.add_argument("--out", metavar="PATH", default=None,
                   help="write the profile here (default: $LIBRA_JAX_PROFILE_DIR/<backend>.json, else "
                        "$XDG_CACHE_HOME/libra_jax/profiles/<backend>.json)")
    p.add_argument("--devices", type=int, default=8,
                   help="host CPU devices to measure among (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> int:
    import os

    if args.devices < 2:
        raise ValueError(f"--devices must be >= 2 (an all-reduce needs two ranks), got {args.devices}")
    # Before JAX starts its CPU backend (a no-op if it already has).
    os.environ["XLA_FLAGS"] = config.xla_flags(args.devices)  # the caller's flags kept
    _check_output(args.out, "--out")
    from libra_jax import calibrate

    try:
        return calibrate.run(quick=args.quick, out=args.out, devices=args.devices,
                             progress=not args.no_progress, install=args.install)
    except calibrate.CalibrationError as exc:
        print(f"libra-jax calibrate: cannot calibrate: {exc}", file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="explain libra_jax.optimize's plan for a training script",
        description="Trace the training step of SCRIPT (a Python file defining build(small=False) "
                    "-> (step, args), like examples/*.py) on 8 host CPU devices and print the "
                    "plan libra_jax.optimize makes: buckets, tensors, bytes, allocation, predicted "
                    "times against the default allocation and fusion only. The options, SCRIPT "
                    "and --profile are checked before the script is imported (exit status 2); "
                    "an exception raised by the script itself exits with 1.")
    p.add_argument("script", help="one script, e.g. examples/transformer.py (a folder is refused, "
                                  "with the scripts in it that define build() named)")
    p.add_argument("--small", action="store_true", help="build the script's small sizes")
    p.add_argument("--variant", default=None, help="passed to build(variant=...) if given")
    p.add_argument("--profile", default=None,
                   help="profile name or JSON path, loaded before the script is (default: the "
                        "backend's)")
    p.add_argument("--no-fusion", action="store_true", help="plan allocations only, no fusion")
    p.add_argument("--overlap", choices=("auto", "sync", "start-done"), default=None,
                   help="how each gradient all-reduce is issued, as optimize(overlap=...) "
                        "(default: $LIBRA_JAX_OVERLAP, else auto)")
    p.add_argument("--prefetch", type=_prefetch_arg, default=None, metavar="{auto,off,N}",
                   help="how far ahead each all-gather is issued, as optimize(prefetch=...) "
                        "(default: $LIBRA_JAX_PREFETCH, else auto)")
    p.add_argument("--plain", action="store_true", help="plain-text table even if rich is installed")
    p.add_argument("--gantt", metavar="PNG", default=None,
                   help="draw the predicted timeline (compute with its slowdown, each all-reduce "
                        "with its allocation)")
    p.add_argument("--gantt-gathers", metavar="PNG", default=None,
                   help="draw the predicted pass of all-gathers (FSDP: each gather, when it is "
                        "issued, and the compute that reads it)")
    p.set_defaults(func=_run_plan)


def _prefetch_arg(text: str) -> str | int:
    """``--prefetch``: auto, off or a number of all-gathers ahead (`config.prefetch_mode`)."""
    try:
        return config.prefetch_mode(text, who="--prefetch")
    except ValueError as exc:
        raise argparse.ArgumentTypeError("must be" + str(exc).split("must be", 1)[-1]) from None


def _script_file(path: str) -> Path:
    """`path` resolved, where it names a file; ValueError (misuse) where it is missing or a
    folder (naming the folder's scripts that define ``build(``, found by their text)."""
    file = Path(path).resolve()
    if file.is_dir():
        scripts = sorted(p.name for p in file.glob("*.py")
                         if "def build(" in p.read_text(errors="replace"))
        found = (f"one of {', '.join(scripts)}" if scripts
                 else "none in it defines build(small=False)")
        raise ValueError(f"{path} is a folder: plan takes one script ({found})")
    if not file.is_file():
        raise ValueError(f"no such file: {path}")
    return file


def _load_script(path: str) -> object:
    """The script as a module. Not `runpy.run_path`: it leaves the script's folder off
    sys.path (examples/*.py import their common.py from there) and returns a dict of globals,
    not a module kept in sys.modules (which a second load of the same file reuses).
    ValueError where the file cannot be a script; `ScriptError` where importing it raised."""
    import importlib.util
    import os

    file = _script_file(path)
    os.environ["XLA_FLAGS"] = config.xla_flags(8)  # the caller's flags kept
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    name = f"libra_plan_{file.stem}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(file):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a Python file (a script defining build(small=False))")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[name]
        raise ValueError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:  # the script's own error, said in one line with its place
        del sys.modules[name]
        raise ScriptError(f"{_where(exc, file, path)}: importing it failed: "
                          f"{type(exc).__name__}: {exc}") from None
    if not callable(getattr(module, "build", None)):
        raise ValueError(f"{path} defines no build(small=False) -> (step, args)")
    return module


#: What `plan` expects of a script, said with every error about its `build`.
_BUILD_CONTRACT = "plan expects build(small=False) -> (step, args), step called as step(*args)"


def _where(exc: BaseException, file: object, path: str) -> str:
    """`path`, with the line of the script's innermost frame in `exc`'s traceback."""
    import traceback

    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(file)]
    return f"{path}:{lines[-1]}" if lines else path


def _build(module: object, path: str, small: bool, kwargs: dict) -> tuple[object, tuple]:
    """(step, args) from the script's ``build(small, **kwargs)``; ValueError naming the script
    and `_BUILD_CONTRACT` where build cannot be called so or returns something else;
    `ScriptError` where it raises."""
    import inspect

    build = module.build  # type: ignore[attr-defined]
    try:
        inspect.signature(build).bind(small, **kwargs)
    except TypeError as exc:
        raise ValueError(f"{path}: build{inspect.signature(build)} cannot be called as "
                         f"build({small!r}): {exc}; {_BUILD_CONTRACT}") from None
    try:
        built = build(small, **kwargs)
    except Exception as exc:
        raise ScriptError(f"{_where(exc, getattr(module, '__file__', ''), path)}: build() "
                          f"failed: {type(exc).__name__}: {exc}") from None
    if (not isinstance(built, (tuple, list)) or len(built) != 2 or not callable(built[0])
            or not isinstance(built[1], (tuple, list))):
        raise ValueError(f"{path}: build() returned {_short(built)}; {_BUILD_CONTRACT}")
    return built[0], tuple(built[1])


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _run_plan(args: argparse.Namespace) -> int:
    import inspect

    # Misuse first, before the script is imported and its step traced (tens of seconds).
    _check_output(args.gantt, "--gantt")
    _check_output(args.gantt_gathers, "--gantt-gathers")
    _script_file(args.script)
    if args.profile is not None:
        cost_models.load_profile(args.profile)  # ValueError: unknown, missing or malformed
    module = _load_script(args.script)
    if args.variant and "variant" not in inspect.signature(module.build).parameters:  # type: ignore[attr-defined]
        raise ValueError(f"{args.script}: build() takes no variant, so --variant "
                         f"{args.variant!r} cannot be used")
    import importlib

    explain_mod = importlib.import_module("libra_jax.explanation")

    kwargs = {"variant": args.variant} if args.variant else {}
    step, step_args = _build(module, args.script, args.small, kwargs)
    result = explain_mod.explain(step, *step_args, profile=args.profile, fusion=not args.no_fusion,
                                 overlap=args.overlap, prefetch=args.prefetch, file=sys.stdout,
                                 use_rich=False if args.plain else None)
    if args.gantt:
        from libra_jax import gantt

        if not result.scopes:
            raise ValueError("no gradient psums were planned: nothing to draw")
        s = result.scopes[0]
        tl = gantt.timeline(list(s.layers), list(s.buckets), s.cost)
        path = gantt.draw(tl, args.gantt, key_unit=s.key_unit.replace("_", " "),
                          title=f"{args.script} on {s.profile}, {s.world} ranks: Libra's plan, "
                                f"{tl.backward_s * 1e3:.2f} ms backward (predicted)")
        print(f"gantt     wrote {path}")
    if args.gantt_gathers:
        from libra_jax import gantt

        if not result.gathers:
            raise ValueError("no all-gathers were planned: nothing to draw")
        g = max(result.gathers, key=lambda g: len(g.rows))
        tl = g.timeline()
        how = f"issued {g.distance} ahead" if g.distance else "one call each"
        path = gantt.draw(tl, args.gantt_gathers, key_unit=g.key_unit.replace("_", " "),
                          names=[r.tensor for r in g.rows],
                          title=f"{args.script} on {g.profile}, {g.world} ranks: all-gathers "
                                f"{how}, {tl.total_s * 1e3:.2f} ms (predicted)")
        print(f"gantt     wrote {path}")
    return 0


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_simulate, _add_plan]
SUBCOMMANDS.append(_add_calibrate)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (``prog: error: ...``) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from libra_jax import __version__

    parser = _Parser(prog="libra-jax",
                     description="Libra: contention-aware all-reduce allocation for JAX.")
    parser.add_argument("--version", action="version", version=f"libra-jax {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                       parser_class=_Parser)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status: 0, 2 for a usage or input error, 1 for
    an error while running (the user's script raising included), 130 when interrupted; an
    error is one line on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, MissingDependencyError) as exc:  # what was asked for cannot be done
        print(f"libra-jax {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"libra-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except ScriptError as exc:  # the user's script raised: an error while running
        print(f"libra-jax {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:  # it went wrong while running
        print(f"libra-jax {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
