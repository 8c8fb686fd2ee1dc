"""The rewrite of one program: `Options`, and the `Rewriter` that walks its scopes.

A scope (a jaxpr: the step's, a `shard_map`'s body, a loop's body) is rewritten by its passes
(`Rewriter.jaxpr`, `passes.run`): those that normalise its equations (`passes.NORMALISE`: its
sub-jaxprs rewritten among them, through `sub_jaxprs`, and a scan's hoistable psums out of
its body where the model prices that lower, through `hoist_loops` and `loop_plan`), then
those that find, classify and plan its collectives and record their edits (`passes.PLAN`);
then its equations are scheduled (`finish`, `edits.schedule`).
"""
from __future__ import annotations

import collections
import collections.abc
import dataclasses
from collections.abc import Sequence
from typing import Any

from libra_jax import _compat, config, loops, model, planner
from libra_jax.ops import blocks as block_rule
from libra_jax.ops.start_done import MAX_CALL_ID
from libra_jax.rewrite.costs import roofline_s
from libra_jax.rewrite.edits import (
    Edits,
    map_jaxprs,
    program_fingerprint,
    schedule,
)
from libra_jax.rewrite.passes import ScopeState, run
from libra_jax.rewrite.ready import Ready
from libra_jax.rewrite.report import LoopPlan, OptimizeReport
from libra_jax.rewrite.scope import LOOP_MODES, Options
from libra_jax.rewrite.sites import (
    contains_psum,
    group_size,
)

__all__ = ["Options", "Rewriter", "LOOP_MODES"]


class Rewriter:
    """One program's rewrite, scope by scope (`jaxpr`): the state its scopes share (the
    options, the report, the loaded profile, call ids, scope names) and the walk over them.
    Each concern is a module of its own: the sites (`sites`), the gradient buckets
    (`buckets`), the all-gathers (`gathers`), the edits and their schedule (`edits`)."""

    def __init__(self, options: Options, report: OptimizeReport, program: Any,
                 profile: model.Profile) -> None:
        self.options, self.report = options, report
        self.profile = profile  # resolved once by the caller: the rewrite and report share it
        self.program = program  # the ClosedJaxpr being rewritten (for `call_id`)
        self.fingerprint: int | None = None
        self.calls = 0
        self.scope_names: collections.Counter[str] = collections.Counter()
        self.unplanned: list[str] = []  # `OptimizeReport.unplanned`, one entry per equation
        # (scope, a scan equation's position) -> the choice hoist_loops made for its stacked
        # slices: a LoopPlan, completed once the body is planned (`loop_report`).
        self.hoisting: dict[tuple[str, int], LoopPlan] = {}
        # Remat's re-gathers taken out of their `checkpoint` to be issued ahead (`gathers.
        # hoist_regathers`): their results, each with the cotangent it must not start before.
        self.regathered: dict[Any, Any] = {}
        self.renamed: dict[Any, Any] = {}  # `transposes`: a moved scatter's result -> the old
        self.prefetch, self.prefetch_why = self.prefetch_mode()
        # Per scope, each gradient collective's ready point by its position (`ready`), and
        # each position's before the collectives moved (the report says those).
        self.ready: dict[str, dict[int, Ready]] = {}
        self.written: dict[str, list[int]] = {}

    def prefetch_mode(self) -> tuple[int | None, str]:
        """(the distance all-gathers are issued at, None: the model's per scope; why "auto"
        issues one call each, or ""). ``prefetch="auto"`` takes the model's distance only on
        a GPU under ``LIBRA_JAX_CUDA=nccl`` (libra's GPU all-gather, issued on its own stream;
        not yet run on a GPU: opt-in with that path). On CPU one call each: it measures best
        on jax 0.10.2, whose XLA:CPU merges remat's re-gathers with the forward's for one call;
        on jax 0.12 the model's distance beat it on one FSDP MLP of three
        (benchmarks/results/fsdp_prefetch.md, fsdp_prefetch_jax0.12.md: the engine's copies
        and the compute share the same cores). On the other GPU paths the all-gathers are
        XLA's, which its own scheduler moves."""
        mode = self.options.prefetch
        if mode != "auto":
            return int(mode), ""
        if self.profile.fair_share is not None:
            return 0, ("on CPU one call where it is used measures as fast as issuing ahead or "
                       "faster (benchmarks/results/fsdp_prefetch.md); time prefetch=1 and 2 "
                       "for a large model")
        if config.cuda_path() != "nccl":
            return 0, ("libra's GPU all-gather is NCCL's (LIBRA_JAX_CUDA=nccl); on this path "
                       "the all-gathers are XLA's")
        return None, ""

    def call_id(self) -> int:
        """The id of the program's next start/done pair (`libra_jax.ops.start_done`): a fingerprint
        of the program's structure plus a count. The same program always gets the same ids,
        so a retrace hits JAX's compilation cache; programs of another structure get others."""
        if self.fingerprint is None:
            self.fingerprint = program_fingerprint(self.program.jaxpr) >> 8
        self.calls += 1
        return (self.fingerprint + self.calls) % MAX_CALL_ID

    # One jaxpr scope: its passes (`passes.run`: normalised, sites found, classified,
    # planned, edits made), then its equations scheduled (`finish`).

    def jaxpr(self, jaxpr: Any, *, axis_sizes: dict, scope: str, in_loop: bool,
              transposed: bool = False, in_backward: bool = False) -> Any:
        """One scope rewritten. `in_loop`: it is (in) a loop body; `transposed`: it is the body
        of a loop autodiff's transpose made (the backward scan of scan-over-layers), all of
        it backward pass though its own equations do not say so; `in_backward`: it is (in) the
        body of any equation autodiff's transpose made (a `checkpoint`'s backward pass: its
        all-gathers are remat's re-gathers)."""
        st = run(self, ScopeState(list(jaxpr.eqns), jaxpr.outvars, axis_sizes, scope, in_loop,
                                  transposed, in_backward, invars=set(jaxpr.invars)))
        return self.finish(jaxpr, st.eqns, st.edits, scope)

    def finish(self, jaxpr: Any, eqns: list[Any], edits: Edits, scope: str) -> Any:
        """The scope scheduled; its report's equation positions are the ones before its
        collectives moved to their ready points (where the written program has them)."""
        order = self.written.get(scope)
        if order is not None:
            for k, p in enumerate(self.report.plans):
                if p.scope == scope:
                    self.report.plans[k] = dataclasses.replace(
                        p, members=tuple(order[i] for i in p.members))
            for entry in self.report.predicted:
                if entry["scope"] == scope:
                    entry["members"] = tuple(order[i] for i in entry["members"])
        return jaxpr.replace(eqns=schedule(eqns, edits))

    def hoist_loops(self, eqns: Sequence[Any], axis_sizes: dict, scope: str) -> list[Any]:
        """The scope's equations with each scan's hoistable psums (`loops.hoistable`) taken out
        of the loop where `loop_plan` says so; the others' loops get its block count."""
        out: list[Any] = []
        for eqn in eqns:
            hoists = [h for h in loops.hoistable(eqn) if all(a in axis_sizes for a in h.axes)]
            hoists = [h for h in hoists if hoists and h.axes == hoists[0].axes]
            if not hoists or group_size(axis_sizes, hoists[0].axes) < 2:
                out.append(eqn)
                continue
            plan = loop_plan(self, eqn, hoists, group_size(axis_sizes, hoists[0].axes), scope,
                                  len(out))
            self.hoisting[(scope, len(out))] = plan
            if plan.choice == "hoist":
                out.extend(loops.hoist(eqn, hoists))
            else:
                out.append(eqn)
        return out

    def sub_jaxprs(self, eqn: Any, index: int, axis_sizes: dict, scope: str,
                   in_loop: bool, in_backward: bool = False) -> Any:
        rule = _compat.HIGHER_ORDER.get(eqn.primitive.name)
        if rule is None:
            if any(contains_psum(j) for j in _compat.jaxprs_in_params(eqn.params)):
                self.report.skipped.append(
                    f"psum inside '{eqn.primitive.name}' (no rewrite rule) in {scope}")
            return eqn
        loop, mesh_param = rule.loop, rule.mesh_param
        sizes = dict(axis_sizes)
        if mesh_param is not None:
            sizes.update(_compat.mesh_axis_sizes(eqn.params[mesh_param]))
        base = f"{scope}/{eqn.primitive.name}"
        bodies: list[str] = []
        first_plan = len(self.report.plans)

        made_by_transpose = _compat.made_by_transpose(eqn, deep=False)
        # The body of a loop or a shard_map that autodiff's transpose made is all backward
        # pass (the backward scan of scan-over-layers; the route's shard_map of the
        # reduce-scatters), though its own equations do not say so. A `checkpoint`'s is not:
        # it computes the forward pass again.
        transposed = made_by_transpose and (loop or mesh_param is not None)

        def rewrite(j: Any) -> Any:
            bodies.append(self.unique_scope(base))
            return self.jaxpr(j, axis_sizes=sizes, scope=bodies[-1], in_loop=in_loop or loop,
                              transposed=transposed, in_backward=in_backward or made_by_transpose)
        params = {name: map_jaxprs(value, rewrite) for name, value in eqn.params.items()}
        hoisting = self.hoisting.pop((scope, index), None)
        if loop:
            self.loop_report(eqn, index, scope, bodies, first_plan, hoisting)
        return eqn.replace(params=params)

    def loop_report(self, eqn: Any, index: int, scope: str, bodies: list[str], first_plan: int,
                    hoisting: LoopPlan | None) -> None:
        """The `LoopPlan` of a loop whose body was just planned: its gradient buckets, run once
        per iteration (in the body or a scope within it: the route's shard_maps in a scan of
        microbatches), and the hoisting choice `hoist_loops` made for it, if any."""
        inner = tuple(f"{b}/" for b in bodies)
        within = [p for p in self.report.plans[first_plan:]
                  if p.scope in bodies or p.scope.startswith(inner)]
        planned = [p for p in within if p.kind == "gradient"]
        if not planned and hoisting is None:
            return
        body = planned[0].scope if planned else bodies[-1]
        length = int(eqn.params["length"]) if "length" in eqn.params else None
        kept = sum(len(p.members) for p in within
                   if p.kind != "gradient" and not p.collective.gathers)
        gradient = sum(len(p.members) for p in planned)
        if hoisting is None:
            hoisting = LoopPlan(scope, index, length, body, gradient, len(planned))
        self.report.loops.append(dataclasses.replace(
            hoisting, body=body, gradient=gradient, calls=len(planned), kept=kept))

    def unique_scope(self, base: str) -> str:
        """`base`, or ``base#n`` for its n-th sub-jaxpr of the program (two shard_maps in one
        step, a cond's branches): every scope of a report has its own name."""
        self.scope_names[base] += 1
        n = self.scope_names[base]
        return base if n == 1 else f"{base}#{n}"


def loop_plan(rw: Rewriter, eqn: Any, hoists: list[loops.Hoist], world: int, scope: str,
              index: int) -> LoopPlan:
    """Hoist or keep one scan's hoistable psums: the model's predicted time of the loop with
    them planned in the body (the planner's buckets for one iteration, overlapping the
    rest of it), against the loop's compute followed by one all-reduce of every
    iteration's slices (what hoisting gives before the planner fuses and overlaps it with
    the scope's other gradients: an upper bound). The body's other psums are the same
    either way and left out of both. `gradient` and `calls` are filled in once the body
    is planned (`sub_jaxprs`)."""
    body = eqn.params["jaxpr"].jaxpr
    length = int(eqn.params["length"])
    costs = [roofline_s(e, rw.profile) for e in body.eqns]
    layers, start = [], 0
    for h in sorted(hoists, key=lambda h: h.psum):
        layers.append(planner.Layer(compute_s=float(sum(costs[start:h.psum])),
                                    grad_bytes=h.nbytes))
        start = h.psum + 1
    layers.append(planner.Layer(compute_s=float(sum(costs[start:])), grad_bytes=0))
    cost = block_rule.capped_derivation(rw.profile, world).cost
    nbytes = sum(h.nbytes for h in hoists)
    whole = [planner.Layer(compute_s=length * sum(layer.compute_s for layer in layers),
                           grad_bytes=length * nbytes)]
    in_loop_s = length * planner.plan(layers, cost, fusion=rw.options.fusion).backward_s
    hoisted_s = min(planner.simulate(whole, [planner.Bucket(0, 0, k)], cost)
                    for k in cost.keys)
    choice = rw.options.loops
    if choice == "auto":
        choice = "hoist" if hoisted_s <= in_loop_s else "in-loop"
    return LoopPlan(scope, index, length, body="", gradient=0, calls=0, psums=len(hoists),
                    nbytes=nbytes, choice=choice, in_loop_s=in_loop_s, hoisted_s=hoisted_s)
