"""All-gathers issued ahead of their use (FSDP's prefetch), alone or several as one call: their
timeline and the distance, grouping and allocation `plan_gathers` picks within a memory bound."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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
# (one call: compute waits for all of it). The phases are `simulate`'s: issuing a call takes
# the compute stream ``call_s`` (the hand-off to the engine, as a gradient bucket's issue),
# then latency, then bytes at ``overlap_bw[k]`` while compute runs and ``solo_bw[k]`` while it
# waits, and compute at ``1/slowdown[k]`` while a gather is active (latency included). Gathers
# run one at a time in order (one communication stream), so a larger distance only helps
# until the stream is busy, and every gather issued but not yet used holds its gathered
# buffer: the memory bound.
#
# Several consecutive gathers may be one call over their members (a group, ``groups``): one
# issue and one latency for all, their bytes together, and the first member's compute waits
# for the whole call. Distance then counts groups. A group issued where its first member is
# used holds its later members' gathered buffers from that point on, as prefetch holds the
# gathers it issued ahead: both count against the same bound (`held_bytes`).


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
    ``latency_end``, bytes until ``end`` (a group's members share their call's times); its
    compute (step ``index``) runs ``compute_start`` to ``compute_end``."""

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


#: A grouping of a pass's gathers: consecutive ``(first, last)`` runs covering them all, each
#: one call over its members.
Groups = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GatherPlan:
    """The prefetch `plan_gathers` chose: ``distance`` (group ``i`` issued when group ``i -
    distance`` is done; 0: each group one call where its first member is used), ``groups``
    (the calls at that distance: `Groups`; () for one call each), each gather's ``blocks``
    (its call's allocation), the predicted pass ``total_s``; and the pass at distance 0 (the
    one-call form `optimize` issues where it does not prefetch): its ``one_call_groups``,
    ``one_call_blocks`` (each gather's call's one-call allocation; () for the callers' own)
    and ``one_call_s``."""

    distance: int
    blocks: tuple[int, ...]
    total_s: float
    one_call_s: float
    groups: Groups = ()
    one_call_groups: Groups = ()
    one_call_blocks: tuple[int, ...] = ()


def _check_steps(steps: Sequence[GatherStep]) -> list[GatherStep]:
    steps = list(steps)
    for i, s in enumerate(steps):
        if not isinstance(s, GatherStep):
            raise ValueError(f"steps[{i}] must be a GatherStep, got {type(s).__name__}")
    return steps


def each_alone(m: int) -> Groups:
    """The grouping of ``m`` gathers one call each."""
    return tuple((i, i) for i in range(m))


def _check_groups(groups: Sequence[tuple[int, int]] | None, m: int) -> Groups:
    """`groups` as `Groups` (None or (): one call each); a ValueError unless they are
    consecutive runs covering the ``m`` gathers in order."""
    if not groups:
        return each_alone(m)
    out, expected = [], 0
    for g in groups:
        first, last = (int(x) for x in g)
        if first != expected or last < first:
            raise ValueError(f"groups must be consecutive (first, last) runs covering the {m} "
                             f"gathers in order, got {tuple(groups)!r}")
        out.append((first, last))
        expected = last + 1
    if expected != m:
        raise ValueError(f"groups must be consecutive (first, last) runs covering the {m} "
                         f"gathers in order, got {tuple(groups)!r}")
    return tuple(out)


def gather_timeline(steps: Sequence[GatherStep], cost: CostModel, *, distance: int,
                    blocks: int | Sequence[int], lead_s: float = 0.0,
                    groups: Sequence[tuple[int, int]] | None = None) -> GatherTimeline:
    """The pass of ``steps`` with every group of gathers (`Groups`; None: one call each)
    issued ``distance`` groups ahead at allocation ``blocks`` (one for all, or one per gather:
    a group's call runs at its first member's), after ``lead_s`` seconds of compute that reads
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
    runs = _check_groups(groups, m)
    terms = cost.terms(_gather())
    if not m:  # the lead's compute alone
        return GatherTimeline((), ((-1, 0.0, float(lead_s), 1.0),) if lead_s else (), float(lead_s))
    n = len(runs)
    group_of = [gi for gi, (first, last) in enumerate(runs) for _ in range(first, last + 1)]
    group_bytes = [sum(steps[i].nbytes for i in range(first, last + 1)) for first, last in runs]
    issue, ready = [math.inf] * n, [math.inf] * n  # issued; its issue done (the stream may take it)
    start, lat_end, end = [math.nan] * n, [math.nan] * n, [math.nan] * n
    c_start, c_end = [math.nan] * m, [math.nan] * m
    segments: list[tuple[int, float, float, float]] = []
    t, hold = 0.0, 0.0  # hold: the compute stream's time still taken by issuing calls

    def issue_call(gi: int) -> None:
        nonlocal hold
        hold += cost.call_s
        issue[gi], ready[gi] = t, t + hold

    for gi in range(min(distance, n)):
        issue_call(gi)
    step, work, waiting = -1, float(lead_s), False  # compute: its step (-1: the lead), work left
    g, active, lat_left, bytes_left = 0, False, 0.0, 0.0  # the stream: group g, its phase
    while True:
        if not active and g < n and ready[g] <= t:  # the stream takes the next issued call
            active, lat_left, bytes_left = True, terms.latency_s, group_bytes[g] * terms.traffic
            start[g], lat_end[g] = t, t + terms.latency_s
        if waiting and g > group_of[step]:  # its call is done: the step's compute starts
            waiting, work, c_start[step] = False, steps[step].compute_s, t
            gi = group_of[step]
            if distance and runs[gi][0] == step and gi + distance < n:
                issue_call(gi + distance)
            continue
        if not waiting and work <= 0 and hold <= 0:  # the step's compute ended
            if step >= 0:
                c_end[step] = t
            if step == m - 1:
                break
            step, waiting = step + 1, True
            if not distance and runs[group_of[step]][0] == step:
                issue_call(group_of[step])
            continue
        if active and lat_left <= 0 and bytes_left <= 0:  # the call ended
            end[g], active, g = t, False, g + 1
            continue
        computing = not waiting and hold <= 0
        k = ks[runs[min(g, n - 1)][0]]
        ob, sb, slow = cost.overlap_bw[k], cost.solo_bw[k], cost.slowdown[k]
        rate = 1.0 / slow if active else 1.0
        dt_compute = work / rate if computing else math.inf
        bw = ob if not waiting else sb  # an issue keeps the device thread busy as compute does
        dt_comm = (lat_left if lat_left > 0 else bytes_left / bw) if active else math.inf
        dt_hold = hold if hold > 0 else math.inf
        dt_ready = (ready[g] - t) if not active and g < n and ready[g] > t else math.inf
        dt = min(dt_compute, dt_comm, dt_hold, dt_ready)
        assert dt < math.inf, "compute waits for a gather never issued"
        if computing:
            segments.append((step, t, t + dt, slow if active else 1.0))
            work = 0.0 if dt == dt_compute else work - dt * rate
        if hold > 0:
            hold = 0.0 if dt == dt_hold else hold - dt
        if active:
            if lat_left > 0:
                lat_left = 0.0 if dt == dt_comm else lat_left - dt
            else:
                bytes_left = 0.0 if dt == dt_comm else bytes_left - dt * bw
        t += dt
    spans = tuple(GatherSpan(i, ks[runs[group_of[i]][0]], steps[i].nbytes, issue[group_of[i]],
                             start[group_of[i]], lat_end[group_of[i]], end[group_of[i]],
                             c_start[i], c_end[i]) for i in range(m))
    return GatherTimeline(spans, tuple(segments), t)


def simulate_gathers(steps: Sequence[GatherStep], cost: CostModel, *, distance: int,
                     blocks: int | Sequence[int], lead_s: float = 0.0,
                     groups: Sequence[tuple[int, int]] | None = None) -> float:
    """Seconds of the pass of ``steps`` (`gather_timeline`'s ``total_s``)."""
    return gather_timeline(steps, cost, distance=distance, blocks=blocks, lead_s=lead_s,
                           groups=groups).total_s


def held_bytes(steps: Sequence[GatherStep], distance: int,
               groups: Sequence[tuple[int, int]] | None = None) -> int:
    """The most gathered bytes held ahead of their use at once: while step ``i`` computes, the
    later members of its call and the ``distance`` calls after it (in flight or done and
    waiting); one gather per call: gathers ``i+1`` to ``i+distance`` (0 for one call each)."""
    sizes = [s.nbytes for s in steps]
    runs = _check_groups(groups, len(sizes))
    totals = [sum(sizes[first:last + 1]) for first, last in runs]
    return max((sum(sizes[i + 1:last + 1]) + sum(totals[gi + 1:gi + 1 + distance])
                for gi, (first, last) in enumerate(runs) for i in range(first, last + 1)),
               default=0)


#: The farthest ahead `plan_gathers` looks: beyond a few gathers the stream is busy anyway.
MAX_PREFETCH_DISTANCE = 4


def _fits(reach: Sequence[int], first: int, last: int) -> bool:
    """Whether gathers ``first..last`` may be one call: each may share a call up to ``last``."""
    return all(reach[j] >= last for j in range(first, last))


def _blocks_of(runs: Groups, one_ks: Sequence[int], group_key: Callable[[int], int] | None,
               steps: Sequence[GatherStep], cost: CostModel) -> tuple[int, ...]:
    """Each gather's one-call allocation as its call's: its own alone, a group's
    (`group_key` of its bytes) for several."""
    out: list[int] = []
    for first, last in runs:
        if first == last or group_key is None:
            out.extend(one_ks[first:last + 1])
        else:
            k = _check_blocks(group_key(sum(s.nbytes for s in steps[first:last + 1])), cost)
            out.extend([k] * (last - first + 1))
    return tuple(out)


def _one_call_groups(steps: Sequence[GatherStep], cost: CostModel, one_ks: Sequence[int],
                     group_key: Callable[[int], int], reach: Sequence[int], max_bytes: int
                     ) -> Groups:
    """The grouping of least pass at distance 0, exactly: there the pass is its compute plus,
    per call, ``call_s + latency + bytes x traffic / solo_bw[k]`` (compute waits for each
    call), so a dynamic program over the last call's first member finds it. A call of
    several holds its later members' bytes from its first member's use: at most
    ``max_bytes``; on a tie the smaller calls win (less memory held)."""
    terms = cost.terms(_gather())
    m = len(steps)
    before = [0]  # bytes of the gathers before each
    for s in steps:
        before.append(before[-1] + s.nbytes)
    best: list[tuple[float, int]] = [(0.0, -1)] + [(math.inf, -1)] * m  # (seconds, its first)
    for last in range(m):
        for first in range(last, -1, -1):  # smaller calls first: a tie keeps them
            if first < last and (before[last + 1] - before[first + 1] > max_bytes
                                 or reach[first] < last):
                break  # (a larger call holds more, and may not be one either: `_fits`)
            nbytes = before[last + 1] - before[first]
            k = one_ks[first] if first == last else _check_blocks(group_key(nbytes), cost)
            seconds = (best[first][0] + cost.call_s + terms.latency_s
                       + nbytes * terms.traffic / cost.solo_bw[k])
            if seconds < best[last + 1][0] * (1 - TIE_RTOL):
                best[last + 1] = (seconds, first)
    runs, last = [], m - 1
    while last >= 0:
        first = best[last + 1][1]
        runs.append((first, last))
        last = first - 1
    return tuple(reversed(runs))


def _merged_groups(steps: Sequence[GatherStep], cost: CostModel, *, distance: int, k: int,
                   reach: Sequence[int], max_held: int, lead_s: float) -> Groups:
    """A grouping for ``distance`` > 0 at allocation ``k``, greedily: from one call each, the
    merge of two neighbouring calls that shortens the pass most (by the timeline), while one
    does by more than `TIE_RTOL` and the held bytes stay within ``max_held``."""
    runs = each_alone(len(steps))
    now = simulate_gathers(steps, cost, distance=distance, blocks=k, lead_s=lead_s, groups=runs)
    while len(runs) > 1:
        best: tuple[float, Groups] | None = None
        for gi in range(len(runs) - 1):
            first, last = runs[gi][0], runs[gi + 1][1]
            if not _fits(reach, first, last):
                continue
            merged = (*runs[:gi], (first, last), *runs[gi + 2:])
            if held_bytes(steps, distance, merged) > max_held:
                continue
            t = simulate_gathers(steps, cost, distance=distance, blocks=k, lead_s=lead_s,
                                 groups=merged)
            if best is None or t < best[0]:
                best = (t, merged)
        if best is None or not best[0] < now * (1 - TIE_RTOL):
            break
        now, runs = best
    return runs


def plan_gathers(steps: Sequence[GatherStep], cost: CostModel, *,
                 one_call_blocks: Sequence[int], max_bytes: int, lead_s: float = 0.0,
                 max_distance: int = MAX_PREFETCH_DISTANCE, distance: int | None = None,
                 reach: Sequence[int] | None = None,
                 group_blocks: Callable[[int], int] | None = None) -> GatherPlan:
    """The distance, grouping and allocation that minimise the pass of ``steps``, with at most
    ``max_bytes`` of gathered buffers held ahead of their use (`held_bytes`) and a distance of
    at most ``max_distance``; ``distance`` fixes it (the memory bound then does not apply to
    the distance: a grouping still holds no more than it or the distance does). Distance 0
    (one call each) runs each gather at its ``one_call_blocks``; a longer distance at the one
    allocation best for it. Within `TIE_RTOL`, the shorter distance wins (less memory held),
    then fewer blocks.

    With ``reach`` (per gather, the last gather it may share one call with: consecutive,
    ``reach[i] >= i``), consecutive gathers may be one call over their members where the model
    prices one call lower than several (one issue and one latency against the overlap a
    later member loses by waiting for the whole call): at distance 0 the best grouping
    exactly (`_one_call_groups`), farther ahead greedily (`_merged_groups`); a call of several
    runs at ``group_blocks(its bytes)`` at distance 0 (the one-call allocation of its size).
    Without ``reach``: one call each."""
    steps = _check_steps(steps)
    cost = _check_cost(cost)
    m = len(steps)
    one_ks = [_check_blocks(k, cost) for k in one_call_blocks]
    if len(one_ks) != m:
        raise ValueError(f"one_call_blocks must give one allocation per gather ({m}), "
                         f"got {len(one_ks)}")
    if not _is_int(max_bytes) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
    max_bytes = int(max_bytes)
    if distance is not None and (not _is_int(distance) or distance < 0):
        raise ValueError(f"distance must be an integer >= 0, got {distance!r}")
    if reach is not None:
        reach = [int(r) for r in reach]
        if len(reach) != m or any(not i <= r < m for i, r in enumerate(reach)):
            raise ValueError(f"reach must give, per gather, the last gather (>= its own index, "
                             f"< {m}) it may share a call with, got {reach!r}")
        if group_blocks is None:
            raise ValueError("plan_gathers: reach needs group_blocks (a call's one-call "
                             "allocation by its bytes)")
    one_groups = (_one_call_groups(steps, cost, one_ks, group_blocks, reach, max_bytes)
                  if reach is not None and group_blocks is not None else each_alone(m))
    one_blocks = _blocks_of(one_groups, one_ks, group_blocks, steps, cost)
    one_s = simulate_gathers(steps, cost, distance=0, blocks=list(one_blocks), lead_s=lead_s,
                             groups=one_groups)
    if distance is not None:
        distances = [min(int(distance), m)] if distance else []
    else:
        distances = [d for d in range(1, min(max_distance, m) + 1)
                     if held_bytes(steps, d) <= max_bytes]
    best: tuple[float, int, int, Groups] = (
        one_s if distance in (None, 0) else math.inf, 0, 0, one_groups)
    for d in distances:
        alone = each_alone(m)
        times = {k: simulate_gathers(steps, cost, distance=d, blocks=k, lead_s=lead_s)
                 for k in cost.keys}
        runs = alone
        if reach is not None and m > 1:
            # Grouped at the allocation best for the gathers alone, then each allocation again.
            k0 = min(cost.keys, key=lambda k: (times[k], k))
            runs = _merged_groups(steps, cost, distance=d, k=k0, reach=reach,
                                  max_held=max(max_bytes, held_bytes(steps, d)), lead_s=lead_s)
            if runs != alone:
                times = {k: simulate_gathers(steps, cost, distance=d, blocks=k, lead_s=lead_s,
                                             groups=runs) for k in cost.keys}
        for k in cost.keys:
            if times[k] < best[0] * (1 - TIE_RTOL):
                best = (times[k], d, k, runs)
    t, d, k, runs = best
    blocks = one_blocks if d == 0 else (k,) * m
    return GatherPlan(d, blocks, t, one_s, runs if d else one_groups, one_groups, one_blocks)
