"""The CPU default profile carried to this machine: the shipped ``cpu-host`` rescaled by a probe
of about three seconds, cached per machine.

Why: ``cpu-host`` was fitted on one 2-core VM (its ``notes``); on any other host its rates are
that VM's (two VMs measured so far differ 31 vs 46 GFLOP/s a device), and a full `libra-jax
calibrate` is opt-in. The probe measures two rates the way calibration does
(`libra_jax.calibrate.probe`: calibration's own matmul and streaming chains, timed between its
marker all-reduces, every device running) and scales the shipped profile by probe/shipped:

* compute ratio ``r_c`` (matmul FLOP/s a device over the shipped sustained
  ``peak_dense_tflop_per_s * compute_efficiency``): every dtype's peak (efficiency kept);
* memory ratio ``r_m`` (streaming bytes/s a device over the shipped sustained
  ``memory_gbyte_per_s * memory_efficiency``): the memory bandwidth, and the rates the engine's
  copies run at, which are memory-bound on a host: ``fair_share.per_block_gbyte_per_s`` (one
  worker's bus rate), ``network.intra_node_gbyte_per_s`` (the bus cap among host devices)
  and ``fusion_copy_gbyte_per_s`` where it is a number.

XLA's own all-reduce, the plain step's collectives (`planner.StepPrice`), is measured, not
scaled (`XlaRates`: ``xla_allreduce_call_us`` an operand of a combined all-reduce,
``xla_allreduce_gbyte_per_s`` with its fresh output written), so that both sides of the
predicted optimized/plain ratio are this machine's; so is the devices' stagger at a blocking
collective (``sync_stagger_us_per_root_ms``, `libra_jax.calibrate.probe.sync_stagger`), which
is the host scheduler's, not the memory's. Why measured: they are XLA's, not the
memory's or the engine's. On one 2-core VM (2026-12-06, benchmarks/results/xla_operands.md)
psum moved 0.75-0.91 GB/s a device with one operand and 0.37-0.54 with several (a plain step
combines several), where the shipped profile's single-operand slope is 1.22, and an operand's
call cost 117-125 us against the shipped 152; a psum of a few operands is cheap to time. A
`Rates` without them (a measurer that does not time XLA) scales the bytes rate by the memory
ratio and keeps the call cost.

The counts are this machine's (its key's): ``fair_share.cores`` the CPUs this process may run
on, ``network.devices_per_node`` its CPU devices, and ``compute_threads`` the shipped compute
threads a device times those devices (XLA's threads a device are its runtime's; how many
devices share how many cores is the machine's). Why: the fair-share form prices a reduction
beside compute or while the devices wait by whether their compute threads fill the cores
(`forms.fair_share_oversubscribed`), which on another machine its own counts say.

Kept as shipped, and why: the engine's latencies and call costs (``base_latency_us``,
``call_us``, ``pending_allreduce_us``: its thread hand-offs and wake-ups inside a step, which
neither rate measures and a probe outside a step cannot fit), fitted structure
(``overlap_block_efficiency``, the traffic ratios: a probe of a second cannot fit them), and the
NIC (not on this host). Where the machine is far from the profile (a rate off by more than
`FAR_RATIO` either way, or another core count than the shipped profile's), `explain` suggests
``libra-jax calibrate``.

Cached per machine in ``<profile dir>/<backend>.probe.json`` (`config.calibrated_profile_dir`),
a loadable profile document whose ``calibration.probe`` holds the key and the numbers. The
key (`machine_key`): libra_jax's version, the profile schema, what the probe measures
(`PROBE_FORMAT`), the shipped profile's content, the
CPU model, the cores this process may run on, the CPU device count, JAX's version, ``XLA_FLAGS``
and the thread settings. A file is used only if its key is this one and its profile is exactly
the shipped one rescaled by its recorded numbers; any other (corrupt, another key, edited) is
refused with a notice and the probe runs again. Writes are atomic (a temporary file in the same
folder, then `os.replace`), so two processes writing at once leave one whole file. A folder
that cannot be written (a read-only or missing home) keeps the probe in memory, said once.

A probe taken while the machine is busy (`busy`: the 1-minute load average at or above the
cores this process may run on, so other work shared the cores the chains ran on) is used and
cached with its load average, and a later process that finds the machine quiet probes again
(said once): a rate measured beside someone's build is not kept for good.

Where it is off (the shipped profile exactly): ``LIBRA_JAX_PROFILE_PROBE=0`` (`config`; the
tests set it, so plans.json stays machine-independent); a calibrated profile (it wins:
`read.default_profile`); a backend other than CPU; JAX not running (the pure layer never
imports it); fewer than two CPU devices; and a multi-process run whose profile broadcast is
off (``LIBRA_JAX_NO_PROFILE_BROADCAST=1``: each process would plan with its own probe, and
plans must agree). Otherwise, in a multi-process run only process 0 probes, on its own devices
(`MEASURER`'s ``context``: a collective over them runs without the other processes, where
one over ``jax.devices()`` would wait for every process under gloo), and
`rewrite.shared_profile` broadcasts the profile it plans with (another process makes it its
default once received, `adopt`); the probe there takes at most half the time the others wait
for it (``LIBRA_JAX_TIMEOUT_S``). The rates are those of process 0's devices running alone
while the others wait, which on a host shared by several processes is not how the step runs
(every process computing at once): a limit docs/calibration.md states, not corrected. A probe
that fails is said once and the shipped profile is used.

The measuring side needs JAX and the engine (layer 5, `libra_jax.calibrate.probe`): this pure
module names it (`MEASURER`) and imports it only where a probe runs, with JAX already running.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra_jax import config
from libra_jax.model import read
from libra_jax.model.profile import BYTES_PER_GBYTE, S_PER_MS, S_PER_US, SCHEMA_VERSION, Profile

#: The module that measures (JAX and the engine): ``context()`` and ``measure()``.
MEASURER = "libra_jax.calibrate.probe"
#: How far a probed rate may be from the profile's (either way) before `explain` suggests a
#: full calibration: past it, the profile's other fitted numbers (call cost, compute threads,
#: overlap efficiency) came from a machine too unlike this one to trust.
FAR_RATIO = 1.5
#: What the probe measures (part of the key: a file from a probe that measured less is refit).
#: 2: XLA's all-reduce terms too (`XlaRates`); 3: this machine's counts (`_counts`); 4: the
#: devices' stagger at a synchronization (`XlaRates.sync_stagger`); 5: XLA's call cost and
#: the stagger over more rounds (`XLA_CALL_REPS`, `SYNC_REPS`: over fewer they varied by 2x
#: and 1.4x across probes).
PROBE_FORMAT = 5
#: The thread settings that change how fast the host's compute runs (part of the cache key).
THREAD_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS")


@dataclass(frozen=True)
class Rates:
    """A device's sustained rates, every device running: matmul FLOP/s and streaming bytes/s;
    and, where measured, XLA's own all-reduce as the plain step runs it (`XlaRates`)."""

    flop_per_s: float
    memory_bytes_per_s: float
    xla: XlaRates | None = None

    def ratios(self, other: Rates) -> tuple[float, float]:
        """(compute, memory): these rates over `other`'s."""
        return self.flop_per_s / other.flop_per_s, self.memory_bytes_per_s / other.memory_bytes_per_s


@dataclass(frozen=True)
class XlaRates:
    """XLA:CPU's all-reduce (``jax.lax.psum`` in a jitted ``shard_map`` over every CPU device),
    measured: ``call_s`` what one more operand of a combined all-reduce costs (its thunk meets
    every rank once per operand: `planner.step`), ``bytes_per_s`` the bytes per rank a second
    with its fresh output written; ``sync_stagger`` (None: not measured) how far behind the
    others the last device reaches such a blocking call, seconds per root second of the
    compute since the devices last met (`libra_jax.calibrate.probe.sync_stagger`). The
    profile's ``xla_allreduce_call_us``, ``xla_allreduce_gbyte_per_s`` and
    ``sync_stagger_us_per_root_ms`` mean these numbers."""

    call_s: float
    bytes_per_s: float
    sync_stagger: float | None = None


@dataclass(frozen=True)
class Outcome:
    """A probe's result: the profile it made of `shipped`, its rates and the shipped ones, and
    the cache file (None: kept in memory) it came from or went to."""

    shipped: str
    profile: Profile
    probed: Rates
    shipped_rates: Rates
    path: Path | None
    cores: int
    load: float | None = None

    def far(self) -> list[str]:
        """Why this machine is far from the profile (empty: it is not): each rate off by more
        than `FAR_RATIO` either way, and a core count other than the profile's."""
        compute, memory = self.probed.ratios(self.shipped_rates)
        why = [f"{name} {ratio:.2f}x the profile's" for name, ratio in
               (("matmul", compute), ("memory copy", memory))
               if max(ratio, 1 / ratio) > FAR_RATIO]
        fair = read.load_profile(self.shipped).fair_share  # the probed profile has these cores
        if fair is not None and self.cores != fair.cores:
            why.append(f"{self.cores} cores, the profile's {fair.cores:g}")
        return why


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - not Unix
        return None


def busy(load: float | None, cores: int) -> bool:
    """Whether a machine of `cores` cores with 1-minute load average `load` is busy: other
    work as heavy as every core running (a probe measured then shares the cores)."""
    return load is not None and load >= cores


def sustained(profile: Profile) -> Rates:
    """The profile's sustained rates a device (peak times efficiency, the default dtype)."""
    return Rates(profile.device.flop_per_s(), profile.device.bytes_per_s())


def rescaled(document: Mapping[str, Any], probed: Rates, key: Mapping[str, Any],
             load: float | None = None) -> dict[str, Any]:
    """The shipped profile `document` rescaled by `probed` over its own sustained rates (the
    module docstring's rule), with the probe (and the load average `load` it was measured
    under, where known) recorded in ``calibration.probe``."""
    doc = json.loads(json.dumps(document))
    doc.pop("calibration", None)
    shipped = sustained(read.profile_from_dict(doc))
    compute, memory = probed.ratios(shipped)
    how = ("rescaled by this machine's probe (libra_jax.model.probe): {0:.3g}x the shipped "
           "value; was: {1}")
    _counts(doc, key)

    def scale(q: dict[str, Any], ratio: float) -> None:
        if q.get("value") is not None:
            q["ref"] = how.format(ratio, q.get("ref", ""))
            q["value"] = q["value"] * ratio

    device = doc["device"]
    for q in device["peak_dense_tflop_per_s"].values():
        if isinstance(q, dict):
            scale(q, compute)
    scale(device["memory_gbyte_per_s"], memory)
    scale(doc["network"]["intra_node_gbyte_per_s"], memory)
    for section in ("fair_share", "nccl_style"):
        if isinstance(doc.get(section), dict):
            scale(doc[section]["per_block_gbyte_per_s"], memory)
            scale(doc[section]["fusion_copy_gbyte_per_s"], memory)
            xla_rate = doc[section].get("xla_allreduce_gbyte_per_s")
            if probed.xla is not None and section == "fair_share":
                _measured(doc[section], probed.xla)
            elif isinstance(xla_rate, dict):
                scale(xla_rate, memory)
    doc["notes"] = list(doc.get("notes", [])) + [
        f"Rescaled to this machine by a probe (matmul {probed.flop_per_s / 1e9:.1f} GFLOP/s a "
        f"device, shipped {shipped.flop_per_s / 1e9:.1f}; streaming "
        f"{probed.memory_bytes_per_s / BYTES_PER_GBYTE:.1f} GB/s, shipped "
        f"{shipped.memory_bytes_per_s / BYTES_PER_GBYTE:.1f}){_xla_note(probed.xla)}; the "
        "engine's latencies, call costs and counts as shipped (libra_jax.model.probe)."]
    record: dict[str, Any] = {"key": dict(key), "flop_per_s": probed.flop_per_s,
                              "memory_bytes_per_s": probed.memory_bytes_per_s}
    if probed.xla is not None:
        record["xla_call_s"] = probed.xla.call_s
        record["xla_bytes_per_s"] = probed.xla.bytes_per_s
        if probed.xla.sync_stagger is not None:
            record["sync_stagger"] = probed.xla.sync_stagger
    doc["calibration"] = {"probe": record}
    if load is not None:
        doc["calibration"]["probe"]["load_average"] = load
    return doc


def _counts(doc: dict[str, Any], key: Mapping[str, Any]) -> None:
    """This machine's counts in the fair-share document `doc` (the module docstring): its
    cores and devices (`key`), and the shipped compute threads a device times its devices."""
    fair, network = doc.get("fair_share"), doc["network"]
    if not isinstance(fair, dict) or "cores" not in key or "devices" not in key:
        return
    cores, devices = int(key["cores"]), int(key["devices"])
    shipped_devices = network["devices_per_node"]["value"]
    per_device = fair["compute_threads"]["value"] / shipped_devices
    was = "; was: {0}"
    fair["cores"] = {"value": cores, "source": "measured",
                     "ref": "the CPUs this process may run on (libra_jax.model.probe)"
                     + was.format(fair["cores"].get("ref", ""))}
    network["devices_per_node"] = {"value": devices, "source": "measured",
                                   "ref": "this process's CPU devices (libra_jax.model.probe)"
                                   + was.format(network["devices_per_node"].get("ref", ""))}
    fair["compute_threads"] = {
        "value": per_device * devices, "source": "assumption",
        "ref": f"the shipped {per_device:.3g} compute threads a device times this machine's "
               f"{devices} devices (libra_jax.model.probe)"
               + was.format(fair["compute_threads"].get("ref", ""))}


def _measured(fair_share: dict[str, Any], xla: XlaRates) -> None:
    """Set the fair-share section's XLA terms to the probe's measurement of them."""
    how = "measured on this machine by its probe (libra_jax.calibrate.probe.{0}); was: {1}"
    fields = [("xla_allreduce_call_us", xla.call_s / S_PER_US, "xla_rates"),
              ("xla_allreduce_gbyte_per_s", xla.bytes_per_s / BYTES_PER_GBYTE, "xla_rates")]
    if xla.sync_stagger is not None:
        fields.append(("sync_stagger_us_per_root_ms",
                       xla.sync_stagger / S_PER_US * S_PER_MS ** 0.5, "sync_stagger"))
    for field, value, measurer in fields:
        was = fair_share.get(field)
        ref = was.get("ref", "") if isinstance(was, dict) else "the default"
        fair_share[field] = {"value": value, "source": "measured",
                             "ref": how.format(measurer, ref)}


def _xla_note(xla: XlaRates | None) -> str:
    if xla is None:
        return ""
    stagger = ("" if xla.sync_stagger is None else
               f"; the devices' stagger at a synchronization "
               f"{xla.sync_stagger / S_PER_US * S_PER_MS ** 0.5:.0f} us per root ms of compute")
    return (f"; XLA's all-reduce measured: {xla.call_s / S_PER_US:.0f} us an operand, "
            f"{xla.bytes_per_s / BYTES_PER_GBYTE:.2f} GB/s{stagger}")


def host_cores() -> int:
    """The CPUs this process may run on (calibration's ``cores`` of the fair-share form, and
    part of the probe's key)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=8)
def _content_hash(name: str) -> str:
    return hashlib.sha256(read.profile_path(name).read_bytes()).hexdigest()[:16]


def machine_key(shipped: str, devices: int, jax_version: str) -> dict[str, Any]:
    """What a cached probe holds for: a probe made under any other key is not used."""
    from libra_jax import __version__

    return {"libra_jax": __version__, "schema_version": SCHEMA_VERSION, "probe": PROBE_FORMAT,
            "shipped": shipped,
            "shipped_sha256": _content_hash(shipped), "cpu": cpu_model(), "cores": host_cores(),
            "devices": devices, "jax": jax_version, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "threads": {name: os.environ[name] for name in THREAD_ENVS if name in os.environ}}


def cache_path(backend: str) -> Path:
    """Where `backend`'s probe is cached: ``<profile dir>/<backend>.probe.json``."""
    return config.calibrated_profile_dir() / f"{backend}.probe.json"


def store(path: Path, document: Mapping[str, Any]) -> None:
    """Write `document` to `path` atomically: a temporary file beside it, then `os.replace`
    (readers, and other writers, see the old file or the new one, whole). OSError where the
    folder cannot be made or written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(document, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def cached(path: Path, key: Mapping[str, Any], shipped: Mapping[str, Any],
           load_now: float | None = None) -> tuple[Rates, float | None] | None:
    """The rates of the probe cached at `path` for `key` and the load average they were
    measured under, or None (no file, or none readable: silently; a file that is not whole
    JSON, another key's, or whose profile is not `shipped` rescaled by its numbers: refused
    with a notice, never used; one measured on a busy machine while it is quiet now
    (`load_now`): probed again, said)."""
    try:
        text = path.read_text()
    except OSError:  # no file to read (none, or no folder): nothing to refuse
        return None
    except UnicodeDecodeError as exc:
        return _refused(path, f"it is not UTF-8 text ({exc})")
    try:
        doc = json.loads(text)
        record = doc["calibration"]["probe"]
        stagger = record.get("sync_stagger")
        xla = (XlaRates(float(record["xla_call_s"]), float(record["xla_bytes_per_s"]),
                        None if stagger is None else float(stagger))
               if "xla_call_s" in record or "xla_bytes_per_s" in record else None)
        rates = Rates(float(record["flop_per_s"]), float(record["memory_bytes_per_s"]), xla)
    except (ValueError, KeyError, TypeError) as exc:
        return _refused(path, f"it is not a whole probe record ({type(exc).__name__}: {exc})")
    if record.get("key") != dict(key):
        theirs = record.get("key") if isinstance(record.get("key"), dict) else {}
        changed = sorted(k for k in set(key) | set(theirs) if theirs.get(k) != key.get(k))
        return _refused(path, f"it was probed under another key ({', '.join(changed)} differ)")
    positive = [rates.flop_per_s, rates.memory_bytes_per_s]
    positive += [rates.xla.bytes_per_s] if rates.xla is not None else []
    if not all(math.isfinite(v) and v > 0 for v in positive):
        return _refused(path, "its rates are not positive numbers")
    if rates.xla is not None and not (math.isfinite(rates.xla.call_s) and rates.xla.call_s >= 0):
        return _refused(path, "its XLA call cost is not a number >= 0")
    stagger = rates.xla.sync_stagger if rates.xla is not None else None
    if stagger is not None and not (math.isfinite(stagger) and stagger >= 0):
        return _refused(path, "its devices' stagger is not a number >= 0")
    load = record.get("load_average")
    if load is not None and not (isinstance(load, (int, float)) and math.isfinite(load)
                                 and load >= 0):
        return _refused(path, f"its load average is not a number >= 0 ({load!r})")
    try:
        mine = read.profile_from_dict(doc, origin=str(path))
        if mine != read.profile_from_dict(rescaled(shipped, rates, key)):
            return _refused(path, "its profile is not the shipped one rescaled by its probe")
    except (ValueError, KeyError, TypeError) as exc:
        return _refused(path, f"its profile does not load ({exc})")
    cores = int(key.get("cores", 1))
    if busy(load, cores) and not busy(load_now, cores) and load_now is not None:
        return _refused(path, f"it was measured while the machine was busy (load average "
                        f"{load:.1f} on {cores} cores) and the machine is quiet now "
                        f"({load_now:.1f})")
    return rates, load


def _refused(path: Path, why: str) -> tuple[Rates, float | None] | None:
    """None, said: the cache file at `path` is not used, for `why`."""
    config.notice("probe-cache-refused", f"libra_jax: not using the cached probe {path}: {why}; "
                  "probing this machine again", RuntimeWarning, stacklevel=4)
    return None


#: Outcomes by the label `read.default_profile` returns for them (`read.PROBED`'s keys).
_outcomes: dict[str, Outcome] = {}
_said: set[str] = set()
#: Labels whose probe failed in this process (not retried: the shipped profile plans).
_failed_keys: set[str] = set()
#: Process 0's probe of a shipped profile, as this process received it (`adopt`), by the
#: shipped profile's name: this process's default in its place.
_adopted: dict[str, str] = {}


def _once(notice_id: str, message: str) -> None:
    """Say a probe's notice once per process (each has one call site: `_failed`, `_unwritable`)."""
    if notice_id not in _said:
        _said.add(notice_id)
        _SAYERS[notice_id](message)


def _failed(message: str) -> None:
    config.notice("probe-failed", message, RuntimeWarning, stacklevel=5)


def _unwritable(message: str) -> None:
    config.notice("probe-cache-unwritable", message, RuntimeWarning, stacklevel=5)


_SAYERS: dict[str, Callable[[str], None]] = {"probe-failed": _failed,
                                             "probe-cache-unwritable": _unwritable}


def _measurer() -> Any:
    return importlib.import_module(MEASURER)


def probed_default(backend: str, shipped: str) -> str:
    """The CPU default `read.default_profile` returns where no calibrated profile is:
    `shipped` rescaled by this machine's probe (its label in `read.PROBED`), or `shipped`
    itself where the probe is off or failed (the module docstring). Probes once per process
    and machine key; a failed probe is not retried in the process."""
    if backend != "cpu" or not config.profile_probe() or "jax" not in sys.modules:
        return shipped
    if shipped in _adopted:
        return _adopted[shipped]
    measurer = _measurer()
    devices, jax_version, off = measurer.context()
    if off:
        return shipped
    key = machine_key(shipped, devices, jax_version)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    label = f"{shipped} (probe {digest})"
    if label in read.PROBED or label in _failed_keys:
        return label if label in read.PROBED else shipped
    path = cache_path(backend)
    document = read.profile_to_dict(read.load_profile(shipped))
    found = cached(path, key, document, load_now=load_average())
    kept: Path | None = path
    if found is not None:
        rates, load = found
    else:
        load = load_average()
        try:
            rates = measurer.measure()
        except Exception as exc:  # a failed probe must not fail the step: the shipped profile plans
            _failed_keys.add(label)
            _once("probe-failed", f"libra_jax: the machine probe failed ({type(exc).__name__}: "
                  f"{exc}); planning with the shipped profile {shipped!r}")
            return shipped
        try:
            store(path, rescaled(document, rates, key, load))
        except OSError as exc:
            kept = None
            _once("probe-cache-unwritable", f"libra_jax: cannot cache the machine probe at {path} "
                  f"({exc}); it is kept in memory, and each process probes again")
    profile = read.profile_from_dict(rescaled(document, rates, key, load),
                                     origin=str(kept) if kept else f"<{label}, in memory>")
    read.PROBED[label] = profile
    _outcomes[label] = Outcome(shipped, profile, rates, sustained(read.load_profile(shipped)),
                               kept, key["cores"], load)
    return label


def adopt(shipped: str, profile: Profile) -> None:
    """Make `profile`, process 0's probe of `shipped` broadcast to this process
    (`rewrite.shared_profile`), this process's CPU default in place of `shipped`. Why: a
    process other than 0 of a multi-process run does not probe; once its first step has
    received process 0's profile, what it plans outside a step (`libra_jax.explain`) is
    planned as its steps run."""
    label = f"{shipped} (process 0's probe)"
    read.PROBED[label] = profile
    _adopted[shipped] = label


def outcome_of(profile: Profile) -> Outcome | None:
    """The probe that made `profile` in this process, if one did."""
    return next((o for o in _outcomes.values() if o.profile == profile), None)


def describe(profile: Profile) -> list[str]:
    """Which profile planned, said for `explain`: probe-rescaled (the probe's two numbers and
    the shipped ones, and ``libra-jax calibrate`` where the machine is far from the profile),
    calibrated (its path), shipped, or another one (its origin)."""
    outcome = outcome_of(profile)
    if outcome is not None:
        p, s = outcome.probed, outcome.shipped_rates
        where = f"cached at {outcome.path}" if outcome.path else "kept in memory"
        lines = [f"profile: {outcome.shipped} rescaled by this machine's probe: matmul "
                 f"{p.flop_per_s / 1e9:.1f} GFLOP/s a device (shipped {s.flop_per_s / 1e9:.1f}), "
                 f"memory copy {p.memory_bytes_per_s / BYTES_PER_GBYTE:.1f} GB/s (shipped "
                 f"{s.memory_bytes_per_s / BYTES_PER_GBYTE:.1f}){_xla_note(p.xla)}; the engine's "
                 f"latencies and call costs as shipped ({where}; {config.PROFILE_PROBE_ENV}=0 "
                 "plans with the shipped one)"]
        if busy(outcome.load, outcome.cores):
            lines.append(f"the probe ran while the machine was busy (load average "
                         f"{outcome.load:.1f} on {outcome.cores} cores): its rates are low; a "
                         "process that finds the machine quiet probes again")
        far = outcome.far()
        if far:
            lines.append(f"this machine is far from the profile ({'; '.join(far)}): `libra-jax "
                         "calibrate` measures it (docs/calibration.md)")
        return lines
    origin = profile.origin.strip("'\"")
    if origin.startswith(str(config.calibrated_profile_dir())):
        return [f"profile: calibrated, {profile.name} from {origin}"]
    if origin == str(read.profile_path(profile.name)):
        why = ""
        if profile.form == "fair-share" and not config.profile_probe():
            why = f" ({config.PROFILE_PROBE_ENV}=0: not rescaled to this machine)"
        return [f"profile: shipped, {profile.name}{why}"]
    return [f"profile: {profile.name} from {profile.origin}"]


read.probe_hook = probed_default  # `read.default_profile`'s CPU default goes through the probe
