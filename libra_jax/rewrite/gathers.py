"""The rewrite of a scope's all-gathers (FSDP's): each libra's, one call where it is used or a
start/done pair issued ahead (`prefetch_gathers`), and remat's re-gathers taken out of their
checkpoint to be issued ahead too (`hoist_regathers`). Functions of the scope's `Rewriter`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from libra_jax import _compat, allreduce, model, planner
from libra_jax.rewrite.costs import roofline_s
from libra_jax.rewrite.edits import Edits, gather_pair_eqns, single_eqn
from libra_jax.rewrite.report import PsumPlan, block_cap
from libra_jax.rewrite.sites import Site, axis_names, backward_sites, gather_site, group_size

if TYPE_CHECKING:
    from libra_jax.rewrite.rewriter import Rewriter

__all__ = ["edit_gathers", "prefetch_gathers", "hoist_regathers"]


def edit_gathers(rw: Rewriter, eqns: Sequence[Any], gathers: Sequence[Site], axis_sizes: dict,
                 scope: str, in_loop: bool, in_backward: bool, invars: set,
                 edits: Edits) -> None:
    """Each all-gather (`gather_site`) as libra's, at the model's block count, or the count
    it was given (kind "user"). Kind "loop" in a loop body (one call each), "backward" on
    the backward pass (remat's re-gathers: in a scope autodiff's transpose made, reading
    what it computed, or taken out of their checkpoint by `hoist_regathers`), else
    "forward". A scope's forward and backward gathers over the same axes are issued as
    `prefetch_gathers` plans them: each one call where it is used
    (`allreduce.default_blocks`), or a start/done pair issued ahead."""
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
    for sites in ahead.values():
        issued.update(prefetch_gathers(rw, eqns, sites, axis_sizes, scope, edits))
    for site in gathers:
        k, overlap, distance = issued.get(site.index, (site.explicit_blocks, "sync", 0))
        if k is None:
            k = allreduce.default_blocks(site.nbytes, group_size(axis_sizes, site.axes),
                                         rw.profile, collective=site.collective)
        if site.explicit_blocks is None and site.index not in issued:
            edits.replacements[site.index] = single_eqn(eqns[site.index], site, k, invars)
        rw.report.plans.append(PsumPlan(scope, site.axes, (site.index,), site.nbytes,
                                          int(k), kinds[site.index], overlap,
                                          site.collective, distance))


def prefetch_gathers(rw: Rewriter, eqns: Sequence[Any], sites: Sequence[Site], axis_sizes: dict,
                     scope: str, edits: Edits) -> dict[int, tuple[int, str, int]]:
    """Issue a scope's gathers over one set of axes (in jaxpr order: the forward pass's,
    then remat's re-gathers) ahead of their use, as the model plans them
    (`planner.plan_gathers`; ``optimize(prefetch=d)``: at distance d): gather i starts
    when gather i - d is done, reading that gather's result as an operand it ignores (XLA
    orders by data only, and drops an `optimization_barrier` on CPU: this keeps the start
    from moving earlier and holding its buffer longer), and is done where the one call
    was, before its first use. One that cannot start earlier (its operand is computed
    after that point) stays one call, except a re-gather out of its checkpoint
    (`hoist_regathers`), which is a pair at its place, its start reading the
    checkpoint's cotangent. Returns, per position issued as a pair, (blocks, "prefetch"
    and the distance, or "sync" and 0 at its place); positions left out are one call
    each."""
    world = group_size(axis_sizes, sites[0].axes)
    if world < 2:
        return {}
    cap, cap_why = block_cap(rw.profile)
    derivation = model.derive(rw.profile, world, max_blocks=cap, max_blocks_why=cap_why)
    cost = derivation.cost
    positions = [site.index for site in sites]
    costs = [0.0 if i in positions else roofline_s(eqn, rw.profile)
             for i, eqn in enumerate(eqns)]
    bounds = [*positions, len(eqns)]
    steps = [planner.GatherStep(float(sum(costs[bounds[j] + 1:bounds[j + 1]])),
                                int(site.nbytes)) for j, site in enumerate(sites)]
    one_call = [derivation.no_overlap_key(site.nbytes, site.collective) for site in sites]
    lead_s = float(sum(costs[:positions[0]]))
    if len(sites) == 1 and lead_s == 0:
        return {}  # no compute before its use: nothing to issue it ahead of
    # The model's choice (or the distance asked for), shown by `explain` even where
    # "auto" issues one call each (`prefetch_mode`).
    plan = planner.plan_gathers(
        steps, cost, one_call_blocks=one_call, max_bytes=rw.options.prefetch_bytes,
        lead_s=lead_s, distance=None if rw.options.prefetch == "auto" or
        not rw.options.prefetch else int(rw.options.prefetch))
    d = plan.distance if rw.prefetch is None else min(plan.distance, rw.prefetch)
    rw.report.gathers.append({
        "scope": scope, "axes": sites[0].axes, "collective": sites[0].collective,
        "world": world, "steps": steps,
        "plan": plan, "distance": d, "why": rw.prefetch_why if d != plan.distance else "",
        "cost": cost, "lead_s": lead_s, "positions": tuple(positions), "one_call": one_call,
        "operands": tuple(eqns[i].invars[0] for i in positions),
        "key_unit": derivation.key_unit, "profile": rw.profile})
    defined = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    results: dict[int, Any] = {}  # position -> the done's result (its gathered value)
    issued = {}
    for j, site in enumerate(sites):
        eqn = eqns[site.index]
        operand = eqn.invars[0]
        k = derivation.launch_blocks(plan.blocks[j])
        made = defined.get(operand, -1) if _compat.is_var(operand) else -1
        # Where it starts: right after gather j - d is done, or at the scope's start.
        at = positions[j - d] if j >= d else 0
        after = results.get(at) if j >= d else None
        ahead, place = d, edits.after if j >= d else edits.before
        if not d or made >= at:  # not issued ahead (its operand is computed later)
            cotangent = rw.regathered.get(site.result)
            if cotangent is None:
                continue  # one call where it is used
            # A re-gather out of its checkpoint: at its place, after its pass's cotangent
            # (else XLA could run it in the forward pass, holding its buffer).
            at, after, ahead, place = site.index, cotangent, 0, edits.before
        start, done = gather_pair_eqns(eqn, site, k, rw.call_id(), after)
        place.setdefault(at, []).append(start)
        edits.replacements[site.index] = done
        results[site.index] = done.outvars[0]
        issued[site.index] = (k, "prefetch" if ahead else "sync", ahead)
    return issued


def hoist_regathers(rw: Rewriter, eqns: Sequence[Any], axis_sizes: dict) -> list[Any]:
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
