"""How a collective is lowered: one rule per platform over a row of `libra_jax.collectives`.

Every libra op (`psum`, `sharded`, `fused`, `start_done`) describes what it lowers as a
`Call`: the kind's row, the mesh axes, the block count, the dimension it scatters or gathers,
and the JAX primitive that does the same (XLA's own, `Call.xla`). One rule per platform
(`rule`, registered in `_RULES`) lowers any row:

* ``"cpu"``: the engine's custom call (`_engine_emit`: the (rank, group) operand and attributes
  of `cpu_call`), where the group's devices are this process's and the engine sums the dtype;
* ``"cuda"``: by `$LIBRA_JAX_CUDA` (`config.cuda_path`, `gpu_call`): XLA's (the default),
  libra's P2P kernels (the all-reduce: the rows the extension registers a ``cuda`` target for)
  or NCCL's call (`nccl_attrs`);
* ``None`` (TPU, ...): XLA's, with the notice; ``"xla"`` (the ops' twins,
  `optimize(collectives="xla")`): XLA's, quietly.

Where libra's call does not serve, the rule lowers XLA's collective (`xla_collective`) with one
notice naming why (``xla-fallback``). What differs between the kinds is their row's layout
(`collectives.LAYOUTS`): what a call's operand and result are, and the ``segment`` of a sharded
call. A start/done pair asks the same question for its flat buffers (`pair_call`). A call with
``blocks=None`` gets `blocks.resolve_blocks` (the model's choice without overlap, within the
data path's cap) here, once the group size is known.

One call shape: every emitter (`libra_call`: one per engine, the CPU engine's `_engine_emit`,
the GPU's `_gpu_emit` for the P2P kernels and NCCL) takes a list of members, the operands at
its `ctx` (one dtype), and gives one result per member; a single buffer is a one-member call.
A bucket's members are one call as they are (`lower_members`: variadic targets, one operand
and one result per member, no copy; start/done likewise, `libra_jax.ops.start_done`); where
the call takes one buffer (XLA's collective) they are packed into one buffer per dtype
(`packing.pack`, `packing.split`).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import numpy as np

from libra_jax import _compat, _deprecated, _ffi, _nccl, collectives, config, model
from libra_jax.collectives import Collective
from libra_jax.ops import blocks as block_rule
from libra_jax.ops.base import Platform, Rule, warn_once
from libra_jax.ops.shards import (
    BF16,
    arranged,
    canonical_bf16_nans,
    from_row_of_shards,
    to_row_of_shards,
)

__all__ = ["Call", "PHASES", "PairCall", "Collective", "ENGINE_DTYPES", "rule", "lower",
           "replaced_rule", "libra_call", "xla_collective", "warn_fallback", "engine_lowering",
           "cpu_call", "lower_members", "gpu_call", "pair_call", "nccl_attrs",
           "nccl_blocks",
           "rank_group_operand", "mirrored",
           "default_blocks", "default_profile",
           "MAX_BLOCKS", "CUDA_DTYPES", "NCCL_DTYPES", "CUDA_VECTOR_BYTES"]

#: Largest block count (engine worker tasks per call).
MAX_BLOCKS: int = _ffi.MAX_BLOCKS
#: What the CPU engine sums (cpp/libra/dtype.h); an all-gather copies any dtype of whole bytes.
ENGINE_DTYPES = frozenset(
    np.dtype(d) for d in (np.float32, np.float64, jax.numpy.bfloat16, np.float16, np.int32, np.int64))


CUDA_DTYPES = frozenset(
    np.dtype(d) for d in (np.float32, np.float64, jax.numpy.bfloat16, np.float16, np.int32))
#: What libra's NCCL call reduces (cpp/libra/nccl.cc: ToNcclDataType).
NCCL_DTYPES = CUDA_DTYPES | {np.dtype(np.int64)}
#: The CUDA kernels move 16-byte vectors.
CUDA_VECTOR_BYTES = 16
_RANK_AVAL = _compat.ShapedArray((2,), np.int32)


#: The parts of a collective a call emits (`Call.phase`): the whole of it, or either half of
#: a start/done pair (`libra_jax.ops.start_done`).
PHASES = ("one", "start", "done")


class Call(NamedTuple):
    """One collective as an op asks its platform to lower it: its kind, axes and block count,
    and the part of it emitted (`phase`, with a pair's `key`); its members are the operands
    at the `ctx` it is lowered at (one buffer, or a bucket's members of one dtype), its
    results the results there."""

    #: The kind (`libra_jax.collectives`): its targets, and its layout.
    row: Collective
    #: The mesh axes it runs over.
    axes: tuple
    #: Engine worker tasks, CUDA blocks or NCCL CTAs; None: `default_blocks`.
    blocks: int | None
    #: XLA's own collective of the operand: ``xla(operand_aval) -> (JAX primitive, params)``.
    xla: Callable[[Any], tuple[Any, dict]]
    #: The scattered dimension of the operand, or the gathered one of the result.
    dimension: int = 0
    #: `jax.lax`'s ``tiled``: the scattered (gathered) dimension is split (joined), not dropped.
    tiled: bool = True
    #: The result aliases the operand (an all-reduce in place).
    inplace: bool = False
    #: The exchanged layout's (the all-to-all's): its engine result (in the operand's type)
    #: made the op's, ``arrange(value, world)`` (`ops.exchange.arrange`).
    arrange: Callable[[Any, int], Any] | None = None
    #: A bucket of a sharded kind whose members gather (scatter) along different dimensions:
    #: one per member, in `dimension`'s place (`dimension_of`); (): every member's is
    #: `dimension`.
    member_dimensions: tuple[int, ...] = ()
    #: Which part of the collective is emitted (`PHASES`): ``"one"`` the whole of it;
    #: ``"start"`` issues it, its results the members' buffers in flight, then a token;
    #: ``"done"`` waits for the start of the same `key`, its operands those buffers, then its
    #: start's token and any it must not run before, its results the buffers.
    phase: str = "one"
    #: The key that ties a start to its done (`start_done.call_key`); 0 for one call.
    key: int = 0

    def dimension_of(self, i: int) -> int:
        """Member `i`'s gathered (scattered) dimension."""
        return self.member_dimensions[i] if self.member_dimensions else self.dimension


def rule(platform: Platform) -> Rule:
    """The rule that lowers any row's `Call` on `platform` (`libra_jax.ops.base`):
    ``rule(ctx, x, call) -> [result]``. Looked up when a program is lowered, so that
    `replaced_rule` reaches every op."""
    if platform not in _RULES:
        raise ValueError(f"no collective rule for platform {platform!r}")
    return partial(lower, platform=platform)


def lower(ctx: Any, x: Any, call: Call, platform: Platform) -> Any:
    """`call` of the operand `x` lowered at `ctx` on `platform`, by that platform's rule."""
    return _RULES[platform](ctx, x, call=call)


@contextlib.contextmanager
def replaced_rule(platform: Platform, replacement: Rule) -> Iterator[None]:
    """Within the block, programs lowered for `platform` lower every collective with
    ``replacement(ctx, x, call=call)`` instead (every op: psum, buckets, start/done's one-call
    path); it returns the call's results. A measurement seam: `benchmarks/model_fidelity.py`
    lowers all-reduces as the identity to time compute alone."""
    saved = _RULES[platform]
    _RULES[platform] = replacement
    try:
        yield
    finally:
        _RULES[platform] = saved


def _libra_or_xla(ctx: Any, x: Any, *, call: Call, platform: Platform) -> Any:
    """The rule of every platform: libra's call where it serves, else XLA's. An empty
    buffer's collective is a constant, no call: the same everywhere."""
    if not math.prod(ctx.avals_in[0].shape):
        out = ctx.avals_out[0]
        return [_compat.ir_constant(np.zeros(out.shape, out.dtype))]
    emit, reason = libra_call(ctx, call, platform)
    if emit is None:
        return xla_collective(ctx, x, call, reason)
    return emit(x)


def libra_call(ctx: Any, call: Call, platform: Platform
               ) -> tuple[Callable[..., Sequence[Any]] | None, str | None]:
    """Libra's call for `call` on `platform` over the members lowered at `ctx` (its operands:
    one buffer, a one-member call, or a bucket's members of one dtype), decided before
    anything is emitted: ``(emit, "")``, ``emit(*xs)`` one result per member, where it serves;
    ``(None, reason)`` where XLA's must do it; ``(None, None)`` for the twin (``"xla"``: XLA's,
    quietly). One emitter per engine: the CPU engine's (`_engine_emit`), and on a GPU libra's
    P2P kernels' or NCCL's (`_gpu_emit`)."""
    if platform == "xla":
        return None, None
    if platform == "cpu":
        return _engine_emit(ctx, call)
    if platform == "cuda":
        return _gpu_emit(ctx, call)
    return None, "/".join(ctx.module_context.platforms)


def lower_members(ctx: Any, xs: Sequence[Any], call: Call, platform: Platform
                  ) -> list[Any] | None:
    """`call` of the members `xs` (the operands at `ctx`, of one dtype) as they are, one
    result each, where the platform's call takes them so: libra's (`libra_call`: the CPU
    engine, the P2P kernels, NCCL's member call); the twin (``"xla"``) and a `replaced_rule`
    each member by its own lowering, as it is, so that the code around a bucket is the CPU
    program's. None where the call takes one buffer (XLA's collective: the caller packs the
    members, `packing.pack`). (`call` serves every member: the same layout.)"""
    if platform == "xla" or _RULES[platform] is not _LIBRA_RULES[platform]:
        return [_compat.ir_values(lower(ctx.replace(avals_in=[a], avals_out=[o]), x,
                                        call._replace(dimension=call.dimension_of(i),
                                                      member_dimensions=()),
                                        platform))[0]
                for i, (a, o, x) in enumerate(zip(ctx.avals_in, ctx.avals_out, xs))]
    emit, _ = libra_call(ctx, call, platform)
    return None if emit is None else _compat.ir_values(emit(*xs))


#: Each platform's rule (`rule`): libra's call where it serves, else XLA's (quietly for
#: ``"xla"``, the twins). `replaced_rule` swaps one for a measurement.
_LIBRA_RULES: dict[Platform, Rule] = {platform: partial(_libra_or_xla, platform=platform)
                                      for platform in (None, "cpu", "cuda", "xla")}
_RULES: dict[Platform, Rule] = dict(_LIBRA_RULES)


def xla_collective(ctx: Any, x: Any, call: Call, reason: str | None) -> Any:
    """XLA's own collective for `call` (the JAX primitive `call.xla` names), with the one-time
    notice of why libra's does not serve it (`reason`; None: quietly, the twin)."""
    if reason is not None:
        warn_fallback(call.row, reason)
    prim, params = call.xla(ctx.avals_in[0])
    return _compat.lower_fun(partial(prim.bind, **params))(ctx, x)


def warn_fallback(row: Collective, reason: str) -> None:
    """The one-time notice of a collective lowered to XLA's, and why."""
    warn_once("xla-fallback",
              f"libra_jax.{row.lax}: no Libra {row.kind} for {reason}; lowering to XLA's "
              f"{row.kind} (blocks ignored).")


def mirrored(invariant: bool, axes: tuple) -> tuple[Any, dict]:
    """The JAX primitive (and its params) that `libra_psum` stands for."""
    if invariant:
        return _compat.psum_invariant_p, {"axes": axes}
    return _compat.psum_p, {"axes": axes, "axis_index_groups": None}


def default_blocks(nbytes: int, world: int, profile: Any, collective: Collective) -> int:
    """`libra_jax.ops.blocks.resolve_blocks` in this module's older argument order (kept for
    callers of it; the public form is `libra_jax.default_blocks`)."""
    return block_rule.resolve_blocks(collective, nbytes, world, profile)


def default_profile(platform: str) -> str:
    """The profile a psum with ``blocks=None`` is lowered with on `platform`: the calibrated
    one if there is one, else `model.BUILTIN_PROFILES`'."""
    return model.default_profile(platform)


def _full_bytes(avals: Sequence[Any], row: Collective, world: int) -> int:
    """The full (unsharded) buffers' bytes of a call whose operands are `avals`."""
    nbytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)
    return nbytes * (world if row.gathers else 1)


def _timeout_attr() -> dict:
    """The ``timeout_ms`` attribute every engine, kernel and NCCL call carries."""
    return {"timeout_ms": np.int64(config.timeout_ms())}


# --- CPU: the engine --------------------------------------------------------------------

def _groups_in_this_process(ctx: Any, axes: tuple) -> tuple[Any, Any, str]:
    """(XLA's replica groups of `axes`, the mesh's devices or None, "") where every device of
    the mesh is this process's; (None, None, why) where libra's in-process calls cannot serve."""
    groups = _compat.replica_groups(ctx, axes)
    if groups is None:
        return None, None, "in a partially automatic shard_map"
    devices = _compat.mesh_devices(ctx)
    if devices is not None and any(d.process_index != jax.process_index() for d in devices):
        return None, None, "devices of several processes"
    return groups, devices, ""


def cpu_call(ctx: Any, axes: tuple, blocks: int | None, collective: Collective
             ) -> tuple[tuple | None, str]:
    """The engine call's (rank, group) operand and attributes for the `collective` (its row)
    lowered at `ctx` (its operands the call's members), or ``(None, reason)``
    where XLA's must do it. Shared by the one call (`_engine_emit`) and the start/done pair
    (`pair_call`); the caller adds ``segments``."""
    groups, devices, reason = _groups_in_this_process(ctx, axes)
    if groups is None:
        # The engine meets the devices of this process only; XLA's collectives (gloo on CPU)
        # cross processes. Never wait for ranks that cannot come.
        return None, f"cpu {reason}"
    _ffi.ensure_registered()
    world = len(groups[0])
    if blocks is None:  # Chosen now that the group size is known.
        blocks = block_rule.resolve_blocks(collective, _full_bytes(ctx.avals_in, collective, world),
                                           world, default_profile("cpu"))
    return (rank_group_operand(ctx, groups),
            dict(label=f"{collective.lax}{tuple(axes)}", world=np.int64(world),
                 blocks=np.int64(blocks), **_timeout_attr())), ""


def _engine_emit(ctx: Any, call: Call) -> tuple[Callable[..., Sequence[Any]] | None, str]:
    """The CPU engine's emitter (`libra_call` on CPU), dtypes it does not sum excepted:
    ``emit(*xs)``, one result per operand. The operands at `ctx` are the call's members (one
    buffer, or a bucket's, all of one dtype): the engine takes each where XLA keeps it
    and writes each result to its own output (in place where `call.inplace`), one round and
    one block count for all, no packed copy. A sharded row's member carries its ``segment``:
    the elements of one shard from the call's dimension on, so that every layout is one call
    without a transposed copy (an all-gather's bf16 NaNs made canonical first, as XLA's)."""
    row = call.row
    avals_in, avals_out = list(ctx.avals_in), list(ctx.avals_out)
    dtype = np.dtype(avals_in[0].dtype)
    if not _ffi.has_target(row, "cpu"):
        return None, f"cpu (the extension registers no {row.kind} target)"
    if row.sums and dtype not in ENGINE_DTYPES:
        return None, f"cpu {dtype.name}"
    found, reason = cpu_call(ctx, call.axes, call.blocks, row)
    if found is None:
        return None, reason
    rank_group, attrs = found
    world = int(attrs["world"])
    if row.exchanges:  # one segment per rank along the split dimension
        segments = [math.prod(a.shape[call.dimension:]) // world for a in avals_in]
        engine_out = avals_in  # the exchanged segments, in the operand's shape (`arrange`)
    else:
        shards = avals_in if row.gathers else avals_out
        segments = [math.prod(a.shape[call.dimension_of(i):])
                    if row.gathers or row.scatters else 0 for i, a in enumerate(shards)]
        engine_out = avals_out
    attrs["segments"] = np.array(segments, np.int64)
    lowered = engine_lowering(
        _ffi.target(row, "cpu"),
        {1 + i: i for i in range(len(avals_in))} if call.inplace else {})

    def emit(*xs: Any) -> Sequence[Any]:
        if not row.sums and dtype == BF16:
            xs = tuple(canonical_bf16_nans(ctx.replace(avals_in=[a]), x)
                       for a, x in zip(avals_in, xs))
        results = lowered(ctx.replace(avals_in=[_RANK_AVAL, *avals_in], avals_out=engine_out),
                          rank_group, *xs, **attrs)
        if engine_out is avals_out or call.arrange is None:
            return results
        return arranged(ctx, call.arrange, world, _compat.ir_values(results), engine_out,
                        avals_out)
    return emit, ""


def engine_lowering(target: str, aliases: dict[int, int]) -> Callable[..., Any]:
    """The lowering of a CPU engine target (a call or a start). Where its results alias its
    operands (`aliases`, one result per member: an all-reduce in place) it has no layout
    constraints; otherwise `jax.ffi.ffi_lowering`'s row-major ones. XLA:CPU's layout assignment makes every
    operand and result of a custom call row-major anyway, and where an aliased operand carries
    a constraint it copies the operand in the fusion that computes it: a copy per gradient,
    and code fused otherwise than in the XLA control's program (the corpus's transformer step
    was not bitwise its control at --xla_cpu_max_isa=AVX2). An all-reduce in place sums the
    same element of every rank's buffer, laid out alike, so its bits do not depend on the
    layout either (`tests/test_allreduce.py`)."""
    return jax.ffi.ffi_lowering(target, operand_output_aliases=aliases,
                                skip_ffi_layout_processing=bool(aliases))


def rank_group_operand(ctx: Any, groups: Sequence[Sequence[int]]) -> Any:
    """The running device's (rank, group) as an int32[2] value of the program lowered at `ctx`:
    looked up in a table of every device's by the device's index. The rank is the position
    in XLA's replica group, so a sum's order is XLA's and a shard's owner is XLA's."""
    table = np.zeros((1 + max(max(g) for g in groups), 2), np.int32)
    for group_id, members in enumerate(groups):
        for rank, device in enumerate(members):
            table[device] = (rank, group_id)
    i32 = _compat.ir.IntegerType.get_signless(32)
    zero = _compat.ir_constant(np.int32(0))
    row = _compat.hlo.dynamic_slice(
        _compat.ir_constant(table), [_compat.device_index(ctx), zero],
        _compat.ir.DenseI64ArrayAttr.get([1, 2]))
    return _compat.hlo.reshape(_compat.ir.RankedTensorType.get([2], i32), row)


# --- CUDA: libra's P2P kernels or NCCL ---------------------------------------------------

def _cuda_default_reason() -> str:
    return (f"cuda ({config.CUDA_PATH_ENV}=xla, the default: libra's GPU all-reduces have not run on a "
            f"GPU yet; {config.CUDA_PATH_ENV}=p2p or {config.CUDA_PATH_ENV}=nccl opts in)")


def gpu_call(ctx: Any, call: Call) -> tuple[str | None, dict, str]:
    """Which libra call serves `call` on a GPU, as ``(engine, attributes, "")``: ``"nccl"``
    (the ``nccl`` path, and the ``p2p`` path's groups that span processes) or ``"cuda"`` (the
    ``p2p`` path: libra's P2P kernels, for the rows the extension has kernels for); ``""`` for
    an empty buffer (no call needed); ``(None, {}, reason)`` where XLA's must do it. Shared by
    the one call and start/done (`pair_call`)."""
    if not _ffi.HAS_CUDA:
        return None, {}, "cuda (libra_jax was built without CUDA)"
    path = config.cuda_path()
    row = call.row
    kernels = _ffi.has_target(row, "cuda")
    if path != "nccl" and not kernels:
        *rest, last = [r.kind for r in collectives.ROWS if not _ffi.has_target(r, "cuda")
                       and _ffi.has_target(r, "nccl")] or ["collectives"]
        nccl_only = ", ".join(rest) + (" and " if rest else "") + last
        return None, {}, (f"cuda ({config.CUDA_PATH_ENV}={path}: libra's GPU {nccl_only} are "
                          f"NCCL's, {config.CUDA_PATH_ENV}=nccl)")
    if path == "xla":
        return None, {}, _cuda_default_reason()
    if not kernels and not _ffi.has_target(row, "nccl"):
        return None, {}, f"cuda (the extension registers no {row.kind} target)"
    groups = _compat.replica_groups(ctx, call.axes)
    devices = _compat.mesh_devices(ctx)
    across = devices is not None and any(d.process_index != jax.process_index()
                                         for d in devices)
    if path == "nccl" or across:
        if not _ffi.has_target(row, "nccl"):
            return None, {}, f"cuda (the extension registers no NCCL {row.kind} target)"
        if groups is None:
            return None, {}, "cuda in a partially automatic shard_map"
        if devices is None:
            return None, {}, (f"cuda with {config.CUDA_PATH_ENV}={path} on an abstract mesh "
                              "(libra's NCCL call needs the mesh's devices: give shard_map or "
                              "libra_jax.value_and_grad a jax.sharding.Mesh, or trace under "
                              "jax.set_mesh)")
        attrs, reason = nccl_attrs(ctx, groups, devices, call.blocks, row)
        if attrs is None:
            return None, {}, reason
        return ("nccl" if attrs else ""), attrs, ""
    attrs, reason = _kernel_attrs(ctx, call)
    if attrs is None:
        return None, {}, reason
    return ("cuda" if attrs else ""), attrs, ""


def _buffer_served(ctx: Any, dtypes: frozenset, path: str) -> tuple[np.dtype, int, str]:
    """The lowered buffers' dtype (one buffer, or a bucket's members of one dtype) and element
    count, and why a GPU call with `dtypes` does not serve them ("" where it does): the check
    every GPU call's attributes start with."""
    dtype = np.dtype(ctx.avals_in[0].dtype)
    reason = "" if dtype in dtypes else f"cuda {dtype.name}{path}"
    return dtype, sum(math.prod(a.shape) for a in ctx.avals_in), reason


def _kernel_attrs(ctx: Any, call: Call) -> tuple[dict | None, str]:
    """The attributes of libra's P2P kernel call for `call` among the GPUs of this process,
    or ``(None, reason)`` where the kernels do not serve it; ``({}, "")`` for an empty buffer."""
    groups, devices, reason = _groups_in_this_process(ctx, call.axes)
    if groups is None:
        return None, f"cuda {reason}"
    world = len(groups[0])
    if world > _ffi.CUDA_MAX_RANKS:
        return None, f"cuda groups of more than {_ffi.CUDA_MAX_RANKS} GPUs"
    dtype, count, reason = _buffer_served(ctx, CUDA_DTYPES, "")
    if reason:
        return None, reason
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
    for g in groups:  # The kernels read peers' memory: without P2P, XLA's all-reduce.
        members = [ordinals[d] for d in g]
        if len(members) > 1 and _ffi.cuda_peer_access(members) is False:
            return None, f"cuda GPUs {members} without peer access (P2P) between them"
    blocks = call.blocks
    if blocks is None:  # Chosen now that the group size is known.
        blocks = block_rule.resolve_blocks(call.row, _full_bytes(ctx.avals_in, call.row, world),
                                           world, default_profile("cuda"))
    return dict(devices=np.array([ordinals[d] for g in groups for d in g], np.int32),
                world=np.int64(world), blocks=np.int64(blocks),
                algorithm=np.int64(config.cuda_algorithm()),
                **_timeout_attr()), ""


def _gpu_emit(ctx: Any, call: Call) -> tuple[Callable[..., Sequence[Any]] | None, str]:
    """The GPU's emitter (`libra_call` on CUDA): the one call `gpu_call` chooses for the
    members at `ctx` (one dtype) that hold data, over them as they are: libra's P2P kernels
    (`_kernel_call`: a table of the members' pointers, a member that is not whole 16-byte
    vectors padded on its own) or NCCL (`_nccl_call`: an all-reduce's buffers as they are, a
    sharded row's each as its row of shards); an empty member a constant."""
    live = [a for a in ctx.avals_in if math.prod(a.shape)]
    engine, attrs, reason = gpu_call(ctx.replace(avals_in=live), call) if live else ("", {}, "")
    if engine is None:
        return None, reason
    if not engine:  # only empty members: nothing to call
        return (lambda *xs: [_compat.ir_constant(np.zeros(o.shape, o.dtype))
                             for o in ctx.avals_out]), ""
    _ffi.ensure_cuda_registered()
    target = _ffi.target(call.row, engine)
    if engine == "nccl":
        return (lambda *xs: _nccl_call(ctx, call, target, attrs, xs)), ""
    return (lambda *xs: _kernel_call(ctx, target, attrs, call.inplace, xs)), ""


def _nccl_call(ctx: Any, call: Call, target: str, attrs: dict, xs: Sequence[Any]
                       ) -> list[Any]:
    """NCCL's call of the members `xs` (the operands at `ctx`, of one dtype) as they are: one
    custom call whose operands and results are the members (the handler issues one NCCL call
    per member as one NCCL group, with the call's CTA limit): an all-reduce's buffers in any
    shape (each result aliased to its operand where `call.inplace`), a sharded kind's each as
    its row of shards (`to_row_of_shards`: no copy where the dimension leads, as in a
    bucket's), an exchanging kind's with its split dimension leading (NCCL sends contiguous
    block ``d`` to rank ``d``), made the op's result by `call.arrange`; an empty member a
    constant."""
    row = call.row
    rows_of_shards = row.scatters or row.gathers or row.exchanges
    tiled = call.tiled or row.exchanges  # an exchange's segments: along its split dimension
    outs: list[Any] = [None] * len(xs)
    live, operands, avals_in, avals_out, shaped = [], [], [], [], []
    for i, (a, o, x) in enumerate(zip(ctx.avals_in, ctx.avals_out, xs)):
        if not math.prod(a.shape):
            outs[i] = _compat.ir_constant(np.zeros(o.shape, o.dtype))
            continue
        live.append(i)
        got = a if row.exchanges else o  # what NCCL's call writes, as the operand's shape
        shaped.append(got)
        if rows_of_shards:
            flat, flat_in = to_row_of_shards(ctx.replace(avals_in=[a], avals_out=[got]), x,
                                             row.gathers, call.dimension_of(i), tiled)
            operands.append(flat)
            avals_in.append(flat_in)
            avals_out.append(flat_in.update(shape=(math.prod(got.shape),)))
        else:
            operands.append(x)
            avals_in.append(a)
            avals_out.append(o)
    aliases = {k: k for k in range(len(live))} if call.inplace else {}
    results = _compat.ir_values(jax.ffi.ffi_lowering(target, operand_output_aliases=aliases)(
        ctx.replace(primitive=None, avals_in=avals_in, avals_out=avals_out), *operands,
        **attrs))
    for k, (i, result) in enumerate(zip(live, results)):
        if rows_of_shards:
            result, = from_row_of_shards(ctx, result, avals_out[k], shaped[k], row.gathers,
                                         call.dimension_of(i), tiled)
        if row.exchanges and call.arrange is not None:
            result, = arranged(ctx, call.arrange, int(attrs["nranks"]), [result],
                               [shaped[k]], [ctx.avals_out[i]])
        outs[i] = result
    return outs


def _kernel_call(ctx: Any, target: str, attrs: dict, inplace: bool, xs: Sequence[Any]
                         ) -> list[Any]:
    """The P2P kernels' all-reduce of the members `xs` (the operands at `ctx`, of one dtype):
    those of whole 16-byte vectors as one call over them as they are (the kernels take a table
    of the members' pointers, 32 a launch: the handler launches as many as the call needs),
    each result aliased to its operand where `inplace`; a member of another size padded on
    its own (`_padded_kernel_call`); an empty one a constant. Every element's sum is in rank
    order, as in one buffer: the bits do not depend on how the members are called."""
    outs: list[Any] = [None] * len(xs)
    whole = []
    for i, (a, x) in enumerate(zip(ctx.avals_in, xs)):
        nbytes = math.prod(a.shape) * np.dtype(a.dtype).itemsize
        if nbytes == 0:
            outs[i] = _compat.ir_constant(np.zeros(ctx.avals_out[i].shape, ctx.avals_out[i].dtype))
        elif nbytes % CUDA_VECTOR_BYTES:
            outs[i], = _padded_kernel_call(
                ctx.replace(avals_in=[a], avals_out=[ctx.avals_out[i]]), target, attrs, inplace, x)
        else:
            whole.append(i)
    if whole:
        rule = jax.ffi.ffi_lowering(
            target, operand_output_aliases={k: k for k in range(len(whole))} if inplace else {})
        results = _compat.ir_values(rule(
            ctx.replace(avals_in=[ctx.avals_in[i] for i in whole],
                        avals_out=[ctx.avals_out[i] for i in whole]),
            *(xs[i] for i in whole), **attrs))
        for i, result in zip(whole, results):
            outs[i] = result
    return outs


def _padded_kernel_call(ctx: Any, target: str, attrs: dict, inplace: bool, x: Any
                        ) -> list[Any]:
    """The P2P kernels' all-reduce of `x` (in place where `inplace`), on its flat form padded
    to 16 bytes where it is not a multiple (the kernels move 16-byte vectors: a padded copy,
    reduced in place)."""
    aval_in, = ctx.avals_in
    dtype = np.dtype(aval_in.dtype)
    count = math.prod(aval_in.shape)
    pad = (-count * dtype.itemsize % CUDA_VECTOR_BYTES) // dtype.itemsize  # 16-byte vectors
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
    rule = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases)
    result, = _compat.ir_values(rule(call_ctx, operand, **attrs))
    if pad:
        result = _compat.hlo.slice(result, _compat.ir.DenseI64ArrayAttr.get([0]),
                                   _compat.ir.DenseI64ArrayAttr.get([count]),
                                   _compat.ir.DenseI64ArrayAttr.get([1]))
        result = _compat.hlo.reshape(_compat.ir_tensor_type(ctx, aval_in.shape, dtype), result)
    return [result]


def nccl_attrs(ctx: Any, groups: Sequence[Sequence[int]], devices: Sequence[Any],
               blocks: int | None, collective: Collective) -> tuple[dict | None, str]:
    """The attributes of `collective`'s NCCL call (and its start: `gpu_call`), the
    all-reduce's `libra_allreduce_nccl` say, lowered at `ctx` over XLA's replica `groups`
    of the mesh's `devices`: NCCL with `blocks` as the
    call's CTA limit (cpp/libra/nccl.h), every GPU one rank of its group, ranks in XLA's group
    order; ``({}, "")`` for an empty buffer; ``(None, reason)`` without NCCL.

    Each process lowers its own program: the call's tables map this process's GPUs (by local
    ordinal) to their communicator and rank. Communicators' unique ids are exchanged now,
    through JAX's key-value store (`libra_jax._nccl`); the communicators themselves are made
    when XLA initialises the program (the handlers' initialize stage).
    """
    ok, why = _nccl.available()
    if not ok:
        return None, f"cuda without NCCL ({why})"
    dtype, count, reason = _buffer_served(ctx, NCCL_DTYPES, " over NCCL")
    if reason and collective.sums:  # a copy takes any dtype, as bytes
        return None, reason
    if count == 0:
        return {}, ""
    world = len(groups[0])
    if blocks is None:
        # Chosen now that the group size is known, from the shipped profile:
        # every process must pick the same count (and, on older NCCL, the same
        # communicator), and a host's own calibration is not shared here
        # (optimize broadcasts process 0's profile; a bare psum cannot).
        full = count * dtype.itemsize * (world if collective.gathers else 1)
        blocks = block_rule.resolve_blocks(collective, full, world, model.BUILTIN_PROFILES["cuda"])
    blocks = nccl_blocks(blocks)
    _say_launch_order(_nccl.library())
    me = jax.process_index()
    local = [d for d in devices if d.process_index == me]
    # A GPU's local ordinal; a CPU mesh (lowering for cuda in tests) counts its devices.
    ordinal = {d.id: (int(d.local_hardware_id) if d.platform == "gpu" else i)
               for i, d in enumerate(local)}
    rows = 1 + max(ordinal.values(), default=0)
    comm_ids = np.full(rows, -1, np.int64)
    ranks = np.full(rows, -1, np.int32)
    for members in groups:
        line = [devices[i] for i in members]
        if not any(d.process_index == me for d in line):
            continue
        comm_id = _nccl.communicator([d.id for d in line], blocks=blocks,
                                     holds_root=line[0].process_index == me,
                                     timeout_s=config.timeout_s())
        for rank, d in enumerate(line):
            if d.process_index == me:
                comm_ids[ordinal[d.id]] = comm_id
                ranks[ordinal[d.id]] = rank
    return dict(comm_ids=comm_ids, ranks=ranks, nranks=np.int64(world),
                ctas=np.int64(blocks), **_timeout_attr()), ""


def nccl_blocks(blocks: int) -> int:
    """`blocks` as the CTA limit the loaded NCCL is asked for: capped at its largest
    (`_nccl.Library.max_ctas`: the version's channel maximum, or the channels a per-collective
    communicator is made with), said once; below NCCL 2.17 none can be honoured, said once."""
    lib = _nccl.library()
    overrides = config.nccl_cta_overrides()
    if overrides:
        settings = ", ".join(f"{k}={v}" for k, v in overrides.items())
        warn_once("nccl-cta-env",
                  f"libra_jax: {settings} in the environment: NCCL applies it over the block "
                  "counts libra passes as CTA limits.")
    if lib.max_ctas == 0:
        warn_once("nccl-no-cta-limit",
                  f"libra_jax: NCCL {lib.version} cannot limit an all-reduce's CTAs (NCCL >= "
                  "2.17 can): block counts are not honoured on this path.")
        return blocks
    if blocks > lib.max_ctas:
        warn_once("nccl-cta-cap",
                  f"libra_jax: NCCL {lib.version} ({lib.route} CTA limits) is asked for at most "
                  f"{lib.max_ctas} CTAs per all-reduce; block counts above it run with "
                  f"{lib.max_ctas}.")
        return lib.max_ctas
    return blocks


def _say_launch_order(lib: _nccl.Library) -> None:
    """Once, where the loaded NCCL may not order libra's communicators with XLA's (several
    communicators on one GPU need one launch order: cpp/libra/streams.h)."""
    if lib.launch_order == "streams":
        warn_once("nccl-stream-order",
                  f"libra_jax: NCCL {lib.version} orders several communicators on one GPU by "
                  "stream dependencies only: libra's NCCL calls are ordered on its one stream "
                  "per GPU, but XLA's own collectives on the same GPUs are not ordered with "
                  "them and may deadlock with them (NCCL >= 2.26 with "
                  f"{config.NCCL_LAUNCH_ORDER_ENV}=1 orders both).")
    elif not config.nccl_launch_order_implicit():
        warn_once("nccl-launch-order",
                  f"libra_jax: {config.NCCL_LAUNCH_ORDER_ENV} is not 1: NCCL {lib.version} "
                  "does not order libra's NCCL calls with XLA's collectives on the same GPU, "
                  "which may deadlock (libra_jax sets it to 1 when imported with "
                  f"{config.CUDA_PATH_ENV}=nccl or p2p, unless it is set).")



# --- Start/done: where libra splits a call in two ---------------------------------------

class PairCall(NamedTuple):
    """Where the platform's libra call splits a collective of flat buffers (a bucket's members
    or rows of shards) into a start and a done: start's and done's targets, the (rank, group)
    operand (the CPU calls' first; the one a done slices a reduce-scatter's shard by), the
    attributes, and the engine. `emit` emits either half (`Call.phase`), for every kind: the
    same operands' order, aliases and key."""

    start_target: str
    rank_group: Any
    done_target: str
    attrs: dict
    engine: str

    def emit(self, ctx: Any, call: Call, operands: Sequence[Any]) -> list[Any]:
        """`call`'s start or done (`call.phase`), keyed `call.key`, of `operands`, typed as
        `ctx`'s operands and results (the members' or the in-flight buffers first, as
        `Call.phase` says)."""
        if call.phase == "start":
            return self._start(ctx, call, operands)
        if call.phase == "done":
            return self._done(ctx, call, operands)
        raise ValueError(f"a start/done pair emits its start or its done, not {call.phase!r}")

    def _start(self, ctx: Any, call: Call, operands: Sequence[Any]) -> list[Any]:
        """Start's call: its results one per member (each aliased to its buffer where
        `call.inplace`), then the token; operands after the members are values it must not
        run before, read by nothing. The CPU engine's (rank, group) leads. A CPU start over
        the members as XLA keeps them (the all-reduce's) is `engine_lowering`'s, without layout
        constraints; a sharded kind's rows of shards are flat, and laid out alike either way."""
        members = len(ctx.avals_out) - 1
        rows_of_shards = call.row.gathers or call.row.scatters
        lead, lead_avals = ([self.rank_group], [_RANK_AVAL]) if self.engine == "cpu" else ([], [])
        aliases = ({len(lead) + k: k for k in range(members)} if call.inplace else {})
        lowered = (engine_lowering(self.start_target, aliases)
                   if self.engine == "cpu" and not rows_of_shards else
                   jax.ffi.ffi_lowering(self.start_target, operand_output_aliases=aliases))
        # The CPU engine names one segment per member (rows of shards: 0); the empty members
        # `pair_call` saw are not started.
        attrs = (dict(self.attrs) if "segments" not in self.attrs else
                 {**self.attrs, "segments": np.zeros(members, np.int64)})
        return _compat.ir_values(lowered(
            ctx.replace(primitive=None, avals_in=[*lead_avals, *ctx.avals_in]),
            *lead, *operands, call_id=np.int64(call.key), **attrs))

    def _done(self, ctx: Any, call: Call, operands: Sequence[Any]) -> list[Any]:
        """Done's call, waiting for the start keyed `call.key`: it reads the in-flight buffers
        once each, aliased to its results (no copy), then its start's token and any tokens it
        must not run before (read by nothing). On CPU (rank, group) and the start's token
        lead, on a GPU the buffers. Lowered with a side effect, so XLA never removes it: a
        done whose result nobody reads still waits for its collective before XLA may reuse
        the buffer the engine writes."""
        n = len(ctx.avals_out)
        buffers, (token, *after) = operands[:n], operands[n:]
        avals, (token_aval, *after_avals) = ctx.avals_in[:n], ctx.avals_in[n:]
        if self.engine == "cpu":
            ordered = [self.rank_group, token, *buffers, *after]
            types = [_RANK_AVAL, token_aval, *avals, *after_avals]
            at = 2
        else:
            ordered, types, at = list(operands), list(ctx.avals_in), 0
        lowered = jax.ffi.ffi_lowering(
            self.done_target, operand_output_aliases={at + k: k for k in range(n)},
            has_side_effect=True)
        return _compat.ir_values(lowered(
            ctx.replace(primitive=None, avals_in=types), *ordered, call_id=np.int64(call.key)))


def pair_call(flat_ctx: Any, call: Call, platform: Platform) -> PairCall | None:
    """Where libra splits `call` of the flat buffer lowered at `flat_ctx` (its operand) into
    start and done: on CPU the engine's start and done; on CUDA the call `gpu_call` chooses
    (the P2P kernels' or NCCL's start on libra's stream, and a done where XLA's stream waits
    for libra's). None where the one-call lowering does it (start and done decide alike: the
    same buffer, axes and blocks; an empty buffer included)."""
    row = call.row
    if platform == "cpu":
        if (not _ffi.has_target(row, "cpu", "start")
                or not row.gathers and np.dtype(flat_ctx.avals_in[0].dtype) not in ENGINE_DTYPES):
            return None
        found, _ = cpu_call(flat_ctx, call.axes, call.blocks, row)
        if found is None:
            return None
        rank_group, attrs = found
        attrs["segments"] = np.zeros(len(flat_ctx.avals_in), np.int64)  # rows of shards
        return PairCall(_ffi.target(row, "cpu", "start"), rank_group,
                        _ffi.target(row, "cpu", "done"), attrs, "cpu")
    if platform == "cuda":
        engine, attrs, _ = gpu_call(flat_ctx, call)
        if not engine:
            return None
        _ffi.ensure_cuda_registered()
        rank_group = None
        groups = _compat.replica_groups(flat_ctx, call.axes)  # known: gpu_call chose a call
        if row.scatters and groups is not None:
            rank_group = rank_group_operand(flat_ctx, groups)
        return PairCall(_ffi.target(row, engine, "start"), rank_group,
                        _ffi.target(row, engine, "done"), attrs, engine)
    return None


def __getattr__(name: str) -> Any:
    # The kinds by `jax.lax` name are `collectives.BY_LAX`, their one home.
    return _deprecated.alias(__name__, name, {"COLLECTIVES": ("collectives.BY_LAX",
                                                              collectives.BY_LAX)})
