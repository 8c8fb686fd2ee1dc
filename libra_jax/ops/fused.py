"""Buckets: several collectives of one kind over the same axes done as one call per dtype.

`libra_bucket` is every kind's bucket, the kind a param (``collective``, a row of
`libra_jax.collectives` with a "bucket" form, `Bucket`, which this module provides the
all-reduce's, the reduce-scatter's and the all-gather's rows; another kind's is refused by its
row, `collectives.NoForm`). The equation `optimize` puts where a bucket's last member was (a
gradient bucket's) or its first (a group of forward all-gathers'): its operands are the
members' operands, its results their results.

- the all-reduce (``collective=psum``): a gradient bucket's psums as one all-reduce per dtype,
  each result typed as that member's psum (params ``axes``, ``blocks``, ``invariant``);
- the reduce-scatter (``collective=psum_scatter``): a bucket of reduce-scatters (each
  `jax.lax.psum_scatter` along dimension 0, tiled or not, over the same axes) as one
  reduce-scatter per dtype, each result typed as that member's
  (`sharded.mirror_reduce_scatter`'s primitive's; params ``axes``, ``blocks``,
  ``axis_size``, ``tiled``, one per member);
- the all-gather (``collective=all_gather``): consecutive all-gathers over the same axes (FSDP's
  forward parameter gathers, `optimize`'s groups: `planner.plan_gathers`) as one all-gather
  per dtype, each result typed as that member's `jax.lax.all_gather` (params ``axes``,
  ``axis_size``, ``tiled``, ``blocks``; ``dimension`` and ``invariant``, one per member). The
  engine takes each member where it is, gathered along its own dimension (its segment); where
  the members cannot be one call as they are, each is its own call (packing shards of several
  members in one buffer would interleave them by rank).

The names of the two kinds' buckets before (`libra_psum_fused_p`,
`libra_reduce_scatter_fused_p`) remain for a release as `base.OldName`s: binding one binds
`libra_bucket` with its kind and its params as they were.

Every bucket lowers by one rule (`_bucket_rule`): per dtype, one call over the members as they are
where the platform's call takes several buffers (`lowering.lower_members`: the CPU engine, and
libra's P2P kernels on a GPU, each member read where XLA put it and its result written to its
own output, no copy); elsewhere (NCCL's one-call form, XLA's collective) the operands flattened
and concatenated (`packing.pack`), that buffer's one collective by the platform's rule, and the
result split back (`packing.split`).

A reduce-scatter gives rank r the r-th of n equal runs of its buffer, so its bucket cannot
concatenate the flattened members as the psum's does (rank r's run would hold whole members,
not its shard of each). Its packing keeps each rank's shards contiguous instead
(`packing.pack` with ``rows=n``): each member, whose dimension 0 is n or a multiple of n, is
viewed as (n, size / n), row r rank r's shard; the members are concatenated along the second
axis into (n, S); and that is flattened to n * S elements, rank r's shards of every member
at [r * S, (r + 1) * S). One reduce-scatter of that row with segment S (the engine's
[world][segment] layout; NCCL's row of shards) leaves rank r the (S,) run of its shards'
sums, which is split into the members' results (`packing.split`). No padding: the engine
takes any S, and NCCL any count.

Summation is elementwise in rank order either way, and a gather copies, so every bucket's
results are bitwise those of its members done one by one.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from libra_jax import _compat
from libra_jax.collectives import Collective
from libra_jax.ops import lowering, packing
from libra_jax.ops.base import OldName, Platform, Rule, register_op
from libra_jax.ops.psum import ALL_REDUCE, allreduce_call
from libra_jax.ops.sharded import ALL_GATHER, REDUCE_SCATTER, sharded_call

__all__ = ["libra_bucket_p", "Bucket", "bucket_abstract_eval",
           "libra_psum_fused_p", "libra_reduce_scatter_fused_p"]


def _bucket_rule(platform: Platform) -> Rule:
    """A bucket's lowering on `platform`, for either kind: per dtype (`packing.packed_layout`'s
    groups), the members packed into one flat buffer (`packing.pack`; with ``rows`` the group
    size for a reduce-scatter, each rank's shards contiguous), that buffer's one collective by
    the platform's rule (`lowering.lower`: libra's call, or XLA's of the same buffer with the
    notice; quietly for the twin, so that the code around the collective is the same in both
    and the control differs from the optimized program in the collective alone), and its
    result split into the members' (`packing.split`). The kind's bucket form
    (``collective.form("bucket")``, `Bucket`) gives by its ``calls(params, members)`` the
    flat buffer's `lowering.Call`, its rows, and each member's call.

    Where the platform's call takes the members as they are (`lowering.lower_members`: the CPU
    engine, the P2P kernels, NCCL), a dtype's members are one call with no packing; the twin
    (``"xla"``) lowers each member by XLA's own collective, as they are too. Where libra's call does not
    serve a reduce-scatter bucket, each member is XLA's own: its rank-contiguous packing is a
    strided copy that only libra's call needs."""
    def rule(ctx: Any, *xs: Any, collective: Collective, **params: Any) -> list[Any]:
        call, rows, member_call = collective.form("bucket").calls(params, len(xs))
        outs: list[Any] = [None] * len(xs)
        # An empty member's collective is itself, a constant: no call holds it (XLA:CPU of
        # jaxlib 0.11.2 crashes compiling a custom call or all-reduce over one beside others).
        live = [i for i, a in enumerate(ctx.avals_in) if math.prod(a.shape)]
        for i, o in enumerate(ctx.avals_out):
            if i not in live:
                outs[i] = _compat.ir_constant(np.zeros(o.shape, o.dtype))
        for _, live_idx, count in packing.packed_layout([ctx.avals_in[i] for i in live],
                                                        align_bytes=1):
            idx = [live[k] for k in live_idx]
            # The call over these members: each with its own dimension, where they differ.
            group_call = call._replace(member_dimensions=tuple(
                call.member_dimensions[i] for i in idx)) if call.member_dimensions else call
            members_ctx = ctx.replace(primitive=None, avals_in=[ctx.avals_in[i] for i in idx],
                                      avals_out=[ctx.avals_out[i] for i in idx])
            if platform == "xla":
                # The twin as the CPU program has it: each member as it is, XLA's own
                # collective each, so that the code around the bucket is the same in both.
                for i in idx:
                    outs[i], = _compat.ir_values(lowering.lower(ctx.replace(
                        primitive=None, avals_in=[ctx.avals_in[i]],
                        avals_out=[ctx.avals_out[i]]), xs[i], member_call(i), platform))
                continue
            results = lowering.lower_members(members_ctx, [xs[i] for i in idx], group_call,
                                             platform)
            if results is not None:
                for i, out in zip(idx, results):
                    outs[i] = out
                continue
            # The first member's type, flat: its varying axes are what XLA's rule checks.
            flat_in = ctx.avals_in[idx[0]].update(shape=(count,))
            flat_out = flat_in.update(shape=(count // rows,))
            flat_ctx = ctx.replace(primitive=None, avals_in=[flat_in], avals_out=[flat_out])
            # Packed into one row only members that scatter along dimension 0: another's
            # shards are not contiguous (each is then its own call, as an all-gather's).
            if (collective.gathers or any(group_call.member_dimensions)
                    or (rows > 1 and lowering.libra_call(flat_ctx, call, platform)[1])):
                for i in idx:
                    outs[i], = lowering.lower(ctx.replace(
                        primitive=None, avals_in=[ctx.avals_in[i]],
                        avals_out=[ctx.avals_out[i]]), xs[i], member_call(i), platform)
                continue
            # One HLO concatenate (`packing.pack`), not a chain of dynamic-update-slices:
            # XLA:CPU fuses it, with the reshapes around it, into one loop over the buffer;
            # the chain was measured slower.
            packed = packing.pack(ctx, xs, idx, count, rows=rows)
            result, = _compat.ir_values(lowering.lower(flat_ctx, packed, call, platform))
            packing.split(ctx, result, flat_out, ctx.avals_out, idx, outs)
        return outs
    return rule


# --- Each kind's bucket: its members' own ops -------------------------------------------

class Bucket(NamedTuple):
    """A kind's bucket form: what a bucket's params say of its members. Member `i` is its
    kind's own op (the row's "primitive") with the params `member(params, i)`: that op's
    abstract evaluation types it, and `call` (the op's `lowering.Call` of its params) lowers
    it alone. The members as one call are member 0's call with `flat`'s params, each member
    along its own dimension (`lowering.Call.member_dimensions`). `per_member` names the
    params that hold one entry per member."""

    member: Callable[[dict[str, Any], int], dict[str, Any]]
    call: Callable[[dict[str, Any]], lowering.Call]
    flat: dict[str, Any]
    per_member: tuple[str, ...]

    def calls(self, params: dict[str, Any], members: int
              ) -> tuple[lowering.Call, int, Callable[[int], lowering.Call]]:
        """The call over the `members` (or their packed buffer), the packed buffer's rows (one
        per rank where the kind has a group size: its shards contiguous), and each member's
        own call."""
        each = [self.member(params, i) for i in range(members)]
        own = [self.call(p) for p in each]
        dims = tuple(c.dimension for c in own)
        flat = self.call({**each[0], **self.flat})
        return (flat._replace(member_dimensions=dims) if any(dims) else flat,
                params.get("axis_size", 1), lambda i: own[i])


def _psum_member(params: dict[str, Any], i: int) -> dict[str, Any]:
    """Member `i`'s `libra_psum` params: in place, as every bucket's all-reduce."""
    return dict(axes=params["axes"], blocks=params["blocks"], inplace=True,
                invariant=params["invariant"])


def _reduce_scatter_member(params: dict[str, Any], i: int) -> dict[str, Any]:
    """Member `i`'s `libra_reduce_scatter` params: scattered along its ``dimension`` (absent:
    every member's is 0), tiled or not."""
    dimension = params.get("dimension")
    return dict(axis_name=params["axes"],
                scatter_dimension=int(dimension[i]) if dimension is not None else 0,
                axis_size=params["axis_size"], tiled=bool(params["tiled"][i]),
                blocks=params["blocks"])


def _all_gather_member(params: dict[str, Any], i: int) -> dict[str, Any]:
    """Member `i`'s `libra_all_gather` params: gathered along its ``dimension``, invariant or
    not (`sharded.mirror_all_gather`'s)."""
    return dict(axis_name=params["axes"], all_gather_dimension=params["dimension"][i],
                axis_size=params["axis_size"], tiled=params["tiled"],
                invariant=params["invariant"][i], blocks=params["blocks"])


# The kinds with a bucket form: their rows hold it (`collectives.Collective.provide`). A
# reduce-scatter's members packed into one row are scattered along dimension 0, tiled
# (`packing.pack` with ``rows``); an all-gather's are never packed (each member is then its
# own call), nor an all-reduce's changed.
ALL_REDUCE.provide("bucket", Bucket(
    _psum_member, lambda p: allreduce_call(p["axes"], p["blocks"], p["invariant"], p["inplace"]),
    {}, ()))
REDUCE_SCATTER.provide("bucket", Bucket(
    _reduce_scatter_member, partial(sharded_call, REDUCE_SCATTER),
    {"scatter_dimension": 0, "tiled": True}, ("tiled", "dimension")))
ALL_GATHER.provide("bucket", Bucket(
    _all_gather_member, partial(sharded_call, ALL_GATHER), {}, ("dimension", "invariant")))


def bucket_abstract_eval(*avals: Any, collective: Collective, **params: Any) -> Any:
    """Each member's type as its own op has it (the row's "primitive" with the member's
    params: JAX's abstract evaluation, and JAX's errors), and the union of their effects; a
    kind without a bucket form is refused by its row (`collectives.NoForm`)."""
    bucket = collective.form("bucket")
    counts = [len(avals) if params.get(name) is None else len(params[name])
              for name in bucket.per_member]
    if any(count != len(avals) for count in counts):
        raise ValueError(f"libra_bucket ({collective}): {' and '.join(bucket.per_member)} need "
                         f"one entry per operand ({len(avals)}), got "
                         f"{' and '.join(map(str, counts))}")
    op = collective.form("primitive")
    outs, effects = [], set()
    for k, aval in enumerate(avals):
        if collective.scatters and not aval.shape:
            raise ValueError(f"libra_bucket ({collective}): operand {k} is a scalar: a "
                             "reduce-scatter needs a dimension to scatter")
        out, eff = op.abstract_eval(aval, **bucket.member(params, k))
        outs.append(out)
        effects |= set(eff)
    return outs, effects


libra_bucket_p = register_op("libra_bucket", abstract_eval=bucket_abstract_eval,
                             lowering=_bucket_rule, multiple_results=True)


def _from_axis_name(params: dict) -> dict:
    params = dict(params)
    params["axes"] = params.pop("axis_name")
    return params


libra_psum_fused_p = OldName("libra_psum_fused", libra_bucket_p, ALL_REDUCE)
libra_reduce_scatter_fused_p = OldName("libra_reduce_scatter_fused", libra_bucket_p,
                                       REDUCE_SCATTER, _from_axis_name)
