"""`libra_all_to_all`: the all-to-all, libra's fourth kind (the ``exchanged`` row of
`libra_jax.collectives`), as an expert-parallel mixture of experts dispatches tokens and
combines them.

It stands for exactly the primitive `jax.lax.all_to_all` binds (`mirror_all_to_all`): its
abstract evaluation is that primitive's (shapes, dtypes, varying axes and JAX's own errors);
it differs in its lowering (`lowering.rule` over its row: the engine's call on CPU) and carries
a block count. Its transpose is the all-to-all back (split and concat axes swapped), as JAX's
is. Params: JAX's (``axis_name``, ``split_axis``, ``concat_axis``, ``tiled``) and ``blocks``
(an int, or None for `lowering.default_blocks`).

The engine exchanges segments in place of their layout: each rank's buffer is rows of one
segment per rank along the split axis (no copy before the call), and the result has the
operand's shape, rank ``s``'s segment where this rank's segment ``s`` was (`arrange`
makes it
`jax.lax.all_to_all`'s result: a copy only where the concat axis is not the split axis).
"""
from __future__ import annotations

from typing import Any

import jax

from libra_jax import _compat, collectives
from libra_jax.ops import lowering
from libra_jax.ops.base import Platform, Rule, register_op
from libra_jax.ops.sharded import moved_batcher

__all__ = ["ALL_TO_ALL", "libra_all_to_all_p", "mirror_all_to_all", "all_to_all_call",
           "arrange"]

#: The kind this module defines the op of (its row's "primitive" form is `libra_all_to_all_p`).
ALL_TO_ALL = collectives.BY_LAX["all_to_all"]


def mirror_all_to_all(*, axis_name: tuple, split_axis: int, concat_axis: int, tiled: bool,
                      blocks: int | None) -> tuple[Any, dict]:
    """The JAX primitive (and its params) that `libra_all_to_all` stands for."""
    return _compat.all_to_all_p, dict(axis_name=axis_name, split_axis=split_axis,
                                      concat_axis=concat_axis, axis_index_groups=None,
                                      tiled=tiled)


def _abstract_eval(aval: Any, **params: Any) -> Any:
    prim, jax_params = mirror_all_to_all(**params)
    return prim.abstract_eval(aval, **jax_params)


def arrange(y: Any, world: int, split_axis: int, concat_axis: int) -> Any:
    """The engine's exchanged segments `y` (the operand's shape: along the split axis, rank
    ``s``'s segment where this rank's segment ``s`` was) as the all-to-all primitive's result:
    the ranks' segments concatenated along the concat axis, in rank order (JAX's primitive
    splits and concatenates so whatever its ``tiled``: `jax.lax.all_to_all` adds and removes
    the unit axes of an untiled call around it). A copy only where the axes differ."""
    if concat_axis == split_axis:
        return y
    shape = tuple(y.shape)
    pre, rest = shape[:split_axis], shape[split_axis + 1:]
    segment = shape[split_axis] // world
    y = y.reshape(pre + (world, segment) + rest)
    order: list[int] = []
    for axis in range(len(shape)):  # the rank axis just before the concat axis, then merged
        if axis == concat_axis:
            order.append(split_axis)
        order.append(axis if axis < split_axis else axis + 1)
    out = [*pre, segment, *rest]
    out[concat_axis] *= world
    return jax.numpy.transpose(y, order).reshape(out)


def all_to_all_call(params: dict[str, Any]) -> lowering.Call:
    """The `lowering.Call` of the all-to-all with the primitive's `params`."""
    return lowering.Call(ALL_TO_ALL, params["axis_name"], params["blocks"],
                         lambda aval: mirror_all_to_all(**params),
                         dimension=params["split_axis"], tiled=params["tiled"],
                         arrange=lambda y, world: arrange(y, world, params["split_axis"],
                                                          params["concat_axis"]))


def _lowering(platform: Platform) -> Rule:
    lower = lowering.rule(platform)
    return lambda ctx, x, **params: lower(ctx, x, call=all_to_all_call(params))


def _transpose(ct: Any, x: Any, *, axis_name: tuple, split_axis: int, concat_axis: int,
               tiled: bool, blocks: int | None) -> tuple:
    if _compat.is_zero_cotangent(ct):
        return (_compat.zero_cotangent(x),)
    return (libra_all_to_all_p.bind(ct, axis_name=axis_name, split_axis=concat_axis,
                                    concat_axis=split_axis, tiled=tiled, blocks=blocks),)


libra_all_to_all_p = ALL_TO_ALL.provide("primitive", register_op(
    "libra_all_to_all", abstract_eval=_abstract_eval, lowering=_lowering, transpose=_transpose))
_compat.register_batcher(libra_all_to_all_p, moved_batcher(
    libra_all_to_all_p, mirror_all_to_all, "split_axis", "concat_axis"))
