"""`libra_psum`: one psum, all-reduced by Libra's engine with a given block count.

The primitive stands for exactly the psum `jax.lax.psum` would bind (`psum_invariant` under
`shard_map(check_vma=True)`, `psum` otherwise, `lowering.mirrored`): its abstract evaluation
*is* that primitive's, so output types (shape, dtype, weak type, varying axes) and effects
are the same by construction; so are its transpose and batching. It differs in its lowering
(`libra_jax.ops.lowering`). Params: ``axes`` (mesh axis names), ``blocks`` (an int, or None
for `lowering.default_blocks`), ``inplace`` (the result aliases the operand), ``invariant``
(it stands for `psum_invariant`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from libra_jax import _compat, collectives
from libra_jax.ops import lowering
from libra_jax.ops.base import Platform, Rule, register_op

__all__ = ["ALL_REDUCE", "libra_psum_p", "psum_abstract_eval", "members_abstract_eval",
           "allreduce_call"]

#: The kind this module defines the op of (its row's "primitive" form is `libra_psum_p`).
ALL_REDUCE = collectives.BY_LAX["psum"]


def psum_abstract_eval(aval: Any, *, axes: tuple, blocks: int | None, inplace: bool,
                       invariant: bool) -> Any:
    """(type, effects) of one buffer's psum: the mirrored JAX primitive's."""
    prim, params = lowering.mirrored(invariant, axes)
    return prim.abstract_eval(aval, **params)


def members_abstract_eval(*avals: Any, axes: tuple, blocks: int | None, invariant: bool
                          ) -> tuple[list[Any], set[Any]]:
    """Each member's type as its psum's result and the union of their effects: a start's
    in-flight buffers (`start_done`)."""
    outs, effects = [], set()
    for aval in avals:
        out, eff = psum_abstract_eval(aval, axes=axes, blocks=blocks, inplace=True,
                                      invariant=invariant)
        outs.append(out)
        effects |= set(eff)
    return outs, effects


def _transpose(ct: Any, x: Any, *, axes: tuple, blocks: int | None, inplace: bool,
               invariant: bool) -> tuple:
    if _compat.is_zero_cotangent(ct):
        return (_compat.zero_cotangent(x),)
    if invariant:  # psum_invariant's transpose: the cotangent, cast to varying.
        return (_compat.pvary(ct, axes),)
    # psum's transpose is psum (psum = psum + pbroadcast).
    return (libra_psum_p.bind(ct, axes=axes, blocks=blocks, inplace=True, invariant=False),)


def _lowering(platform: Platform) -> Rule:
    """The platform's rule (`lowering.rule`) for the all-reduce's row."""
    lower = lowering.rule(platform)

    def rule(ctx: Any, x: Any, *, axes: tuple, blocks: int | None, inplace: bool,
             invariant: bool) -> Any:
        return lower(ctx, x, call=allreduce_call(axes, blocks, invariant, inplace))
    return rule


def allreduce_call(axes: tuple, blocks: int | None, invariant: bool,
                   inplace: bool) -> lowering.Call:
    """The `lowering.Call` of one buffer's psum: XLA's is `mirrored`'s primitive, psum's
    where the operand carries no varying axes (a buffer packed during lowering: psum's
    lowering is the same all-reduce as psum_invariant's and takes it)."""
    def xla(aval: Any) -> tuple[Any, dict]:
        varying = invariant and set(axes) <= set(_compat.varying_axes(aval))
        return lowering.mirrored(varying, axes)
    return lowering.Call(ALL_REDUCE, axes, blocks, xla, inplace=inplace)


def _batcher(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[Any], *,
             axes: tuple, blocks: int | None, inplace: bool, invariant: bool) -> tuple[Any, Any]:
    (x,), (dim,) = vals_in, dims_in
    if axis_data.name in axes:
        # A vmapped axis among the reduced ones is reduced by XLA, as lax.psum does.
        prim, params = lowering.mirrored(invariant, axes)
        return _compat.jax_batcher(prim)(axis_data, vals_in, dims_in, **params)
    return libra_psum_p.bind(x, axes=axes, blocks=blocks, inplace=inplace,
                             invariant=invariant), dim


libra_psum_p = ALL_REDUCE.provide("primitive", register_op(
    "libra_psum", abstract_eval=psum_abstract_eval, lowering=_lowering, transpose=_transpose,
    batcher=_batcher))
