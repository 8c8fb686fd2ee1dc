"""`libra_reduce_scatter` and `libra_all_gather`: sharded data parallelism's pair of collectives.

Each stands for exactly the primitive `jax.lax` binds (`mirror_reduce_scatter`,
`mirror_all_gather`): `reduce_scatter` for `psum_scatter`; `all_gather`, or
`all_gather_invariant` (``to='invarying'`` under `shard_map(check_vma=True)`), for
`all_gather`. Their abstract evaluation *is* that primitive's (shapes, dtypes, varying axes,
effects and JAX's own errors); they differ in their lowering (`lowering.rule` over their row: the
engine's call on CPU) and carry a block count. They are each other's transpose, as JAX's are,
so `jax.grad` through `libra_all_gather` is libra's reduce-scatter. `all_gather_invariant`'s
transpose is JAX's: the slice of this device's shard from a cotangent that is already the
same everywhere (its all-reduce is the psum JAX puts where the cotangent became invariant;
`optimize` turns that psum and the slice into the slice's reduce-scatter). Params: JAX's (``axis_name``, ``axis_size``,
``tiled``, and ``scatter_dimension`` or ``all_gather_dimension``), ``blocks`` (an int, or
None for `lowering.default_blocks`) and, for the all-gather, ``invariant``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from libra_jax import _compat, collectives
from libra_jax.collectives import Collective
from libra_jax.ops import lowering
from libra_jax.ops.base import Platform, Rule, register_op

__all__ = ["REDUCE_SCATTER", "ALL_GATHER", "Mirror", "libra_reduce_scatter_p",
           "libra_all_gather_p", "mirror_reduce_scatter", "mirror_all_gather",
           "mirror_abstract_eval", "moved_batcher", "sharded_call", "flat_call"]

#: The two kinds this module defines the ops of (their rows' "primitive" and "mirror" forms).
REDUCE_SCATTER = collectives.BY_LAX["psum_scatter"]
ALL_GATHER = collectives.BY_LAX["all_gather"]


def mirror_reduce_scatter(*, axis_name: tuple, scatter_dimension: int, axis_size: int,
                          tiled: bool, blocks: int | None) -> tuple[Any, dict]:
    """The JAX primitive (and its params) that `libra_reduce_scatter` stands for."""
    return _compat.reduce_scatter_p, dict(
        axis_name=axis_name, scatter_dimension=scatter_dimension, axis_index_groups=None,
        axis_size=axis_size, tiled=tiled)


def mirror_all_gather(*, axis_name: tuple, all_gather_dimension: int, axis_size: int,
                      tiled: bool, invariant: bool, blocks: int | None) -> tuple[Any, dict]:
    """The JAX primitive (and its params) that `libra_all_gather` stands for."""
    params = dict(axis_name=axis_name, all_gather_dimension=all_gather_dimension,
                  axis_size=axis_size, tiled=tiled)
    if invariant:
        return _compat.all_gather_invariant_p, params
    return _compat.all_gather_p, dict(params, axis_index_groups=None)


def mirror_abstract_eval(mirror: Any) -> Any:
    """The abstract evaluation of the op that `mirror` names the JAX primitive of: that
    primitive's own, ``abstract_eval(aval, **params) -> (type, effects)``."""
    def abstract_eval(aval: Any, **params: Any) -> Any:
        prim, jax_params = mirror(**params)
        return prim.abstract_eval(aval, **jax_params)
    return abstract_eval


def _reduce_scatter_transpose(ct: Any, x: Any, *, axis_name: tuple, scatter_dimension: int,
                              axis_size: int, tiled: bool, blocks: int | None) -> tuple:
    if _compat.is_zero_cotangent(ct):
        return (_compat.zero_cotangent(x),)
    return (libra_all_gather_p.bind(ct, axis_name=axis_name,
                                    all_gather_dimension=scatter_dimension,
                                    axis_size=axis_size, tiled=tiled, invariant=False,
                                    blocks=blocks),)


def _all_gather_transpose(ct: Any, x: Any, *, axis_name: tuple, all_gather_dimension: int,
                          axis_size: int, tiled: bool, invariant: bool,
                          blocks: int | None) -> tuple:
    if _compat.is_zero_cotangent(ct):
        return (_compat.zero_cotangent(x),)
    if invariant:  # JAX's rule: this device's shard of the (invariant) cotangent.
        size = ct.shape[all_gather_dimension] // axis_size
        start = jax.lax.axis_index(axis_name) * size
        shard = jax.lax.dynamic_slice_in_dim(ct, start, size, axis=all_gather_dimension)
        return (shard if tiled else jax.lax.squeeze(shard, [all_gather_dimension]),)
    params: dict[str, Any] = dict(axis_name=axis_name, scatter_dimension=all_gather_dimension,
                                  axis_size=axis_size, tiled=tiled, blocks=blocks)
    if np.dtype(ct.aval.dtype) not in lowering.ENGINE_DTYPES:  # fp8 ...: JAX's reduce-scatter
        prim, jax_params = mirror_reduce_scatter(**params)
        return (prim.bind(ct, **jax_params),)
    return (libra_reduce_scatter_p.bind(ct, **params),)


def moved_batcher(prim: Any, mirror: Any, *dimensions: str) -> Any:
    """A `vmap` rule of a collective op over one operand: a vmapped axis among the
    collective's axes is JAX's rule for its `mirror` (no communication: the collective over
    the batch, within the device); any other batch dimension moves to the front, and each
    param in `dimensions` (the axes the collective splits or joins) one further."""
    def rule(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[Any],
             **params: Any) -> tuple[Any, Any]:
        (x,), (dim,) = vals_in, dims_in
        if axis_data.name in params["axis_name"]:
            jax_prim, jax_params = mirror(**params)
            return _compat.jax_batcher(jax_prim)(axis_data, vals_in, dims_in, **jax_params)
        if dim is None:
            return prim.bind(x, **params), None
        x = jax.numpy.moveaxis(x, dim, 0)
        return prim.bind(x, **dict(params, **{d: params[d] + 1 for d in dimensions})), 0
    return rule


class Mirror(NamedTuple):
    """A sharded kind's "mirror" form: the JAX primitive its op stands for (by the op's
    params: ``jax(**params) -> (primitive, params)``), the param naming the dimension it
    scatters or gathers, and its other params' values in a flat call (`flat_call`)."""

    jax: Callable[..., tuple[Any, dict]]
    dimension: str
    flat: dict[str, Any]


REDUCE_SCATTER.provide("mirror", Mirror(mirror_reduce_scatter, "scatter_dimension", {}))
ALL_GATHER.provide("mirror", Mirror(mirror_all_gather, "all_gather_dimension",
                                    {"invariant": False}))


def sharded_call(collective: Collective, params: dict[str, Any]) -> lowering.Call:
    """The `lowering.Call` of a sharded kind's op (`collective`: its row, with a "mirror"
    form) with the primitive's `params` (JAX's, and ``blocks``)."""
    mirror = collective.form("mirror")
    return lowering.Call(collective, params["axis_name"], params["blocks"],
                         lambda aval: mirror.jax(**params), dimension=params[mirror.dimension],
                         tiled=params["tiled"])


def _lowering(collective: Collective) -> Callable[[Platform], Rule]:
    def for_platform(platform: Platform) -> Rule:
        lower = lowering.rule(platform)
        return lambda ctx, x, **params: lower(ctx, x, call=sharded_call(collective, params))
    return for_platform


def flat_call(collective: Collective, axis_name: tuple, axis_size: int, blocks: int | None
              ) -> lowering.Call:
    """The reduce-scatter's or all-gather's (`collective`) `lowering.Call` of a flat row of
    shards (`shards.to_row_of_shards`): along its only dimension, tiled."""
    mirror = collective.form("mirror")
    return sharded_call(collective, dict(axis_name=axis_name, axis_size=axis_size, tiled=True,
                                         blocks=blocks, **{mirror.dimension: 0},
                                         **mirror.flat))


libra_reduce_scatter_p = REDUCE_SCATTER.provide("primitive", register_op(
    "libra_reduce_scatter", abstract_eval=mirror_abstract_eval(mirror_reduce_scatter),
    lowering=_lowering(REDUCE_SCATTER), transpose=_reduce_scatter_transpose))
libra_all_gather_p = ALL_GATHER.provide("primitive", register_op(
    "libra_all_gather", abstract_eval=mirror_abstract_eval(mirror_all_gather),
    lowering=_lowering(ALL_GATHER), transpose=_all_gather_transpose))
_compat.register_batcher(libra_reduce_scatter_p, moved_batcher(
    libra_reduce_scatter_p, mirror_reduce_scatter, "scatter_dimension"))
_compat.register_batcher(libra_all_gather_p, moved_batcher(
    libra_all_gather_p, mirror_all_gather, "all_gather_dimension"))
