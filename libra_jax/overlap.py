"""Start/done all-reduces: a gradient bucket's all-reduce runs beside the backward pass.

`libra_jax.optimize(step, overlap="start-done")` splits each planned gradient all-reduce
(``overlap="auto"``, the default: each one the model picks) into two equations of the
rewritten program:

* ``libra_psum_start(*xs)``, where the bucket's last gradient is ready: packs the bucket
  (per dtype: flatten, concatenate, zero-pad to 16 bytes) and launches the all-reduce
  *in place* on the packed buffer. Its results are the packed buffers, in flight.
* ``libra_psum_done(*flats)``, after the rest of the backward pass (`rewrite`: the pure
  equations downstream of its results, the optimizer update, move with it; an effect or
  another all-reduce that reads a result places it first): waits for the all-reduce and
  splits the buffers into the psums' results.

What runs in between is the compute the all-reduce overlaps. Per platform:

* CUDA: start is the ``libra_allreduce_cuda_start`` custom call (the kernel on libra's own
  stream, after an event from XLA's stream); done is ``libra_allreduce_cuda_done`` (XLA's
  stream waits for the kernel's end event) and its output aliases its operand, the packed
  buffer, so XLA keeps that buffer alive and unread until done.
* CPU: start is ``libra_allreduce_cpu_start``: the device's buffer joins its round and the
  call returns at once, so nothing is pending in XLA's program while the backward pass runs;
  the engine reduces when the last rank arrives. done is ``libra_allreduce_cpu_done``: a
  future for the end of that round (usually over by then), output aliased as on CUDA. (The
  one-call handler is asynchronous too, but its pending future mid-program costs the CNN
  example ~10% on 8 devices sharing 2 cores: `benchmarks/results/end_to_end.md`.)
* A buffer the engine does not serve (CUDA: dtype, group size, groups across processes; CPU:
  groups across processes) is all-reduced in start by the platform's one-call lowering, and
  done only splits it; elsewhere (TPU...) the same with XLA's all-reduce.

Done has one more operand, the latest start's first gradient: XLA orders by data only, and
this keeps every done after the last start. On a GPU, whether XLA's schedule keeps the
kernel beside compute is what `benchmarks/gpu_check.sh` measures.
`call_id` ties a start to its done: the CPU engine keys a started call by (call id, run id,
group, rank), a run id being unique per execution; the CUDA handlers key their events by
(GPU, call id). `optimize` numbers a program's pairs from a fingerprint of the program's
structure, so a retrace yields the same program (JAX's compilation cache keeps working) and
programs of another structure do not share ids. A GPU start whose id is still in flight (the
same program dispatched from two threads at once) fails with an error rather than mixing the
two; a pair inside a loop body is started and waited for in each iteration, in order.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import numpy as np

from libra_jax import _compat, _ffi, allreduce

__all__ = ["libra_psum_start_p", "libra_psum_done_p", "packed_layout", "packed_avals"]

#: Packed buffers are padded to a multiple of this many bytes (the CUDA kernels move
#: 16-byte vectors).
PACK_ALIGN_BYTES = 16


def packed_layout(avals: Sequence[Any], align_bytes: int = PACK_ALIGN_BYTES
                  ) -> list[tuple[np.dtype, list[int], int]]:
    """Per dtype, in first-appearance order: (dtype, indices of its operands, element count
    of its packed buffer, padded to a multiple of `align_bytes`)."""
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, aval in enumerate(avals):
        by_dtype.setdefault(np.dtype(aval.dtype), []).append(i)
    out = []
    for dtype, idx in by_dtype.items():
        count = sum(int(math.prod(avals[i].shape)) for i in idx)
        per_vector = max(1, align_bytes // dtype.itemsize)
        out.append((dtype, idx, -(-count // per_vector) * per_vector))
    return out


# --- start ----------------------------------------------------------------------

libra_psum_start_p = _compat.Primitive("libra_psum_start")
libra_psum_start_p.multiple_results = True


def _start_abstract_eval(*avals: Any, axes: tuple, blocks: int, invariant: bool,
                         call_id: int) -> Any:
    effects: set = set()
    for aval in avals:
        _, eff = allreduce._abstract_eval(aval, axes=axes, blocks=blocks, inplace=True,
                                          invariant=invariant)
        effects |= set(eff)
    return packed_avals(avals), effects


def packed_avals(avals: Sequence[Any]) -> list[Any]:
    """The types of start's results: one flat, padded buffer per dtype of `avals`."""
    return [_compat.ShapedArray((n,), dtype) for dtype, _, n in packed_layout(avals)]


def pack(ctx: Any, xs: Sequence[Any], idx: Sequence[int], padded: int) -> Any:
    """The operands `idx` of a lowering (all of one dtype), flattened and concatenated into
    one buffer of `padded` elements (zeros after them).

    One `concatenate`: XLA fuses it (with the copy it inserts before an in-place all-reduce)
    into one loop over the buffer that reads each element from its own operand only. Measured
    on 8 host devices (2-core VM), 8 MiB per device as 8 fused tensors: +2 ms over one tensor,
    against +26 ms for the former chain of `dynamic-update-slice`s into a zeroed buffer (zero
    fill, in-place updates, then that copy fused with the last update into a loop over the
    whole buffer -- which also evaluated the last operand's fused producer, e.g. a bias
    gradient's reduction, for every element: 0.5 s per step for the MLP example's 9 MiB
    bucket); +16 vs +45 ms at 40 tensors, equal at 200. Emitted as HLO directly: it involves
    no varying-axes typing. Shared by the fused all-reduce (`rewrite.libra_psum_fused_p`)."""
    ety = _compat.ir.RankedTensorType(xs[idx[0]].type).element_type
    sizes = [int(math.prod(ctx.avals_in[i].shape)) for i in idx]
    parts = [_compat.hlo.reshape(_compat.ir.RankedTensorType.get([n], ety), xs[i])
             for i, n in zip(idx, sizes)]
    if padded > sum(sizes):
        dtype = np.dtype(ctx.avals_in[idx[0]].dtype)
        parts.append(_compat.ir_constant(np.zeros(padded - sum(sizes), dtype)))
    if len(parts) == 1:
        return parts[0]
    return _compat.hlo.concatenate(parts, _compat.ir.IntegerAttr.get(
        _compat.ir.IntegerType.get_signless(64), 0))


def split(ctx: Any, flat: Any, flat_aval: Any, out_avals: Sequence[Any], idx: Sequence[int],
          outs: list[Any]) -> None:
    """The inverse of `pack`: `flat` cut into the results `idx` of one dtype (padding
    dropped), each written to its place in `outs`."""
    shapes = tuple(out_avals[i].shape for i in idx)
    offsets = np.cumsum([0] + [int(math.prod(s)) for s in shapes])

    def cut(v: Any) -> Any:
        return tuple(v[offsets[k]:offsets[k + 1]].reshape(shape) for k, shape in enumerate(shapes))

    parts = _compat.lower_fun(cut, multiple_results=True)(
        ctx.replace(primitive=None, avals_in=[flat_aval],
                    avals_out=[out_avals[i] for i in idx]), flat)
    for i, part in zip(idx, parts):
        outs[i] = part


def _start_lowering(sync_rule: Any, *, platform: str | None = None) -> Any:
    def rule(ctx: Any, *xs: Any, axes: tuple, blocks: int, invariant: bool,
             call_id: int) -> list[Any]:
        outs = []
        for j, (dtype, idx, padded) in enumerate(packed_layout(ctx.avals_in)):
            flat = _compat.ShapedArray((padded,), dtype)
            flat_ctx = ctx.replace(primitive=None, avals_in=[flat], avals_out=[flat])
            packed = pack(ctx, xs, idx, padded)
            split_call = _split_call(platform, flat_ctx, axes, blocks)
            if split_call is None:
                result, = _compat.ir_values(sync_rule(flat_ctx, packed, axes=axes,
                                                      blocks=blocks, inplace=True,
                                                      invariant=invariant))
            else:
                target, operands, attrs = split_call
                call = jax.ffi.ffi_lowering(target, operand_output_aliases={0: 0})
                call_ctx = ctx.replace(primitive=None, avals_out=[flat], avals_in=[flat] + [
                    _compat.ShapedArray((2,), np.int32)] * len(operands))
                result, = call(call_ctx, packed, *operands, call_id=np.int64(call_id * 16 + j),
                               **attrs)
            outs.append(result)
        return outs
    return rule


def _split_call(platform: str | None, flat_ctx: Any, axes: tuple,
                blocks: int) -> tuple[str, list, dict] | None:
    """(start target, its operands after the buffer, its attributes) where the platform's
    engine can split this packed buffer's all-reduce into start and done; None where start
    all-reduces it with the one-call lowering and done only splits. Start and done decide
    alike (the same buffer, axes and blocks)."""
    if platform == "cpu":
        call, _ = allreduce._cpu_call(flat_ctx, axes, blocks)
        if call is None:
            return None
        rank_group, attrs = call
        return _ffi.ALLREDUCE_CPU_START_TARGET, [rank_group], attrs
    if platform == "cuda":
        attrs, _ = allreduce._cuda_kernel_attrs(flat_ctx, axes, blocks)
        if not attrs:
            return None
        _ffi.ensure_cuda_registered()
        return _ffi.ALLREDUCE_CUDA_START_TARGET, [], attrs
    return None


# --- done -----------------------------------------------------------------------

libra_psum_done_p = _compat.Primitive("libra_psum_done")
libra_psum_done_p.multiple_results = True


def _done_abstract_eval(*operands: Any, out_avals: tuple, axes: tuple, blocks: int,
                        call_id: int) -> Any:
    return list(out_avals), set()


def _done_lowering(*, platform: str | None = None) -> Any:
    def rule(ctx: Any, *operands: Any, out_avals: tuple, axes: tuple, blocks: int,
             call_id: int) -> list[Any]:
        *flats, after = operands  # `after` only orders done after it
        outs: list[Any] = [None] * len(out_avals)
        for j, ((dtype, idx, padded), flat, flat_aval) in enumerate(
                zip(packed_layout(out_avals), flats, ctx.avals_in)):
            flat_ctx = ctx.replace(primitive=None, avals_in=[flat_aval], avals_out=[flat_aval])
            split_call = _split_call(platform, flat_ctx, axes, blocks)
            if split_call is not None and platform == "cpu":
                rank_group = split_call[1][0]
                call = jax.ffi.ffi_lowering(_ffi.ALLREDUCE_CPU_DONE_TARGET,
                                            operand_output_aliases={0: 0})
                flat, = call(ctx.replace(primitive=None, avals_out=[flat_aval], avals_in=[
                    flat_aval, _compat.ShapedArray((2,), np.int32), ctx.avals_in[-1]]),
                    flat, rank_group, after, call_id=np.int64(call_id * 16 + j))
            elif split_call is not None:  # cuda: XLA's stream waits for libra's
                call = jax.ffi.ffi_lowering(_ffi.ALLREDUCE_CUDA_DONE_TARGET,
                                            operand_output_aliases={1: 0})
                flat, = call(ctx.replace(primitive=None, avals_in=[flat_aval, flat_aval],
                                         avals_out=[flat_aval]),
                             flat, flat, call_id=np.int64(call_id * 16 + j))
            split(ctx, flat, flat_aval, out_avals, idx, outs)
        return outs
    return rule


libra_psum_start_p.def_impl(functools.partial(_compat.apply_primitive, libra_psum_start_p))
libra_psum_start_p.def_effectful_abstract_eval(_start_abstract_eval)
_compat.register_lowering(libra_psum_start_p, _start_lowering(allreduce._xla_lowering))
_compat.register_lowering(libra_psum_start_p,
                          _start_lowering(allreduce._cpu_lowering, platform="cpu"),
                          platform="cpu")
_compat.register_lowering(libra_psum_start_p,
                          _start_lowering(allreduce._cuda_lowering, platform="cuda"),
                          platform="cuda")

libra_psum_done_p.def_impl(functools.partial(_compat.apply_primitive, libra_psum_done_p))
libra_psum_done_p.def_effectful_abstract_eval(_done_abstract_eval)
_compat.register_lowering(libra_psum_done_p, _done_lowering())
_compat.register_lowering(libra_psum_done_p, _done_lowering(platform="cpu"), platform="cpu")
_compat.register_lowering(libra_psum_done_p, _done_lowering(platform="cuda"), platform="cuda")
