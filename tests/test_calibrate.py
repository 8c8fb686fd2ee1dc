"""`libra-jax calibrate`: a tiny calibration yields a profile that `optimize` loads by default,
bad profiles are rejected with a clear message, and the fits recover known parameters."""
from __future__ import annotations

import json
import warnings
from collections.abc import Callable

import numpy as np
import pytest

from libra_jax import calibrate, cli, model
from libra_jax.calibrate.measure import CALL_REPEATS

pytest.importorskip("scipy")


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory, jax_8):
    path = tmp_path_factory.mktemp("profiles") / "cpu.json"
    with warnings.catch_warnings():  # a tiny budget fails the quality gate: said, written anyway
        warnings.simplefilter("ignore")
        out, doc = calibrate.calibrate(calibrate.TINY, devices=8, progress=False, out=path)
    assert out == path
    return path, doc


def test_tiny_calibration_writes_a_valid_profile(tiny_profile) -> None:
    path, doc = tiny_profile
    profile = model.load_profile(path)
    assert profile.name == "cpu-calibrated" and profile.form == "fair-share"
    assert profile.sources["fair_share.per_block_gbyte_per_s"].source == "measured"
    assert profile.sources["fair_share.compute_threads"].source == "measured"
    assert profile.fair_share.cores == calibrate.host_cores()
    # The engine takes a bucket's members as they are: nothing is copied, fusion packs nothing.
    assert profile.fair_share.fusion_copy_bytes_per_s == float("inf")
    assert model.derive(profile, 8).cost.pack_s_per_byte == 0.0
    # Fitted to the calls train steps: the call cost, and the efficiency of workers beside
    # running compute where the model has any (compute threads that leave cores idle).
    assert profile.sources["fair_share.call_us"].source == "measured"
    fair = profile.fair_share
    waiting = model.fair_share_oversubscribed(fair.compute_threads, fair.cores)
    assert profile.sources["fair_share.overlap_block_efficiency"].source == (
        "assumption" if waiting else "measured")
    assert doc["calibration"]["analysis"]["calls"]["fit"]["efficiency_fitted"] is not waiting
    assert profile.fair_share.call_s >= 0 and 0 < profile.fair_share.overlap_block_efficiency <= 1
    # The latency is the engine's own (the alone fit's intercept), not a call in a step.
    assert profile.network.base_latency_s == pytest.approx(
        doc["calibration"]["analysis"]["alone"]["fit"]["params"]["latency_s"])
    # What calibration does not measure comes from the shipped profile, marked so.
    shipped = model.load_profile("cpu-host").fair_share
    assert profile.fair_share.reduce_scatter_traffic == shipped.reduce_scatter_traffic
    assert profile.fair_share.all_gather_traffic == shipped.all_gather_traffic
    # XLA's own all-reduce (the plain step the step price compares with): measured here, as
    # the probe measures it, neither the shipped numbers nor the defaults.
    for field in ("xla_allreduce_call_us", "xla_allreduce_gbyte_per_s"):
        q = profile.sources[f"fair_share.{field}"]
        assert q.source == "measured" and "xla_rates" in q.ref, field
    assert profile.fair_share.xla_call_s >= 0 and profile.fair_share.xla_bytes_per_s > 0
    # So is the devices' stagger at a synchronization (the step price's), not carried over.
    q = profile.sources["fair_share.sync_stagger_us_per_root_ms"]
    assert q.source == "measured" and "sync_stagger" in q.ref
    assert profile.fair_share.sync_stagger is not None and profile.fair_share.sync_stagger >= 0
    q = profile.sources["fair_share.reduce_scatter_traffic"]
    assert q.source == "assumption" and q.ref.startswith("not calibrated; from the shipped")
    assert profile.sources["device.memory_gbyte_per_s"].source == "measured"
    cal = json.loads(path.read_text())["calibration"]
    for key in ("machine", "backend", "jax_version", "date", "samples", "analysis"):
        assert key in cal, key
    assert {s["fused"] for s in cal["samples"]["calls"]} == {True, False}
    # fused or not, big or small tensors, CALL_REPEATS pairs per repetition
    assert len(cal["samples"]["calls"]) == 4 * CALL_REPEATS * calibrate.TINY.reps
    assert {s["small"] for s in cal["samples"]["calls"]} == {True, False}
    # The plans optimize made of the calls train steps: one call per gradient, or one for all.
    plans = cal["analysis"]["calls"]["plans"]
    for shape, tensors in (("big", calibrate.TINY.calls_tensors), ("small", calibrate.TINY.calls_small_tensors)):
        assert len(plans[f"per-tensor, {shape}"]["buckets"]) == tensors
        assert plans[f"fused, {shape}"]["buckets"] == [[0, tensors - 1, 2]]
    fit = cal["analysis"]["calls"]["fit"]
    assert set(fit["diff_s"]) == {"big", "small"} and np.isfinite(fit["rms_error_s"])
    assert cal["backend"] == "cpu" and cal["workers"] == 8
    assert len(cal["samples"]["alone"]) == (len(calibrate.TINY.sizes) * len(calibrate.TINY.blocks)
                                            * calibrate.TINY.reps)
    fit = cal["analysis"]["alone"]["fit"]
    assert np.isfinite(fit["rms_rel_error"])
    assert set(fit["ci95"]) == set(fit["params"]) - {"softmin_p"}  # p is fixed, not fitted
    assert fit["params"]["softmin_p"] == calibrate.fit.SOFTMIN_P
    assert np.isfinite(cal["analysis"]["alone"]["free_softmin_p_fit"]["rms_rel_error"])
    q = cal["quality"]
    assert q["passed"] == (not q["failures"]) and q["limits"] == calibrate.GATE_LIMITS
    assert set(q["conditions"]) == {"before", "after", "steal_fraction", "reference_drift"}
    assert q["conditions"]["before"]["reference_s"] > 0
    derivation = model.derive(profile, 8)
    assert set(derivation.cost.slowdown) <= set(calibrate.TINY.blocks)
    assert all(s >= 1 for s in derivation.cost.slowdown.values())
    assert "devices 8" in calibrate.summary(doc)


def test_optimize_uses_the_calibrated_profile_by_default(tiny_profile, monkeypatch, tmp_path, jax_8) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import libra_jax
    from conftest import mesh_of

    path, _ = tiny_profile
    monkeypatch.setenv(model.PROFILE_DIR_ENV, str(path.parent))
    assert model.calibrated_profile_path("cpu") == path
    assert model.default_profile("cpu") == str(path)
    mesh = mesh_of((8,), ("d",))

    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        return jax.lax.psum(g, "d")

    fn = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(), check_vma=False)
    opt = libra_jax.optimize(fn)
    w, x = jnp.ones((16, 16)), jnp.ones((64, 16))
    np.testing.assert_array_equal(np.asarray(opt(w, x)), np.asarray(jax.jit(fn)(w, x)))
    assert opt.last_report.predicted[0]["profile"].name == "cpu-calibrated"
    # Without a calibrated profile: the shipped one.
    monkeypatch.setenv(model.PROFILE_DIR_ENV, str(tmp_path / "empty"))
    assert model.default_profile("cpu") == "cpu-host"


def _write(tmp_path, doc) -> str:
    (tmp_path / "cpu.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(tmp_path / "cpu.json")


def test_outdated_or_malformed_profiles_are_rejected(tiny_profile, tmp_path, monkeypatch) -> None:
    _, doc = tiny_profile
    monkeypatch.setenv(model.PROFILE_DIR_ENV, str(tmp_path))
    old = dict(doc, schema_version=0)
    with pytest.raises(ValueError, match=r"'schema_version' must be 3, got 0 \(an outdated profile: re-run "
                                         r"`libra-jax calibrate`"):
        model.load_profile(_write(tmp_path, old))
    with pytest.raises(ValueError, match=r"got 7 \(written by a newer libra_jax"):
        model.profile_from_dict(dict(doc, schema_version=7))
    with pytest.raises(ValueError, match=r"field 'calibration' must be an object"):
        model.profile_from_dict(dict(doc, calibration=[1, 2]))
    broken = json.loads(json.dumps(doc))
    del broken["fair_share"]["per_block_gbyte_per_s"]
    with pytest.raises(ValueError, match=r"'fair_share\.per_block_gbyte_per_s' is missing"):
        model.load_profile(_write(tmp_path, broken))
    # The default lookup skips a bad calibrated profile with a warning that says why.
    for bad, why in ((old, "outdated profile"), ("{not json", "not valid JSON"), (broken, "is missing")):
        _write(tmp_path, bad)
        model.read._warned_profiles.clear()
        with pytest.warns(RuntimeWarning, match=why):
            assert model.default_profile("cpu") == "cpu-host"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per file
            assert model.default_profile("cpu") == "cpu-host"


def test_refuses_without_two_devices(jax_8, capsys) -> None:
    with pytest.raises(calibrate.CalibrationError, match="at least 2 devices.*found 1"):
        calibrate.measure(calibrate.TINY, devices=1, progress=False)
    assert cli.main(["calibrate", "--devices", "1"]) == 2
    assert "--devices must be >= 2" in capsys.readouterr().err


def test_cli_has_calibrate() -> None:
    args = cli.build_parser().parse_args(["calibrate", "--quick", "--out", "x.json"])
    assert args.quick and args.out == "x.json" and args.func is cli._run_calibrate


def test_profile_dir_env_and_xdg(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(model.PROFILE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert model.calibrated_profile_path("cuda") == tmp_path / "libra_jax" / "profiles" / "cuda.json"
    monkeypatch.setenv(model.PROFILE_DIR_ENV, str(tmp_path / "mine"))
    assert model.calibrated_profile_path("cpu") == tmp_path / "mine" / "cpu.json"


# --- Fits on synthetic samples ------------------------------------------------------------------


def test_fit_alone_recovers_known_parameters() -> None:
    rng = np.random.default_rng(1)
    sizes = np.array([64, 256, 1024, 4096, 16384]) * 1024.0
    blocks = np.array([1, 2, 4, 8])
    b, k = (a.ravel() for a in np.meshgrid(sizes, blocks))
    true = dict(beta=2e9, link=6e9, p=4.0, lat=30e-6)
    t = calibrate.alone_time_s(b, k, 8, true["beta"], true["link"], true["p"], true["lat"])
    fit = calibrate.fit_alone(b, k, t * np.exp(rng.normal(0, 0.01, t.size)), 8)
    assert fit.params["beta_bytes_per_s"] == pytest.approx(true["beta"], rel=0.05)
    assert fit.params["link_bytes_per_s"] == pytest.approx(true["link"], rel=0.05)
    assert fit.params["latency_s"] == pytest.approx(true["lat"], rel=0.15)
    assert fit.rms_rel_error < 0.02
    # Overlapped: eta with the solo parameters fixed.
    ov = calibrate.alone_time_s(b, k, 8, true["beta"], true["link"], true["p"], true["lat"], eta=0.3)
    eta = calibrate.fit_overlap(b, k, ov, 8, fit).params["eta"]
    assert eta == pytest.approx(0.3, rel=0.05)


def test_fit_slowdown_recovers_units_and_memory_traffic() -> None:
    k = np.array([1, 2, 3, 4, 6, 8])
    units = calibrate.fit_slowdown_units(k, 24 / (24 - 2 * k))
    assert (units.params["compute_units"], units.params["units_per_block"]) in ((24, 2), (12, 1), (36, 3),
                                                                               (48, 4), (60, 5), (72, 6),
                                                                               (84, 7), (96, 8))
    assert units.rms_rel_error < 1e-9
    bus = 1e9 * k
    s = 40e9 / (40e9 - 3.0 * bus)
    mem = calibrate.fit_memory_traffic(k, s, bus, 40e9)
    assert mem.params["memory_bytes_per_bus_byte"] == pytest.approx(3.0, rel=1e-3)


def test_slowdown_from_windows() -> None:
    rng = np.random.default_rng(2)
    d = rng.uniform(0.01, 0.05, 50)  # seconds of all-reduce inside the window
    extra = d * (1 - 1 / 1.5) + rng.normal(0, 1e-4, 50)
    assert calibrate.slowdown_from_windows(extra, d) == pytest.approx(1.5, rel=0.02)
    assert calibrate.slowdown_from_windows([], []) == 1.0
    assert calibrate.slowdown_from_windows([-1.0], [1.0]) == 1.0


def test_median_ci() -> None:
    med, lo, hi = calibrate.median_ci([1.0, 2.0, 3.0, 4.0, 100.0])
    assert med == 3.0 and lo <= med <= hi


@pytest.mark.parametrize("D, P", [(8.0, 2.0), (12.0, 2.0), (3.0, 4.0), (40.0, 16.0)])
def test_fit_fair_share_recovers_compute_threads(D, P) -> None:
    rng = np.random.default_rng(int(D * 10 + P))
    k = np.array([1, 2, 3, 4, 6, 8] * 2)  # two workloads, one curve
    s = model_slowdowns(k, D, P) * np.exp(rng.normal(0, 0.02, k.size))
    s[3] *= 5.0  # one disturbed window (another job) must not move the fit much
    fit = calibrate.fit_fair_share(k, s, P)
    assert fit.params["compute_threads"] == pytest.approx(D, rel=0.1)
    assert fit.params["cores"] == P


def model_slowdowns(k, D, P):
    from libra_jax import model

    return np.array([model.fair_share_slowdown(int(b), compute_threads=D, cores=P) for b in k])


def test_fit_alone_with_a_core_cap_recovers_the_per_worker_rate() -> None:
    # Alone, k workers get min(k, P) cores; beside compute, a fraction: those times pin beta.
    sizes = np.array([256, 1024, 4096]) * 1024.0
    cores = np.array([0.2, 0.5, 1.0, 2.0, 2.0, 2.0])
    b, c = (a.ravel() for a in np.meshgrid(sizes, cores))
    t = calibrate.alone_time_s(b, c, 8, 1.5e9, 2.5e9, 4.0, 40e-6)
    fit = calibrate.fit_alone(b, c, t, 8)
    assert fit.params["beta_bytes_per_s"] == pytest.approx(1.5e9, rel=0.03)
    assert fit.params["link_bytes_per_s"] == pytest.approx(2.5e9, rel=0.05)
    # cores= caps the block count itself: 8 workers alone run on 2 cores, like 2 workers
    k = np.array([1, 2, 4, 8] * 3)
    sz = np.repeat(sizes, 4)
    t2 = calibrate.alone_time_s(sz, np.minimum(k, 2), 8, 1.5e9, 2.5e9, 4.0, 40e-6)
    capped = calibrate.fit_alone(sz, k, t2, 8, cores=2.0)
    assert capped.rms_rel_error < 1e-3
    assert calibrate.fit_alone(sz, k, t2, 8).rms_rel_error > 10 * capped.rms_rel_error


def _calls_predictor(doc: dict) -> Callable[[str, float, float], float]:
    """The model's difference, under profile document `doc` with the two call terms given, of
    calibration's two calls plans: one call per gradient minus one call for all, for 8
    gradients of 2 MiB ("big") and 64 of 16 KiB ("small")."""
    from libra_jax import planner
    big = [planner.Layer(2e-3, 2 << 20) for _ in range(8)]
    small = [planner.Layer(5e-5, 16 << 10) for _ in range(64)]
    arms = {shape: ([planner.Bucket(i, i, 2) for i in range(len(layers))],
                    [planner.Bucket(0, len(layers) - 1, 2)], layers)
            for shape, layers in (("big", big), ("small", small))}

    def predict(shape: str, call_s: float, efficiency: float) -> float:
        d = dict(doc, fair_share=dict(doc["fair_share"]))
        d["fair_share"]["call_us"] = {"value": call_s * 1e6, "source": "assumption"}
        d["fair_share"]["overlap_block_efficiency"] = {"value": efficiency, "source": "assumption"}
        cost = model.derive(model.profile_from_dict(d), 8).cost
        per_call, one, layers = arms[shape]
        return planner.simulate(layers, per_call, cost) - planner.simulate(layers, one, cost)
    return predict


def test_call_terms_recover_what_the_model_was_told() -> None:
    """`fit_call_terms` finds the per-call cost and the overlapped workers' efficiency that
    make the model's prediction of two plans the measured difference: differences made by the
    model itself at known terms (plus noise) give those terms back, and the steps as measured
    on the 2-core VM (the MLP's one call per gradient slower than one for all, where the model
    without the terms predicts it faster) need an efficiency below 1."""
    base = model.load_profile("cpu-host")
    doc = model.profile_to_dict(base)
    doc["fair_share"]["cores"]["value"] = 10  # idle cores: workers beside running compute
    predict = _calls_predictor(doc)

    rng = np.random.default_rng(0)
    true = (60e-6, 0.45)
    diffs = {shape: predict(shape, *true) + rng.normal(0, 2e-5, 9) for shape in ("big", "small")}
    out = calibrate.fit_call_terms(diffs, predict, n_boot=10)
    assert out["call_s"][0] == pytest.approx(true[0], abs=10e-6)
    assert out["efficiency"][0] == pytest.approx(true[1], abs=0.05)
    assert out["call_s"][1] <= out["call_s"][0] <= out["call_s"][2]
    assert out["efficiency"][1] <= out["efficiency"][0] <= out["efficiency"][2]
    # Measured on the 2-core VM (calibrate's calls steps, 8 devices): one call per gradient of
    # 8 MiB in 8 gradients 0.9-1.6 ms slower than one for all, which the model without the
    # terms predicts 1.0 ms faster.
    measured = {"big": np.full(9, 1.2e-3), "small": np.full(9, predict("small", 0.0, 1.0))}
    assert predict("big", 0.0, 1.0) < 0
    assert calibrate.fit_call_terms(measured, predict, n_boot=4)["efficiency"][0] < 0.9
    with pytest.raises(calibrate.CalibrationError, match="no paired calls"):
        calibrate.fit_call_terms({"big": np.array([])}, predict)


def test_call_terms_where_the_compute_threads_fill_the_cores_fit_the_call_cost_alone() -> None:
    """Where the compute threads fill the cores (the shipped profile's 9.36 on 2), the model
    prices no worker beside running compute: the steps do not depend on the efficiency, which
    is kept as given, and the call cost alone is fitted (least squares over both shapes)."""
    doc = model.profile_to_dict(model.load_profile("cpu-host"))
    fair = model.profile_from_dict(doc).fair_share
    assert model.fair_share_oversubscribed(fair.compute_threads, fair.cores)
    predict = _calls_predictor(doc)

    assert predict("big", 50e-6, 0.3) == predict("big", 50e-6, 1.0)
    rng = np.random.default_rng(0)
    diffs = {shape: predict(shape, 80e-6, 1.0) + rng.normal(0, 2e-5, 9) for shape in ("big", "small")}
    out = calibrate.fit_call_terms(diffs, predict, n_boot=10, efficiency=0.36)
    assert out["call_s"][0] == pytest.approx(80e-6, abs=10e-6)
    assert out["efficiency"] == [0.36, 0.36, 0.36] and out["efficiency_fitted"] is False


def _good_analysis(doc: dict) -> dict:
    """The tiny run's analysis, with the numbers of a good full run on a quiet 2-core VM."""
    import copy
    a = copy.deepcopy(doc["calibration"]["analysis"])
    fit = a["alone"]["fit"]
    fit["rms_rel_error"] = 0.21
    fit["ci95"] = {"beta_bytes_per_s": [13e9, 27e9], "link_bytes_per_s": [5.0e9, 6.1e9],
                   "latency_s": [20e-6, 60e-6]}
    share = a["slowdown"]["fair_share_fit"]
    share["params"]["compute_threads"] = 10.3
    share["ci95"] = {"compute_threads": [7.7, 12.4]}
    return a


QUIET = {"steal_fraction": 0.0, "reference_drift": 0.03, "before": {"others_runnable": 0.0},
         "after": {"others_runnable": 0.0}}


@pytest.mark.parametrize("change, named", [
    (lambda a, c: None, None),
    (lambda a, c: a["slowdown"]["fair_share_fit"]["params"].update(compute_threads=0.8),
     "compute threads 0.8 for 8 devices"),
    (lambda a, c: a["slowdown"]["fair_share_fit"]["params"].update(compute_threads=40.1),
     "compute threads 40.1 for 8 devices"),
    (lambda a, c: a["alone"]["fit"]["ci95"].update(link_bytes_per_s=[0.85e9, 5501e9]),
     "link_bytes_per_s 95% interval"),
    (lambda a, c: a["alone"]["fit"]["ci95"].update(link_bytes_per_s=[0.30e9, float("inf")]),
     "link_bytes_per_s 95% interval"),
    (lambda a, c: a["alone"]["fit"].update(rms_rel_error=0.58), "fit error rms 58% > 35%"),
    (lambda a, c: c.update(steal_fraction=0.12), "12.0% of the host's CPU time was stolen"),
    (lambda a, c: c.update(reference_drift=0.4), "reference computation ran 40% apart"),
    (lambda a, c: c.update(before={"others_runnable": 2.0}), "2 other threads were runnable"),
])
def test_the_quality_gate_refuses_the_bad_runs_seen(tiny_profile, change, named) -> None:
    """The gate's limits (`build.GATE_LIMITS`) against the bad runs of the issue: D = 0.8 and
    40 on 8 devices, L intervals of 0.85-5501 GB/s and 0.30-inf, a 58% fit error, and a host
    that others were using (steal time, the reference computation's drift). A good run passes."""
    _, doc = tiny_profile
    analysis, conditions = _good_analysis(doc), dict(QUIET)
    change(analysis, conditions)
    failures = calibrate.quality(analysis, 8, conditions)
    if named is None:
        assert failures == []
    else:
        assert len(failures) == 1 and named in failures[0], failures


def test_a_failing_or_quick_calibration_is_not_installed(jax_8, monkeypatch, tmp_path) -> None:
    """Only a full calibration that passes the gate becomes the default profile; a failing one
    is written as cpu.rejected.json and a smoke test (quick) as cpu.quick.json, each with a
    warning saying why, unless install=True for the smoke test."""
    monkeypatch.setenv("LIBRA_JAX_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "quality", lambda *a: ["all-reduce fit error rms 58% > 35%"])
    with pytest.warns(UserWarning, match="not installed as the default profile.*58%"):
        path, _ = calibrate.calibrate(calibrate.TINY, devices=8, progress=False)
    assert path == tmp_path / "cpu.rejected.json" and not (tmp_path / "cpu.json").exists()
    monkeypatch.setattr(calibrate, "quality", lambda *a: [])
    with pytest.warns(UserWarning, match="a quick calibration is a smoke test"):
        path, _ = calibrate.calibrate(calibrate.TINY, devices=8, progress=False)
    assert path == tmp_path / "cpu.quick.json" and not (tmp_path / "cpu.json").exists()
    path, doc = calibrate.calibrate(calibrate.TINY, devices=8, progress=False, install=True)
    assert path == tmp_path / "cpu.json" and doc["calibration"]["quality"]["passed"]
    assert model.default_profile("cpu") == str(path) or model.load_profile(path)


def test_host_conditions_are_measured() -> None:
    c = calibrate.Conditions()
    c.start()
    got = c.finish()
    assert got["before"]["reference_s"] > 0 and got["after"]["reference_s"] > 0
    assert got["steal_fraction"] is None or 0.0 <= got["steal_fraction"] <= 1.0
    assert got["reference_drift"] >= 0
    assert got["before"]["others_runnable"] is None or got["before"]["others_runnable"] >= 0

