"""Buckets at the edges (issue 68): empty members, scalars, shape (1,), every dtype mix and any
member count are ordinary buckets under every issue form (one call, start/done, loop bodies),
and a bucket behaves as `jax.lax.psum` of the same tree.

The defect: a dtype group whose only members are empty got a start whose results nobody read
(its buffers zero-size, its token unread: done read the last group's), so XLA deleted it as
dead code while its done, a side effect, stayed: every run failed with "done of call N without
its start". Each comparison is the XLA control bit for bit (class 2: the same rewritten
program with XLA's all-reduce) and plain JAX within class 3 (docs/bitwise.md)."""
from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_bitwise,
    assert_codegen_close,
    check_start_done_pairs,
    mesh_of,
    psum_of_what_xla_compiles,
    skip_unless_xla_compiles_empty_results,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _ffi

#: The dtypes a gradient bucket may hold: the engine's (f32, bf16, f16, s32) and those
#: XLA's all-reduce serves for it (s8, u8, u32, c64). (f64 and s64 need jax_enable_x64.)
DTYPES = (np.float32, jnp.bfloat16, np.float16, np.int32, np.int8, np.uint8, np.uint32,
          np.complex64)
OVERLAPS = ("auto", "start-done", "sync")
WORLD = 8

# The dtypes the engine does not sum (s8, u8, u32, c64) stay XLA's psum, said by a notice.
pytestmark = pytest.mark.filterwarnings("ignore:libra_jax.optimize left an XLA psum")


def _values(shape: tuple[int, ...], dtype, seed: int) -> np.ndarray:
    """Each of the 8 devices' value of a leaf of `shape` (stacked on a leading axis): small
    integers for integer dtypes (their sums exact), normal draws otherwise."""
    rng = np.random.default_rng(seed)
    full = (WORLD, *shape)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(0, 5, full).astype(dtype)
    if np.issubdtype(np.dtype(dtype), np.complexfloating):
        return (rng.normal(size=full) + 1j * rng.normal(size=full)).astype(dtype)
    return rng.normal(size=full).astype(dtype)


def tree_of(leaves: list[tuple[tuple[int, ...], object]], seed: int = 0) -> dict:
    return {f"leaf{i:03d}": _values(shape, dtype, seed + i)
            for i, (shape, dtype) in enumerate(leaves)}


def psum_step(loop: bool = False, psum=jax.lax.psum):
    """The bucket: each device's own value of every leaf (row r of the stacked leaves),
    psum'd over the mesh as one tree (by `psum`); with `loop`, inside a scan body, twice."""
    mesh = mesh_of((WORLD,), ("data",))

    def reduce(tree):
        mine = jax.tree.map(lambda x: x[0], tree)
        if not loop:
            return psum(mine, "data")

        def body(carry, _):
            return psum(carry, "data"), None
        return jax.lax.scan(body, mine, None, length=2)[0]
    return jax.shard_map(reduce, mesh=mesh, in_specs=P("data"), out_specs=P(),
                         check_vma=False)


def check_bucket(tree: dict, overlap: str, loop: bool = False) -> None:
    """`tree` psum'd through `optimize` equals XLA's control bit for bit, and plain JAX's
    psum within class 3 (each leaf its dtype and shape)."""
    step = psum_step(loop)
    options = dict(overlap=overlap, loops="in-loop") if loop else dict(overlap=overlap)
    plain = jax.jit(psum_step(loop, psum_of_what_xla_compiles))(tree)
    got = jax.jit(libra_jax.optimize(step, **options))(tree)
    control = jax.jit(libra_jax.optimize(step, collectives="xla", **options))(tree)
    assert_bitwise(got, control)
    assert_codegen_close(got, plain)


# --- the cases of the issue ---------------------------------------------------------

PAIRS = [(a, b) for a, b in itertools.product(DTYPES, DTYPES) if a is not b]


@pytest.mark.parametrize("overlap", ("auto", "start-done"))
@pytest.mark.parametrize("empty,full", PAIRS, ids=lambda d: np.dtype(d).name)
def test_a_bucket_with_an_empty_member_of_its_own_dtype(empty, full, overlap):
    """The issue's minimal case, for every ordered pair of `DTYPES`: psum({"a": empty (8, 0)
    of one dtype, "b": (8, 5) of another}) failed for every engine dtype of "a"."""
    check_bucket(tree_of([((8, 0), empty), ((8, 5), full)]), overlap)


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("leaves", [
    [((8, 0), np.float32), ((8, 5), np.float32)],      # an empty member beside one of its dtype
    [((8, 0), jnp.bfloat16), ((0,), jnp.bfloat16)],     # nothing but empty members
    [((), np.float32), ((1,), np.int32), ((0,), np.float16)],  # a scalar, (1,), an empty
    [((8, 0), jnp.bfloat16), ((8, 5), np.float32)],     # the minimal case, under sync too
], ids=("beside-its-dtype", "all-empty", "scalar-one-empty", "minimal"))
def test_small_buckets_under_every_form(leaves, overlap):
    check_bucket(tree_of(leaves), overlap)


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_a_bucket_of_100_mixed_leaves(overlap):
    """100 leaves of every dtype, empty ones, scalars and shape (1,) among them (40 such
    leaves happened to pass: 100 did not)."""
    shapes = [(8, 0), (), (1,), (3, 5), (0,), (17,), (2, 0, 3), (4, 4)]
    leaves = [(shapes[i % len(shapes)], DTYPES[(i * 3) % len(DTYPES)]) for i in range(100)]
    check_bucket(tree_of(leaves), overlap)


@pytest.mark.parametrize("loops", ("in-loop", "hoist"))
@pytest.mark.parametrize("overlap", ("auto", "start-done"))
def test_a_scanned_layer_stack_with_an_empty_member(overlap, loops):
    """Loop bodies: a scanned stack of layers whose gradient psums (autodiff's, in the
    backward scan's body) include an empty bf16 slice per layer; kept in the body (one call
    a bucket there: the rewriter splits no in-loop bucket) or hoisted after the loop
    (planned with the other gradients, start/done pairs)."""
    skip_unless_xla_compiles_empty_results()  # the step returns the updated empty slices
    mesh = mesh_of((WORLD,), ("data",))
    rng = np.random.default_rng(0)
    params = {"w": (rng.normal(size=(3, 16, 16)) / 4).astype(np.float32),
              "t": np.zeros((3, 0, 16), jnp.bfloat16), "b": np.zeros((3, 16), np.float32)}
    x = rng.normal(size=(64, 16)).astype(np.float32)

    def loss(p, x):
        def layer(h, weights):
            w, t, b = weights
            return jnp.tanh(h @ w + b + t.astype(jnp.float32).sum(0)), None
        return jnp.sum(jax.lax.scan(layer, x, (p["w"], p["t"], p["b"]))[0] ** 2) / 64

    def step(p, x):
        return jax.tree.map(lambda w, g: w - (0.1 * g).astype(w.dtype), p,
                            jax.grad(loss)(p, x))
    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    options = dict(overlap=overlap, loops=loops)
    optimized = libra_jax.optimize(step, **options)
    got = jax.jit(optimized)(params, x)
    assert optimized.last_report.plans
    assert_bitwise(got, jax.jit(libra_jax.optimize(step, collectives="xla", **options))(
        params, x))
    assert_codegen_close(got, jax.jit(step)(params, x))


@pytest.mark.parametrize("overlap, issued", [(None, "sync"), ("start-done", "start-done")])
def test_mixed_precision_step_with_an_empty_bf16_table_under_the_default(overlap, issued):
    """The issue's first case, every option default: float32 weights beside an empty
    bfloat16 table (a model configured with zero extra tokens), trained 3 steps with Adam.
    The plan was one bucket issued as a start/done pair, the table's gradient its first
    member: the empty bf16 group's start was deleted and every run failed. The default
    issues that bucket as one call now (ready at the end of the backward pass: nothing left
    to hide a wait, `buckets.split_buckets`); the pair is asked for by name."""
    skip_unless_xla_compiles_empty_results()  # the step returns the updated empty table
    import optax
    mesh = mesh_of((WORLD,), ("data",))
    rng = np.random.default_rng(0)
    params = {"layers": [{"w": (rng.normal(size=(16, 16)) / 4).astype(np.float32),
                          "b": np.zeros((16,), np.float32)} for _ in range(4)],
              "table": np.zeros((0, 16), jnp.bfloat16)}
    x = rng.normal(size=(64, 16)).astype(np.float32)
    tx = optax.adam(1e-2)

    def loss(p, x):
        h = x
        for layer in p["layers"]:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean((h + p["table"].astype(jnp.float32).sum(0)) ** 2)

    def step_of(psum):
        def step(p, state, x):
            grads = jax.tree.map(lambda g: g / WORLD, psum(jax.grad(loss)(p, x), "data"))
            updates, state = tx.update(grads, state, p)
            return optax.apply_updates(p, updates), state
        return jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P(),
                             check_vma=False)
    step = step_of(jax.lax.psum)
    optimized = libra_jax.optimize(step, overlap=overlap)
    fast, control, plain = (jax.jit(optimized),
                            jax.jit(libra_jax.optimize(step, collectives="xla", overlap=overlap)),
                            jax.jit(step_of(psum_of_what_xla_compiles)))
    runs = {"fast": fast, "control": control, "plain": plain}
    state = {name: (params, tx.init(params)) for name in runs}
    for _ in range(3):
        state = {name: run(*state[name], x) for name, run in runs.items()}
    # One bucket: the 8 weights' gradients (the empty table's is a constant, no member:
    # before, it was the bucket's first, and every run failed).
    assert [(p.overlap, len(p.members)) for p in optimized.last_report.plans] == [
        (issued, 8)]
    assert_bitwise(state["fast"], state["control"])
    assert_codegen_close(state["fast"], state["plain"])
    table = state["fast"][0]["table"]
    assert table.dtype == jnp.bfloat16 and table.shape == (0, 16)


# --- no collective holds an empty array ----------------------------------------------

#: An operand or result of zero elements in StableHLO text.
_ZERO_SIZE = re.compile(r"tensor<(?:\d+x)*0(?:x\d+)*x\w+>")


def _collectives_with_empty_arrays(text: str) -> list[str]:
    """The lines of lowered StableHLO `text` that issue a collective (XLA's all-reduce or a
    libra call) with a zero-size operand or result."""
    lines = text.splitlines()
    found = []
    for k, line in enumerate(lines):
        if "stablehlo.all_reduce" in line or "custom_call @libra_" in line:
            # XLA's all-reduce prints its types after its reduction region.
            end = k
            while "stablehlo.all_reduce" in line and ") -> " not in lines[end]:
                end += 1
            if _ZERO_SIZE.search(" ".join(lines[k:end + 1])):
                found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("dtype", (np.float32, np.int8), ids=("engine", "delegated"))
def test_no_collective_holds_an_empty_member(dtype, overlap):
    """The sum of an empty array is itself: no call (the engine's, or XLA's all-reduce of a
    dtype the engine does not sum, left in place) carries an empty member, under every form
    and through the drop-in `libra_jax.psum`. Before, overlap="sync" gave the engine an
    empty member and a delegated dtype's XLA psum kept its empty member, which jaxlib 0.11.2's
    XLA crashes (SIGSEGV) compiling beside the others."""
    tree = tree_of([((8, 0), dtype), ((8, 5), dtype), ((0,), dtype), ((3,), np.float32)])
    optimized = jax.jit(libra_jax.optimize(psum_step(), overlap=overlap))
    assert _collectives_with_empty_arrays(optimized.lower(tree).as_text()) == []
    drop_in = jax.jit(jax.shard_map(
        lambda t: libra_jax.psum(jax.tree.map(lambda x: x[0], t), "data"),
        mesh=mesh_of((WORLD,), ("data",)), in_specs=P("data"), out_specs=P(), check_vma=False))
    assert _collectives_with_empty_arrays(drop_in.lower(tree).as_text()) == []
    check_bucket(tree, overlap)


# --- every group's start has its done ------------------------------------------------

#: A start's line in a compiled CPU program: its result tuple (members, then the token).
_CPU_START = re.compile(r"= \(([^)]*)\) custom-call\([^\n]*custom_call_target="
                        r"\"libra_allreduce_cpu_start\"")


def test_compiled_starts_and_dones_per_dtype_group():
    """In the compiled CPU program: one start and one done per dtype group that holds data,
    none for a group of empty members (their results are constants), and every start's
    token read (by its done, or by the next start of its bucket, whose token its done
    reads), so XLA deletes no start whose done it keeps."""
    tree = tree_of([((8, 0), jnp.bfloat16), ((8, 5), np.float32), ((0,), np.int32),
                    ((3,), np.float16), ((2,), np.float16), ((0, 4), np.float32)])
    optimized = jax.jit(libra_jax.optimize(psum_step(), overlap="start-done"))
    hlo = optimized.lower(tree).compile().as_text()
    starts = _CPU_START.findall(hlo)
    groups = sorted(tuple(sorted(re.findall(r"(\w+)\[", results)[:-1])) for results in starts)
    assert groups == [("f16", "f16"), ("f32",)], starts
    assert hlo.count('custom_call_target="libra_allreduce_cpu_done"') == len(starts)
    # The start over the f16 members reads the f32 start's token (or the reverse): chained.
    start_names = re.findall(r"\n\s*(\S+) = \([^)]*\) custom-call\([^\n]*"
                             r"libra_allreduce_cpu_start", hlo)
    for name in start_names:
        readers = re.findall(rf"get-tuple-element\([^)]*%?{re.escape(name)}\), index=(\d+)",
                             hlo)
        assert readers, (name, hlo)


@pytest.mark.skipif(not _ffi.HAS_CUDA, reason="libra_jax built without CUDA")
def test_cuda_lowering_starts_a_group_of_empty_members_nowhere(monkeypatch):
    """On CUDA with the P2P kernels (lowered here; NCCL's in tests/test_nccl.py, against its
    stub): the same per group."""
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    _ffi.ensure_cuda_registered()
    tree = tree_of([((8, 0), jnp.bfloat16), ((8, 4), np.float32), ((8,), np.float16),
                    ((0,), np.int32)])
    text = jax.jit(libra_jax.optimize(psum_step(), overlap="start-done")).trace(tree).lower(
        lowering_platforms=("cuda",)).as_text()
    # f32 and f16 (16 bytes: whole vectors); no start for the bf16 and s32 groups
    assert check_start_done_pairs(text, "libra_allreduce_cuda_start", None) == 2


# --- generated buckets ------------------------------------------------------------

_SHAPES = st.sampled_from([(), (1,), (0,), (8, 0), (0, 3), (5,), (2, 3), (16,), (3, 1, 2)])
_DTYPE = st.sampled_from(DTYPES)


@st.composite
def buckets(draw):
    """1 to 200 leaves of any dtype and shape (empty, scalar and (1,) ones likely), and a
    dtype whose only members are empty (the defect's trigger) where the draw says so."""
    leaves = draw(st.lists(st.tuples(_SHAPES, _DTYPE), min_size=1, max_size=200))
    if draw(st.booleans()):
        used = {np.dtype(d) for _, d in leaves}
        free = [d for d in DTYPES if np.dtype(d) not in used]
        if free:
            empty_dtype = draw(st.sampled_from(free))
            leaves += [((0,), empty_dtype)] * draw(st.integers(1, 3))
    return leaves, draw(st.sampled_from(OVERLAPS))


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(buckets())
@example(([((8, 0), jnp.bfloat16), ((8, 5), np.float32)], "start-done"))
@example(([((8, 0), np.int32), ((8, 5), np.float32)], "auto"))
@example(([((8, 0), np.float32), ((8, 5), jnp.bfloat16)], "start-done"))
@example(([((0,), np.float16)], "start-done"))
@example(([((), np.float32), ((1,), jnp.bfloat16), ((0,), np.int8)], "sync"))
def test_generated_buckets_are_jax_psum(case):
    """Random pytrees (1 to 200 leaves) through `optimize` under every overlap form and the
    drop-in `libra_jax.psum`, compared with JAX's psum: the control bitwise, plain within
    class 3. `derandomize`: CI runs the same examples every time (12, and the explicit
    ones: each a program of its own, compiled 3 times)."""
    leaves, overlap = case
    tree = tree_of(leaves)
    check_bucket(tree, overlap)
    mesh = mesh_of((WORLD,), ("data",))
    drop_in = jax.jit(jax.shard_map(
        lambda t: libra_jax.psum(jax.tree.map(lambda x: x[0], t), "data"), mesh=mesh,
        in_specs=P("data"), out_specs=P(), check_vma=False))
    assert_codegen_close(drop_in(tree), jax.jit(psum_step(psum=psum_of_what_xla_compiles))(tree))
