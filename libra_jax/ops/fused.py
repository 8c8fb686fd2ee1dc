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
from typing import Any, NamedTuple

import numpy as np

from libra_jax import _compat
from libra_jax.collectives import Collective
from libra_jax.ops import lowering, packing
from libra_jax.ops.base import OldName, Platform, Rule, register_op
from libra_jax.ops.psum import ALL_REDUCE, allreduce_call, members_abstract_eval
from libra_jax.ops.sharded import (
    ALL_GATHER,
    REDUCE_SCATTER,
    mirror_abstract_eval,
    mirror_all_gather,
    mirror_reduce_scatter,
    sharded_call,
)

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
    (``collective.form("bucket")``, `Bucket`) gives by its ``calls(params)`` the flat
    buffer's `lowering.Call`, its rows, and each member's call.

    Where the platform's call takes the members as they are (`lowering.lower_members`: the CPU
    engine, the P2P kernels), a dtype's members are one call with no packing; the twin (``"xla"``) lowers
    each member by XLA's own collective, as they are too. Where libra's call does not
    serve a reduce-scatter bucket, each member is XLA's own: its rank-contiguous packing is a
    strided copy that only libra's call needs."""
    def rule(ctx: Any, *xs: Any, collective: Collective, **params: Any) -> list[Any]:
        call, rows, member_call = collective.form("bucket").calls(params)
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


def _psum_bucket(params: dict[str, Any]) -> tuple[lowering.Call, int, Any]:
    call = allreduce_call(params["axes"], params["blocks"], params["invariant"], True)
    return call, 1, lambda i: call


# --- The reduce-scatter bucket -------------------------------------------------------

_member_abstract_eval = mirror_abstract_eval(mirror_reduce_scatter)


def _member_params(axis_name: tuple, axis_size: int, tiled: bool, blocks: int | None,
                   dimension: int = 0) -> dict[str, Any]:
    """One member's `libra_reduce_scatter` params: scattered along `dimension`."""
    return dict(axis_name=axis_name, scatter_dimension=int(dimension), axis_size=axis_size,
                tiled=bool(tiled), blocks=blocks)


def _scatter_dimensions(params: dict[str, Any], members: int) -> tuple[int, ...]:
    """Each member's scattered dimension (``dimension``; absent: every member's is 0)."""
    dimension = params.get("dimension")
    return tuple(dimension) if dimension is not None else (0,) * members


def _reduce_scatter_abstract_eval(*avals: Any, axes: tuple, axis_size: int, tiled: tuple,
                                  blocks: int | None, dimension: tuple | None = None) -> Any:
    """Each member's type as its `jax.lax.psum_scatter` along its dimension (``dimension``, one
    per member; None: 0 for all) has it (JAX's abstract evaluation, and JAX's errors), the
    union of their effects."""
    dims = _scatter_dimensions({"dimension": dimension}, len(avals))
    if len(tiled) != len(avals) or len(dims) != len(avals):
        raise ValueError(f"libra_bucket ({REDUCE_SCATTER}): tiled and dimension need one entry "
                         f"per operand ({len(avals)}), got {len(tiled)} and {len(dims)}")
    outs, effects = [], set()
    for k, (aval, member_tiled, d) in enumerate(zip(avals, tiled, dims)):
        if not aval.shape:
            raise ValueError(f"libra_bucket ({REDUCE_SCATTER}): operand {k} is a scalar: a "
                             "reduce-scatter needs a dimension to scatter")
        out, eff = _member_abstract_eval(aval, **_member_params(axes, axis_size,
                                                                member_tiled, blocks, d))
        outs.append(out)
        effects |= set(eff)
    return outs, effects


def _reduce_scatter_bucket(params: dict[str, Any]) -> tuple[lowering.Call, int, Any]:
    """The members' reduce-scatter: where a platform's call takes them as they are (the CPU
    engine's call, NCCL's member call), each along its own dimension (the engine's segments,
    NCCL's rows of shards: `lowering.Call.member_dimensions`); else the packed row's, along
    dimension 0, tiled, every rank's shards of every member in one run (`packing.pack` with
    ``rows``: members scattered along dimension 0 only); each member's own, as it is."""
    axis_name, axis_size, blocks = params["axes"], params["axis_size"], params["blocks"]
    dims = _scatter_dimensions(params, len(params["tiled"]))

    def member_call(i: int) -> lowering.Call:
        return sharded_call(REDUCE_SCATTER, _member_params(axis_name, axis_size,
                                                            params["tiled"][i], blocks, dims[i]))
    call = sharded_call(REDUCE_SCATTER, _member_params(axis_name, axis_size, True, blocks))
    return (call._replace(member_dimensions=dims) if any(dims) else call), axis_size, member_call


# --- The all-gather bucket ------------------------------------------------------------

def _gather_member_params(params: dict[str, Any], i: int) -> dict[str, Any]:
    """Member `i`'s `libra_all_gather` params (`sharded.mirror_all_gather`'s)."""
    return dict(axis_name=params["axes"], all_gather_dimension=params["dimension"][i],
                axis_size=params["axis_size"], tiled=params["tiled"],
                invariant=params["invariant"][i], blocks=params["blocks"])


_gather_abstract_eval = mirror_abstract_eval(mirror_all_gather)


def _all_gather_abstract_eval(*avals: Any, axes: tuple, axis_size: int, tiled: bool,
                              dimension: tuple, invariant: tuple, blocks: int | None) -> Any:
    """Each member's type as its `jax.lax.all_gather` has it (JAX's abstract evaluation, and
    JAX's errors), the union of their effects."""
    params = dict(axes=axes, axis_size=axis_size, tiled=tiled, dimension=dimension,
                  invariant=invariant, blocks=blocks)
    if not len(dimension) == len(invariant) == len(avals):
        raise ValueError(f"libra_bucket ({ALL_GATHER}): dimension and invariant need one entry "
                         f"per operand ({len(avals)}), got {len(dimension)} and {len(invariant)}")
    outs, effects = [], set()
    for k, aval in enumerate(avals):
        out, eff = _gather_abstract_eval(aval, **_gather_member_params(params, k))
        outs.append(out)
        effects |= set(eff)
    return outs, effects


def _all_gather_bucket(params: dict[str, Any]) -> tuple[lowering.Call, int, Any]:
    """One all-gather over the members as they are, each along its own dimension (the
    engine's segments: `lowering.Call.member_dimensions`); each member's own call."""
    def member_call(i: int) -> lowering.Call:
        return sharded_call(ALL_GATHER, _gather_member_params(params, i))
    return (member_call(0)._replace(member_dimensions=tuple(params["dimension"])),
            params["axis_size"], member_call)


# --- One primitive for every kind's bucket ---------------------------------------------

class Bucket(NamedTuple):
    """A kind's bucket form: its members' types and its params' meaning (`abstract_eval`),
    and its calls (`calls(params) -> (the flat buffer's lowering.Call, its rows, member i's
    call)`)."""

    abstract_eval: Callable[..., Any]
    calls: Callable[[dict[str, Any]], tuple[lowering.Call, int, Any]]


# The kinds with a bucket form: their rows hold it (`collectives.Collective.provide`).
ALL_REDUCE.provide("bucket", Bucket(members_abstract_eval, _psum_bucket))
REDUCE_SCATTER.provide("bucket", Bucket(_reduce_scatter_abstract_eval, _reduce_scatter_bucket))
ALL_GATHER.provide("bucket", Bucket(_all_gather_abstract_eval, _all_gather_bucket))


def bucket_abstract_eval(*avals: Any, collective: Collective, **params: Any) -> Any:
    """Each member's type as its own collective has it, and their effects (the kind's); a
    kind without a bucket form is refused by its row (`collectives.NoForm`)."""
    return collective.form("bucket").abstract_eval(*avals, **params)


libra_bucket_p = register_op("libra_bucket", abstract_eval=bucket_abstract_eval,
                             lowering=_bucket_rule, multiple_results=True)


def _from_axis_name(params: dict) -> dict:
    params = dict(params)
    params["axes"] = params.pop("axis_name")
    return params


libra_psum_fused_p = OldName("libra_psum_fused", libra_bucket_p, ALL_REDUCE)
libra_reduce_scatter_fused_p = OldName("libra_reduce_scatter_fused", libra_bucket_p,
                                       REDUCE_SCATTER, _from_axis_name)
