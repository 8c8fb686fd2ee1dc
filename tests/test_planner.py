"""Tests for libra_jax.planner, in the module's order: inputs, simulate, plan, baselines, exhaustive.

The simulator is checked against an event-by-event replay written here from the issue's
semantics; the planner against exhaustive enumeration (itself checked against a brute force over
``simulate``) and against every baseline.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from libra_jax import planner
from libra_jax.planner import (
    EXHAUSTIVE_LIMIT,
    Bucket,
    CollectiveTerms,
    CostModel,
    Layer,
    Plan,
    plan,
    plan_default,
    plan_exhaustive,
    plan_fusion_only,
    plan_mgwfbp,
    simulate,
    timeline,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# An independent replay of the semantics: advance from event to event with explicit rates.
# ---------------------------------------------------------------------------------------------


def reference_backward_time(layers, buckets, cost):
    work = [layer.compute_s for layer in layers]
    sizes = [sum(layers[i].grad_bytes for i in range(b.first, b.last + 1)) for b in buckets]
    tensors = [sum(layers[i].grad_bytes > 0 for i in range(b.first, b.last + 1)) for b in buckets]
    n = len(layers)
    now = 0.0
    cur, left = 0, (work[0] if work else 0.0)  # layer being computed, its remaining full-speed work
    nxt = 0  # next bucket to issue
    active = None  # [blocks, latency left, bytes left, packing left]

    def skip_finished():
        nonlocal cur, left
        while cur < n and left <= 0.0:
            cur += 1
            left = work[cur] if cur < n else 0.0

    skip_finished()
    while True:
        while active is None and nxt < len(buckets) and cur > buckets[nxt].last:
            if sizes[nxt] > 0:
                terms = cost.terms(layers[buckets[nxt].last].collective)
                # A one-call bucket's pending cost: at most the compute left after its ready point.
                after = sum(work[buckets[nxt].last + 1:])
                pack = (cost.call_s + (cost.pack_s_per_byte * sizes[nxt] if tensors[nxt] >= 2 else 0.0)
                        + min(terms.pending_s, after))
                active = [buckets[nxt].blocks, terms.latency_s, sizes[nxt] * terms.traffic, pack]
            nxt += 1
        computing = cur < n
        if active is None and not computing:
            assert nxt == len(buckets)
            return now
        packing = bool(active) and active[3] > 0.0  # the compute stream packs the bucket
        rate = 0.0 if packing else (1.0 / cost.slowdown[active[0]] if (active and computing) else 1.0)
        bw = None
        events = []
        if computing and not packing:
            events.append((left / rate, "compute"))
        if packing:
            events.append((active[3], "pack"))
        elif active:
            if active[1] > 0.0:
                events.append((active[1], "latency"))
            else:
                bw = cost.overlap_bw[active[0]] if computing else cost.solo_bw[active[0]]
                events.append((active[2] / bw, "bytes"))
        dt, what = min(events)
        now += dt
        if computing:
            left = 0.0 if what == "compute" else max(0.0, left - dt * rate)
            if left <= 1e-13 * (1 + work[cur]):
                left = 0.0
        if packing:
            active[3] = 0.0 if what == "pack" else max(0.0, active[3] - dt)
        elif active:
            if active[1] > 0.0:
                active[1] = 0.0 if what == "latency" else max(0.0, active[1] - dt)
                if active[1] <= 1e-13 * (1 + cost.latency_s):
                    active[1] = 0.0
            else:
                active[2] = 0.0 if what == "bytes" else active[2] - dt * bw
                if active[2] <= 1e-9:
                    active = None
        skip_finished()


def close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

compute_times = st.one_of(st.just(0.0), st.floats(0.0, 2.0, allow_nan=False, allow_infinity=False))
grad_sizes = st.one_of(st.just(0), st.integers(1, 100))


def layer_lists(lo=1, hi=8):
    return st.lists(st.builds(Layer, compute_times, grad_sizes), min_size=lo, max_size=hi)


@st.composite
def cost_models(draw, max_options=4, physical=True):
    """Random costs; ``physical`` keeps solo_bw >= overlap_bw (contention never speeds a collective)."""
    keys = draw(st.lists(st.integers(1, 16), min_size=1, max_size=max_options, unique=True))
    solo = {k: draw(st.floats(1.0, 100.0)) for k in keys}
    if physical:
        overlap = {k: solo[k] * draw(st.floats(0.05, 1.0)) for k in keys}
    else:
        overlap = {k: draw(st.floats(1.0, 100.0)) for k in keys}
    slowdown = {k: draw(st.floats(1.0, 4.0)) for k in keys}
    latency = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.1), st.floats(0.1, 3.0)))
    pack = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.05)))
    call = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5)))
    pending = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
    return CostModel(latency_s=latency, solo_bw=solo, overlap_bw=overlap, slowdown=slowdown, pack_s_per_byte=pack,
                     call_s=call, pending_s=pending)


@st.composite
def groupings(draw, n):
    """A random tiling of n layers as (first, last) pairs."""
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    edges = [0, *cuts, n]
    return [(edges[i], edges[i + 1] - 1) for i in range(len(edges) - 1)]


@st.composite
def instances(draw, physical=True, hi=8, max_options=4):
    layers = draw(layer_lists(1, hi))
    return layers, draw(cost_models(max_options=max_options, physical=physical))


@st.composite
def bucketed(draw, physical=True):
    layers, cost = draw(instances(physical=physical))
    ranges = draw(groupings(len(layers)))
    keys = list(cost.keys)
    return layers, [Bucket(f, l, draw(st.sampled_from(keys))) for f, l in ranges], cost


def brute_force(layers, cost, ranges_list):
    best = math.inf
    for ranges in ranges_list:
        for ks in itertools.product(cost.keys, repeat=len(ranges)):
            best = min(best, simulate(layers, [Bucket(f, l, k) for (f, l), k in zip(ranges, ks)], cost))
    return best


def all_tilings(n):
    for mask in range(2 ** (n - 1)):
        edges = [0, *(i + 1 for i in range(n - 1) if mask >> i & 1), n]
        yield [(edges[i], edges[i + 1] - 1) for i in range(len(edges) - 1)]


COST = CostModel(latency_s=0.5, solo_bw={1: 10.0, 2: 20.0, 4: 30.0}, overlap_bw={1: 5.0, 2: 8.0, 4: 9.0},
                 slowdown={1: 1.1, 2: 1.5, 4: 2.5})
LAYERS = [Layer(1.0, 10), Layer(0.5, 40), Layer(2.0, 0), Layer(1.5, 25), Layer(0.2, 60), Layer(1.0, 5)]


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def test_import_needs_no_jax():
    code = "import sys; sys.modules['jax'] = None; import libra_jax.planner; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_values_are_frozen_and_normalised():
    layer = Layer(1, 3)
    assert isinstance(layer.compute_s, float) and layer.compute_s == 1.0
    with pytest.raises(FrozenInstanceError):
        layer.compute_s = 2.0  # type: ignore[misc]
    table = {2: 5.0, 1: 4.0}
    cost = CostModel(latency_s=0, solo_bw=table, overlap_bw={1: 1.0, 2: 1.0}, slowdown={1: 1.0, 2: 1.0})
    table[3] = 1.0  # the model keeps its own copy
    assert cost.keys == (1, 2) and list(cost.solo_bw) == [1, 2]
    with pytest.raises(TypeError):
        cost.solo_bw[1] = 3.0  # type: ignore[index]
    assert hash(cost) == hash(CostModel(0.0, {1: 4.0, 2: 5.0}, {2: 1.0, 1: 1.0}, {1: 1.0, 2: 1.0}))
    with pytest.raises(FrozenInstanceError):
        Bucket(0, 1, 2).blocks = 3  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, match", [
    (dict(compute_s=-1.0, grad_bytes=1), r"Layer\.compute_s must be a finite number >= 0, got -1\.0"),
    (dict(compute_s=math.nan, grad_bytes=1), r"Layer\.compute_s must be a finite number >= 0, got nan"),
    (dict(compute_s=math.inf, grad_bytes=1), r"Layer\.compute_s must be a finite number >= 0, got inf"),
    (dict(compute_s="1", grad_bytes=1), r"Layer\.compute_s must be a finite number"),
    (dict(compute_s=1.0, grad_bytes=-1), r"Layer\.grad_bytes must be an integer >= 0, got -1"),
    (dict(compute_s=1.0, grad_bytes=1.5), r"Layer\.grad_bytes must be an integer >= 0, got 1\.5"),
    (dict(compute_s=1.0, grad_bytes=math.inf), r"Layer\.grad_bytes must be an integer >= 0, got inf"),
    (dict(compute_s=1.0, grad_bytes=True), r"Layer\.grad_bytes must be an integer"),
])
def test_layer_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layer(**kwargs)


GOOD = dict(latency_s=0.0, solo_bw={1: 1.0, 2: 2.0}, overlap_bw={1: 1.0, 2: 1.0}, slowdown={1: 1.0, 2: 1.5})


@pytest.mark.parametrize("change, match", [
    (dict(latency_s=-0.1), r"CostModel\.latency_s must be a finite number >= 0, got -0\.1"),
    (dict(latency_s=math.nan), r"CostModel\.latency_s must be a finite number >= 0, got nan"),
    (dict(latency_s=math.inf), r"CostModel\.latency_s must be a finite number >= 0, got inf"),
    (dict(solo_bw={}), r"CostModel\.solo_bw is empty"),
    (dict(overlap_bw={}), r"CostModel\.overlap_bw is empty"),
    (dict(slowdown={}), r"CostModel\.slowdown is empty"),
    (dict(solo_bw={1: 1.0, 3: 2.0}), r"CostModel tables must have the same keys: solo_bw \[1, 3\]"),
    (dict(slowdown={1: 1.0}), r"CostModel tables must have the same keys"),
    (dict(slowdown={1: 1.0, 2: 0.99}), r"CostModel\.slowdown\[2\] must be finite and >= 1, got 0\.99"),
    (dict(slowdown={1: 1.0, 2: math.nan}), r"CostModel\.slowdown\[2\] must be finite and >= 1"),
    (dict(solo_bw={1: 0.0, 2: 2.0}), r"CostModel\.solo_bw\[1\] must be finite and > 0, got 0\.0"),
    (dict(solo_bw={1: -1.0, 2: 2.0}), r"CostModel\.solo_bw\[1\] must be finite and > 0, got -1\.0"),
    (dict(overlap_bw={1: math.inf, 2: 1.0}), r"CostModel\.overlap_bw\[1\] must be finite and > 0, got inf"),
    (dict(overlap_bw={1: math.nan, 2: 1.0}), r"CostModel\.overlap_bw\[1\] must be finite and > 0, got nan"),
    (dict(solo_bw={0: 1.0, 2: 2.0}), r"CostModel\.solo_bw keys must be positive integers, got 0"),
    (dict(solo_bw={1.5: 1.0, 2: 2.0}), r"CostModel\.solo_bw keys must be positive integers, got 1\.5"),
    (dict(solo_bw=[1.0, 2.0]), r"CostModel\.solo_bw must be a mapping"),
])
def test_cost_model_validation(change, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**{**GOOD, **change})


@pytest.mark.parametrize("args, match", [
    ((-1, 0, 1), r"Bucket\.first must be >= 0, got -1"),
    ((2, 1, 1), r"Bucket\.last \(1\) must be >= Bucket\.first \(2\)"),
    ((0, 0, 0), r"Bucket\.blocks must be positive, got 0"),
    ((0, 0.5, 1), r"Bucket\.last must be an integer, got 0\.5"),
])
def test_bucket_validation(args, match):
    with pytest.raises(ValueError, match=match):
        Bucket(*args)


@pytest.mark.parametrize("buckets, match", [
    ([], r"buckets is empty: the buckets must tile the layers"),
    ([Bucket(1, 5, 1)], r"do not tile the layers: bucket 0 starts at layer 1, expected 0"),
    ([Bucket(0, 2, 1), Bucket(2, 5, 1)], r"do not tile the layers: bucket 1 starts at layer 2, expected 3"),
    ([Bucket(0, 2, 1), Bucket(4, 5, 1)], r"do not tile the layers: bucket 1 starts at layer 4, expected 3"),
    ([Bucket(0, 4, 1)], r"do not tile the layers: they cover layers 0\.\.4, but there are 6 layers"),
    ([Bucket(0, 6, 1)], r"do not tile the layers: they cover layers 0\.\.6, but there are 6 layers"),
    ([Bucket(0, 5, 3)], r"buckets\[0\]\.blocks=3 is not an allocation of the cost model \(keys \[1, 2, 4\]\)"),
    ([(0, 5)], r"buckets\[0\] must be a Bucket, got tuple"),
])
def test_simulate_validation(buckets, match):
    with pytest.raises(ValueError, match=match):
        simulate(LAYERS, buckets, COST)


def test_empty_and_wrong_inputs():
    for fn in (lambda: simulate([], [Bucket(0, 0, 1)], COST), lambda: plan([], COST),
               lambda: plan_default([], COST, blocks=1, fusion_bytes=0), lambda: plan_mgwfbp([], COST, blocks=1),
               lambda: plan_fusion_only([], COST, blocks=1), lambda: plan_exhaustive([], COST)):
        with pytest.raises(ValueError, match=r"layers is empty: at least one layer is needed"):
            fn()
    with pytest.raises(ValueError, match=r"layers\[1\] must be a Layer, got tuple"):
        plan([Layer(1.0, 1), (1.0, 1)], COST)
    with pytest.raises(ValueError, match=r"cost must be a CostModel, got dict"):
        plan(LAYERS, {})


@pytest.mark.parametrize("grouping, match", [
    ([(0, 2), (4, 5)], r"do not tile the layers: bucket 1 starts at layer 4, expected 3"),
    ([(0, 2), (3, 4)], r"do not tile the layers: they cover layers 0\.\.4, but there are 6 layers"),
    ([(0, 3), (2, 5)], r"do not tile the layers: bucket 1 starts at layer 2, expected 4"),
    ([(0, 5, 1)], r"buckets\[0\] must be a \(first, last\) pair"),
    ([(0, 2.0), (3, 5)], r"buckets\[0\] must hold integer layer indices"),
    ([], r"buckets is empty"),
])
def test_plan_grouping_validation(grouping, match):
    with pytest.raises(ValueError, match=match):
        plan(LAYERS, COST, buckets=grouping)
    with pytest.raises(ValueError, match=match):
        plan_exhaustive(LAYERS, COST, buckets=grouping)


def test_baseline_argument_validation():
    with pytest.raises(ValueError, match=r"blocks=3 is not an allocation of the cost model \(keys \[1, 2, 4\]\)"):
        plan_default(LAYERS, COST, blocks=3, fusion_bytes=0)
    with pytest.raises(ValueError, match=r"blocks=3 is not an allocation"):
        plan_mgwfbp(LAYERS, COST, blocks=3)
    with pytest.raises(ValueError, match=r"blocks=3 is not an allocation"):
        plan_fusion_only(LAYERS, COST, blocks=3)
    with pytest.raises(ValueError, match=r"fusion_bytes must be an integer >= 0, got -1"):
        plan_default(LAYERS, COST, blocks=1, fusion_bytes=-1)


# ---------------------------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------------------------


def test_simulate_by_hand():
    # Two layers of 1 s; bucket [0] (10 bytes) is ready at 1 s. Latency 0.5 s at slowdown 2: compute
    # advances 0.25 s. Then 10 bytes at 5 B/s would take 2 s, but compute (0.75 s left, 1.5 s wall)
    # ends at 3.0 s after 7.5 bytes; the last 2.5 bytes go at 10 B/s: 3.25 s. Bucket [1] (10 bytes,
    # ready since 3.0 s) then runs solo: 0.5 + 1.0 = 4.75 s.
    cost = CostModel(latency_s=0.5, solo_bw={1: 10.0}, overlap_bw={1: 5.0}, slowdown={1: 2.0})
    layers = [Layer(1.0, 10), Layer(1.0, 10)]
    assert simulate(layers, [Bucket(0, 0, 1), Bucket(1, 1, 1)], cost) == pytest.approx(4.75, abs=1e-12)
    # One bucket of 20 bytes after all compute: 2.0 + 0.5 + 2.0.
    assert simulate(layers, [Bucket(0, 1, 1)], cost) == pytest.approx(4.5, abs=1e-12)


def test_simulate_without_bytes_is_compute_time():
    layers = [Layer(0.5, 0), Layer(1.25, 0)]
    assert simulate(layers, [Bucket(0, 0, 1), Bucket(1, 1, 4)], COST) == 1.75


@FAST
@given(bucketed(physical=False))
def test_simulate_matches_reference(case):
    layers, buckets, cost = case
    assert close(simulate(layers, buckets, cost), reference_backward_time(layers, buckets, cost))


@SLOW
@given(st.data())
def test_simulate_matches_reference_long(data):
    layers = data.draw(layer_lists(20, 60))
    cost = data.draw(cost_models(max_options=8, physical=False))
    ranges = data.draw(groupings(len(layers)))
    buckets = [Bucket(f, l, data.draw(st.sampled_from(cost.keys))) for f, l in ranges]
    assert close(simulate(layers, buckets, cost), reference_backward_time(layers, buckets, cost))

# The one cost formula (`core._collective`) runs on Python floats (`simulate`, `timeline`, the
# plans' scores) and on NumPy arrays (`plan`'s search, `plan_exhaustive`), whose plans the
# tests above compare exactly: the two must give the same floats, bit for bit, in every case.

CASES = ("solo only", "hidden", "partly overlapped")


@st.composite
def one_collective(draw):
    """One collective's `_collective` arguments aimed at one of its cases (compute ends during
    the latency; the transfer ends first; compute ends during the transfer), issued before or
    after its bucket is ready, with or without packing: (case, arguments)."""
    case = draw(st.sampled_from(CASES))
    C = draw(st.floats(0.0, 4.0))
    P = draw(st.floats(0.0, C))
    ready = draw(st.one_of(st.floats(0.0, P), st.floats(P, C)))  # late when above P
    T = draw(st.floats(0.0, 10.0))
    pack = draw(st.one_of(st.just(0.0), st.floats(1e-6, 0.5)))
    s = draw(st.floats(1.0, 4.0))
    sb = draw(st.floats(1.0, 1e10))
    ob = sb * draw(st.floats(0.05, 1.2))
    busy = (C - max(P, ready)) * s  # compute's wall time left once the bucket is ready
    if case == "solo only":
        lat = busy + draw(st.floats(0.0, 1.0))
        nbytes = draw(st.floats(0.0, 1e10))
    else:
        assume(busy > 1e-9)
        lat = busy * draw(st.floats(0.0, 0.99))
        cap = (busy - lat) * ob
        share = draw(st.floats(0.0, 1.0) if case == "hidden" else st.floats(1.01, 100.0))
        nbytes = cap * share
    return case, (T, P, ready, nbytes, lat, ob, sb, s, C, pack)


def bits(x):
    return np.asarray(x, dtype=np.float64).view(np.uint64)


@FAST
@given(st.lists(one_collective(), min_size=1, max_size=12))
def test_the_cost_formula_is_the_same_on_floats_and_arrays(drawn):
    from libra_jax.planner import core

    rows = [args for _, args in drawn]
    scalar = [core._collective(*args, phases=True) for args in rows]
    for (case, args), ph in zip(drawn, scalar):  # each case is the one aimed at
        C = args[8]
        assert (ph.end, ph.progress_end) == core._collective(*args)
        assert ph.start <= ph.pack_end <= ph.latency_end <= ph.solo_start <= ph.end
        if case == "solo only":
            assert ph.solo_start == ph.latency_end and ph.progress_end == C
        elif case == "hidden":
            assert ph.solo_start == ph.end
        else:
            assert ph.progress_end == C
    # As `plan_exhaustive` calls it: one candidate per element.
    columns = [np.array(column) for column in zip(*rows)]
    for got, want in zip(core._collective_np(*columns, phases=True), zip(*scalar)):
        assert np.array_equal(bits(got), bits(want))
    # As `plan`'s search calls it: states down, allocations across, one bucket (ready, latency
    # and total compute shared); every pairing against the float path.
    T, P, _, nbytes, _, ob, sb, s, _, pack = columns
    ready, lat, C = rows[0][2], rows[0][4], rows[0][8]
    E, Q = core._collective_np(T[:, None], P[:, None], ready, nbytes[:, None], lat, ob, sb, s, C,
                               pack[:, None])
    for (i, state), (j, alloc) in itertools.product(enumerate(rows), repeat=2):
        e, q = core._collective(state[0], state[1], ready, state[3], lat, *alloc[5:8], C, state[9])
        assert (bits(E[i, j]), bits(Q[i, j])) == (bits(e), bits(q))


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


def check_plan(p, layers, cost):
    assert isinstance(p, Plan) and isinstance(p.buckets, list)
    assert p.backward_s == simulate(layers, p.buckets, cost)
    assert all(b.blocks in cost.keys for b in p.buckets)


def plan_and_optimum(layers, cost, **options):
    """`plan` (checked by `check_plan`) and `plan_exhaustive` with the same options."""
    p = plan(layers, cost, **options)
    check_plan(p, layers, cost)
    return p, plan_exhaustive(layers, cost, **options)


@FAST
@given(instances())
def test_plan_with_fusion_within_one_percent_of_exhaustive(case):
    p, e = plan_and_optimum(*case)
    assert e.backward_s <= p.backward_s * (1 + 1e-9) and p.backward_s <= e.backward_s * 1.01


@FAST
@given(instances())
def test_plan_without_fusion_within_one_percent_of_exhaustive(case):
    layers, cost = case
    p, e = plan_and_optimum(layers, cost, fusion=False)
    assert [(b.first, b.last) for b in p.buckets] == [(i, i) for i in range(len(layers))]
    assert e.backward_s <= p.backward_s * (1 + 1e-9) and p.backward_s <= e.backward_s * 1.01


@FAST
@given(st.data())
def test_plan_with_grouping_within_one_percent_of_exhaustive(data):
    layers, cost = data.draw(instances())
    grouping = data.draw(groupings(len(layers)))
    p, e = plan_and_optimum(layers, cost, buckets=grouping)
    assert [(b.first, b.last) for b in p.buckets] == grouping
    assert e.backward_s <= p.backward_s * (1 + 1e-9) and p.backward_s <= e.backward_s * 1.01


@SLOW
@given(instances(physical=False))
def test_plan_quality_when_overlap_is_faster_than_solo(case):
    # Outside the physical regime the dominance rules are heuristics, so no bound against the
    # exhaustive search is claimed (e.g. 2.0 vs 1.96 s for layers (0 s, 1 B), (0 s, 73 B),
    # (0.75 s, 0 B) with overlapped bandwidth 49x the solo one); the safety net still holds.
    layers, cost = case
    p = plan(layers, cost)
    check_plan(p, layers, cost)
    assert plan_exhaustive(layers, cost).backward_s <= p.backward_s * (1 + 1e-9)
    for k in cost.keys:
        assert p.backward_s <= plan_mgwfbp(layers, cost, blocks=k).backward_s * (1 + 1e-12)
        assert p.backward_s <= plan_default(layers, cost, blocks=k, fusion_bytes=0).backward_s * (1 + 1e-12)


@FAST
@given(instances(hi=12, max_options=5), st.integers(0, 300))
def test_plan_never_worse_than_baselines(case, fusion_bytes):
    layers, cost = case
    best = plan(layers, cost).backward_s
    alone = plan(layers, cost, fusion=False).backward_s
    for k in cost.keys:
        for base in (plan_default(layers, cost, blocks=k, fusion_bytes=fusion_bytes),
                     plan_default(layers, cost, blocks=k, fusion_bytes=0),
                     plan_fusion_only(layers, cost, blocks=k), plan_mgwfbp(layers, cost, blocks=k)):
            check_plan(base, layers, cost)
            assert best <= base.backward_s * (1 + 1e-9)
        assert alone <= plan_default(layers, cost, blocks=k, fusion_bytes=0).backward_s * (1 + 1e-9)


def test_plan_large_instance_beats_baselines():
    # Beyond ATOMS layers the planner pre-fuses; it must still beat every baseline it is compared to.
    import random

    rng = random.Random(3)
    layers = [Layer(rng.lognormvariate(-8, 1), int(rng.lognormvariate(13, 2))) for _ in range(400)]
    mib = 1 << 20
    keys = (1, 2, 3, 4, 6, 8, 12, 16)
    cost = CostModel(latency_s=7e-5, solo_bw={k: 1e9 * (1 - 0.7 ** k) for k in keys},
                     overlap_bw={k: 0.8e9 * (1 - 0.7 ** k) for k in keys},
                     slowdown={k: 1 + 0.05 * k for k in keys})
    p = plan(layers, cost)
    check_plan(p, layers, cost)
    for k in keys:
        for base in (plan_default(layers, cost, blocks=k, fusion_bytes=64 * mib),
                     plan_default(layers, cost, blocks=k, fusion_bytes=0), plan_mgwfbp(layers, cost, blocks=k)):
            assert p.backward_s <= base.backward_s * (1 + 1e-12)
    assert plan(layers, cost, fusion=False).backward_s <= min(
        plan_default(layers, cost, blocks=k, fusion_bytes=0).backward_s for k in keys) * (1 + 1e-12)


def test_plan_is_deterministic():
    first = plan(LAYERS, COST)
    shuffled = CostModel(latency_s=0.5, solo_bw={4: 30.0, 1: 10.0, 2: 20.0}, overlap_bw={2: 8.0, 4: 9.0, 1: 5.0},
                         slowdown={4: 2.5, 2: 1.5, 1: 1.1})
    for _ in range(3):
        assert plan(LAYERS, COST) == first
    assert plan(LAYERS, shuffled) == first


def test_ties_prefer_fewer_blocks():
    # Every allocation costs the same: the smallest wins everywhere, in plan and in plan_exhaustive.
    same = CostModel(latency_s=0.1, solo_bw={2: 10.0, 1: 10.0, 8: 10.0}, overlap_bw={1: 5.0, 2: 5.0, 8: 5.0},
                     slowdown={1: 1.5, 2: 1.5, 8: 1.5})
    for fusion in (True, False):
        for fn in (plan, plan_exhaustive):
            assert {b.blocks for b in fn(LAYERS, same, fusion=fusion).buckets} == {1}


def test_ties_prefer_fewer_buckets_then_lexicographic():
    # No bytes at all: every plan takes exactly the compute time, so one bucket with the smallest key.
    layers = [Layer(1.0, 0), Layer(2.0, 0), Layer(0.5, 0)]
    for fn in (plan, plan_exhaustive):
        p = fn(layers, COST)
        assert p.buckets == [Bucket(0, 2, 1)] and p.backward_s == 3.5
    # Zero compute and zero latency, bytes only in the last layer: one bucket is as good as any.
    layers = [Layer(0.0, 0), Layer(0.0, 0), Layer(0.0, 30)]
    cost = CostModel(latency_s=0.0, solo_bw={1: 10.0}, overlap_bw={1: 10.0}, slowdown={1: 1.0})
    for fn in (plan, plan_exhaustive):
        assert fn(layers, cost).buckets == [Bucket(0, 2, 1)]
    # Fixed grouping, zero-byte group: it carries the smallest key.
    p = plan(LAYERS, COST, buckets=[(0, 1), (2, 2), (3, 5)])
    assert p.buckets[1] == Bucket(2, 2, 1)


def test_plan_fusion_false_ignored_when_grouping_given():
    grouping = [(0, 2), (3, 5)]
    assert plan(LAYERS, COST, fusion=False, buckets=grouping) == plan(LAYERS, COST, buckets=grouping)
    as_buckets = [Bucket(0, 2, 4), Bucket(3, 5, 4)]  # blocks of given Buckets are ignored
    assert plan(LAYERS, COST, buckets=as_buckets) == plan(LAYERS, COST, buckets=grouping)


def test_plan_single_layer():
    p = plan([Layer(1.0, 100)], COST)
    assert len(p.buckets) == 1 and p.backward_s == plan_exhaustive([Layer(1.0, 100)], COST).backward_s


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def test_plan_default_cuts_like_horovod():
    layers = [Layer(1.0, b) for b in (10, 20, 30, 100, 5, 5, 0, 60)]
    ranges = lambda p: [(b.first, b.last) for b in p.buckets]  # noqa: E731
    # Threshold 30: 10+20 fits exactly; 30 alone; 100 exceeds it, alone; 5+5+0 fits; 60 alone.
    p = plan_default(layers, COST, blocks=2, fusion_bytes=30)
    assert ranges(p) == [(0, 1), (2, 2), (3, 3), (4, 6), (7, 7)]
    assert {b.blocks for b in p.buckets} == {2}
    assert ranges(plan_default(layers, COST, blocks=2, fusion_bytes=0)) == [(i, i) for i in range(8)]
    assert ranges(plan_default(layers, COST, blocks=2, fusion_bytes=10**9)) == [(0, 7)]
    assert p.backward_s == simulate(layers, p.buckets, COST)


def test_plan_mgwfbp_merges_when_waiting_is_cheaper_than_a_startup():
    layers = [Layer(1.0, 10), Layer(0.1, 10), Layer(1.0, 10), Layer(1.0, 10)]
    # All-reduce of a layer: 1 + 10/10 = 2 s at blocks=1. Layer 0's would start at 1.0 but layer 1
    # is ready at 1.1 < 1.0 + 1: merge. [0,1] then starts at 1.1 (< 2.1 - 1), ends at 1.1 + 1 + 2 =
    # 4.1; layer 2 is ready at 2.1 but would start at 4.1 > 3.1 - 1: merge; the last layer is
    # the end of the walk.
    cost = CostModel(latency_s=1.0, solo_bw={1: 10.0, 2: 20.0}, overlap_bw={1: 5.0, 2: 5.0},
                     slowdown={1: 1.0, 2: 2.0})
    p = plan_mgwfbp(layers, cost, blocks=1)
    assert [(b.first, b.last, b.blocks) for b in p.buckets] == [(0, 1, 1), (2, 3, 1)]
    assert p.backward_s == simulate(layers, p.buckets, cost)
    # Without latency nothing is worth merging unless the link is busy.
    free = CostModel(latency_s=0.0, solo_bw={1: 1000.0}, overlap_bw={1: 1000.0}, slowdown={1: 1.0})
    assert len(plan_mgwfbp(layers, free, blocks=1).buckets) == 4


@SLOW
@given(instances(hi=6, max_options=3))
def test_plan_fusion_only_is_the_planner_with_one_allocation(case):
    layers, cost = case
    for k in cost.keys:
        p = plan_fusion_only(layers, cost, blocks=k)
        assert {b.blocks for b in p.buckets} == {k}
        one = CostModel(cost.latency_s, {k: cost.solo_bw[k]}, {k: cost.overlap_bw[k]}, {k: cost.slowdown[k]},
                        cost.pack_s_per_byte, cost.call_s, pending_s=cost.pending_s)
        assert close(p.backward_s, plan_exhaustive(layers, one).backward_s)


# ---------------------------------------------------------------------------------------------
# plan_exhaustive
# ---------------------------------------------------------------------------------------------


@SLOW
@given(instances(physical=False, hi=5, max_options=3))
def test_exhaustive_matches_brute_force(case):
    layers, cost = case
    n = len(layers)
    assert close(plan_exhaustive(layers, cost).backward_s, brute_force(layers, cost, all_tilings(n)))
    assert close(plan_exhaustive(layers, cost, fusion=False).backward_s,
                 brute_force(layers, cost, [[(i, i) for i in range(n)]]))


def test_exhaustive_limit(monkeypatch):
    assert EXHAUSTIVE_LIMIT == 10**7
    cost4 = CostModel(0.0, {k: 1.0 for k in (1, 2, 3, 4)}, {k: 1.0 for k in (1, 2, 3, 4)},
                      {k: 1.0 for k in (1, 2, 3, 4)})
    # 4 * 5^10 = 39,062,500 with fusion; 4^12 = 16,777,216 without; 4^12 for a 12-group grouping.
    with pytest.raises(ValueError, match=r"would enumerate 39062500 candidates, more than the limit 10000000"):
        plan_exhaustive([Layer(1.0, 1)] * 11, cost4)
    with pytest.raises(ValueError, match=r"would enumerate 16777216 candidates"):
        plan_exhaustive([Layer(1.0, 1)] * 12, cost4, fusion=False)
    with pytest.raises(ValueError, match=r"would enumerate 16777216 candidates"):
        plan_exhaustive([Layer(1.0, 1)] * 13, cost4, buckets=[(0, 1), *((i, i) for i in range(2, 13))])
    # The limit is inclusive: exactly EXHAUSTIVE_LIMIT candidates still run.
    monkeypatch.setattr(planner.exhaustive, "EXHAUSTIVE_LIMIT", 4 * 5**2)
    assert len(plan_exhaustive([Layer(1.0, 1)] * 3, cost4).buckets) >= 1  # 100 candidates
    with pytest.raises(ValueError, match=r"would enumerate 500 candidates, more than the limit 100"):
        plan_exhaustive([Layer(1.0, 1)] * 4, cost4)


# ---------------------------------------------------------------------------------------------
# Fusion's price (pack_s_per_byte) and fusable ranges (reach)
# ---------------------------------------------------------------------------------------------


def test_pack_cost_by_hand():
    # Two layers, both gradients ready at the end: one fused bucket pays the pack (compute is
    # over, so it only delays the collective), two singles pay the latency twice.
    layers = [Layer(1.0, 10), Layer(0.0, 30)]
    cost = CostModel(latency_s=0.5, solo_bw={1: 10.0}, overlap_bw={1: 10.0}, slowdown={1: 1.0},
                     pack_s_per_byte=0.01)
    assert cost.pack_s(40, 2) == pytest.approx(0.4) and cost.pack_s(40, 1) == 0.0
    fused = simulate(layers, [Bucket(0, 1, 1)], cost)
    assert fused == pytest.approx(1.0 + 0.4 + 0.5 + 4.0)
    assert simulate(layers, [Bucket(0, 0, 1), Bucket(1, 1, 1)], cost) == pytest.approx(1.0 + 0.5 + 1.0 + 0.5 + 3.0)
    # A bucket with one non-empty gradient is not packed.
    assert simulate([Layer(1.0, 0), Layer(0.0, 30)], [Bucket(0, 1, 1)], cost) == pytest.approx(1.0 + 0.5 + 3.0)
    # Packing stalls compute: a bucket packed while later layers still compute delays them.
    stalls = [Layer(1.0, 10), Layer(1.0, 10), Layer(2.0, 0)]
    t = simulate(stalls, [Bucket(0, 1, 1), Bucket(2, 2, 1)], cost)
    assert t == pytest.approx(2.0 + 0.2 + 0.5 + 2.0)  # packing starts at 2 s; compute then ends at 4.2 s
    t_cheap = simulate(stalls, [Bucket(0, 1, 1), Bucket(2, 2, 1)],
                       CostModel(0.5, {1: 10.0}, {1: 10.0}, {1: 1.0}, pack_s_per_byte=0.0))
    assert t == pytest.approx(t_cheap + 0.2)


def test_a_call_costs_the_compute_stream_call_s():
    # Every call, fused or not, takes call_s from the compute stream before its latency (the
    # hand-offs of a call in a step); a fused bucket adds its packing.
    cost = CostModel(latency_s=0.5, solo_bw={1: 10.0}, overlap_bw={1: 10.0}, slowdown={1: 1.0},
                     pack_s_per_byte=0.01, call_s=0.25)
    assert cost.issue_s(40, 1) == pytest.approx(0.25) and cost.issue_s(40, 2) == pytest.approx(0.65)
    layers = [Layer(1.0, 10), Layer(0.0, 30)]
    assert simulate(layers, [Bucket(0, 1, 1)], cost) == pytest.approx(1.0 + 0.65 + 0.5 + 4.0)
    assert simulate(layers, [Bucket(0, 0, 1), Bucket(1, 1, 1)], cost) == pytest.approx(
        1.0 + 0.25 + 0.5 + 1.0 + 0.25 + 0.5 + 3.0)
    # It stalls compute: a call issued while later layers compute delays them by call_s.
    stalls = [Layer(1.0, 10), Layer(2.0, 0)]
    t = simulate(stalls, [Bucket(0, 0, 1), Bucket(1, 1, 1)], cost)
    assert t == pytest.approx(1.0 + 0.25 + 2.0)
    # A bucket of no bytes is no call.
    assert simulate([Layer(1.0, 0)], [Bucket(0, 0, 1)], cost) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="call_s"):
        CostModel(0.0, {1: 1.0}, {1: 1.0}, {1: 1.0}, call_s=-1.0)


def test_a_call_priced_in_the_step_fuses_more():
    # Gradients ready through the backward pass: with calls priced by their latency alone, the
    # plan overlaps them one by one; priced as they run in a step (call_s), it fuses them.
    layers = [Layer(1e-3, 1 << 16) for _ in range(8)]
    base = dict(latency_s=1e-5, solo_bw={1: 1e9, 2: 1.5e9}, overlap_bw={1: 5e8, 2: 6e8},
                slowdown={1: 1.2, 2: 1.5})
    free = plan(layers, CostModel(**base))
    priced = plan(layers, CostModel(**base, call_s=4e-4))
    assert len(priced.buckets) < len(free.buckets)
    for p_, c in ((free, 0.0), (priced, 4e-4)):
        assert close(p_.backward_s, plan_exhaustive(layers, CostModel(**base, call_s=c)).backward_s)


def test_pack_cost_changes_the_plan_when_copies_are_slow():
    # Many small gradients after the backward pass: fusing saves latencies; when packing is
    # slow (low memory bandwidth) it costs more than it saves, and the planner stops fusing.
    layers = [Layer(1.0, 1000)] + [Layer(0.0, 1000)] * 5
    base = dict(latency_s=0.01, solo_bw={1: 1e5, 2: 1.5e5}, overlap_bw={1: 5e4, 2: 6e4},
                slowdown={1: 1.2, 2: 1.5})
    cheap = plan(layers, CostModel(**base, pack_s_per_byte=1e-7))
    slow = plan(layers, CostModel(**base, pack_s_per_byte=1e-4))
    assert len(cheap.buckets) == 1
    assert all(b.first == b.last for b in slow.buckets)
    for p_, c in ((cheap, 1e-7), (slow, 1e-4)):
        assert close(p_.backward_s, plan_exhaustive(layers, CostModel(**base, pack_s_per_byte=c)).backward_s)


@st.composite
def reaching(draw):
    layers, cost = draw(instances(hi=7, max_options=3))
    n = len(layers)
    reach = [draw(st.integers(i, n - 1)) for i in range(n)]
    return layers, cost, reach


@FAST
@given(reaching())
def test_plan_with_reach_matches_exhaustive(case):
    layers, cost, reach = case
    p = plan(layers, cost, reach=reach)
    for b in p.buckets:
        assert all(b.last <= reach[i] for i in range(b.first, b.last))
    assert close(p.backward_s, simulate(layers, p.buckets, cost))
    assert p.backward_s <= plan_exhaustive(layers, cost, reach=reach).backward_s * (1 + 1e-9) + 1e-12


def test_reach_on_a_large_instance_keeps_every_bucket_fusable():
    import random

    rng = random.Random(5)
    n = 600  # beyond ATOMS: pre-fused groups must respect reach too
    layers = [Layer(rng.random() * 1e-3, rng.randrange(1, 1 << 20)) for _ in range(n)]
    reach = [min(n - 1, i + rng.choice([0, 1, 3, 50])) for i in range(n)]
    cost = CostModel(latency_s=1e-4, solo_bw={1: 1e9, 4: 3e9}, overlap_bw={1: 5e8, 4: 1e9},
                     slowdown={1: 1.1, 4: 1.5}, pack_s_per_byte=1e-11)
    p = plan(layers, cost, reach=reach)
    for b in p.buckets:
        assert all(b.last <= reach[i] for i in range(b.first, b.last))


def test_within_reach_cuts_forbidden_buckets():
    reach = [1, 1, 4, 3, 4]  # layer 1 cannot wait for 2; layer 2 may join 3 and 4, layer 3 only 3
    got = planner.within_reach([Bucket(0, 4, 2)], reach)
    assert got == [Bucket(0, 1, 2), Bucket(2, 3, 2), Bucket(4, 4, 2)]
    assert planner.within_reach([Bucket(0, 4, 2)], None) == [Bucket(0, 4, 2)]
    with pytest.raises(ValueError, match="reach"):
        plan([Layer(1.0, 1)] * 3, COST, reach=[0, 1])
    with pytest.raises(ValueError, match=r"reach\[1\]"):
        plan([Layer(1.0, 1)] * 3, COST, reach=[2, 0, 2])


def test_cost_model_pack_validation():
    with pytest.raises(ValueError, match="pack_s_per_byte"):
        CostModel(0.0, {1: 1.0}, {1: 1.0}, {1: 1.0}, pack_s_per_byte=-1.0)
    assert hash(CostModel(0.0, {1: 1.0}, {1: 1.0}, {1: 1.0}, 1e-9)) != hash(CostModel(0.0, {1: 1.0}, {1: 1.0}, {1: 1.0}))


def test_timeline_is_simulate_phase_by_phase():
    # The Gantt chart is drawn from planner.timeline, the same formula as simulate (no second
    # event simulator): the same backward time, exactly, and phases in order.
    import random

    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 10)
        layers = [planner.Layer(rng.choice([0.0, rng.random() * 1e-3]),
                                rng.choice([0, rng.randrange(1, 1 << 22)])) for _ in range(n)]
        keys = sorted(rng.sample([1, 2, 4, 8], rng.randint(1, 3)))
        solo = {k: rng.uniform(1e9, 2e10) for k in keys}
        cost = planner.CostModel(rng.choice([0.0, 1e-5]), solo,
                                 {k: solo[k] * rng.uniform(0.3, 1.0) for k in keys},
                                 {k: rng.uniform(1.0, 3.0) for k in keys},
                                 pack_s_per_byte=rng.choice([0.0, 1e-10]),
                                 call_s=rng.choice([0.0, 2e-5]))
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        bounds = [0, *cuts, n]
        buckets = [planner.Bucket(a, b - 1, rng.choice(keys)) for a, b in zip(bounds, bounds[1:])]
        tl = planner.timeline(layers, buckets, cost)
        assert tl.backward_s == planner.simulate(layers, buckets, cost)
        for _, _, _, ph in tl.collectives:
            assert ph.start <= ph.pack_end <= ph.latency_end <= ph.solo_start <= ph.end
        t, progress = 0.0, 0.0
        for t0, t1, p0, p1, slowdown in tl.compute:  # in order; back to back until compute ends
            assert (t0 == t if progress < tl.compute[-1][3] else t0 >= t)
            assert t1 >= t0 and p1 >= p0 == progress and slowdown >= 1.0
            t, progress = t1, p1
        assert progress == pytest.approx(sum(l.compute_s for l in layers), rel=1e-12, abs=1e-18)


# ---------------------------------------------------------------------------------------------
# A backward pass of all-reduces and reduce-scatters (FSDP beside replicated parameters)
# ---------------------------------------------------------------------------------------------


@st.composite
def mixed_instances(draw, hi=7, max_options=3):
    """Layers whose gradients are all-reduced or reduce-scattered, and a cost that prices both."""
    n = draw(st.integers(1, hi))
    layers = [Layer(draw(compute_times), draw(grad_sizes),
                    draw(st.sampled_from(["all-reduce", "reduce-scatter"]))) for _ in range(n)]
    cost = draw(cost_models(max_options=max_options))
    terms = CollectiveTerms(latency_s=draw(st.floats(0.0, 1.0)), traffic=draw(st.floats(0.2, 1.0)),
                            pending_s=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))))
    return layers, CostModel(cost.latency_s, cost.solo_bw, cost.overlap_bw, cost.slowdown,
                             cost.pack_s_per_byte, call_s=cost.call_s, collectives={"reduce-scatter": terms},
                             pending_s=cost.pending_s)


def one_collective_per_bucket(layers, buckets):
    return all(len({layers[i].collective for i in range(b.first, b.last + 1)}) == 1 for b in buckets)


@FAST
@given(mixed_instances())
def test_mixed_collectives_plan_is_the_exhaustive_optimum(case):
    # The planner's claim (module docstring): exact without pre-fusion while the cap does not
    # bind, with a bucket per collective. No gap to the enumeration, in both directions.
    layers, cost = case
    for options in ({}, {"fusion": False}):
        p, e = plan_and_optimum(layers, cost, **options)
        assert one_collective_per_bucket(layers, p.buckets)
        assert one_collective_per_bucket(layers, e.buckets)
        assert close(p.backward_s, e.backward_s)


@FAST
@given(st.data())
def test_mixed_collectives_simulate_replays_event_by_event(data):
    layers, cost = data.draw(mixed_instances())
    runs = planner.core._pricing(layers, cost).runs or [len(layers) - 1] * len(layers)
    ranges = planner.core._within_reach(data.draw(groupings(len(layers))), runs)
    buckets = [Bucket(f, l, data.draw(st.sampled_from(list(cost.keys)))) for f, l in ranges]
    assert close(simulate(layers, buckets, cost), reference_backward_time(layers, buckets, cost))
    assert planner.timeline(layers, buckets, cost).backward_s == simulate(layers, buckets, cost)


@FAST
@given(mixed_instances(hi=6))
def test_mixed_collectives_with_reach_matches_exhaustive(case):
    layers, cost = case
    reach = [min(len(layers) - 1, i + 1) for i in range(len(layers))]
    p = plan(layers, cost, reach=reach)
    assert one_collective_per_bucket(layers, p.buckets)
    assert all(b.last <= reach[i] for b in p.buckets for i in range(b.first, b.last))
    assert close(p.backward_s, plan_exhaustive(layers, cost, reach=reach).backward_s)


def test_mixed_collectives_baselines_keep_one_collective_per_bucket():
    import random

    rng = random.Random(11)
    kinds = ["all-reduce", "reduce-scatter"]
    layers = [Layer(rng.random() * 1e-3, rng.randrange(1, 1 << 20), kinds[(i // 3) % 2]) for i in range(300)]
    cost = CostModel(1e-4, {1: 1e9, 4: 3e9}, {1: 5e8, 4: 1e9}, {1: 1.1, 4: 1.5}, 1e-11,
                     collectives={"reduce-scatter": CollectiveTerms(6e-5, 0.5)})
    plans = [plan(layers, cost), plan(layers, cost, fusion=False),  # 300 > ATOMS: pre-fused
             plan_default(layers, cost, blocks=4, fusion_bytes=64 << 20),
             plan_mgwfbp(layers, cost, blocks=1), plan_fusion_only(layers, cost, blocks=4),
             *planner.compare_policies(layers, cost, default_alloc=4).plans.values()]
    for p in plans:
        assert one_collective_per_bucket(layers, p.buckets)
        assert close(p.backward_s, simulate(layers, p.buckets, cost))


def test_reduce_scatter_is_priced_by_its_terms():
    # Same layers, same buckets: the reduce-scatter's bytes cost `traffic` of the all-reduce's
    # and its latency is its own; with the all-reduce's terms it is the all-reduce exactly.
    layers = [Layer(0.0, 1000), Layer(0.0, 3000)]
    base = dict(latency_s=0.5, solo_bw={1: 10.0}, overlap_bw={1: 10.0}, slowdown={1: 1.0})
    half = CostModel(**base, collectives={"reduce-scatter": CollectiveTerms(0.25, 0.5)})
    same = CostModel(**base, collectives={"reduce-scatter": CollectiveTerms(0.5, 1.0)})
    rs = [Layer(l.compute_s, l.grad_bytes, "reduce-scatter") for l in layers]
    one = [Bucket(0, 1, 1)]
    assert simulate(layers, one, half) == 0.5 + 4000 / 10.0
    assert simulate(rs, one, half) == 0.25 + 0.5 * 4000 / 10.0
    assert simulate(rs, one, same) == simulate(layers, one, same)
    assert plan(rs, same) == plan(layers, same)


def test_a_layers_collective_is_its_row():
    """`Layer.collective` and `CostModel.collectives`' keys are rows (`libra_jax.collectives`),
    given by the row or by its name (the model's or `jax.lax`'s); the default is the all-reduce."""
    from libra_jax.collectives import BY_KIND
    scatter = BY_KIND["reduce-scatter"]
    assert Layer(1.0, 8).collective is BY_KIND["all-reduce"]
    assert (Layer(1.0, 8, "reduce-scatter").collective is Layer(1.0, 8, "psum_scatter").collective
            is Layer(1.0, 8, scatter).collective is scatter)
    assert Layer(1.0, 8, "reduce-scatter") == Layer(1.0, 8, scatter)
    terms = CollectiveTerms(0.25, 0.5)
    by_name = CostModel(0.5, {1: 10.0}, {1: 5.0}, {1: 2.0}, collectives={"reduce-scatter": terms})
    by_row = CostModel(0.5, {1: 10.0}, {1: 5.0}, {1: 2.0}, collectives={scatter: terms})
    assert by_name == by_row and hash(by_name) == hash(by_row)
    assert dict(by_name.collectives) == {scatter: terms} and by_name.terms(scatter) is terms
    assert by_name.terms(BY_KIND["all-reduce"]) == CollectiveTerms(0.5, 1.0)
    with pytest.raises(ValueError, match="does not price the all-gather: give "
                                         r"CostModel\(collectives=\{'all-gather'"):
        by_name.terms(BY_KIND["all-gather"])
    with pytest.raises(ValueError, match="'all-reduce' is not priced this way"):
        CostModel(0.0, {1: 1.0}, {1: 1.0}, {1: 1.0}, collectives={"psum": terms})


def test_mixed_collectives_errors():
    with pytest.raises(ValueError, match="Layer.collective must be one of"):
        Layer(1.0, 1, "all_reduce")
    with pytest.raises(ValueError, match="'all-reduce' is not priced this way"):
        CostModel(0.0, {1: 1.0}, {1: 1.0}, {1: 1.0}, collectives={"all-reduce": CollectiveTerms(0.0, 1.0)})
    with pytest.raises(ValueError, match="must be CollectiveTerms"):
        CostModel(0.0, {1: 1.0}, {1: 1.0}, {1: 1.0}, collectives={"reduce-scatter": (0.0, 0.5)})
    with pytest.raises(ValueError, match="traffic must be a finite number > 0"):
        CollectiveTerms(0.0, 0.0)
    with pytest.raises(ValueError, match="latency_s must be a finite number >= 0"):
        CollectiveTerms(math.nan, 0.5)
    layers = [Layer(1.0, 8), Layer(1.0, 8, "reduce-scatter")]
    with pytest.raises(ValueError, match="does not price the reduce-scatter"):
        plan(layers, COST)
    cost = CostModel(0.5, {1: 10.0}, {1: 5.0}, {1: 2.0},
                     collectives={"reduce-scatter": CollectiveTerms(0.25, 0.5)})
    with pytest.raises(ValueError, match="bucket 0 .* mixes the all-reduce of layer 0 and the "
                                         "reduce-scatter of layer 1"):
        simulate(layers, [Bucket(0, 1, 1)], cost)
    with pytest.raises(ValueError, match="a bucket holds one collective"):
        plan(layers, cost, buckets=[(0, 1)])
    with pytest.raises(ValueError, match="a bucket holds one collective"):
        plan_exhaustive(layers, cost, buckets=[(0, 1)])
    assert hash(cost) != hash(CostModel(0.5, {1: 10.0}, {1: 5.0}, {1: 2.0}))


# ---------------------------------------------------------------------------------------------
# All-gathers issued ahead (prefetch): gather_timeline, plan_gathers
# ---------------------------------------------------------------------------------------------

from libra_jax.planner import (  # noqa: E402
    GatherStep,
    gather_timeline,
    held_bytes,
    plan_gathers,
    simulate_gathers,
)


def gather_cost(slowdown=1.25, overlap_ratio=0.6, latency=2e-5):
    """Two allocations; the all-gather moves half an all-reduce's bytes per byte."""
    return CostModel(latency_s=1e-5, solo_bw={1: 1e9, 4: 3e9},
                     overlap_bw={1: 1e9 * overlap_ratio, 4: 3e9 * overlap_ratio},
                     slowdown={1: 1.0 + (slowdown - 1) / 3, 4: slowdown},
                     collectives={"all-gather": CollectiveTerms(latency, 0.5)})


@st.composite
def gather_instances(draw):
    n = draw(st.integers(1, 6))
    steps = [GatherStep(draw(st.floats(0, 2e-3)), draw(st.integers(0, 4_000_000)))
             for _ in range(n)]
    return steps, draw(st.floats(0, 1e-3)), draw(st.integers(0, 4)), draw(st.sampled_from([1, 4]))


def test_one_call_gathers_are_serial_with_compute():
    """Distance 0: compute waits for each whole gather, alone at the solo rate, no slowdown."""
    cost = gather_cost()
    steps = [GatherStep(1e-3, 2_000_000), GatherStep(5e-4, 0), GatherStep(2e-3, 6_000_000)]
    for k in (1, 4):
        expected = 3e-4 + sum(2e-5 + s.nbytes * 0.5 / cost.solo_bw[k] + s.compute_s for s in steps)
        assert simulate_gathers(steps, cost, distance=0, blocks=k, lead_s=3e-4) == pytest.approx(
            expected, rel=1e-12)


def test_a_gather_ahead_hides_behind_the_compute_before_its_use():
    """Distance 1 with no contention (slowdown 1, full overlap bandwidth) and compute longer
    than every gather: only the first gather shows (it has no compute before it)."""
    cost = CostModel(latency_s=0.0, solo_bw={2: 1e9}, overlap_bw={2: 1e9}, slowdown={2: 1.0},
                     collectives={"all-gather": CollectiveTerms(0.0, 1.0)})
    steps = [GatherStep(2e-3, 1_000_000) for _ in range(5)]
    assert simulate_gathers(steps, cost, distance=1, blocks=2) == pytest.approx(1e-3 + 1e-2)
    assert simulate_gathers(steps, cost, distance=0, blocks=2) == pytest.approx(5e-3 + 1e-2)
    # A lead of compute reading no gather hides the first one too (issued at the start).
    assert simulate_gathers(steps, cost, distance=1, blocks=2, lead_s=1e-3) == pytest.approx(
        1e-3 + 1e-2)


@given(gather_instances())
@FAST
def test_gather_timeline_keeps_its_rules(case):
    """Every gather is issued when gather i - d's compute starts (the first d at 0; one call:
    when compute reaches it), starts after the previous one ends and no earlier than issued,
    ends before its compute starts; computes run back to back or wait; the compute stream
    does each step's full-speed work; the pass ends when the last compute does."""
    steps, lead, d, k = case
    cost = gather_cost()
    tl = gather_timeline(steps, cost, distance=d, blocks=k, lead_s=lead)
    eps = 1e-12
    prev_end, prev_compute_end = 0.0, None
    for i, g in enumerate(tl.gathers):
        if d and i < d:
            assert g.issue == 0.0
        elif d:
            assert g.issue == pytest.approx(tl.gathers[i - d].compute_start, abs=eps)
        else:
            assert g.issue == pytest.approx(prev_compute_end if i else lead, abs=eps)
        assert g.start >= max(g.issue, prev_end) - eps
        assert g.start == pytest.approx(max(g.issue, prev_end), abs=eps)
        assert g.end >= g.latency_end - eps and g.compute_start >= g.end - eps
        if i:
            assert g.compute_start >= prev_compute_end - eps
        prev_end, prev_compute_end = g.end, g.compute_end
    for step in range(-1, len(steps)):
        work = sum((t1 - t0) / s for j, t0, t1, s in tl.compute if j == step)
        assert work == pytest.approx(lead if step < 0 else steps[step].compute_s, abs=1e-12)
    assert tl.total_s == pytest.approx(tl.gathers[-1].compute_end, abs=eps)
    assert simulate_gathers(steps, cost, distance=d, blocks=k, lead_s=lead) == tl.total_s


@given(gather_instances())
@FAST
def test_plan_gathers_is_the_best_distance_and_allocation_within_the_memory(case):
    steps, lead, _, _ = case
    cost = gather_cost()
    limit = 3_000_000
    one = [1] * len(steps)
    got = plan_gathers(steps, cost, one_call_blocks=one, max_bytes=limit, lead_s=lead)
    options = [(simulate_gathers(steps, cost, distance=0, blocks=one, lead_s=lead), 0)]
    options += [(simulate_gathers(steps, cost, distance=d, blocks=k, lead_s=lead), d)
                for d in range(1, min(4, len(steps)) + 1) if held_bytes(steps, d) <= limit
                for k in cost.keys]
    best = min(t for t, _ in options)
    assert got.total_s == pytest.approx(best, rel=1e-12)
    assert held_bytes(steps, got.distance) <= limit
    assert got.distance == min(d for t, d in options if t <= best * (1 + 1e-12))
    assert got.one_call_s == options[0][0]


def test_plan_gathers_memory_bound_and_fixed_distance():
    cost = gather_cost(slowdown=1.0, overlap_ratio=1.0)
    steps = [GatherStep(1e-3, 2_000_000) for _ in range(6)]
    assert held_bytes(steps, 0) == 0 and held_bytes(steps, 2) == 4_000_000
    assert plan_gathers(steps, cost, one_call_blocks=[4] * 6, max_bytes=10**9).distance >= 1
    # Nothing may be held ahead: one call each, at the one-call allocation.
    tight = plan_gathers(steps, cost, one_call_blocks=[4] * 6, max_bytes=1_999_999)
    assert tight.distance == 0 and tight.blocks == (4,) * 6
    assert tight.total_s == tight.one_call_s
    # A fixed distance is taken as given (the bound is the caller's), at its best allocation.
    fixed = plan_gathers(steps, cost, one_call_blocks=[1] * 6, max_bytes=0, distance=3)
    assert fixed.distance == 3 and fixed.blocks == (4,) * 6
    assert fixed.total_s == simulate_gathers(steps, cost, distance=3, blocks=4)


def test_gather_plan_errors():
    cost = gather_cost()
    steps = [GatherStep(1e-3, 10)]
    with pytest.raises(ValueError, match="GatherStep.compute_s"):
        GatherStep(-1.0, 1)
    with pytest.raises(ValueError, match="GatherStep.nbytes"):
        GatherStep(1.0, 1.5)
    with pytest.raises(ValueError, match="distance must be an integer >= 0"):
        simulate_gathers(steps, cost, distance=-1, blocks=1)
    with pytest.raises(ValueError, match="one allocation per gather"):
        simulate_gathers(steps, cost, distance=0, blocks=[1, 4])
    with pytest.raises(ValueError, match="one_call_blocks must give one allocation"):
        plan_gathers(steps, cost, one_call_blocks=[], max_bytes=1)
    with pytest.raises(ValueError, match="max_bytes"):
        plan_gathers(steps, cost, one_call_blocks=[1], max_bytes=-1)
    with pytest.raises(ValueError, match="does not price the all-gather"):
        simulate_gathers(steps, CostModel(0.0, {1: 1.0}, {1: 1.0}, {1: 1.0}), distance=0,
                         blocks=1)


def test_a_pass_without_gathers_is_its_lead():
    cost = CostModel(latency_s=0.0, solo_bw={2: 1e9}, overlap_bw={2: 1e9}, slowdown={2: 1.0},
                     collectives={"all-gather": CollectiveTerms(0.0, 1.0)})  # no allocation 1
    assert simulate_gathers([], cost, distance=1, blocks=2, lead_s=2e-3) == 2e-3
    assert gather_timeline([], cost, distance=0, blocks=[], lead_s=0.0).total_s == 0.0
    assert plan_gathers([], cost, one_call_blocks=[], max_bytes=0).total_s == 0.0


# ---------------------------------------------------------------------------------------------
# Several all-gathers as one call (groups): gather_timeline(groups=), plan_gathers(reach=)
# ---------------------------------------------------------------------------------------------

def call_cost(call_s=5e-5, latency=2e-5, overlap_ratio=0.6, slowdown=1.25):
    """`gather_cost` with a price per call (its issue on the compute stream), as the CPU
    profile's ``call_s``."""
    cost = gather_cost(slowdown=slowdown, overlap_ratio=overlap_ratio, latency=latency)
    return CostModel(cost.latency_s, dict(cost.solo_bw), dict(cost.overlap_bw),
                     dict(cost.slowdown), call_s=call_s,
                     collectives={"all-gather": CollectiveTerms(latency, 0.5)})


def _key_of(cost):
    """A call's one-call allocation by its bytes: the fastest alone (`group_blocks`)."""
    return lambda nbytes: min(cost.keys, key=lambda k: (nbytes / cost.solo_bw[k], k))


def _groupings(m):
    """Every grouping of m gathers into consecutive calls."""
    for cuts in itertools.product([False, True], repeat=max(0, m - 1)):
        runs, first = [], 0
        for i, cut in enumerate(cuts):
            if cut:
                runs.append((first, i))
                first = i + 1
        runs.append((first, m - 1))
        yield tuple(runs)


def test_a_call_over_several_gathers_pays_one_issue_and_one_latency():
    """Distance 0: the pass is its compute plus, per call, call_s + latency + its bytes at the
    solo rate; members share their call's span, the first member's compute waits for all of
    it and the later members' do not wait again."""
    cost = call_cost()
    steps = [GatherStep(1e-3, 2_000_000), GatherStep(5e-4, 1_000_000), GatherStep(2e-3, 3_000_000)]
    per_call = cost.call_s + 2e-5
    alone = simulate_gathers(steps, cost, distance=0, blocks=4, lead_s=3e-4)
    assert alone == pytest.approx(3e-4 + sum(per_call + s.nbytes * 0.5 / 3e9 + s.compute_s
                                             for s in steps), rel=1e-12)
    tl = gather_timeline(steps, cost, distance=0, blocks=4, lead_s=3e-4, groups=((0, 1), (2, 2)))
    assert tl.total_s == pytest.approx(alone - per_call, rel=1e-12)
    g0, g1, g2 = tl.gathers
    assert (g0.start, g0.end) == (g1.start, g1.end) and g0.issue == pytest.approx(3e-4)
    assert g0.start == pytest.approx(3e-4 + cost.call_s)  # after its issue
    assert g1.compute_start == pytest.approx(g0.compute_end)  # no second wait
    assert g2.issue == pytest.approx(g1.compute_end)
    assert held_bytes(steps, 0, ((0, 1), (2, 2))) == 1_000_000
    assert held_bytes(steps, 1, ((0, 1), (2, 2))) == 1_000_000 + 3_000_000
    assert held_bytes(steps, 0, ((0, 2),)) == 4_000_000 == held_bytes(steps, 2)
    with pytest.raises(ValueError, match="consecutive"):
        gather_timeline(steps, cost, distance=0, blocks=4, groups=((0, 0), (2, 2)))


def test_fusing_wins_where_calls_cost_more_than_the_overlap_they_give():
    """Small gathers, a price per call: one call over all of them, at distance 0 and ahead
    alike, beats one call each; its allocation is `group_blocks` of its bytes."""
    cost = call_cost()
    steps = [GatherStep(1e-5, 8_192) for _ in range(6)]
    key = _key_of(cost)
    alone = plan_gathers(steps, cost, one_call_blocks=[1] * 6, max_bytes=1 << 30)
    fused = plan_gathers(steps, cost, one_call_blocks=[1] * 6, max_bytes=1 << 30,
                         reach=[5] * 6, group_blocks=key)
    assert alone.groups == planner.each_alone(6) == alone.one_call_groups
    assert fused.one_call_groups == ((0, 5),)
    assert fused.one_call_blocks == (key(6 * 8_192),) * 6
    assert fused.one_call_s < alone.one_call_s and fused.total_s < alone.total_s
    assert fused.one_call_s == simulate_gathers(steps, cost, distance=0, blocks=list(
        fused.one_call_blocks), groups=fused.one_call_groups)
    assert len(fused.groups) < 6  # ahead too, fewer calls
    # fusion=False's: no reach, one call each (the plan of before).
    assert alone == plan_gathers(steps, cost, one_call_blocks=[1] * 6, max_bytes=1 << 30)


def test_the_memory_bound_forbids_a_fused_gather():
    """A call of several holds its later members' gathered bytes from its first member's
    use: at most max_bytes. Below one gather's bytes none is fused; between, calls as large
    as the bound allows; reach cuts them too."""
    cost = call_cost()
    steps = [GatherStep(1e-5, 8_192) for _ in range(6)]
    key = _key_of(cost)

    def plan(limit, reach=(5,) * 6):
        return plan_gathers(steps, cost, one_call_blocks=[1] * 6, max_bytes=limit,
                            reach=list(reach), group_blocks=key)
    tight = plan(8_191)
    assert tight.one_call_groups == planner.each_alone(6) and tight.distance == 0
    two = plan(8_192)
    assert two.one_call_groups == ((0, 1), (2, 3), (4, 5))
    assert held_bytes(steps, 0, two.one_call_groups) <= 8_192
    assert held_bytes(steps, two.distance, two.groups) <= 8_192
    cut = plan(1 << 30, reach=(2, 2, 2, 5, 5, 5))
    assert cut.one_call_groups == ((0, 2), (3, 5))


def test_overlap_can_beat_one_call():
    """Large gathers, each step's compute just long enough to hide one gather issued a call
    ahead (0.7 ms against 0.67): a call of two would make the first member's compute wait
    for the second's bytes, so the plan keeps one call each ahead, though it fuses them
    where each is issued at its use (there nothing overlaps, and one call saves the calls)."""
    cost = call_cost(call_s=1e-6, latency=1e-6, overlap_ratio=1.0, slowdown=1.0)
    steps = [GatherStep(7e-4, 4_000_000) for _ in range(4)]
    got = plan_gathers(steps, cost, one_call_blocks=[4] * 4, max_bytes=1 << 30,
                       reach=[3] * 4, group_blocks=_key_of(cost))
    assert got.distance >= 1 and got.groups == planner.each_alone(4)
    assert got.one_call_groups == ((0, 3),)
    assert got.total_s < got.one_call_s


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e-3), st.integers(0, 400_000)), min_size=1, max_size=6),
       st.integers(0, 1_000_000), st.floats(0, 1e-4), st.data())
def test_one_call_groups_are_the_best_grouping_within_bound_and_reach(raw, limit, call_s, data):
    """At distance 0 the grouping is the best of every grouping whose calls fit the memory
    bound and the reach (exhaustive over them), and it keeps to both."""
    steps = [GatherStep(c, b) for c, b in raw]
    m = len(steps)
    reach = [data.draw(st.integers(i, m - 1)) for i in range(m)]
    cost = call_cost(call_s=call_s)
    key = _key_of(cost)
    one = [key(s.nbytes) for s in steps]
    got = plan_gathers(steps, cost, one_call_blocks=one, max_bytes=limit, reach=reach,
                       group_blocks=key)

    def fits(groups):
        return (held_bytes(steps, 0, groups) <= limit
                and all(reach[j] >= b for a, b in groups for j in range(a, b)))

    def seconds(groups):
        blocks = [one[a] if a == b else key(sum(s.nbytes for s in steps[a:b + 1]))
                  for a, b in groups for _ in range(a, b + 1)]
        return simulate_gathers(steps, cost, distance=0, blocks=blocks, groups=groups)
    best = min(seconds(g) for g in _groupings(m) if fits(g))
    assert fits(got.one_call_groups)
    assert got.one_call_s == pytest.approx(best, rel=1e-9)
    assert got.one_call_s == pytest.approx(seconds(got.one_call_groups), rel=1e-12)
    assert held_bytes(steps, got.distance, got.groups) <= limit
    assert all(reach[j] >= b for a, b in got.groups for j in range(a, b))


def test_grouping_errors():
    cost = call_cost()
    steps = [GatherStep(1e-3, 10), GatherStep(1e-3, 10)]
    with pytest.raises(ValueError, match="reach needs group_blocks"):
        plan_gathers(steps, cost, one_call_blocks=[1, 1], max_bytes=1, reach=[1, 1])
    with pytest.raises(ValueError, match="reach must give"):
        plan_gathers(steps, cost, one_call_blocks=[1, 1], max_bytes=1, reach=[0, 0],
                     group_blocks=_key_of(cost))


# ---------------------------------------------------------------------------------------------
# FSDP: regathered_layers, compare_fsdp
# ---------------------------------------------------------------------------------------------

from libra_jax.planner import (  # noqa: E402
    FSDP_POLICIES,
    FsdpStep,
    compare_fsdp,
    regathered_layers,
)


def fsdp_cost():
    """`gather_cost` with the reduce-scatter's terms as well (half an all-reduce's bytes)."""
    cost = gather_cost()
    return CostModel(cost.latency_s, dict(cost.solo_bw), dict(cost.overlap_bw),
                     dict(cost.slowdown),
                     collectives={"all-gather": CollectiveTerms(2e-5, 0.5),
                                  "reduce-scatter": CollectiveTerms(2e-5, 0.5)})


@st.composite
def fsdp_steps(draw):
    n = draw(st.integers(1, 6))
    compute = [draw(st.floats(0, 2e-3)) for _ in range(n)]
    sizes = [draw(st.integers(0, 4_000_000)) for _ in range(n)]
    forward = tuple(GatherStep(c / 2, b) for c, b in zip(compute[::-1], sizes[::-1]))
    backward = tuple(GatherStep(c, b) for c, b in zip(compute, sizes))
    layers = tuple(Layer(c, b, "reduce-scatter") for c, b in zip(compute, sizes))
    return FsdpStep(forward, draw(st.floats(0, 1e-3)), backward, layers)


@settings(max_examples=40, deadline=None)
@given(fsdp_steps(), st.integers(0, 3), st.sampled_from([1, 4]))
def test_regathered_layers_end_where_their_compute_ends(step, distance, blocks):
    """Each layer stretched to its compute's end in the re-gathers' pass: at least its own
    compute, and the stretched pass is the gather pass, to the second."""
    cost = fsdp_cost()
    layers = regathered_layers(step, cost, distance=distance, blocks=blocks)
    tl = gather_timeline(step.backward, cost, distance=distance, blocks=blocks)
    assert [l.grad_bytes for l in layers] == [l.grad_bytes for l in step.layers]
    assert {l.collective.kind for l in layers} == {"reduce-scatter"}
    # (to the rounding of a difference of two times of the pass: 1e-15 s)
    assert all(l.compute_s >= s.compute_s * (1 - 1e-9) - 1e-15 for l, s in zip(layers, step.layers))
    assert math.isclose(sum(l.compute_s for l in layers), tl.total_s, rel_tol=1e-9)


@settings(max_examples=40, deadline=None)
@given(fsdp_steps())
def test_compare_fsdp_libra_is_never_slower_than_a_baseline(step):
    cost = fsdp_cost()
    plans = compare_fsdp(step, cost, default_alloc=4, prefuse=0)
    assert list(plans) == list(FSDP_POLICIES)
    total = {k: p.forward_s + p.backward_s for k, p in plans.items()}
    assert total["libra"] <= min(total["default"], total["fusion-only"]) * (1 + 1e-9)
    assert plans["libra"].forward_s <= plans["default"].forward_s * (1 + 1e-9)
    # The baselines: each gather one ahead at the fixed allocation, in both passes.
    for name in ("default", "fusion-only"):
        p = plans[name]
        assert p.forward.distance == p.backward.distance == 1
        assert set(p.forward.blocks) | set(p.backward.blocks) == {4}
        layers = regathered_layers(step, cost, distance=1, blocks=4)
        assert math.isclose(p.backward_s, simulate(layers, list(p.buckets), cost), rel_tol=1e-9)
    assert plans["default"].forward_s == pytest.approx(
        simulate_gathers(step.forward, cost, distance=1, blocks=4, lead_s=step.forward_lead_s))


def test_fsdp_step_needs_one_regather_per_layer():
    with pytest.raises(ValueError, match="2 backward gathers for 1 layers"):
        FsdpStep((), 0.0, (GatherStep(1e-3, 8), GatherStep(1e-3, 8)),
                 (Layer(1e-3, 8, "reduce-scatter"),))


def test_a_pending_wait_merges_buckets_that_overlap_would_split():
    # Two reduce-scatter gradients of 100 bytes, 1 s of compute each, 100 B/s, 0.1 s latency.
    # Without a wait the first overlaps the second's compute: 3.2 s against one bucket's 4.1.
    # A one-call bucket ready mid-backward holds the compute stream for the wait, at most the
    # compute left after it (`pending_at`: 1 s here): split 4.2 s, so one bucket wins; the last
    # bucket, ready when compute ends, waits for nothing.
    layers = [Layer(1.0, 100, "reduce-scatter"), Layer(1.0, 100, "reduce-scatter")]

    def cost(pending_s):
        return CostModel(latency_s=0.1, solo_bw={1: 100.0}, overlap_bw={1: 100.0}, slowdown={1: 1.0},
                         collectives={"reduce-scatter": CollectiveTerms(0.1, 1.0, pending_s)})

    split, one = [Bucket(0, 0, 1), Bucket(1, 1, 1)], [Bucket(0, 1, 1)]
    assert close(simulate(layers, split, cost(0.0)), 3.2)
    assert close(simulate(layers, split, cost(2.0)), 4.2)
    assert close(simulate(layers, one, cost(2.0)), simulate(layers, one, cost(0.0)))
    assert close(simulate(layers, one, cost(2.0)), 4.1)
    assert plan(layers, cost(0.0)).buckets == split
    assert plan(layers, cost(2.0)).buckets == one
    assert plan_exhaustive(layers, cost(2.0)).buckets == one
    # The all-reduce's wait is the cost model's own (`CostModel.pending_s`).
    reduce = [Layer(1.0, 100), Layer(1.0, 100)]
    assert plan(reduce, dataclasses.replace(cost(0.0), pending_s=2.0)).buckets == one
    assert timeline(layers, split, cost(2.0)).backward_s == simulate(layers, split, cost(2.0))
