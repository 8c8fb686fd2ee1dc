"""A failed execution leaves the process usable (issue 68; docs/architecture.md, "Failed
calls"): a CPU start joins its round and the engine writes the device's buffers later, so an
execution that fails between a start and its done must not end (and have XLA free those
buffers) while a worker may still write them.

Each test runs, in a subprocess of 8 host devices with ``LIBRA_JAX_TIMEOUT_S=5`` and glibc's
heap checks (``MALLOC_CHECK_=3 MALLOC_PERTURB_=165``: a freed block is overwritten, a corrupt
heap aborts), 10 times: a program that fails *with a round in flight* (the failing rank has
started, the others start later, so the round runs after the failure), then 20 healthy
optimized steps (``optimize(overlap="start-done")``) checked against plain JAX. On the code
before the fix, every run of both programs crashed (10 of 10 each: SIGSEGV, once SIGABRT
"malloc(): unsorted double linked list corrupted"; under ASan, heap-use-after-free in the
engine's reduce). CI also runs this file with the extension built with ASan (.ci/run).

The failing programs bind the start/done primitives by hand (as tests/test_overlap.py's
abandoned starts do), so that the order of start, failure and done is fixed by data."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from libra_jax.config import xla_flags

ROUNDS = 10
HEALTHY_STEPS = 20

# The failing program's prelude: a start over a large buffer (1M f32 per device, a temporary of
# the execution: a buffer glibc maps on its own, so a write after its free faults), with a
# callback before it that holds every rank but FAILING back until FAILING has failed (its
# callback opens the gate 50 ms after it raises) or GATE_S has passed: without the fix the
# round runs (and writes FAILING's buffer) after that execution has ended.
PRELUDE = """
import os, sys, threading, time
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import PartitionSpec as P
import libra_jax
from libra_jax import ops
from libra_jax.ops.start_done import TOKEN_AVAL, register_pair
sys.path.insert(0, {tests!r})
from conftest import mlp_step

mesh = jax.make_mesh((8,), ("x",))
FAILING, N = 3, 1 << 20
aval = jax.core.ShapedArray((1, N), np.float32)
flag = jax.ShapeDtypeStruct((1,), np.int32)
state = {{"fail": False, "gate": threading.Event()}}

def hold(i):
    # Before the start: the other ranks wait for the failing one (at most GATE_S).
    if state["fail"] and int(i) != FAILING:
        state["gate"].wait(GATE_S)
    return np.zeros((1,), np.int32)

def start(a):
    # The start's buffer is a temporary of the execution (a + 0), after `hold` by data.
    i = jax.lax.axis_index("x")
    f = jax.pure_callback(hold, flag, i)
    a = a + f.astype(a.dtype)
    buf, token = ops.libra_start_p.bind(a, collective="psum", axes=("x",), blocks=4,
                                        invariant=False, call_id=START_ID)
    return i, f, buf, token

def done(buf, *tokens, call_id):
    out, = ops.libra_done_p.bind(buf, *tokens, collective="psum", out_avals=(aval,),
                                 axes=("x",), blocks=4, call_id=call_id)
    return out
"""

# The healthy steps and the loop: ROUNDS times the failing program (it must raise), then
# HEALTHY_STEPS optimized steps of the MLP, each checked against the plain step's result.
LOOP = """
program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                check_vma=False))
x = jax.device_put(np.ones((8, N), np.float32), jax.NamedSharding(mesh, P("x")))
step, (params, batch) = mlp_step()
plain = jax.jit(step)
fast = jax.jit(libra_jax.optimize(step, overlap="start-done"))
assert "libra_allreduce_cpu_start" in fast.lower(params, batch).compile().as_text()
t0 = time.time()
for k in range({rounds}):
    state["fail"] = True
    state["gate"].clear()
    try:
        jax.block_until_ready(program(x))
        print("NO ERROR")
    except Exception as e:
        said = [m for m in ("between its start and its done", "without its start") if m in str(e)]
        print("FAILED", type(e).__name__, said, flush=True)
    state["fail"] = False
    time.sleep(0.1)  # the failing rank's gate timer has fired: the next round starts closed
    p = params
    for _ in range({steps}):
        want_loss, want = plain(p, batch)
        got_loss, got = fast(p, batch)
        np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-6)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
        p = want
    print("HEALTHY", k, flush=True)
print("ELAPSED", round(time.time() - t0, 1))
print("OK")
"""

# (a) A callback raises on the failing rank between its start and its done: it reads start's
# token (so it runs after the start: XLA:CPU ran an independent callback before the start) and
# done reads its result. The other ranks start only when it has raised (or GATE_S later), so
# without the fix the round runs while the failing execution ends.
CALLBACK = """
START_ID, GATE_S = 41, 0.5

def fail_between(i, token):
    if state["fail"] and int(i) == FAILING:
        threading.Timer(0.05, state["gate"].set).start()
        raise RuntimeError("the failing rank's callback raises between its start and its done")
    return np.zeros((1,), np.int32)

def body(a):
    i, f, buf, token = start(a)
    t = jax.pure_callback(fail_between, flag, i, token)
    return done(buf, token, t, call_id=START_ID).sum(keepdims=True)  # start's buffer: a temp
"""

# (b) A done without its start: the start is call 52, its done is bound as call 53 (the start
# is registered as paired by hand, as `optimize` would), so every rank's done fails at once
# ("done of call 53 without its start") while call 52's round is in flight: the failing rank
# has started, the others start after (when its done has failed, or 0.5 s later).
UNPAIRED = """
START_ID, GATE_S = 52, 0.5
register_pair("psum", START_ID)

def mark(i, token):
    if state["fail"] and int(i) == FAILING:
        threading.Timer(0.05, state["gate"].set).start()
    return token

def body(a):
    i, f, buf, token = start(a)
    token = jax.pure_callback(mark, TOKEN_AVAL, i, token)  # after the start, by data
    return done(buf, token, call_id=START_ID + 1).sum(keepdims=True)
"""


def run_failing_then_healthy(program: str, **env: str) -> str:
    tests = os.path.dirname(os.path.abspath(__file__))
    script = (textwrap.dedent(PRELUDE).format(tests=tests) + textwrap.dedent(program)
              + textwrap.dedent(LOOP).format(rounds=ROUNDS, steps=HEALTHY_STEPS))
    env = {**os.environ, "XLA_FLAGS": xla_flags(None), "LIBRA_JAX_TIMEOUT_S": "5",
           "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165", **env}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)
    out = proc.stdout
    assert proc.returncode == 0, (f"rc {proc.returncode}\n" + out[-3000:] + proc.stderr[-4000:])
    assert "OK" in out.splitlines(), out + proc.stderr[-3000:]
    return out


def test_callback_raising_between_start_and_done_leaves_the_process_usable():
    out = run_failing_then_healthy(CALLBACK)
    failures = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failures) == ROUNDS, out
    assert all("'between its start and its done'" in line for line in failures), out
    assert out.count("HEALTHY") == ROUNDS, out


@pytest.mark.parametrize("start_returns", ["0", "1"], ids=["start-waits", "start-returns"])
def test_done_without_its_start_leaves_the_process_usable(start_returns):
    """With the default (a start's future pends until its round ends, so done runs after it)
    and with LIBRA_JAX_CPU_START_RETURNS=1 (start returns at once: the done fails while the
    round is in flight, and its error waits for the run's started rounds to end)."""
    out = run_failing_then_healthy(UNPAIRED, LIBRA_JAX_CPU_START_RETURNS=start_returns)
    failures = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failures) == ROUNDS, out
    assert all("'without its start'" in line for line in failures), out
    assert out.count("HEALTHY") == ROUNDS, out
