"""Contention model: a hardware profile and a world size become the planner's ``CostModel``.

What it computes
----------------
For every allowed allocation ``k`` (the profile says whether ``k`` counts thread blocks or total
threads) the planner needs three numbers and one latency (see `libra_jax.planner.CostModel`):

* ``solo_bw[k]``    -- gradient bytes per second of a ring all-reduce that runs alone;
* ``overlap_bw[k]`` -- the same while backward compute runs beside it (always <= ``solo_bw[k]``:
  the collective competes with compute kernels for memory bandwidth and issue slots);
* ``slowdown[k]``   -- how much longer overlapped compute takes (>= 1: the collective's blocks
  occupy SMs and move bytes through the same HBM);
* ``latency_s``     -- the part of a collective no allocation speeds up.

Ring all-reduce over ``n`` ranks moves ``2(n-1)/n`` of the gradient bytes through each rank's link
and pays ``2n-2`` step latencies (NCCL's ``nsteps`` for ring all-reduce). So a bus bandwidth ``B``
gives ``B * n / (2(n-1))`` gradient bytes per second, and the latency is
``base + (steps - inter_steps) * intra_step + inter_steps * inter_step`` with
``inter_steps = 2(nodes-1)`` -- the shape of NCCL's ``tuning.cc`` ring latency.

Three functional forms (chosen by the profile's ``form``)
---------------------------------------------------------
``libra-fit`` -- the curves fitted by the Libra artifact on 2 GPUs at 50 Gb/s, in its own units
(MiB/ms, ``T`` = total communication threads):

    bus bandwidth(T) = b - a * exp(-c * T**e)          (e = 0.6; separate fits solo / overlapped)
    slowdown(T)      = s / (b' - c' * T)               (overlapped compute X takes X * slowdown)

Faster networks follow the artifact's rule: at ``k`` times the reference link the thread options are
multiplied by ``k``, both bandwidth fits are evaluated at ``T/k`` and multiplied by ``k`` (``k``
times the bandwidth needs ``k`` times the threads), and the slowdown fit is evaluated at ``T``
itself. The slowdown hyperbola has a pole (``b'/c'`` ~ 5457 threads for the testbed): options at or
beyond it, or where a bandwidth fit is not positive, are dropped and the reason is recorded in
`Derivation.dropped`. A fitted slowdown below 1 (fit error at tiny ``T``) is raised to 1 and
noted.

``nccl-style`` -- an analytic form for datasheet profiles, in the spirit of NCCL's symmetric-kernel
model (per-SM bandwidth capped by the link):

    bus_solo(k)    = softmin_p(k * beta,       L)      softmin_p(x, y) = (x**-p + y**-p) ** (-1/p)
    bus_overlap(k) = softmin_p(k * beta * eta, L)
    slowdown(k)    = (1 - f) * U / (U - k * u)  +  f * H / (H - m * bus_overlap(k))

``beta`` is one block's bandwidth, ``L`` the ring's bottleneck link, ``p`` the soft-min sharpness
(``p`` -> infinity is the hard min; at ``k * beta = L`` the soft-min gives ``2**(-1/p) * L``).
``eta`` < 1 is the fraction of a block's throughput kept while compute shares the GPU, so the
overlapped bandwidth is far below solo for a few blocks and approaches it once the link saturates
-- the same shape as the artifact's two fits. The slowdown mixes the two resources compute loses: a
fraction ``1 - f`` of backward compute is SM-bound and runs on ``U - k*u`` of ``U`` SMs (as
Transformer Engine gives GEMMs ``sm_count - comm_sms``); the memory-bound fraction ``f`` gets the
HBM bandwidth ``H`` minus the collective's traffic, ``m`` HBM bytes per bus byte. Options that
would take every SM or all of the HBM bandwidth are dropped with a reason.

``fair-share`` -- CPU hosts, where the "blocks" are the engine's worker threads and every device's
compute threads and the workers share the host's ``P`` cores (``cores``). A fair scheduler gives
each runnable thread ``min(1, P / threads)`` of a core; with ``D`` busy compute threads
(``compute_threads``, fitted by calibration):

    bus_solo(k)    = softmin_p(min(k, P) * beta,                 L)
    bus_overlap(k) = softmin_p(k * min(1, P / (D + k)) * beta,   L)
    slowdown(k)    = max(1, (D + k) / P) / max(1, D / P)          ((D + k) / D once D >= P)

``beta`` is one worker's rate with a core to itself. The GPU form's SM partition (``U / (U - k u)``)
does not describe threads time-sliced on a few cores.

The price of fusion (both analytic forms)
-----------------------------------------
A fused bucket (two or more gradients) is packed into one buffer on the compute stream before its
collective starts: ``pack_s = bytes / fusion_copy_gbyte_per_s`` (``CostModel.pack_s_per_byte``).
On GPUs it is a datasheet copy rate (half the HBM rate); on CPU hosts calibration measures it in
train steps, where it is far above the copy itself (a fused bucket waits for every device's whole
backward pass). ``libra-fit`` prices fusion at nothing, as the paper does.

One time formula for all forms (NCCL ``tuning.cc`` style): a collective of ``b`` bytes costs
``pack_s + latency + b / bw`` with ``bw`` the solo or overlapped table entry of its allocation, and
slows overlapped compute by the ``slowdown`` table entry; the per-form tables above fill them.

Other collectives (sharded data parallelism)
--------------------------------------------
The tables are the all-reduce's. A reduce-scatter or an all-gather of an unsharded buffer of
``b`` bytes costs ``pack_s + latency_c + traffic_c * b / bw`` with the same ``bw`` and the same
``slowdown`` (the same blocks beside the same compute): `COLLECTIVE_SHAPES` is the one table of
per-collective terms. ``latency_c`` is `ring_latency_s` with the collective's steps (``n-1``
against the all-reduce's ``2(n-1)``); ``traffic_c`` (`collective_traffic`) is the ratio of bus
bytes for a ring, 1/2, and for the CPU engine, which is no ring, the profile's measured ratio
(``fair_share.reduce_scatter_traffic`` / ``all_gather_traffic``) or else the ratio of the memory
each moves, ``(n+1)/(2n)``. They reach the planner as ``CostModel.collectives``.

Profiles
--------
JSON files (``libra_jax/profiles/<name>.json``), loaded by name or by path with
`load_profile`, carry ``schema_version`` (`SCHEMA_VERSION`) and put units in key names
(``..._gbyte_per_s``, ``..._us``); `SCHEMA_CHANGES` says what each version changed, and an
outdated profile is rejected with that list. Every number is a quantity ``{"value": ..., "source": ...}``
whose source is ``datasheet``, ``measured`` or ``assumption`` (plus an optional ``ref``/``note``),
so a reader can tell a vendor figure from a guess. Validation happens on load and raises
``ValueError`` naming the missing or malformed field by its dotted path. A profile written by
``libra-jax calibrate`` also carries an optional ``calibration`` object (machine, backend, JAX
version, date, raw samples, fit errors), and `default_profile` prefers it to the shipped
profile of its backend (see `calibrated_profile_path`, ``docs/calibration.md``).

This module is pure Python: no JAX, no compiled extension.
"""
from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from libra_jax import config
from libra_jax.planner import COLLECTIVES, CollectiveTerms, CostModel, no_overlap_allocation
from libra_jax.planner import default_allocation as planner_default_allocation

__all__ = [
    "MAX_LAUNCH_BLOCKS",
    "SCHEMA_VERSION",
    "SOURCES",
    "FORMS",
    "Quantity",
    "DeviceSpec",
    "NetworkSpec",
    "LibraFit",
    "NcclStyle",
    "FairShare",
    "Profile",
    "Derivation",
    "PROFILE_DIR",
    "list_profiles",
    "load_profile",
    "calibrated_profile_dir",
    "calibrated_profile_path",
    "default_profile",
    "resolve_profile",
    "BUILTIN_PROFILES",
    "profile_from_dict",
    "derive",
    "cost_model",
    "ring_bytes_per_rank",
    "ring_steps",
    "ring_latency_s",
    "ring_algo_factor",
    "CollectiveShape",
    "COLLECTIVE_SHAPES",
    "collective_traffic",
    "softmin",
    "libra_bandwidth_mib_per_ms",
    "libra_slowdown",
    "nccl_bus_bandwidth",
    "nccl_slowdown",
    "fair_share_core_share",
    "fair_share_slowdown",
]

#: The most blocks a call is launched with: the CPU engine's pool (``kMaxBlocks``,
#: cpp/libra/engine.h; tests/test_model.py checks the extension says the same).
MAX_LAUNCH_BLOCKS = 64

SCHEMA_VERSION = 2
SOURCES = ("datasheet", "measured", "assumption")
FORMS = ("libra-fit", "nccl-style", "fair-share")
#: What changed in each schema version (the error for an outdated profile names it).
SCHEMA_CHANGES = {
    2: "the 'fair-share' form (CPU hosts) and 'fusion_copy_gbyte_per_s' (the cost of packing a "
       "fused bucket) in 'nccl_style'; base_latency_us of calibrated CPU profiles no longer "
       "includes the ranks' arrival skew",
}
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

# Unit conversions (named, so that every scale factor in this file is visible).
BYTES_PER_MIB = 1 << 20
MS_PER_S = 1e3
BYTES_PER_S_PER_MIB_PER_MS = BYTES_PER_MIB * MS_PER_S
BYTES_PER_GBYTE = 1e9
BYTES_PER_GBIT = 1e9 / 8
S_PER_US = 1e-6
FLOP_PER_TFLOP = 1e12


# ----------------------------------------------------------------------------------------------
# Ring all-reduce
# ----------------------------------------------------------------------------------------------


def _check_workers(workers: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
        raise ValueError(f"workers must be an integer >= 2 (a ring needs two ranks), got {workers!r}")


class CollectiveShape(NamedTuple):
    """What one collective over ``n`` ranks does with an unsharded buffer of ``b`` bytes (a
    reduce-scatter's input, an all-gather's output): as a ring (NCCL's ``nsteps`` and bus
    bandwidth factors), ``steps(n)`` hop latencies and ``bus_fraction(n) * b`` bytes through each
    rank's link; in the CPU engine (not a ring: each range is reduced or copied by one worker
    from all ranks' buffers), ``engine_traffic(n) * b`` bytes of memory read and written in all."""

    steps: Callable[[int], int]
    bus_fraction: Callable[[int], float]
    engine_traffic: Callable[[int], float]


#: The per-collective terms, one row per collective (`planner.COLLECTIVES`). A ring all-reduce is
#: a reduce-scatter then an all-gather: twice their steps and bytes. The engine's all-reduce
#: reads the n inputs and writes n outputs; its reduce-scatter reads n and writes one shard's
#: worth (1/n on each of n ranks), its all-gather reads the n shards once and writes n outputs.
COLLECTIVE_SHAPES: Mapping[str, CollectiveShape] = MappingProxyType({
    "all-reduce": CollectiveShape(lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n, lambda n: 2.0 * n),
    "reduce-scatter": CollectiveShape(lambda n: n - 1, lambda n: (n - 1) / n, lambda n: n + 1.0),
    "all-gather": CollectiveShape(lambda n: n - 1, lambda n: (n - 1) / n, lambda n: n + 1.0),
})
assert tuple(COLLECTIVE_SHAPES) == COLLECTIVES


def ring_steps(workers: int, collective: str = "all-reduce") -> int:
    """Communication steps of a ring `collective`: ``2(n-1)`` for the all-reduce (a
    reduce-scatter plus an all-gather), ``n-1`` for either half."""
    _check_workers(workers)
    return COLLECTIVE_SHAPES[collective].steps(workers)


def ring_bytes_per_rank(grad_bytes: float, workers: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``grad_bytes``: ``2(n-1)/n``."""
    _check_workers(workers)
    return grad_bytes * 2.0 * (workers - 1) / workers


def ring_algo_factor(workers: int) -> float:
    """Gradient bytes per second per bus byte per second: ``n / (2(n-1))`` (1 at two ranks)."""
    _check_workers(workers)
    return workers / (2.0 * (workers - 1))


def ring_latency_s(network: NetworkSpec, workers: int, collective: str = "all-reduce") -> float:
    """Latency of one ring `collective`: base plus one hop latency per step (NCCL tuning.cc
    shape).

    Steps that cross nodes (the collective's steps over the nodes: ``2(nodes-1)`` for the
    all-reduce) pay the inter-node hop latency, the others the intra-node one.
    """
    steps = ring_steps(workers, collective)
    nodes = math.ceil(workers / network.devices_per_node)
    inter = COLLECTIVE_SHAPES[collective].steps(nodes)
    return (network.base_latency_s + (steps - inter) * network.intra_step_latency_s
            + inter * network.inter_step_latency_s)


# ----------------------------------------------------------------------------------------------
# Functional forms
# ----------------------------------------------------------------------------------------------


def libra_bandwidth_mib_per_ms(threads: float, a: float, b: float, c: float, exponent: float) -> float:
    """Libra artifact bandwidth fit ``b - a*exp(-c*T**exponent)`` in MiB/ms (may be <= 0 at tiny T)."""
    return b - a * math.exp(-c * threads**exponent)


def libra_slowdown(threads: float, scale: float, intercept: float, slope: float) -> float:
    """Libra artifact compute fit: overlapped time / solo time ``= scale / (intercept - slope*T)``.

    Returns ``inf`` at or beyond the pole ``T = intercept/slope`` (the fit is invalid there).
    """
    denominator = intercept - slope * threads
    return math.inf if denominator <= 0 else scale / denominator


def softmin(x: float, y: float, p: float) -> float:
    """Smooth minimum ``(x**-p + y**-p) ** (-1/p)`` of two positive rates (p-norm of the times).

    Equivalent to adding the times ``1/x`` and ``1/y`` in an ``l_p`` norm: below ``min(x, y)``,
    tends to it as ``p`` grows, and equals ``2**(-1/p) * x`` when ``x == y``.
    """
    if x <= 0 or y <= 0:
        raise ValueError(f"softmin needs positive rates, got {x} and {y}")
    # Scale by the larger value first so large exponents cannot overflow.
    hi = max(x, y)
    return hi * ((x / hi) ** -p + (y / hi) ** -p) ** (-1.0 / p)


def nccl_bus_bandwidth(blocks: int, per_block_bytes_per_s: float, link_bytes_per_s: float, p: float,
                       efficiency: float = 1.0) -> float:
    """Bus bandwidth of ``blocks`` blocks: ``softmin_p(blocks * beta * efficiency, link)``."""
    return softmin(blocks * per_block_bytes_per_s * efficiency, link_bytes_per_s, p)


def nccl_slowdown(blocks: int, *, compute_units: int, units_per_block: float, memory_bound_fraction: float,
                  memory_bytes_per_s: float, comm_memory_bytes_per_s: float) -> float:
    """Compute slowdown from the SMs and HBM bandwidth the collective takes (``inf`` if it takes all)."""
    free_units = compute_units - blocks * units_per_block
    free_memory = memory_bytes_per_s - comm_memory_bytes_per_s
    if free_units <= 0 or free_memory <= 0:
        return math.inf
    return ((1.0 - memory_bound_fraction) * compute_units / free_units
            + memory_bound_fraction * memory_bytes_per_s / free_memory)


def fair_share_core_share(threads: float, cores: float) -> float:
    """The fraction of a core each of ``threads`` runnable threads gets on ``cores`` cores under a
    fair scheduler: ``min(1, cores / threads)``."""
    if threads <= 0 or cores <= 0:
        raise ValueError(f"fair share needs positive threads and cores, got {threads} and {cores}")
    return min(1.0, cores / threads)


def fair_share_slowdown(blocks: int, *, compute_threads: float, cores: float) -> float:
    """Compute slowdown when ``blocks`` worker threads join ``compute_threads`` busy compute
    threads on ``cores`` cores: ``max(1, (D + k)/P) / max(1, D/P)`` (``(D + k)/D`` once compute
    alone fills the cores). Workers and compute threads are equal before the scheduler."""
    return (fair_share_core_share(compute_threads, cores)
            / fair_share_core_share(compute_threads + blocks, cores))


# ----------------------------------------------------------------------------------------------
# Profile data
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantity:
    """A profile number with its provenance (``datasheet``, ``measured`` or ``assumption``)."""

    value: Any
    source: str
    ref: str = ""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU host). Rates are in SI units: FLOP/s and bytes/s."""

    name: str
    compute_unit_kind: str
    compute_units: int
    peak_dense_flop_per_s: Mapping[str, float]
    memory_bytes_per_s: float
    compute_efficiency: float
    memory_efficiency: float
    default_dtype: str

    def flop_per_s(self, dtype: str | None = None) -> float:
        """Sustained FLOP/s of training kernels: peak for ``dtype`` times the compute efficiency."""
        dtype = dtype or self.default_dtype
        if dtype not in self.peak_dense_flop_per_s:
            raise ValueError(f"device {self.name!r} has no peak rate for dtype {dtype!r}; "
                             f"known: {', '.join(sorted(self.peak_dense_flop_per_s))}")
        return self.peak_dense_flop_per_s[dtype] * self.compute_efficiency

    def bytes_per_s(self) -> float:
        """Sustained memory bandwidth of memory-bound kernels."""
        return self.memory_bytes_per_s * self.memory_efficiency


@dataclass(frozen=True)
class NetworkSpec:
    """Links seen by one device, per direction, and the ring's hop latencies."""

    devices_per_node: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    base_latency_s: float
    intra_step_latency_s: float
    inter_step_latency_s: float

    def ring_link_bytes_per_s(self, workers: int) -> float:
        """The ring's bottleneck: the intra-node link within one node, else the slower of the two."""
        if workers <= self.devices_per_node:
            return self.intra_node_bytes_per_s
        return min(self.intra_node_bytes_per_s, self.inter_node_bytes_per_s)


@dataclass(frozen=True)
class LibraFit:
    """The Libra artifact's curve fits (units: MiB/ms and total threads)."""

    reference_link_bytes_per_s: float
    thread_options: tuple[int, ...]
    max_threads_per_block: int
    overlap_bw: tuple[float, float, float, float]  # a, b, c, exponent
    solo_bw: tuple[float, float, float, float]
    slowdown: tuple[float, float, float]  # scale, intercept, slope


@dataclass(frozen=True)
class NcclStyle:
    """Parameters of the analytic (NCCL-style) form; keys are thread blocks."""

    block_options: tuple[int, ...]
    threads_per_block: int
    per_block_bytes_per_s: float
    softmin_p: float
    overlap_block_efficiency: float
    units_per_block: float  # SMs (or SM-equivalents, when measured) one block takes from compute
    memory_bytes_per_bus_byte: float
    memory_bound_fraction: float
    fusion_copy_bytes_per_s: float  # bucket bytes per second packed into (and split from) one buffer


@dataclass(frozen=True)
class FairShare:
    """Parameters of the CPU-host form: worker threads and compute threads share the cores.

    ``per_block_bytes_per_s`` is the bus rate of one worker thread with a core to itself,
    ``cores`` the host's hardware threads (shared by all its devices), ``compute_threads`` the
    runnable threads the backward pass keeps busy on the host (all devices together),
    ``fusion_copy_bytes_per_s`` the bucket bytes per second packed into one buffer and split back.
    ``pending_allreduce_s`` (optional) what one all-reduce left pending in XLA:CPU's program
    while the backward pass runs costs the step; ``optimize(overlap="auto")`` weighs it against
    the work a start/done pair would defer (`libra_jax.rewrite`). None: not known.
    ``reduce_scatter_traffic`` / ``all_gather_traffic`` (optional): the engine's seconds for
    that collective of a buffer over its all-reduce's of the same buffer at the same block
    count, measured (`collective_traffic`; None: derived from the memory each moves).
    """

    block_options: tuple[int, ...]
    threads_per_block: int
    per_block_bytes_per_s: float
    softmin_p: float
    cores: float
    compute_threads: float
    fusion_copy_bytes_per_s: float
    pending_allreduce_s: float | None = None
    reduce_scatter_traffic: float | None = None
    all_gather_traffic: float | None = None


@dataclass(frozen=True, eq=False)
class Profile:
    """A validated hardware profile. ``sources`` maps each number's dotted path to its provenance.

    A value: two profiles are equal, and hash alike, when every field but ``origin`` is
    equal (the numbers, their provenance in ``sources``, the text fields). ``origin`` (where
    it was read from) does not take part, so two loads of the same file, a copy of it
    elsewhere, and the document process 0 broadcasts to the others are one profile.
    Hashable, so a profile keys caches (``allreduce.default_blocks``) as a name does.
    """

    name: str
    origin: str
    form: str
    description: str
    device: DeviceSpec
    network: NetworkSpec
    libra_fit: LibraFit | None
    nccl_style: NcclStyle | None
    notes: tuple[str, ...]
    sources: Mapping[str, Quantity] = field(repr=False)
    fair_share: FairShare | None = None

    @functools.cached_property
    def _identity(self) -> tuple:
        # Cached: the instance is frozen (dataclasses.replace makes a new one).
        return tuple((f.name, _frozen(getattr(self, f.name))) for f in fields(self)
                     if f.name != "origin")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Profile):
            return NotImplemented
        return self is other or self._identity == other._identity

    def __hash__(self) -> int:
        return hash(self._identity)


def _frozen(value: Any) -> Any:
    """A hashable stand-in for a profile field: mappings and sequences become tuples."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return (type(value).__name__,) + tuple(_frozen(getattr(value, f.name))
                                               for f in fields(value))
    return value


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _finite(value: int | float) -> bool:
    """Finite as a float: JSON's integers are unbounded, and 10**400 is no float."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


class _Reader:
    """Walks the JSON document; every error names the dotted field path and the profile."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.sources: dict[str, Quantity] = {}

    def fail(self, path: str, problem: str) -> ValueError:
        return ValueError(f"profile {self.origin}: field '{path}' {problem}")

    def section(self, data: Mapping[str, Any], key: str, prefix: str = "",
                allowed: Iterable[str] | None = None) -> Mapping[str, Any]:
        path = prefix + key
        if key not in data:
            raise self.fail(path, "is missing")
        value = data[key]
        if not isinstance(value, Mapping):
            raise self.fail(path, f"must be an object, got {type(value).__name__}")
        if allowed is not None:
            self.no_unknown(value, path + ".", allowed)
        return value

    def no_unknown(self, data: Mapping[str, Any], prefix: str, allowed: Iterable[str]) -> None:
        allowed = set(allowed) | {"note", "notes", "ref"}
        for key in data:
            if key not in allowed and not key.startswith("_"):
                raise self.fail(prefix + key, f"is not a known field (expected one of {', '.join(sorted(allowed))})")

    def text(self, data: Mapping[str, Any], key: str, prefix: str = "", choices: Iterable[str] | None = None) -> str:
        path = prefix + key
        if key not in data:
            raise self.fail(path, "is missing")
        value = data[key]
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {value!r}")
        if choices is not None and value not in choices:
            raise self.fail(path, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def quantity(self, data: Mapping[str, Any], key: str, prefix: str = "") -> Quantity:
        path = prefix + key
        if key not in data:
            raise self.fail(path, "is missing")
        q = data[key]
        if not isinstance(q, Mapping):
            raise self.fail(path, 'must be an object {"value": ..., "source": ...}, '
                            f"got {type(q).__name__}")
        self.no_unknown(q, path + ".", ("value", "source"))
        if "value" not in q:
            raise self.fail(path + ".value", "is missing")
        if "source" not in q:
            raise self.fail(path + ".source", "is missing")
        if q["source"] not in SOURCES:
            raise self.fail(path + ".source", f"must be one of {', '.join(SOURCES)}, got {q['source']!r}")
        ref = q.get("ref", "")
        quantity = Quantity(q["value"], q["source"], ref if isinstance(ref, str) else "")
        self.sources[path] = quantity
        return quantity

    def number(self, data: Mapping[str, Any], key: str, prefix: str = "", *, minimum: float = 0.0,
               inclusive: bool = False, maximum: float | None = None) -> float:
        """A finite number ``> minimum`` (``>=`` when inclusive) and ``<= maximum``."""
        path = prefix + key
        value = self.quantity(data, key, prefix).value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise self.fail(path + ".value", f"must be a finite number, got {_short(value)}")
        if value < minimum or (value == minimum and not inclusive):
            bound = ">=" if inclusive else ">"
            raise self.fail(path + ".value", f"must be {bound} {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise self.fail(path + ".value", f"must be <= {maximum}, got {value!r}")
        return float(value)

    def integer(self, data: Mapping[str, Any], key: str, prefix: str = "", *, minimum: int = 1) -> int:
        path = prefix + key
        value = self.quantity(data, key, prefix).value
        if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
                or not _finite(value)):
            raise self.fail(path + ".value", f"must be an integer >= {minimum} (and a float's "
                            f"range), got {_short(value)}")
        return value

    def options(self, data: Mapping[str, Any], key: str, prefix: str = "") -> tuple[int, ...]:
        path = prefix + key
        value = self.quantity(data, key, prefix).value
        if (not isinstance(value, list) or not value
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 or not _finite(v)
                       for v in value)):
            raise self.fail(path + ".value", "must be a non-empty list of positive integers, "
                            f"got {_short(value)}")
        if sorted(set(value)) != value:
            raise self.fail(path + ".value", f"must be strictly increasing, got {value!r}")
        return tuple(value)


def _read_bw_fit(r: _Reader, section: Mapping[str, Any], key: str, prefix: str) -> tuple[float, float, float, float]:
    fit = r.section(section, key, prefix, ("a_mib_per_ms", "b_mib_per_ms", "c", "thread_exponent"))
    p = f"{prefix}{key}."
    return (r.number(fit, "a_mib_per_ms", p), r.number(fit, "b_mib_per_ms", p), r.number(fit, "c", p),
            r.number(fit, "thread_exponent", p))


# The fields the block-count forms (fair-share, nccl-style) share.
_BLOCK_FORM_KEYS = ("block_options", "threads_per_block", "per_block_gbyte_per_s", "softmin_p",
                    "fusion_copy_gbyte_per_s")


def _block_form_fields(r: _Reader, c: Mapping[str, Any], p: str) -> dict[str, Any]:
    """The shared fields of a block-count form, read and converted to SI units."""
    return dict(
        block_options=r.options(c, "block_options", p),
        threads_per_block=r.integer(c, "threads_per_block", p),
        per_block_bytes_per_s=r.number(c, "per_block_gbyte_per_s", p) * BYTES_PER_GBYTE,
        softmin_p=r.number(c, "softmin_p", p),
        fusion_copy_bytes_per_s=r.number(c, "fusion_copy_gbyte_per_s", p) * BYTES_PER_GBYTE,
    )


def profile_from_dict(data: Mapping[str, Any], *, origin: str = "<dict>") -> Profile:
    """Validate a parsed profile document and build a `Profile`.

    Raises ``ValueError`` naming the first missing or malformed field (dotted path) and ``origin``.
    """
    r = _Reader(origin)
    if not isinstance(data, Mapping):
        raise ValueError(f"profile {origin}: the document must be a JSON object, got {type(data).__name__}")
    r.no_unknown(data, "", ("schema_version", "name", "description", "form", "device", "network",
                            "libra_fit", "nccl_style", "fair_share", "calibration"))
    if "schema_version" not in data:
        raise r.fail("schema_version", "is missing")
    version = data["schema_version"]
    if version != SCHEMA_VERSION:
        if isinstance(version, int) and not isinstance(version, bool) and version < SCHEMA_VERSION:
            changes = "; ".join(f"{v}: {SCHEMA_CHANGES[v]}" for v in sorted(SCHEMA_CHANGES) if v > version)
            why = ("an outdated profile: re-run `libra-jax calibrate` or update it (docs/calibration.md); "
                   f"changed since: {changes}")
        elif isinstance(version, int) and not isinstance(version, bool):
            why = "written by a newer libra_jax: upgrade libra_jax or re-run `libra-jax calibrate`"
        else:
            why = "not a schema version"
        raise r.fail("schema_version", f"must be {SCHEMA_VERSION}, got {version!r} ({why})")
    if "calibration" in data and not isinstance(data["calibration"], Mapping):
        raise r.fail("calibration", f"must be an object, got {type(data['calibration']).__name__}")
    name = r.text(data, "name")
    form = r.text(data, "form", choices=FORMS)
    description = data.get("description", "")
    if not isinstance(description, str):
        raise r.fail("description", "must be a string")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise r.fail("notes", "must be a list of strings")

    d = r.section(data, "device", allowed=("name", "compute_unit_kind", "compute_units",
                                            "peak_dense_tflop_per_s", "memory_gbyte_per_s",
                                            "compute_efficiency", "memory_efficiency", "default_dtype"))
    peaks_raw = r.section(d, "peak_dense_tflop_per_s", "device.")
    peaks = {dt: r.number(peaks_raw, dt, "device.peak_dense_tflop_per_s.") * FLOP_PER_TFLOP
             for dt in peaks_raw if dt not in ("note", "notes", "ref") and not dt.startswith("_")}
    if not peaks:
        raise r.fail("device.peak_dense_tflop_per_s", "must name at least one dtype")
    default_dtype = r.text(d, "default_dtype", "device.", choices=tuple(peaks))
    device = DeviceSpec(
        name=r.text(d, "name", "device."),
        compute_unit_kind=r.text(d, "compute_unit_kind", "device.", choices=("SM", "core")),
        compute_units=r.integer(d, "compute_units", "device."),
        peak_dense_flop_per_s=peaks,
        memory_bytes_per_s=r.number(d, "memory_gbyte_per_s", "device.") * BYTES_PER_GBYTE,
        compute_efficiency=r.number(d, "compute_efficiency", "device.", maximum=1.0),
        memory_efficiency=r.number(d, "memory_efficiency", "device.", maximum=1.0),
        default_dtype=default_dtype,
    )

    n = r.section(data, "network", allowed=("devices_per_node", "intra_node_gbyte_per_s", "nic_gbit_per_s",
                                             "base_latency_us", "intra_node_step_latency_us",
                                             "inter_node_step_latency_us"))
    network = NetworkSpec(
        devices_per_node=r.integer(n, "devices_per_node", "network."),
        intra_node_bytes_per_s=r.number(n, "intra_node_gbyte_per_s", "network.") * BYTES_PER_GBYTE,
        inter_node_bytes_per_s=r.number(n, "nic_gbit_per_s", "network.") * BYTES_PER_GBIT,
        base_latency_s=r.number(n, "base_latency_us", "network.", inclusive=True) * S_PER_US,
        intra_step_latency_s=r.number(n, "intra_node_step_latency_us", "network.", inclusive=True) * S_PER_US,
        inter_step_latency_s=r.number(n, "inter_node_step_latency_us", "network.", inclusive=True) * S_PER_US,
    )

    spec = FORM_TABLE[form]
    sections: dict[str, Any] = {f.section: None for f in FORM_TABLE.values()}
    sections[spec.section] = spec.read(r, data)
    return Profile(name=name, origin=origin, form=form, description=description, device=device,
                   network=network, notes=tuple(notes), sources=dict(r.sources), **sections)


def _read_libra_fit(r: _Reader, data: Mapping[str, Any]) -> LibraFit:
    f = r.section(data, "libra_fit", allowed=("reference_link_gbit_per_s", "thread_options",
                                              "max_threads_per_block", "overlap_bw", "solo_bw", "slowdown"))
    s = r.section(f, "slowdown", "libra_fit.", ("scale", "intercept", "slope_per_thread"))
    return LibraFit(
        reference_link_bytes_per_s=r.number(f, "reference_link_gbit_per_s", "libra_fit.") * BYTES_PER_GBIT,
        thread_options=r.options(f, "thread_options", "libra_fit."),
        max_threads_per_block=r.integer(f, "max_threads_per_block", "libra_fit."),
        overlap_bw=_read_bw_fit(r, f, "overlap_bw", "libra_fit."),
        solo_bw=_read_bw_fit(r, f, "solo_bw", "libra_fit."),
        slowdown=(r.number(s, "scale", "libra_fit.slowdown."), r.number(s, "intercept", "libra_fit.slowdown."),
                  r.number(s, "slope_per_thread", "libra_fit.slowdown.", inclusive=True)),
    )


def _read_fair_share(r: _Reader, data: Mapping[str, Any]) -> FairShare:
    c = r.section(data, "fair_share", allowed=_BLOCK_FORM_KEYS + (
        "cores", "compute_threads", "pending_allreduce_us", *_TRAFFIC_KEYS.values()))
    p = "fair_share."
    return FairShare(
        **_block_form_fields(r, c, p),
        cores=r.number(c, "cores", p),
        compute_threads=r.number(c, "compute_threads", p),
        pending_allreduce_s=(r.number(c, "pending_allreduce_us", p, inclusive=True) * S_PER_US
                             if "pending_allreduce_us" in c else None),
        reduce_scatter_traffic=_optional_number(r, c, "reduce_scatter_traffic", p),
        all_gather_traffic=_optional_number(r, c, "all_gather_traffic", p),
    )


def _optional_number(r: _Reader, section: Mapping[str, Any], key: str, prefix: str) -> float | None:
    return r.number(section, key, prefix) if key in section else None


#: The fair-share form's measured `collective_traffic`, by collective: its field (and key).
_TRAFFIC_KEYS = {"reduce-scatter": "reduce_scatter_traffic", "all-gather": "all_gather_traffic"}


def _read_nccl_style(r: _Reader, data: Mapping[str, Any]) -> NcclStyle:
    c = r.section(data, "nccl_style", allowed=_BLOCK_FORM_KEYS + (
        "overlap_block_efficiency", "units_per_block", "memory_bytes_per_bus_byte",
        "memory_bound_fraction"))
    p = "nccl_style."
    return NcclStyle(
        **_block_form_fields(r, c, p),
        overlap_block_efficiency=r.number(c, "overlap_block_efficiency", p, maximum=1.0),
        units_per_block=r.number(c, "units_per_block", p, minimum=0.0),
        memory_bytes_per_bus_byte=r.number(c, "memory_bytes_per_bus_byte", p, inclusive=True),
        memory_bound_fraction=r.number(c, "memory_bound_fraction", p, inclusive=True, maximum=1.0),
    )


#: Directory of calibrated profiles (overrides the per-user cache directory).
PROFILE_DIR_ENV = config.PROFILE_DIR_ENV
calibrated_profile_dir = config.calibrated_profile_dir


def calibrated_profile_path(backend: str) -> Path:
    """The calibrated profile of ``backend`` (``"cpu"``, ``"cuda"``): ``<dir>/<backend>.json``."""
    return calibrated_profile_dir() / f"{backend}.json"


#: Built-in profile per backend, used when the backend has not been calibrated.
BUILTIN_PROFILES = {"cpu": "cpu-host", "cuda": "h100", "gpu": "h100"}
_warned_profiles: set[str] = set()


def default_profile(backend: str, builtin: str | None = None) -> str:
    """The profile ``optimize`` and ``psum(blocks=None)`` use on ``backend``: the calibrated one
    (`calibrated_profile_path`) if it exists and loads, else ``builtin`` (by default the
    backend's shipped profile). A calibrated profile that does not load is skipped with a warning
    that says why. Returns a name or a path, for `load_profile`."""
    fallback = builtin or BUILTIN_PROFILES.get(backend, "cpu-host")
    path = calibrated_profile_path(backend)
    if not path.is_file():
        return fallback
    text = str(path)
    try:
        _loaded(text)
    except (ValueError, OSError) as exc:
        if text not in _warned_profiles:
            _warned_profiles.add(text)
            config.notice("profile-ignored",
                          f"libra_jax: ignoring the calibrated profile {text}: {exc}; using {fallback!r}",
                          RuntimeWarning, stacklevel=2)
        return fallback
    return text


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int) -> Profile:
    return load_profile(path)


def _loaded(name_or_path: str | os.PathLike[str]) -> Profile:
    """`load_profile`, read once per file version (path and modification time)."""
    text = os.fspath(name_or_path)
    path = Path(text)
    if not (text.endswith(".json") or path.is_file()):
        path = PROFILE_DIR / f"{text}.json"
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        return load_profile(text)  # says what is wrong with it
    return _load_cached(text, mtime_ns)


def resolve_profile(profile: Profile | str | os.PathLike[str] | Mapping[str, Any] | None,
                    backend: str | None = None, *, who: str = "libra_jax") -> Profile:
    """The one resolution of a ``profile=`` argument into a loaded `Profile`, done once
    per ``optimize`` trace, ``explain`` or lowered ``psum(blocks=None)``: a Profile is itself;
    a name or path is loaded (once per file version); a mapping is a profile's JSON document;
    None is ``backend``'s `default_profile`. Anything else is a TypeError naming `who`."""
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, Mapping):
        return profile_from_dict(profile, origin="<profile= document>")
    if isinstance(profile, (str, os.PathLike)):
        return _loaded(profile)
    if profile is None:
        if backend is None:
            raise TypeError(f"{who}: profile=None needs a backend to take the default of")
        return _loaded(default_profile(backend))
    raise TypeError(f"{who}: profile must be a profile name, a path, a model.Profile or its "
                    f"JSON document (a dict), got {type(profile).__name__}")


def list_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON document of a validated profile, for ``profile_from_dict`` elsewhere (another
    process, a file): every number with its provenance, and the text fields. Measurement
    records (``calibration``) and per-field notes are not kept: nothing reads them to plan."""
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "name": profile.name,
                           "form": profile.form, "description": profile.description,
                           "notes": list(profile.notes)}
    for path, q in profile.sources.items():
        *parents, leaf = path.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = {"value": q.value, "source": q.source, **({"ref": q.ref} if q.ref else {})}
    device = doc.setdefault("device", {})
    device.update(name=profile.device.name, compute_unit_kind=profile.device.compute_unit_kind,
                  default_dtype=profile.device.default_dtype)
    return doc


def load_profile(name_or_path: str | Path) -> Profile:
    """Load and validate a profile: a shipped name (``"h200"``) or a path to a JSON file."""
    text_arg = str(name_or_path)
    path = Path(text_arg)
    if not (text_arg.endswith(".json") or path.is_file()):
        path = PROFILE_DIR / f"{text_arg}.json"
        if not path.is_file():
            raise ValueError(f"unknown profile {text_arg!r}: not a file, and not one of "
                             f"{', '.join(list_profiles())}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"profile file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"profile {str(path)!r} is a directory, not a JSON file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not UTF-8 text: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not valid JSON: {exc}") from None
    return profile_from_dict(data, origin=repr(str(path)))


# ----------------------------------------------------------------------------------------------
# Profile -> CostModel
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Derivation:
    """A `CostModel` with the context that produced it.

    ``key_unit`` says what the CostModel keys count (``"total_threads"`` or ``"blocks"``);
    ``dropped`` maps each option that was removed to the reason; ``notes`` records adjustments.
    """

    cost: CostModel
    profile: str
    form: str
    workers: int
    link_bytes_per_s: float
    key_unit: str
    threads_per_block: int
    dropped: Mapping[int, str]
    notes: tuple[str, ...]

    def default_allocation(self) -> int:
        """The baselines' fixed allocation among this cost model's options
        (`planner.default_allocation`)."""
        return planner_default_allocation(self.cost.slowdown, self.key_unit)

    def launch_shape(self, key: int) -> tuple[int, int]:
        """(blocks, threads per block) that realise allocation ``key`` in a kernel launch.

        Total threads map as the artifact did: ``blocks = max(1, T // 512)``,
        ``threads = min(512, T)``.
        """
        if key not in self.cost.slowdown:
            raise ValueError(f"allocation {key} is not an option of this cost model")
        if self.key_unit == "blocks":
            return key, self.threads_per_block
        return max(1, key // self.threads_per_block), min(self.threads_per_block, key)

    # The block count of a call is chosen here, once: the planner works in allocation keys,
    # and every call's ``blocks`` comes from one of these (rewrite, and the lowering of a
    # collective left at ``blocks=None``), never from a conversion of its own.

    def launch_blocks(self, key: int) -> int:
        """The block count a call is launched with for allocation ``key``: `launch_shape`'s
        blocks, 1..`MAX_LAUNCH_BLOCKS`."""
        return min(MAX_LAUNCH_BLOCKS, max(1, self.launch_shape(key)[0]))

    def key_for_blocks(self, blocks: int) -> int:
        """The allocation that stands for a fixed block count in the model: the option whose
        launch is nearest `blocks` (the smaller on a tie)."""
        return min(self.cost.slowdown, key=lambda k: (abs(self.launch_shape(k)[0] - blocks), k))

    def no_overlap_key(self, nbytes: int, collective: str = "all-reduce") -> int:
        """The allocation of a `collective` (the model's name) of `nbytes` with no overlapped
        compute known (`planner.no_overlap_allocation`)."""
        return no_overlap_allocation(self.cost, nbytes, lambda k: self.launch_shape(k)[0],
                                     collective)

    def no_overlap_blocks(self, nbytes: int, collective: str = "all-reduce") -> int:
        """`no_overlap_key`'s block count (`launch_blocks`): a call's ``blocks=None``."""
        return self.launch_blocks(self.no_overlap_key(nbytes, collective))


_OptionTables = tuple[dict[int, float], dict[int, float], dict[int, float]]  # solo, overlap, slowdown


def _libra_fit_options(profile: Profile, link: float, algo: float, dropped: dict[int, str],
                       notes: list[str]) -> _OptionTables:
    fit = profile.libra_fit
    assert fit is not None
    scale = link / fit.reference_link_bytes_per_s
    solo: dict[int, float] = {}
    overlap: dict[int, float] = {}
    slowdown: dict[int, float] = {}
    for base in fit.thread_options:
        key = max(1, round(base * scale))
        if key in slowdown or key in dropped:
            continue
        eff = key / scale  # bandwidth fits evaluated at T/k ...
        bw_o = libra_bandwidth_mib_per_ms(eff, *fit.overlap_bw) * scale  # ... and multiplied by k
        bw_s = libra_bandwidth_mib_per_ms(eff, *fit.solo_bw) * scale
        slow = libra_slowdown(key, *fit.slowdown)  # slowdown at T itself
        if not math.isfinite(slow):
            pole = fit.slowdown[1] / fit.slowdown[2]
            dropped[key] = (f"slowdown fit {fit.slowdown[0]:g}/({fit.slowdown[1]:g} - {fit.slowdown[2]:g}*T) "
                            f"has its pole at T = {pole:.0f}; T = {key} is beyond it")
            continue
        if bw_o <= 0 or bw_s <= 0:
            dropped[key] = (f"bandwidth fit is not positive at T/k = {eff:g} threads "
                            f"(overlapped {bw_o:.3g}, solo {bw_s:.3g} MiB/ms)")
            continue
        if slow < 1.0:
            notes.append(f"T = {key}: fitted slowdown {slow:.4f} < 1 raised to 1")
            slow = 1.0
        if bw_o > bw_s:
            notes.append(f"T = {key}: overlapped fit {bw_o:.4f} > solo fit {bw_s:.4f} MiB/ms; capped at solo")
            bw_o = bw_s
        to_grad = BYTES_PER_S_PER_MIB_PER_MS * algo
        solo[key], overlap[key], slowdown[key] = bw_s * to_grad, bw_o * to_grad, slow
    return solo, overlap, slowdown


def _nccl_style_options(profile: Profile, link: float, algo: float, dropped: dict[int, str],
                        notes: list[str]) -> _OptionTables:
    c = profile.nccl_style
    assert c is not None
    dev = profile.device
    solo: dict[int, float] = {}
    overlap: dict[int, float] = {}
    slowdown: dict[int, float] = {}
    for k in c.block_options:
        if k * c.units_per_block >= dev.compute_units:
            dropped[k] = (f"{k} blocks would occupy all {dev.compute_units} "
                          f"{dev.compute_unit_kind}s, leaving none for compute")
            continue
        bus_s = nccl_bus_bandwidth(k, c.per_block_bytes_per_s, link, c.softmin_p)
        bus_o = nccl_bus_bandwidth(k, c.per_block_bytes_per_s, link, c.softmin_p, c.overlap_block_efficiency)
        traffic = c.memory_bytes_per_bus_byte * bus_o
        slow = nccl_slowdown(k, compute_units=dev.compute_units, units_per_block=c.units_per_block,
                             memory_bound_fraction=c.memory_bound_fraction,
                             memory_bytes_per_s=dev.memory_bytes_per_s, comm_memory_bytes_per_s=traffic)
        if not math.isfinite(slow):
            dropped[k] = (f"the collective's memory traffic {traffic / BYTES_PER_GBYTE:.0f} GB/s "
                          f"would take all {dev.memory_bytes_per_s / BYTES_PER_GBYTE:.0f} GB/s")
            continue
        solo[k], overlap[k], slowdown[k] = bus_s * algo, bus_o * algo, slow
    return solo, overlap, slowdown


def _fair_share_options(profile: Profile, link: float, algo: float, dropped: dict[int, str],
                        notes: list[str]) -> _OptionTables:
    c = profile.fair_share
    assert c is not None
    solo: dict[int, float] = {}
    overlap: dict[int, float] = {}
    slowdown: dict[int, float] = {}
    for k in c.block_options:
        cores_alone = k * fair_share_core_share(k, c.cores)  # min(k, P)
        cores_beside = k * fair_share_core_share(k + c.compute_threads, c.cores)
        solo[k] = nccl_bus_bandwidth(1, cores_alone * c.per_block_bytes_per_s, link, c.softmin_p) * algo
        overlap[k] = nccl_bus_bandwidth(1, cores_beside * c.per_block_bytes_per_s, link, c.softmin_p) * algo
        slowdown[k] = fair_share_slowdown(k, compute_threads=c.compute_threads, cores=c.cores)
    return solo, overlap, slowdown


class _Form(NamedTuple):
    """One profile form: its section of the document (and field of `Profile`), how it is
    read, and how it becomes a cost model's options, keys and fusion cost."""

    section: str
    read: Callable[[_Reader, Mapping[str, Any]], Any]
    options: Callable[[Profile, float, float, dict[int, str], list[str]], _OptionTables]
    key_unit: str  # what the cost model's keys count
    threads_per_block: Callable[[Any], int]  # of the section's value
    #: The bucket bytes per second at which a fused bucket is packed and split back: the
    #: profile's ``fusion_copy_gbyte_per_s``; the Libra artifact's fit prices fusion at nothing
    #: (as the paper does).
    fusion_copy_rate: Callable[[Any], float]


#: Every form, by name: the one place a form is dispatched on.
FORM_TABLE: Mapping[str, _Form] = MappingProxyType({
    "libra-fit": _Form("libra_fit", _read_libra_fit, _libra_fit_options, "total_threads",
                       lambda f: f.max_threads_per_block, lambda f: math.inf),
    "nccl-style": _Form("nccl_style", _read_nccl_style, _nccl_style_options, "blocks",
                        lambda f: f.threads_per_block, lambda f: f.fusion_copy_bytes_per_s),
    "fair-share": _Form("fair_share", _read_fair_share, _fair_share_options, "blocks",
                        lambda f: f.threads_per_block, lambda f: f.fusion_copy_bytes_per_s),
})
assert tuple(FORM_TABLE) == FORMS


def derive(profile: Profile | str | Path, workers: int, *, link_gbit_per_s: float | None = None,
           max_blocks: int | None = None, max_blocks_why: str = "") -> Derivation:
    """Build the cost model of ``profile`` for a ring of ``workers`` ranks.

    ``link_gbit_per_s`` overrides the ring's bottleneck link (per direction, per device); by
    default it is the intra-node link when all workers fit in one node, else the slower of the
    intra-node link and the NIC. For ``libra-fit`` profiles the link sets ``k = link / reference``
    in the faster-network rule. ``max_blocks`` drops the options that launch more blocks
    than the data path may take (`libra_jax.rewrite`: the loaded NCCL's CTA limit), each with
    ``max_blocks_why`` as its reason in `Derivation.dropped`. Raises ``ValueError`` if no
    option survives.
    """
    if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int)
                                   or max_blocks < 1):
        raise ValueError(f"max_blocks must be a positive integer, got {max_blocks!r}")
    return _derive(resolve_profile(profile), workers, link_gbit_per_s, max_blocks, max_blocks_why)


@functools.lru_cache(maxsize=256)
def _derive(profile: Profile, workers: int, link_gbit_per_s: float | None,
            max_blocks: int | None = None, max_blocks_why: str = "") -> Derivation:
    """`derive`, once per (profile value, workers, link, cap): a Profile is a hashable value."""
    _check_workers(workers)
    if link_gbit_per_s is None:
        link = profile.network.ring_link_bytes_per_s(workers)
    else:
        if not (isinstance(link_gbit_per_s, (int, float)) and math.isfinite(link_gbit_per_s) and link_gbit_per_s > 0):
            raise ValueError(f"link_gbit_per_s must be positive and finite, got {link_gbit_per_s!r}")
        link = link_gbit_per_s * BYTES_PER_GBIT
    algo = ring_algo_factor(workers)
    dropped: dict[int, str] = {}
    notes: list[str] = []
    spec = FORM_TABLE[profile.form]
    section = getattr(profile, spec.section)
    solo, overlap, slowdown = spec.options(profile, link, algo, dropped, notes)
    key_unit, tpb = spec.key_unit, spec.threads_per_block(section)
    if max_blocks is not None:
        for key in list(slowdown):
            blocks = key if key_unit == "blocks" else max(1, key // tpb)
            if blocks > max_blocks:
                dropped[key] = (f"{blocks} blocks, above the {max_blocks} the all-reduce may take"
                                + (f" ({max_blocks_why})" if max_blocks_why else ""))
                del solo[key], overlap[key], slowdown[key]
    if not slowdown:
        reasons = "; ".join(f"{k}: {why}" for k, why in sorted(dropped.items()))
        raise ValueError(f"profile {profile.name!r} leaves no valid allocation for {workers} workers ({reasons})")
    others = {}
    for collective in COLLECTIVES[1:]:
        traffic, _ = collective_traffic(profile, collective, workers)
        others[collective] = CollectiveTerms(ring_latency_s(profile.network, workers, collective), traffic)
    cost = CostModel(latency_s=ring_latency_s(profile.network, workers), solo_bw=solo, overlap_bw=overlap,
                     slowdown=slowdown, pack_s_per_byte=1.0 / spec.fusion_copy_rate(section),
                     collectives=others)
    return Derivation(cost=cost, profile=profile.name, form=profile.form, workers=workers, link_bytes_per_s=link,
                      key_unit=key_unit, threads_per_block=tpb,
                      dropped=MappingProxyType(dict(sorted(dropped.items()))),
                      notes=tuple(notes))


def collective_traffic(profile: Profile, collective: str, workers: int) -> tuple[float, str]:
    """`collective`'s seconds per gradient byte over the all-reduce's, at the same allocation
    (`planner.CollectiveTerms.traffic`), and where the number comes from.

    The GPU forms price rings: the ratio of the collectives' bus fractions (`COLLECTIVE_SHAPES`;
    1/2 for either half of the all-reduce). The CPU engine is no ring: the fair-share form
    takes the profile's measured ratio (``fair_share.<collective>_traffic``,
    ``benchmarks/sharded_cpu.py``) where it has one, else the ratio of the memory each moves
    (``engine_traffic``: (n+1)/(2n), 9/16 at 8 ranks).
    """
    if collective == "all-reduce":
        return 1.0, "the all-reduce"
    shape, ring = COLLECTIVE_SHAPES[collective], COLLECTIVE_SHAPES["all-reduce"]
    if profile.fair_share is None:
        return shape.bus_fraction(workers) / ring.bus_fraction(workers), "ring bus fractions"
    measured = getattr(profile.fair_share, _TRAFFIC_KEYS[collective])
    if measured is not None:
        return measured, f"fair_share.{_TRAFFIC_KEYS[collective]}"
    return (shape.engine_traffic(workers) / ring.engine_traffic(workers),
            "the engine's memory traffic (not measured)")


def cost_model(profile: Profile | str | Path, workers: int, *, link_gbit_per_s: float | None = None) -> CostModel:
    """Shorthand for ``derive(...).cost``."""
    return derive(profile, workers, link_gbit_per_s=link_gbit_per_s).cost
