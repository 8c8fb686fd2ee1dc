"""All-gathers issued ahead of their use (FSDP's prefetch): their timeline and the distance and
allocation `plan_gathers` picks within a memory bound."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from libra_jax import collectives
from libra_jax.planner.core import (
    TIE_RTOL,
    CostModel,
    _check_blocks,
    _check_cost,
    _is_int,
    _is_real,
)

# ---------------------------------------------------------------------------------------------
# All-gathers issued ahead of their use (FSDP's prefetch)
# ---------------------------------------------------------------------------------------------
#
# In a sharded step each layer's parameters are all-gathered before the compute that reads
# them, in the forward pass and (under remat) again in the backward pass. Here the compute
# waits for the collective, not the other way round: gather ``i`` must end before step ``i``'s
# compute starts. Issued ``distance`` gathers ahead, gather ``i`` starts when step ``i -
# distance``'s compute starts (its own gather done: the point `optimize` anchors it to), so it
# runs beside that compute and the ones up to its use; distance 0 issues it where it is used
# (one call: compute waits for all of it). The phases are `simulate`'s: latency, then bytes at
# ``overlap_bw[k]`` while compute runs and ``solo_bw[k]`` while it waits, and compute at
# ``1/slowdown[k]`` while a gather is active (latency included). Gathers run one at a time in
# order (one communication stream), so a larger distance only helps until the stream is busy,
# and every gather issued but not yet used holds its gathered buffer: the memory bound.


def _gather() -> collectives.Collective:
    """The kind these passes issue: the row whose operand is one rank's shard and whose result
    the whole buffer (`collectives.Collective.gathers`), as the rows are when asked."""
    return next(row for row in collectives.ROWS if row.gathers)


@dataclass(frozen=True)
class GatherStep:
    """One all-gather of a pass and the compute that reads it: ``nbytes`` is the gathered
    buffer's size per rank; ``compute_s`` the full-speed compute from its use to the next
    gather's use (the last one's: to the end of the pass)."""

    compute_s: float
    nbytes: int

    def __post_init__(self) -> None:
        if not _is_real(self.compute_s) or not math.isfinite(self.compute_s) or self.compute_s < 0:
            raise ValueError(f"GatherStep.compute_s must be a finite number >= 0, got {self.compute_s!r}")
        if not _is_int(self.nbytes) or self.nbytes < 0:
            raise ValueError(f"GatherStep.nbytes must be an integer >= 0, got {self.nbytes!r}")
        object.__setattr__(self, "compute_s", float(self.compute_s))
        object.__setattr__(self, "nbytes", int(self.nbytes))


@dataclass(frozen=True)
class GatherSpan:
    """One gather as the model times it: issued at ``issue``, latency from ``start`` to
    ``latency_end``, bytes until ``end``; its compute (step ``index``) runs ``compute_start``
    to ``compute_end``."""

    index: int
    blocks: int
    nbytes: int
    issue: float
    start: float
    latency_end: float
    end: float
    compute_start: float
    compute_end: float


@dataclass(frozen=True)
class GatherTimeline:
    """`gather_timeline`'s result: each gather's span, the compute stream as segments
    ``(step, t0, t1, slowdown)`` (step -1: the compute before the first use), and the pass's
    end (``total_s``: when the last step's compute ends)."""

    gathers: tuple[GatherSpan, ...]
    compute: tuple[tuple[int, float, float, float], ...]
    total_s: float


@dataclass(frozen=True)
class GatherPlan:
    """The prefetch `plan_gathers` chose: ``distance`` (gather ``i`` issued when gather ``i -
    distance`` is done; 0: each one call where it is used), each gather's ``blocks``
    (allocation), the predicted pass ``total_s``, and ``one_call_s``: the pass with every
    gather one call at its one-call allocation."""

    distance: int
    blocks: tuple[int, ...]
    total_s: float
    one_call_s: float


def _check_steps(steps: Sequence[GatherStep]) -> list[GatherStep]:
    steps = list(steps)
    for i, s in enumerate(steps):
        if not isinstance(s, GatherStep):
            raise ValueError(f"steps[{i}] must be a GatherStep, got {type(s).__name__}")
    return steps


def gather_timeline(steps: Sequence[GatherStep], cost: CostModel, *, distance: int,
                    blocks: int | Sequence[int], lead_s: float = 0.0) -> GatherTimeline:
    """The pass of ``steps`` with every gather issued ``distance`` ahead at allocation
    ``blocks`` (one for all, or one per gather), after ``lead_s`` seconds of compute that reads
    none of them (see the section's comment for the model)."""
    steps = _check_steps(steps)
    cost = _check_cost(cost)
    if not _is_int(distance) or distance < 0:
        raise ValueError(f"distance must be an integer >= 0, got {distance!r}")
    distance = int(distance)
    m = len(steps)
    if isinstance(blocks, Sequence):
        if len(blocks) != m:
            raise ValueError(f"blocks must give one allocation per gather ({m}), got {len(blocks)}")
        ks = [_check_blocks(b, cost) for b in blocks]
    else:
        ks = [_check_blocks(blocks, cost)] * m
    if not _is_real(lead_s) or not math.isfinite(lead_s) or lead_s < 0:
        raise ValueError(f"lead_s must be a finite number >= 0, got {lead_s!r}")
    terms = cost.terms(_gather())
    if not m:  # the lead's compute alone
        return GatherTimeline((), ((-1, 0.0, float(lead_s), 1.0),) if lead_s else (), float(lead_s))
    issue = [0.0 if i < distance else math.inf for i in range(m)]
    start, lat_end, end = [math.nan] * m, [math.nan] * m, [math.nan] * m
    c_start, c_end = [math.nan] * m, [math.nan] * m
    segments: list[tuple[int, float, float, float]] = []
    t = 0.0
    step, work, waiting = -1, float(lead_s), False  # compute: its step (-1: the lead), work left
    g, active, lat_left, bytes_left = 0, False, 0.0, 0.0  # the stream: gather g, its phase
    while True:
        if not active and g < m and issue[g] <= t:  # the stream takes the next issued gather
            active, lat_left, bytes_left = True, terms.latency_s, steps[g].nbytes * terms.traffic
            start[g], lat_end[g] = t, t + terms.latency_s
        if waiting and g > step:  # its gather is done: the step's compute starts
            waiting, work, c_start[step] = False, steps[step].compute_s, t
            if distance and step + distance < m:
                issue[step + distance] = t
            continue
        if not waiting and work <= 0:  # the step's compute ended
            if step >= 0:
                c_end[step] = t
            if step == m - 1:
                break
            step, waiting = step + 1, True
            if not distance:
                issue[step] = t
            continue
        if active and lat_left <= 0 and bytes_left <= 0:  # the gather ended
            end[g], active, g = t, False, g + 1
            continue
        computing = not waiting
        assert computing or active, "compute waits for a gather never issued"
        k = ks[min(g, m - 1)]
        ob, sb, slow = cost.overlap_bw[k], cost.solo_bw[k], cost.slowdown[k]
        rate = 1.0 / slow if active else 1.0
        dt_compute = work / rate if computing else math.inf
        bw = ob if computing else sb
        dt_comm = (lat_left if lat_left > 0 else bytes_left / bw) if active else math.inf
        dt = min(dt_compute, dt_comm)
        if computing:
            segments.append((step, t, t + dt, slow if active else 1.0))
            work = 0.0 if dt == dt_compute else work - dt * rate
        if active:
            if lat_left > 0:
                lat_left = 0.0 if dt == dt_comm else lat_left - dt
            else:
                bytes_left = 0.0 if dt == dt_comm else bytes_left - dt * bw
        t += dt
    spans = tuple(GatherSpan(i, ks[i], steps[i].nbytes, issue[i], start[i], lat_end[i], end[i],
                             c_start[i], c_end[i]) for i in range(m))
    return GatherTimeline(spans, tuple(segments), t)


def simulate_gathers(steps: Sequence[GatherStep], cost: CostModel, *, distance: int,
                     blocks: int | Sequence[int], lead_s: float = 0.0) -> float:
    """Seconds of the pass of ``steps`` (`gather_timeline`'s ``total_s``)."""
    return gather_timeline(steps, cost, distance=distance, blocks=blocks, lead_s=lead_s).total_s


def held_bytes(steps: Sequence[GatherStep], distance: int) -> int:
    """The most gathered bytes issued ahead at once: while step ``i`` computes, gathers ``i+1``
    to ``i+distance`` are in flight or done and waiting (0 for one call each)."""
    sizes = [s.nbytes for s in steps]
    return max((sum(sizes[i + 1:i + 1 + distance]) for i in range(len(sizes))), default=0)


#: The farthest ahead `plan_gathers` looks: beyond a few gathers the stream is busy anyway.
MAX_PREFETCH_DISTANCE = 4


def plan_gathers(steps: Sequence[GatherStep], cost: CostModel, *,
                 one_call_blocks: Sequence[int], max_bytes: int, lead_s: float = 0.0,
                 max_distance: int = MAX_PREFETCH_DISTANCE, distance: int | None = None
                 ) -> GatherPlan:
    """The distance and allocation that minimise the pass of ``steps``, with at most
    ``max_bytes`` of gathered buffers issued ahead (`held_bytes`) and a distance of at most
    ``max_distance``; ``distance`` fixes it (the memory bound then does not apply). Distance 0
    (one call each) runs each gather at its ``one_call_blocks``; a longer distance at the one
    allocation best for it. Within `TIE_RTOL`, the shorter distance wins (less memory held),
    then fewer blocks."""
    steps = _check_steps(steps)
    cost = _check_cost(cost)
    one_ks = [_check_blocks(k, cost) for k in one_call_blocks]
    if len(one_ks) != len(steps):
        raise ValueError(f"one_call_blocks must give one allocation per gather ({len(steps)}), "
                         f"got {len(one_ks)}")
    if not _is_int(max_bytes) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
    max_bytes = int(max_bytes)
    if distance is not None and (not _is_int(distance) or distance < 0):
        raise ValueError(f"distance must be an integer >= 0, got {distance!r}")
    one_s = simulate_gathers(steps, cost, distance=0, blocks=one_ks, lead_s=lead_s)
    if distance is not None:
        distances = [min(int(distance), len(steps))] if distance else []
    else:
        distances = [d for d in range(1, min(max_distance, len(steps)) + 1)
                     if held_bytes(steps, d) <= max_bytes]
    best: tuple[float, int, int] = (one_s if distance in (None, 0) else math.inf, 0, 0)
    for d in distances:
        for k in cost.keys:
            t = simulate_gathers(steps, cost, distance=d, blocks=k, lead_s=lead_s)
            if t < best[0] * (1 - TIE_RTOL):
                best = (t, d, k)
    blocks = tuple(one_ks) if best[1] == 0 else (best[2],) * len(steps)
    return GatherPlan(best[1], blocks, best[0], one_s)


