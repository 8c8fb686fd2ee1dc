"""Libra's planner: per-bucket thread-block allocation co-optimised with tensor fusion.

A package along its concerns: `core` (inputs, outputs, the cost formula: `simulate`,
`timeline`), `dp` (the dynamic program, `plan`), `gathers` (all-gathers issued ahead,
`plan_gathers`), `baselines` (Horovod's fusion, fusion only, MG-WFBP, the policies compared,
sharded training's) and `exhaustive` (`plan_exhaustive`, the reference). Every public name is
here; pure Python (layer 1).

During the backward pass, gradients become ready layer by layer and are all-reduced in
buckets while the rest of the backward pass runs. For every bucket we pick an allocation ``k``
(more blocks: a faster all-reduce, but slower overlapped compute) and, with fusion, where the
bucket boundaries fall, so that the backward pass ends as early as possible.

Model (`simulate`, exact)
-------------------------------
Layers run back to back on one compute stream and never wait for communication. A bucket is
ready when its last layer ends; a bucket of 0 bytes issues no collective. Collectives run one
at a time in bucket order, each starting at max(ready, previous collective's end). Issuing a
collective takes the compute stream ``call_s`` (what a call costs a step beside its latency:
its hand-offs), and a fused bucket (two or more non-empty gradients) first packs them into one
buffer there: ``pack_s_per_byte * bytes`` more; compute makes no progress meanwhile. Then it
spends ``latency_s``, then moves its bytes at ``overlap_bw[k]`` while compute still runs and at
``solo_bw[k]`` once compute has finished. While it is active (latency included) compute runs at
``1/slowdown[k]`` of full speed. Backward time is the end of the last collective or of compute,
whichever is later. With ``reach``, only buckets whose every gradient may wait for the bucket's
last one are allowed (`plan`; a gradient used before a later one is computed cannot).

Collectives. Each layer names what reduces its gradient (`Layer.collective`): an all-reduce
(data parallelism) or a reduce-scatter (a parameter sharded over the ranks: FSDP). A bucket holds
one collective, as if ``reach`` ended every layer's run of one collective; a bucket of collective
``c`` takes ``CostModel.terms(c)``'s latency and moves its bytes times ``terms(c).traffic`` at the
tables' bandwidths, with the same slowdown. Nothing below depends on which: every argument is per
collective, the bounds take the least latency still due.

All-gathers (FSDP's parameter gathers) are planned apart (`plan_gathers`, the section "All-gathers
issued ahead"): there compute waits for the collective, and the choice is how far ahead of its
use each gather is issued, priced by the same phases and contention; exhaustive over a few
distances and the allocations, so exact for its model. Consecutive gathers may be one call over
their members (one issue and latency for all; the first member's compute waits for the whole
call), within the same memory bound as prefetch: the best grouping exactly where each call is
issued at its use, greedily farther ahead.

Everything the future depends on after a collective is the pair ``(T, P)``: the time the
collective ends and the compute *progress* ``P`` reached by then (seconds of full-speed work,
0 <= P <= C, C = total compute). One collective maps ``(T, P)`` to ``(E, Q)`` in closed form
(`_collective`, one short formula: latency phase, overlapped phase, solo phase).

Algorithm (`plan`)
------------------------
A forward dynamic program over bucket boundaries: every layer boundary, or with a fixed grouping
the grouping's boundaries, or with fusion and more than ``ATOMS`` layers the boundaries of about
``ATOMS`` pre-fused groups of consecutive layers (a group's share of compute plus its share of
bytes stays under ``2/ATOMS`` unless it is a single layer, so no cut moves by more than that).
Boundary ``t`` keeps a small set of states ``(T, P)`` and builds it from the states of earlier
boundaries (with fusion: all of them; fixed grouping: the previous one) times every allocation,
in one vectorised numpy expression per boundary. Rules, in the order they are applied:

* *Normalisation.* No collective can start before the next bucket's earliest ready progress
  ``R``, so a state with ``P < R`` is replaced by ``(T + R - P, R)``; states whose collectives
  all finished in time collapse to one point per boundary.
* *Idle sources.* A state with ``P <= R_t`` starts the bucket ending at ``t`` at its ready time
  ``T + R_t - P``: the state only contributes its lag ``T - P``. Per source boundary only the
  least-lag such state is expanded; a boundary whose states are all idle for every later target
  is collapsed to that single state (``R_t`` only grows with ``t``).
* *Compute finished.* Once ``P = C`` every remaining layer is ready and contention is over, so
  every remaining bucket runs at the best ``solo_bw``: with fusion, a backward DP over the
  boundaries (`_tail`, latencies against packing, within ``reach``) gives the best rest
  from every boundary; without, each remaining group. Such states become complete plans at once.
* *Reach.* Boundary ``t`` only takes sources from boundaries ``>= lo[t]`` (non-decreasing), so
  states below it are dropped for good; pre-fused groups never straddle a forbidden join.
* *Branch and bound.* The best complete plan so far (initially the uniform allocations and the
  MG-WFBP and Horovod baselines) bounds the answer by ``U``; a state is dropped when
  ``T + max(C - P, latency + bytes left / best bandwidth) > U``, and a source boundary stops
  feeding later targets once ``T + (R_t - P) + bytes left / best bandwidth > U`` for all its
  states.
* *Dominance.* ``(T, P)`` dominates ``(T', P')`` if ``T <= T'`` and ``P >= P'`` (Pareto), and
  also if ``P < P'`` but ``T + lam (P' - P) <= T'`` (Lipschitz rule below).
* *Cap.* If more than ``FRONT_CAP`` states survive at a boundary, their progress range is cut
  into ``FRONT_CAP`` equal cells and only the most advanced state of each cell is kept.

Optimality and error bound
--------------------------
Assume ``solo_bw[k] >= overlap_bw[k]`` for every ``k`` (contention never speeds a collective up;
true of every physical profile). Then one collective is monotone: a start with ``S <= S'`` and
progress ``pi >= pi'`` ends with ``E <= E'`` (its duration is non-increasing in ``pi``: more
compute done, more bytes at the solo rate) and ``Q >= Q'`` (``pi + d(pi)/slowdown`` has slope
``overlap_bw/solo_bw`` or 1 in ``pi``). The start rule ``S = T + max(0, R - P)``,
``pi = max(P, R)`` and the final time ``T + C - P`` preserve the order, so Pareto dominance is
exact. Time-shift invariance (``(T + x, P)`` evolves exactly like ``(T, P)`` delayed by ``x``)
makes the value of a state ``T + U_t(P)``, which justifies normalisation and idle sources.
A call's issue (``call_s``, packing) is a time shift of the state at the collective's start, so
it keeps both properties.
Differentiating along a fixed decision sequence, the sensitivity of the final time to ``P`` is
``-1`` until an idle start or the end, ``-slowdown (1 - overlap_bw/solo_bw)`` for the one
collective during which compute ends, and 0 after either, so ``U_t`` is non-increasing and
``lam``-Lipschitz with ``lam = max(1, max_k slowdown[k] (1 - overlap_bw[k] / solo_bw[k]))``: the
Lipschitz rule is exact too. Bounds are valid lower bounds. So **without pre-fusion and while
the cap does not bind, plan is optimal** (up to float rounding). On the instances the tests
compare with `plan_exhaustive` (up to 8 layers, 4 options) fronts hold about ten states at
most, far below the cap. The
cap loses at most ``lam * cell width`` at each boundary where it binds (keeping the most
advanced state of a cell costs at most ``lam`` per second of progress given up), so the
returned time exceeds the optimum over the allowed boundaries by at most the sum of those
losses (``_search`` returns that sum; it is a worst case and loose on long plans). Pre-fusion has
no such certificate; measured gaps are in ``benchmarks/results/planner_quality.md``. If some
``k`` has ``overlap_bw > solo_bw`` the dominance rules are heuristics (``lam`` is not used).
In every case the planner also scores the uniform allocations and, with fusion, one bucket,
MG-WFBP and Horovod-style buckets (64 and 128 MiB) at every allocation, and returns the best plan
it has seen, so it is never worse than those.

Ties
----
Plans whose backward times are within ``TIE_RTOL`` (relative) are equal; among them the
preference is fewer blocks (the sum of ``blocks`` over buckets that issue a collective), then
fewer buckets, then the lexicographically smaller list of ``(first, last, blocks)``. The program
compares states on a ``TIE_RTOL`` grid and applies the same order among equal states and among
all complete plans it scores, so plans are deterministic; only `plan_exhaustive`
guarantees the globally preferred plan when two plans tie through different intermediate states.
A zero-byte bucket (no collective) carries the smallest key.

Complexity
----------
``G`` allowed boundaries (with fusion ``G = L`` up to ``ATOMS`` layers and ``G < 2 ATOMS``
beyond; otherwise the group count),
``K`` options, ``F <= FRONT_CAP`` states per boundary, ``A`` the sources of one boundary (live
source boundaries plus busy states). Each boundary costs ``O(A K log(A K))`` vectorised work; with
fusion ``A <= G + G F``, so a plan is ``O(G^2 F K log)`` in the worst case, and ``O(G F K log)``
without fusion; pre-fusion and baselines add ``O(L K)``. No chunk discretisation (the paper's DP is
``O(S L^2 Z^2 K)``). Measured: 1,000 layers with 8 options plan in about 0.1-0.3 s on a 2-core VM
(``benchmarks/results/planner_speed.md``). `simulate` is ``O(L)``. `plan_exhaustive`
enumerates all ``K (K+1)^(L-1)`` plans with fusion (``K^L`` without, ``K^G`` for a fixed grouping)
in vectorised chunks and refuses more than ``EXHAUSTIVE_LIMIT``.
"""
from __future__ import annotations

from typing import Any

from libra_jax import _deprecated
from libra_jax.planner.baselines import (
    DEFAULT_PREFUSE,
    FSDP_POLICIES,
    POLICIES,
    XLA_COMBINE_BYTES,
    Comparison,
    FsdpPlan,
    FsdpStep,
    compare_fsdp,
    compare_policies,
    plan_default,
    plan_fusion_only,
    plan_mgwfbp,
    prefuse_groups,
    regathered_layers,
    within_reach,
)
from libra_jax.planner.core import (
    BLOCK_PENALTY,
    HOROVOD_FUSION_BYTES,
    KINDS,
    LIBRA_DEFAULT_THREADS,
    TIE_RTOL,
    Bucket,
    CollectiveTerms,
    CostModel,
    Layer,
    Phases,
    Plan,
    Timeline,
    default_allocation,
    no_overlap_allocation,
    pending_at,
    simulate,
    timeline,
)
from libra_jax.planner.dp import (
    plan,
)
from libra_jax.planner.exhaustive import (
    EXHAUSTIVE_LIMIT,
    plan_exhaustive,
)
from libra_jax.planner.gathers import (
    MAX_PREFETCH_DISTANCE,
    GatherPlan,
    GatherSpan,
    GatherStep,
    GatherTimeline,
    Groups,
    each_alone,
    gather_timeline,
    held_bytes,
    plan_gathers,
    simulate_gathers,
)
from libra_jax.planner.step import (
    XLA_CPU_COMBINE_COUNT,
    OtherCall,
    PlannedScope,
    StepPrice,
    XlaTerms,
    price_step,
    stagger_s,
    synchronizations,
)

__all__ = [
    "BLOCK_PENALTY",
    "KINDS",
    "CollectiveTerms",
    "HOROVOD_FUSION_BYTES",
    "LIBRA_DEFAULT_THREADS",
    "default_allocation",
    "POLICIES",
    "Comparison",
    "compare_policies",
    "prefuse_groups",
    "DEFAULT_PREFUSE",
    "no_overlap_allocation",
    "pending_at",
    "EXHAUSTIVE_LIMIT",
    "TIE_RTOL",
    "Bucket",
    "CostModel",
    "Layer",
    "Plan",
    "plan",
    "plan_default",
    "plan_exhaustive",
    "plan_fusion_only",
    "plan_mgwfbp",
    "simulate",
    "timeline",
    "Timeline",
    "Phases",
    "within_reach",
    "GatherStep",
    "GatherSpan",
    "GatherTimeline",
    "GatherPlan",
    "Groups",
    "each_alone",
    "gather_timeline",
    "simulate_gathers",
    "held_bytes",
    "plan_gathers",
    "MAX_PREFETCH_DISTANCE",
    "FsdpStep",
    "FsdpPlan",
    "FSDP_POLICIES",
    "XLA_COMBINE_BYTES",
    "regathered_layers",
    "compare_fsdp",
    "XLA_CPU_COMBINE_COUNT",
    "XlaTerms",
    "PlannedScope",
    "OtherCall",
    "StepPrice",
    "price_step",
    "synchronizations",
    "stagger_s",
]


def __getattr__(name: str) -> Any:
    return _deprecated.alias(__name__, name, {"COLLECTIVES": ("KINDS", KINDS)})
