"""The whole step priced both ways (`planner.price_step`, `OptimizeReport.step`, issue 73): the
arithmetic on a hand-built case, and the predicted optimized/plain ratio's direction."""
from __future__ import annotations

import dataclasses

import pytest
from test_explanation import mlp_step

import libra_jax
from libra_jax import collectives, model, planner, rewrite

AR = collectives.REFERENCE
MS = 1e-3


def cost(call_s: float = 0.05 * MS) -> planner.CostModel:
    """One allocation, 1 GB/s both ways, no contention, 0.1 ms latency."""
    return planner.CostModel(latency_s=0.1 * MS, solo_bw={1: 1e9}, overlap_bw={1: 1e9},
                             slowdown={1: 1.0}, call_s=call_s)


LAYERS = (planner.Layer(1 * MS, 1_000_000), planner.Layer(1 * MS, 1_000_000))
XLA = planner.XlaTerms(call_s=0.2 * MS, bytes_per_s=0.5e9)


def scope(buckets: tuple[planner.Bucket, ...], sync: tuple[bool, ...] = ()) -> planner.PlannedScope:
    return planner.PlannedScope(key=("top", ("x",)), layers=LAYERS, buckets=buckets, cost=cost(),
                                sync=sync)


def test_the_arithmetic_of_one_bucket_after_the_backward_pass():
    # One bucket of both layers, ready when compute ends (2 ms): issue 0.05 + latency 0.1 +
    # 2 MB at 1 GB/s 2 ms, nothing overlapped: 2.15 ms exposed. The loss's pmean (4 bytes)
    # costs the optimized step 0.15 ms; in plain it joins XLA's combined all-reduce.
    loss = planner.OtherCall(("top", ("x",)), 4, AR, 1.0, 0.15 * MS)
    price = planner.price_step(10 * MS, [scope((planner.Bucket(0, 1, 1),), (False,))], [loss],
                               XLA, pending_s=0.9 * MS)
    assert price.exposed_s == pytest.approx(2.15 * MS)
    assert price.pending_s == 0.0  # a start/done pair leaves nothing pending
    assert price.others_s == pytest.approx(0.15 * MS)
    assert (price.plain_calls, price.plain_operands, price.plain_bytes) == (1, 3, 2_000_004)
    assert price.plain_collectives_s == pytest.approx(3 * 0.2 * MS + 2_000_004 / 0.5e9)
    assert price.optimized_calls == 2
    assert price.plain_s == pytest.approx(10 * MS + 0.6 * MS + 4.000008 * MS)
    assert price.optimized_s == pytest.approx(10 * MS + 2.15 * MS + 0.15 * MS)
    assert price.predicted_ratio == pytest.approx(12.3 / 14.600008)
    assert price.predicted_ratio < 1  # the fresh outputs and the per-operand rendezvous go


def test_a_one_call_bucket_costs_the_pending_all_reduce():
    # Layer 0's bucket is ready with 1 ms of compute left after it: one call leaves 0.9 ms
    # pending (at most that 1 ms); layer 1's, ready when compute ends, leaves nothing pending.
    mid = (planner.Bucket(0, 0, 1), planner.Bucket(1, 1, 1))
    one_call = planner.price_step(10 * MS, [scope(mid, (True, True))], [], XLA,
                                  pending_s=0.9 * MS)
    assert one_call.pending_s == pytest.approx(0.9 * MS)
    longer = planner.price_step(10 * MS, [scope(mid, (True, True))], [], XLA, pending_s=3 * MS)
    assert longer.pending_s == pytest.approx(1 * MS)  # no more than the compute left
    unknown = planner.price_step(10 * MS, [scope(mid, (True, True))], [], XLA, pending_s=None)
    assert unknown.pending_s == 0.0
    assert one_call.optimized_s - unknown.optimized_s == pytest.approx(0.9 * MS)
    at_the_end = planner.price_step(10 * MS, [scope((planner.Bucket(0, 1, 1),), (True,))], [],
                                    XLA, pending_s=0.9 * MS)
    assert at_the_end.pending_s == 0.0


def test_a_kind_the_planner_prices_pending_is_not_counted_twice():
    # A cost model whose all-reduce carries the pending cost (`overlap="sync"`, or a kind with
    # no pair): `simulate` has it in the exposed time; the sum adds nothing.
    mid = (planner.Bucket(0, 0, 1), planner.Bucket(1, 1, 1))
    priced = planner.PlannedScope(key=("top", ("x",)), layers=LAYERS, buckets=mid,
                                  cost=dataclasses.replace(cost(), pending_s=0.9 * MS),
                                  sync=(True, True))
    price = planner.price_step(10 * MS, [priced], [], XLA, pending_s=0.9 * MS)
    assert price.pending_s == 0.0
    plain = planner.price_step(10 * MS, [scope(mid, (True, True))], [], XLA, pending_s=None)
    assert price.exposed_s == pytest.approx(plain.exposed_s + 0.9 * MS)


def test_two_buckets_overlap_the_backward_pass_and_make_two_calls():
    # The first layer's bucket runs beside the second layer's compute (1 ms at 1 GB/s: its
    # 0.15 ms of issue and latency, then 0.85 ms of its bytes), the rest after.
    split = planner.price_step(10 * MS, [scope((planner.Bucket(0, 0, 1), planner.Bucket(1, 1, 1)),
                                               (False, False))], [], XLA, None)
    fused = planner.price_step(10 * MS, [scope((planner.Bucket(0, 1, 1),), (False,))], [],
                               XLA, None)
    expected = planner.simulate(LAYERS, [planner.Bucket(0, 0, 1), planner.Bucket(1, 1, 1)], cost())
    assert split.exposed_s == pytest.approx(expected - 2 * MS)
    assert split.optimized_calls == 2 and fused.optimized_calls == 1
    assert split.plain_s == fused.plain_s  # plain is the same program either way
    assert split.exposed_s < fused.exposed_s


def test_other_kinds_are_one_xla_call_each_at_their_traffic():
    scatter = collectives.row_of("reduce-scatter")
    price = planner.price_step(0.0, [], [planner.OtherCall(None, 1_000_000, scatter, 0.5, 0.0),
                                         planner.OtherCall(None, 1_000_000, scatter, 0.5, 0.0)],
                               XLA, None)
    assert (price.plain_calls, price.plain_operands) == (2, 2)
    assert price.plain_collectives_s == pytest.approx(2 * (0.2 * MS + 0.5e6 / 0.5e9))


def test_the_ratio_is_one_where_nothing_is_planned_and_near_one_where_compute_dominates():
    assert planner.price_step(5 * MS, [], [], XLA, None).predicted_ratio == 1.0
    assert planner.price_step(0.0, [], [], XLA, None).predicted_ratio == 1.0
    assert rewrite.OptimizeReport().predicted_ratio == 1.0
    tiny = (planner.Layer(1.0, 4),)
    price = planner.price_step(2.0, [planner.PlannedScope("k", tiny, (planner.Bucket(0, 0, 1),),
                                                          cost(), (False,))], [], XLA, None)
    assert price.predicted_ratio == pytest.approx(1.0, abs=1e-3)


def test_the_terms_are_checked():
    with pytest.raises(ValueError, match="bytes_per_s"):
        planner.XlaTerms(call_s=0.0, bytes_per_s=0.0)
    with pytest.raises(ValueError, match="compute_s"):
        planner.price_step(-1.0, [], [], XLA, None)


def test_the_profile_carries_xla_terms_with_documented_defaults():
    host = model.load_profile("cpu-host").fair_share
    assert host is not None
    assert host.xla_terms() == (pytest.approx(152e-6), pytest.approx(1.22e9))
    doc = model.profile_to_dict(model.load_profile("cpu-host"))
    for key in ("xla_allreduce_call_us", "xla_allreduce_gbyte_per_s"):
        assert doc["fair_share"][key]["source"] == "measured"
        del doc["fair_share"][key]
    without = model.profile_from_dict(doc).fair_share
    assert without is not None and without.xla_call_s is None
    assert without.xla_terms() == (model.profile.XLA_CPU_ALLREDUCE_CALL_S,
                                   model.profile.XLA_CPU_ALLREDUCE_BYTES_PER_S)


@pytest.mark.usefixtures("jax_8")
def test_a_planned_step_is_priced_both_ways():
    step, args = mlp_step(hidden=256)
    e = libra_jax.explain(step, *args, file=None)
    price = e.step
    assert price is not None and price is e.report.step
    assert e.predicted_ratio == price.predicted_ratio < 1
    # Plain: XLA's combiner joins the 6 gradients and the loss into one all-reduce of 7
    # operands; optimized: libra's calls as planned, the loss's pmean with the gradients
    # (a layer of the scope: `sites.value_sites`).
    assert (price.plain_calls, price.plain_operands) == (1, 7)
    assert price.plain_bytes == sum(s.layers[i].grad_bytes for s in e.scopes
                                    for i in range(len(s.layers)))
    gradient_calls = sum(1 for p in e.report.plans if p.kind == "gradient")
    assert price.optimized_calls == gradient_calls + len(e.others)
    assert price.exposed_s == pytest.approx(sum(s.backward_s - s.compute_s for s in e.scopes))
    assert price.compute_s > sum(s.compute_s for s in e.scopes)  # forward and update too
