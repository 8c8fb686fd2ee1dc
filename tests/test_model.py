"""Tests of libra_jax.model: profiles, validation, the two functional forms, monotonicity."""
from __future__ import annotations

import copy
import json
import math

import pytest

from libra_jax import model, planner
from libra_jax.collectives import BY_KIND
from libra_jax.model import BYTES_PER_S_PER_MIB_PER_MS, S_PER_US

PROFILES = model.list_profiles()
TESTBED_OPTIONS = [64, 128, 256, 512, 1024, 2048, 4096]


def raw(name: str) -> dict:
    return json.loads((model.PROFILE_DIR / f"{name}.json").read_text())


def test_shipped_profiles() -> None:
    assert set(PROFILES) == {"libra-testbed", "v100", "a100", "h100", "h200", "cpu-host"}


@pytest.mark.parametrize("name", PROFILES)
def test_profile_valid_cost_model_for_2_to_1024_workers(name: str) -> None:
    profile = model.load_profile(name)
    assert profile.name == name
    previous = None
    for workers in range(2, 1025):
        d = model.derive(profile, workers)
        cost = d.cost
        assert isinstance(cost, planner.CostModel)
        keys = list(cost.slowdown)
        assert keys and list(cost.solo_bw) == keys == list(cost.overlap_bw)
        assert all(isinstance(k, int) and k > 0 for k in keys)
        assert cost.latency_s > 0
        for k in keys:
            assert 0 < cost.overlap_bw[k] <= cost.solo_bw[k] < math.inf
            assert 1.0 <= cost.slowdown[k] < math.inf
        assert not set(d.dropped) & set(keys)
        if previous is not None:  # more workers: no less latency, no more bandwidth, same options
            # (more latency where a step has one: a calibrated CPU profile folds it into the base)
            per_node = profile.network.devices_per_node
            grows = (profile.network.intra_step_latency_s > 0
                     or math.ceil(workers / per_node) > math.ceil((workers - 1) / per_node))
            assert cost.latency_s > previous.latency_s if grows else cost.latency_s == previous.latency_s
            assert list(previous.slowdown) == keys
            for k in keys:
                assert cost.solo_bw[k] <= previous.solo_bw[k]
                assert cost.overlap_bw[k] <= previous.overlap_bw[k]
                assert cost.slowdown[k] == pytest.approx(previous.slowdown[k]) or d.form == "nccl-style"
        previous = cost


@pytest.mark.parametrize("name", PROFILES)
def test_every_number_has_a_source(name: str) -> None:
    profile = model.load_profile(name)
    assert profile.sources
    assert all(q.source in model.SOURCES for q in profile.sources.values())
    # every leaf quantity of the file was read (none silently ignored)
    def count(node: object) -> int:
        if isinstance(node, dict):
            return 1 if "value" in node else sum(count(v) for v in node.values())
        return 0
    assert count(raw(name)) == len(profile.sources)


def test_sources_are_labelled_as_expected() -> None:
    testbed = model.load_profile("libra-testbed")
    assert testbed.sources["libra_fit.overlap_bw.a_mib_per_ms"].source == "measured"
    assert testbed.sources["libra_fit.slowdown.intercept"].source == "measured"
    h200 = model.load_profile("h200")
    assert h200.sources["device.compute_units"].source == "datasheet"
    assert h200.sources["device.memory_gbyte_per_s"].source == "datasheet"
    assert h200.sources["nccl_style.per_block_gbyte_per_s"].source == "assumption"
    assert h200.device.compute_units == 132
    assert h200.device.memory_bytes_per_s == pytest.approx(4.8e12)
    cpu = model.load_profile("cpu-host").sources
    # Its latency and the price of a call in a step are measured as calibration measures them
    # (one definition), the collectives' traffic by benchmarks/sharded_cpu.py; the rest are
    # assumptions (the fusion copy: none, the engine copies nothing). XLA's all-reduce (the
    # plain step's, `planner.StepPrice`) is measured by benchmarks/allreduce_cpu.py, the
    # devices' stagger at a synchronization by the probe's `sync_stagger`.
    measured = ("network.base_latency_us", "fair_share.reduce_scatter_traffic",
                "fair_share.all_gather_traffic", "fair_share.call_us",
                "fair_share.overlap_block_efficiency", "fair_share.xla_allreduce_call_us",
                "fair_share.xla_allreduce_gbyte_per_s", "fair_share.sync_stagger_us_per_root_ms")
    assert all(cpu[k].source == "measured" for k in measured)
    assert all(q.source == "assumption" for k, q in cpu.items() if k not in measured)


def test_load_by_path(tmp_path) -> None:
    path = tmp_path / "mine.json"
    data = raw("h100")
    data["name"] = "mine"
    path.write_text(json.dumps(data))
    assert model.load_profile(path).name == "mine"
    assert model.load_profile(str(path)).name == "mine"


# ------------------------------------------------------------------------------------------
# The artifact's fits
# ------------------------------------------------------------------------------------------


def fit_bw(t: float, a: float, b: float, c: float) -> float:
    return b - a * math.exp(-c * t**0.6)


OVERLAP = (8.2216991, 6.53459963, 0.0290902)
SOLO = (10.01228313, 7.10248977, 0.05409201)


def fit_slowdown(t: float) -> float:
    return 1.0 / (0.876321235 - 1.60589190e-4 * t)


def test_testbed_matches_artifact_fits_at_two_workers() -> None:
    d = model.derive("libra-testbed", 2)
    assert d.key_unit == "total_threads"
    assert list(d.cost.slowdown) == TESTBED_OPTIONS
    assert d.dropped == {}
    assert d.cost.latency_s == pytest.approx(2 * 5 * S_PER_US)
    for t in TESTBED_OPTIONS:
        assert d.cost.solo_bw[t] == pytest.approx(fit_bw(t, *SOLO) * BYTES_PER_S_PER_MIB_PER_MS)
        assert d.cost.overlap_bw[t] == pytest.approx(fit_bw(t, *OVERLAP) * BYTES_PER_S_PER_MIB_PER_MS)
        assert d.cost.slowdown[t] == pytest.approx(fit_slowdown(t))
    # the research notes' table: 6.05 MiB/ms overlapped and 1.83x at 2048 threads
    assert d.cost.overlap_bw[2048] / BYTES_PER_S_PER_MIB_PER_MS == pytest.approx(6.05, abs=0.01)
    assert d.cost.slowdown[2048] == pytest.approx(1.83, abs=0.01)


@pytest.mark.parametrize("workers", [2, 8, 128])
def test_ring_scaling(workers: int) -> None:
    two = model.derive("libra-testbed", 2).cost
    n = model.derive("libra-testbed", workers).cost
    factor = workers / (2 * (workers - 1))
    for t in TESTBED_OPTIONS:
        assert n.solo_bw[t] == pytest.approx(two.solo_bw[t] * factor)
    assert n.latency_s == pytest.approx((2 * workers - 2) * 5 * S_PER_US)
    assert model.ring_bytes_per_rank(1000, workers) == pytest.approx(1000 * 2 * (workers - 1) / workers)
    assert model.ring_steps(workers, BY_KIND["all-reduce"]) == 2 * workers - 2


def test_faster_network_rule_and_dropped_options() -> None:
    base = model.derive("libra-testbed", 8)
    fast = model.derive("libra-testbed", 8, link_gbit_per_s=100)
    assert list(fast.cost.slowdown) == [128, 256, 512, 1024, 2048, 4096]
    assert list(fast.dropped) == [8192]
    assert "pole" in fast.dropped[8192] and "5457" in fast.dropped[8192]
    for t in TESTBED_OPTIONS[:-1]:
        # bandwidth fits evaluated at T/k and multiplied by k ...
        assert fast.cost.solo_bw[2 * t] == pytest.approx(2 * base.cost.solo_bw[t])
        assert fast.cost.overlap_bw[2 * t] == pytest.approx(2 * base.cost.overlap_bw[t])
        # ... the slowdown at T itself
        assert fast.cost.slowdown[2 * t] == pytest.approx(fit_slowdown(2 * t))
    faster = model.derive("libra-testbed", 8, link_gbit_per_s=200)
    assert list(faster.dropped) == [8192, 16384]
    odd = model.derive("libra-testbed", 8, link_gbit_per_s=75)
    assert list(odd.cost.slowdown) == [96, 192, 384, 768, 1536, 3072]


def test_profile_notes_say_options_are_dropped() -> None:
    assert any("5457" in note and "dropped" in note for note in model.load_profile("libra-testbed").notes)


def test_launch_shape() -> None:
    d = model.derive("libra-testbed", 8)
    assert d.launch_shape(64) == (1, 64)
    assert d.launch_shape(512) == (1, 512)
    assert d.launch_shape(4096) == (8, 512)
    h = model.derive("h200", 8)
    assert h.key_unit == "blocks"
    assert h.launch_shape(16) == (16, 512)
    with pytest.raises(ValueError, match="not an option"):
        h.launch_shape(3)


# ------------------------------------------------------------------------------------------
# The NCCL-style form
# ------------------------------------------------------------------------------------------


def test_softmin() -> None:
    assert model.softmin(3.0, 3.0, 4) == pytest.approx(3.0 * 2 ** -0.25)
    assert model.softmin(1.0, 100.0, 4) < 1.0
    assert model.softmin(1.0, 100.0, 64) == pytest.approx(1.0, rel=1e-6)
    assert model.softmin(1e300, 1e300, 8) == pytest.approx(1e300 * 2 ** -0.125)
    with pytest.raises(ValueError):
        model.softmin(0.0, 1.0, 4)


def test_nccl_style_values() -> None:
    p = model.load_profile("h200")
    d = model.derive(p, 8)  # one node: the NVLink is the ring's link
    c = p.nccl_style
    assert d.link_bytes_per_s == pytest.approx(450e9)
    algo = 8 / 14
    for k in d.cost.slowdown:
        bus = model.softmin(k * c.per_block_bytes_per_s, 450e9, c.softmin_p)
        bus_o = model.softmin(k * c.per_block_bytes_per_s * c.overlap_block_efficiency, 450e9, c.softmin_p)
        assert d.cost.solo_bw[k] == pytest.approx(bus * algo)
        assert d.cost.overlap_bw[k] == pytest.approx(bus_o * algo)
        sm = (1 - c.memory_bound_fraction) * 132 / (132 - k)
        mem = c.memory_bound_fraction * 4.8e12 / (4.8e12 - c.memory_bytes_per_bus_byte * bus_o)
        assert d.cost.slowdown[k] == pytest.approx(sm + mem)
    # across nodes the NIC (400 Gb/s = 50 GB/s) is the bottleneck
    assert model.derive(p, 16).link_bytes_per_s == pytest.approx(50e9)
    # latency: NCCL-style base + per-step hops; 2 nodes -> 2 inter-node steps
    net = p.network
    assert model.derive(p, 16).cost.latency_s == pytest.approx(
        net.base_latency_s + 28 * net.intra_step_latency_s + 2 * net.inter_step_latency_s)


def _small_gpu() -> dict:
    data = raw("v100")
    data["device"]["compute_units"]["value"] = 8
    data["nccl_style"]["units_per_block"]["value"] = 1
    return data


def test_nccl_style_drops_options_that_take_every_sm() -> None:
    data = _small_gpu()
    data["nccl_style"]["block_options"]["value"] = [1, 2, 8, 16]
    d = model.derive(model.profile_from_dict(data), 4)
    assert list(d.cost.slowdown) == [1, 2]
    assert "occupy all 8 SMs" in d.dropped[8] and 16 in d.dropped


def test_nccl_style_drops_options_that_take_all_memory_bandwidth() -> None:
    data = raw("h200")
    data["device"]["memory_gbyte_per_s"]["value"] = 500
    d = model.derive(model.profile_from_dict(data), 8)
    assert any("memory traffic" in why for why in d.dropped.values())
    assert 1 in d.cost.slowdown


def test_no_valid_option_is_an_error() -> None:
    data = _small_gpu()
    data["nccl_style"]["block_options"]["value"] = [8, 9]
    with pytest.raises(ValueError, match="no valid allocation"):
        model.derive(model.profile_from_dict(data), 4)


def test_libra_fit_slowdown_below_one_is_raised_and_noted() -> None:
    data = raw("libra-testbed")
    data["libra_fit"]["slowdown"]["intercept"]["value"] = 1.2  # 1/(1.2 - c*T) < 1 at small T
    d = model.derive(model.profile_from_dict(data), 4)
    assert d.cost.slowdown[64] == 1.0
    assert any("raised to 1" in note for note in d.notes)


# ------------------------------------------------------------------------------------------
# Monotonicity
# ------------------------------------------------------------------------------------------


def best_allreduce_s(cost: planner.CostModel, nbytes: float) -> float:
    return min(cost.latency_s + nbytes / bw for bw in cost.solo_bw.values())


@pytest.mark.parametrize("name", PROFILES)
def test_more_workers_more_time(name: str) -> None:
    times = [best_allreduce_s(model.cost_model(name, w), 64 << 20) for w in (2, 4, 8, 16, 64, 256, 1024)]
    assert times == sorted(times) and len(set(times)) == len(times)


@pytest.mark.parametrize("name", PROFILES)
def test_more_bandwidth_less_time(name: str) -> None:
    links = (10, 25, 50, 100, 200, 400, 800)
    costs = [model.cost_model(name, 8, link_gbit_per_s=g) for g in links]
    times = [best_allreduce_s(c, 64 << 20) for c in costs]
    assert times == sorted(times, reverse=True) and len(set(times)) == len(times)
    if model.load_profile(name).form == "nccl-style":  # per allocation, too
        for slow, fast in zip(costs, costs[1:]):
            for k in slow.solo_bw:
                assert fast.solo_bw[k] >= slow.solo_bw[k]
                assert fast.overlap_bw[k] >= slow.overlap_bw[k]


@pytest.mark.parametrize("name", ["libra-testbed", "h200"])
def test_planned_backward_time_is_monotone(name: str) -> None:
    layers = [planner.Layer(2e-3 * (1 + i % 3), (4 + 3 * (i % 4)) << 20) for i in range(10)]

    def best(workers: int, link: float) -> float:
        return planner.plan(layers, model.cost_model(name, workers, link_gbit_per_s=link)).backward_s

    by_workers = [best(w, 50) for w in (2, 4, 8, 32, 128)]
    assert by_workers == sorted(by_workers)
    by_link = [best(8, g) for g in (25, 50, 100, 200)]
    assert by_link == sorted(by_link, reverse=True)


# ------------------------------------------------------------------------------------------
# Validation: errors name the field
# ------------------------------------------------------------------------------------------


def mutate(name: str, path: str, value: object = None, *, delete: bool = False) -> dict:
    data = copy.deepcopy(raw(name))
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    if delete:
        del node[last]
    else:
        node[last] = value
    return data


def test_pending_allreduce_cost_is_optional() -> None:
    """`optimize(overlap="auto")` reads it; a profile without it (calibrated before it
    existed, or written by hand) still loads, and says it is not known."""
    host = model.load_profile("cpu-host")
    assert host.fair_share.pending_allreduce_s == pytest.approx(
        raw("cpu-host")["fair_share"]["pending_allreduce_us"]["value"] * 1e-6)
    without = model.profile_from_dict(mutate("cpu-host", "fair_share.pending_allreduce_us",
                                             delete=True))
    assert without.fair_share.pending_allreduce_s is None


@pytest.mark.parametrize("workers", [2, 8, 16, 128])
def test_collective_terms_of_a_ring(workers: int) -> None:
    """A ring reduce-scatter or all-gather: half the all-reduce's bus bytes and steps; the
    steps that cross nodes are the collective's steps over the nodes."""
    profile = model.load_profile("h200")
    net = profile.network
    cost = model.derive(profile, workers).cost
    nodes = math.ceil(workers / net.devices_per_node)
    for collective in (BY_KIND["reduce-scatter"], BY_KIND["all-gather"]):
        terms = cost.terms(collective)
        assert terms.traffic == 0.5
        assert model.ring_steps(workers, collective) == workers - 1
        inter = nodes - 1
        assert terms.latency_s == pytest.approx(
            net.base_latency_s + (workers - 1 - inter) * net.intra_step_latency_s
            + inter * net.inter_step_latency_s)
        assert terms.latency_s < cost.latency_s
    assert cost.terms(BY_KIND["all-reduce"]) == planner.CollectiveTerms(cost.latency_s, 1.0)


def test_collective_terms_of_the_cpu_engine() -> None:
    """The CPU engine is no ring: the profile's measured ratios (benchmarks/sharded_cpu.py),
    else the ratio of the memory each collective moves, (n+1)/(2n)."""
    host = raw("cpu-host")["fair_share"]
    cost = model.derive("cpu-host", 8).cost
    assert cost.terms(BY_KIND["reduce-scatter"]).traffic == host["reduce_scatter_traffic"]["value"]
    assert cost.terms(BY_KIND["all-gather"]).traffic == host["all_gather_traffic"]["value"]
    assert host["reduce_scatter_traffic"]["source"] == "measured"
    doc = mutate("cpu-host", "fair_share.reduce_scatter_traffic", delete=True)
    derived = model.derive(model.profile_from_dict(doc), 8).cost
    assert derived.terms(BY_KIND["reduce-scatter"]).traffic == 9 / 16
    assert derived.terms(BY_KIND["all-gather"]).traffic == host["all_gather_traffic"]["value"]
    value, how = model.collective_traffic(model.profile_from_dict(doc),
                                         BY_KIND["reduce-scatter"], 4)
    assert (value, how) == (5 / 8, "the engine's memory traffic (not measured)")


@pytest.mark.parametrize("name, path, value, delete, message", [
    ("cpu-host", "fair_share.reduce_scatter_traffic.value", 0, False,
     r"'fair_share\.reduce_scatter_traffic\.value' must be > 0"),
    ("h200", "device.compute_units", None, True, r"field 'device\.compute_units' is missing"),
    ("h200", "network", None, True, r"field 'network' is missing"),
    ("h200", "nccl_style.softmin_p.value", None, True, r"field 'nccl_style\.softmin_p\.value' is missing"),
    ("h200", "nccl_style.softmin_p.source", None, True, r"field 'nccl_style\.softmin_p\.source' is missing"),
    ("h200", "device.compute_units.value", 13.5, False, r"'device\.compute_units\.value' must be an integer"),
    ("h200", "device.memory_gbyte_per_s.value", -1, False, r"'device\.memory_gbyte_per_s\.value' must be > 0"),
    ("h200", "device.memory_gbyte_per_s.value", "fast", False, r"'device\.memory_gbyte_per_s\.value' must be a finite number"),
    ("h200", "device.compute_efficiency.value", 1.5, False, r"'device\.compute_efficiency\.value' must be <= 1"),
    ("h200", "network.nic_gbit_per_s.source", "vendor", False, r"'network\.nic_gbit_per_s\.source' must be one of datasheet, measured, assumption"),
    ("h200", "network.nic_gbit_per_s", 400, False, r"'network\.nic_gbit_per_s' must be an object"),
    ("h200", "nccl_style.block_options.value", [4, 2], False, r"'nccl_style\.block_options\.value' must be strictly increasing"),
    ("h200", "nccl_style.block_options.value", [], False, r"'nccl_style\.block_options\.value' must be a non-empty list"),
    ("h200", "device.sm_count", {"value": 1, "source": "datasheet"}, False, r"'device\.sm_count' is not a known field"),
    ("h200", "device.default_dtype", "int4", False, r"'device\.default_dtype' must be one of"),
    ("h200", "form", "magic", False, r"'form' must be one of libra-fit, nccl-style"),
    ("h200", "schema_version", 4, False, r"'schema_version' must be 3, got 4"),
    ("h200", "schema_version", 1, False, r"'schema_version' must be 3, got 1 \(an outdated profile.*changed since: "
                                         r"2: the 'fair-share' form"),
    ("h200", "nccl_style.fusion_copy_gbyte_per_s", None, True, r"'nccl_style\.fusion_copy_gbyte_per_s' is missing"),
    ("cpu-host", "fair_share.compute_threads", None, True, r"'fair_share\.compute_threads' is missing"),
    ("cpu-host", "fair_share.cores.value", 0, False, r"'fair_share\.cores\.value' must be > 0"),
    ("cpu-host", "fair_share.pending_allreduce_us.value", -1, False,
     r"'fair_share\.pending_allreduce_us\.value' must be >= 0"),
    ("cpu-host", "fair_share", None, True, r"field 'fair_share' is missing"),
    ("h200", "schema_version", None, True, r"'schema_version' is missing"),
    ("h200", "nccl_style", None, True, r"field 'nccl_style' is missing"),
    ("libra-testbed", "libra_fit.solo_bw.c", None, True, r"'libra_fit\.solo_bw\.c' is missing"),
    ("libra-testbed", "libra_fit.slowdown.intercept.value", 0, False, r"'libra_fit\.slowdown\.intercept\.value' must be > 0"),
    ("libra-testbed", "libra_fit.thread_options.value", [64, "128"], False, r"'libra_fit\.thread_options\.value' must be a non-empty list of positive integers"),
    ("libra-testbed", "libra_fit", None, True, r"field 'libra_fit' is missing"),
])
def test_malformed_profile_names_the_field(name: str, path: str, value: object, delete: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model.profile_from_dict(mutate(name, path, value, delete=delete), origin="test")


def test_malformed_file_errors(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        model.load_profile(bad)
    with pytest.raises(ValueError, match="does not exist"):
        model.load_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown profile 'b200'"):
        model.load_profile("b200")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(mutate("a100", "device.compute_units", delete=True)))
    with pytest.raises(ValueError, match=r"broken\.json.*'device\.compute_units' is missing"):
        model.load_profile(broken)
    with pytest.raises(ValueError, match="must be a JSON object"):
        model.profile_from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("workers", [1, 0, -3, 2.5, True, "8"])
def test_bad_worker_counts(workers: object) -> None:
    with pytest.raises(ValueError, match="workers must be an integer >= 2"):
        model.derive("h100", workers)  # type: ignore[arg-type]


@pytest.mark.parametrize("link", [0, -1, math.inf, math.nan])
def test_bad_link(link: float) -> None:
    with pytest.raises(ValueError, match="link_gbit_per_s"):
        model.derive("h100", 8, link_gbit_per_s=link)


def test_device_rates() -> None:
    dev = model.load_profile("h100").device
    assert dev.flop_per_s("bf16") == pytest.approx(989.4e12 * dev.compute_efficiency)
    assert dev.flop_per_s() == dev.flop_per_s("bf16")
    with pytest.raises(ValueError, match="no peak rate for dtype 'int4'"):
        dev.flop_per_s("int4")


# ------------------------------------------------------------------------------------------
# The fair-share form (CPU hosts) and the price of fusion (schema 2)
# ------------------------------------------------------------------------------------------


def test_fair_share_formulas() -> None:
    # Compute alone fills the cores (D >= P): k workers slow it by (D + k) / D.
    assert model.fair_share_slowdown(8, compute_threads=8, cores=2) == pytest.approx(2.0)
    assert model.fair_share_slowdown(1, compute_threads=8, cores=2) == pytest.approx(9 / 8)
    # Idle cores absorb workers first: no slowdown until D + k > P.
    assert model.fair_share_slowdown(2, compute_threads=2, cores=4) == 1.0
    assert model.fair_share_slowdown(4, compute_threads=2, cores=4) == pytest.approx(1.5)
    assert model.fair_share_core_share(10, 2) == pytest.approx(0.2)
    assert model.fair_share_core_share(1, 2) == 1.0
    with pytest.raises(ValueError):
        model.fair_share_core_share(0, 2)


def test_fair_share_cost_model() -> None:
    data = raw("cpu-host")
    fs = data["fair_share"]
    fs["cores"]["value"], fs["compute_threads"]["value"] = 2, 8
    fs["per_block_gbyte_per_s"]["value"], fs["softmin_p"]["value"] = 1.0, 64
    data["network"]["intra_node_gbyte_per_s"]["value"] = 100.0  # the cap does not bind
    fs["block_options"]["value"] = [1, 2, 4, 8]
    fs["overlap_block_efficiency"]["value"], fs["call_us"]["value"] = 0.5, 40
    d = model.derive(model.profile_from_dict(data), 8)
    algo = model.ring_algo_factor(8)
    for k in (1, 2, 4, 8):
        # alone: min(k, P) cores. 8 compute threads fill the 2 cores: the devices take turns
        # and a bucket's reduction runs while the others wait, at its solo rate, slowing no
        # compute
        assert d.cost.solo_bw[k] == pytest.approx(min(k, 2) * 1e9 * algo, rel=1e-3)
        assert d.cost.overlap_bw[k] == d.cost.solo_bw[k]
        assert d.cost.slowdown[k] == 1.0
    assert any("while the other devices wait" in note for note in d.notes)
    # Compute threads that leave cores idle run side by side: beside compute, k of the D + k
    # runnable threads' share of P cores, at the efficiency a worker keeps beside compute.
    fs["cores"]["value"], fs["compute_threads"]["value"] = 16, 12
    d = model.derive(model.profile_from_dict(data), 8)
    for k in (1, 2, 4, 8):
        assert d.cost.solo_bw[k] == pytest.approx(k * 1e9 * algo, rel=1e-3)
        assert d.cost.overlap_bw[k] == pytest.approx(
            0.5 * k * min(1, 16 / (12 + k)) * 1e9 * algo, rel=1e-3)
        assert d.cost.slowdown[k] == pytest.approx(max(1.0, (12 + k) / 16))
    assert not any("while the other devices wait" in note for note in d.notes)
    fs["cores"]["value"], fs["compute_threads"]["value"] = 2, 8
    assert d.key_unit == "blocks" and d.form == "fair-share"
    assert d.cost.call_s == pytest.approx(40e-6)
    fs["overlap_block_efficiency"]["value"] = 1.5
    with pytest.raises(ValueError, match=r"fair_share\.overlap_block_efficiency\.value' must be <= 1"):
        model.profile_from_dict(data)


def test_fair_share_oversubscribed() -> None:
    # 8 devices' 9.36 compute threads fill 2 cores; 1.5 or 2 on 2 do not.
    assert model.fair_share_oversubscribed(9.36, 2)
    assert not model.fair_share_oversubscribed(1.5, 2)
    assert not model.fair_share_oversubscribed(2, 2)
    with pytest.raises(ValueError, match="positive threads and cores"):
        model.fair_share_oversubscribed(0, 2)


def test_an_oversubscribed_hosts_reductions_run_at_their_solo_rate() -> None:
    # The shipped CPU profile (8 devices on 2 cores): a bucket's reduction runs while the
    # other devices wait at their calls (benchmarks/results/call_timeline.md), so a block
    # count matters through its solo rate alone. Before, it was priced beside all 9.36
    # compute threads: 1.1-1.9x slower compute and a fifth of the solo rate.
    cost = model.derive(model.load_profile("cpu-host"), 8).cost
    for k in cost.keys:
        assert cost.overlap_bw[k] == cost.solo_bw[k] and cost.slowdown[k] == 1.0
    assert cost.solo_bw[1] < cost.solo_bw[2]  # one worker is slower than two on two cores
    # A bucket ready mid-backward is hidden whatever its block count; the last one is not.
    layers = [planner.Layer(5e-3, 4 << 20), planner.Layer(5e-3, 4 << 20)]
    hidden = planner.simulate(layers, [planner.Bucket(0, 0, 1), planner.Bucket(1, 1, 8)], cost)
    exposed = planner.simulate(layers, [planner.Bucket(0, 1, 1)], cost)
    assert hidden == pytest.approx(10e-3 + 2 * cost.call_s + cost.latency_s
                                   + (4 << 20) / cost.solo_bw[8])
    assert exposed == pytest.approx(10e-3 + cost.call_s + cost.latency_s + (8 << 20) / cost.solo_bw[1])


def test_fusion_is_priced_by_form() -> None:
    host = model.load_profile("cpu-host")
    # The CPU engine takes a bucket's members as they are: nothing to pack (a null copy rate).
    assert raw("cpu-host")["fair_share"]["fusion_copy_gbyte_per_s"]["value"] is None
    assert host.fair_share.fusion_copy_bytes_per_s == math.inf
    assert model.derive(host, 8).cost.pack_s_per_byte == 0.0
    assert model.derive(host, 8).cost.call_s == pytest.approx(host.fair_share.call_s)
    assert host.fair_share.call_s > 0
    assert model.derive("h200", 8).cost.call_s == 0.0  # a GPU call's stand-in: its latency
    assert model.derive("libra-testbed", 8).cost.call_s == 0.0
    h200 = model.load_profile("h200")
    assert model.derive(h200, 8).cost.pack_s_per_byte == pytest.approx(
        1 / h200.nccl_style.fusion_copy_bytes_per_s)
    assert model.derive("libra-testbed", 8).cost.pack_s_per_byte == 0.0  # the paper's model
    assert host.sources["fair_share.fusion_copy_gbyte_per_s"].source in model.SOURCES


@pytest.mark.parametrize("name", model.list_profiles())
def test_profile_to_dict_round_trips(name):
    """profile_to_dict gives a document profile_from_dict reads back as the same profile (what
    optimize publishes to other processes)."""
    profile = model.load_profile(name)
    document = json.loads(json.dumps(model.profile_to_dict(profile)))
    assert model.profile_from_dict(document, origin=profile.origin) == profile


# --- A profile is a value --------------------------------------------------------------------

def test_profiles_are_values_equal_by_content_not_origin(tmp_path) -> None:
    import dataclasses

    a, b = model.load_profile("cpu-host"), model.load_profile("cpu-host")
    assert a is not b and a == b and hash(a) == hash(b)
    # The same document elsewhere (a copy; process 0's broadcast) is the same profile.
    copy_path = tmp_path / "copy.json"
    copy_path.write_text(json.dumps(model.profile_to_dict(a)))
    c = model.load_profile(copy_path)
    assert c.origin != a.origin and c == a and hash(c) == hash(a)
    assert model.profile_from_dict(model.profile_to_dict(a), origin="<broadcast>") == a
    assert dataclasses.replace(a, origin="") == a
    # Any other field, its provenance included, makes another profile.
    assert a != model.load_profile("h100")
    assert dataclasses.replace(a, name="other") != a
    fair = dataclasses.replace(a.fair_share, cores=a.fair_share.cores + 1)
    assert dataclasses.replace(a, fair_share=fair) != a
    doc = model.profile_to_dict(a)
    cores = doc["fair_share"]["cores"]
    cores["source"] = "measured" if cores["source"] != "measured" else "assumption"
    assert model.profile_from_dict(doc) != a
    # Hashable: a profile keys a cache as its name does (dropins.default_blocks).
    assert {a: 1}[c] == 1 and len({a, b, c}) == 1
    assert a != "cpu-host"


def test_profile_numbers_beyond_a_float_name_their_field(tmp_path) -> None:
    # JSON integers are unbounded: 10**400 was an OverflowError, not a ValueError.
    doc = model.profile_to_dict(model.load_profile("cpu-host"))
    doc["network"]["base_latency_us"]["value"] = 10 ** 400
    with pytest.raises(ValueError, match=r"field 'network.base_latency_us.value' must be a finite "
                                         r"number, got 1000.*characters\)"):
        model.profile_from_dict(doc)
    doc = model.profile_to_dict(model.load_profile("cpu-host"))
    doc["fair_share"]["block_options"]["value"] = [1, 10 ** 400]
    with pytest.raises(ValueError, match="field 'fair_share.block_options.value'"):
        model.profile_from_dict(doc)
    path = tmp_path / "huge.json"
    doc = model.profile_to_dict(model.load_profile("cpu-host"))
    doc["device"]["compute_units"]["value"] = 10 ** 400
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="field 'device.compute_units.value'"):
        model.load_profile(path)


def test_a_profile_file_that_is_not_utf8_or_is_a_directory_names_the_file(tmp_path) -> None:
    bad = tmp_path / "latin1.json"
    bad.write_bytes('{"name": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"profile '.*latin1.json' is not UTF-8 text"):
        model.load_profile(bad)
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ValueError, match=r"profile '.*dir.json' is a directory"):
        model.load_profile(tmp_path / "dir.json")


# --- Property: any broken field is a ValueError naming it ----------------------------------

def _leaf_paths(doc, prefix=""):
    """Dotted paths of every quantity's value and every text field of a profile document."""
    out = []
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and "value" in value and "source" in value:
            out.append(path)
        elif isinstance(value, dict):
            out.extend(_leaf_paths(value, path + "."))
    return out


def _set(doc, path, mutate):
    *parents, leaf = path.split(".")
    node = doc
    for p in parents:
        node = node[p]
    if mutate == "remove":
        del node[leaf]
    else:
        node[leaf]["value"] = mutate


def test_every_broken_field_of_every_shipped_profile_is_a_value_error_naming_it() -> None:
    # Exhaustive over (shipped profile, quantity, breakage): ~1,250 documents in about a second.
    breaks = ["remove", None, "text", -1.0, -(10 ** 400), 10 ** 400, math.nan, math.inf, [], {},
              True]
    errors = 0
    for name in model.list_profiles():
        original = model.profile_to_dict(model.load_profile(name))
        for path in _leaf_paths(original):
            for broken in breaks:
                doc = copy.deepcopy(original)
                _set(doc, path, broken)
                try:
                    model.profile_from_dict(doc, origin="<mutated>")
                except ValueError as exc:
                    # A removed entry may be reported through a field that refers to it (the
                    # default dtype's peak rate): then that field is named.
                    named = f"field '{path}" if broken != "remove" else "field '"
                    assert named in str(exc), (name, path, broken, exc)
                    errors += 1
                except Exception as exc:  # noqa: BLE001 - the property: nothing else
                    raise AssertionError(f"{name}: {path} = {broken!r}: "
                                         f"{type(exc).__name__}: {exc}") from exc
                # else: a value some fields accept (a negative exponent, 0 where >= 0)
    assert errors > 1000


@pytest.mark.parametrize("name, cap, kept", [
    ("h100", 8, [1, 2, 4, 8]),              # blocks
    ("libra-testbed", 2, [64, 128, 256, 512, 1024]),  # total threads: blocks = T // 512
])
def test_derive_drops_options_above_a_block_cap(name, cap, kept) -> None:
    """`max_blocks`: the options that would launch more blocks than the data path may take
    (the loaded NCCL's CTA limit, `libra_jax.rewrite.block_cap`) are dropped, with the reason."""
    full = model.derive(name, 8)
    capped = model.derive(name, 8, max_blocks=cap, max_blocks_why="NCCL 2.24.0 says so")
    assert sorted(capped.cost.slowdown) == kept
    assert set(full.cost.slowdown) - set(kept) == set(capped.dropped) - set(full.dropped)
    for key in set(capped.dropped) - set(full.dropped):
        assert f"above the {cap} the all-reduce may take (NCCL 2.24.0 says so)" in \
            capped.dropped[key]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_blocks must be a positive integer"):
            model.derive(name, 8, max_blocks=bad)


def test_a_calls_block_count_is_chosen_by_the_derivation():
    """Every call's `blocks` comes from `Derivation` (launch_blocks and the helpers on it):
    the planner's keys converted once, within the engine's pool."""
    from libra_jax import _ffi

    assert model.MAX_LAUNCH_BLOCKS == _ffi.MAX_BLOCKS
    d = model.derive("h100", 8)
    keys = sorted(d.cost.slowdown)
    assert [d.launch_blocks(k) for k in keys] == [
        min(model.MAX_LAUNCH_BLOCKS, max(1, d.launch_shape(k)[0])) for k in keys]
    for k in keys:
        assert d.key_for_blocks(d.launch_shape(k)[0]) == min(
            j for j in keys if d.launch_shape(j)[0] == d.launch_shape(k)[0])
    scatter = BY_KIND["reduce-scatter"]
    key = d.no_overlap_key(64 << 20, scatter)
    assert key in keys and d.no_overlap_blocks(64 << 20, scatter) == d.launch_blocks(key)
