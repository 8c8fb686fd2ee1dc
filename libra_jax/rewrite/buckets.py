"""The rewrite of a scope's gradient collectives: the planner's buckets and block counts
(`plan`), each bucket issued as one call or a start/done pair (`split_buckets`), and the edits
that issue it (`edit_bucket`). Functions of the rewrite's shared state (`scope.Scope`).
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from libra_jax import _compat, collectives, config, planner
from libra_jax.ops import blocks as block_rule
from libra_jax.rewrite.costs import region_roofline_s
from libra_jax.rewrite.edits import (
    Edits,
    can_fuse,
    downstream_of,
    fused_eqn,
    pairs_bucket,
    single_eqn,
    start_done_eqns,
    sunk_after,
    within_class,
)
from libra_jax.rewrite.report import CallPlan
from libra_jax.rewrite.scope import Scope
from libra_jax.rewrite.sites import Site

__all__ = ["plan", "edit_bucket", "split_buckets", "deferred_s"]


def plan(rw: Scope, members: list[Site], costs: list[float], world: int, scope: str,
         reach: list[int] | None = None, in_loop: bool = False, after_s: float = 0.0
         ) -> Iterable[tuple[list[Site], int]]:
    """Buckets (lists of sites) and their block counts for one group of gradient psums.
    `reach` (`fusable_reach`): which psums can share a fused bucket; the plan keeps to it.
    `in_loop`: the scope is a loop body, and this is one iteration's plan. `after_s`: the
    scope's compute that waits for its gradients (the update), for the step price."""
    if world < 2:
        return [([site], 1) for site in members]
    cap, cap_why = block_rule.block_cap(rw.profile)  # said below where it took an option away
    derivation = block_rule.capped_derivation(rw.profile, world)
    layers, start = [], 0
    for site in members:
        layers.append(planner.Layer(compute_s=float(sum(costs[start:site.index])),
                                    grad_bytes=int(site.nbytes), collective=site.collective))
        start = site.index + 1
    reach = within_class(members, reach)
    cost = with_pending(rw, derivation.cost, in_loop)
    fixed = rw.options.blocks
    if fixed is not None:
        key = derivation.key_for_blocks(fixed)  # stands for it in the model
        if rw.options.fusion:
            buckets = planner.plan_fusion_only(layers, cost, blocks=key, reach=reach).buckets
        else:
            buckets = [planner.Bucket(i, i, key) for i in range(len(layers))]
    else:
        buckets = planner.plan(layers, cost, fusion=rw.options.fusion, reach=reach).buckets
    # A bucket that cannot be one fused all-reduce runs as several: predict what runs.
    buckets = planner.within_reach(buckets, reach)
    rw.report.predicted.append({
        "scope": scope, "layers": layers, "buckets": list(buckets), "in_loop": in_loop,
        "after_s": after_s,
        "backward_s": planner.simulate(layers, buckets, cost),
        # The loaded profile and its derivation: `explain` reads these, never a name.
        "profile": rw.profile, "derivation": derivation, "world": world,
        # For `libra_jax.explain`: per layer, the psum's equation index and result variable;
        # the cost model and what its keys count.
        "axes": members[0].axes, "members": tuple(s.index for s in members),
        "results": tuple(rw.renamed.get(s.result, s.result) for s in members), "cost": cost,
        "key_unit": derivation.key_unit, "reach": reach,
        # Where each member is ready in the backward pass (`ready`; None: where written).
        "ready": tuple(rw.ready.get(scope, {}).get(s.index) for s in members),
        # Said where the cap took an option away.
        "limit": (f"block counts at most {cap}: {cap_why}"
                  if cap is not None and any(cap_why in why
                                             for why in derivation.dropped.values())
                  else ""),
    })
    out = []
    for bucket in buckets:
        if rw.options.blocks is not None:
            k = rw.options.blocks
        else:
            k = derivation.launch_blocks(bucket.blocks)
        out.append((members[bucket.first:bucket.last + 1], k))
    return out


def with_pending(rw: Scope, cost: planner.CostModel, in_loop: bool) -> planner.CostModel:
    """`cost` with the pending cost (`planner.CollectiveTerms.pending_s`) of each kind whose
    buckets this scope issues as one call: the profile's ``pending_allreduce_us`` for a kind
    with no start/done pair of a bucket (`pairs_bucket`: the reduce-scatter's) and, under
    ``overlap="sync"``, for every kind. Why: a one-call bucket ready mid-backward holds the
    device until the last rank arrives, which the planner must weigh when it splits a stream
    (measured, 2026-12-07: the FSDP example's reduce-scatters in two one-call buckets against
    one, priced 0.7% ahead without it, ran 1.5-3% behind). None in a loop body (each
    iteration's calls are done within it) or where the profile has no such wait (GPUs)."""
    fair = rw.profile.fair_share
    pending = fair.pending_allreduce_s if fair is not None else None
    if in_loop or not pending:
        return cost

    def of(row: Any) -> float:
        return pending if rw.options.overlap == "sync" or not pairs_bucket(row) else 0.0

    return dataclasses.replace(
        cost, pending_s=of(collectives.REFERENCE),
        collectives={row: dataclasses.replace(terms, pending_s=of(row))
                     for row, terms in cost.collectives.items()})


def edit_bucket(rw: Scope, eqns: Sequence[Any], bucket: list[Site], axes: tuple,
                invariant: bool, k: int, split: bool, scope: str, invars: set,
                edits: Edits) -> None:
    """The edits that issue one planned gradient bucket: fused (or, where its members
    cannot be one call, each alone), as one call or a start/done pair; and its report."""
    mode = "start-done" if split else "sync"
    if len(bucket) == 1 or not can_fuse(eqns, bucket):
        for site in bucket:
            if split:
                edits.replacements[site.index], edits.dones[site.index] = start_done_eqns(
                    eqns, [site], axes, invariant, k, rw.call_id())
            else:
                edits.replacements[site.index] = single_eqn(eqns[site.index], site, k, invars)
                _say_copy(rw, eqns, site, scope, edits.replacements[site.index])
        rw.report.plans.extend(
            CallPlan(scope, axes, (s.index,), s.nbytes, k, "gradient", mode, s.collective)
            for s in bucket)
        return
    last = bucket[-1].index
    if split:
        edits.replacements[last], edits.dones[last] = start_done_eqns(
            eqns, bucket, axes, invariant, k, rw.call_id())
    else:
        edits.replacements[last] = fused_eqn(eqns, bucket, axes, invariant, k)
    edits.removed.update(site.index for site in bucket[:-1])
    edits.sink[last] = sunk_after(eqns, bucket)
    rw.report.plans.append(CallPlan(scope, axes, tuple(s.index for s in bucket),
                                      sum(s.nbytes for s in bucket), k, "gradient", mode,
                                      bucket[0].collective))


def split_buckets(rw: Scope, eqns: Sequence[Any], outvars: Sequence[Any],
                  buckets: list[list[Site]], costs: Sequence[float]) -> list[bool]:
    """Per gradient bucket, whether it is issued as a start/done pair (else one call).

    "auto" weighs what each way costs. A start/done pair defers the bucket's own
    downstream work (its optimizer update) until after the backward pass, where nothing
    hides it, and makes one call more than one call does (the profile's ``call_us``). One
    call lets that work run beside the rest of the backward pass, but leaves the all-reduce
    pending in the device's program until the last rank arrives: on XLA:CPU that costs the
    step about the profile's `pending_allreduce_us` (measured, benchmarks/results/
    end_to_end.md), at most the compute left after the bucket to hide it (`costs` after its
    last member: `planner.pending_at`; a bucket ready at the end of the backward pass costs
    nothing pending, as the step waits for every rank there anyway). Deferring costs the
    work's roofline time times the share of it the backward pass would have hidden: the
    cores its compute threads leave idle, ``max(0, 1 - D / P)`` in the fair-share form; none
    where the compute threads fill the cores (as 8 host devices do on 2: there the work
    takes the same cores either way, and the pair wins where compute is left to hide the
    wait; benchmarks/results/planning_quality.md). Under ``LIBRA_JAX_CUDA=nccl`` every bucket
    is a pair, whatever the profile: on a GPU libra's NCCL call as one call makes XLA's stream
    wait for it at once, which serialises it with the backward pass. Other profiles without
    `pending_allreduce_us` (the GPU forms on the other paths, until `benchmarks/gpu_check.sh`
    has measured start/done) issue one call."""
    mode = rw.options.overlap
    if mode != "auto":
        return [mode == "start-done"] * len(buckets)
    if config.cuda_path() == "nccl":  # whatever the profile: the program a GPU runs
        return [True] * len(buckets)
    fair_share = rw.profile.fair_share
    pending_s = fair_share.pending_allreduce_s if fair_share is not None else None
    if pending_s is None:
        return [False] * len(buckets)
    assert fair_share is not None
    hidden = max(0.0, 1.0 - fair_share.compute_threads / fair_share.cores)
    total = float(sum(costs))
    return [deferred * hidden + fair_share.call_s
            < planner.pending_at(pending_s, float(sum(costs[:bucket[-1].index + 1])), total)
            for bucket, deferred in zip(buckets, deferred_s(rw, eqns, outvars, buckets))]


def deferred_s(rw: Scope, eqns: Sequence[Any], outvars: Sequence[Any],
               buckets: list[list[Site]]) -> list[float]:
    """Per bucket, the predicted seconds of the work that waits for its all-reduce alone:
    the pure equations downstream of its results and of no other bucket's, priced as one
    fused region (`region_roofline_s`), as XLA fuses an optimizer's elementwise chain."""
    reached = [downstream_of(eqns, [eqns[s.index].outvars[0] for s in bucket])
               for bucket in buckets]
    shared = collections.Counter(i for r in reached for i in r)
    readers: dict[Any, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if _compat.is_var(v):
                readers.setdefault(v, []).append(i)
    for v in outvars:
        if _compat.is_var(v):
            readers.setdefault(v, []).append(len(eqns))  # read after the last equation
    return [region_roofline_s(eqns, [i for i in sorted(r) if shared[i] == 1
                                      and not eqns[i].effects], readers, rw.profile)
            for r in reached]


def _say_copy(rw: Scope, eqns: Sequence[Any], site: Site, scope: str, issued: Any) -> None:
    """Notes a psum issued in place (`single_eqn`'s equation `issued`, ``inplace``: its
    operand is no input of the scope) whose operand another equation reads too: XLA must copy
    the operand first, as the all-reduce overwrites it (a bucket packs its members into a
    buffer of its own, so only a psum alone is in place)."""
    eqn = eqns[site.index]
    operand = eqn.invars[0]
    if not (issued.params.get("inplace", False) and eqn.params.get("inplace", True)
            and _compat.is_var(operand)):
        return
    readers = sum(v is operand for e in eqns for v in e.invars if _compat.is_var(v))
    if readers > 1:
        shape = "x".join(map(str, operand.aval.shape)) or "scalar"
        rw.report.copied.append(
            f"psum of {operand.aval.dtype}[{shape}] in {scope}: its operand has "
            f"{readers - 1} other reader(s), so XLA copies it before the in-place all-reduce")
