"""Packing: a bucket's members of one dtype as one flat buffer, and back.

Where the call a bucket is lowered to takes one buffer (XLA's collective standing in for
libra's, or a platform whose libra call takes no members: `lowering.lower_members` says which),
`libra_jax.ops.fused` and `libra_jax.ops.start_done` concatenate the members into one buffer
(`pack`), lower that buffer's collective and cut the result back into the members' results
(`split`). Libra's own calls (the CPU engine, the P2P kernels, NCCL) take the members as they
are and need none of it. `packed_layout` groups a bucket's operands by dtype, which every
bucket's lowering does, packed or not.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from libra_jax import _compat
from libra_jax.ops.lowering import CUDA_VECTOR_BYTES

__all__ = ["packed_layout", "packed_avals", "pack", "split", "PACK_ALIGN_BYTES"]

#: The padding `packed_layout` rounds a packed buffer to by default: the P2P kernels' vectors.
PACK_ALIGN_BYTES = CUDA_VECTOR_BYTES


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


def packed_avals(avals: Sequence[Any]) -> list[Any]:
    """The types of start's results: one flat, padded buffer per dtype of `avals`."""
    return [_compat.ShapedArray((n,), dtype) for dtype, _, n in packed_layout(avals)]


def pack(ctx: Any, xs: Sequence[Any], idx: Sequence[int], padded: int, rows: int = 1) -> Any:
    """The operands `idx` of a lowering (all of one dtype), flattened and concatenated into
    one buffer of `padded` elements (zeros after them).

    With `rows` > 1 (a reduce-scatter bucket's, `rows` the group size), the buffer keeps each
    rank's shards contiguous: every operand is viewed as (`rows`, size / `rows`), its row r
    rank r's shard, the operands (and the padding, `rows` rows of it) concatenated along the
    second axis, and the (`rows`, `padded` / `rows`) result flattened: rank r's shards of
    every operand are one run, the layout of one reduce-scatter of the whole buffer.

    One `concatenate`: XLA fuses it (with the copy it inserts before an in-place all-reduce)
    into one loop over the buffer that reads each element from its own operand only; a chain
    of `dynamic-update-slice`s into a zeroed buffer was measured slower (the fused copy
    re-evaluated the last operand's producer for every element). Emitted as HLO directly: it
    involves no varying-axes typing."""
    ety = _compat.ir.RankedTensorType(xs[idx[0]].type).element_type

    def view(count: int) -> list[int]:
        return [count] if rows == 1 else [rows, count // rows]
    sizes = [int(math.prod(ctx.avals_in[i].shape)) for i in idx]
    parts: list[Any] = [_compat.hlo.reshape(_compat.ir.RankedTensorType.get(view(n), ety), xs[i])
                        for i, n in zip(idx, sizes)]
    if padded > sum(sizes):
        dtype = np.dtype(ctx.avals_in[idx[0]].dtype)
        parts.append(_compat.ir_constant(np.zeros(view(padded - sum(sizes)), dtype)))
    packed = parts[0] if len(parts) == 1 else _compat.hlo.concatenate(
        parts, _compat.ir.IntegerAttr.get(_compat.ir.IntegerType.get_signless(64),
                                          len(view(padded)) - 1))
    if rows == 1:
        return packed
    return _compat.hlo.reshape(_compat.ir.RankedTensorType.get([padded], ety), packed)


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
