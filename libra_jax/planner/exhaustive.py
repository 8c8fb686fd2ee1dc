"""The exhaustive reference: `plan_exhaustive` enumerates every plan (the planner's tests
hold `plan` to it)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from libra_jax.planner.core import (
    TIE_RTOL,
    Bucket,
    CostModel,
    Layer,
    Plan,
    _collective_np,
    _make_plan,
    _plan_key,
    _problem,
    pending_at,
)

EXHAUSTIVE_LIMIT = 10**7  # most candidate plans plan_exhaustive will enumerate
_EXHAUSTIVE_CHUNK = 1 << 16  # candidates simulated per vectorised step in plan_exhaustive


# ---------------------------------------------------------------------------------------------
# Exhaustive reference
# ---------------------------------------------------------------------------------------------


def plan_exhaustive(layers: Sequence[Layer], cost: CostModel, *, fusion: bool = True,
                    buckets: Sequence[tuple[int, int]] | None = None,
                    reach: Sequence[int] | None = None) -> Plan:
    """Exact optimum by enumerating every plan (vectorised), with the same tie order as `plan`.

    Candidates: ``K (K+1)^(L-1)`` with fusion, ``K^L`` without, ``K^G`` for a fixed grouping of
    ``G`` buckets; with fusion, those ``reach`` forbids (see `plan`) or that mix collectives are
    discarded. Raises ``ValueError`` if that exceeds ``EXHAUSTIVE_LIMIT``.
    """
    layers, cost, reach, pricing, fixed, free, comp, byts = _problem(
        layers, cost, fusion=fusion, buckets=buckets, reach=reach)
    n, K = len(layers), len(cost.keys)
    ranges = fixed if fixed is not None else [(i, i) for i in range(n)]
    G = len(ranges)
    count = K * (K + 1) ** (n - 1) if free else K ** G
    if count > EXHAUSTIVE_LIMIT:
        raise ValueError(f"plan_exhaustive would enumerate {count} candidates, more than the limit "
                         f"{EXHAUSTIVE_LIMIT}; use plan()")
    keys = np.array(cost.keys, dtype=np.int64)
    ob = np.array([cost.overlap_bw[k] for k in cost.keys])
    sb = np.array([cost.solo_bw[k] for k in cost.keys])
    sl = np.array([cost.slowdown[k] for k in cost.keys])
    C = comp[-1]
    # Digits, least significant first. With fusion: digit i < n-1 says what happens after layer i
    # (0 = no cut, d = cut and the bucket ending there uses key d-1); the last digit is the final
    # bucket's key index. Otherwise: one key index per group.
    radix = [K + 1] * (n - 1) + [K] if free else [K] * G
    weights = np.cumprod([1, *radix[:-1]]).astype(np.int64)
    best_t = math.inf
    tied: list[tuple[np.ndarray, ...]] = []  # codes, times, blocks, buckets
    for lo in range(0, count, _EXHAUSTIVE_CHUNK):
        idx = np.arange(lo, min(count, lo + _EXHAUSTIVE_CHUNK), dtype=np.int64)
        T = np.zeros(idx.size)
        P = np.zeros(idx.size)
        acc = np.zeros(idx.size)
        wired = np.zeros(idx.size)  # its bytes as priced (`_Pricing.wire`)
        tensors = np.zeros(idx.size, dtype=np.int64)  # non-empty layers in the open bucket
        allowed = np.full(idx.size, n - 1)  # the last layer the open bucket may reach
        ok = np.ones(idx.size, dtype=bool)
        blk = np.zeros(idx.size, dtype=np.int64)
        nb = np.zeros(idx.size, dtype=np.int64)
        for i, (first, last) in enumerate(ranges):
            nbytes = float(byts[last + 1] - byts[first])
            acc = acc + nbytes
            wired = wired + (pricing.wire[last + 1] - pricing.wire[first])
            tensors = tensors + sum(byts[j + 1] > byts[j] for j in range(first, last + 1))
            if reach is not None:
                ok &= last <= allowed
                allowed = np.minimum(allowed, reach[last])
            digit = (idx // weights[i]) % radix[i]
            if free and i < n - 1:
                close, kk = digit > 0, np.maximum(digit - 1, 0)
            else:
                close, kk = np.ones(idx.size, dtype=bool), digit
            fire = close & (acc > 0)
            if fire.any():
                kf = kk[fire]
                packed = cost.call_s + np.where(tensors[fire] >= 2,
                                                acc[fire] * cost.pack_s_per_byte, 0.0) + \
                    pending_at(pricing.pend[last], comp[last + 1], C)
                T[fire], P[fire] = _collective_np(T[fire], P[fire], comp[last + 1], wired[fire],
                                                  pricing.lat[last], ob[kf], sb[kf], sl[kf], C, packed)
                blk[fire] += keys[kf]
            nb += close
            acc = np.where(close, 0.0, acc)
            wired = np.where(close, 0.0, wired)
            tensors = np.where(close, 0, tensors)
            allowed = np.where(close, n - 1, allowed)
        total = np.where(ok, T + (C - P), math.inf)
        best_t = min(best_t, float(total.min()))
        tied.append((idx, total, blk, nb))
        tied = [tuple(a[t[1] <= best_t * (1 + TIE_RTOL)] for a in t) for t in tied]
    codes, _, blk, nb = (np.concatenate(a) for a in zip(*tied))
    lead = (blk == blk.min())
    lead &= nb == nb[lead].min()

    def decode(code: int) -> list[Bucket]:
        out, first = [], 0
        for i, (g_first, g_last) in enumerate(ranges):
            digit = (code // int(weights[i])) % radix[i]
            if free and i < n - 1:
                if digit == 0:
                    continue
                k = int(keys[digit - 1])
            else:
                k = int(keys[digit])
            if not free:
                first = g_first
            out.append(Bucket(first, g_last, k))
            first = g_last + 1
        return out

    plans = [decode(int(c)) for c in codes[lead]]
    best = min(plans, key=lambda b: _plan_key(b, byts))
    return _make_plan(layers, best, cost)
