"""A scope's rewrite as passes over one `ScopeState`, in two ordered lists: `NORMALISE`, the
passes that bring its equations into the form the rewrite plans (each returns the new
equations), then `PLAN`, the passes that find its collectives, plan them and record the edits
that issue them (each fills the state). `Rewriter.jaxpr` runs both (`run`) and schedules the
edits (`Rewriter.finish`).

A scope is a jaxpr: the step's, a `shard_map`'s body, a loop's body. `NORMALISE`, and why
this order, pass by pass:

1. ``inline``: with ``ready="dataflow"``, a `jit` inside the step is a boundary only (its body
   inlined, `ready.inline_calls`), and a backward scan's stacked-slice psums go into its body
   (`loops.sink`), so that the passes below see every gradient psum where it is computed;
2. ``deferred``: with ``ready="dataflow"``, a forward `shard_map`'s reductions of its results
   (the loss's `pmean`) moved into the backward `shard_map` (`deferred.defer_reductions`),
   where they are planned with the gradients, before that body is rewritten (``sub_jaxprs``);
3. ``shrink``: a psum feeding only a linear map that shrinks it is issued after the map
   (`shrink.shrink_psums`), at the map's size;
4. ``transposes``: a psum_scatter of a transpose is issued before it
   (`transposes.scatter_before_transpose`), after ``shrink`` (which may move a psum there);
5. ``loops``: a scan's hoistable psums leave its body where the model prices that lower
   (`Rewriter.hoist_loops`), before the bodies are rewritten (so a body plans what stays);
6. ``regathers``: remat's re-gathers taken out of their checkpoints to be issued ahead
   (`gathers.hoist_regathers`; outside loops, where the prefetch distance is not 0);
7. ``sub_jaxprs``: every sub-jaxpr rewritten as a scope of its own (`Rewriter.sub_jaxprs`);
8. ``zeros``: psums of empty operands split off and psums of zeros folded
   (`sites.split_empty_operands`, `sites.fold_zero_psums`; said in the report);
9. ``sliced``: a psum whose result is only sliced to this rank's shard becomes a
   psum_scatter (`sites.scatter_sliced_psums`);
10. ``gathers``: each all-gather moved to just before its first use (`edits.sink_gathers`).

`PLAN`, in order:

1. ``sites``: the scope's collectives by the site rules (`sites.find_site`): psums and
   psum_scatters, all-gathers, all-to-alls, and why others are skipped;
2. ``readiness``: with ``ready="dataflow"``, each gradient collective moved to where its
   operand is ready (`ready.to_ready_points`), so that the planner's layers are the backward
   pass's whichever way the code was written; the sites found again there;
3. ``unplanned``: what the report says of the collectives no rule serves;
4. ``other_collectives``: the all-gathers' and the all-to-alls' edits (`gathers`,
   `exchanges`);
5. ``classify``: each psum's kind (`sites.site_kinds`: gradient, forward, ...; under
   ``ready="dataflow"`` a loss's pmean that nothing reads joins the gradients:
   `sites.value_sites`) and each
   equation's compute (`costs.roofline_s`; none for what waits for a gradient, the update);
6. ``singles``: every collective that is no gradient issued alone, at its resolved block
   count (`ops.blocks.resolve_blocks`);
7. ``buckets``: the gradient collectives planned per stream (`buckets.plan`), each bucket
   one call or a start/done pair (`buckets.split_buckets`), and its edits
   (`buckets.edit_bucket`).

Each pass is a function of the rewrite's shared state (`scope.Scope`) and this scope's
(`ScopeState`); tests/test_passes.py runs each alone on a small jaxpr.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from libra_jax import _compat, loops
from libra_jax.ops import blocks as block_rule
from libra_jax.rewrite.buckets import edit_bucket, split_buckets
from libra_jax.rewrite.buckets import plan as plan_buckets
from libra_jax.rewrite.costs import roofline_s
from libra_jax.rewrite.deferred import defer_reductions
from libra_jax.rewrite.edits import (
    Edits,
    downstream_of,
    fusable_reach,
    pairs_bucket,
    single_eqn,
    sink_gathers,
)
from libra_jax.rewrite.exchanges import edit_exchanges
from libra_jax.rewrite.gathers import edit_gathers, hoist_regathers
from libra_jax.rewrite.ready import inline_calls, to_ready_points
from libra_jax.rewrite.report import CallPlan
from libra_jax.rewrite.scope import Scope
from libra_jax.rewrite.shrink import shrink_psums
from libra_jax.rewrite.sites import (
    Site,
    axis_names,
    find_site,
    fold_zero_psums,
    gradient_sites,
    group_size,
    is_psum,
    libras_row,
    scatter_sliced_psums,
    site_kinds,
    split_empty_operands,
    warn_invariant_operands,
)
from libra_jax.rewrite.transposes import scatter_before_transpose

__all__ = ["ScopeState", "Pass", "Step", "NORMALISE", "PLAN", "normalise", "run"]


@dataclasses.dataclass
class ScopeState:
    """One scope as the passes see it: its equations (each pass replaces them), its outputs,
    the sizes of the mesh axes in scope, its name, and where it is: in (a) loop body
    (`in_loop`), the body of a loop or shard_map autodiff's transpose made (`transposed`: all
    backward pass), the body of any equation autodiff's transpose made (`in_backward`)."""

    eqns: list[Any]
    outvars: Sequence[Any]
    axis_sizes: dict
    scope: str
    in_loop: bool = False
    transposed: bool = False
    in_backward: bool = False
    invars: set = dataclasses.field(default_factory=set)  # the scope's inputs
    # Filled by `PLAN`: the sites by kind of collective (`sites`), why others were skipped,
    # each psum's kind by position (`classify`), each equation's compute, the gradient
    # streams (`singles`: per axes and bucket class, its sites), and the edits.
    sites: list[Site] = dataclasses.field(default_factory=list)
    gathers: list[Site] = dataclasses.field(default_factory=list)
    exchanges: list[Site] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    kinds: dict[int, str] = dataclasses.field(default_factory=dict)
    costs: list[float] = dataclasses.field(default_factory=list)
    waiting_s: float = 0.0  # the compute that waits for the gradients (the update): `classify`
    streams: dict[tuple, list[Site]] = dataclasses.field(default_factory=dict)
    edits: Edits = dataclasses.field(default_factory=Edits)


#: A pass: the scope's new equations from the shared state and the scope's.
Pass = Callable[[Scope, ScopeState], list[Any]]


def inline(rw: Scope, st: ScopeState) -> list[Any]:
    """Calls inlined and a backward scan's slice psums sunk into its body (``ready="dataflow"``,
    where the scope has a psum)."""
    if rw.options.ready != "dataflow" or not any(is_psum(e) for e in st.eqns):
        return st.eqns
    return loops.sink(inline_calls(st.eqns), st.outvars)


def deferred(rw: Scope, st: ScopeState) -> list[Any]:
    """A forward shard_map's reductions of its results moved into the backward one
    (``ready="dataflow"``)."""
    if rw.options.ready != "dataflow":
        return st.eqns
    return defer_reductions(st.eqns)


def shrink(rw: Scope, st: ScopeState) -> list[Any]:
    """Each psum feeding only a shrinking linear map issued after the map."""
    return shrink_psums(st.eqns, st.outvars)


def transposes(rw: Scope, st: ScopeState) -> list[Any]:
    """Each psum_scatter of a transpose issued before it (the renamed results recorded)."""
    return scatter_before_transpose(st.eqns, st.outvars, rw.renamed)


def hoisted_loops(rw: Scope, st: ScopeState) -> list[Any]:
    """Each scan's hoistable psums out of its body where the model says so."""
    return rw.hoist_loops(st.eqns, st.axis_sizes, st.scope)


def regathers(rw: Scope, st: ScopeState) -> list[Any]:
    """Remat's re-gathers out of their checkpoints (outside loops, prefetch not 0)."""
    if st.in_loop or rw.prefetch == 0:
        return st.eqns
    return hoist_regathers(rw, st.eqns, st.axis_sizes)


def sub_jaxprs(rw: Scope, st: ScopeState) -> list[Any]:
    """Every sub-jaxpr rewritten as a scope of its own."""
    return [rw.sub_jaxprs(eqn, i, st.axis_sizes, st.scope, st.in_loop, st.in_backward)
            for i, eqn in enumerate(st.eqns)]


def zeros(rw: Scope, st: ScopeState) -> list[Any]:
    """Empty operands split off and psums of zeros folded (the report says which)."""
    eqns, folded = fold_zero_psums(split_empty_operands(st.eqns))
    rw.report.folded.extend(f"{name} of zeros in {st.scope}" for name in folded)
    return eqns


def sliced(rw: Scope, st: ScopeState) -> list[Any]:
    """A psum only sliced to this rank's shard made a psum_scatter."""
    return scatter_sliced_psums(st.eqns, st.outvars, st.axis_sizes)


def gathers(rw: Scope, st: ScopeState) -> list[Any]:
    """Each all-gather just before its first use."""
    return sink_gathers(st.eqns)


#: The passes, in the order the module docstring gives and why.
NORMALISE: tuple[tuple[str, Pass], ...] = (
    ("inline", inline), ("deferred", deferred), ("shrink", shrink), ("transposes", transposes),
    ("loops", hoisted_loops), ("regathers", regathers), ("sub_jaxprs", sub_jaxprs),
    ("zeros", zeros), ("sliced", sliced), ("gathers", gathers))


def normalise(rw: Scope, st: ScopeState) -> ScopeState:
    """`st` after every pass of `NORMALISE`, in order (its equations replaced)."""
    for _, one in NORMALISE:
        st.eqns = list(one(rw, st))
    return st


#: A pass of `PLAN`: fills the scope's state.
Step = Callable[[Scope, ScopeState], None]


def sites(rw: Scope, st: ScopeState) -> None:
    """The scope's collectives, by kind, and why others are skipped, in order."""
    st.sites, st.gathers, st.exchanges, st.skipped = [], [], [], []
    for i, eqn in enumerate(st.eqns):
        found = find_site(i, eqn)
        if isinstance(found, str):
            st.skipped.append(found)
        elif found is not None:  # by its kind's layout: gathered, exchanged, or summed
            row = found.collective
            (st.gathers if row.gathers else st.exchanges if row.exchanges
             else st.sites).append(found)


def readiness(rw: Scope, st: ScopeState) -> None:
    """Each gradient collective moved to its ready point (``ready="dataflow"``; in a loop body
    only where it has a backward pass), its ready point and the written order recorded."""
    if rw.options.ready != "dataflow" or not st.sites:
        return
    gradient, backward = gradient_sites(st.eqns, st.sites, st.outvars, st.transposed,
                                        values=rw.options.ready == "dataflow")
    movable = [] if st.in_loop and backward is None else [
        s.index for s in st.sites if s.index in gradient and s.explicit_blocks is None]
    if movable:
        st.eqns, order, ready = to_ready_points(st.eqns, movable)
        rw.ready[st.scope] = {i: dataclasses.replace(r, after=_label(st.eqns, r.point))
                              for i, r in ready.items()}
        rw.written[st.scope] = order
        sites(rw, st)


def _label(eqns: Sequence[Any], point: int) -> str:
    """The equation at a ready point, as a report says it: its primitive and result's type."""
    if point < 0:
        return "the scope's start"
    eqn = eqns[point]
    out = eqn.outvars[0].aval if eqn.outvars else None
    shape = "x".join(map(str, getattr(out, "shape", ()))) or "scalar"
    return f"{eqn.primitive.name} ({shape}) at equation {point}"


def unplanned(rw: Scope, st: ScopeState) -> None:
    """The report's skipped sites, and each collective no rule serves (`unplanned`)."""
    rw.report.skipped.extend(f"{why} in {st.scope}" for why in st.skipped)
    served = {site.index for site in st.sites + st.gathers + st.exchanges}
    for i, eqn in enumerate(st.eqns):
        other = _compat.OTHER_COLLECTIVES.get(eqn.primitive.name)
        libras = libras_row(eqn.primitive)
        name = other or (libras.lax if libras is not None else None)
        if name is not None and i not in served:
            rw.unplanned.append(f"{name} over {axis_names(eqn.params)} in {st.scope}"
                                + (" (libra's)" if libras else ""))


def other_collectives(rw: Scope, st: ScopeState) -> None:
    """The all-gathers' and the all-to-alls' edits."""
    backward = st.in_backward or st.transposed
    edit_gathers(rw, st.eqns, st.gathers, st.axis_sizes, st.scope, st.in_loop, backward,
                 st.invars, st.edits)
    rw.report.plans += edit_exchanges(st.eqns, st.exchanges, st.axis_sizes, st.scope,
                                      st.in_loop, backward, rw.profile, st.invars, st.edits)


def classify(rw: Scope, st: ScopeState) -> None:
    """Each psum's kind and each equation's compute (none for what waits for a gradient)."""
    if not st.sites:
        return
    warn_invariant_operands(st.eqns, st.sites)
    gradient, backward = gradient_sites(st.eqns, st.sites, st.outvars, st.transposed,
                                        values=rw.options.ready == "dataflow")
    if st.in_loop and backward is None:
        # No backward pass in the body: a forward loop (a metric, a statistic per layer)
        # whose psums are no gradients; at top level this is a hand-written backward pass.
        gradient = set()
    st.kinds = site_kinds(st.sites, gradient, backward, st.in_loop)
    # Compute that consumes a gradient all-reduce (the optimizer update) waits for it
    # and overlaps nothing: it is not part of the backward stream the planner sees.
    waits = downstream_of(st.eqns, [st.eqns[i].outvars[0] for i in sorted(gradient)])
    costs = [roofline_s(eqn, rw.profile) for eqn in st.eqns]
    st.costs = [0.0 if i in waits else c for i, c in enumerate(costs)]
    st.waiting_s = float(sum(costs[i] for i in waits))  # where the step's devices meet


def singles(rw: Scope, st: ScopeState) -> None:
    """Every collective that is no gradient issued alone; the gradient ones into streams.
    Gradient collectives over the same axes of one `Site.bucket_class` are one stream of
    buckets: FSDP's reduce-scatters and all-reduces, which alternate in its backward pass,
    are two, each fused over the other's gradients (one stream fused none)."""
    st.streams = {}
    for site in st.sites:  # in jaxpr order: the report lists them so
        kind = st.kinds[site.index]
        if kind == "gradient":
            st.streams.setdefault((site.axes, site.bucket_class), []).append(site)
            continue
        k = site.explicit_blocks
        if k is None:
            k = block_rule.resolve_blocks(site.collective, site.nbytes,
                                          group_size(st.axis_sizes, site.axes), rw.profile)
            st.edits.replacements[site.index] = single_eqn(st.eqns[site.index], site, k,
                                                           st.invars)
        rw.report.plans.append(CallPlan(st.scope, site.axes, (site.index,), site.nbytes, k,
                                        kind, "sync", site.collective))


def buckets(rw: Scope, st: ScopeState) -> None:
    """The gradient streams planned into buckets, each one call or a start/done pair, and
    their edits. In a loop body each bucket is one call: every iteration's collectives are
    done within it, so a pair could only overlap the rest of that iteration; a bucket of a
    kind with no pair of a bucket (psum_scatters: `edits.pairs_bucket`) is one call too."""
    planned = [(axes, bucket, k)
               for (axes, _), members in st.streams.items()
               for bucket, k in plan_buckets(rw, members, st.costs,
                                             group_size(st.axis_sizes, axes), st.scope,
                                             fusable_reach(st.eqns, members), st.in_loop,
                                             st.waiting_s)]
    splits = ([False] * len(planned) if st.in_loop else
              split_buckets(rw, st.eqns, st.outvars, [b for _, b, _ in planned], st.costs))
    for (axes, bucket, k), split in zip(planned, splits):
        edit_bucket(rw, st.eqns, bucket, axes, bucket[0].invariant, k,
                    split and pairs_bucket(bucket[0].collective), st.scope, st.invars,
                    st.edits)


#: The passes that plan a normalised scope, in the order the module docstring gives.
PLAN: tuple[tuple[str, Step], ...] = (
    ("sites", sites), ("readiness", readiness), ("unplanned", unplanned),
    ("other_collectives", other_collectives), ("classify", classify), ("singles", singles),
    ("buckets", buckets))


def run(rw: Scope, st: ScopeState) -> ScopeState:
    """`st` normalised (`NORMALISE`) and planned (`PLAN`): its edits, ready to schedule."""
    normalise(rw, st)
    for _, step in PLAN:
        step(rw, st)
    return st
