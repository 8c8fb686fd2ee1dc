"""NCCL's control path (cpp/libra/nccl.h, libra_jax/_nccl.py) against a stub
NCCL in host memory (cpp/tests/nccl_stub.cc, built here): library loading and
its errors, the version switch between per-collective and per-communicator CTA
limits, the communicator cache, unique ids through JAX's key-value store, and
the cuda lowering of a psum that spans processes. NCCL itself cannot run here
(no GPU, and NCCL refuses two ranks on one GPU); the real 2-GPU test at the
bottom skips without two GPUs.

Each scenario runs in a fresh Python process: a process opens NCCL once."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from libra_jax.config import xla_flags

from test_multiprocess import GRAD_WORKER, free_port, run_processes

ROOT = Path(__file__).resolve().parents[1]
INT_MIN = -2**31


@pytest.fixture(scope="session")
def stub_library(tmp_path_factory) -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the NCCL stub")
    out = tmp_path_factory.mktemp("nccl_stub") / "libnccl_stub.so"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(out),
                    str(ROOT / "cpp/tests/nccl_stub.cc")], check=True)
    return out


@pytest.fixture
def stub_env(stub_library, tmp_path) -> dict:
    """Environment of a process that uses the stub; its log at env['NCCL_STUB_LOG']."""
    return {**os.environ, "XLA_FLAGS": xla_flags(None), "LIBRA_JAX_NCCL_LIBRARY": str(stub_library),
            "NCCL_STUB_DIR": str(tmp_path), "NCCL_STUB_LOG": str(tmp_path / "stub.log"),
            "NCCL_STUB_TIMEOUT_S": "30", "NCCL_STUB_VERSION": "23100"}


def run(script: str, env: dict, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def log_lines(env: dict, kind: str) -> list[dict]:
    """The stub's log lines of one kind ("init", "split" or "allreduce"), as dicts."""
    out = []
    for line in Path(env["NCCL_STUB_LOG"]).read_text().splitlines():
        word, *fields = line.split()
        if word == kind:
            out.append({k: (v if k in ("id", "parent") else int(v))
                        for k, v in (f.split("=", 1) for f in fields)})
    return out


def two_ranks(per_call: str, report: str, prelude: str = "") -> str:
    """A script: two ranks as two threads of one process; for blocks 2, 4 and 2 each takes the
    group's communicator (`comm`) and runs `per_call` (it sees `r`, `blocks`, `comm`, and
    appends what it got to `outs`); then `report` runs (it sees `results[r]`, rank r's `outs`).
    `prelude` runs first."""
    def block(code: str, indent: str) -> str:
        return textwrap.indent(textwrap.dedent(code).strip("\n"), indent)
    return "\n".join([
        "import threading, sys",
        "import numpy as np",
        "from libra_jax import _nccl",
        block(prelude, ""),
        "results = {}",
        "def rank(r):",
        "    outs = []",
        "    for blocks in (2, 4, 2):",
        "        comm = _nccl.communicator([0, 1], blocks=blocks, holds_root=True, timeout_s=5)",
        block(per_call, "        "),
        "    results[r] = outs",
        "threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]",
        "[t.start() for t in threads]; [t.join() for t in threads]",
        block(report, ""),
    ])


# Two ranks as two threads of one process, three all-reduces with blocks 2, 4, 2.
THREADED = two_ranks(
    prelude="""
        lib = _nccl.library()
        print("ROUTE", lib.route, lib.version)
    """,
    per_call="""
        a = np.arange(6, dtype=np.float32) * (r + 1) + blocks
        _nccl.allreduce_host(comm, 2, r, blocks, a)
        outs.append(a.tolist())
    """,
    report="""
        print("RESULTS", results[0] == results[1], results[0][1])
        print("COMMUNICATORS", _nccl.communicators_created())
    """)


# The version matrix: what reaches NCCL for blocks 2, 4, 2 on two ranks. The stub keeps NCCL's
# rules (cpp/tests/nccl_stub.cc): CTA fields read from a config of version >= 21700 by a library
# >= 2.17 only, a collective on at most its communicator's channels (2 by default, as on a PCIe
# machine), ncclAllReduceConfig from 2.31 only. So `ctas` (what ran) == `asked` only when libra
# configures NCCL right. Before the fix: the config said version 21400, so 2.17-2.30 ran every
# call on 2 CTAs (defect 1); 2.31's communicators had no CTA range, so a call asking 4 ran on 2
# (defect 3).
@pytest.mark.parametrize("version, name, route", [
    (21400, "2.14.0", "none"),
    (21700, "2.17.0", "per-communicator"), (21800, "2.18.0", "per-communicator"),
    (22400, "2.24.0", "per-communicator"),
    (22500, "2.25.0", "per-communicator"), (22600, "2.26.0", "per-communicator"),
    (23000, "2.30.0", "per-communicator"),
    (23100, "2.31.0", "per-collective"),
])
def test_what_reaches_nccl_by_version(stub_env, version, name, route):
    stub_env["NCCL_STUB_VERSION"] = str(version)
    out = run(THREADED, stub_env)
    assert f"ROUTE {route} {name}" in out, out
    # rank 0: arange*1+4, rank 1: arange*2+4 -> arange*3 + 8, whatever reaches NCCL
    assert "RESULTS True [8.0, 11.0, 14.0, 17.0, 20.0, 23.0]" in out
    inits, calls = log_lines(stub_env, "init"), log_lines(stub_env, "allreduce")
    if route == "none":  # the block count cannot be honoured: one communicator, no limits
        assert "COMMUNICATORS 2" in out
        assert all(i["minCTAs"] == i["maxCTAs"] == INT_MIN for i in inits)
        assert all(c["asked"] == 0 and c["config"] == 0 for c in calls)
        return
    assert sorted(c["ctas"] for c in calls) == [2, 2, 2, 2, 4, 4]  # every call ran as asked
    if route == "per-communicator":  # one communicator per (group, block count)
        assert all(c["config"] == 0 for c in calls)  # plain ncclAllReduce
        by_id = {}
        for c in calls:
            by_id.setdefault(c["id"], set()).add(c["ctas"])
        assert sorted(map(tuple, by_id.values())) == [(2,), (4,)]  # a communicator per count
        splits = log_lines(stub_env, "split")
        if version < 21800:  # 2.17: each its own communicator (and unique id, and buffers)
            assert "COMMUNICATORS 4" in out  # 2 ranks x {2, 4} blocks; the second 2 reuses
            assert sorted((i["minCTAs"], i["maxCTAs"]) for i in inits) == [(2, 2), (2, 2),
                                                                           (4, 4), (4, 4)]
            assert not splits and sum(i["mem"] for i in inits) == 2 * (2 + 4)
        else:  # 2.18+: the first count's communicator, the other split from it, shared
            assert "COMMUNICATORS 4" in out
            assert sorted((i["minCTAs"], i["maxCTAs"]) for i in inits) == [(2, 2), (2, 2)]
            assert [(p["minCTAs"], p["channels"], p["share"]) for p in splits] == [(4, 4, 1)] * 2
            # Memory: channels with buffers per rank = the largest count (4), not 2 + 4.
            assert sum(i["mem"] for i in inits) + sum(p["mem"] for p in splits) == 2 * 4
    else:  # one communicator per group, made with the channels of every per-call limit
        assert "COMMUNICATORS 2" in out
        assert [(i["minCTAs"], i["maxCTAs"], i["channels"]) for i in inits] == [(32, 32, 32)] * 2
        assert sorted(c["asked"] for c in calls) == [2, 2, 2, 2, 4, 4]
        assert all(c["config"] == 1 for c in calls)  # ncclAllReduceConfig
        assert len({c["id"] for c in calls}) == 1


# The sharded pair on NCCL: two ranks as threads, a reduce-scatter and an all-gather per block
# count (2, 4, 2), out of place and in place (NCCL's rule: a reduce-scatter's output at input +
# rank x recvcount, an all-gather's input at output + rank x sendcount, as views of one buffer).
THREADED_SHARDED = two_ranks(
    per_call="""
        full = np.arange(8, dtype=np.float32) * (r + 1) + blocks
        mine = np.empty(4, np.float32)
        _nccl.collective_host("reduce-scatter", comm, 2, r, blocks, full, mine)
        in_place = full.copy()
        _nccl.collective_host("reduce-scatter", comm, 2, r, blocks, in_place,
                              in_place[4 * r:4 * r + 4])
        gathered = np.empty(8, np.float32)
        _nccl.collective_host("all-gather", comm, 2, r, blocks, mine, gathered)
        buffer = np.zeros(8, np.float32)
        buffer[4 * r:4 * r + 4] = mine
        _nccl.collective_host("all-gather", comm, 2, r, blocks, buffer[4 * r:4 * r + 4], buffer)
        outs.append((mine.tolist(), in_place[4 * r:4 * r + 4].tolist(), gathered.tolist(),
                     buffer.tolist()))
    """,
    report="""
        print("SCATTERED", results[0][1][0], results[1][1][0])
        print("IN_PLACE_SAME", all(o[0] == o[1] for r in results for o in results[r]))
        print("GATHERED",
              results[0][1][2] == results[1][1][2] == results[0][1][3] == results[1][1][3],
              results[0][1][2])
    """)


@pytest.mark.parametrize("version, route", [(21400, "none"), (21700, "per-communicator"),
                                            (22700, "per-communicator"),
                                            (23100, "per-collective")])
def test_reduce_scatter_and_all_gather_reach_nccl_by_version(stub_env, version, route):
    """ncclReduceScatter and ncclAllGather take the block count by the all-reduce's routes: the
    per-call config from 2.31 (ncclReduceScatterConfig / ncclAllGatherConfig), a communicator
    per block count on 2.17-2.30, none below; in place as NCCL places it."""
    stub_env["NCCL_STUB_VERSION"] = str(version)
    out = run(THREADED_SHARDED, stub_env)
    # blocks 4: rank 0 arange*1+4, rank 1 arange*2+4 -> arange*3 + 8; rank r keeps half r.
    assert "SCATTERED [8.0, 11.0, 14.0, 17.0] [20.0, 23.0, 26.0, 29.0]" in out, out
    assert "IN_PLACE_SAME True" in out
    assert "GATHERED True [8.0, 11.0, 14.0, 17.0, 20.0, 23.0, 26.0, 29.0]" in out
    for kind in ("reducescatter", "allgather"):
        calls = log_lines(stub_env, kind)
        assert len(calls) == 12 and sorted(c["count"] for c in calls) == [4] * 12, calls
        assert sorted(c["inplace"] for c in calls) == [0] * 6 + [1] * 6
        if route == "none":
            assert all(c["asked"] == 0 and c["config"] == 0 for c in calls)
            continue
        assert sorted(c["ctas"] for c in calls) == [2] * 8 + [4] * 4  # every call as asked
        assert all(c["config"] == (route == "per-collective") for c in calls)


# The all-to-all on NCCL: two ranks as threads, one exchange per block count (2, 4, 2) of 8
# elements, 4 to each peer (NCCL's count, from the buffers by the kind's row: the FFI target
# libra_all_to_all_nccl sizes its calls so too), through the extension's host entry point.
THREADED_ALL_TO_ALL = two_ranks(
    prelude="""
        from libra_jax import _libra_ffi
    """,
    per_call="""
        sent = np.arange(8, dtype=np.float32) + 100 * r + blocks
        got = np.full(8, -1, np.float32)
        _libra_ffi.nccl_collective_host("all-to-all", comm, 2, r, blocks, sent, got,
                                        timeout_ms=10000)
        outs.append(got.tolist())
    """,
    report="""
        print("EXCHANGED", results[0][1], results[1][1])
    """)


@pytest.mark.parametrize("version, route", [(22400, "sends"), (22700, "sends"),
                                            (22800, "ncclAlltoAll"),
                                            (23100, "ncclAlltoAllConfig")])
def test_all_to_all_reaches_nccl_by_version(stub_env, version, route):
    """ncclAlltoAll from 2.28 (with its per-call config from 2.31), else one group of
    ncclSend/ncclRecv with every rank on the communicator pinned to the call's block count
    (2.18-2.27: the group's, or its split); 4 elements to and from each peer either way."""
    stub_env["NCCL_STUB_VERSION"] = str(version)
    out = run(THREADED_ALL_TO_ALL, stub_env)
    # blocks 4: rank d's block s is rank s's block d (rank s sent arange + 100 s + 4).
    assert ("EXCHANGED [4.0, 5.0, 6.0, 7.0, 104.0, 105.0, 106.0, 107.0] "
            "[8.0, 9.0, 10.0, 11.0, 108.0, 109.0, 110.0, 111.0]") in out, out
    direct, sends = log_lines(stub_env, "alltoall"), log_lines(stub_env, "send")
    if route == "sends":
        recvs = log_lines(stub_env, "recv")
        assert not direct and len(sends) == len(recvs) == 12  # 3 calls x 2 ranks x 2 peers
        assert all(c["count"] == 4 and c["dtype"] == 7 for c in sends + recvs)
        # Each call's sends on the communicator pinned to its block count (2, 4, 2).
        pinned = {c["id"]: c["minCTAs"]
                  for c in log_lines(stub_env, "init") + log_lines(stub_env, "split")}
        for rank in (0, 1):
            assert [pinned[c["id"]] for c in sends if c["rank"] == rank] == [2, 2, 4, 4, 2, 2]
        return
    assert not sends and len(direct) == 6 and all(c["count"] == 4 for c in direct), direct
    assert sorted(c["ctas"] for c in direct) == [2, 2, 2, 2, 4, 4]  # every call as asked
    assert all(c["config"] == (route == "ncclAlltoAllConfig") and c["inplace"] == 0
               for c in direct)


def test_nccl_overlapping_buffers_outside_the_in_place_rule_are_refused(stub_env):
    out = run("""
        import numpy as np
        from libra_jax import _nccl
        comm = _nccl.communicator([0], blocks=2, holds_root=True, timeout_s=5)
        a = np.arange(8, dtype=np.float32)
        _nccl.collective_host("reduce-scatter", comm, 1, 0, 2, a, a)  # one rank: in place
        try:
            b = np.arange(8, dtype=np.float32)
            _nccl.collective_host("all-gather", comm, 1, 0, 2, b[1:5], b[:4])
        except RuntimeError as e:
            print("REFUSED", e)
        try:
            _nccl.collective_host("reduce-scatter", comm, 2, 0, 2, a[:3], a[:2])
        except ValueError as e:
            print("SIZES", e)
    """, stub_env)
    assert "REFUSED libra NCCL: ncclAllGatherConfig failed: invalid argument" in out, out
    assert "SIZES nccl_collective_host: sizes do not fit" in out, out
    assert any(line.startswith("overlap") for line in Path(stub_env["NCCL_STUB_LOG"]).read_text()
               .splitlines())


@pytest.mark.parametrize("version, most", [(22400, 32), (22500, 64), (23100, 32)])
def test_block_counts_above_what_nccl_honours_are_capped_and_said(stub_env, version, most):
    # NCCL's channel maximum is 32 up to 2.24 and 64 from 2.25; per collective (2.31) libra's
    # communicators have 32 channels. The lowering caps a larger count (said once); the C++ side
    # refuses one that gets past it, never lets NCCL clip it in silence.
    stub_env["NCCL_STUB_VERSION"] = str(version)
    out = run(f"""
        import warnings
        import numpy as np
        from libra_jax import _nccl
        from libra_jax.ops import lowering
        print("MAX", _nccl.library().max_ctas)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("CAPPED", lowering.nccl_blocks({most} + 8), lowering.nccl_blocks({most}),
                  lowering.nccl_blocks(3))
        print("SAID", len(caught), str(caught[0].message) if caught else "")
        comm = _nccl.communicator([7], blocks={most} + 8, holds_root=True, timeout_s=5)
        try:
            _nccl.allreduce_host(comm, 1, 0, {most} + 8, np.ones(4, np.float32))
        except RuntimeError as e:
            print("ERROR", e)
    """, stub_env)
    assert f"MAX {most}" in out
    assert f"CAPPED {most} {most} 3" in out
    assert "SAID 1 libra_jax: NCCL" in out and f"at most {most} CTAs per all-reduce" in out, out
    assert f"{most + 8} CTAs" in out.split("ERROR", 1)[1], out


# Defect 3's planner half: on the nccl path the planner is offered no block count above what the
# loaded NCCL honours (a larger one would run on fewer CTAs than priced), and `explain` says so.
# The profile is h100 with one more option, 64 blocks, which NCCL 2.24 (32 at most) drops.
CAPPED_PLAN = """
    import json, os, sys
    os.environ["LIBRA_JAX_CUDA"] = "nccl"
    import jax, numpy as np
    jax.config.update("jax_num_cpu_devices", 8)
    import libra_jax
    from libra_jax import model
    sys.path.insert(0, sys.argv[1])
    from conftest import mlp_step
    doc = json.loads((model.PROFILE_DIR / "h100.json").read_text())
    doc["nccl_style"]["block_options"]["value"] = [1, 2, 4, 8, 16, 32, 64]
    doc["name"] = "h100-64"
    path = os.path.join(sys.argv[2], "h100-64.json")
    open(path, "w").write(json.dumps(doc))
    print("OPTIONS", sorted(model.derive(path, 8).cost.slowdown))
    step, args = mlp_step(sizes=(1024, 4096, 4096, 8))  # large gradients: many blocks pay
    e = libra_jax.explain(step, *args, profile=path, file=None)
    print("BLOCKS", sorted({r.blocks for s in e.scopes for r in s.rows}))
    print("TABLE", str(e))
"""


@pytest.mark.parametrize("version, most", [("22400", 32), ("22500", None)])
def test_the_planner_offers_no_block_count_above_what_nccl_honours(stub_env, tmp_path, version,
                                                                    most):
    stub_env["NCCL_STUB_VERSION"] = version
    out = run(CAPPED_PLAN, stub_env, str(Path(__file__).parent), str(tmp_path))
    assert "OPTIONS [1, 2, 4, 8, 16, 32, 64]" in out, out  # the profile offers 64 ...
    blocks = eval(out.split("BLOCKS", 1)[1].splitlines()[0])
    if most is None:  # 2.25+: 64 channels, nothing capped, nothing said; the plan takes 64
        assert "block counts at most" not in out, out
        assert 64 in blocks, out
        return
    assert max(blocks) <= most, out  # ... the plan never takes it on 2.24
    assert (f"block counts at most {most}: NCCL 2.24.0 (per-communicator CTA limits) runs an "
            f"all-reduce on at most {most} CTAs") in out, out


def test_nccl_cta_settings_in_the_environment_are_said(stub_env):
    stub_env["NCCL_MAX_CTAS"] = "4"
    out = run("""
        import warnings
        from libra_jax.ops import lowering
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lowering.nccl_blocks(8), lowering.nccl_blocks(2)
        print("SAID", len(caught), caught[0].message)
    """, stub_env)
    assert "SAID 1 libra_jax: NCCL_MAX_CTAS=4 in the environment: NCCL applies it over" in out


def test_nccl_below_2_17_says_the_block_count_cannot_be_honoured(stub_env):
    stub_env["NCCL_STUB_VERSION"] = "21400"
    out = run("""
        import warnings
        from libra_jax.ops import lowering
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("BLOCKS", lowering.nccl_blocks(8), lowering.nccl_blocks(4))
        print("SAID", len(caught), caught[0].message)
    """, stub_env)
    assert "BLOCKS 8 4" in out
    assert "SAID 1 libra_jax: NCCL 2.14.0 cannot limit an all-reduce's CTAs (NCCL >= 2.17" in out


# Several communicators on one GPU (libra's, one per block count on 2.17-2.30, and XLA's own)
# need one launch order (defect 5): libra issues on one stream per GPU (the C++ test
# launch_order), asks NCCL >= 2.31 per communicator, and sets NCCL_LAUNCH_ORDER_IMPLICIT=1 when
# imported with its NCCL path chosen (NCCL reads it at its first launch, XLA's included).
LAUNCH_ORDER = """
    import os, warnings
    print("ENV", os.environ.get("NCCL_LAUNCH_ORDER_IMPLICIT"))
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    import libra_jax
    print("ENV", os.environ.get("NCCL_LAUNCH_ORDER_IMPLICIT"))
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    f = jax.jit(jax.shard_map(lambda v: libra_jax.psum(v, "x", blocks=2), mesh=mesh,
                              in_specs=P("x"), out_specs=P()))
    x = jax.ShapeDtypeStruct((2, 8), np.float32, sharding=jax.NamedSharding(mesh, P("x")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    print("CALL", "@libra_allreduce_nccl" in text)
    print("SAID", [str(w.message) for w in caught if "order" in str(w.message)])
"""


@pytest.mark.parametrize("version, preset, env, said", [
    ("22400", None, "1", "orders several communicators on one GPU by stream dependencies only"),
    ("22600", None, "1", None),          # set by libra_jax's import: nothing to say
    ("22600", "0", "0", "NCCL_LAUNCH_ORDER_IMPLICIT is not 1: NCCL 2.26.0 does not order"),
    ("23100", None, "1", None),
    ("23100", "0", "0", "NCCL_LAUNCH_ORDER_IMPLICIT is not 1: NCCL 2.31.0 does not order"),
])
def test_launch_order_is_asked_for_and_said_where_it_is_missing(stub_env, version, preset, env,
                                                                said):
    stub_env.update(NCCL_STUB_VERSION=version, LIBRA_JAX_CUDA="nccl",
                    XLA_FLAGS=xla_flags(2, xla_flags(None)))
    stub_env.pop("NCCL_LAUNCH_ORDER_IMPLICIT", None)
    if preset is not None:
        stub_env["NCCL_LAUNCH_ORDER_IMPLICIT"] = preset  # the user's value is left alone
    out = run(LAUNCH_ORDER, stub_env)
    if "CALL False" in out:
        pytest.skip("libra_jax built without CUDA: the cuda lowering is XLA's")
    assert f"ENV {preset}\nENV {env}\n" in out, out
    notices = out.split("SAID", 1)[1]
    assert (said in notices) if said else notices.strip() == "[]", out


def test_launch_order_is_left_alone_without_libra_nccl_path(stub_env):
    stub_env.pop("NCCL_LAUNCH_ORDER_IMPLICIT", None)
    for path in ("", "xla"):
        stub_env["LIBRA_JAX_CUDA"] = path
        out = run("""
            import os, libra_jax
            print("ENV", os.environ.get("NCCL_LAUNCH_ORDER_IMPLICIT"))
        """, stub_env)
        assert "ENV None" in out, out


def test_nccl_targets_make_communicators_when_xla_initialises_the_program():
    # The initialize stage runs on every device's thread before the program does: communicators
    # are made then (cpp/libra/nccl.h Communicators::Prepare), not in the middle of a program.
    from libra_jax import _ffi, _libra_ffi
    stages = {t["name"]: t["stages"] for t in _libra_ffi.registry()}
    if not _ffi.HAS_CUDA:
        pytest.skip("libra_jax built without CUDA")
    for target in (_ffi.target("all-reduce", "nccl"), _ffi.target("all-reduce", "nccl", "start")):
        assert stages[target] == ["initialize", "execute"], stages


def test_a_rank_that_never_joins_is_an_error_after_the_timeout(stub_env):
    # NCCL waits forever for a missing rank; libra's communicators are non-blocking, polled, and
    # aborted after LIBRA_JAX_TIMEOUT_S (defect 4). The stub's own timeout is far longer.
    stub_env["LIBRA_JAX_TIMEOUT_S"] = "0.5"
    stub_env["NCCL_STUB_TIMEOUT_S"] = "120"
    out = run("""
        import numpy as np
        from libra_jax import _nccl
        comm = _nccl.communicator([40, 41], blocks=2, holds_root=True, timeout_s=5)
        try:
            _nccl.allreduce_host(comm, 2, 0, 2, np.ones(4, np.float32))  # rank 1 never comes
        except RuntimeError as e:
            print("ERROR", e)
        print("COMMUNICATORS", _nccl.communicators_created())
    """, stub_env)
    assert ("ERROR libra NCCL: creating the communicator of rank 0 of 2: not every rank arrived "
            "within 500 ms (LIBRA_JAX_TIMEOUT_S); the communicator was aborted") in out, out
    assert "COMMUNICATORS 0" in out  # aborted and forgotten
    assert [line.split()[0] for line in Path(stub_env["NCCL_STUB_LOG"]).read_text().splitlines()
            ] == ["init", "abort"]
    assert log_lines(stub_env, "init")[0]["blocking"] == 0  # a non-blocking communicator


@pytest.mark.parametrize("version", ["21700", "22700"])
def test_another_block_count_on_a_pinned_communicator(stub_env, version):
    # 2.17: a communicator pinned to its CTAs refuses another count (libra_jax gives each count
    # its own communicator id); 2.18+: the other count runs on a child split from it.
    stub_env["NCCL_STUB_VERSION"] = version
    out = run("""
        import numpy as np
        from libra_jax import _nccl
        comm = _nccl.communicator([3], blocks=2, holds_root=True, timeout_s=5)
        a = np.ones(4, np.int32)
        _nccl.allreduce_host(comm, 1, 0, 2, a)
        print("ONE RANK", a.tolist())
        try:
            _nccl.allreduce_host(comm, 1, 0, 8, a)
            print("EIGHT", a.tolist(), _nccl.communicators_created())
        except RuntimeError as e:
            print("ERROR", e)
    """, stub_env)
    assert "ONE RANK [1, 1, 1, 1]" in out
    if version == "21700":
        assert ("ERROR libra NCCL: communicator 1 was created for 1 ranks and 2 CTAs, called "
                "with 1 and 8") in out, out
    else:
        assert "EIGHT [1, 1, 1, 1] 2" in out, out
        split, = log_lines(stub_env, "split")
        assert (split["minCTAs"], split["maxCTAs"], split["share"]) == (8, 8, 1)
        assert [c["ctas"] for c in log_lines(stub_env, "allreduce")] == [2, 8]


@pytest.mark.parametrize("library, message", [
    ("/nonexistent/libnccl.so.2", "cannot load /nonexistent/libnccl.so.2"),
    ("libm.so.6", "libm.so.6 has no ncclGetVersion"),
])
def test_unusable_library_is_a_clear_error_and_the_lowering_falls_back(stub_env, library,
                                                                        message):
    stub_env["LIBRA_JAX_NCCL_LIBRARY"] = library
    out = run("""
        from libra_jax import _nccl
        try:
            _nccl.library()
        except RuntimeError as e:
            print("ERROR", e)
        print("AVAILABLE", _nccl.available()[0])
    """, stub_env)
    assert f"ERROR libra NCCL: {message}" in out
    assert "AVAILABLE False" in out


@pytest.mark.parametrize("version, forced, expect", [
    ("23100", "", "ROUTE per-collective"),
    ("23100", "auto", "ROUTE per-collective"),
    ("22700", " Auto ", "ROUTE per-communicator"),
    ("23100", "per-communicator", "ROUTE per-communicator 64"),
    ("23200", "per-communicator", "ROUTE per-communicator 64"),
    ("23200", "per-collective", "ROUTE per-collective 32"),
    ("23100", "per-collective", "ROUTE per-collective"),
    ("22700", "per-communicator", "ROUTE per-communicator"),
    ("22700", "per-collective", "ERROR RuntimeError libra NCCL: "
                                "LIBRA_JAX_NCCL_CTA_ROUTE=per-collective, but"),
    ("22800", "per-collective", "(NCCL 2.28.0) has no ncclAllReduceConfig (NCCL >= 2.31 has)"),
    ("23100", "per-call", "ERROR ValueError LIBRA_JAX_NCCL_CTA_ROUTE must be one of auto, "
                          "per-collective, per-communicator, got 'per-call'"),
    ("21400", "per-communicator", "ERROR RuntimeError libra NCCL: "
                                  "LIBRA_JAX_NCCL_CTA_ROUTE=per-communicator, but"),
])
def test_the_cta_route_can_be_forced(stub_env, version, forced, expect):
    # auto (or unset) is the version's route; either route may be forced where the version has
    # it (per-communicator on every NCCL with CTA limits, 2.31 and 2.32 included), and one it
    # lacks is an error naming the version; a value that is no route is config's ValueError.
    stub_env["NCCL_STUB_VERSION"] = version
    stub_env["LIBRA_JAX_NCCL_CTA_ROUTE"] = forced
    out = run("""
        from libra_jax import _nccl
        try:
            lib = _nccl.library()
            print("ROUTE", lib.route, lib.max_ctas)
        except (RuntimeError, ValueError) as e:
            print("ERROR", type(e).__name__, e)
    """, stub_env)
    assert expect in out, out


def test_the_route_is_chosen_when_nccl_is_first_opened(stub_env):
    # Its communicators are that route's: a later forced request for the other is an error
    # naming both (it was ignored before), the same route or auto is the open library.
    out = run("""
        import os
        from libra_jax import _nccl
        print("FIRST", _nccl.library().route)
        for route in ("per-communicator", "per-collective", "auto"):
            os.environ["LIBRA_JAX_NCCL_CTA_ROUTE"] = route
            try:
                print("AGAIN", route, _nccl.library().route)
            except RuntimeError as e:
                print("ERROR", route, e)
    """, stub_env)
    assert "FIRST per-collective" in out, out
    assert ("ERROR per-communicator libra NCCL: LIBRA_JAX_NCCL_CTA_ROUTE=per-communicator, but "
            "NCCL 2.31.0 is already open on the per-collective route") in out, out
    assert "AGAIN per-collective per-collective" in out and "AGAIN auto per-collective" in out


# Two ranks as threads, a bucket of three members (two f32, one s32) as one NCCL group per block
# count (2, 4, 2) through the communicator cache, as the start and one-call handlers issue it.
THREADED_BUCKET = two_ranks(
    prelude="""
        lib = _nccl.library()
        print("ROUTE", lib.route, lib.version)
    """,
    per_call="""
        a = np.arange(6, dtype=np.float32) * (r + 1) + blocks
        b = np.full(3, 10.0 * (r + 1), np.float32)
        c = np.full(5, 100 + r, np.int32)
        _nccl.collective_group_host("all-reduce", comm, 2, r, blocks, [a, b, c], [a, b, c])
        outs.append((a.tolist(), b.tolist(), c.tolist()))
    """,
    report="""
        print("RESULTS", results[0] == results[1], results[0][1])
        print("COMMUNICATORS", _nccl.communicators_created())
    """)


@pytest.mark.parametrize("version, forced", [("23100", "per-communicator"),
                                             ("23200", "per-communicator"),
                                             ("23200", "auto"), ("22700", "auto")])
def test_a_bucket_on_each_cta_route(stub_env, version, forced):
    """The per-communicator route forced on NCCL 2.31 and 2.32 issues a bucket as 2.18-2.30 do:
    one group of plain ncclAllReduce calls (no ncclAllReduceConfig) on communicators whose
    config pins the CTAs (the first block count's made with it, the other's split from it,
    sharing its buffers), one launch per group in the stub's model of NCCL's planner. The
    per-collective route (auto on 2.32) gives each member a per-call limit, which NCCL 2.32
    isolates from aggregation: a launch per member. Sums right on every route."""
    stub_env["NCCL_STUB_VERSION"] = version
    stub_env["LIBRA_JAX_NCCL_CTA_ROUTE"] = forced
    out = run(THREADED_BUCKET, stub_env)
    pinned = forced == "per-communicator" or int(version) < 23100
    assert f"ROUTE {'per-communicator' if pinned else 'per-collective'} " in out, out
    # blocks 4: rank 0 arange+4, rank 1 2*arange+4 -> 3*arange+8; 10+20; 100+101
    assert ("RESULTS True ([8.0, 11.0, 14.0, 17.0, 20.0, 23.0], [30.0, 30.0, 30.0], "
            "[201, 201, 201, 201, 201])") in out, out
    calls, groups = log_lines(stub_env, "allreduce"), log_lines(stub_env, "group")
    assert len(calls) == 2 * 3 * 3 and sorted(c["ctas"] for c in calls) == [2] * 12 + [4] * 6
    assert [g["calls"] for g in groups] == [3] * 6  # each rank: one group per bucket
    if pinned:
        assert all(c["config"] == 0 and c["asked"] == 0 for c in calls)  # ncclAllReduce
        inits, splits = log_lines(stub_env, "init"), log_lines(stub_env, "split")
        assert [(i["minCTAs"], i["maxCTAs"]) for i in inits] == [(2, 2)] * 2
        assert [(p["minCTAs"], p["maxCTAs"], p["share"]) for p in splits] == [(4, 4, 1)] * 2
        assert "COMMUNICATORS 4" in out, out
        assert all(g["launches"] == 1 for g in groups), groups
    else:
        assert all(c["config"] == 1 and c["asked"] == c["ctas"] for c in calls)
        assert "COMMUNICATORS 2" in out, out
        assert all(g["launches"] == 3 for g in groups), groups  # 2.32: isolated per member


def test_bad_unique_id_and_unknown_communicator(stub_env):
    out = run("""
        import numpy as np
        from libra_jax import _libra_ffi
        for call in (lambda: _libra_ffi.nccl_register_id(7, b"short"),
                     lambda: _libra_ffi.nccl_allreduce_host(99, 1, 0, 1, np.ones(2, np.float32)),
                     lambda: _libra_ffi.nccl_allreduce_host(1, 1, 0, 1, np.ones(2, np.int8))):
            try:
                call()
            except (ValueError, RuntimeError, TypeError) as e:
                print(type(e).__name__, e)
    """, stub_env)
    assert "ValueError an NCCL unique id has 128 bytes, got 5" in out
    assert "RuntimeError libra NCCL: communicator 99 has no unique id" in out
    assert "TypeError nccl_allreduce_host: float32, float64, int32 or int64 arrays only" in out


# Two processes x 2 CPU devices through jax.distributed: unique ids through the
# key-value store, a host all-reduce per process, and the cuda lowering of a
# psum over the 4 devices of both.
TWO_PROCESSES = """
    import sys
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    import libra_jax
    from libra_jax import _nccl
    comm = _nccl.communicator([10, 11], blocks=4, holds_root=pid == 0, timeout_s=30)
    a = np.arange(3, dtype=np.float64) + 10 * pid
    _nccl.allreduce_host(comm, 2, pid, 4, a)
    print("HOST", a.tolist())
    if pid == 1:  # nobody holds this group's rank 0: an error after the timeout
        try:
            _nccl.communicator([20, 21], blocks=4, holds_root=False, timeout_s=2)
        except RuntimeError as e:
            print("TIMEOUT", e)
    import os
    mesh = jax.make_mesh((4,), ("x",))
    # Under LIBRA_JAX_CUDA=p2p, a group across processes is NCCL's, flat (every GPU one
    # rank), whatever the buffer: 2 x 3 floats per GPU, and 2 x 4 (whole 16-byte vectors:
    # the hierarchical P2P + NCCL stages were here before). Under nccl the same; under xla
    # (the default) XLA's all-reduce.
    for name, path, cols in (("FLAT", "p2p", 3), ("P2P", "p2p", 4), ("NCCL", "nccl", 4),
                             ("XLA", "xla", 4)):
        os.environ["LIBRA_JAX_CUDA"] = path
        f = jax.jit(jax.shard_map(lambda v: libra_jax.psum(v, "x", blocks=6), mesh=mesh,
                                  in_specs=P("x"), out_specs=P()))
        x = jax.ShapeDtypeStruct((8, cols), np.float32, sharding=jax.NamedSharding(mesh, P("x")))
        text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        print(name, " ".join(l.strip() for l in text.splitlines()
                             if "libra_allreduce" in l or "all_reduce" in l), "END")
    # optimize across the processes, each overlap mode, on the nccl path.
    import re
    import jax.numpy as jnp
    os.environ["LIBRA_JAX_CUDA"] = "nccl"
    def local(w, v):
        return jax.lax.psum(jax.grad(lambda w: jnp.sum(jnp.tanh(v @ w) ** 2))(w), "x")
    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                         check_vma=False)
    w = jax.ShapeDtypeStruct((4, 4), np.float32, sharding=jax.NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=jax.NamedSharding(mesh, P("x")))
    for mode in ("sync", "start-done", "auto"):
        opt = libra_jax.optimize(step, overlap=mode)
        text = jax.jit(opt).trace(w, x).lower(lowering_platforms=("cuda",)).as_text()
        print("OPT", mode, sorted(set(re.findall(r"custom_call @(libra_\\w+)", text))),
              sorted(set(re.findall(r" ranks = dense<([^>]*)>", text))), "END")
    jax.distributed.shutdown()
"""


def test_unique_ids_travel_through_the_key_value_store(stub_env):
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(TWO_PROCESSES), str(pid),
                               port], env=stub_env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for pid in range(2)]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for out in outs:
        assert "HOST [10.0, 12.0, 14.0]" in out, out
    calls = log_lines(stub_env, "allreduce")
    assert len(calls) == 2 and len({c["id"] for c in calls}) == 1  # one communicator
    assert "TIMEOUT libra_jax: no NCCL unique id for the all-reduce over devices [20, 21]" \
        in outs[1]
    # Each process lowers its own ranks (devices 0,1 in process 0; 2,3 in process 1).
    for pid, out in enumerate(outs):
        for name in ("FLAT", "P2P", "NCCL"):
            call = out.split(name, 1)[1].split("END", 1)[0]
            assert "@libra_allreduce_nccl" in call and "ctas = 6" in call, call
            assert "nranks = 4" in call and "@libra_allreduce_cuda" not in call, call
            assert f"ranks = dense<[{2 * pid}, {2 * pid + 1}]>" in call, call
            assert "local_world" not in call and "local_teams" not in call, call
        # optimize's buckets: NCCL's call or its start and the kernels' done, this process's
        # ranks (2 of 4); "auto" splits what the model prices lower split.
        mine = f"['[{2 * pid}, {2 * pid + 1}]']"
        assert f"OPT sync ['libra_allreduce_nccl'] {mine} END" in out, out
        for mode in ("start-done", "auto"):
            assert (f"OPT {mode} ['libra_allreduce_cuda_done', 'libra_allreduce_nccl_start'] "
                    f"{mine} END") in out, out
        # The default, xla: XLA's all-reduce, no libra call.
        xla = out.split("XLA", 1)[1].split("END", 1)[0]
        assert "all_reduce" in xla and "libra_allreduce" not in xla, xla


@pytest.mark.parametrize("path, overlap", [("nccl", "start-done"), ("xla", "sync"),
                                           ("p2p", "sync")])
def test_auto_issues_nccl_buckets_as_start_done(stub_env, path, overlap):
    """optimize's default (overlap="auto") on a GPU profile: under LIBRA_JAX_CUDA=nccl every
    gradient bucket is a start/done pair (one call would make XLA's stream wait for NCCL at
    once); the other paths keep one call until start/done is measured on a GPU."""
    stub_env["LIBRA_JAX_CUDA"] = path
    out = run("""
        import jax, sys
        jax.config.update("jax_num_cpu_devices", 8)
        import libra_jax
        sys.path.insert(0, sys.argv[1])
        from conftest import mlp_step
        step, args = mlp_step()
        e = libra_jax.explain(step, *args, profile="h100", file=None)
        print("OVERLAP", sorted({r.overlap for s in e.scopes for r in s.rows}))
    """, stub_env, str(Path(__file__).parent))
    assert f"OVERLAP ['{overlap}']" in out, out


@pytest.mark.parametrize("versions, agree", [(("23100", "23100"), True),
                                              (("22400", "23100"), False)])
def test_plan_agreement_covers_the_nccl_configuration(stub_env, versions, agree):
    """Two processes that plan alike but load different NCCLs (2.24: a communicator per block
    count; 2.31: per-collective limits) would issue different communicators and CTA limits:
    optimize's plan agreement names the difference (cpu-host plans: the data path only)."""
    runs = run_processes(GRAD_WORKER, [["cpu-host"], ["cpu-host"]],
                         env={**stub_env, "LIBRA_JAX_CUDA": "nccl"},
                         env_per_process=[{"NCCL_STUB_VERSION": v} for v in versions])
    for r in runs:
        if agree:
            assert "ERROR" not in r.out and "PLAN" in r.out, r.out
        else:
            assert "planned this step differently" in r.out, r.out
            assert "NCCL=2.24.0 route=per-communicator" in r.out, r.out
            assert "NCCL=2.31.0 route=per-collective" in r.out, r.out


# One process, LIBRA_JAX_CUDA=nccl: every GPU of the group is an NCCL rank of one communicator
# (made here, no key-value store), lowered for cuda from a CPU mesh of 2, 4 and 8 devices; a
# bare psum and optimize's plans in each overlap mode: only libra's NCCL call, with the planned
# block counts as its CTA limits.
IN_PROCESS = """
    import os, re, sys
    os.environ["LIBRA_JAX_CUDA"] = "nccl"
    import jax, numpy as np
    jax.config.update("jax_num_cpu_devices", 8)
    from jax.sharding import PartitionSpec as P
    import libra_jax
    from libra_jax import _ffi
    sys.path.insert(0, sys.argv[1])  # the tests' folder, for conftest's MLP step
    from conftest import check_start_done_pairs, mlp_step
    print("HAS_CUDA", _ffi.HAS_CUDA)
    for n in (2, 4, 8):
        mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
        f = jax.jit(jax.shard_map(lambda v: libra_jax.psum(v, "x", blocks=6), mesh=mesh,
                                  in_specs=P("x"), out_specs=P()))
        x = jax.ShapeDtypeStruct((n, 8), np.float32, sharding=jax.NamedSharding(mesh, P("x")))
        text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        calls = re.findall(r"custom_call @(libra_\\w+)\\(.*?ctas = (\\d+).*?nranks = (\\d+)"
                           r".*?ranks = dense<([^>]*)>", text)
        print("PSUM", n, calls, "all_reduce" in text)
        # Communicator choice: two block counts over one group, one program.
        g = jax.jit(jax.shard_map(lambda v: (libra_jax.psum(v, "x", blocks=2),
                                             libra_jax.psum(v * 2, "x", blocks=6)),
                                  mesh=mesh, in_specs=P("x"), out_specs=(P(), P())))
        text = g.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        comms = re.findall(r"comm_ids = dense<([^>]*)> : tensor<[^>]*>, ctas = (\\d+)", text)
        print("COMMS", n, len({ids for ids, _ in comms}), sorted({int(c) for _, c in comms}))
        step, args = mlp_step(devices=n)
        for mode in ("sync", "start-done", "auto"):
            opt = libra_jax.optimize(step, overlap=mode)
            text = jax.jit(opt).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            names = sorted(set(re.findall(r"custom_call @(libra_\\w+)", text)))
            ctas = sorted({int(c) for c in re.findall(r"ctas = (\\d+)", text)})
            planned = sorted({p.blocks for p in opt.last_report.plans})
            # One start/done per bucket (its members one NCCL group: one dtype here).
            split = sum(1 for p in opt.last_report.plans if p.overlap == "start-done")
            pairs = (check_start_done_pairs(text, "libra_allreduce_nccl_start", None)
                     if split else 0)
            print("STEP", n, mode, names, ctas == planned, "all_reduce" in text, pairs == split)
        # A bucket of two dtypes bound by hand: one start per dtype over its members.
        from libra_jax import ops
        def bucket(a, b, c):
            avals = tuple(jax.typeof(v) for v in (a, b, c))
            started = ops.libra_start_p.bind(a, b, c, collective="psum", axes=("x",), blocks=2,
                                             invariant=False, call_id=77)
            return tuple(ops.libra_done_p.bind(  # ordered after the latest start, as optimize's
                *started, started[-1], collective="psum", out_avals=avals, axes=("x",),
                blocks=2, call_id=77))
        h = jax.jit(jax.shard_map(bucket, mesh=mesh, in_specs=(P(),) * 3,
                                  out_specs=(P(),) * 3, check_vma=False))
        shapes = [((4, 8), np.float32), ((3,), np.int32), ((16,), np.float32)]
        text = h.trace(*[jax.ShapeDtypeStruct(s, d) for s, d in shapes]).lower(
            lowering_platforms=("cuda",)).as_text()
        starts = re.findall(r"%\\S+:(\\d+) = stablehlo.custom_call @libra_allreduce_nccl_start",
                            text)
        print("BUCKET", n, sorted(starts), check_start_done_pairs(text,
              "libra_allreduce_nccl_start", None), "concatenate" in text)
        # With an empty member of a dtype of its own (issue 68): that group has no start (its
        # result a constant); the other starts and their dones as before.
        def with_empty(a, b, c, e):
            avals = tuple(jax.typeof(v) for v in (a, b, c, e))
            started = ops.libra_start_p.bind(a, b, c, e, collective="psum", axes=("x",),
                                             blocks=2, invariant=False, call_id=78)
            return tuple(ops.libra_done_p.bind(
                *started, started[-1], collective="psum", out_avals=avals, axes=("x",),
                blocks=2, call_id=78))
        h = jax.jit(jax.shard_map(with_empty, mesh=mesh, in_specs=(P(),) * 4,
                                  out_specs=(P(),) * 4, check_vma=False))
        text = h.trace(*[jax.ShapeDtypeStruct(s, d) for s, d in
                         shapes + [((0, 8), jax.numpy.bfloat16)]]).lower(
            lowering_platforms=("cuda",)).as_text()
        starts = re.findall(r"%\\S+:(\\d+) = stablehlo.custom_call @libra_allreduce_nccl_start",
                            text)
        print("EMPTY_GROUP", n, sorted(starts), check_start_done_pairs(text,
              "libra_allreduce_nccl_start", None))
        # The same bucket as one call: one libra_allreduce_nccl per dtype over its members.
        def fused(a, b, c):
            return tuple(ops.libra_bucket_p.bind(a, b, c, collective="psum", axes=("x",),
                                                 blocks=2, invariant=False))
        h = jax.jit(jax.shard_map(fused, mesh=mesh, in_specs=(P(),) * 3,
                                  out_specs=(P(),) * 3, check_vma=False))
        text = h.trace(*[jax.ShapeDtypeStruct(s, d) for s, d in shapes]).lower(
            lowering_platforms=("cuda",)).as_text()
        calls = re.findall(r"custom_call @libra_allreduce_nccl\\(([^)]*)\\)", text)
        print("FUSED_BUCKET", n, sorted(len(c.split(", ")) for c in calls),
              "concatenate" in text, "slice" in text)
"""


@pytest.mark.parametrize("version, communicators", [("21700", 2), ("22700", 1), ("23100", 1)])
def test_nccl_path_in_one_process(stub_env, version, communicators):
    # Communicators per group in the lowered program: one per block count on 2.17 (each its own
    # unique id), one per group from 2.18 (children split at run time) and on 2.31.
    stub_env["NCCL_STUB_VERSION"] = version
    out = run(IN_PROCESS, stub_env, str(Path(__file__).parent))
    if "HAS_CUDA False" in out:
        pytest.skip("libra_jax built without CUDA: the cuda lowering is XLA's")
    for n in (2, 4, 8):
        assert f"COMMS {n} {communicators} [2, 6]" in out, out
        line = next(l for l in out.splitlines() if l.startswith(f"PSUM {n} "))
        ranks = ", ".join(map(str, range(n)))
        assert f"('libra_allreduce_nccl', '6', '{n}', '[{ranks}]')" in line, line
        assert line.endswith("False"), line  # no XLA all-reduce
        assert f"STEP {n} sync ['libra_allreduce_nccl'] True False True" in out, out
        # Start/done on NCCL: start on libra's stream, the kernels' done; no copy of the
        # in-flight buffer (conftest.check_start_done_pairs). "auto" splits what the model
        # prices lower split (here every gradient bucket).
        # The loss's pmean is a member of the gradients' bucket: no single call.
        for mode in ("start-done", "auto"):
            assert (f"STEP {n} {mode} ['libra_allreduce_cuda_done', "
                    "'libra_allreduce_nccl_start'] True False True") in out, out
        # A bucket's members of one dtype are one start (one NCCL group), each dtype its own:
        # 2 + token and 1 + token results; no packed copy.
        assert f"BUCKET {n} ['2', '3'] 2 False" in out, out
        assert f"EMPTY_GROUP {n} ['2', '3'] 2" in out, out  # no start for the empty bf16
        # One call per dtype over its members as they are (it was packed: concatenate, slice).
        assert f"FUSED_BUCKET {n} [1, 2] False False" in out, out


# The sharded pair lowered for cuda on LIBRA_JAX_CUDA=nccl: NCCL's reduce-scatter and
# all-gather, one call and start/done (start on libra's stream, the kernels' done), the block
# count as the call's CTA limit, no XLA collective left.
SHARDED_IN_PROCESS = """
    import os, re, sys
    os.environ["LIBRA_JAX_CUDA"] = "nccl"
    import jax, numpy as np
    jax.config.update("jax_num_cpu_devices", 8)
    from jax.sharding import PartitionSpec as P
    import libra_jax
    from libra_jax import _ffi
    sys.path.insert(0, sys.argv[1])  # the tests' folder
    from conftest import check_start_done_pairs
    from libra_jax import ops
    print("HAS_CUDA", _ffi.HAS_CUDA)

    def pairs(g, w):
        # Both starts, then both dones, each with its own start's token and the latest
        # start's (as optimize places them): the compute between would go where the dones are.
        params = dict(axes=("x",), dimension=1, axis_size=jax.lax.axis_size("x"),
                      tiled=True, blocks=6)
        rs_out, _ = ops.libra_reduce_scatter_p.abstract_eval(
            jax.typeof(g), axis_name=("x",), scatter_dimension=1, axis_size=params["axis_size"],
            tiled=True, blocks=6)
        ag_out, _ = ops.libra_all_gather_p.abstract_eval(
            jax.typeof(w), axis_name=("x",), all_gather_dimension=1,
            axis_size=params["axis_size"], tiled=True, invariant=False, blocks=6)
        rs, rs_token = ops.libra_start_p.bind(g, collective="psum_scatter", call_id=1,
                                              **params)
        ag, token = ops.libra_start_p.bind(w, collective="all_gather", call_id=2, **params)
        return (ops.libra_done_p.bind(rs, rs_token, token, collective="psum_scatter",
                                      call_id=1, out_avals=(rs_out,), **params)[0],
                ops.libra_done_p.bind(ag, token, token, collective="all_gather",
                                      call_id=2, out_avals=(ag_out,), **params)[0])
    for n in (2, 8):
        mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
        for form in ("one-call", "start-done"):
            def body(g, w):
                if form == "one-call":
                    return (libra_jax.psum_scatter(g, "x", scatter_dimension=1, tiled=True,
                                                   blocks=6),
                            libra_jax.all_gather(w, "x", axis=1, tiled=True, blocks=6))
                return pairs(g, w)
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                                      out_specs=(P("x"), P("x")), check_vma=False))
            g = jax.ShapeDtypeStruct((n * 3, 4 * n), np.float32,
                                     sharding=jax.NamedSharding(mesh, P("x")))
            w = jax.ShapeDtypeStruct((n * 3, 2), np.float32,
                                     sharding=jax.NamedSharding(mesh, P("x")))
            text = f.trace(g, w).lower(lowering_platforms=("cuda",)).as_text()
            names = sorted(set(re.findall(r"custom_call @(libra_\\w+)", text)))
            ctas = sorted({int(c) for c in re.findall(r"ctas = (\\d+)", text)})
            xla = "reduce_scatter" in text.replace("libra_reduce_scatter", "") or (
                "all_gather" in text.replace("libra_all_gather", ""))
            checked = (check_start_done_pairs(text, ("libra_reduce_scatter_nccl_start",
                                                     "libra_all_gather_nccl_start"), None)
                       if form == "start-done" else 0)
            print("SHARDED", n, form, names, ctas, xla, checked)
        # An all-gather copies any dtype of whole bytes (as NCCL's uint8); a reduce-scatter of
        # one NCCL does not sum is XLA's.
        h = jax.jit(jax.shard_map(lambda b: (libra_jax.all_gather(b, "x", tiled=True),
                                             libra_jax.psum_scatter(b, "x", tiled=True)),
                                  mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")),
                                  check_vma=False))
        b = jax.ShapeDtypeStruct((n * n, 3), np.int8, sharding=jax.NamedSharding(mesh, P("x")))
        text = h.trace(b).lower(lowering_platforms=("cuda",)).as_text()
        print("BYTES", n, sorted(set(re.findall(r"custom_call @(libra_\\w+)", text))),
              "reduce_scatter" in text.replace("libra_reduce_scatter", ""))
"""


@pytest.mark.parametrize("version", ["21700", "22700", "23100"])
def test_sharded_pair_on_the_nccl_path(stub_env, version):
    stub_env["NCCL_STUB_VERSION"] = version
    out = run(SHARDED_IN_PROCESS, stub_env, str(Path(__file__).parent))
    if "HAS_CUDA False" in out:
        pytest.skip("libra_jax built without CUDA: the cuda lowering is XLA's")
    for n in (2, 8):
        assert (f"SHARDED {n} one-call ['libra_all_gather_nccl', 'libra_reduce_scatter_nccl'] "
                "[6] False 0") in out, out
        assert f"BYTES {n} ['libra_all_gather_nccl'] True" in out, out
        # Start/done: no copy of an in-flight buffer (conftest.check_start_done_pairs: 2 pairs).
        assert (f"SHARDED {n} start-done ['libra_all_gather_nccl_start', "
                "'libra_allreduce_cuda_done', 'libra_reduce_scatter_nccl_start'] [6] False 2"
                ) in out, out


# One process on LIBRA_JAX_CUDA=nccl lowering for cuda from 8 CPU devices (the scripts below
# continue it); it says whether the extension has CUDA (else the lowering is XLA's: skipped).
NCCL_LOWERING_PRELUDE = """
    import os, re
    os.environ["LIBRA_JAX_CUDA"] = "nccl"
    import jax, numpy as np
    jax.config.update("jax_num_cpu_devices", 8)
    from jax.sharding import PartitionSpec as P
    from libra_jax import _ffi
    print("HAS_CUDA", _ffi.HAS_CUDA)
"""


# The all-to-all on LIBRA_JAX_CUDA=nccl, lowered for cuda: NCCL sends contiguous block d of its
# buffer to rank d, so the split dimension is moved to the front and flattened before the call
# (a transpose where it does not lead) and moved back after it, then the received segments
# concatenated along the concat dimension (`lowering.Call.arrange`): one libra call, no XLA
# all-to-all, flat buffers of the whole operand in and out.
EXCHANGE_IN_PROCESS = NCCL_LOWERING_PRELUDE + """
    import libra_jax
    for n in (2, 4):
        mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
        for split, concat in ((0, 0), (1, 0), (0, 1)):
            f = jax.jit(jax.shard_map(
                lambda v: libra_jax.all_to_all(v, "x", split, concat, tiled=True, blocks=4),
                mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
            x = jax.ShapeDtypeStruct((n * 4, 4 * n), np.float32,
                                     sharding=jax.NamedSharding(mesh, P("x")))
            text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
            calls = re.findall(r"custom_call @(libra_\\w+)\\(.*?ctas = (\\d+).*?"
                               r": \\((tensor<[^>]*>)[^)]*\\) -> (tensor<[^>]*>)", text)
            print("EXCHANGE", n, split, concat, calls, "stablehlo.all_to_all" in text,
                  text.count("stablehlo.transpose"))
"""


def test_all_to_all_on_the_nccl_path(stub_env):
    stub_env["NCCL_STUB_VERSION"] = "22800"
    out = run(EXCHANGE_IN_PROCESS, stub_env)
    if "HAS_CUDA False" in out:
        pytest.skip("libra_jax built without CUDA: the cuda lowering is XLA's")
    for n in (2, 4):
        flat = f"tensor<{16 * n}xf32>"  # the operand (4, 4n), flat, in and out
        call = f"[('libra_all_to_all_nccl', '4', '{flat}', '{flat}')] False"
        # Split along the leading dimension: no transpose (the shape's own order), else one
        # to bring the split dimension to the front and one back; concat along another
        # dimension: the arrangement's transpose.
        assert f"EXCHANGE {n} 0 0 {call} 0" in out, out
        assert f"EXCHANGE {n} 1 0 {call} " in out and f"EXCHANGE {n} 0 1 {call} " in out, out
        for split, concat in ((1, 0), (0, 1)):
            transposes = int(re.search(rf"EXCHANGE {n} {split} {concat} .* (\d+)$", out,
                                       re.M).group(1))
            assert transposes >= 1, out


# A reduce-scatter bucket (ops.libra_bucket_p of kind psum_scatter) lowered for cuda on
# LIBRA_JAX_CUDA=nccl: one NCCL call per dtype NCCL sums, over the members as they are (each
# its own row of shards, one NCCL group; they were packed into one row before); a dtype it
# does not sum (int8) is XLA's, per member.
FUSED_SHARDED_IN_PROCESS = NCCL_LOWERING_PRELUDE + """
    from libra_jax import ops
    for n in (2, 8):
        mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
        def body(v):
            members = (v, v[:n, :2], v.astype(jax.numpy.bfloat16), v[:n].astype(np.int8))
            return tuple(ops.libra_bucket_p.bind(
                *members, collective="psum_scatter", axes=("x",), axis_size=n,
                tiled=(True, False, True, False), blocks=6))
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 4,
                                  check_vma=False))
        v = jax.ShapeDtypeStruct((n * n * 3, 4), np.float32,
                                 sharding=jax.NamedSharding(mesh, P("x")))
        text = f.trace(v).lower(lowering_platforms=("cuda",)).as_text()
        calls = re.findall(r"custom_call @(libra_\\w+)\\(.*?ctas = (\\d+).*"
                           r": \\(([^)]*)\\) -> \\(?([^()]*?)\\)?$", text, re.M)
        print("FUSED", n, sorted(calls, key=lambda c: c[3]),
              text.count("stablehlo.reduce_scatter"), "stablehlo.concatenate" in text)
"""


def test_reduce_scatter_bucket_on_the_nccl_path(stub_env):
    out = run(FUSED_SHARDED_IN_PROCESS, stub_env)
    if "HAS_CUDA False" in out:
        pytest.skip("libra_jax built without CUDA: the cuda lowering is XLA's")
    for n in (2, 8):
        line = next(l for l in out.splitlines() if l.startswith(f"FUSED {n} "))
        # f32: both members in one call, each its row of n shards in, this rank's shard out.
        assert (f"'tensor<{n * 12}xf32>, tensor<{n * 2}xf32>', 'tensor<12xf32>, tensor<2xf32>'"
                in line), line
        assert f"'tensor<{n * 12}xbf16>', 'tensor<12xbf16>'" in line, line
        assert line.count("libra_reduce_scatter_nccl") == 2 and "'6'" in line, line
        assert line.endswith(" 1 False"), line  # int8: XLA's reduce-scatter; no concatenate


# The FSDP corpus steps (tests/corpus.py) under `optimize`, lowered for cuda on
# LIBRA_JAX_CUDA=nccl: every gradient reduce-scatter is a planned libra NCCL call (one per
# planned bucket, with its blocks as the CTA limit) and no XLA reduce-scatter is left.
#: The corpus's FSDP steps lowered for CUDA on ``LIBRA_JAX_CUDA=nccl`` (8 host devices), in a
#: process of their own: the start of each script below (argv[1]: the tests folder).
FSDP_PRELUDE = """
    import os, re, sys, warnings
    os.environ["LIBRA_JAX_CUDA"] = "nccl"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    warnings.simplefilter("ignore")
    sys.path.insert(0, sys.argv[1])
    from corpus import CASES
    import libra_jax
    from libra_jax import _ffi
    print("HAS_CUDA", _ffi.HAS_CUDA)
"""

FSDP_CORPUS_IN_PROCESS = FSDP_PRELUDE + """
    for name in ("fsdp-remat", "fsdp-explicit-psum-scatter", "fsdp-mixed-replicated"):
        case = CASES[name]()
        with case.context():
            opt = libra_jax.optimize(case.step)
            text = case.trace(opt).lower(lowering_platforms=("cuda",)).as_text()
        planned = sorted(p.blocks for p in opt.last_report.plans
                         if p.collective.kind == "reduce-scatter")
        ctas = sorted(int(c) for c in re.findall(
            r"custom_call @libra_reduce_scatter_nccl\\(.*?ctas = (\\d+)", text))
        print("CASE", name, planned, ctas, text.count("stablehlo.reduce_scatter"))
"""


def test_fsdp_corpus_reduce_scatters_are_nccl_calls(stub_env):
    out = run(FSDP_CORPUS_IN_PROCESS, stub_env, str(Path(__file__).resolve().parent))
    if "HAS_CUDA False" in out:
        pytest.skip("libra_jax built without CUDA: the cuda lowering is XLA's")
    lines = [line for line in out.splitlines() if line.startswith("CASE ")]
    assert len(lines) == 3, out
    for line in lines:
        name, planned, ctas, xla = re.fullmatch(
            r"CASE (\S+) (\[.*?\]) (\[.*?\]) (\d+)", line).groups()
        assert planned == ctas != "[]" and xla == "0", line


# --- On real GPUs (skipped here) --------------------------------------------

GPU_WORKER = """
    import sys
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, local_device_ids=[pid])
    import libra_jax
    mesh = jax.make_mesh((2,), ("x",))
    data = np.arange(2 * 1000, dtype=np.float32).reshape(2, 1000)
    x = jax.make_array_from_callback(data.shape, jax.NamedSharding(mesh, P("x")),
                                     lambda i: data[i])
    for blocks in (1, 4, 16):
        f = jax.jit(jax.shard_map(lambda v: libra_jax.psum(v, "x", blocks=blocks), mesh=mesh,
                                  in_specs=P("x"), out_specs=P()))
        got = np.asarray(f(x).addressable_data(0))
        assert np.array_equal(got, data.sum(0, keepdims=True)), blocks
    print("GPU OK")
    jax.distributed.shutdown()
"""


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return out.stdout.count("GPU ")


@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one)")
def test_two_processes_on_two_gpus():
    env = {**os.environ, "XLA_FLAGS": xla_flags(None), "LIBRA_JAX_CUDA": "nccl"}
    env.pop("LIBRA_JAX_NCCL_LIBRARY", None)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(GPU_WORKER), str(pid), port],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "GPU OK" in out, err[-3000:]


FSDP_PREFETCH_IN_PROCESS = FSDP_PRELUDE + """
    case = CASES["fsdp-remat"]()
    opt = libra_jax.optimize(case.step, profile="h200")  # "auto": the model's distance
    text = case.trace(opt).lower(lowering_platforms=("cuda",)).as_text()
    ahead = sorted({p.ahead for p in opt.last_report.plans if p.collective.kind == "all-gather"})
    # A start's results: its members' buffers, then its token (a group's: several members).
    starts = [(s, int(n) - 1) for s, n in re.findall(
        r"%(\\S+):(\\d+) = stablehlo.custom_call @libra_all_gather_nccl_start", text)]
    paired = all(re.search(rf"custom_call @libra_allreduce_cuda_done\\("
                           + ", ".join(f"%{s}#{k}" for k in range(n + 1)) + r"\\)", text)
                 for s, n in starts)  # each done reads its own start's buffers and token
    once = all(len(re.findall(rf"%{s}#{k}\\b", text)) == 1  # each buffer read by done only
               for s, n in starts for k in range(n))
    print("PREFETCH", ahead, sum(n for _, n in starts), len(starts), paired, once,
          text.count("stablehlo.all_gather"))
"""


def test_fsdp_gathers_issued_ahead_are_nccl_pairs_with_no_copy(stub_env):
    """On ``LIBRA_JAX_CUDA=nccl`` with a GPU profile, "auto" issues the model's distance: every
    all-gather (forward and remat's re-gathers) is NCCL's start on libra's stream and the
    kernels' done, the forward's in fewer starts than gathers (a group: one start over its
    members), each done reading its own start's buffers and token, each buffer read by
    nothing else (no copy of an in-flight buffer); no XLA all-gather left."""
    out = run(FSDP_PREFETCH_IN_PROCESS, stub_env, str(Path(__file__).resolve().parent))
    if "HAS_CUDA False" in out:
        pytest.skip("libra_jax built without CUDA: the cuda lowering is XLA's")
    line = next(line for line in out.splitlines() if line.startswith("PREFETCH "))
    ahead, members, starts, paired, once, xla = re.fullmatch(
        r"PREFETCH \[(\d+)\] (\d+) (\d+) (\w+) (\w+) (\d+)", line).groups()
    assert int(ahead) >= 1 and members == "6" and int(starts) < 6, line
    assert paired == once == "True" and xla == "0", line
