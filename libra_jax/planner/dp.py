"""Libra's dynamic program: `plan`, the allocation and fusion that minimise backward time
(the package docstring states the model, the ties and the complexity)."""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from libra_jax.planner.core import (
    _HOROVOD_THRESHOLDS,
    TIE_RTOL,
    Bucket,
    CostModel,
    Layer,
    Plan,
    Ranges,
    _best,
    _collective_np,
    _horovod_ranges,
    _make_plan,
    _mgwfbp_ranges,
    _plan_key,
    _prefix,
    _Pricing,
    _problem,
    _simulate_ranges,
    _tensor_prefix,
    _within_reach,
    pending_at,
)

ATOMS = 128  # with fusion, layers beyond this count are pre-fused into about this many groups
FRONT_CAP = 48  # most states kept per boundary; more are thinned with a bounded loss
_BOUND_RTOL = 1e-9  # slack on branch-and-bound pruning, far above float rounding of the bounds


# ---------------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------------






def plan(layers: Sequence[Layer], cost: CostModel, *, fusion: bool = True,
         buckets: Sequence[tuple[int, int]] | None = None, reach: Sequence[int] | None = None) -> Plan:
    """Minimise backward time over allocations and, with ``fusion``, bucket boundaries.

    ``fusion=False`` makes every layer its own bucket; ``buckets=[(first, last), ...]`` keeps
    that grouping (it takes precedence over ``fusion``) and only chooses allocations. With
    fusion, ``reach[i]`` (default: the last layer) is the last layer that may share a bucket with
    layer ``i``: a bucket ``first..last`` is allowed when ``last <= reach[i]`` for every layer
    ``i < last`` in it (e.g. a gradient that is used before a later one is computed cannot wait
    for it). A bucket also holds one collective (`Layer.collective`): layers of another one
    are out of its reach. Exact when ``solo_bw[k] >= overlap_bw[k]`` for all ``k``; see the
    module docstring.
    """
    layers, cost, reach, pricing, ranges, free, comp, byts = _problem(
        layers, cost, fusion=fusion, buckets=buckets, reach=reach)
    n = len(layers)
    if ranges is not None:
        cuts = [0, *(last + 1 for _, last in ranges)]
    elif free:
        cuts = _atoms(layers, ATOMS, reach)
    else:
        cuts = list(range(n + 1))
    groups = [(cuts[i], cuts[i + 1] - 1) for i in range(len(cuts) - 1)]

    # Upper bound and safety net: complete plans (ranges, one key) scored before the search.
    seeds: list[tuple[Ranges, int]] = [(groups, k) for k in cost.keys]
    if free:  # one bucket, and the baselines, so that an inexact search never loses to them
        fixed = [_within_reach(r, reach) for r in
                 ([(0, n - 1)], *(_horovod_ranges(layers, thr) for thr in _HOROVOD_THRESHOLDS))]
        seeds += [(r, k) for r in fixed for k in cost.keys]
        seeds += [(_within_reach(_mgwfbp_ranges(comp, pricing, k, cost), reach), k)
                  for k in cost.keys]
    tensors = _tensor_prefix(byts)
    # Seeds cut to the same buckets (many runs of one collective cut them all alike) score once.
    seeds = list({(tuple(r), k): (r, k) for r, k in seeds}.values())
    scored = [(_simulate_ranges(comp, byts, pricing, r, [k] * len(r), cost, tensors), r, [k] * len(r))
              for r, k in seeds]
    upper = min(c[0] for c in scored)
    found, _ = _search(comp, byts, cuts, free, cost, upper, reach=reach, pricing=pricing)
    if found is not None:
        r, ks = [(b.first, b.last) for b in found], [b.blocks for b in found]
        scored.append((_simulate_ranges(comp, byts, pricing, r, ks, cost, tensors), r, ks))
    return _make_plan(layers, _best(scored, byts), cost)


def _lipschitz(cost: CostModel) -> float | None:
    """How many seconds one second of lost compute progress can cost at most, or None.

    For a fixed sequence of decisions the final time is continuous and piecewise smooth in the
    progress of a state; its slope is -1 (compute then waits for nobody) or -s(1 - ob/sb) (the
    collective during which compute ends) or 0. Valid when ``solo_bw >= overlap_bw`` everywhere.
    """
    if any(cost.overlap_bw[k] > cost.solo_bw[k] for k in cost.keys):
        return None
    return max(1.0, max(cost.slowdown[k] * (1.0 - cost.overlap_bw[k] / cost.solo_bw[k]) for k in cost.keys))


def _thin(E: np.ndarray, Q: np.ndarray, keys: Callable[[np.ndarray], tuple[np.ndarray, ...]],
          lam: float | None, cap: int, scale: float) -> tuple[np.ndarray, float]:
    """Indices of the states to keep (progress ascending) and the time this may cost.

    Exact: Pareto dominance, then the Lipschitz rule (a state with less progress dominates one
    with more when ``T + lam * (P' - P) <= T'``). Bounded: if more than ``cap`` remain, keep the
    most advanced state of each of ``cap`` equal progress cells, costing at most ``lam * width``.
    ``keys(indices)`` gives those states' tie keys, asked only for the states the sort sees.
    """
    # Compare on a grid of TIE_RTOL * scale so that states equal up to rounding tie, and the tie
    # keys (blocks, buckets, then the path) decide between them.
    quantum = TIE_RTOL * scale
    E, Q = np.round(E / quantum), np.round(Q / quantum)
    live = _beaten_from_above(E, Q)
    order = live[np.lexsort((*keys(live)[::-1], E[live], -Q[live]))]
    # progress descending, then time, then tie keys
    Es = E[order]
    keep = np.empty(order.size, dtype=bool)
    keep[0] = True
    keep[1:] = Es[1:] < np.minimum.accumulate(Es)[:-1]
    sel = order[keep][::-1]
    if lam is not None and sel.size > 1:
        phi = E[sel] - lam * Q[sel]
        keep = np.empty(sel.size, dtype=bool)
        keep[0] = True
        keep[1:] = phi[1:] < np.minimum.accumulate(phi)[:-1]
        sel = sel[keep]
    if sel.size <= cap:
        return sel, 0.0
    lo, hi = float(Q[sel[0]]), float(Q[sel[-1]])
    width = (hi - lo) / cap
    cell = np.minimum(((Q[sel] - lo) / width).astype(np.int64), cap - 1)
    width *= quantum
    last = np.empty(sel.size, dtype=bool)
    last[-1] = True
    last[:-1] = cell[1:] != cell[:-1]
    return sel[last], (math.inf if lam is None else lam * width)


def _beaten_from_above(E: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """Indices of the states (rounded times ``E``, progress ``Q``) that no state of a higher
    cell of progress matches or beats on time (cells: about half as many as states, equal
    widths between the least progress and the most).

    A prefilter for `_thin`'s sort on every key, which is its cost: a state dropped here has a
    state of strictly more progress and no more time, so the Pareto step would drop it too,
    and what it dominates that state dominates as well: the selection is the same. Linear
    passes only (no sort).
    """
    cells = max(64, E.size // 2)
    lo, hi = float(Q.min()), float(Q.max())
    if E.size <= 64 or hi <= lo:
        return np.arange(E.size)
    cell = ((Q - lo) * (cells / (hi - lo))).astype(np.int64)  # monotone in Q
    np.minimum(cell, cells - 1, out=cell)
    best = np.full(cells + 1, np.inf)
    np.minimum.at(best, cell, E)
    best = np.minimum.accumulate(best[::-1])[::-1]  # the best time in this cell or above
    return np.flatnonzero(E < best[cell + 1])


def _atoms(layers: Sequence[Layer], target: int, reach: Sequence[int] | None = None) -> list[int]:
    """Allowed bucket boundaries: every layer boundary, or about ``target`` pre-fused groups.

    Up to ``target`` layers nothing is fused. Beyond, consecutive layers are grouped while their
    share of compute plus their share of bytes stays under ``2 / target`` (a layer above it is a
    group of its own), which gives fewer than ``2 * target`` groups (adjacent groups weigh more than the limit).
    A group also ends where ``reach`` forbids the next layer to join it (more groups, never fewer).
    """
    n = len(layers)
    if n <= target:
        return list(range(n + 1))
    C = sum(l.compute_s for l in layers) or 1.0
    B = sum(l.grad_bytes for l in layers) or 1
    limit = 2.0 / target
    cuts, acc, allowed = [0], 0.0, n - 1
    for i, layer in enumerate(layers):
        w = layer.compute_s / C + layer.grad_bytes / B
        if (acc > 0 and acc + w > limit) or i > allowed:
            cuts.append(i)
            acc, allowed = 0.0, n - 1
        acc += w
        if reach is not None:
            allowed = min(allowed, reach[i])
    cuts.append(n)
    return cuts


def _lowest_sources(cuts: list[int], reach: Sequence[int] | None) -> np.ndarray:
    """Per boundary ``t``: the lowest boundary a bucket ending at ``t`` may start from.

    A bucket covering groups ``s..t-1`` is allowed when every layer but its last reaches its last
    layer. Non-decreasing in ``t``. Without ``reach``: 0 everywhere.
    """
    M = len(cuts) - 1
    lo = np.zeros(M + 1, dtype=np.int64)
    if reach is None:
        return lo
    group_min = [min(reach[cuts[g]:cuts[g + 1]]) for g in range(M)]
    for t in range(1, M + 1):
        last = cuts[t] - 1
        low = min(reach[cuts[t - 1]:last], default=last)  # the group itself (allowed by _atoms)
        s = t - 1
        while s > 0 and min(low, group_min[s - 1]) >= last:
            low = min(low, group_min[s - 1])
            s -= 1
        lo[t] = s
    return np.maximum.accumulate(lo)


def _tail(Bc: np.ndarray, Rb: np.ndarray, Nc: np.ndarray, lo: np.ndarray, free: bool, lat: np.ndarray,
          bw: float, key: int, pack_per_byte: float, call_s: float, scale: float,
          pend: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The best way to finish once compute is over, from every boundary: all remaining layers are
    ready and contention is over, so every bucket runs alone at the best solo bandwidth ``bw``
    (allocation ``key``) and costs ``lat + issue + bytes / bw`` (nothing without bytes): ``lat``
    of the bucket's collective (per boundary it ends at), its bytes as priced (``Bc``, prefix
    sums at the boundaries) and packed (``Rb``, the bytes themselves); issuing is ``call_s``
    plus the packing of a fused bucket and the bucket's pending cost (``pend``, per boundary:
    `core.pending_at` of its collective's, fixed by where it is ready).

    With fusion, a backward dynamic program over the boundaries (buckets allowed by ``lo``)
    chooses the cuts: fewer calls against the packing of fused buckets. Returns, per
    boundary, the time, the blocks and buckets (tie keys) and the next cut.
    """
    M = len(Bc) - 1
    t_best = np.zeros(M + 1)
    blk = np.zeros(M + 1, dtype=np.int64)
    nb = np.zeros(M + 1, dtype=np.int64)
    nxt = np.full(M + 1, M, dtype=np.int64)
    quantum = TIE_RTOL * scale
    for t in range(M - 1, -1, -1):
        u = np.arange(t + 1, M + 1) if free else np.array([t + 1])
        u = u[lo[u] <= t]
        nbytes = Bc[u] - Bc[t]
        real = Rb[u] - Rb[t]
        packed = call_s + np.where(Nc[u] - Nc[t] >= 2, real * pack_per_byte, 0.0) + pend[u]
        some = real > 0
        time = np.where(some, lat[u] + packed + nbytes / bw, 0.0) + t_best[u]
        blocks = np.where(some, key, 0) + blk[u]
        buckets = 1 + nb[u]
        i = np.lexsort((buckets, blocks, np.round(time / quantum)))[0]
        t_best[t], blk[t], nb[t], nxt[t] = time[i], blocks[i], buckets[i], u[i]
    return t_best, blk, nb, nxt


@dataclass
class _Front:
    """The live states of the search, one entry per state, grouped by boundary (ascending) and by
    progress within a group: time ``T``, progress ``P``, boundary ``B``, blocks and buckets so
    far (tie keys), the state's id in the store, and ``loc``: the offset within the group of the
    least-lag (``T - P``) state among the group's states up to this one."""

    T: np.ndarray
    P: np.ndarray
    B: np.ndarray
    blk: np.ndarray
    nb: np.ndarray
    id: np.ndarray
    loc: np.ndarray

    def _fields(self) -> tuple[np.ndarray, ...]:
        return self.T, self.P, self.B, self.blk, self.nb, self.id, self.loc

    @property
    def size(self) -> int:
        return int(self.T.size)

    def take(self, sel: np.ndarray) -> _Front:
        return _Front(*(x[sel] for x in self._fields()))

    def extended(self, other: _Front) -> _Front:
        return _Front(*(np.concatenate((a, b)) for a, b in zip(self._fields(), other._fields())))

    def group_starts(self) -> np.ndarray:
        return np.flatnonzero(np.concatenate(([True], self.B[1:] != self.B[:-1])))


class _Search:
    """The dynamic program of the module docstring, as its named steps (`run` applies them per
    boundary): `sources` (idle sources), `expand` (one collective per source and allocation, with
    normalisation), `finish` (compute finished), `bound`, `grow` (dominance and cap, into the
    front), `prune` (reach and bound on sources, idle groups collapsed), `backtrack`."""

    def __init__(self, comp: list[float], byts: list[int], cuts: list[int], free: bool, cost: CostModel,
                 upper: float, cap: int, reach: Sequence[int] | None, pricing: _Pricing) -> None:
        self.byts, self.cuts, self.free, self.upper, self.cap = byts, cuts, free, upper, cap
        self.keys = np.array(cost.keys, dtype=np.int64)
        self.ob = np.array([cost.overlap_bw[k] for k in cost.keys])
        self.sb = np.array([cost.solo_bw[k] for k in cost.keys])
        self.sl = np.array([cost.slowdown[k] for k in cost.keys])
        # Per boundary t: the latency of a bucket ending there (its collective's).
        self.lat = np.array([0.0] + [pricing.lat[c - 1] for c in cuts[1:]])
        self.lam = _lipschitz(cost)
        bw_max = float(max(self.ob.max(), self.sb.max()))
        self.best_solo = int(np.argmax(self.sb))  # first maximum: the fewest blocks among the fastest
        self.M = len(cuts) - 1
        self.C = C = comp[-1]
        self.R = np.array([comp[c] for c in cuts] + [C])  # ready progress of a bucket ending at each boundary
        self.Bc = Bc = np.array([pricing.wire[c] for c in cuts])  # bytes before each boundary, priced
        self.Rb = np.array([float(byts[c]) for c in cuts])  # ... and as they are (packing)
        nonempty_prefix = _prefix(byts[i + 1] > byts[i] for i in range(len(byts) - 1))
        self.Nc = np.array([nonempty_prefix[c] for c in cuts])  # non-empty layers before each boundary
        self.lo = _lowest_sources(cuts, reach if free else None)
        self.pack_c, self.call_s = cost.pack_s_per_byte, cost.call_s
        # Per boundary t: the pending cost of a bucket ending there (`pending_at`; 0 at t = 0).
        self.pend = np.array([0.0] + [pending_at(pricing.pend[c - 1], comp[c], C)
                                      for c in cuts[1:]])
        total = Bc[-1]
        # Best rest once compute is over, and a lower bound on the communication still due.
        group_bytes = np.diff(Bc)
        nonempty = group_bytes > 0
        self.tail_t, self.tail_blk, self.tail_nb, self.tail_next = _tail(
            Bc, self.Rb, self.Nc, self.lo, free, self.lat, float(self.sb[self.best_solo]),
            int(self.keys[self.best_solo]), self.pack_c, self.call_s, max(upper, C, 1e-300),
            self.pend)
        if free:
            rest = total - Bc
            # The least latency of a collective still due: of the layers from each boundary on.
            lat_after = np.minimum.accumulate(np.array([*pricing.lat, math.inf])[::-1])[::-1]
            self.comm_lb = np.where(rest > 0, lat_after[cuts] + rest / bw_max, 0.0)
        else:
            self.comm_lb = np.concatenate(
                [np.cumsum(np.where(nonempty, self.lat[1:] + group_bytes / bw_max, 0.0)[::-1])[::-1], [0]])
        self.rest_lb = (total - Bc) / bw_max  # seconds of bytes still due from each boundary, at best
        # Store of every kept state: parent id, allocation index, boundary. Id 0 is the start.
        self.parents: list[np.ndarray] = [np.array([-1])]
        self.kidx: list[np.ndarray] = [np.array([0])]
        self.bound_of: list[np.ndarray] = [np.array([0])]
        self.n_states = 1
        self.upper_b = upper * (1 + _BOUND_RTOL)
        self.fin: list[tuple] = []  # (time, blocks, buckets, src id, k index, boundary) of complete plans
        self.best_t = math.inf
        self.err = 0.0

    def run(self) -> tuple[list[Bucket] | None, float]:
        start = float(self.R[1])  # normalised: compute runs alone up to the first ready time
        zeros = np.zeros(1, dtype=np.int64)
        front = _Front(np.array([start]), np.array([start]), zeros, zeros, zeros, zeros, zeros)
        for t in range(1, self.M + 1):
            if self.free and self.lo[t] > 0 and front.size and front.B[0] < self.lo[t]:
                # Buckets ending here or later cannot start this early (reach): drop those sources.
                front = front.take(front.B >= self.lo[t])
            if front.size == 0:
                break
            src_i = self.sources(front, t)
            E, Q, r, nbytes = self.expand(front, src_i, t)
            tie = functools.partial(self.tie_keys, front, src_i, nbytes)
            E, Q, r = self.finish(t, E, Q, r, tie)
            if t == self.M:
                break
            E, Q, r = self.bound(t, *self.normalise(t, E, Q), r)
            front = self.grow(front, t, E, Q, r, tie)
            if self.free and front.size:
                front = self.prune(front, t)
        return self.backtrack()

    def sources(self, front: _Front, t: int) -> np.ndarray:
        """Idle sources: per group, the least-lag state among those idle at ``R[t]`` (they all start
        the bucket at ``R[t]`` and differ only by a time shift), plus every busy state."""
        Rt = float(self.R[t])
        starts = front.group_starts() if self.free else np.zeros(1, dtype=np.int64)
        idle = front.P <= Rt
        cnt = np.add.reduceat(idle.astype(np.int64), starts)
        has = cnt > 0
        reps = starts[has] + front.loc[starts[has] + cnt[has] - 1]
        return np.concatenate([reps, np.flatnonzero(~idle)])

    def expand(self, front: _Front, src_i: np.ndarray, t: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every source times every allocation: the bucket from the source's boundary to ``t``
        (packed if fused). Returns (E, Q, r, bytes per source), ``r`` the row-major index into
        (source, allocation); a bucket of no bytes carries its state over, with the smallest key."""
        T0, P0 = front.T[src_i], front.P[src_i]
        nbytes = self.Bc[t] - self.Bc[front.B[src_i]]
        real = self.Rb[t] - self.Rb[front.B[src_i]]
        packed = self.call_s + np.where(self.Nc[t] - self.Nc[front.B[src_i]] >= 2,
                                        real * self.pack_c, 0.0) + self.pend[t]
        E, Q = _collective_np(T0[:, None], P0[:, None], float(self.R[t]), nbytes[:, None], float(self.lat[t]),
                              self.ob, self.sb, self.sl, self.C, packed[:, None])
        empty = nbytes == 0
        r = np.arange(E.size)
        if empty.any():
            E[empty] = T0[empty, None]
            Q[empty] = P0[empty, None]
            valid = np.ones(E.shape, dtype=bool)
            valid[empty, 1:] = False
            keep = valid.ravel()
            return E.ravel()[keep], Q.ravel()[keep], r[keep], nbytes
        return E.ravel(), Q.ravel(), r, nbytes

    def tie_keys(self, front: _Front, src_i: np.ndarray, nbytes: np.ndarray, r: np.ndarray
                 ) -> tuple[np.ndarray, ...]:
        """(blocks, buckets, source id, allocation index) of the new states ``r``."""
        row, kk = np.divmod(r, len(self.keys))
        src = src_i[row]
        blk = front.blk[src] + np.where(nbytes[row] > 0, self.keys[kk], 0)
        return blk, front.nb[src] + 1, front.id[src], kk

    def finish(self, t: int, E: np.ndarray, Q: np.ndarray, r: np.ndarray,
               tie: Callable[[np.ndarray], tuple[np.ndarray, ...]]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Compute finished (or the last boundary): the state becomes a complete plan with the best
        rest (`_tail`); kept among the plans within a tie of the best. Returns the other states."""
        done = Q >= self.C
        if t == self.M:
            done[:] = True
        if not done.any():
            return E, Q, r
        ft = E[done] + (self.C - Q[done]) + self.tail_t[t]
        m = float(ft.min())
        if m < self.best_t:
            self.best_t = m
            self.fin = [f for f in self.fin if f[0] <= self.best_t * (1 + TIE_RTOL)]
            self.upper_b = min(self.upper_b, self.best_t * (1 + _BOUND_RTOL))
        keep = ft <= self.best_t * (1 + TIE_RTOL)
        blk, nb, src, kk = tie(r[done][keep])
        for f, b, c, s, k in zip(ft[keep], blk + self.tail_blk[t], nb + self.tail_nb[t], src, kk):
            self.fin.append((float(f), int(b), int(c), int(s), int(k), t))
        live = ~done
        return E[live], Q[live], r[live]

    def normalise(self, t: int, E: np.ndarray, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """No collective starts before the next bucket's ready progress: ``(T + R - P, R)``."""
        nxt = float(self.R[t + 1])
        late = Q < nxt
        return np.where(late, E + (nxt - Q), E), np.where(late, nxt, Q)

    def bound(self, t: int, E: np.ndarray, Q: np.ndarray, r: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Branch and bound: drop states that cannot beat the best complete plan."""
        ok = E + np.maximum(self.C - Q, self.comm_lb[t]) <= self.upper_b
        return E[ok], Q[ok], r[ok]

    def grow(self, front: _Front, t: int, E: np.ndarray, Q: np.ndarray, r: np.ndarray,
             tie: Callable[[np.ndarray], tuple[np.ndarray, ...]]) -> _Front:
        """Dominance and cap (`_thin`) on the new states at ``t``, stored and added to the front
        (with fusion; a fixed grouping's front is only the new states)."""
        if not E.size:
            return front if self.free else front.take(np.zeros(0, dtype=np.int64))
        sel, loss = _thin(E, Q, lambda idx: tie(r[idx]), self.lam, self.cap,
                          max(self.upper, self.C, 1e-300))
        self.err += loss
        E, Q, r = E[sel], Q[sel], r[sel]
        blk, nb, src, kk = tie(r)
        lag = E - Q
        run = np.minimum.accumulate(lag)
        first_min = np.concatenate(([True], lag[1:] < run[:-1]))
        loc = np.maximum.accumulate(np.where(first_min, np.arange(E.size), 0))
        ids = np.arange(self.n_states, self.n_states + E.size)
        self.n_states += E.size
        self.parents.append(src)
        self.kidx.append(kk)
        self.bound_of.append(np.full(E.size, t))
        new = _Front(E, Q, np.full(E.size, t, dtype=np.int64), blk, nb, ids, loc)
        return front.extended(new) if self.free else new

    def prune(self, front: _Front, t: int) -> _Front:
        """Drop what can no longer beat the bound; collapse groups idle from now on to their
        least-lag state (R only grows, so both are for good)."""
        nxt = float(self.R[t + 1])
        lb = front.T + np.maximum(nxt - front.P, 0.0) + self.rest_lb[front.B]
        starts = front.group_starts()
        sizes = np.diff(np.append(starts, front.size))
        g_alive = np.minimum.reduceat(lb, starts) <= self.upper_b
        g_idle = np.maximum.reduceat(front.P, starts) <= nxt
        g_rep = starts + front.loc[starts + sizes - 1]
        keep = np.repeat(g_alive & ~g_idle, sizes)
        keep[g_rep[g_alive & g_idle]] = True
        if keep.all():
            return front
        collapsed = np.zeros(front.size, dtype=bool)
        collapsed[g_rep[g_alive & g_idle]] = True
        return dataclasses.replace(front, loc=np.where(collapsed, 0, front.loc)).take(keep)

    def backtrack(self) -> tuple[list[Bucket] | None, float]:
        """The best complete plan's buckets (ties: fewest blocks, then buckets, then bytes order),
        from its store path and the tail, and the error bound."""
        fin, keys, cuts, byts, M = self.fin, self.keys, self.cuts, self.byts, self.M
        if not fin:
            return None, self.err
        par = np.concatenate(self.parents)
        kid = np.concatenate(self.kidx)
        bnd = np.concatenate(self.bound_of)
        fin.sort(key=lambda f: (f[1], f[2]))
        lead = [f for f in fin if f[1:3] == fin[0][1:3]]
        plans = []
        for f in lead:
            _, _, _, s, k, t = f
            steps = [(t, int(keys[k]))]
            while s > 0:
                steps.append((int(bnd[s]), int(keys[kid[s]])))
                s = int(par[s])
            steps.reverse()
            out, prev = [], 0
            for tb, kb in steps:
                first, last = cuts[prev], cuts[tb] - 1
                out.append(Bucket(first, last, kb if byts[last + 1] > byts[first] else int(keys[0])))
                prev = tb
            while prev < M:  # the best rest after compute ended (_tail)
                first, last = cuts[prev], cuts[int(self.tail_next[prev])] - 1
                nonzero = byts[last + 1] > byts[first]
                out.append(Bucket(first, last, int(keys[self.best_solo]) if nonzero else int(keys[0])))
                prev = int(self.tail_next[prev])
            plans.append(out)
        return min(plans, key=lambda b: _plan_key(b, byts)[2]), self.err


def _search(comp: list[float], byts: list[int], cuts: list[int], free: bool, cost: CostModel,
            upper: float, *, pricing: _Pricing, cap: int = FRONT_CAP,
            reach: Sequence[int] | None = None) -> tuple[list[Bucket] | None, float]:
    """The dynamic program of the module docstring: the best plan it finds and its error bound."""
    return _Search(comp, byts, cuts, free, cost, upper, cap, reach, pricing).run()
