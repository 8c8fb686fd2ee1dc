"""The machine probe (libra_jax.model.probe, measured by libra_jax.calibrate.probe): the shipped
CPU profile rescaled to this machine, cached per machine key, refused when corrupt or of another
key, written atomically, kept in memory where it cannot be written, off under the switch, and
named by `explain`. The probe is faked (its rates fixed) except where its measurement is tested;
no test asserts a time."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import warnings

import jax.numpy as jnp
import pytest
from conftest import _jax, mesh_of
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import config, model
from libra_jax.model import probe, read

jax = _jax()  # 8 host devices, before any JAX operation

SHIPPED = model.load_profile("cpu-host")
SHIPPED_RATES = probe.sustained(SHIPPED)
#: XLA's all-reduce as the fake probe measures it: 100 us an operand, 1 GB/s, and the devices'
#: stagger 300 us per root ms (the shipped profile's are 152 us, 1.22 GB/s and 494).
FAKE_XLA = probe.XlaRates(100e-6, 1e9, 300e-6 / 1e-3 ** 0.5)


class FakeMeasurer:
    """`probe.MEASURER`'s interface with fixed rates, counting its measurements."""

    def __init__(self, compute: float = 1.25, memory: float = 0.8, off: str = "") -> None:
        self.rates = probe.Rates(SHIPPED_RATES.flop_per_s * compute,
                                 SHIPPED_RATES.memory_bytes_per_s * memory, FAKE_XLA)
        self.off, self.calls = off, 0

    def context(self) -> tuple[int, str, str]:
        return len(jax.devices("cpu")), jax.__version__, self.off

    def measure(self) -> probe.Rates:
        self.calls += 1
        return self.rates


@pytest.fixture
def probing(tmp_path, monkeypatch):
    """The probe on (the suite turns it off), a fresh profile folder and in-process state, and
    a fake measurer (returned)."""
    monkeypatch.setenv(config.PROFILE_PROBE_ENV, "1")
    monkeypatch.setenv(config.PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setattr(read, "PROBED", {})
    monkeypatch.setattr(probe, "_outcomes", {})
    monkeypatch.setattr(probe, "_said", set())
    monkeypatch.setattr(probe, "_failed_keys", set())
    monkeypatch.setattr(probe, "_adopted", {})
    fake = FakeMeasurer()
    monkeypatch.setattr(probe, "_measurer", lambda: fake)
    monkeypatch.setattr(probe, "load_average", lambda: 0.0)  # a quiet machine, whatever runs
    return fake


def _no_warnings():
    return warnings.catch_warnings(action="error")


def test_the_switch_gives_the_shipped_profile_exactly(probing, monkeypatch):
    probed = model.resolve_profile(None, "cpu")
    assert probed != SHIPPED and probing.calls == 1
    assert probed.device.flop_per_s() == pytest.approx(probing.rates.flop_per_s)
    for off in ("0", "off", " OFF "):
        monkeypatch.setenv(config.PROFILE_PROBE_ENV, off)
        assert model.default_profile("cpu") == "cpu-host"
        assert model.resolve_profile(None, "cpu") == SHIPPED
    assert probing.calls == 1
    monkeypatch.setenv(config.PROFILE_PROBE_ENV, "maybe")
    with pytest.raises(ValueError, match=config.PROFILE_PROBE_ENV):
        model.default_profile("cpu")


def test_the_rescaled_profile_scales_rates_and_keeps_latencies(probing):
    probed = model.resolve_profile(None, "cpu")
    compute, memory = probing.rates.ratios(SHIPPED_RATES)
    assert probed.device.memory_bytes_per_s == pytest.approx(SHIPPED.device.memory_bytes_per_s * memory)
    for dtype, peak in SHIPPED.device.peak_dense_flop_per_s.items():
        assert probed.device.peak_dense_flop_per_s[dtype] == pytest.approx(peak * compute)
    assert probed.fair_share.per_block_bytes_per_s == pytest.approx(
        SHIPPED.fair_share.per_block_bytes_per_s * memory)
    assert probed.network.intra_node_bytes_per_s == pytest.approx(
        SHIPPED.network.intra_node_bytes_per_s * memory)
    for kept in ("base_latency_s", "inter_node_bytes_per_s", "inter_step_latency_s"):
        assert getattr(probed.network, kept) == getattr(SHIPPED.network, kept)
    # XLA's all-reduce (the plain step's) is the probe's measurement, not a rescale.
    assert probed.fair_share.xla_terms() == pytest.approx((FAKE_XLA.call_s, FAKE_XLA.bytes_per_s))
    assert probed.sources["fair_share.xla_allreduce_call_us"].source == "measured"
    # So is the devices' stagger at a synchronization (the step price's, `planner.stagger_s`).
    assert probed.fair_share.sync_stagger == pytest.approx(FAKE_XLA.sync_stagger)
    assert probed.sources["fair_share.sync_stagger_us_per_root_ms"].value == pytest.approx(300)
    assert SHIPPED.fair_share.sync_stagger != probed.fair_share.sync_stagger
    for kept in ("call_s", "overlap_block_efficiency", "pending_allreduce_s",
                 "fusion_copy_bytes_per_s"):
        assert getattr(probed.fair_share, kept) == getattr(SHIPPED.fair_share, kept)
    # The counts are this machine's: its cores and devices, the shipped threads a device.
    assert probed.fair_share.cores == probe.host_cores()
    assert probed.network.devices_per_node == len(jax.devices("cpu"))
    assert probed.fair_share.compute_threads == pytest.approx(
        SHIPPED.fair_share.compute_threads / SHIPPED.network.devices_per_node
        * len(jax.devices("cpu")))
    # Every user of the CPU default gets it: the lowering's default and derive.
    assert model.derive(model.default_profile("cpu"), 8).cost != model.derive(SHIPPED, 8).cost
    assert model.load_profile(model.default_profile("cpu")) == probed


def test_the_probed_profile_has_this_machines_counts(probing, monkeypatch):
    """On a machine of 16 cores (where the shipped profile's 2 are), the probe's profile has
    them, and the shipped compute threads a device times this machine's devices: 8 devices'
    9.36 threads no longer fill the cores, so a reduction is priced beside running compute
    (its workers at their fair share, compute slowed), not at its solo rate while the devices
    wait, as on the 2-core host the shipped profile was fitted on; `explain` says the core
    count is far from the profile's."""
    monkeypatch.setattr(probe, "host_cores", lambda: 16)
    probed = model.resolve_profile(None, "cpu")
    fair = probed.fair_share
    assert fair.cores == 16 and probed.network.devices_per_node == 8
    assert fair.compute_threads == pytest.approx(SHIPPED.fair_share.compute_threads)
    assert probed.sources["fair_share.cores"].source == "measured"
    assert not model.fair_share_oversubscribed(fair.compute_threads, fair.cores)
    cost = model.derive(probed, 8).cost
    assert all(cost.slowdown[k] > 1 for k in cost.keys if k + fair.compute_threads > 16)
    assert all(cost.overlap_bw[k] < cost.solo_bw[k] for k in cost.keys)
    shipped = model.derive(SHIPPED, 8).cost  # 2 cores: the devices wait
    assert all(shipped.slowdown[k] == 1 for k in shipped.keys)
    assert any("16 cores, the profile's 2" in line for line in probe.describe(probed))


def test_a_probe_without_xla_terms_scales_xla_bytes_by_memory(probing, monkeypatch):
    """A measurer that does not time XLA (`Rates.xla` None): XLA's bytes rate moves with the
    memory rate and its call cost stays as shipped; the cache keeps the difference."""
    probing.rates = probe.Rates(probing.rates.flop_per_s, probing.rates.memory_bytes_per_s)
    probed = model.resolve_profile(None, "cpu")
    memory = probing.rates.ratios(SHIPPED_RATES)[1]
    assert probed.fair_share.xla_terms() == pytest.approx(
        (SHIPPED.fair_share.xla_terms()[0], SHIPPED.fair_share.xla_terms()[1] * memory))
    record = json.loads(probe.cache_path("cpu").read_text())["calibration"]["probe"]
    assert "xla_call_s" not in record
    monkeypatch.setattr(read, "PROBED", {})  # a new process: the file, not the memory
    with _no_warnings():
        assert model.resolve_profile(None, "cpu") == probed
    assert probing.calls == 1


def test_a_calibrated_profile_wins_over_the_probe(probing):
    path = model.calibrated_profile_path("cpu")
    probe.store(path, read.profile_to_dict(SHIPPED))
    assert model.default_profile("cpu") == str(path) and probing.calls == 0


def test_the_cache_is_used_and_a_changed_key_refits(probing, monkeypatch):
    first = model.resolve_profile(None, "cpu")
    assert probing.calls == 1 and probe.cache_path("cpu").is_file()
    monkeypatch.setattr(read, "PROBED", {})  # a new process: the file, not the memory
    with _no_warnings():
        assert model.resolve_profile(None, "cpu") == first
    assert probing.calls == 1
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    probing.rates = probe.Rates(probing.rates.flop_per_s * 2, probing.rates.memory_bytes_per_s,
                                FAKE_XLA)
    with pytest.warns(RuntimeWarning, match=r"another key \(xla_flags differ\).*probe-cache-refused"):
        second = model.resolve_profile(None, "cpu")
    assert probing.calls == 2 and second != first
    record = json.loads(probe.cache_path("cpu").read_text())["calibration"]["probe"]
    assert "--xla_cpu_enable_fast_math=false" in record["key"]["xla_flags"]


@pytest.mark.parametrize("damage", ["truncated", "edited", "not-json", "xla-call", "stagger"])
def test_a_corrupt_file_is_refused_with_a_notice_and_refit(probing, monkeypatch, damage):
    good = model.resolve_profile(None, "cpu")
    path = probe.cache_path("cpu")
    text = path.read_text()
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "edited":  # whole JSON, its key right, a rate changed by hand
        doc = json.loads(text)
        doc["fair_share"]["call_us"]["value"] = 1.0
        path.write_text(json.dumps(doc))
    elif damage == "xla-call":  # the record's XLA call cost made negative, key and profile kept
        doc = json.loads(text)
        doc["calibration"]["probe"]["xla_call_s"] = -1e-4
        path.write_text(json.dumps(doc))
    elif damage == "stagger":  # the record's stagger made negative, key and profile kept
        doc = json.loads(text)
        doc["calibration"]["probe"]["sync_stagger"] = -0.01
        path.write_text(json.dumps(doc))
    else:
        path.write_bytes(b"\xff\x00 not a profile")
    monkeypatch.setattr(read, "PROBED", {})
    with pytest.warns(RuntimeWarning, match="probe-cache-refused"):
        again = model.resolve_profile(None, "cpu")
    assert probing.calls == 2 and again == good  # refit, never the damaged numbers
    assert again.fair_share.call_s == SHIPPED.fair_share.call_s
    key = json.loads(path.read_text())["calibration"]["probe"]["key"]
    with _no_warnings():
        assert probe.cached(path, key, read.profile_to_dict(SHIPPED)) == (probing.rates, 0.0)


def test_a_probe_of_a_busy_machine_is_measured_again_once_it_is_quiet(probing, monkeypatch):
    """A probe measured while other work filled the cores is used and cached with its load
    average; a later process on a machine still busy keeps it, one on a quiet machine probes
    again (said), and `explain`'s profile line says when the rates came from a busy machine."""
    cores = probe.host_cores()
    monkeypatch.setattr(probe, "load_average", lambda: 2.0 * cores)
    slow = model.resolve_profile(None, "cpu")
    record = json.loads(probe.cache_path("cpu").read_text())["calibration"]["probe"]
    assert probing.calls == 1 and record["load_average"] == 2.0 * cores
    assert any("busy (load average" in line for line in probe.describe(slow))
    monkeypatch.setattr(read, "PROBED", {})  # a new process, the machine still busy
    with _no_warnings():
        assert model.resolve_profile(None, "cpu") == slow
    assert probing.calls == 1
    monkeypatch.setattr(read, "PROBED", {})  # a new process, the machine quiet
    monkeypatch.setattr(probe, "load_average", lambda: 0.1)
    probing.rates = probe.Rates(probing.rates.flop_per_s * 2, probing.rates.memory_bytes_per_s,
                                FAKE_XLA)
    with pytest.warns(RuntimeWarning, match=r"busy \(load average .*quiet now"):
        quiet = model.resolve_profile(None, "cpu")
    assert probing.calls == 2 and quiet != slow
    assert not any("machine was busy" in line for line in probe.describe(quiet))
    record = json.loads(probe.cache_path("cpu").read_text())["calibration"]["probe"]
    assert record["load_average"] == 0.1 and record["flop_per_s"] == probing.rates.flop_per_s


def test_two_processes_writing_at_once_leave_a_valid_file(tmp_path):
    path = tmp_path / "cpu.probe.json"
    writer = textwrap.dedent("""
        import sys
        from pathlib import Path
        from libra_jax.model import probe, read
        doc = read.profile_to_dict(read.load_profile("cpu-host"))
        doc["notes"] = ["writer " + sys.argv[2] + " " + "x" * 200000]
        for _ in range(60):
            probe.store(Path(sys.argv[1]), doc)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(path), str(i)], env=os.environ)
             for i in range(2)]
    seen = 0
    while any(p.poll() is None for p in procs):
        if path.exists():  # a reader never sees a partial file
            json.loads(path.read_text())
            seen += 1
    assert [p.wait() for p in procs] == [0, 0]
    doc = json.loads(path.read_text())
    assert doc["notes"][0].split()[:2] in (["writer", "0"], ["writer", "1"])
    assert read.profile_from_dict(doc) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left


def test_a_read_only_home_falls_back_to_memory(probing, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a folder cannot be made under a file, root or not
    monkeypatch.setenv(config.PROFILE_DIR_ENV, str(blocked / "profiles"))
    with pytest.warns(RuntimeWarning, match="probe-cache-unwritable"):
        probed = model.resolve_profile(None, "cpu")
    assert probing.calls == 1 and probed != SHIPPED and probed.origin.endswith("in memory>")
    assert model.resolve_profile(None, "cpu") == probed and probing.calls == 1
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_thunk_runtime=true")
    with _no_warnings():  # said once per process
        model.resolve_profile(None, "cpu")
    assert probing.calls == 2
    assert any("kept in memory" in line for line in probe.describe(probed))


def test_a_failed_probe_plans_with_the_shipped_profile(probing, monkeypatch):
    def fail() -> probe.Rates:
        raise RuntimeError("no engine")
    monkeypatch.setattr(probing, "measure", fail)
    with pytest.warns(RuntimeWarning, match="probe-failed"):
        assert model.default_profile("cpu") == "cpu-host"
    calls = []
    monkeypatch.setattr(probing, "measure", lambda: calls.append(1))
    with _no_warnings():  # said once, and not retried in the process
        assert model.default_profile("cpu") == "cpu-host" and not calls


def test_where_the_probe_is_off_the_profile_is_shipped(probing, monkeypatch):
    probing.off = "a multi-process run"
    assert model.default_profile("cpu") == "cpu-host" and probing.calls == 0
    probing.off = ""
    assert model.default_profile("cuda") == "h100" and probing.calls == 0
    from libra_jax.calibrate import probe as measuring

    assert measuring.context() == (len(jax.devices("cpu")), jax.__version__, "")


@pytest.mark.parametrize("index, broadcast, off", [
    (0, True, ""),                                     # process 0 probes, and broadcasts it
    (1, True, "plans with process 0's probe"),         # the others wait for it
    (0, False, "LIBRA_JAX_NO_PROFILE_BROADCAST=1"),    # no broadcast: nobody probes
    (1, False, "LIBRA_JAX_NO_PROFILE_BROADCAST=1")])
def test_in_a_multi_process_run_only_process_0_probes(monkeypatch, index, broadcast, off):
    """Under multi-process JAX only process 0 probes, on its own devices (jax.local_devices),
    and only where the profile broadcast carries its probe to the others; its probe then takes
    at most half of LIBRA_JAX_TIMEOUT_S, the time the others wait for it."""
    from libra_jax.calibrate import probe as measuring

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: index)
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: jax.devices("cpu")[:4])
    if not broadcast:
        monkeypatch.setenv(config.NO_PROFILE_BROADCAST_ENV, "1")
    devices, version, why = measuring.context()
    assert (devices, version) == (4, jax.__version__)
    assert (off in why) if off else why == ""
    monkeypatch.setenv(config.TIMEOUT_ENV, "10")
    assert measuring.time_limit_s() == 5.0
    monkeypatch.setenv(config.TIMEOUT_ENV, "1000")
    assert measuring.time_limit_s() == measuring.PROBE_TIMEOUT_S
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setenv(config.TIMEOUT_ENV, "10")
    assert measuring.time_limit_s() == measuring.PROBE_TIMEOUT_S  # nobody waits on one process


def test_the_probe_measures_as_calibration_does():
    from libra_jax.calibrate import probe as measuring

    rates = measuring.measure()
    assert rates.flop_per_s > 0 and rates.memory_bytes_per_s > 0
    assert rates.xla is not None and rates.xla.call_s >= 0 and rates.xla.bytes_per_s > 0
    stagger = rates.xla.sync_stagger
    assert stagger is not None and stagger >= 0 and stagger < 1.0  # < 1 s a root second
    key = probe.machine_key("cpu-host", 8, jax.__version__)
    doc = probe.rescaled(read.profile_to_dict(SHIPPED), rates, key)
    rescaled = read.profile_from_dict(doc)
    assert rescaled.device.flop_per_s() == pytest.approx(rates.flop_per_s)
    assert rescaled.device.bytes_per_s() == pytest.approx(rates.memory_bytes_per_s)
    assert rescaled.fair_share.xla_terms() == pytest.approx((rates.xla.call_s, rates.xla.bytes_per_s))
    assert rescaled.fair_share.sync_stagger == pytest.approx(stagger)
    assert measuring.PROBE_BUDGET.matmul_n == 256  # the chain cpu-host's matmul rate names


def test_a_probe_that_overruns_is_stopped_before_measure_raises():
    """A probe past its time is told to stop and waited for: when `measure` raises, no probe
    thread is left dispatching programs beside the caller's (collectives of two programs
    dispatched in different orders on different devices can wait on each other), and the
    measurers work again after it."""
    from libra_jax.calibrate import probe as measuring

    with pytest.raises(RuntimeError, match="took more than 0.05 s$"):
        measuring.measure(timeout_s=0.05)
    assert not [t for t in threading.enumerate() if t.name == "libra_jax-probe"]
    mesh = mesh_of((8,), ("p",))
    x = jax.device_put(jnp.ones(8 * 256), jax.NamedSharding(mesh, P("p")))
    program = measuring.psum_program(jax, mesh, 256, 2, True)
    times = measuring.interleaved_times({"psum": (program, x)}, 2, random.Random(0))
    assert len(times["psum"]) == 2


def test_the_stagger_programs_synchronize_after_each_segment_or_once():
    """`sync_stagger`'s two programs: the same compute, a blocking psum after each of its
    segments (one all-reduce each, the next segment reading it) against one after all."""
    import numpy as np
    from jax.sharding import Mesh

    from libra_jax.calibrate import probe as measuring

    mesh = Mesh(np.array(jax.devices("cpu")), ("p",))
    x = jnp.ones((measuring.SYNC_N * 8, measuring.SYNC_N), jnp.float32)
    for synced, calls in ((True, 5), (False, 1)):
        hlo = measuring.sync_program(jax, mesh, 5, synced).lower(x).as_text()
        assert hlo.count("all_reduce") == calls
        assert hlo.count("dot_general") == 5


def _step(w, x):
    g = jax.lax.pmean(jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2))(w, x), "d")
    return w - 0.1 * g


def _explained() -> str:
    step = jax.shard_map(_step, mesh=mesh_of((8,), ("d",)), in_specs=(P(), P("d")), out_specs=P(),
                         check_vma=False)
    return str(libra_jax.explain(step, jnp.ones((64, 64)), jnp.ones((32, 64)), file=None))


def test_explain_names_the_profile(probing, monkeypatch):
    monkeypatch.setenv(config.PROFILE_PROBE_ENV, "0")
    assert "profile: shipped, cpu-host (LIBRA_JAX_PROFILE_PROBE=0" in _explained()
    monkeypatch.setenv(config.PROFILE_PROBE_ENV, "1")
    probing.rates = probe.Rates(SHIPPED_RATES.flop_per_s * 2, SHIPPED_RATES.memory_bytes_per_s,
                                FAKE_XLA)
    text = " ".join(_explained().split())
    assert "cpu-host rescaled by this machine's probe: matmul 92.8 GFLOP/s a device (shipped 46.4)" in text
    assert "memory copy 21.6 GB/s (shipped 21.6)" in text
    assert "XLA's all-reduce measured: 100 us an operand, 1.00 GB/s" in text
    assert "matmul 2.00x the profile's" in text and "`libra-jax calibrate`" in text
    monkeypatch.setattr(read, "PROBED", {})
    monkeypatch.setattr(probe, "_outcomes", {})
    probe.cache_path("cpu").unlink()
    probing.rates = SHIPPED_RATES
    text = " ".join(_explained().split())
    assert "rescaled by this machine's probe" in text
    assert ("`libra-jax calibrate`" in text) == (probe.host_cores() != SHIPPED.fair_share.cores)
    path = model.calibrated_profile_path("cpu")
    probe.store(path, read.profile_to_dict(SHIPPED))
    assert f"profile: calibrated, cpu-host from {path}" in " ".join(_explained().split())
