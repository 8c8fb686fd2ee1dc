"""Buckets: several collectives over the same axes done as one call per dtype.

- `libra_psum_fused`: a gradient bucket's psums as one all-reduce per dtype. The equation
  `optimize` puts where a bucket's last member was: its operands are the members' operands,
  its results their results, each typed as that member's psum. Lowered per dtype: the
  operands flattened and concatenated (`lowering.pack`), all-reduced once by the platform's
  rule, and split back (`lowering.split`).
- `libra_reduce_scatter_fused`: a bucket of reduce-scatters (each `jax.lax.psum_scatter`
  along dimension 0, tiled or not, over the same axes) as one reduce-scatter per dtype,
  each result typed as that member's (`sharded.mirror_reduce_scatter`'s primitive's).

A reduce-scatter gives rank r the r-th of n equal runs of its buffer, so its bucket cannot
concatenate the flattened members as the psum's does (rank r's run would hold whole members,
not its shard of each). Its packing keeps each rank's shards contiguous instead
(`lowering.pack` with ``rows=n``): each member, whose dimension 0 is n or a multiple of n, is
viewed as (n, size / n), row r rank r's shard; the members are concatenated along the second
axis into (n, S); and that is flattened to n * S elements, rank r's shards of every member
at [r * S, (r + 1) * S). One reduce-scatter of that row with segment S (the engine's
[world][segment] layout; NCCL's row of shards) leaves rank r the (S,) run of its shards'
sums, which is split into the members' results (`lowering.split`). No padding: the engine
takes any S, and NCCL any count.

Summation is elementwise in rank order either way, so every bucket's results are bitwise
those of its members done one by one.
"""
from __future__ import annotations

from typing import Any

from libra_jax import _compat
from libra_jax.ops import lowering
from libra_jax.ops.base import Platform, Rule, register_op
from libra_jax.ops.psum import psum_abstract_eval
from libra_jax.ops.sharded import mirror_abstract_eval, mirror_reduce_scatter

__all__ = ["libra_psum_fused_p", "fused_abstract_eval", "libra_reduce_scatter_fused_p",
           "reduce_scatter_fused_abstract_eval"]


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


# --- The reduce-scatter bucket -------------------------------------------------------

_member_abstract_eval = mirror_abstract_eval(mirror_reduce_scatter)


def _member_params(axis_name: tuple, axis_size: int, tiled: bool, blocks: int | None
                   ) -> dict[str, Any]:
    """One member's `libra_reduce_scatter` params: scattered along dimension 0."""
    return dict(axis_name=axis_name, scatter_dimension=0, axis_size=axis_size,
                tiled=bool(tiled), blocks=blocks)


def reduce_scatter_fused_abstract_eval(*avals: Any, axis_name: tuple, axis_size: int,
                                       tiled: tuple, blocks: int | None) -> Any:
    """Each member's type as its `jax.lax.psum_scatter` along dimension 0 has it (JAX's
    abstract evaluation, and JAX's errors), the union of their effects."""
    if len(tiled) != len(avals):
        raise ValueError(f"libra_reduce_scatter_fused: tiled has {len(tiled)} entries for "
                         f"{len(avals)} operands (one per member)")
    outs, effects = [], set()
    for k, (aval, member_tiled) in enumerate(zip(avals, tiled)):
        if not aval.shape:
            raise ValueError(f"libra_reduce_scatter_fused: operand {k} is a scalar: a "
                             "reduce-scatter needs a dimension 0 to scatter")
        out, eff = _member_abstract_eval(aval, **_member_params(axis_name, axis_size,
                                                                member_tiled, blocks))
        outs.append(out)
        effects |= set(eff)
    return outs, effects


def _reduce_scatter_lowering(platform: Platform) -> Rule:
    """Per dtype (`lowering.packed_layout`'s groups): libra's reduce-scatter
    (`lowering.sharded_call`) of the members packed rank-contiguously, split back; where it
    does not serve (a dtype the engine does not sum, the ``xla``/``p2p`` CUDA paths, other
    platforms), each member XLA's own (`lowering.sharded_xla`); the twin, XLA's of the same
    packed row."""
    def rule(ctx: Any, *xs: Any, axis_name: tuple, axis_size: int, tiled: tuple,
             blocks: int | None) -> list[Any]:
        outs: list[Any] = [None] * len(xs)
        for dtype, idx, count in lowering.packed_layout(ctx.avals_in, align_bytes=1):
            segment = count // axis_size  # every member's size is a multiple of axis_size
            row = _compat.ShapedArray((count,), dtype)
            shards = _compat.ShapedArray((segment,), dtype)
            row_ctx = ctx.replace(primitive=None, avals_in=[row], avals_out=[shards])
            emit, reason = lowering.sharded_call(row_ctx, "psum_scatter", platform,
                                                 axis_name=axis_name, blocks=blocks,
                                                 dimension=0, tiled=True)
            if emit is None and reason is None:
                # The twin: XLA's reduce-scatter of the same packed row, split the same way,
                # so the code around it is the code around libra's call (the control then
                # differs from the optimized program in the collective alone: XLA:CPU
                # contracts a consumer's a*b+c into an FMA per fusion, and the fusions differ
                # where the members' results come straight from their own reduce-scatters).
                packed = lowering.pack(ctx, xs, idx, count, rows=axis_size)
                varying_ctx = ctx.replace(  # JAX's rule checks its operand's varying axes
                    primitive=None, avals_in=[ctx.avals_in[idx[0]].update(shape=row.shape)],
                    avals_out=[ctx.avals_out[idx[0]].update(shape=shards.shape)])
                scattered, = _compat.ir_values(lowering.sharded_xla(
                    varying_ctx, packed, "psum_scatter", mirror_reduce_scatter, None,
                    **_member_params(axis_name, axis_size, True, blocks)))
                lowering.split(ctx, scattered, shards, ctx.avals_out, idx, outs)
                continue
            if emit is None:
                for i in idx:
                    member_ctx = ctx.replace(primitive=None, avals_in=[ctx.avals_in[i]],
                                             avals_out=[ctx.avals_out[i]])
                    outs[i], = lowering.sharded_xla(
                        member_ctx, xs[i], "psum_scatter", mirror_reduce_scatter, reason,
                        **_member_params(axis_name, axis_size, tiled[i], blocks))
                continue
            # One HLO concatenate (lowering.pack), not a chain of dynamic-update-slices: XLA:CPU
            # fuses it, with the reshapes around it, into one loop over the row (one kLoop
            # fusion in the compiled HLO); the chain was measured slower (for the psum bucket).
            packed = lowering.pack(ctx, xs, idx, count, rows=axis_size)
            scattered, = _compat.ir_values(emit(packed))
            lowering.split(ctx, scattered, shards, ctx.avals_out, idx, outs)
        return outs
    return rule


libra_reduce_scatter_fused_p = register_op(
    "libra_reduce_scatter_fused", abstract_eval=reduce_scatter_fused_abstract_eval,
    lowering=_reduce_scatter_lowering, multiple_results=True)
