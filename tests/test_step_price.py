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


def test_the_stagger_of_plains_scatters_where_each_gradient_is_made():
    """A reduce-scatter scope of four layers of 1 ms at the end of a 10 ms step: plain's XLA
    issues a blocking call where each gradient is made (ready at 7, 8, 9 and 10 ms: segments of
    7, 1, 1 and 1 ms), the optimized program one call for them all at the end (one of 10 ms,
    which a step without any pays too: 0). Stagger c = 0.5 ms a root ms."""
    scatter = collectives.row_of("reduce-scatter")
    layers = tuple(planner.Layer(1 * MS, 1_000_000, scatter) for _ in range(4))
    c = 0.5 * MS / MS ** 0.5
    priced = dataclasses.replace(
        cost(), collectives={"reduce-scatter": planner.CollectiveTerms(0.1 * MS, 0.5)})
    one = planner.PlannedScope(key=("top", ("x",)), layers=layers,
                               buckets=(planner.Bucket(0, 3, 1),), cost=priced, sync=(True,))
    price = planner.price_step(10 * MS, [one], [], XLA, None, sync_stagger=c)
    roots = 7 ** 0.5 + 3 * 1.0 - 10 ** 0.5  # in root ms
    assert price.plain_stagger_s == pytest.approx(0.5 * MS * roots)
    assert price.optimized_stagger_s == 0.0
    assert price.plain_s == pytest.approx(10 * MS + price.plain_collectives_s
                                          + 0.5 * MS * roots)
    assert price.optimized_s == pytest.approx(10 * MS + price.exposed_s)
    # Two one-call buckets (after layers 1 and 3) synchronize at 8 and 10 ms: 8, 2.
    two = dataclasses.replace(one, buckets=(planner.Bucket(0, 1, 1), planner.Bucket(2, 3, 1)),
                              sync=(True, True))
    split = planner.price_step(10 * MS, [two], [], XLA, None, sync_stagger=c)
    assert split.optimized_stagger_s == pytest.approx(0.5 * MS * (8 ** 0.5 + 2 ** 0.5 - 10 ** 0.5))
    # Start/done pairs wait at the end of the backward pass: as one call there.
    pairs = dataclasses.replace(two, sync=(False, False))
    assert planner.price_step(10 * MS, [pairs], [], XLA, None,
                              sync_stagger=c).optimized_stagger_s == 0.0
    # Where the devices do not drift (c = 0) nothing is charged.
    assert planner.price_step(10 * MS, [one], [], XLA, None).plain_stagger_s == 0.0


def test_a_combined_all_reduce_synchronizes_once_where_its_last_operand_is_ready():
    """Data parallel: XLA's combiner makes the gradients one all-reduce, after the last; the
    plan's start/done pairs wait at the same point: the same stagger both ways."""
    layers = (planner.Layer(1 * MS, 1_000_000), planner.Layer(1 * MS, 0),
              planner.Layer(1 * MS, 1_000_000))
    pairs = planner.PlannedScope(key=("top", ("x",)), layers=layers,
                                 buckets=(planner.Bucket(0, 0, 1), planner.Bucket(1, 2, 1)),
                                 cost=cost(), sync=(False, False))
    plain, optimized = planner.synchronizations(10 * MS, [pairs])
    assert plain == [pytest.approx(10 * MS)] and optimized == [pytest.approx(10 * MS)] * 2
    price = planner.price_step(12 * MS, [pairs], [], XLA, None, sync_stagger=0.01)
    assert price.plain_stagger_s == pytest.approx(price.optimized_stagger_s)
    with pytest.raises(ValueError, match="sync_stagger"):
        planner.price_step(12 * MS, [pairs], [], XLA, None, sync_stagger=-1.0)


def test_the_update_after_the_backward_pass_is_a_segment_both_ways():
    """The devices meet at the gradients, then run the update that waits for them
    (`PlannedScope.after_s`): both programs pay a synchronization before it, c (sqrt(T - a) +
    sqrt(a) - sqrt(T)); with no update the meeting is the step's end (nothing to pay)."""
    layers = (planner.Layer(1 * MS, 1_000_000), planner.Layer(1 * MS, 0),
              planner.Layer(1 * MS, 1_000_000))
    pairs = planner.PlannedScope(key=("top", ("x",)), layers=layers,
                                 buckets=(planner.Bucket(0, 0, 1), planner.Bucket(1, 2, 1)),
                                 cost=cost(), sync=(False, False), after_s=4 * MS)
    plain, optimized = planner.synchronizations(12 * MS, [pairs])
    assert plain == [pytest.approx(8 * MS)] and optimized == [pytest.approx(8 * MS)] * 2
    price = planner.price_step(12 * MS, [pairs], [], XLA, None, sync_stagger=0.01)
    want = 0.01 * ((8 * MS) ** 0.5 + (4 * MS) ** 0.5 - (12 * MS) ** 0.5)
    assert price.plain_stagger_s == pytest.approx(want)
    assert price.optimized_stagger_s == pytest.approx(want)
    at_end = planner.price_step(12 * MS, [dataclasses.replace(pairs, after_s=0.0)], [], XLA, None,
                                sync_stagger=0.01)
    assert at_end.plain_stagger_s == at_end.optimized_stagger_s == 0.0
    with pytest.raises(ValueError, match="after_s"):
        dataclasses.replace(pairs, after_s=-1.0)


@pytest.mark.usefixtures("jax_8")
def test_a_steps_update_is_where_its_devices_meet_after_the_gradients():
    """The SGD update inside the shard_map waits for the gradients' psums: the scope's
    ``after_s`` is its compute, and both programs pay the same stagger of a meeting before
    it (the shipped profile's c)."""
    step, args = mlp_step(hidden=256)
    e = libra_jax.explain(step, *args, file=None)
    price = e.step
    assert price is not None
    (entry,) = e.report.predicted
    # Everything the backward stream does not hold is the update here (the step is all in its
    # shard_map, the forward in the stream's first layer).
    assert entry["after_s"] > 0
    assert entry["after_s"] == pytest.approx(price.compute_s - e.scopes[0].compute_s)
    assert price.plain_stagger_s == pytest.approx(price.optimized_stagger_s)
    assert price.plain_stagger_s > 0


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


@pytest.mark.usefixtures("jax_8")
def test_a_gspmd_update_is_priced_at_one_devices_part():
    """Outside a shard_map a program is GSPMD's, at global shapes: an update of gradients a
    shard_map hands out sharded (its out_specs), or of values a sharding constraint lays out,
    runs on each device's part; a value the program never lays out counts whole."""
    import jax
    import jax.numpy as jnp
    from conftest import mesh_of
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from libra_jax.rewrite import costs

    mesh = mesh_of((8,), ("data",))
    profile = model.load_profile("cpu-host")

    def grads(w, x):
        return jax.lax.psum_scatter(x.T @ x @ w, "data", scatter_dimension=0, tiled=True)

    def step(w, mu, x, lone):
        g = jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))(w, x)
        mu = 0.9 * mu + 0.1 * g  # reads the sharded gradient: sharded as it is
        laid = jax.lax.with_sharding_constraint(lone * 2.0, NamedSharding(mesh, P("data")))
        return w - 1e-3 * mu, laid + 1.0, lone * 3.0  # the last: never laid out, whole

    w, mu = jnp.ones((256, 64)), jnp.ones((256, 64))
    closed = jax.make_jaxpr(step)(w, mu, jnp.ones((64, 256)), jnp.ones((256, 64)))
    eqns = closed.jaxpr.eqns
    parts = costs.device_parts(eqns)
    by_name: dict[str, list[int]] = {}
    for e in eqns:
        by_name.setdefault(e.primitive.name, []).append(parts.get(e.outvars[0], 1))
    assert by_name["shard_map"] == [8]
    assert by_name["sharding_constraint"] == [8]
    # 0.1*g, 0.9*mu (added to it), 1e-3*mu, w - that, lone*2 (the constraint's operand) and
    # laid + 1.0: sharded; lone*3: whole (no laid-out value reaches it).
    assert sorted(by_name["mul"]) == [1, 8, 8, 8, 8]
    assert by_name["add"] == [8, 8] and by_name["sub"] == [8]
    whole = sum(costs.roofline_s(e, profile) for e in eqns)
    shard_map = sum(costs.roofline_s(e, profile) for e in eqns if e.primitive.name == "shard_map")
    split = sum(costs.roofline_s(e, profile) / parts.get(e.outvars[0], 1) for e in eqns
                if e.primitive.name != "shard_map")
    assert costs.step_roofline_s(eqns, profile) == pytest.approx(shard_map + split)
    assert costs.step_roofline_s(eqns, profile) < whole


@pytest.mark.usefixtures("jax_8")
def test_the_fsdp_routes_update_is_priced_per_device():
    """The GSPMD route's step (`libra_jax.value_and_grad` with in_specs, an optimizer outside
    the shard_map): its compute is the shard_maps' plus the update at a device's part."""
    import jax
    import jax.numpy as jnp
    from conftest import mesh_of
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from libra_jax.rewrite import costs

    mesh = mesh_of((8,), ("data",))
    params = {"w1": jnp.ones((64, 128)), "w2": jnp.ones((128, 64))}
    specs = {"w1": P(None, "data"), "w2": P("data")}

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2

    def step(p, x):
        loss, g = libra_jax.value_and_grad(loss_fn, in_specs=(specs, P("data")))(p, x)
        new = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
        return jax.lax.with_sharding_constraint(
            new, {k: NamedSharding(mesh, s) for k, s in specs.items()}), loss

    put = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("data")))
    e = libra_jax.explain(step, put, x, file=None)
    price = e.step
    assert price is not None
    eqns = jax.make_jaxpr(step)(put, x).jaxpr.eqns
    parts = costs.device_parts(eqns)
    updates = [q for q in eqns if q.primitive.name == "sub"]
    assert len(updates) == 2 and all(parts.get(q.outvars[0]) == 8 for q in updates)
    profile = e.report.predicted[0]["profile"]
    assert price.compute_s == pytest.approx(costs.step_roofline_s(eqns, profile))
    update_s = sum(costs.roofline_s(q, profile) for q in eqns if q.primitive.name != "shard_map")
    assert price.compute_s == pytest.approx(
        sum(costs.roofline_s(q, profile) for q in eqns if q.primitive.name == "shard_map")
        + update_s / 8, rel=1e-3)  # the loss's scalar arithmetic is whole on each device
