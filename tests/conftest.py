"""Shared fixtures: 8 simulated CPU devices and meshes over any number of them."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile

from libra_jax.config import xla_flags  # pure Python: JAX does not start

# Before JAX starts its CPU backend (also for subprocesses spawned by tests): 8 host devices,
# and every flag the caller gave kept (CI's --xla_cpu_max_isa runs need theirs to reach XLA).
os.environ["XLA_FLAGS"] = xla_flags(8)
# A user's calibrated profile must not change what the tests expect.
os.environ["LIBRA_JAX_PROFILE_DIR"] = tempfile.mkdtemp(prefix="libra_jax_test_profiles_")
# Nor this machine's probe: plans (tests/data/plans.json) come from the shipped profile exactly;
# subprocesses inherit it (they pass os.environ). tests/test_probe.py turns it on where it tests it.
os.environ["LIBRA_JAX_PROFILE_PROBE"] = "0"

import numpy as np
import pytest

from libra_jax import testing
from libra_jax.testing import assert_bitwise  # noqa: F401  (the tests import it from here)


def _jax():
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    return jax


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]):
    """A mesh over the first prod(shape) CPU devices."""
    jax = _jax()
    n = int(np.prod(shape))
    devices = np.array(jax.devices("cpu")[:n]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def shard(x, mesh, spec):
    jax = _jax()
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


def data_mesh(kind: str):
    """A 1-D ("data",) mesh over 8 CPU devices whose axis is of `kind`: "auto" or "explicit"."""
    jax = _jax()
    axis_type = (jax.sharding.AxisType.Explicit if kind == "explicit" else
                 jax.sharding.AxisType.Auto)
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("data",),
                             axis_types=(axis_type,))


def assert_trees_close(got, want) -> None:
    """`assert_codegen_close` of two pytrees of arrays (jax's or NumPy's)."""
    jax = _jax()
    assert_codegen_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))


# --- Comparing results: the three classes of docs/bitwise.md ---------------------
# (libra_jax.testing): classes 1 and 2 (by construction; the same program but the collective)
# are bitwise, class 3 (two programs: by XLA's code generation) is within CODEGEN_ULPS.

#: Where assert_codegen_close appends what it measured (a JSON line per leaf), for
#: benchmarks/codegen_bounds.py's table; unset in ordinary runs.
CODEGEN_RECORD_ENV = "CODEGEN_BOUNDS_RECORD"


def assert_codegen_close(got, want) -> None:
    """libra_jax.testing.assert_codegen_close, recording each leaf's error where
    $CODEGEN_BOUNDS_RECORD names a file (before asserting: a failure is recorded too)."""
    import json

    record = os.environ.get(CODEGEN_RECORD_ENV)
    if record:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        with open(record, "a") as f:
            for leaf, error in testing.codegen_errors(got, want).items():
                f.write(json.dumps({"test": test, "leaf": leaf, "error": error}) + "\n")
    testing.assert_codegen_close(got, want)


_EMPTY_RESULT_PROBE = """
import jax, numpy as np
from jax.sharding import PartitionSpec as P
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
step = jax.shard_map(lambda a, b: (a, 2 * b), mesh=mesh, in_specs=P("data"),
                     out_specs=P("data"), check_vma=False)
jax.jit(step)(np.zeros((8, 0), np.float32), np.ones((8, 5), np.float32))
"""


@functools.cache
def xla_compiles_empty_results() -> bool:
    """Whether this jaxlib's XLA compiles a shard_map over 8 CPU devices that returns an empty
    array computed from an operand beside a non-empty one (jaxlib 0.11.2's crashes with
    SIGSEGV, with or without libra_jax): probed once, in a subprocess."""
    return subprocess.run([sys.executable, "-c", _EMPTY_RESULT_PROBE],  # XLA_FLAGS: above
                          capture_output=True, timeout=300).returncode == 0


def skip_unless_xla_compiles_empty_results() -> None:
    """Skips a test whose programs (JAX's own included) return an empty array computed from
    an operand beside others, where XLA crashes compiling them (`xla_compiles_empty_results`)."""
    if not xla_compiles_empty_results():
        pytest.skip("this jaxlib's XLA crashes compiling a shard_map that returns an empty "
                    "array computed from an operand beside a non-empty one (JAX's own program "
                    "included; jaxlib 0.11.2)")


def psum_of_what_xla_compiles(tree, axis_name):
    """`jax.lax.psum(tree, axis_name)` as a reference for trees with empty leaves: the
    non-empty leaves psum'd as one tuple, each empty one a constant. jaxlib 0.11.2's XLA
    crashes (SIGSEGV) compiling a shard_map whose results hold an empty array computed from
    an operand beside a non-empty one (`(a, 2 * b)` with `a` empty is enough), so JAX's own
    psum of such a tree cannot be the reference there."""
    jax = _jax()
    leaves, treedef = jax.tree.flatten(tree)
    full = [i for i, x in enumerate(leaves) if x.size]
    summed = jax.lax.psum([leaves[i] for i in full], axis_name)
    out = [jax.numpy.zeros(x.shape, x.dtype) for x in leaves]
    for i, x in zip(full, summed):
        out[i] = x
    return treedef.unflatten(out)


def lower_for(platform, f, mesh, shape, spec, warns):
    """The HLO text of jitted `f` traced on an array of `shape` laid out by `spec` over the
    (abstract) `mesh`, lowered for `platform`, asserting a UserWarning matching `warns`;
    skipped where this JAX cannot lower across platforms."""
    jax = _jax()
    try:
        traced = f.trace(jax.ShapeDtypeStruct(shape, np.float32,
                                              sharding=jax.NamedSharding(mesh, spec)))
        with pytest.warns(UserWarning, match=warns):
            return traced.lower(lowering_platforms=(platform,)).as_text()
    except (TypeError, AttributeError) as e:  # pragma: no cover - API differs by version
        pytest.skip(f"cross-platform lowering unavailable: {e}")


@pytest.fixture(scope="session")
def jax_8():
    jax = _jax()
    assert len(jax.devices("cpu")) == 8, "tests need 8 host devices"
    return jax


def mlp_step(sizes=(16, 32, 32, 32, 8), dtype=np.float32, devices=8):
    """A check_vma data-parallel SGD step (autodiff psums each gradient where it is made) on
    the first `devices` CPU devices, and its arguments (a batch of 4 rows per device)."""
    jax = _jax()
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((m, n)) * 0.3).astype(dtype)
              for m, n in zip(sizes[:-1], sizes[1:])]
    mesh = mesh_of((devices,), ("x",))

    def local(params, x):
        def loss(params):
            h = x
            for w in params:
                h = jnp.tanh(h @ w)
            return jax.lax.pmean(jnp.mean(h * h), "x")
        loss_value, grads = jax.value_and_grad(loss)(params)
        return loss_value, [w - 0.1 * g for w, g in zip(params, grads)]

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()),
                         check_vma=True)
    x = shard(rng.standard_normal((devices * 4, sizes[0])).astype(dtype), mesh, P("x"))
    return step, (params, x)


def check_start_done_pairs(text: str, start: str | tuple[str, ...], call: str | None) -> int:
    """Asserts the structure of the CUDA start/done pairs in a lowered program's `text` (the
    fix of the stale-data defect: done(s, s) made XLA copy the in-flight buffer on its stream
    while the all-reduce could still write it): each `start` custom call (one target, or any
    of several: the sharded pair's) over its members (one, or a bucket's of one dtype)
    works in place or on its own results (a start whose outputs alias its operands, the
    all-reduce's and the reduce-scatter's, says so); each ``libra_allreduce_cuda_done`` reads
    its own start's buffers, each aliased to its output, under the same call id, its own
    start's token and the latest start's; it is lowered with a side effect (XLA never removes
    it); the buffers have no other reader. `call` is the one-call target, used once (a
    forward psum, never split), or None where there is none. Returns the number of pairs."""
    import re
    names = (start,) if isinstance(start, str) else start
    alternatives = "|".join(map(re.escape, names))
    # (result, its count: members + the token, operands, call id)
    starts = [(result, int(count), operands.split(", "), call_id) for result, count, operands,
              call_id in re.findall(rf"%(\S+):(\d+) = stablehlo.custom_call @(?:{alternatives})"
                                    r"\(([^)]*)\).*?call_id = (\d+)", text)]
    dones = re.findall(r"stablehlo.custom_call @libra_allreduce_cuda_done\(([^)]*)\) "
                       r"\{[^{]*?has_side_effect = true.*?call_id = (\d+)"
                       r".*?output_operand_aliases = \[([^\]]*(?:\][^\]]*)*?)\]\}", text)
    assert starts and len(dones) == len(starts), (starts, dones)
    by_result = {result: (count - 1, call_id) for result, count, _, call_id in starts}
    order = [result for result, _, _, _ in starts]
    latest = order[-1]
    for operands, call_id, aliases in dones:
        *buffers, token, after = operands.split(", ")
        result = buffers[0].partition("#")[0].lstrip("%")
        members, own_id = by_result[result]
        assert buffers == [f"%{result}#{i}" for i in range(members)], (buffers, members)
        assert own_id == call_id
        for i in range(members):  # each buffer aliased to its output
            assert f"output_tuple_indices = [{i}], operand_index = {i}," in aliases or (
                members == 1 and "output_tuple_indices = [], operand_index = 0," in aliases), (
                aliases, i)
        # Its start's token, or a later one's of the same bucket (a bucket's dtypes, or its
        # members on the P2P kernels, are one start each; its equation's token is the last's).
        own, _, token_index = token.lstrip("%").partition("#")
        assert own in by_result and token_index == str(by_result[own][0]), (buffers, token)
        assert order.index(own) >= order.index(result), (buffers, token)
        assert after == f"%{latest}#{by_result[latest][0]}", (buffers, token, after)
    assert len({call_id for _, call_id in by_result.values()}) == len(starts)
    # Every start's token is read: by its done, or by the next start of its equation (a
    # bucket's dtypes, or its members on the P2P kernels), whose token then feeds the done.
    # A start whose token nobody reads XLA deletes while its done stays (issue 68).
    tokens_read = {token.lstrip("%").partition("#")[0] for operands, _, _ in dones
                   for token in operands.split(", ")[-2:]}
    for result, count, operands, _ in starts:
        tokens_read.update(o.lstrip("%").partition("#")[0] for o in operands[count - 1:])
    assert set(by_result) <= tokens_read, (set(by_result) - tokens_read, starts)
    for result, (members, _) in by_result.items():
        for i in range(members):  # read by done only
            assert len(re.findall(rf"%{result}#{i}\b", text)) == 1, (result, i)
    in_place = [n for n in names if "all_gather" not in n]  # an all-gather's is a new buffer
    start_lines = [line for line in text.splitlines()
                   if any(f"@{n}(" in line for n in in_place)]
    assert all("operand_index = 0" in line for line in start_lines)
    if call is not None:
        assert len(re.findall(rf"@{call}\(", text)) == 1 and "all_reduce" not in text
    return len(starts)


def copied_operands(hlo: str, collective: str) -> list[str]:
    """The operands of a compiled program's `collective` instructions (a regular expression
    matched against the instruction's line: ``all-reduce(``, a custom call's target) that are
    copies XLA made: a ``copy``, or a fusion whose root is one, of a value of the same shape
    and layout (how XLA:CPU copies an operand in the fusion that computes it; a transpose
    done as a copy that changes the layout is not one)."""
    import re
    found: dict[str, tuple[str, str, list[str], str | None]] = {}  # name: shape, op, args, calls
    root_of: dict[str, str] = {}  # computation: its root instruction
    computation = ""
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?(%\S+) .*\{$", line)
        if header:
            computation = header.group(1)
            continue
        m = re.match(r"^\s+(ROOT )?(%\S+) = (\w+\[[^\]]*\](?:\{[^}]*\})?) ([\w-]+)\(([^)]*)\)(.*)",
                     line)
        if not m:
            continue
        root, name, shape, op, args, rest = m.groups()
        calls = re.search(r"calls=(%[\w.-]+)", rest)
        found[name] = (shape, op, re.sub(r"/\*index=\d+\*/", "", args).split(", "),
                       calls.group(1) if calls else None)
        if root:
            root_of[computation] = name

    def is_copy(name: str) -> bool:
        shape, op, args, calls = found[name]
        if op == "fusion":
            return calls in root_of and is_copy(root_of[calls])
        return op == "copy" and args[0] in found and found[args[0]][0] == shape

    copied = []
    for line in hlo.splitlines():
        if not re.search(collective, line):
            continue
        args = re.search(r"(?:custom-call|all-reduce(?:-start)?)\(([^)]*)\)", line)
        for arg in re.sub(r"/\*index=\d+\*/", "", args.group(1) if args else "").split(", "):
            if arg in found and is_copy(arg):
                copied.append(arg)
    return copied


def cpu_start_done_pairs(hlo: str) -> tuple[dict[str, str], list[tuple[str, str]],
                                            dict[str, tuple[str, str]]]:
    """A compiled CPU program's sharded start/done pairs, checked: each
    ``libra_allreduce_cpu_done`` (operands: (rank, group), its token, its buffer, then the
    tokens it runs after) reads element 0 of a sharded start (its in-flight buffer) and
    element 1 of the same start (its token). Returns (start name -> its target, the dones'
    (buffer, token) names, get-tuple-element name -> (tuple, index)). Tokens after a done's
    own (the latest start's) are not returned."""
    import re
    starts = dict(re.findall(r"(%\S+) = \(\S+, s32\[1\]\{0\}\) custom-call\(.*?"
                             r'custom_call_target="(libra_\w+_cpu_start)"', hlo))
    elements = {name: (tuple_, index) for name, tuple_, index in re.findall(
        r"(%get-tuple-element\S*) = \S+ get-tuple-element\((%\S+?)\), index=(\d)", hlo)}
    dones = [(buffer, token) for token, buffer in re.findall(
        r"custom-call\(\S+?, (%[^,)]+?), (%[^,)]+?)(?:, %[^,)]+?)*\), "
        r'custom_call_target="libra_allreduce_cpu_done"', hlo)]
    for buffer, token in dones:
        assert elements[buffer][0] in starts and elements[buffer][1] == "0", (buffer, hlo)
        assert elements[token] == (elements[buffer][0], "1"), token
    return starts, dones, elements


# --- Starts abandoned by a failed execution (tests/test_overlap.py, tests/test_sharded.py) ----

_ABANDONED_PRELUDE = """
import os, sys, time
os.environ["LIBRA_JAX_TIMEOUT_S"] = "1"
import jax, numpy as np
jax.config.update("jax_num_cpu_devices", 4)
from jax.sharding import PartitionSpec as P
import libra_jax
from libra_jax import _libra_ffi, ops
sys.path.insert(0, {tests!r})
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
"""

_ABANDONED_RUNS = """
try:
    jax.block_until_ready(program(True)(x, x))
    print("NO ERROR")
except Exception as e:
    print("FAILED", type(e).__name__)
time.sleep(0.2)
print("PENDING_AFTER_FAILURE", _libra_ffi.cpu_pending_starts())
time.sleep(1.2)  # past the timeout since those rounds ended
print("RESULT", summary(program(False)(x, x)))
print("PENDING_AFTER_NEXT", _libra_ffi.cpu_pending_starts())
"""


def run_abandoned_starts(program_source: str) -> tuple[int, str]:
    """A start whose execution fails before its done leaves its in-flight entry behind; a later
    start drops entries whose round is over and whose done has not come within the timeout.

    Runs, in a subprocess of 4 host devices with a 1 s timeout, `program_source` (it defines
    `program(fail)`, a jitted step of two arguments whose starts are followed, when `fail`, by
    a psum that rank 2 never reaches; its input `x`; and `summary(outputs)`, what to print of a
    result), first failing, then, past the timeout, succeeding. Asserts that the first run
    failed, that the second run's starts dropped every stale entry and that the debug log
    (``LIBRA_JAX_DEBUG=1``) said so. Returns (the entries left pending after the failure, the
    printed summary of the second run)."""
    import subprocess
    import sys
    import textwrap

    tests = os.path.dirname(os.path.abspath(__file__))
    script = (_ABANDONED_PRELUDE.format(tests=tests) + textwrap.dedent(program_source)
              + _ABANDONED_RUNS)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "XLA_FLAGS": xla_flags(None),
                                            "LIBRA_JAX_DEBUG": "1"})
    out = proc.stdout
    assert "FAILED" in out, out + proc.stderr[-3000:]
    assert int(out.split("PENDING_AFTER_NEXT")[1].split()[0]) == 0, out
    # Each entry dropped is said in the debug log: a bounded leak, never a silent one.
    assert "its done never came" in proc.stderr, proc.stderr[-3000:]
    result = out.split("RESULT ", 1)[1].splitlines()[0]
    return int(out.split("PENDING_AFTER_FAILURE")[1].split()[0]), result
