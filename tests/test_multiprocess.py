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


def test_psum_across_two_processes_falls_back_to_xla():
    port = str(free_port())
    env = {**os.environ, "XLA_FLAGS": ""}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(pid), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in range(2)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        assert proc.returncode == 0, err[-3000:]
        outs.append(out)
    for out in outs:
        assert "RESULT [84.0, 92.0, 100.0] True" in out, out
