"""A collective's operand and result as one flat row of shards, the layout NCCL's calls and the
start/done pairs' flat buffers take (`to_row_of_shards`, `from_row_of_shards`), the exchanged
segments made an all-to-all's result (`arranged`), and the bf16 NaNs an all-gather makes
canonical as XLA:CPU's does. Lowering helpers of `libra_jax.ops.lowering`, for every platform.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from libra_jax import _compat

__all__ = ["to_row_of_shards", "from_row_of_shards", "arranged", "canonical_bf16_nans", "BF16"]


def to_row_of_shards(ctx: Any, x: Any, gathers: bool, dimension: int, tiled: bool
                     ) -> tuple[Any, Any]:
    """(value, type) of the operand lowered at `ctx` as one flat row of shards, the devices'
    shards in rank order (NCCL's layout, and the start/done pairs'): the scattered dimension
    (or a tiled gather's) moved to the front, then flattened; an untiled gather's operand is
    one shard as it is. A copy only where that dimension does not lead."""
    aval_in, = ctx.avals_in
    flat_in = aval_in.update(shape=(math.prod(aval_in.shape),))
    moved = dimension if (tiled or not gathers) else None

    def flatten(v: Any) -> Any:
        return (v if moved is None else jax.numpy.moveaxis(v, moved, 0)).reshape(-1)
    flat, = _compat.ir_values(_compat.lower_fun(flatten)(
        ctx.replace(primitive=None, avals_out=[flat_in]), x))
    return flat, flat_in


def from_row_of_shards(ctx: Any, flat: Any, flat_aval: Any, out_aval: Any, gathers: bool,
                       dimension: int, tiled: bool, rank_group: Any = None) -> list[Any]:
    """The inverse of `to_row_of_shards` for the collective's result `out_aval`: `flat` (the
    gathered row, or one shard; with `rank_group`, the whole row of an in-place
    reduce-scatter, of which this device's shard is sliced) reshaped, its leading dimension
    moved back to `dimension`."""
    shape = out_aval.shape
    front = ((shape[dimension], *shape[:dimension], *shape[dimension + 1:])
             if (tiled or gathers) else shape)
    shard = math.prod(shape)

    def unflatten(v: Any, *rank: Any) -> Any:
        if rank:  # this device's shard of an in-place reduce-scatter's row
            v = jax.lax.dynamic_slice_in_dim(v, rank[0][0] * shard, shard)
        v = v.reshape(front)
        return jax.numpy.moveaxis(v, 0, dimension) if front is not shape else v
    operands = [flat] if rank_group is None else [flat, rank_group]
    avals = [flat_aval] + ([] if rank_group is None else [_compat.ShapedArray((2,), np.int32)])
    return list(_compat.lower_fun(unflatten)(
        ctx.replace(primitive=None, avals_in=avals, avals_out=[out_aval]), *operands))


BF16 = np.dtype(jax.numpy.bfloat16)


def canonical_bf16_nans(ctx: Any, x: Any) -> Any:
    """`x` (bf16) with every NaN made canonical (sign | 0x7fc0), as XLA:CPU's all-gather leaves
    them: it gathers bf16 through f32 (0x7fd0 comes back 0x7fc0; pinned by
    tests/test_sharded.py). One elementwise pass over the shard, before the copy."""
    def canonical(v: Any) -> Any:
        bits = jax.lax.bitcast_convert_type(v, np.uint16)
        nan = (bits & np.uint16(0x7FFF)) > np.uint16(0x7F80)
        fixed = (bits & np.uint16(0x8000)) | np.uint16(0x7FC0)
        return jax.lax.bitcast_convert_type(jax.numpy.where(nan, fixed, bits), BF16)
    aval = ctx.avals_in[0]
    return _compat.lower_fun(canonical)(
        ctx.replace(primitive=None, avals_in=[aval], avals_out=[aval]), x)[0]


def arranged(ctx: Any, arrange: Callable[[Any, int], Any], world: int, results: Sequence[Any],
             avals_in: Sequence[Any], avals_out: Sequence[Any]) -> list[Any]:
    """An exchanging call's `results` (each in its operand's shape `avals_in`: along the split
    axis, rank ``s``'s segment where this rank's segment ``s`` was) made the op's results
    `avals_out` by the call's `arrange` (`lowering.Call.arrange`)."""
    return [_compat.lower_fun(lambda v: arrange(v, world))(
        ctx.replace(primitive=None, avals_in=[a], avals_out=[o]), result)[0]
        for result, a, o in zip(results, avals_in, avals_out)]
