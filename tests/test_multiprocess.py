"""libra_jax across processes (jax.distributed on localhost, CPU, gloo).

The engine serves the devices of one process only, so a psum spanning processes falls back
to XLA's collectives with a notice. `optimize` plans identically on every process: process
0's profile is broadcast through JAX's key-value store, and the plans are compared there. A
process that dies makes the others stop (JAX's heartbeat), never hang. Every worker runs as
its own Python process (`run_processes`), N processes x D host devices each."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from libra_jax.config import xla_flags

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Every worker: argv = pid, port, processes, devices per process, extra arguments...
PRELUDE = textwrap.dedent("""
    import json, os, sys, time, warnings
    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    pid, port, nproc, ndev = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    args = sys.argv[5:]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", ndev)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                               process_id=pid, initialization_timeout=60,
                               heartbeat_timeout_seconds=int(os.environ.get("HEARTBEAT_S", 100)))
    assert len(jax.local_devices()) == ndev  # starts the backend: later config changes are moot
    import libra_jax
""")

# A 3-layer MLP's gradient step: three gradient psums for the planner to bucket. Run by the
# workers and, for the single-process reference, by the tests themselves.
GRAD_STEP = textwrap.dedent("""
    SIZES = (16, 32, 32, 8)

    def grad_step(mesh, profile):
        def loss(ws, x):
            for w in ws[:-1]:
                x = jnp.tanh(x @ w)
            return jnp.sum((x @ ws[-1]) ** 2)

        def body(ws, x):
            return jax.lax.psum(jax.grad(loss)(ws, x), "x")

        return libra_jax.optimize(
            jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                          check_vma=False), profile=profile)

    def grad_inputs(mesh):
        rng = np.random.default_rng(0)
        ws = tuple((rng.standard_normal((m, n)) / np.sqrt(m)).astype(np.float32)
                   for m, n in zip(SIZES[:-1], SIZES[1:]))
        data = rng.standard_normal((8 * 4, SIZES[0])).astype(np.float32)
        x = jax.make_array_from_callback(data.shape, jax.NamedSharding(mesh, P("x")),
                                         lambda i: data[i])
        return ws, x
""")

PSUM_WORKER = PRELUDE + textwrap.dedent("""
    mesh = jax.make_mesh((8,), ("x",))
    data = np.arange(24, dtype=np.float32).reshape(8, 3)
    x = jax.make_array_from_callback((8, 3), jax.NamedSharding(mesh, P("x")), lambda i: data[i])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = jax.jit(jax.shard_map(lambda v: libra_jax.psum(v, "x"), mesh=mesh,
                                  in_specs=P("x"), out_specs=P()))
        out = np.asarray(f(x).addressable_data(0)).ravel().tolist()
    print("RESULT", out, any("several processes" in str(w.message) for w in caught))
    # The sharded pair over the same mesh: XLA's collectives, with libra's notice.
    y = jax.make_array_from_callback((64, 3), jax.NamedSharding(mesh, P("x")),
                                     lambda i: np.arange(192, dtype=np.float32).reshape(64, 3)[i])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = jax.jit(jax.shard_map(
            lambda v: libra_jax.all_gather(libra_jax.psum_scatter(v, "x", tiled=True), "x",
                                           tiled=True), mesh=mesh, in_specs=P("x"),
            out_specs=P("x")))
        got = np.asarray(g(y).addressable_data(0))[:, 0].tolist()
    notices = [str(w.message) for w in caught if "several processes" in str(w.message)]
    print("SHARDED", got, sorted(n.split(":")[1].split(" for")[0].strip() for n in notices))
    jax.distributed.shutdown()
""")

# args: profile ("-" for the default), [profile directory]
GRAD_WORKER = PRELUDE + GRAD_STEP + textwrap.dedent("""
    profile = None if args[0] == "-" else args[0]
    if profile and profile.startswith("object:"):  # a model.Profile, not a name
        from libra_jax import model
        profile = model.load_profile(profile[len("object:"):])
    if len(args) > 1:
        os.environ["LIBRA_JAX_PROFILE_DIR"] = args[1]
    mesh = jax.make_mesh((8,), ("x",))
    step = grad_step(mesh, profile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            grads = step(*grad_inputs(mesh))
        except RuntimeError as e:
            print("ERROR", type(e).__name__, str(e).replace("\\n", " | "))
            grads = None
    if grads is not None:
        report = step.last_report
        print("PLAN", json.dumps(report.plan_lines()))
        print("PROFILE", json.dumps([p["profile"].name for p in report.predicted]))
        from libra_jax.model import profile_to_dict
        print("PROFILE_DOCS", json.dumps([profile_to_dict(p["profile"]) for p in report.predicted]))
        explained = libra_jax.explain(step, *grad_inputs(mesh), file=None).report
        print("EXPLAIN_DOCS", json.dumps([profile_to_dict(p["profile"])
                                          for p in explained.predicted]))
        print("RESULT", json.dumps([np.asarray(g.addressable_data(0)).tolist() for g in grads]))
    print("WARNINGS", json.dumps([str(w.message) for w in caught if "profile" in str(w.message)]))
    jax.distributed.shutdown()
""")

# args: output directory, steps
EXAMPLE_WORKER = PRELUDE + textwrap.dedent("""
    sys.path.insert(0, os.environ["EXAMPLES_DIR"])
    import common
    step, state_and_batch = common.load_example("mlp").build(True)
    f = jax.jit(libra_jax.optimize(step), donate_argnums=0)
    state, batch = state_and_batch[0], state_and_batch[1:]
    losses = []
    for _ in range(int(args[1])):
        state, loss = f(state, *batch)
        losses.append(float(loss))
    print("LOSSES", json.dumps(losses))
    np.savez(os.path.join(args[0], f"state{pid}.npz"),
             *[np.asarray(leaf.addressable_data(0)) for leaf in jax.tree.leaves(state)])
    jax.distributed.shutdown()
""")

# args: when the victim (the last process) kills itself: "before_first_step" (the others then
# wait in libra_jax's plan agreement) or "mid_training" (in an all-reduce).
KILL_WORKER = PRELUDE + GRAD_STEP + textwrap.dedent("""
    import signal
    mesh = jax.make_mesh((8,), ("x",))
    step = jax.jit(grad_step(mesh, None))
    inputs = grad_inputs(mesh)
    victim = pid == nproc - 1
    if args[0] == "mid_training":
        jax.block_until_ready(step(*inputs))
        print("STEP 1 DONE", flush=True)
    if victim:
        os.kill(os.getpid(), signal.SIGKILL)
    for i in range(3):
        jax.block_until_ready(step(*inputs))
        print("STEP DONE", flush=True)
    print("SURVIVED", flush=True)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Finished:
    returncode: int | None  # None: still running at the deadline (then killed)
    out: str
    err: str
    seconds: float          # from the start until it was seen to end


def run_processes(script: str, args_per_process: list[list[str]], *, devices: int = 4,
                  env: dict[str, str] | None = None,
                  env_per_process: list[dict[str, str]] | None = None,
                  timeout: float = 120.0, check: bool = True) -> list[Finished]:
    """Run `script` as len(args_per_process) processes of one jax.distributed job on localhost,
    each with `devices` host devices; output goes to files (no pipe can fill and stall a
    process). Anything still running at `timeout` is killed. With `check`, every process must
    exit 0."""
    port = str(free_port())
    n = len(args_per_process)
    base = {**os.environ, "XLA_FLAGS": xla_flags(None), "LIBRA_JAX_TIMEOUT_S": "60",
            "EXAMPLES_DIR": str(EXAMPLES), **(env or {})}
    logs = Path(tempfile.mkdtemp(prefix="libra_mp_"))
    procs, files = [], []
    start = time.monotonic()
    try:
        for pid, extra in enumerate(args_per_process):
            out, err = open(logs / f"{pid}.out", "w+"), open(logs / f"{pid}.err", "w+")
            files.append((out, err))
            procs.append(subprocess.Popen(
                [sys.executable, "-c", script, str(pid), port, str(n), str(devices), *extra],
                env={**base, **(env_per_process[pid] if env_per_process else {})},
                stdout=out, stderr=err, text=True))
        ended: dict[int, float] = {}
        while len(ended) < n and time.monotonic() - start < timeout:
            for pid, proc in enumerate(procs):
                if pid not in ended and proc.poll() is not None:
                    ended[pid] = time.monotonic() - start
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for pid, (proc, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0), err.seek(0)
        results.append(Finished(proc.returncode if pid in ended else None, out.read(), err.read(),
                                ended.get(pid, timeout)))
        out.close(), err.close()
    shutil.rmtree(logs, ignore_errors=True)
    if check:
        for pid, r in enumerate(results):
            assert r.returncode == 0, f"process {pid}: rc={r.returncode}\n{r.out}\n{r.err[-3000:]}"
    return results


def field(out: str, name: str):
    """The JSON after `name` on its line of a worker's output."""
    for line in out.splitlines():
        if line.startswith(name + " "):
            return json.loads(line[len(name) + 1:])
    raise AssertionError(f"no {name} line in:\n{out}")


def reference_grads(profile):
    """The gradient step in this (single) process, on the conftest's 8 host devices."""
    import jax
    import jax.numpy as jnp  # noqa: F401  (used by GRAD_STEP)
    from jax.sharding import PartitionSpec as P  # noqa: F401

    import libra_jax

    ns = {"jax": jax, "jnp": jnp, "np": np, "P": P, "libra_jax": libra_jax}
    exec(GRAD_STEP, ns)
    mesh = jax.make_mesh((8,), ("x",))
    step = ns["grad_step"](mesh, profile)
    grads = step(*ns["grad_inputs"](mesh))
    return [np.asarray(g) for g in grads], step.last_report.plan_lines()


pytestmark = pytest.mark.usefixtures("jax_8")


def test_psum_across_two_processes_falls_back_to_xla():
    for r in run_processes(PSUM_WORKER, [[], []]):
        assert "RESULT [84.0, 92.0, 100.0] True" in r.out, r.out
        # Each device's 8 rows summed over the 8 devices, scattered then gathered back.
        want = np.arange(192, dtype=np.float32).reshape(8, 8, 3).sum(0)[:, 0].tolist()
        assert (f"SHARDED {want} ['no Libra all-gather', 'no Libra reduce-scatter']"
                in r.out), r.out


def test_plans_agree_across_processes():
    want, plan = reference_grads("cpu-host")
    for r in run_processes(GRAD_WORKER, [["cpu-host"], ["cpu-host"]]):
        assert field(r.out, "PLAN") == plan
        assert field(r.out, "WARNINGS") == []


def test_four_processes_two_devices_each_match_one_process():
    """4 processes x 2 devices: the gradients equal the single-process run (whose psums run on
    libra_jax's engine; across processes they run on gloo, summed in another order), are
    identical on every process, and every process planned as the single process did."""
    want, plan = reference_grads(None)
    runs = run_processes(GRAD_WORKER, [["-"]] * 4, devices=2)
    results = [field(r.out, "RESULT") for r in runs]
    for r, got in zip(runs, results):
        assert field(r.out, "PLAN") == plan
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=1e-5, atol=1e-5)
        assert got == results[0]  # bitwise the same on every process


def test_plan_mismatch_is_a_clear_error():
    """With the profile broadcast off, processes that plan with different profiles fail with
    an error naming the differing all-reduces."""
    runs = run_processes(GRAD_WORKER, [["cpu-host"], ["h100"]],
                         env={"LIBRA_JAX_NO_PROFILE_BROADCAST": "1"})
    for r in runs:
        assert "ERROR" in r.out and "planned this step differently" in r.out, r.out
        assert "blocks=" in r.out


@pytest.mark.parametrize("how", ["explicit", "object", "calibrated"])
def test_profile_broadcast_plans_with_process_0s_profile(how, tmp_path):
    """Process 1 asks for another profile, explicitly or by having calibrated differently
    (its default profile is another file), or process 0 passes a `model.Profile` object: both
    plan with process 0's, and process 1 says so."""
    from libra_jax import model

    cpu_host, plan = reference_grads("cpu-host")
    _, h100_plan = reference_grads("h100")
    assert h100_plan != plan  # else agreement would prove nothing
    if how == "explicit":
        args = [["cpu-host"], ["h100"]]
    elif how == "object":
        args = [["object:cpu-host"], ["h100"]]
    else:
        other = tmp_path / "process1"
        other.mkdir()
        shutil.copy(model.PROFILE_DIR / "h100.json", other / "cpu.json")
        args = [["-", str(tmp_path / "process0")], ["-", str(other)]]
    runs = run_processes(GRAD_WORKER, args)
    for pid, r in enumerate(runs):
        assert field(r.out, "PLAN") == plan
        assert set(field(r.out, "PROFILE")) == {model.load_profile("cpu-host").name}
        warned = field(r.out, "WARNINGS")
        if pid == 0:
            assert warned == []
        else:
            assert len(warned) == 1 and "differs from process 0's" in warned[0], warned
        for g, w in zip(field(r.out, "RESULT"), cpu_host):
            np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=1e-5, atol=1e-5)


def test_with_the_probe_on_every_process_plans_with_process_0s_probe(tmp_path):
    """With the machine probe on, process 0 probes its own devices (alone: a collective over
    them does not wait for process 1) and caches it; process 1 does not probe, and plans with
    process 0's probe-rescaled profile, broadcast, without being told its own (shipped) default
    differs; `explain` after the step plans with it too. Their plans agree."""
    from libra_jax import model

    dirs = [tmp_path / f"process{pid}" for pid in (0, 1)]
    runs = run_processes(GRAD_WORKER, [["-", str(d)] for d in dirs],
                         env={"LIBRA_JAX_PROFILE_PROBE": "1"})
    cached = json.loads((dirs[0] / "cpu.probe.json").read_text())
    assert not (dirs[1] / "cpu.probe.json").exists()
    assert cached["calibration"]["probe"]["key"]["devices"] == 4  # process 0's own devices
    probed = model.profile_from_dict(cached)
    assert probed != model.load_profile("cpu-host")
    plans = [field(r.out, "PLAN") for r in runs]
    assert plans[0] == plans[1]
    for r in runs:
        for line in ("PROFILE_DOCS", "EXPLAIN_DOCS"):  # the step, and `explain` after it
            docs = field(r.out, line)
            assert docs and all(model.profile_from_dict(d) == probed for d in docs), line
        assert field(r.out, "WARNINGS") == []


def test_with_the_broadcast_off_no_process_probes(tmp_path):
    """``LIBRA_JAX_NO_PROFILE_BROADCAST=1`` on every process: no process probes (each would
    plan with its own probe, and their plans would differ); each plans with the shipped profile,
    the single process's plan, caches nothing, and is told nothing."""
    _, plan = reference_grads("cpu-host")
    dirs = [tmp_path / f"process{pid}" for pid in (0, 1)]
    runs = run_processes(GRAD_WORKER, [["-", str(d)] for d in dirs],
                         env={"LIBRA_JAX_PROFILE_PROBE": "1", "LIBRA_JAX_NO_PROFILE_BROADCAST": "1"})
    for r, folder in zip(runs, dirs):
        assert field(r.out, "PLAN") == plan
        assert field(r.out, "WARNINGS") == []
        assert not (folder / "cpu.probe.json").exists()


def test_profile_broadcast_timeout_is_a_clear_error():
    """Process 0 does not publish its profile (broadcast off there only): process 1 gives up
    after LIBRA_JAX_TIMEOUT_S with a RuntimeError that says what it waited for; nobody hangs."""
    runs = run_processes(GRAD_WORKER, [["cpu-host"], ["cpu-host"]], timeout=60,
                         env={"LIBRA_JAX_TIMEOUT_S": "3"},
                         env_per_process=[{"LIBRA_JAX_NO_PROFILE_BROADCAST": "1"}, {}])
    assert "ERROR RuntimeError" in runs[1].out and "for process 0's profile" in runs[1].out, \
        runs[1].out
    assert "ERROR" in runs[0].out  # its plan agreement timed out: process 1 published no plan


def test_example_mlp_trains_across_two_processes_as_in_one(tmp_path):
    """examples/mlp.py's optimized step (small) on 2 processes x 4 devices: losses and final
    state match the single-process run, and are identical on both processes."""
    import jax

    import libra_jax

    sys.path.insert(0, str(EXAMPLES))
    import common

    steps = 3
    runs = run_processes(EXAMPLE_WORKER, [[str(tmp_path), str(steps)]] * 2)
    step, args = common.load_example(EXAMPLES / "mlp.py").build(True)
    f = jax.jit(libra_jax.optimize(step), donate_argnums=0)
    state, batch, losses = args[0], args[1:], []
    for _ in range(steps):
        state, loss = f(state, *batch)
        losses.append(float(loss))
    want = [np.asarray(leaf) for leaf in jax.tree.leaves(state)]
    for r in runs:
        np.testing.assert_allclose(field(r.out, "LOSSES"), losses, rtol=1e-5)
    assert field(runs[0].out, "LOSSES") == field(runs[1].out, "LOSSES")
    states = [np.load(tmp_path / f"state{pid}.npz") for pid in range(2)]
    for i, w in enumerate(want):
        a, b = states[0][f"arr_{i}"], states[1][f"arr_{i}"]
        assert a.tobytes() == b.tobytes()
        # Adam divides by sqrt(second moment): an ulp of gradient can move a parameter by
        # about lr * (a few ulps), hence the absolute tolerance.
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("when", ["before_first_step", "mid_training"])
def test_killed_process_makes_the_others_stop(when):
    """The last process SIGKILLs itself; the survivor ends with an error within the test's
    deadline: JAX's coordination service sees the missing heartbeats
    (heartbeat_timeout_seconds=10) and terminates it, or its all-reduce fails first.
    LIBRA_JAX_TIMEOUT_S is long, so it is not libra_jax's own timeout that ends the wait."""
    deadline = 90.0
    runs = run_processes(KILL_WORKER, [[when], [when]], check=False, timeout=deadline,
                         env={"HEARTBEAT_S": "10", "LIBRA_JAX_TIMEOUT_S": "600"})
    victim, survivor = runs[1], runs[0]
    assert victim.returncode == -9, victim
    assert survivor.returncode is not None, \
        f"the survivor hung for {deadline} s:\n{survivor.err[-3000:]}"
    assert survivor.returncode != 0 and "SURVIVED" not in survivor.out
    assert survivor.seconds < deadline
    if when == "mid_training":
        assert "STEP 1 DONE" in survivor.out
    stopped_by = ("JAX distributed service detected fatal errors", "heartbeat", "Gloo",
                  "Traceback")
    assert any(s in survivor.err for s in stopped_by), survivor.err[-3000:]
