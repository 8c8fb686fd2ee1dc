"""What the examples share: 8 host CPU devices, the side-by-side training loop, and loading an
example module by path (for the tests, ``libra-jax plan`` and ``benchmarks/end_to_end.py``).

Every example module defines ``build(small: bool = False, **options) -> (step, args)``:
``step(state, *batch) -> (state, loss)`` is one data-parallel training step (not jitted; it
calls ``jax.shard_map`` or ``jax.pmap`` itself), ``state = (params, opt_state)``, and
``args = (state, *batch)`` its first inputs. A GSPMD step that takes its gradient through
`libra_jax.value_and_grad` carries ``step.plain``: the same step as GSPMD code
(`jax.value_and_grad`), what its user would run without libra_jax (examples/fsdp.py).
:func:`train` runs ``jax.jit(step.plain or step)`` (plain: XLA's collectives) and
``jax.jit(libra_jax.optimize(step))`` (Libra's) side by side from the same start.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

#: Host CPU devices the examples run on: 8, or $LIBRA_JAX_EXAMPLE_DEVICES (a benchmark's sweep
#: of device counts, benchmarks/contention_sweep.py); read before JAX starts.
DEVICES = int(os.environ.get("LIBRA_JAX_EXAMPLE_DEVICES", "8"))
if DEVICES < 1:
    raise ValueError(f"LIBRA_JAX_EXAMPLE_DEVICES must be a positive int, got {DEVICES}")
from libra_jax.config import xla_flags  # noqa: E402  (pure Python: JAX does not start)

os.environ["XLA_FLAGS"] = xla_flags(DEVICES)  # the caller's flags kept

import jax  # noqa: E402
import numpy as np  # noqa: E402


WARMUP = 2


def setup_devices(n: int = DEVICES) -> None:
    """Ask for ``n`` host CPU devices (a no-op once the CPU backend has started)."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # noqa: BLE001 - the backend is already up: keep what it has
        pass
    have = len(jax.devices("cpu"))
    if have < n:
        raise RuntimeError(f"the examples need {n} host CPU devices, JAX has {have}; set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts")


def mesh(n: int = DEVICES) -> jax.sharding.Mesh:
    setup_devices(n)
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:n]), ("data",))


def load_example(path_or_name: str | os.PathLike) -> Any:
    """Import an example module from a path (``examples/mlp.py``) or a name (``mlp``)."""
    path = Path(path_or_name)
    if path.suffix != ".py":
        path = Path(__file__).with_name(f"{path_or_name}.py")
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"no such example file: {path_or_name}")
    name = f"libra_example_{path.stem}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # for `import common` in the example
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "build", None)):
        raise ValueError(f"{path} defines no build(small=False) -> (step, args)")
    return module


def replicate(tree: Any, m: jax.sharding.Mesh) -> Any:
    """Place a state on every device of the mesh (as the step's outputs are): the first and
    later steps then compile once."""
    return jax.device_put(tree, jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec()))


def copy_tree(tree: Any) -> Any:
    """Fresh buffers (the steps donate their state)."""
    return jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, tree)


def n_params(tree: Any) -> int:
    return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree))


@dataclass
class Result:
    losses: dict[str, list[float]] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)  # seconds, after WARMUP steps
    states: dict[str, Any] = field(default_factory=dict)
    report: Any = None  # the optimized step's OptimizeReport

    def identical(self, a: str = "plain", b: str = "optimized") -> bool:
        """Whether arms `a` and `b` ended in bitwise the same state."""
        x, y = (jax.tree.leaves(self.states[k]) for k in (a, b))
        return all(np.asarray(u).tobytes() == np.asarray(v).tobytes() for u, v in zip(x, y))

    def max_loss_diff(self) -> float:
        a, b = self.losses["plain"], self.losses["optimized"]
        return float(np.max(np.abs(np.subtract(a, b)))) if a else 0.0

    def loss_error(self) -> float:
        """How far the optimized loss curve is from the plain one, in class 3's units
        (`libra_jax.testing.codegen_error`: eps x the largest loss); the two are different
        programs, which XLA may round differently (docs/bitwise.md)."""
        from libra_jax import testing

        return testing.codegen_error(np.float32(self.losses["optimized"]),
                                     np.float32(self.losses["plain"]))


def plain_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """The step its user would run without libra_jax: ``step.plain`` where it has one (a
    GSPMD step written for the route), else the step itself."""
    return getattr(step, "plain", step)


def compile_pair(step: Callable[..., Any], *, control: bool = False,
                 **optimize_options: Any) -> dict[str, Callable[..., Any]]:
    """The plain and the optimized step, each jitted with its state donated; with `control`,
    also the optimized program with XLA's all-reduce in Libra's place
    (``optimize(collectives="xla")``)."""
    import libra_jax

    optimized = libra_jax.optimize(step, **optimize_options)
    jitted = jax.jit(optimized, donate_argnums=0)
    jitted.optimized = optimized  # for .last_report
    fns = {"plain": jax.jit(plain_step(step), donate_argnums=0), "optimized": jitted}
    if control:
        fns["control"] = jax.jit(libra_jax.optimize(step, collectives="xla", **optimize_options),
                                 donate_argnums=0)
    return fns


def train(step: Callable[..., Any], args: tuple, steps: int, *, progress: bool = True,
          control: bool = False, **optimize_options: Any) -> Result:
    """Train the plain and the optimized step (and with `control`, the control:
    `compile_pair`) side by side, from the same start, for ``steps`` steps each (interleaved,
    alternating the order). The first WARMUP steps compile (the second sees the state placed
    on the mesh) and are not timed."""
    fns = compile_pair(step, control=control, **optimize_options)
    state0, batch = args[0], tuple(args[1:])
    res = Result(losses={k: [] for k in fns}, times={k: [] for k in fns},
                 states={k: copy_tree(state0) for k in fns})
    bar = _progress(range(steps), progress)
    for i in bar:
        order = list(fns) if i % 2 == 0 else list(fns)[::-1]
        for name in order:
            t0 = time.perf_counter()
            res.states[name], loss = fns[name](res.states[name], *batch)
            loss = float(loss)  # waits for the step
            if i >= WARMUP:
                res.times[name].append(time.perf_counter() - t0)
            res.losses[name].append(loss)
        if progress and hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{res.losses['plain'][-1]:.4f}")
    res.report = fns["optimized"].optimized.last_report
    return res


def _progress(it: Any, enabled: bool) -> Any:
    if not enabled:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the [examples] extra
        return it
    return tqdm(it, desc="training", unit="step", leave=False)


def print_result(res: Result, title: str) -> None:
    print(title)
    n = len(res.losses["plain"])
    shown = sorted({0, n - 1, *range(0, n, max(1, n // 8))})
    print(f"{'step':>6} {'loss (plain)':>14} {'loss (optimized)':>17}")
    for i in shown:
        print(f"{i + 1:>6} {res.losses['plain'][i]:>14.6f} {res.losses['optimized'][i]:>17.6f}")
    from libra_jax import testing

    # A GSPMD step's plain arm is another program (GSPMD's): the optimized one is then held
    # to its control, the same program with XLA's collectives (class 2 of docs/bitwise.md).
    against = "control" if "control" in res.states else "plain"
    error = res.loss_error()
    print(f"loss curves: max |difference| {res.max_loss_diff():.3g}, {error:.3g} x eps x max loss: "
          + ("within" if error <= testing.CODEGEN_ULPS else "OUTSIDE")
          + f" class 3's bound of {testing.CODEGEN_ULPS} (plain and optimized are two programs, "
          "which XLA may round differently; docs/bitwise.md)")
    same = res.identical("optimized", against)
    print(f"final state: {'bitwise' if same else 'not bitwise'} {against}'s"
          + ("" if same else " (two programs, which XLA may round differently; their loss "
             "curves agree within the bound above)") + "; libra's collectives themselves are "
          "bitwise jax.lax's (class 1, docs/bitwise.md)")
    if res.times["plain"]:
        med = {k: np.median(v) * 1e3 for k, v in res.times.items()}
        for k, v in res.times.items():
            ms = np.asarray(v) * 1e3
            print(f"{k:>10} step: {med[k]:.2f} ms median (IQR {np.percentile(ms, 25):.2f}-"
                  f"{np.percentile(ms, 75):.2f}) over {len(ms)} steps")
        print(f"optimized / plain: {med['optimized'] / med['plain']:.3f}x")
    if res.report is not None:
        plans = res.report.plans
        buckets = [p for p in plans if p.kind == "gradient"]
        calls = ", ".join(f"{n} {c}s" for c in ("all-reduce", "reduce-scatter", "all-gather")
                          if (n := sum(p.collective == c for p in plans)))
        print(f"libra_jax.optimize: {res.report.num_psums} collectives -> {calls} "
              f"({len(buckets)} gradient bucket{'' if len(buckets) == 1 else 's'}, blocks "
              f"{sorted({p.blocks for p in plans})}); details: libra-jax plan")


def main(module_doc: str, build: Callable[..., Any], *, options: dict[str, Any] | None = None) -> Result:
    """Command line of an example: ``--steps``, ``--small``, ``--no-progress`` and ``options``
    (name -> choices, passed to ``build``)."""
    parser = argparse.ArgumentParser(description=module_doc.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default: %(default)s)")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a quick check)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name, choices in (options or {}).items():
        parser.add_argument(f"--{name}", choices=choices, default=choices[0],
                            help="(default: %(default)s)")
    ns = parser.parse_args()
    if ns.steps < 1:
        parser.error("--steps must be >= 1")
    kwargs = {name: getattr(ns, name) for name in (options or {})}
    step, args = build(ns.small, **kwargs)
    params = n_params(args[0][0])
    print(f"{DEVICES} host CPU devices, {params / 1e6:.2f}M parameters ({4 * params / 2**20:.1f} MiB "
          f"of f32 gradients per step), jax {jax.__version__}")
    res = train(step, args, ns.steps, progress=not ns.no_progress,
                control=plain_step(step) is not step)
    print_result(res, f"{ns.steps} steps, plain (jax.jit) and optimized (libra_jax.optimize) side by side:")
    from libra_jax import testing

    if not res.loss_error() <= testing.CODEGEN_ULPS:
        raise SystemExit("the loss curves disagree beyond class 3's bound")
    return res
