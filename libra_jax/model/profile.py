"""A hardware profile: its schema's constants, the units every number is named in, and the
validated dataclasses a profile is read into (`Profile`: a device, a network, one form's
fitted or datasheet terms). Reading and loading: `libra_jax.model.read`.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from libra_jax.collectives import ROWS

#: The most blocks a call is launched with: the CPU engine's pool (``kMaxBlocks``,
#: cpp/libra/engine.h; tests/test_model.py checks the extension says the same).
MAX_LAUNCH_BLOCKS = 64

SCHEMA_VERSION = 3
SOURCES = ("datasheet", "measured", "assumption")
FORMS = ("libra-fit", "nccl-style", "fair-share")
#: What changed in each schema version (the error for an outdated profile names it).
SCHEMA_CHANGES = {
    2: "the 'fair-share' form (CPU hosts) and 'fusion_copy_gbyte_per_s' (the cost of packing a "
       "fused bucket) in 'nccl_style'; base_latency_us of calibrated CPU profiles no longer "
       "includes the ranks' arrival skew",
    3: "'call_us' (what one more call costs a step beside its latency) in 'nccl_style' and "
       "'fair_share', 'overlap_block_efficiency' in 'fair_share' too; 'fusion_copy_gbyte_per_s' "
       "may be null (nothing is copied: the members are taken as they are); base_latency_us of "
       "calibrated CPU profiles is the engine's own latency again",
}
PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"

# Unit conversions (named, so that every scale factor in this file is visible).
BYTES_PER_MIB = 1 << 20
MS_PER_S = 1e3
BYTES_PER_S_PER_MIB_PER_MS = BYTES_PER_MIB * MS_PER_S
BYTES_PER_GBYTE = 1e9
BYTES_PER_GBIT = 1e9 / 8
S_PER_US = 1e-6
S_PER_MS = 1e-3
FLOP_PER_TFLOP = 1e12


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
    call_s: float  # what one more call costs the compute stream beside its latency


@dataclass(frozen=True)
class FairShare:
    """Parameters of the CPU-host form: worker threads and compute threads share the cores.

    ``per_block_bytes_per_s`` is the bus rate of one worker thread with a core to itself,
    ``cores`` the host's hardware threads (shared by all its devices), ``compute_threads`` the
    runnable threads the backward pass keeps busy on the host (all devices together),
    ``fusion_copy_bytes_per_s`` the bucket bytes per second packed into one buffer and split back
    (inf: nothing is copied, the engine takes a bucket's members where they are),
    ``overlap_block_efficiency`` the fraction of a worker's rate kept beside compute (cache and
    memory contention the fair share does not see), ``call_s`` what one more call costs the
    compute stream beside its latency (the ranks' hand-offs): both measured in train steps.
    ``pending_allreduce_s`` (optional) what one all-reduce left pending in XLA:CPU's program
    while the backward pass runs costs the step; ``optimize(overlap="auto")`` weighs it against
    the work a start/done pair would defer (`libra_jax.rewrite`). None: not known.
    ``reduce_scatter_traffic`` / ``all_gather_traffic`` / ``all_to_all_traffic`` (optional,
    one per kind's row: `collectives.Collective.traffic_key`): the engine's seconds for
    that collective of a buffer over its all-reduce's of the same buffer at the same block
    count, measured (`collective_traffic`; None: derived from the memory each moves).
    ``xla_call_s`` / ``xla_bytes_per_s`` (optional) how XLA:CPU runs the plain step's
    all-reduce (`planner.StepPrice`): what one operand's call costs (its device threads'
    rendezvous) and its bytes per rank a second, fresh output buffer written; None: the documented defaults,
    `XLA_CPU_ALLREDUCE_CALL_S` and `XLA_CPU_ALLREDUCE_BYTES_PER_S`.
    ``sync_stagger`` (optional) how far behind the others the last device reaches a blocking
    collective, seconds per root second of the compute since the devices last met (their
    threads' time slices are a random walk where they share the cores); the step price
    charges each program's synchronizations with it (`planner.price_step`). None: 0.
    """

    block_options: tuple[int, ...]
    threads_per_block: int
    per_block_bytes_per_s: float
    softmin_p: float
    cores: float
    compute_threads: float
    fusion_copy_bytes_per_s: float
    overlap_block_efficiency: float
    call_s: float
    pending_allreduce_s: float | None = None
    reduce_scatter_traffic: float | None = None
    all_gather_traffic: float | None = None
    all_to_all_traffic: float | None = None
    xla_call_s: float | None = None
    xla_bytes_per_s: float | None = None
    sync_stagger: float | None = None

    def xla_terms(self) -> tuple[float, float]:
        """(seconds an operand's call, bytes per rank a second) of XLA:CPU's all-reduce: the profile's
        ``xla_allreduce_call_us`` and ``xla_allreduce_gbyte_per_s``, else the defaults."""
        return (XLA_CPU_ALLREDUCE_CALL_S if self.xla_call_s is None else self.xla_call_s,
                XLA_CPU_ALLREDUCE_BYTES_PER_S if self.xla_bytes_per_s is None
                else self.xla_bytes_per_s)


#: XLA:CPU's all-reduce (`jax.lax.psum` in a jitted program, 8 host devices on the 2-core VM,
#: float32; benchmarks/results/allreduce_cpu.md, 2026-12-01, medians of 60 interleaved
#: repetitions). Per operand (XLA:CPU's all-reduce thunk runs one rendezvous of every rank per
#: operand of a combined all-reduce): psum's 1 KiB call (0.328 ms) less what the same harness
#: adds to libra's (its 1 KiB call, 0.249 ms, less the 73 us `cpu-host` prices it at in a
#: step: base_latency_us + call_us), 0.152 ms. Per byte: the slope of psum's medians from 1 KiB
#: to 16 MiB (14.083 ms), bytes per rank a second with a fresh output written (4097 page faults
#: a call at 16 MiB; the 1 MiB median lies 15% under the line, in cache). The defaults of
#: ``fair_share.xla_allreduce_call_us`` and ``fair_share.xla_allreduce_gbyte_per_s``.
XLA_CPU_ALLREDUCE_CALL_S = 152e-6
XLA_CPU_ALLREDUCE_BYTES_PER_S = 1.22e9


# Every kind measured against the all-reduce has its field here (its row's traffic key).
if _unfielded := sorted({row.traffic_key for row in ROWS if row.traffic_key is not None}
                        - {f.name for f in fields(FairShare)}):
    raise TypeError(f"collectives.ROWS' traffic keys {_unfielded} are no FairShare fields")


@dataclass(frozen=True, eq=False)
class Profile:
    """A validated hardware profile. ``sources`` maps each number's dotted path to its provenance.

    A value: two profiles are equal, and hash alike, when every field but ``origin`` is
    equal (the numbers, their provenance in ``sources``, the text fields). ``origin`` (where
    it was read from) does not take part, so two loads of the same file, a copy of it
    elsewhere, and the document process 0 broadcasts to the others are one profile.
    Hashable, so a profile keys caches (``dropins.default_blocks``) as a name does.
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
