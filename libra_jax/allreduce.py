"""`libra_jax.psum`: a drop-in for `jax.lax.psum` that all-reduces with Libra's engine.

The primitive `libra_psum` stands for exactly the psum that `jax.lax.psum` would
bind (`psum_invariant` under `shard_map(check_vma=True)`, `psum` otherwise): its
abstract evaluation *is* that primitive's, so output types (shape, dtype,
weak type, varying axes) and effects are the same by construction. It differs
in its lowering: on CPU it becomes the `libra_allreduce_cpu` custom call, which
carries its block count; elsewhere it lowers to XLA's all-reduce.

Cases the engine does not serve are handed to `jax.lax.psum` itself (with a
one-time warning): axes bound by `vmap` or positional axes, `axis_index_groups`,
bool and dtypes outside f32/f64/bf16/f16/s32/s64, unreduced inputs. Values that
are not traced (Python scalars, constants) need no communication and also go
to `jax.lax.psum`, silently.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from functools import partial
from typing import Any, Callable, Hashable, Iterator, Sequence

import jax
import numpy as np

from libra_jax import _compat, _ffi, _nccl, model

__all__ = ["psum", "pmean", "patch_lax", "default_blocks", "MAX_BLOCKS", "libra_psum_p"]

# JAX's own functions, taken at import: libra_jax calls these (for constants, the axis
# size, delegated psums), never `jax.lax.psum` by its live name, which code may have
# patched to `libra_jax.psum` (`patch_lax`).
_JAX_PSUM = jax.lax.psum
_JAX_PMEAN = jax.lax.pmean

#: Largest block count (engine worker tasks per all-reduce).
MAX_BLOCKS: int = _ffi.MAX_BLOCKS

AxisName = Hashable
_SUPPORTED_DTYPES = frozenset(
    np.dtype(d) for d in (np.float32, np.float64, jax.numpy.bfloat16, np.float16, np.int32, np.int64)
)
_DEFAULT_TIMEOUT_S = 300.0
#: Built-in profile per platform, used until the backend is calibrated: `model`'s table,
#: its one home (kept here under this name, which the docs use).
DEFAULT_PROFILES = model.BUILTIN_PROFILES
#: With no overlap known, a block costs this fraction of the all-reduce's time
#: (the SM penalty NCCL's symmetric kernels used).
BLOCK_PENALTY = 0.025


def psum(x: Any, axis_name: AxisName | Sequence[AxisName], *,
         axis_index_groups: Sequence[Sequence[int]] | None = None,
         blocks: int | None = None, inplace: bool | None = None) -> Any:
    """All-reduce sum over mapped axes, like `jax.lax.psum`, with a chosen block count.

    Args:
      x: array or pytree of arrays, inside `jax.shard_map` or `jax.pmap`.
      axis_name: a mesh axis name or a tuple of them.
      axis_index_groups: as in `jax.lax.psum`; such psums are delegated to it.
      blocks: how many engine worker tasks (the CPU counterpart of CUDA thread
        blocks) carry out each all-reduce, 1..`MAX_BLOCKS`. ``None``: the
        contention model chooses (`default_blocks`) when the program is lowered,
        or `libra_jax.optimize` plans it. Recorded in the HLO either way.
      inplace: write the result over the input buffer (the custom call's output
        aliases its input). Free when the input is an intermediate value or a
        donated argument; for a live value XLA copies the input first. ``None``
        (default): in place unless `x` is an argument of the traced function.

    Returns:
      The same as `jax.lax.psum(x, axis_name)`, bit for bit on CPU.

    Raises:
      NameError: an axis name is not bound.
      ValueError: `blocks` is outside 1..MAX_BLOCKS.
      TypeError: `blocks` is not an int, or is given for a psum that is
        delegated to `jax.lax.psum` (which has no block count).
    """
    _check_blocks(blocks)
    if inplace is not None and not isinstance(inplace, bool):
        raise TypeError(f"libra_jax.psum: inplace must be True, False or None, got {inplace!r}")
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if axis_index_groups is not None:
        return _delegate(x, axis_name, "axis_index_groups is not supported", blocks,
                         axis_index_groups=axis_index_groups)
    for name in axes:
        if not isinstance(name, int) and not _compat.axis_is_bound(name):
            _unbound_axis(x, axis_name, name)
    manual = _compat.manual_axes()
    mapped = [name for name in axes if not isinstance(name, int) and name in manual]
    if len(mapped) < len(axes):
        # Only axes bound by vmap (or positional ones): a sum within each device, no
        # communication, so nothing to warn about (shape-only traces under vmap, such as
        # eqx.filter_pmap's, see nothing else). With a mesh axis among them, XLA's
        # all-reduce does the communication: said once.
        return _delegate(x, axis_name, "axes bound by vmap or positional axes are reduced "
                         "by XLA", blocks, quiet=not mapped)
    axes = _compat.skip_size_one_axes(axes)
    if not axes:
        return x
    return jax.tree_util.tree_map(partial(_psum_leaf, axes=axes, blocks=blocks, inplace=inplace), x)


@contextlib.contextmanager
def patch_lax() -> Iterator[None]:
    """Within the block, `jax.lax.psum` and `jax.lax.pmean` are `libra_jax.psum` and
    `libra_jax.pmean`: a way to try the drop-in on existing code without editing it. The
    previous functions come back on exit (also on an error).

    Limits: it acts when code is traced, so a function jitted and traced before the block
    keeps XLA's psum (trace it inside); a ``from jax.lax import psum`` taken earlier still
    names JAX's; the psums autodiff inserts (`check_vma`) are not `lax.psum` calls (use
    `libra_jax.optimize` for those). It does reach library code that calls
    ``jax.lax.psum``/``pmean`` by that name, such as Flax's BatchNorm with ``axis_name``.
    It changes a module attribute: not for several threads tracing at once.
    """
    saved = jax.lax.psum, jax.lax.pmean
    jax.lax.psum, jax.lax.pmean = psum, pmean
    try:
        yield
    finally:
        jax.lax.psum, jax.lax.pmean = saved


def pmean(x: Any, axis_name: AxisName | Sequence[AxisName], *,
          axis_index_groups: Sequence[Sequence[int]] | None = None,
          blocks: int | None = None, inplace: bool | None = None) -> Any:
    """All-reduce mean: `psum` divided by the number of participants, like `jax.lax.pmean`."""
    if axis_index_groups is not None:
        _check_blocks(blocks)
        return _delegate(x, axis_name, "axis_index_groups is not supported", blocks,
                         axis_index_groups=axis_index_groups, op=_JAX_PMEAN)
    total = psum(x, axis_name, blocks=blocks, inplace=inplace)
    n = _JAX_PSUM(1, axis_name)
    return jax.tree_util.tree_map(lambda v: v / n, total)


def default_blocks(nbytes: int, world: int, profile: Any = "cpu-host") -> int:
    """Block count of a psum with `blocks=None` outside `@libra_jax.optimize`.

    With no overlapped compute known, it minimises the model's predicted time
    of an all-reduce of `nbytes` per rank among `world` ranks, times
    (1 + `BLOCK_PENALTY` x blocks): more blocks must buy proportionally more
    speed. `profile` is a profile name, path or `model.Profile`.
    """
    if world < 2 or nbytes <= 0:
        return 1
    derivation = _derive(profile, world)
    cost = derivation.cost

    def score(key: int) -> tuple[float, int]:
        blocks = derivation.launch_shape(key)[0]
        seconds = cost.latency_s + nbytes / cost.solo_bw[key]
        return seconds * (1 + BLOCK_PENALTY * blocks), blocks

    best = min(sorted(cost.solo_bw), key=score)
    return int(min(MAX_BLOCKS, max(1, derivation.launch_shape(best)[0])))


def _default_profile(platform: str) -> str:
    """The calibrated profile of `platform` if there is one, else `DEFAULT_PROFILES`'."""
    return model.default_profile(platform, DEFAULT_PROFILES[platform])


@functools.lru_cache(maxsize=64)
def _derive(profile: Any, world: int) -> Any:
    from libra_jax import model

    return model.derive(profile, world)


# --- Front end helpers ------------------------------------------------------

def engine_dtype(dtype: Any) -> np.dtype | None:
    """`dtype` as the numpy dtype the engine reduces, or None where it does not: outside
    `_SUPPORTED_DTYPES`, and JAX's extended dtypes (PRNG keys, ``key<fry>``), which numpy
    cannot even name."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None
    dtype = np.dtype(dtype)
    return dtype if dtype in _SUPPORTED_DTYPES else None


def _check_blocks(blocks: int | None) -> None:
    if blocks is None:
        return
    if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)):
        raise TypeError(f"libra_jax.psum: blocks must be an int or None, got {blocks!r}")
    if not 1 <= blocks <= MAX_BLOCKS:
        raise ValueError(f"libra_jax.psum: blocks must be in [1, {MAX_BLOCKS}], got {blocks}")


def warn_invariant_operand(axes: tuple, who: str) -> None:
    """Say once that a psum's operand is already the same on every device of `axes` (under
    `check_vma`), which is almost always a gradient summed twice: `jax.grad` of a
    replicated parameter already sums its cotangent over the axis, so a psum of it
    multiplies by the axis size and a pmean leaves that sum, not the mean."""
    _warn_once(
        f"{who}: a psum over {', '.join(map(repr, axes))} of an array that is already "
        "invariant over it (check_vma): the result is the axis size times the array (pmean: "
        "the array itself). Under jax.shard_map's default check_vma=True, jax.grad already "
        "sums a replicated parameter's gradient over the axis: pmean the loss inside the "
        "differentiated function instead, or use check_vma=False for per-device gradients.")


def _unbound_axis(x: Any, axis_name: Any, name: Any) -> None:
    """Raise what `jax.lax.psum` raises for an unbound axis in this context (its message
    differs between eager and traced code), with libra's hint added."""
    hint = (f"libra_jax.psum: call it inside jax.shard_map or jax.pmap over a mesh with an "
            f"axis named {name!r}.")
    try:
        _JAX_PSUM(x, axis_name)
    except Exception as e:  # noqa: BLE001 - whatever JAX raises, as it raises it
        e.add_note(hint)
        raise
    raise NameError(f"unbound axis name: {name}. {hint}")  # JAX accepted it: say so anyway


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


def _delegate(x: Any, axis_name: Any, reason: str, blocks: int | None, *,
              op: Any = _JAX_PSUM, quiet: bool = False, **kwargs: Any) -> Any:
    if blocks is not None:
        raise TypeError(
            f"libra_jax.psum: blocks={blocks} cannot be honoured: {reason}, so this psum is "
            "done by jax.lax.psum, which has no block count. Drop blocks= here.")
    if not quiet:
        _warn_once(f"libra_jax.psum: {reason}; delegating to jax.lax.psum.")
    return op(x, axis_name, **kwargs)


def _psum_leaf(leaf: Any, *, axes: tuple, blocks: int | None, inplace: bool | None) -> Any:
    if not isinstance(leaf, _compat.Tracer):
        return _JAX_PSUM(leaf, axes)  # A constant: no communication needed.
    aval = jax.typeof(leaf)
    state = _compat.input_state(aval, axes)
    if state in ("unreduced", "reduced"):
        return _delegate(leaf, axes, f"{state} inputs are not supported", blocks)
    dtype = engine_dtype(aval.dtype)
    if dtype is None:
        return _delegate(leaf, axes, f"dtype {aval.dtype} is not supported by the engine",
                         blocks)
    if inplace is None:
        inplace = not _compat.is_traced_argument(leaf)
    invariant = _compat.check_vma_enabled()
    if invariant and _compat.auto_pcast_enabled():
        # As lax.psum: make the value varying over every reduced axis first.
        missing = tuple(a for a in axes if a not in _compat.varying_axes(aval))
        if missing:
            warn_invariant_operand(missing, "libra_jax.psum")
            leaf = _compat.pvary(leaf, missing)
    return libra_psum_p.bind(leaf, axes=axes, blocks=None if blocks is None else int(blocks),
                             inplace=inplace, invariant=invariant)


# --- The primitive ----------------------------------------------------------

libra_psum_p = _compat.Primitive("libra_psum")


def _mirrored(invariant: bool, axes: tuple) -> tuple[Any, dict]:
    """The JAX primitive (and its params) that `libra_psum` stands for."""
    if invariant:
        return _compat.psum_invariant_p, {"axes": axes}
    return _compat.psum_p, {"axes": axes, "axis_index_groups": None}


def _abstract_eval(aval: Any, *, axes: tuple, blocks: int, inplace: bool,
                   invariant: bool) -> Any:
    prim, params = _mirrored(invariant, axes)
    return prim.abstract_eval(aval, **params)


def _cpu_lowering(ctx: Any, x: Any, *, axes: tuple, blocks: int, inplace: bool,
                  invariant: bool) -> Any:
    call, reason = _cpu_call(ctx, axes, blocks)
    if call is None:
        return _xla_lowering(ctx, x, axes=axes, blocks=blocks, inplace=inplace,
                             invariant=invariant, reason=reason)
    rank_group, attrs = call
    aval_in, = ctx.avals_in
    call_ctx = ctx.replace(avals_in=[aval_in, _compat.ShapedArray((2,), np.int32)])
    rule = jax.ffi.ffi_lowering(_ffi.ALLREDUCE_CPU_TARGET,
                                operand_output_aliases={0: 0} if inplace else {})
    return rule(call_ctx, x, rank_group, **attrs)


def _cpu_call(ctx: Any, axes: tuple, blocks: int | None) -> tuple[tuple | None, str]:
    """The engine call's (rank, group) operand and attributes for the psum lowered at
    `ctx`, or ``(None, reason)`` where XLA's all-reduce must do it. Shared by the call
    and the start/done pair (`libra_jax.overlap`)."""
    groups = _compat.replica_groups(ctx, axes)
    if groups is None:
        return None, "a partially automatic shard_map"
    devices = _compat.mesh_devices(ctx)
    if devices is not None and any(d.process_index != jax.process_index() for d in devices):
        # The engine meets the devices of this process only; XLA's collectives
        # (gloo on CPU) cross processes. Never wait for ranks that cannot come.
        return None, "cpu devices of several processes"
    _ffi.ensure_registered()
    aval_in = ctx.avals_in[0]
    if blocks is None:  # Chosen now that the group size is known.
        nbytes = math.prod(aval_in.shape) * np.dtype(aval_in.dtype).itemsize
        blocks = default_blocks(nbytes, len(groups[0]), _default_profile("cpu"))
    # (rank, group) of every device, looked up by the running device's index:
    # rank is the position in XLA's replica group, so the summation order is XLA's.
    table = np.zeros((1 + max(max(g) for g in groups), 2), np.int32)
    for group_id, members in enumerate(groups):
        for rank, device in enumerate(members):
            table[device] = (rank, group_id)
    i32 = _compat.ir.IntegerType.get_signless(32)
    zero = _compat.ir_constant(np.int32(0))
    row = _compat.hlo.dynamic_slice(
        _compat.ir_constant(table), [_compat.device_index(ctx), zero],
        _compat.ir.DenseI64ArrayAttr.get([1, 2]))
    rank_group = _compat.hlo.reshape(_compat.ir.RankedTensorType.get([2], i32), row)
    return (rank_group, dict(label=f"psum{tuple(axes)}", world=np.int64(len(groups[0])),
                             blocks=np.int64(blocks),
                             timeout_ms=np.int64(timeout_ms()))), ""


_CUDA_ALGORITHMS = {"auto": 0, "oneshot": 1, "twoshot": 2}
_CUDA_DTYPES = frozenset(
    np.dtype(d) for d in (np.float32, np.float64, jax.numpy.bfloat16, np.float16, np.int32))
_CUDA_VECTOR_BYTES = 16


#: The GPU data path switch: which all-reduce a psum lowered for CUDA becomes.
CUDA_PATH_ENV = "LIBRA_JAX_CUDA"
#: ``xla`` (the default): XLA's own all-reduce (NCCL, scheduled by XLA); libra's plan is
#: made and reported, its block counts are not applied. ``p2p``: libra's peer-to-peer
#: kernels among the GPUs of one process (and, across processes, inside each process with
#: NCCL between them). ``nccl``: libra's NCCL call with the block count as its CTA limit,
#: for groups that span processes (in one process: XLA's, until that path exists). None of
#: libra's GPU paths has run on a GPU yet, so both are opt-in.
CUDA_PATHS = ("xla", "p2p", "nccl")


def cuda_path() -> str:
    """The GPU data path `$LIBRA_JAX_CUDA` selects (`CUDA_PATHS`); ValueError naming the
    variable for anything else."""
    raw = os.environ.get(CUDA_PATH_ENV, "")
    path = raw.strip().lower() or "xla"
    if path not in CUDA_PATHS:
        raise ValueError(f"{CUDA_PATH_ENV} must be one of {', '.join(CUDA_PATHS)}, got {raw!r}")
    return path


def _cuda_default_reason() -> str:
    return (f"cuda ({CUDA_PATH_ENV}=xla, the default: libra's GPU all-reduces have not run on a "
            f"GPU yet; {CUDA_PATH_ENV}=p2p or {CUDA_PATH_ENV}=nccl opts in)")


def _cuda_kernel_attrs(ctx: Any, axes: tuple, blocks: int | None) -> tuple[dict | None, str]:
    """The attributes of libra's P2P kernel call for the psum lowered at `ctx`
    (among the GPUs of this process), or ``(None, reason)`` where the kernels do
    not serve it; ``({}, "")`` for an empty buffer (no call needed). Shared by
    the synchronous call and the start/done pair (`libra_jax.overlap`)."""
    if not _ffi.HAS_CUDA:
        return None, "cuda (libra_jax was built without CUDA)"
    path = cuda_path()
    if path == "xla":
        return None, _cuda_default_reason()
    if path != "p2p":
        return None, (f"cuda groups inside one process with {CUDA_PATH_ENV}={path} (libra's "
                      "NCCL call serves groups that span processes)")
    groups = _compat.replica_groups(ctx, axes)
    if groups is None:
        return None, "cuda in a partially automatic shard_map"
    devices = _compat.mesh_devices(ctx)
    if devices is not None and any(d.process_index != jax.process_index() for d in devices):
        return None, "cuda groups that span processes"
    world = len(groups[0])
    if world > _ffi.CUDA_MAX_RANKS:
        return None, f"cuda groups of more than {_ffi.CUDA_MAX_RANKS} GPUs"
    aval_in, = ctx.avals_in
    dtype = np.dtype(aval_in.dtype)
    if dtype not in _CUDA_DTYPES:
        return None, f"cuda {dtype.name}"
    count = math.prod(aval_in.shape)
    if count == 0:
        return {}, ""
    if devices is None:
        # An abstract mesh (lowering for export): device i of the mesh is taken
        # to be CUDA device i of the process that runs it.
        ordinals = list(range(1 + max(max(g) for g in groups)))
    elif any(d.platform != "gpu" for d in devices):
        ordinals = list(range(len(devices)))  # Lowering for cuda from a CPU mesh.
    else:
        ordinals = [int(d.local_hardware_id) for d in devices]
    if blocks is None:  # Chosen now that the group size is known.
        blocks = default_blocks(count * dtype.itemsize, world, _default_profile("cuda"))
    return dict(devices=np.array([ordinals[d] for g in groups for d in g], np.int32),
                world=np.int64(world), blocks=np.int64(blocks),
                algorithm=np.int64(_cuda_algorithm()),
                timeout_ms=np.int64(timeout_ms())), ""


def _cuda_lowering(ctx: Any, x: Any, *, axes: tuple, blocks: int, inplace: bool,
                   invariant: bool) -> Any:
    """The psum on a GPU, by the data path `cuda_path` selects: XLA's all-reduce (``xla``,
    the default), the `libra_allreduce_cuda` custom call (``p2p``: libra's P2P kernels with
    `blocks` thread blocks among the GPUs of this process) or, for groups that span
    processes, `libra_allreduce_nccl` (``nccl``, and ``p2p`` hierarchically). Falls back to
    XLA's all-reduce (with a one-time notice) for what the chosen path does not serve."""
    fallback = partial(_xla_lowering, ctx, x, axes=axes, blocks=blocks, inplace=inplace,
                       invariant=invariant)
    groups = _compat.replica_groups(ctx, axes)
    devices = _compat.mesh_devices(ctx)
    path = cuda_path()
    if (_ffi.HAS_CUDA and path != "xla" and groups is not None and devices is not None
            and any(d.process_index != jax.process_index() for d in devices)):
        return _nccl_lowering(ctx, x, groups=groups, devices=devices, blocks=blocks,
                              inplace=inplace, fallback=fallback,
                              hierarchical=path == "p2p")
    attrs, reason = _cuda_kernel_attrs(ctx, axes, blocks)
    if attrs is None:
        return fallback(reason=reason)
    if not attrs:
        return [x]
    aval_in, = ctx.avals_in
    dtype = np.dtype(aval_in.dtype)
    count = math.prod(aval_in.shape)
    pad = (-count * dtype.itemsize % _CUDA_VECTOR_BYTES) // dtype.itemsize  # 16-byte vectors
    _ffi.ensure_cuda_registered()
    operand, call_ctx, aliases = x, ctx, {0: 0} if inplace else {}
    if pad:
        flat = _compat.ShapedArray((count + pad,), dtype)
        flat_type = _compat.ir_tensor_type(ctx, (count,), dtype)
        operand = _compat.hlo.pad(
            _compat.hlo.reshape(flat_type, x), _compat.ir_constant(np.zeros((), dtype)),
            _compat.ir.DenseI64ArrayAttr.get([0]), _compat.ir.DenseI64ArrayAttr.get([pad]),
            _compat.ir.DenseI64ArrayAttr.get([0]))
        call_ctx = ctx.replace(avals_in=[flat], avals_out=[flat])
        aliases = {0: 0}  # The padded copy is an intermediate.
    rule = jax.ffi.ffi_lowering(_ffi.ALLREDUCE_CUDA_TARGET, operand_output_aliases=aliases)
    result, = rule(call_ctx, operand, **attrs)
    if pad:
        result = _compat.hlo.slice(result, _compat.ir.DenseI64ArrayAttr.get([0]),
                                   _compat.ir.DenseI64ArrayAttr.get([count]),
                                   _compat.ir.DenseI64ArrayAttr.get([1]))
        result = _compat.hlo.reshape(_compat.ir_tensor_type(ctx, aval_in.shape, dtype), result)
    return [result]


def _nccl_lowering(ctx: Any, x: Any, *, groups: list, devices: Sequence[Any], blocks: int | None,
                   inplace: bool, fallback: Callable[..., Any], hierarchical: bool) -> Any:
    """The `libra_allreduce_nccl` custom call, for groups that span processes:
    NCCL with `blocks` as the call's CTA limit (cpp/libra/nccl.h).

    Flat: every GPU is one NCCL rank of its group. Hierarchical (`hierarchical`: the
    ``p2p`` path, which opts in to the P2P kernels), when every
    process holds the same number L > 1 of each group's GPUs (and the kernels
    serve the buffer): libra's P2P kernels sum inside the process, local GPU j
    all-reduces slice j of the sum over NCCL with the j-th GPUs of the other
    processes, and a second P2P pass gathers the slices (xla_ffi/cuda_allreduce.cc).
    Each process lowers its own program: the call's tables map this process's
    GPUs (by local ordinal) to their communicator, rank and local team.
    Communicators' unique ids are exchanged now, through JAX's key-value store
    (libra_jax._nccl).
    """
    ok, why = _nccl.available()
    if not ok:
        return fallback(reason=f"cuda across processes without NCCL ({why})")
    aval_in, = ctx.avals_in
    dtype = np.dtype(aval_in.dtype)
    count = math.prod(aval_in.shape)
    if count == 0:
        return [x]
    world = len(groups[0])
    nbytes = count * dtype.itemsize
    if blocks is None:
        # Chosen now that the group size is known, from the shipped profile:
        # every process must pick the same count (and, on older NCCL, the same
        # communicator), and a host's own calibration is not shared here
        # (optimize broadcasts process 0's profile; a bare psum cannot).
        blocks = default_blocks(nbytes, world, DEFAULT_PROFILES["cuda"])
    me = jax.process_index()
    local = [d for d in devices if d.process_index == me]
    # A GPU's local ordinal; a CPU mesh (lowering for cuda in tests) counts its devices.
    ordinal = {d.id: (int(d.local_hardware_id) if d.platform == "gpu" else i)
               for i, d in enumerate(local)}
    per_process = [_by_process(devices, members) for members in groups]
    sizes = {len(ids) for g in per_process for ids in g.values()}
    local_world = sizes.pop() if len(sizes) == 1 and hierarchical else 1
    if (local_world > _ffi.CUDA_MAX_RANKS or nbytes % _CUDA_VECTOR_BYTES
            or dtype not in _CUDA_DTYPES):
        local_world = 1  # flat: one NCCL rank per GPU
    rows = 1 + max(ordinal.values(), default=0)
    comm_ids = np.full(rows, -1, np.int64)
    ranks = np.full(rows, -1, np.int32)
    teams = np.full((rows, local_world), -1, np.int32)
    for members, by_process in zip(groups, per_process):
        if me not in by_process:
            continue
        if local_world == 1:  # ranks in XLA's group order
            lines = [([devices[i].id for i in members], [devices[i] for i in members])]
        else:  # line j: the j-th GPU of every process, processes in group order
            line_devices = [[devices[ids[j]] for ids in by_process.values()]
                            for j in range(local_world)]
            lines = [([d.id for d in ds], ds) for ds in line_devices]
        for ids, line in lines:
            if not any(d.process_index == me for d in line):
                continue
            comm_id = _nccl.communicator(ids, blocks=blocks,
                                         holds_root=line[0].process_index == me,
                                         timeout_s=_timeout_s())
            for rank, d in enumerate(line):
                if d.process_index == me:
                    comm_ids[ordinal[d.id]] = comm_id
                    ranks[ordinal[d.id]] = rank
        team = [ordinal[devices[i].id] for i in by_process[me]]
        for i in by_process[me]:
            teams[ordinal[devices[i].id]] = team if local_world > 1 else [ordinal[devices[i].id]]
    _ffi.ensure_cuda_registered()
    rule = jax.ffi.ffi_lowering(_ffi.ALLREDUCE_NCCL_TARGET,
                                operand_output_aliases={0: 0} if inplace else {})
    return rule(ctx, x, comm_ids=comm_ids, ranks=ranks,
                nranks=np.int64(world // local_world), ctas=np.int64(blocks),
                local_teams=teams.reshape(-1), local_world=np.int64(local_world),
                timeout_ms=np.int64(timeout_ms()))


def _by_process(devices: Sequence[Any], members: Sequence[int]) -> dict[int, list[int]]:
    """A group's members (indices into `devices`) by process, in group order."""
    out: dict[int, list[int]] = {}
    for i in members:
        out.setdefault(devices[i].process_index, []).append(i)
    return out


def _cuda_algorithm() -> int:
    raw = os.environ.get("LIBRA_JAX_CUDA_ALGORITHM", "auto").strip().lower() or "auto"
    if raw not in _CUDA_ALGORITHMS:
        raise ValueError("LIBRA_JAX_CUDA_ALGORITHM must be one of "
                         f"{', '.join(_CUDA_ALGORITHMS)}, got {raw!r}")
    return _CUDA_ALGORITHMS[raw]


def _xla_lowering(ctx: Any, x: Any, *, axes: tuple, blocks: int, inplace: bool,
                  invariant: bool, reason: str | None = None, quiet: bool = False) -> Any:
    """XLA's own all-reduce, where the engine has no target (or, `quiet`, where it is
    asked for: `optimize(collectives="xla")`); `blocks` is ignored."""
    platforms = "/".join(ctx.module_context.platforms)
    if not quiet:
        _warn_once(f"libra_jax.psum: no Libra all-reduce for {reason or platforms}; "
                   "lowering to XLA's all-reduce (blocks ignored).")
    aval_in, = ctx.avals_in
    # A buffer packed during lowering (fused, start/done) carries no varying axes: psum's
    # lowering is the same all-reduce as psum_invariant's and takes it.
    varying = invariant and set(axes) <= set(_compat.varying_axes(aval_in))
    prim, params = _mirrored(varying, axes)
    return _compat.lower_fun(partial(prim.bind, **params))(ctx, x)


#: How long a rank waits for the others: `$LIBRA_JAX_TIMEOUT_S` seconds (default 300).
TIMEOUT_ENV = "LIBRA_JAX_TIMEOUT_S"
#: The longest finite timeout accepted (116 days): the engine's and the CUDA kernels' clocks
#: add it to a time stamp in nanoseconds, which must not overflow.
MAX_TIMEOUT_S = 1e7

def _timeout_s() -> float:
    """`$LIBRA_JAX_TIMEOUT_S` in seconds: inf for "wait forever" (``inf`` or ``0``), else
    0 < t <= MAX_TIMEOUT_S; anything else is a ValueError naming the variable."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value == 0 or value == math.inf:
        return math.inf
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                         f"or inf or 0 to wait forever; got {raw!r}")
    return value


def timeout_ms() -> int:
    """The timeout as the engine's and the CUDA handler's milliseconds: 0 waits forever, and
    any positive timeout is at least 1 ms (rounded up: 0.4 ms must not become "forever")."""
    seconds = _timeout_s()
    return 0 if seconds == math.inf else max(1, math.ceil(seconds * 1000))


def kv_timeout_ms() -> int:
    """The timeout for a wait in JAX's key-value store, in its milliseconds."""
    return _compat.kv_wait_ms(_timeout_s())


def _transpose(ct: Any, x: Any, *, axes: tuple, blocks: int, inplace: bool,
               invariant: bool) -> tuple:
    if _compat.is_zero_cotangent(ct):
        return (_compat.zero_cotangent(x),)
    if invariant:  # psum_invariant's transpose: the cotangent, cast to varying.
        return (_compat.pvary(ct, axes),)
    # psum's transpose is psum (psum = psum + pbroadcast).
    return (libra_psum_p.bind(ct, axes=axes, blocks=blocks, inplace=True, invariant=False),)


def _batcher(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[Any], *,
             axes: tuple, blocks: int, inplace: bool, invariant: bool) -> tuple[Any, Any]:
    (x,), (dim,) = vals_in, dims_in
    if axis_data.name in axes:
        # A vmapped axis among the reduced ones is reduced by XLA, as lax.psum does.
        prim, params = _mirrored(invariant, axes)
        return _compat.jax_batcher(prim)(axis_data, vals_in, dims_in, **params)
    return libra_psum_p.bind(x, axes=axes, blocks=blocks, inplace=inplace,
                             invariant=invariant), dim


libra_psum_p.def_impl(partial(_compat.apply_primitive, libra_psum_p))
libra_psum_p.def_effectful_abstract_eval(_abstract_eval)
_compat.deflinear(libra_psum_p, _transpose)
_compat.register_batcher(libra_psum_p, _batcher)
_compat.register_lowering(libra_psum_p, _xla_lowering)
_compat.register_lowering(libra_psum_p, _cpu_lowering, platform="cpu")
_compat.register_lowering(libra_psum_p, _cuda_lowering, platform="cuda")
