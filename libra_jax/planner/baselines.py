"""The baselines Libra is compared with (Horovod's fusion, fusion only, MG-WFBP), the
policies of the paper's table (`compare_policies`) and of sharded training
(`compare_fsdp`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from libra_jax.planner.core import (
    HOROVOD_FUSION_BYTES,
    TIE_RTOL,
    Bucket,
    CostModel,
    Layer,
    Plan,
    _check_blocks,
    _check_cost,
    _check_layers,
    _check_reach,
    _horovod_ranges,
    _is_int,
    _make_plan,
    _mgwfbp_ranges,
    _prefix,
    _pricing,
    _within_reach,
    simulate,
)
from libra_jax.planner.dp import (
    plan,
)
from libra_jax.planner.gathers import (
    GatherPlan,
    GatherStep,
    gather_timeline,
    plan_gathers,
    simulate_gathers,
)

# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------




def plan_default(layers: Sequence[Layer], cost: CostModel, *, blocks: int, fusion_bytes: int) -> Plan:
    """Horovod-NCCL: one fixed allocation, buckets cut by a byte threshold.

    Layers are walked in order and the bucket is closed before a layer that would push it past
    ``fusion_bytes``, or of another collective; a layer larger than the threshold is a bucket of
    its own; ``fusion_bytes=0`` gives one bucket per layer.
    """
    layers = _check_layers(layers)
    cost = _check_cost(cost)
    k = _check_blocks(blocks, cost)
    if not _is_int(fusion_bytes) or fusion_bytes < 0:
        raise ValueError(f"fusion_bytes must be an integer >= 0, got {fusion_bytes!r}")
    ranges = _within_reach(_horovod_ranges(layers, int(fusion_bytes)), _pricing(layers, cost).runs)
    return _make_plan(layers, [Bucket(f, l, k) for f, l in ranges], cost)


def plan_fusion_only(layers: Sequence[Layer], cost: CostModel, *, blocks: int,
                     reach: Sequence[int] | None = None) -> Plan:
    """The planner with the allocation fixed to ``blocks``: it only chooses bucket boundaries
    (within ``reach``, as `plan`)."""
    cost = _check_cost(cost)
    k = _check_blocks(blocks, cost)
    fixed = dataclasses.replace(cost, solo_bw={k: cost.solo_bw[k]}, overlap_bw={k: cost.overlap_bw[k]},
                                slowdown={k: cost.slowdown[k]})
    return plan(layers, fixed, fusion=True, reach=reach)


def within_reach(buckets: Sequence[Bucket], reach: Sequence[int] | None) -> list[Bucket]:
    """``buckets`` with every bucket that ``reach`` forbids (see `plan`) cut, greedily from
    its first layer, into allowed ones with the same allocation.

    Why: a plan made without ``reach`` (a baseline, a hand-written plan) runs that way -- a fused
    bucket whose early gradient is needed before its last one is ready cannot be one all-reduce
    -- so its predicted time must be that of the cut plan.
    """
    buckets = list(buckets)
    if reach is None:
        return buckets
    n = max((b.last for b in buckets), default=-1) + 1
    reach = _check_reach(reach, n)
    return [Bucket(f, l, b.blocks) for b in buckets for f, l in _within_reach([(b.first, b.last)], reach)]




def plan_mgwfbp(layers: Sequence[Layer], cost: CostModel, *, blocks: int) -> Plan:
    """MG-WFBP (Shi et al., INFOCOM'19): the paper's "fusion only" baseline.

    With the contention-free alpha-beta model ``latency_s + bytes / solo_bw[blocks]`` and
    contention-free ready times, layers are walked in backward order; a gradient is merged with
    the next one when its all-reduce could not start before the next gradient is ready minus one
    start-up latency (waiting costs less than an extra start-up), and not across a change of
    collective. All buckets use ``blocks``;
    the returned time is the contention-aware `simulate`.
    """
    layers = _check_layers(layers)
    cost = _check_cost(cost)
    k = _check_blocks(blocks, cost)
    ranges = _mgwfbp_ranges(_prefix(l.compute_s for l in layers), _pricing(layers, cost), k, cost)
    return _make_plan(layers, [Bucket(f, l, k) for f, l in ranges], cost)



# ---------------------------------------------------------------------------------------------
# The policies compared (the paper's table; ``libra-jax simulate``)
# ---------------------------------------------------------------------------------------------

#: The Libra artifact's PREPROCESS_LAYER_NUM: layers are pre-fused into 40 groups.
DEFAULT_PREFUSE = 40

# Policy key -> description, in table order.
POLICIES: dict[str, str] = {
    "default": "Horovod-NCCL: fixed allocation, 64 MiB fusion",
    "mgwfbp": "fusion only: MG-WFBP merge, fixed allocation",
    "fusion-only": "fusion only: planner grouping, fixed allocation",
    "libra-alloc": "Libra allocation, default grouping",
    "libra": "Libra: allocation co-optimised with fusion",
}


@dataclass(frozen=True)
class Comparison:
    """Plans of every policy in `POLICIES` for one workload and cost model."""

    plans: dict[str, Plan]
    default_alloc: int
    fusion_bytes: int

    def backward_s(self, policy: str) -> float:
        return self.plans[policy].backward_s

    def best_baseline(self) -> str:
        """The fastest of the baselines (everything except the two Libra policies)."""
        return min(("default", "mgwfbp", "fusion-only"), key=self.backward_s)


def prefuse_groups(layers: Sequence[Layer], groups: int) -> list[tuple[int, int]]:
    """Cut ``layers`` into at most ``groups`` contiguous groups of about equal weight.

    A layer's weight is the mean of its share of the backward compute and of the gradient bytes,
    so both long compute stretches and large gradients stay resolved. This is the Libra artifact's
    pre-fusion step (it plans 40 pre-fused groups); any plan over the groups is a valid plan over
    the layers, and `compare_policies` evaluates it on the exact layers. A group also ends where
    the collective changes (`Layer.collective`: up to one more group per change).
    """
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    n = len(layers)
    total_c = sum(l.compute_s for l in layers) or 1.0
    total_b = sum(l.grad_bytes for l in layers) or 1
    out: list[tuple[int, int]] = []
    first, c, b = 0, 0.0, 0
    for i, layer in enumerate(layers):
        c += layer.compute_s
        b += layer.grad_bytes
        share = 0.5 * (c / total_c + b / total_b)
        if (i == n - 1 or layers[i + 1].collective != layer.collective
                or (share >= (len(out) + 1) / groups - 1e-12 and len(out) < groups - 1)):
            out.append((first, i))
            first = i + 1
    return out


def compare_policies(layers: Sequence[Layer], cost: CostModel, *, default_alloc: int,
                     fusion_bytes: int = HOROVOD_FUSION_BYTES,
                     prefuse: int = DEFAULT_PREFUSE) -> Comparison:
    """Plan ``layers`` under every policy of `POLICIES`.

    The fusion-searching planner policies (``fusion-only`` and ``libra``) plan over
    `prefuse_groups` of at most ``prefuse`` groups (0: the exact layers); their buckets are
    mapped back to layer indices and every reported time is ``simulate`` on the exact layers.
    """
    layers = list(layers)
    default = plan_default(layers, cost, blocks=default_alloc, fusion_bytes=fusion_bytes)
    grouping = [(b.first, b.last) for b in default.buckets]
    if prefuse and len(layers) > prefuse:
        groups = prefuse_groups(layers, prefuse)
        coarse = [Layer(sum(layers[i].compute_s for i in range(a, z + 1)),
                        sum(layers[i].grad_bytes for i in range(a, z + 1)), layers[a].collective)
                  for a, z in groups]

        def exact(plan: Plan) -> Plan:
            buckets = [Bucket(groups[b.first][0], groups[b.last][1], b.blocks)
                       for b in plan.buckets]
            return Plan(buckets, simulate(layers, buckets, cost))
    else:
        coarse = layers

        def exact(plan: Plan) -> Plan:
            return plan
    plans = {
        "default": default,
        "mgwfbp": plan_mgwfbp(layers, cost, blocks=default_alloc),
        "fusion-only": exact(plan_fusion_only(coarse, cost, blocks=default_alloc)),
        "libra-alloc": plan(layers, cost, buckets=grouping),
        "libra": exact(plan(coarse, cost, fusion=True)),
    }
    return Comparison(plans, default_alloc, fusion_bytes)



# ---------------------------------------------------------------------------------------------
# FSDP: a sharded training step (forward gathers, backward re-gathers and reduce-scatters)
# ---------------------------------------------------------------------------------------------

#: XLA's default combiner threshold for all-reduces, all-gathers and reduce-scatters alike
#: (``kDefaultReduceScatterCombineThreshold``, xla/service/collective_utils.h: 30 MiB + 7):
#: the default FSDP policy's fusion.
XLA_COMBINE_BYTES = 30 * 1024 * 1024 + 7

#: The FSDP comparison's policies, in table order.
FSDP_POLICIES: dict[str, str] = {
    "default": "XLA on NCCL: fixed allocation, each gather one ahead, 30 MiB combiner",
    "fusion-only": "planner grouping of the reduce-scatters, fixed allocation, gathers one ahead",
    "libra": "Libra: gathers' distance and allocation planned, reduce-scatters' allocation "
             "co-optimised with fusion",
}


@dataclass(frozen=True)
class FsdpStep:
    """One FSDP (ZeRO-3) training step at full speed, per rank. ``forward``: a `GatherStep`
    per parameterised op in forward order (its weights gathered, the compute from its use to
    the next one's), after ``forward_lead_s`` of compute that reads none. ``backward``: remat's
    re-gathers, one per `layers` entry, each needed from the start of that layer's compute.
    ``layers``: the backward pass, every gradient reduce-scattered (`Layer.collective`)."""

    forward: tuple[GatherStep, ...]
    forward_lead_s: float
    backward: tuple[GatherStep, ...]
    layers: tuple[Layer, ...]

    def __post_init__(self) -> None:
        if len(self.backward) != len(self.layers):
            raise ValueError(f"FsdpStep: {len(self.backward)} backward gathers for "
                             f"{len(self.layers)} layers (one re-gather per layer)")


@dataclass(frozen=True)
class FsdpPlan:
    """A policy's FSDP step: each pass's gathers (distance, allocation per gather), the
    reduce-scatters' buckets, and the predicted forward and backward seconds."""

    forward: GatherPlan
    backward: GatherPlan
    buckets: tuple[Bucket, ...]
    forward_s: float
    backward_s: float


def regathered_layers(step: FsdpStep, cost: CostModel, *, distance: int,
                      blocks: int | Sequence[int]) -> list[Layer]:
    """The backward pass's layers as the re-gathers leave them: layer i's compute stretched to
    the time from layer i - 1's end to its own in the re-gathers' `gather_timeline` (waits for
    its gather and the gathers' contention included), so its gradient is ready when it is.

    The sequential composition of the two streams is this function's assumption: the
    reduce-scatters are then priced on these layers by `simulate` (their contention slows the
    stretched compute, waits included), and a reduce-scatter and a gather in flight together
    do not slow each other; on one NCCL communicator they would share the link."""
    tl = gather_timeline(step.backward, cost, distance=distance, blocks=blocks)
    ends = [span.compute_end for span in tl.gathers]
    return [Layer(end - prev, layer.grad_bytes, layer.collective)
            for layer, end, prev in zip(step.layers, ends, [0.0, *ends[:-1]])]


def compare_fsdp(step: FsdpStep, cost: CostModel, *, default_alloc: int,
                 fusion_bytes: int = XLA_COMBINE_BYTES, prefuse: int = DEFAULT_PREFUSE,
                 max_bytes: int = 1 << 30) -> dict[str, FsdpPlan]:
    """The FSDP step under each of `FSDP_POLICIES`. The baselines issue each gather one ahead
    (XLA's latency-hiding scheduler) at ``default_alloc`` and reduce-scatter in the default's
    (``fusion_bytes``) or the planner's fusion-only grouping; Libra plans each pass's gathers
    (`plan_gathers`, at most ``max_bytes`` held ahead) and then the reduce-scatters on the
    layers they leave (`regathered_layers`, `compare_policies`' ``libra``); in the backward
    pass it keeps the baselines' re-gathers where those leave the shorter pass, so it is never
    slower than either baseline in this model."""
    default_alloc = _check_blocks(default_alloc, cost)

    def fixed(steps: Sequence[GatherStep], lead_s: float) -> GatherPlan:
        d = min(1, len(steps))
        one = simulate_gathers(steps, cost, distance=0, blocks=default_alloc, lead_s=lead_s)
        total = simulate_gathers(steps, cost, distance=d, blocks=default_alloc, lead_s=lead_s)
        return GatherPlan(d, (default_alloc,) * len(steps), total, one)

    def planned(steps: Sequence[GatherStep], lead_s: float) -> GatherPlan:
        return plan_gathers(steps, cost, one_call_blocks=[default_alloc] * len(steps),
                            max_bytes=max_bytes, lead_s=lead_s)

    out: dict[str, FsdpPlan] = {}
    fwd, bwd = fixed(step.forward, step.forward_lead_s), fixed(step.backward, 0.0)
    layers = regathered_layers(step, cost, distance=bwd.distance, blocks=bwd.blocks)
    baselines = compare_policies(layers, cost, default_alloc=default_alloc,
                                 fusion_bytes=fusion_bytes, prefuse=prefuse)
    for name in ("default", "fusion-only"):
        p = baselines.plans[name]
        out[name] = FsdpPlan(fwd, bwd, tuple(p.buckets), fwd.total_s, p.backward_s)
    # Libra: the planned gathers; in the backward pass the baselines' re-gathers too, whichever
    # leaves the shorter pass once the reduce-scatters are planned on it (the two streams are
    # planned one after the other, so the gathers' best alone need not be the step's best).
    fwd = planned(step.forward, step.forward_lead_s)
    best: tuple[float, GatherPlan, Plan] | None = None
    for gathers in (planned(step.backward, 0.0), bwd):
        layers = regathered_layers(step, cost, distance=gathers.distance, blocks=gathers.blocks)
        p = (baselines if gathers is bwd else compare_policies(
            layers, cost, default_alloc=default_alloc, fusion_bytes=fusion_bytes,
            prefuse=prefuse)).plans["libra"]
        if best is None or p.backward_s < best[0] * (1 - TIE_RTOL):
            best = (p.backward_s, gathers, p)
    assert best is not None
    out["libra"] = FsdpPlan(fwd, best[1], tuple(best[2].buckets), fwd.total_s, best[0])
    return out
