"""What `optimize` planned, said: the report of a rewrite, the block cap a profile sets, and the
agreement of every process of a job on one profile and one plan.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

import jax

from libra_jax import _compat, _deprecated, _nccl, collectives, config, model, planner
from libra_jax.collectives import Collective
from libra_jax.ops.base import warn_once
from libra_jax.ops.blocks import block_cap  # its home; named here for the rewrite's callers
from libra_jax.rewrite.costs import step_roofline_s

__all__ = ["CallPlan", "LoopPlan", "OptimizeReport", "LatestReport", "block_cap", "shared_profile",
           "data_path_lines", "check_plan_agreement", "NO_PROFILE_BROADCAST_ENV", "price_step"]


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """One planned call of a collective in one jaxpr scope: a bucket of one or more members
    (psums, psum_scatters, all-gathers) or one all-to-all. (Named ``PsumPlan`` before it
    planned every kind; that name is a deprecated alias.)"""

    scope: str                      # where: "shard_map/jit/..." path of the jaxpr
    axes: tuple                     # the reduced mesh axes
    members: tuple[int, ...]        # positions of the psums in the scope's equations
    nbytes: int                     # bytes per rank
    blocks: int                     # the allocation (engine worker tasks / thread blocks)
    # "gradient" (planned and fused: `Rewriter.jaxpr`), "backward" (of the backward pass,
    # feeding more of it: e.g. a batch norm statistic's cotangent), "forward" (the forward
    # pass, metrics), "loop" (in a loop body) or "user" (blocks= given)
    kind: str
    overlap: str                    # "sync" (one call) or "start-done" (`libra_jax.ops.start_done`)
    # What the bucket issues (its row of `libra_jax.collectives`; `plan_lines` writes its
    # ``kind``): the all-reduce (psums), the reduce-scatter (psum_scatters: a sharded
    # parameter's gradient; `nbytes` is then the unsharded buffers' bytes per rank), the
    # all-gather (one all_gather; `nbytes`: the gathered buffer's) or the all-to-all.
    collective: Collective
    # An all-gather issued ahead of its use (`overlap` "prefetch": a start/done pair): how many
    # gathers of its scope ahead (`planner.GatherPlan.distance`); 0 for one call.
    ahead: int = 0


def __getattr__(name: str) -> Any:
    return _deprecated.alias(__name__, name, {"PsumPlan": ("CallPlan", CallPlan)})


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """What `optimize` did with one loop (`scan`, `while`) whose body holds gradient psums:
    each iteration's plan (the body's scope, whose `CallPlan`s run once per iteration) and,
    for a scan whose psums could leave the body (a stacked weight's gradient slices:
    `libra_jax.loops`), the choice to hoist them or keep them in the body."""

    scope: str                      # the scope the loop equation is in
    index: int                      # its position among the scope's equations
    length: int | None              # iterations (a scan's; None: a while loop's)
    body: str                       # the body's scope: its PsumPlans are each iteration's
    gradient: int                   # gradient psums planned in the body, per iteration
    calls: int                      # the calls they make per iteration (their buckets)
    # A scan's hoistable psums: how many, their bytes per iteration, "hoist" (all-reduced
    # after the loop, planned with the scope's gradients) or "in-loop" (planned in the body),
    # and the model's predicted seconds of the loop each way; 0 and "in-loop" where none.
    psums: int = 0
    nbytes: int = 0
    choice: str = "in-loop"
    in_loop_s: float | None = None
    hoisted_s: float | None = None
    kept: int = 0                   # the body's psums not planned as gradients (kind loop)


@dataclasses.dataclass
class OptimizeReport:
    """What the rewrite did: every planned all-reduce, and what it left alone."""

    plans: list[CallPlan] = dataclasses.field(default_factory=list)
    predicted: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # why nothing was planned
    # Collectives other than psum (JAX's, `_compat.OTHER_COLLECTIVES`, left to XLA; libra's
    # psum_scatter and all_gather, marked "(libra's)", at their own blocks): one line per kind,
    # axes and scope, with its count.
    unplanned: list[str] = dataclasses.field(default_factory=list)
    loops: list[LoopPlan] = dataclasses.field(default_factory=list)
    # Collectives whose results the step never uses, removed before planning with the
    # computation only they needed (dead code): one line per kind, with its count.
    dropped: list[str] = dataclasses.field(default_factory=list)
    # psums of a known zero, computed without a call (`sites.fold_zero_psums`): one line
    # per psum, with its scope.
    folded: list[str] = dataclasses.field(default_factory=list)
    # Gradient all-reduces issued in place whose operand has another reader (a norm metric
    # of the local gradients): XLA copies the operand before the call. One line each.
    copied: list[str] = dataclasses.field(default_factory=list)
    # Per scope whose all-gathers were planned together (`gathers.prefetch_gathers`): the
    # model's inputs and choice (`planner.GatherStep`s, `planner.GatherPlan`), for `explain`.
    gathers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # The whole step priced both ways, plain (XLA's collectives, combined as XLA:CPU's
    # combiner does) and as planned (`price_step`, `planner.StepPrice`: its terms, plain_s,
    # optimized_s, predicted_ratio); None where nothing was planned or the profile has no
    # XLA terms (the GPU forms).
    step: planner.StepPrice | None = None

    @property
    def predicted_ratio(self) -> float | None:
        """The model's optimized / plain step time (`planner.StepPrice.predicted_ratio`): 1.0
        where nothing was planned (both programs are one), None where not priced."""
        if self.step is not None:
            return self.step.predicted_ratio
        return None if self.plans or self.predicted or self.gathers else 1.0

    @property
    def num_psums(self) -> int:
        return sum(len(p.members) for p in self.plans)

    def plan_lines(self) -> list[str]:
        """One line per planned collective: what every process must agree on."""
        return ([f"{p.scope} axes={p.axes} psums={p.members} bytes={p.nbytes} blocks={p.blocks} "
                 f"kind={p.kind} overlap={p.overlap} collective={p.collective.kind}"
                 + (f" ahead={p.ahead}" if p.collective.gathers else "")
                 for p in self.plans]
                + [f"{p.scope} loop={p.index} body={p.body} gradient={p.gradient} "
                   f"calls={p.calls} psums={p.psums} {p.choice}" for p in self.loops])


class LatestReport:
    """``optimize(fn).last_report`` before the first call: a view of the latest plan of the
    function `optimize` returned, read at each access. `jax.jit` (like `functools.wraps`)
    copies a function's attributes when it wraps it, before any call has planned:
    ``jax.jit(optimize(step)).last_report`` is this object, so it reads the plan the
    optimized function made last (the function's own attribute is that `OptimizeReport`
    from its first call on). It reads as that report (its attributes, ``repr``, ``==``);
    false, and `report` None, before the first call; `report` is the `OptimizeReport`."""

    __slots__ = ("report",)

    def __init__(self) -> None:
        #: The latest `OptimizeReport`, or None before the function's first call.
        self.report: OptimizeReport | None = None

    def __getattr__(self, name: str) -> Any:
        report = object.__getattribute__(self, "report")
        if report is None:
            raise AttributeError(
                f"libra_jax.optimize: no plan yet to read {name!r} from: the optimized "
                "function plans at its first call (or call libra_jax.explain)")
        return getattr(report, name)

    def __bool__(self) -> bool:
        return self.report is not None

    def __eq__(self, other: object) -> bool:
        other = other.report if isinstance(other, LatestReport) else other
        return self.report == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.report) if self.report is not None else "LatestReport(no plan yet)"


#: Set to 1 (on every process) to plan with each process's own profile under multi-process JAX.
NO_PROFILE_BROADCAST_ENV = config.NO_PROFILE_BROADCAST_ENV


_profile_broadcasts: dict[str, int] = {}


def shared_profile(resolve: Callable[[], model.Profile], *, program: str) -> model.Profile:
    """Under multi-process JAX, the profile every process plans `program` with: process 0's.

    Why: plans must be identical on every process (same all-reduces, same order, same block
    counts), but each host resolves its own profile -- its own calibration (``libra-jax
    calibrate`` measures the host it runs on) or whatever `profile=` its code passed. So
    process 0 publishes its resolved profile's JSON document in JAX's distributed key-value
    store (key ``libra_jax/profile/<program hash>/<n>``) and every other process plans with
    that one. Process 0's default CPU profile is its machine probe's (`model.probe`; no other
    process probes), so a process whose own default is the shipped profile that probe rescaled
    is not told its profile differs, and makes process 0's its default (`model.probe.adopt`).
    This holds for an explicit `profile=` too: SPMD code runs the same program everywhere, so
    a per-process difference is a deployment accident (a path that resolves to different
    files per host), not a request for mismatched plans. A process whose own profile differs
    from process 0's says so in a one-time warning.

    ``LIBRA_JAX_NO_PROFILE_BROADCAST=1`` (set it on every process) turns the broadcast off;
    `check_plan_agreement` still catches any difference. A process that waits longer than
    ``LIBRA_JAX_TIMEOUT_S`` for process 0's profile raises RuntimeError. `resolve` resolves
    this process's profile (once); in a single process, its result is returned.
    """
    client = _compat.distributed_client()
    if (client is None or jax.process_count() == 1
            or not config.profile_broadcast()):
        return resolve()
    tag = hashlib.sha256(program.encode()).hexdigest()[:16]
    _profile_broadcasts[tag] = sequence = _profile_broadcasts.get(tag, 0) + 1
    key = f"libra_jax/profile/{tag}/{sequence}"
    if jax.process_index() == 0:
        try:
            profile = resolve()
            document = model.profile_to_dict(profile)
        except (ValueError, OSError, TypeError) as exc:  # tell the others, not let them wait
            client.key_value_set(key, json.dumps({"error": str(exc)}))
            raise
        outcome = model.probe.outcome_of(profile)
        client.key_value_set(key, json.dumps({"name": _profile_label(profile),
                                              "document": document,
                                              "probe_of": outcome and outcome.shipped}))
        return profile
    timeout_s = config.timeout_s()
    try:
        payload = json.loads(client.blocking_key_value_get(key, config.kv_timeout_ms()))
    except Exception as exc:
        raise RuntimeError(
            f"libra_jax.optimize: process {jax.process_index()} waited {timeout_s:g} s "
            "(LIBRA_JAX_TIMEOUT_S) for process 0's profile and got none: process 0 may have "
            f"died, be tracing a different program, or run with {NO_PROFILE_BROADCAST_ENV}=1 "
            f"while this process does not ({type(exc).__name__}: {exc})") from exc
    if "error" in payload:
        raise RuntimeError(f"libra_jax.optimize: process 0 could not load its profile, so no "
                           f"process can plan this step: {payload['error']}")
    theirs = model.profile_from_dict(payload["document"],
                                     origin=f"process 0's profile {payload['name']}")
    try:
        mine: model.Profile | None = resolve()
    except (ValueError, OSError, TypeError):
        mine = None
    probed = payload.get("probe_of")  # process 0's default, rescaled by its probe: not ours
    if probed and mine == model.load_profile(probed):
        model.probe.adopt(probed, theirs)  # this process's default from now on (`explain`)
    elif mine != theirs:
        warn_once(
            "profile-mismatch",
            f"libra_jax.optimize: the profile of process {jax.process_index()} "
            f"({_profile_label(mine)}) differs from process 0's ({payload['name']}); every "
            "process plans with process 0's so that their all-reduces match "
            f"({NO_PROFILE_BROADCAST_ENV}=1 turns this off)")
    return theirs


def _profile_label(profile: model.Profile | None) -> str:
    if profile is None:
        return "which does not load"
    return f"profile {profile.name!r} from {profile.origin}"


_agreement_checks: dict[str, int] = {}


def data_path_lines() -> list[str]:
    """What every process must also agree on where libra's GPU path is chosen (`$LIBRA_JAX_CUDA`
    ``p2p`` or ``nccl``): the NCCL it loaded and how block counts reach it (version, CTA route
    and limit, launch order, NCCL's own CTA settings), which decide each call's CTA limit and
    communicators (one per block count on 2.17-2.30). None under ``xla``."""
    path = config.cuda_path()
    if path == "xla":
        return []
    line = f"data path: LIBRA_JAX_CUDA={path}"
    if not _nccl.available()[0]:
        return [f"{line} NCCL=none"]
    lib = _nccl.library()
    overrides = " ".join(f"{k}={v}" for k, v in config.nccl_cta_overrides().items())
    return [f"{line} NCCL={lib.version} route={lib.route} max_ctas={lib.max_ctas} "
            f"splits={int(lib.splits)} launch_order={lib.launch_order} "
            f"{config.NCCL_LAUNCH_ORDER_ENV}={int(config.nccl_launch_order_implicit())}"
            + (f" {overrides}" if overrides else "")]


def check_plan_agreement(report: OptimizeReport, *, program: str) -> None:
    """Under multi-process JAX, check that every process planned `program` the same way.

    Every process must run the same all-reduces in the same order with the same block
    counts, and on libra's GPU path with the same NCCL configuration (`data_path_lines`);
    profiles may differ from host to host. Each process publishes its plan in
    JAX's distributed key-value store and compares it with everyone's, so a mismatch is a
    clear error naming the differing all-reduces instead of a hang or silent skew. A
    no-op in a single process.
    """
    client = _compat.distributed_client()
    if client is None or jax.process_count() == 1:
        return
    tag = hashlib.sha256(program.encode()).hexdigest()[:16]
    _agreement_checks[tag] = sequence = _agreement_checks.get(tag, 0) + 1
    prefix = f"libra_jax/plan/{tag}/{sequence}"
    mine = report.plan_lines() + data_path_lines()
    client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(mine))
    timeout_ms = config.kv_timeout_ms()
    for process in range(jax.process_count()):
        if process == jax.process_index():
            continue
        theirs = json.loads(client.blocking_key_value_get(f"{prefix}/{process}", timeout_ms))
        if theirs != mine:
            diff = [f"  here:          {a}\n  process {process}: {b}"
                    for a, b in zip(mine + ["(none)"] * len(theirs), theirs + ["(none)"] * len(mine))
                    if a != b]
            raise RuntimeError(
                f"libra_jax.optimize: process {jax.process_index()} and process {process} planned "
                "this step differently, so their all-reduces would not match. Use the same "
                "profile everywhere (optimize(profile=...)), and the same LIBRA_JAX_CUDA and "
                "NCCL. Differing all-reduces:\n" + "\n".join(diff))


def price_step(report: OptimizeReport, jaxpr: Any) -> planner.StepPrice | None:
    """The step `jaxpr` (the program as traced, before the rewrite), whose plan `report`
    holds, priced both ways (`planner.price_step`): its compute the roofline of its equations
    at the planning profile's rates, as the planner's layers are priced, each at one device's
    part (`costs.step_roofline_s`); every planned scope
    (`report.predicted`) with its buckets as issued (one call or a start/done pair, from
    `report.plans`); the collectives planned apart (a loss's pmean, a psum given ``blocks=``)
    at the model's price of one call alone; each scope's all-gathers at their predicted
    exposed time (the pass as issued minus its compute). None where nothing was planned or the
    profile is not the fair-share form (no XLA terms known)."""
    entries = list(report.predicted) + list(report.gathers)
    if not entries or entries[0]["profile"].fair_share is None:
        return None
    profile = entries[0]["profile"]
    fair = profile.fair_share
    call_s, bytes_per_s = fair.xla_terms()
    xla = planner.XlaTerms(call_s, bytes_per_s)
    issued: dict[tuple[str, int], list[CallPlan]] = {}
    for p in report.plans:
        if p.kind == "gradient":
            issued.setdefault((p.scope, p.members[-1]), []).append(p)
    scopes: list[planner.PlannedScope] = []
    costs: dict[tuple, tuple[planner.CostModel, Any]] = {}
    for entry in report.predicted:
        key = (entry["scope"], tuple(entry["axes"]))
        costs.setdefault(key, (entry["cost"], entry["derivation"]))
        members = entry["members"]
        plans = [issued.get((entry["scope"], members[i]), []) for i in range(len(members))]
        in_bucket = [p for b in entry["buckets"] for i in range(b.first, b.last + 1)
                     for p in plans[i]]
        sync = tuple(all(p.overlap == "sync" for p in plans[b.last]) for b in entry["buckets"])
        scopes.append(planner.PlannedScope(
            key=key, layers=tuple(entry["layers"]), buckets=tuple(entry["buckets"]),
            cost=entry["cost"], sync=sync, calls=len(in_bucket) or None,
            in_loop=entry.get("in_loop", False), after_s=entry.get("after_s", 0.0)))
    gathered = {g["scope"] for g in report.gathers}
    others = []
    for p in report.plans:
        if p.kind == "gradient" or (p.collective.gathers and p.scope in gathered):
            continue
        key = (p.scope, tuple(p.axes))
        cost, derivation = costs.get(key) or next(iter(costs.values()), (None, None))
        if cost is None:
            continue  # no planned scope to price it with: the same call both ways, left out
        others.append(_other_call(key, p, cost, derivation))
    for g in report.gathers:
        steps, cost = g["steps"], g["cost"]
        plan = g["plan"]
        total = plan.total_s if g["distance"] == plan.distance else plan.one_call_s
        exposed = max(0.0, total - g["lead_s"] - sum(s.compute_s for s in steps))
        traffic = cost.terms(g["collective"]).traffic
        firsts = {first for first, _ in g["groups"]} if g["groups"] else set(range(len(steps)))
        others.extend(planner.OtherCall(None, s.nbytes, g["collective"], traffic,
                                        exposed / len(steps), int(i in firsts))
                      for i, s in enumerate(steps))
    compute_s = step_roofline_s(jaxpr.eqns, profile)
    return planner.price_step(compute_s, scopes, others, xla, fair.pending_allreduce_s,
                              fair.sync_stagger or 0.0)


def _other_call(key: tuple, p: CallPlan, cost: planner.CostModel,
                derivation: Any) -> planner.OtherCall:
    """A collective planned apart from a backward pass, as one call alone: its issue, its
    latency and its bytes at the solo rate of its blocks."""
    terms = cost.terms(p.collective)
    try:
        k = derivation.key_for_blocks(p.blocks)
    except (ValueError, KeyError):
        k = max(cost.keys)
    k = k if k in cost.solo_bw else max(cost.keys)
    libra_s = (cost.issue_s(p.nbytes, 1) + terms.latency_s
               + p.nbytes * terms.traffic / cost.solo_bw[k])
    return planner.OtherCall(key if p.collective is collectives.REFERENCE else None, p.nbytes,
                             p.collective, terms.traffic, libra_s)
