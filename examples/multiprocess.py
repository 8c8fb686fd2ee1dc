"""The MLP example trained with libra_jax.optimize across processes (jax.distributed, CPU).

    python examples/multiprocess.py [--processes 2] [--steps 10] [--small]

Without --process-id, the script launches itself as --processes local processes of one
jax.distributed job (coordinator on 127.0.0.1, a free port), each with 8 / processes host CPU
devices (2 processes x 4 devices by default; examples/mlp.py trains on 8 devices in all), and
prints process 0's loss per step. With --process-id it is one process of such a job; on two
hosts run, for example,

    host0$ python examples/multiprocess.py --coordinator host0:29500 --processes 2 --process-id 0
    host1$ python examples/multiprocess.py --coordinator host0:29500 --processes 2 --process-id 1

Across processes on CPU, libra_jax's all-reduces fall back to XLA's (gloo) with a notice; the
plan is still made, broadcast from process 0's profile and checked on every process
(docs/multiprocess.md).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from libra_jax.config import xla_flags

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
TOTAL_DEVICES = 8  # what examples/mlp.py trains on (common.DEVICES)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--processes", type=int, default=2,
                        help="processes in the job, dividing 8 (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10,
                        help="training steps (default: %(default)s)")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a quick check)")
    parser.add_argument("--process-id", type=int, default=None,
                        help="run as this process of the job (default: launch all locally)")
    parser.add_argument("--coordinator", default=None,
                        help="host:port of process 0's coordination service (with --process-id)")
    parser.add_argument("--heartbeat-timeout", type=int, default=10,
                        help="seconds without a heartbeat before JAX stops the job when a "
                             "process dies (default: %(default)s; JAX's own default is 100)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="launcher: stop every process after this many seconds "
                             "(default: %(default)s)")
    ns = parser.parse_args(argv)
    if ns.processes < 1 or TOTAL_DEVICES % ns.processes:
        parser.error(f"--processes must divide {TOTAL_DEVICES}")
    if ns.steps < 1:
        parser.error("--steps must be >= 1")
    if ns.process_id is not None and ns.coordinator is None:
        parser.error("--process-id needs --coordinator host:port")
    return ns


def launch(ns: argparse.Namespace) -> int:
    """Start ns.processes copies of this script as one local job; 0 if every one succeeded.
    When one fails, the others are stopped rather than left to JAX's heartbeat timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # jax_num_cpu_devices sets the devices per process; a forced count from XLA_FLAGS must not.
    env = {**os.environ, "XLA_FLAGS": xla_flags(None)}
    common = [sys.executable, os.path.abspath(__file__), "--processes", str(ns.processes),
              "--steps", str(ns.steps), "--coordinator", f"127.0.0.1:{port}",
              "--heartbeat-timeout", str(ns.heartbeat_timeout)] + (["--small"] if ns.small else [])
    procs = [subprocess.Popen(common + ["--process-id", str(i)], env=env,
                              stdout=None if i == 0 else subprocess.DEVNULL)
             for i in range(ns.processes)]
    deadline = time.monotonic() + ns.timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"process {failed[0]} failed" if failed else f"timeout ({ns.timeout:g} s)"
                print(f"multiprocess: {why}; stopping the others", file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        print(f"multiprocess: exit codes {codes}", file=sys.stderr)
        return 1
    return 0


def run(ns: argparse.Namespace) -> None:
    """One process of the job: join it, build examples/mlp.py over all its devices, train."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", TOTAL_DEVICES // ns.processes)
    jax.distributed.initialize(coordinator_address=ns.coordinator, num_processes=ns.processes,
                               process_id=ns.process_id,
                               heartbeat_timeout_seconds=ns.heartbeat_timeout)
    jax.local_devices()  # start the CPU backend with this process's devices

    sys.path.insert(0, EXAMPLES)
    import common  # noqa: E402  (after the backend is up: its 8-device default is moot)

    import libra_jax

    step, args = common.load_example("mlp").build(ns.small)
    optimized = libra_jax.optimize(step)
    train = jax.jit(optimized, donate_argnums=0)
    state, batch = args[0], args[1:]
    main = jax.process_index() == 0
    if main:
        print(f"{jax.process_count()} processes x {jax.local_device_count()} host CPU devices, "
              f"{common.n_params(state[0]) / 1e6:.2f}M parameters, jax {jax.__version__}",
              flush=True)
    for i in range(ns.steps):
        t0 = time.perf_counter()
        state, loss = train(state, *batch)
        loss = float(loss)  # replicated: every process holds it
        if main:
            print(f"step {i + 1:>4}  loss {loss:.6f}  {1e3 * (time.perf_counter() - t0):8.1f} ms",
                  flush=True)
    report = optimized.last_report
    if main and report is not None:
        print(f"libra_jax.optimize: {report.num_psums} psums -> {len(report.plans)} all-reduces, "
              f"blocks {sorted({p.blocks for p in report.plans})} (the same plan on every process)")
    jax.distributed.shutdown()


if __name__ == "__main__":
    ns = parse_args()
    if ns.process_id is None:
        sys.exit(launch(ns))
    run(ns)
