"""The rewrite of a scope's all-gathers (FSDP's): each libra's, one call where it is used or a
start/done pair issued ahead, consecutive forward ones one call over several where the model
says so (`prefetch_gathers`), and remat's re-gathers taken out of their checkpoint to be issued
ahead too (`hoist_regathers`). Functions of the rewrite's shared state (`scope.Scope`).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from libra_jax import _compat, planner
from libra_jax.ops import blocks as block_rule
from libra_jax.rewrite.costs import roofline_s
from libra_jax.rewrite.edits import Edits, fused_eqn, gather_bucket_pair_eqns, single_eqn
from libra_jax.rewrite.report import CallPlan
from libra_jax.rewrite.scope import Scope
from libra_jax.rewrite.sites import Site, axis_names, backward_sites, gather_site, group_size

__all__ = ["edit_gathers", "prefetch_gathers", "hoist_regathers"]


def edit_gathers(rw: Scope, eqns: Sequence[Any], gathers: Sequence[Site], axis_sizes: dict,
                 scope: str, in_loop: bool, in_backward: bool, invars: set,
                 edits: Edits) -> None:
    """Each all-gather (`gather_site`) as libra's, at the model's block count, or the count
    it was given (kind "user"). Kind "loop" in a loop body (one call each), "backward" on
    the backward pass (remat's re-gathers: in a scope autodiff's transpose made, reading
    what it computed, or taken out of their checkpoint by `hoist_regathers`), else
    "forward". A scope's forward and backward gathers over the same axes are issued as
    `prefetch_gathers` plans them: each one call where it is used
    (`ops.blocks.resolve_blocks`), or a start/done pair issued ahead, and consecutive forward
    gathers one call over several where the model says so (one plan line each call, its
    members' positions and bytes)."""
    if not gathers:
        return
    backward = backward_sites(eqns, gathers) or set()
    kinds: dict[int, str] = {}
    ahead: dict[tuple, list[Site]] = {}
    for site in gathers:
        if site.explicit_blocks is not None:
            kinds[site.index] = "user"
        elif in_loop:
            kinds[site.index] = "loop"
        else:
            kinds[site.index] = ("backward" if in_backward or site.index in backward
                                 or site.result in rw.regathered else "forward")
            ahead.setdefault(site.axes, []).append(site)
    issued: dict[int, tuple[int, str, int]] = {}  # position -> (blocks, overlap, ahead)
    calls: dict[int, tuple[int, ...]] = {}  # a call of several: its first position -> members'
    forward = {i for i, kind in kinds.items() if kind == "forward"}
    for sites in ahead.values():
        got, grouped = prefetch_gathers(rw, eqns, sites, axis_sizes, scope, edits, forward)
        issued.update(got)
        calls.update(grouped)
    later = {i for members in calls.values() for i in members[1:]}  # said with their first
    nbytes = {site.index: site.nbytes for site in gathers}
    for site in gathers:
        if site.index in later:
            continue
        k, overlap, distance = issued.get(site.index, (site.explicit_blocks, "sync", 0))
        if k is None:
            k = block_rule.resolve_blocks(site.collective, site.nbytes,
                                          group_size(axis_sizes, site.axes), rw.profile)
        if site.explicit_blocks is None and site.index not in issued:
            edits.replacements[site.index] = single_eqn(eqns[site.index], site, k, invars)
        members = calls.get(site.index, (site.index,))
        rw.report.plans.append(CallPlan(scope, site.axes, members,
                                        sum(nbytes[i] for i in members), int(k),
                                        kinds[site.index], overlap, site.collective, distance))


def _reach(eqns: Sequence[Any], sites: Sequence[Site], forward: Collection[int],
           defined: dict[Any, int]) -> list[int]:
    """Per gather of the pass (`sites`, in order), the last one it may share one call with
    (`planner.plan_gathers`' ``reach``): the run of forward gathers of its bucket class
    (`Site.bucket_class`: one engine call) after it whose operands are computed before the
    pass's first gather (a parameter's shard, or its cast), so that the call can be issued
    wherever the model times it (at its first member's place, or ahead). A gather of a value
    the pass computes is its own call, as are remat's re-gathers: fused, these would hold
    several layers' weights in the backward pass, which remat exists to avoid."""
    made = [max((defined.get(v, -1) for v in eqns[s.index].invars[:1] if _compat.is_var(v)),
                default=-1) for s in sites]
    joins = [s.index in forward and made[j] < sites[0].index for j, s in enumerate(sites)]
    out = list(range(len(sites)))
    for j, site in enumerate(sites):
        last = j
        while (joins[j] and last + 1 < len(sites) and joins[last + 1]
               and sites[last + 1].bucket_class == site.bucket_class):
            last += 1
        out[j] = last
    return out


def prefetch_gathers(rw: Scope, eqns: Sequence[Any], sites: Sequence[Site], axis_sizes: dict,
                     scope: str, edits: Edits, forward: Collection[int] = ()
                     ) -> tuple[dict[int, tuple[int, str, int]], dict[int, tuple[int, ...]]]:
    """Issue a scope's gathers over one set of axes (in jaxpr order: the forward pass's,
    then remat's re-gathers) as the model plans them (`planner.plan_gathers`;
    ``optimize(prefetch=d)``: at distance d), consecutive forward ones (positions in
    `forward`, `_reach`) grouped into one call over their members where the model prices
    one call lower than several, within ``optimize(prefetch_bytes=)`` (a group holds its
    later members' gathered weights from its first member's use, as prefetch holds the
    gathers it issued ahead; ``fusion=False``: one call each). A group of several is one
    `libra_bucket` where its first member is used, or one start/done pair over its members
    issued ahead. Ahead, group i starts when group i - d is done, reading that group's
    result as an operand it ignores (XLA orders by data only, and drops an
    `optimization_barrier` on CPU: this keeps the start from moving earlier and holding its
    buffer longer), and is done where the one call was, before its first use. One that
    cannot start earlier (an operand computed after that point) is one call where it is
    used, except a re-gather out of its checkpoint (`hoist_regathers`), which is a pair at
    its place, its start reading the checkpoint's cotangent. Returns, per position issued
    here, (blocks, "prefetch" and the distance, or "sync" and 0 at its place), and per
    call of several its first position and its members' positions; positions left out are
    one call each, as `edit_gathers` issues them."""
    world = group_size(axis_sizes, sites[0].axes)
    if world < 2:
        return {}, {}
    derivation = block_rule.capped_derivation(rw.profile, world)
    cost = derivation.cost
    collective = sites[0].collective
    positions = [site.index for site in sites]
    costs = [0.0 if i in positions else roofline_s(eqn, rw.profile)
             for i, eqn in enumerate(eqns)]
    bounds = [*positions, len(eqns)]
    steps = [planner.GatherStep(float(sum(costs[bounds[j] + 1:bounds[j + 1]])),
                                int(site.nbytes)) for j, site in enumerate(sites)]
    one_call = [derivation.no_overlap_key(site.nbytes, site.collective) for site in sites]
    lead_s = float(sum(costs[:positions[0]]))
    if len(sites) == 1 and lead_s == 0:
        return {}, {}  # no compute before its use: nothing to issue it ahead of
    defined = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    reach = _reach(eqns, sites, forward, defined) if rw.options.fusion else None

    def group_key(nbytes: int) -> int:
        return derivation.no_overlap_key(nbytes, collective)
    # The model's choice (or the distance asked for), shown by `explain` even where
    # "auto" issues one call each (`prefetch_mode`).
    plan = planner.plan_gathers(
        steps, cost, one_call_blocks=one_call, max_bytes=rw.options.prefetch_bytes,
        lead_s=lead_s, distance=None if rw.options.prefetch == "auto" or
        not rw.options.prefetch else int(rw.options.prefetch), reach=reach,
        group_blocks=group_key)
    d = plan.distance if rw.prefetch is None else min(plan.distance, rw.prefetch)
    groups = (plan.groups if d == plan.distance else
              plan.one_call_groups if d == 0 else planner.each_alone(len(sites)))
    rw.report.gathers.append({
        "scope": scope, "axes": sites[0].axes, "collective": collective,
        "world": world, "steps": steps,
        "plan": plan, "distance": d, "why": rw.prefetch_why if d != plan.distance else "",
        "cost": cost, "lead_s": lead_s, "positions": tuple(positions), "one_call": one_call,
        "groups": groups, "reach": reach, "group_blocks": group_key,
        "operands": tuple(eqns[i].invars[0] for i in positions),
        "key_unit": derivation.key_unit, "profile": rw.profile})
    results: dict[int, Any] = {}  # a call's first position -> its result (its first member's)
    issued: dict[int, tuple[int, str, int]] = {}
    calls: dict[int, tuple[int, ...]] = {}
    for gi, (a, b) in enumerate(groups):
        members = list(sites[a:b + 1])
        first = members[0]
        made = max((defined.get(v, -1) for s in members for v in eqns[s.index].invars[:1]
                    if _compat.is_var(v)), default=-1)
        # Where it starts: right after group gi - d is done, or at the scope's start.
        at = positions[groups[gi - d][0]] if gi >= d else 0
        after = results.get(at) if gi >= d else None
        ahead, place = d, edits.after if gi >= d else edits.before
        k = derivation.launch_blocks(plan.blocks[a])
        if not d or made >= at:  # not issued ahead (an operand is computed later)
            if len(members) > 1:  # one call over the group where its first member is used
                k = derivation.launch_blocks(group_key(sum(s.nbytes for s in members)))
                call = fused_eqn(eqns, members, first.axes, False, k)
                edits.replacements[first.index] = call
                edits.removed.update(s.index for s in members[1:])
                results[first.index] = call.outvars[0]
                issued.update((s.index, (k, "sync", 0)) for s in members)
                calls[first.index] = tuple(s.index for s in members)
                continue
            cotangent = rw.regathered.get(first.result)
            if cotangent is None:
                continue  # one call where it is used
            # A re-gather out of its checkpoint: at its place, after its pass's cotangent
            # (else XLA could run it in the forward pass, holding its buffer).
            at, after, ahead, place = first.index, cotangent, 0, edits.before
        start, done = gather_bucket_pair_eqns([eqns[s.index] for s in members], members, k,
                                              rw.call_id(), after)
        place.setdefault(at, []).append(start)
        edits.replacements[first.index] = done
        edits.removed.update(s.index for s in members[1:])
        results[first.index] = done.outvars[0]
        issued.update((s.index, (k, "prefetch" if ahead else "sync", ahead)) for s in members)
        if len(members) > 1:
            calls[first.index] = tuple(s.index for s in members)
    return issued, calls


def hoist_regathers(rw: Scope, eqns: Sequence[Any], axis_sizes: dict) -> list[Any]:
    """The scope's equations with remat's re-gathers taken out of their checkpoint: a
    `checkpoint` autodiff's transpose made (a layer's backward pass under `jax.checkpoint`)
    whose body all-gathers one of its inputs gets that gather's result as an input
    instead, the gather placed just before it, where `prefetch_gathers` may issue it
    ahead. The values are the same; what remat saves is unchanged (the gather still runs in
    the backward pass, not kept from the forward one). Each is noted with the
    checkpoint's last input computed in this scope (its cotangent), which its start waits
    for unless prefetched (so XLA cannot move it into the forward pass)."""
    out: list[Any] = []
    defined = {v for eqn in eqns for v in eqn.outvars}
    for eqn in eqns:
        body = eqn.params.get("jaxpr")
        if (eqn.primitive.name not in ("remat2", "checkpoint")
                or not isinstance(body, _compat.Jaxpr) or body.constvars
                or not _compat.made_by_transpose(eqn, deep=False)):
            out.append(eqn)
            continue
        position: dict[Any, int] = {v: i for i, v in enumerate(body.invars)}
        taken = [e for e in body.eqns
                 if gather_site(0, e) is not None and e.params.get("blocks") is None
                 and _compat.is_var(e.invars[0]) and e.invars[0] in position
                 and all(a in axis_sizes for a in axis_names(e.params))]
        computed = [v for v in eqn.invars if _compat.is_var(v) and v in defined]
        if not taken or not computed:
            out.append(eqn)
            continue
        hoisted = []
        for e in taken:
            result = _compat.new_var(e.outvars[0].aval)
            hoisted.append(e.replace(invars=[eqn.invars[position[e.invars[0]]]],
                                     outvars=[result], source_info=eqn.source_info))
            rw.regathered[result] = computed[-1]
        kept = [e for e in body.eqns if not any(e is t for t in taken)]
        new_body = body.replace(invars=[*body.invars, *(e.outvars[0] for e in taken)],
                                eqns=kept)
        out.extend(hoisted)
        out.append(eqn.replace(invars=[*eqn.invars, *(e.outvars[0] for e in hoisted)],
                               params={**eqn.params, "jaxpr": new_body}))
    return out
