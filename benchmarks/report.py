"""What a benchmark's committed table starts and ends with: the command that made it and the
machine it ran on (so the table can be reproduced and judged), then the file it goes to."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import jax

#: The repository's root: benchmarks read the examples and the test corpus from it.
ROOT = Path(__file__).resolve().parents[1]


def header(machine: str) -> list[str]:
    """The command line of this run and a date/versions line ending with `machine`."""
    script = f"benchmarks/{os.path.basename(sys.argv[0])}"
    return [f"Command: `python {script} {' '.join(sys.argv[1:])}`".rstrip(), "",
            f"Date: {datetime.date.today()}; jax {jax.__version__}; "
            f"Python {platform.python_version()}; {os.cpu_count()} CPU cores{machine}"]


def load_file(path: Path, name: str) -> ModuleType:
    """The Python file at `path` imported as module `name` (kept in `sys.modules`): the examples
    and the test corpus are files, not an installed package, and no benchmark edits `sys.path`."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def interleaved_steps(arms: dict, state: dict, batch: tuple, rounds: int, steps: int,
                      warmup: int) -> dict[str, list[float]]:
    """Per arm, its per-step seconds in each of `rounds` rounds of `steps` train steps, after
    `warmup` steps. An arm is ``f(state, *batch) -> (state, loss)`` (donating its state,
    `state[arm]`, updated in place); each round runs every arm, in an order that rotates from
    round to round, so drift hits every arm alike."""
    import time

    for k, f in arms.items():  # compile + warm up
        for _ in range(warmup):
            state[k], loss = f(state[k], *batch)
            float(loss)
    per_step: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(steps):
                state[k], loss = arms[k](state[k], *batch)
            float(loss)
            per_step[k].append((time.perf_counter() - t0) / steps)
    return per_step


def spread(values, q: tuple[float, float] = (10, 90), scale: float = 1.0,
           digits: int = 2) -> str:
    """``"lo-hi"``: the `q` percentiles of `values` times `scale` (a table's spread cell)."""
    import numpy as np

    lo, hi = (np.percentile(values, p) * scale for p in q)
    return f"{lo:.{digits}f}-{hi:.{digits}f}"


def median_ci(ratios, seed: int = 0, n: int = 2000) -> tuple[float, float, float]:
    """The median of paired per-round ratios (a NumPy array) and its bootstrap 95% interval."""
    import numpy as np

    rng = np.random.default_rng(seed)
    boots = np.median(rng.choice(ratios, (n, ratios.size)), axis=1)
    return float(np.median(ratios)), *np.percentile(boots, (2.5, 97.5))


def device_run(doc: str, rounds: int) -> tuple[argparse.Namespace, tuple, list, object]:
    """What a benchmark over every CPU device starts with: its ``--rounds`` (default `rounds`)
    and ``--out`` parsed (its description `doc`'s first line), the load average before it,
    the devices, and a one-axis mesh ``("p",)`` over them."""
    import numpy as np
    from jax.sharding import Mesh

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", default=None)
    devices = jax.devices("cpu")
    return parser.parse_args(), os.getloadavg(), devices, Mesh(np.array(devices), ("p",))


def load_line(before: tuple, after: tuple) -> str:
    """The load average before and after a run, as every table states it."""
    return (f"Load average (1/5/15 min) before: {'/'.join(f'{x:.1f}' for x in before)}, after: "
            f"{'/'.join(f'{x:.1f}' for x in after)} (the run's own 8 device threads count in it).")


def paired_run(before: tuple, after: tuple, rounds: int, steps: int, warmup: int) -> list[str]:
    """The lines a table of `interleaved_steps` gives under its header: the load average
    before and after, and how the rounds ran."""
    return [load_line(before, after),
            f"{rounds} paired interleaved rounds of {steps} steps per arm after {warmup} "
            "warm-up steps; ratios per round."]


def ratio_rows(times: dict[str, list[float]], base: str) -> list[str]:
    """A table row per arm of `interleaved_steps`' `times`: its median and p10-p90 ms, and the
    median of its per-round ratio to arm `base` with its 95% interval (`median_ci`)."""
    import numpy as np

    rows = []
    for arm, values in times.items():
        v = np.asarray(values)
        mid, lo, hi = median_ci(v / np.asarray(times[base]))
        rows.append(f"| {arm} | {np.median(v) * 1e3:.1f} | {spread(v, scale=1e3, digits=1)} | "
                    f"{mid:.3f} ({lo:.3f}-{hi:.3f}) |")
    return rows


def publish(lines: list[str], out: str | None) -> None:
    """Print the table, and write it to `out` when given."""
    text = "\n".join(lines) + "\n"
    if out:
        Path(out).write_text(text)
    print(text)
