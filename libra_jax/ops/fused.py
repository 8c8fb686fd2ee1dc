"""`libra_psum_fused`: a gradient bucket's psums as one all-reduce per dtype.

The equation `optimize` puts where a bucket's last member was: its operands are the
members' operands, its results their results, each typed as that member's psum. Lowered
per dtype: the operands flattened and concatenated (`lowering.pack`), all-reduced once by
the platform's rule, and split back (`lowering.split`). Summation is elementwise in rank
order either way, so the results are bitwise those of the unfused psums.
"""
from __future__ import annotations

from typing import Any

from libra_jax import _compat
from libra_jax.ops import lowering
from libra_jax.ops.base import Platform, Rule, register_op
from libra_jax.ops.psum import psum_abstract_eval

__all__ = ["libra_psum_fused_p", "fused_abstract_eval"]


def fused_abstract_eval(*avals: Any, axes: tuple, blocks: int | None,
                        invariant: bool) -> Any:
    outs, effects = [], set()
    for aval in avals:
        out, eff = psum_abstract_eval(aval, axes=axes, blocks=blocks, inplace=True,
                                      invariant=invariant)
        outs.append(out)
        effects |= set(eff)
    return outs, effects


def _lowering(platform: Platform) -> Rule:
    single_rule = lowering.allreduce_rule(platform)

    def rule(ctx: Any, *xs: Any, axes: tuple, blocks: int | None,
             invariant: bool) -> list[Any]:
        outs: list[Any] = [None] * len(xs)
        for dtype, idx, count in lowering.packed_layout(ctx.avals_in, align_bytes=1):
            flat = _compat.ShapedArray((count,), dtype)
            reduced, = _compat.ir_values(single_rule(
                ctx.replace(primitive=None, avals_in=[flat], avals_out=[flat]),
                lowering.pack(ctx, xs, idx, count), axes=axes, blocks=blocks, inplace=True,
                invariant=invariant))
            lowering.split(ctx, reduced, flat, ctx.avals_out, idx, outs)
        return outs
    return rule


libra_psum_fused_p = register_op("libra_psum_fused", abstract_eval=fused_abstract_eval,
                                 lowering=_lowering, multiple_results=True)
