"""libra_jax.psum across processes (jax.distributed on localhost, CPU): the engine serves the
devices of one process only, so a psum spanning processes falls back to XLA's collectives
(gloo) with a notice, and never waits for ranks that cannot arrive."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import sys, warnings
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    import libra_jax
    mesh = jax.make_mesh((8,), ("x",))
    data = np.arange(24, dtype=np.float32).reshape(8, 3)
    x = jax.make_array_from_callback((8, 3), jax.NamedSharding(mesh, P("x")), lambda i: data[i])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = jax.jit(jax.shard_map(lambda v: libra_jax.psum(v, "x"), mesh=mesh,
                                  in_specs=P("x"), out_specs=P()))
        out = np.asarray(f(x).addressable_data(0)).ravel().tolist()
    print("RESULT", out, any("several processes" in str(w.message) for w in caught))
    jax.distributed.shutdown()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(script: str, args_per_process: list[list[str]]) -> list[str]:
    port = str(free_port())
    env = {**os.environ, "XLA_FLAGS": "", "LIBRA_JAX_TIMEOUT_S": "60"}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(pid), port, *extra], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid, extra in enumerate(args_per_process)]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_psum_across_two_processes_falls_back_to_xla():
    for out in run_pair(WORKER, [[], []]):
        assert "RESULT [84.0, 92.0, 100.0] True" in out, out

AGREEMENT_WORKER = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    pid, port, profile = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    import libra_jax
    mesh = jax.make_mesh((8,), ("x",))
    def body(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        return jax.lax.psum(g, "x")
    f = jax.jit(libra_jax.optimize(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(), check_vma=False),
        profile=profile))
    w = np.ones((16, 16), np.float32)
    data = np.arange(8 * 16 * 16, dtype=np.float32).reshape(8 * 16, 16) / 1e3
    x = jax.make_array_from_callback(data.shape, jax.NamedSharding(mesh, P("x")), lambda i: data[i])
    try:
        f.lower(w, x)
        print("AGREED")
    except RuntimeError as e:
        print("MISMATCH", str(e).replace("\\n", " | "))
    jax.distributed.shutdown()
""")


def test_plans_agree_across_processes():
    outs = run_pair(AGREEMENT_WORKER, [["cpu-host"], ["cpu-host"]])
    assert all("AGREED" in out for out in outs), outs


def test_plan_mismatch_is_a_clear_error():
    outs = run_pair(AGREEMENT_WORKER, [["cpu-host"], ["h100"]])
    for out in outs:
        assert "MISMATCH" in out and "planned this step differently" in out, out
        assert "blocks=" in out
