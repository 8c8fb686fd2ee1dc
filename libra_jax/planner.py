"""Libra's planner: per-bucket thread-block allocation co-optimised with tensor fusion.

During the backward pass, gradients become ready layer by layer and are all-reduced in
buckets while the rest of the backward pass runs. For every bucket we pick an allocation ``k``
(more blocks: a faster all-reduce, but slower overlapped compute) and, with fusion, where the
bucket boundaries fall, so that the backward pass ends as early as possible.

Model (`simulate`, exact)
-------------------------------
Layers run back to back on one compute stream and never wait for communication. A bucket is
ready when its last layer ends; a bucket of 0 bytes issues no collective. Collectives run one
at a time in bucket order, each starting at max(ready, previous collective's end). A collective
of a fused bucket (two or more non-empty gradients) first packs them into one buffer on the
compute stream: ``pack_s_per_byte * bytes`` seconds in which compute makes no progress. Then it
spends ``latency_s``, then moves its bytes at ``overlap_bw[k]`` while compute still runs and at
``solo_bw[k]`` once compute has finished. While it is active (latency included) compute runs at
``1/slowdown[k]`` of full speed. Backward time is the end of the last collective or of compute,
whichever is later. With ``reach``, only buckets whose every gradient may wait for the bucket's
last one are allowed (`plan`; a gradient used before a later one is computed cannot).

Collectives. Each layer names what reduces its gradient (`Layer.collective`): an all-reduce
(data parallelism) or a reduce-scatter (a parameter sharded over the ranks: FSDP). A bucket holds
one collective, as if ``reach`` ended every layer's run of one collective; a bucket of collective
``c`` takes ``CostModel.terms(c)``'s latency and moves its bytes times ``terms(c).traffic`` at the
tables' bandwidths, with the same slowdown. Nothing below depends on which: every argument is per
collective, the bounds take the least latency still due.

All-gathers (FSDP's parameter gathers) are planned apart (`plan_gathers`, the section "All-gathers
issued ahead"): there compute waits for the collective, and the choice is how far ahead of its
use each gather is issued, priced by the same phases and contention; exhaustive over a few
distances and the allocations, so exact for its model.

Everything the future depends on after a collective is the pair ``(T, P)``: the time the
collective ends and the compute *progress* ``P`` reached by then (seconds of full-speed work,
0 <= P <= C, C = total compute). One collective maps ``(T, P)`` to ``(E, Q)`` in closed form
(`_collective`, one short formula: latency phase, overlapped phase, solo phase).

Algorithm (`plan`)
------------------------
A forward dynamic program over bucket boundaries: every layer boundary, or with a fixed grouping
the grouping's boundaries, or with fusion and more than ``ATOMS`` layers the boundaries of about
``ATOMS`` pre-fused groups of consecutive layers (a group's share of compute plus its share of
bytes stays under ``2/ATOMS`` unless it is a single layer, so no cut moves by more than that).
Boundary ``t`` keeps a small set of states ``(T, P)`` and builds it from the states of earlier
boundaries (with fusion: all of them; fixed grouping: the previous one) times every allocation,
in one vectorised numpy expression per boundary. Rules, in the order they are applied:

* *Normalisation.* No collective can start before the next bucket's earliest ready progress
  ``R``, so a state with ``P < R`` is replaced by ``(T + R - P, R)``; states whose collectives
  all finished in time collapse to one point per boundary.
* *Idle sources.* A state with ``P <= R_t`` starts the bucket ending at ``t`` at its ready time
  ``T + R_t - P``: the state only contributes its lag ``T - P``. Per source boundary only the
  least-lag such state is expanded; a boundary whose states are all idle for every later target
  is collapsed to that single state (``R_t`` only grows with ``t``).
* *Compute finished.* Once ``P = C`` every remaining layer is ready and contention is over, so
  every remaining bucket runs at the best ``solo_bw``: with fusion, a backward DP over the
  boundaries (`_tail`, latencies against packing, within ``reach``) gives the best rest
  from every boundary; without, each remaining group. Such states become complete plans at once.
* *Reach.* Boundary ``t`` only takes sources from boundaries ``>= lo[t]`` (non-decreasing), so
  states below it are dropped for good; pre-fused groups never straddle a forbidden join.
* *Branch and bound.* The best complete plan so far (initially the uniform allocations and the
  MG-WFBP and Horovod baselines) bounds the answer by ``U``; a state is dropped when
  ``T + max(C - P, latency + bytes left / best bandwidth) > U``, and a source boundary stops
  feeding later targets once ``T + (R_t - P) + bytes left / best bandwidth > U`` for all its
  states.
* *Dominance.* ``(T, P)`` dominates ``(T', P')`` if ``T <= T'`` and ``P >= P'`` (Pareto), and
  also if ``P < P'`` but ``T + lam (P' - P) <= T'`` (Lipschitz rule below).
* *Cap.* If more than ``FRONT_CAP`` states survive at a boundary, their progress range is cut
  into ``FRONT_CAP`` equal cells and only the most advanced state of each cell is kept.

Optimality and error bound
--------------------------
Assume ``solo_bw[k] >= overlap_bw[k]`` for every ``k`` (contention never speeds a collective up;
true of every physical profile). Then one collective is monotone: a start with ``S <= S'`` and
progress ``pi >= pi'`` ends with ``E <= E'`` (its duration is non-increasing in ``pi``: more
compute done, more bytes at the solo rate) and ``Q >= Q'`` (``pi + d(pi)/slowdown`` has slope
``overlap_bw/solo_bw`` or 1 in ``pi``). The start rule ``S = T + max(0, R - P)``,
``pi = max(P, R)`` and the final time ``T + C - P`` preserve the order, so Pareto dominance is
exact. Time-shift invariance (``(T + x, P)`` evolves exactly like ``(T, P)`` delayed by ``x``)
makes the value of a state ``T + U_t(P)``, which justifies normalisation and idle sources.
A pack is a time shift of the state at the collective's start, so it keeps both properties.
Differentiating along a fixed decision sequence, the sensitivity of the final time to ``P`` is
``-1`` until an idle start or the end, ``-slowdown (1 - overlap_bw/solo_bw)`` for the one
collective during which compute ends, and 0 after either, so ``U_t`` is non-increasing and
``lam``-Lipschitz with ``lam = max(1, max_k slowdown[k] (1 - overlap_bw[k] / solo_bw[k]))``: the
Lipschitz rule is exact too. Bounds are valid lower bounds. So **without pre-fusion and while
the cap does not bind, plan is optimal** (up to float rounding). On the instances the tests
compare with `plan_exhaustive` (up to 8 layers, 4 options) fronts hold about ten states at
most, far below the cap. The
cap loses at most ``lam * cell width`` at each boundary where it binds (keeping the most
advanced state of a cell costs at most ``lam`` per second of progress given up), so the
returned time exceeds the optimum over the allowed boundaries by at most the sum of those
losses (``_search`` returns that sum; it is a worst case and loose on long plans). Pre-fusion has
no such certificate; measured gaps are in ``benchmarks/results/planner_quality.md``. If some
``k`` has ``overlap_bw > solo_bw`` the dominance rules are heuristics (``lam`` is not used).
In every case the planner also scores the uniform allocations and, with fusion, one bucket,
MG-WFBP and Horovod-style buckets (64 and 128 MiB) at every allocation, and returns the best plan
it has seen, so it is never worse than those.

Ties
----
Plans whose backward times are within ``TIE_RTOL`` (relative) are equal; among them the
preference is fewer blocks (the sum of ``blocks`` over buckets that issue a collective), then
fewer buckets, then the lexicographically smaller list of ``(first, last, blocks)``. The program
compares states on a ``TIE_RTOL`` grid and applies the same order among equal states and among
all complete plans it scores, so plans are deterministic; only `plan_exhaustive`
guarantees the globally preferred plan when two plans tie through different intermediate states.
A zero-byte bucket (no collective) carries the smallest key.

Complexity
----------
``G`` allowed boundaries (with fusion ``G = L`` up to ``ATOMS`` layers and ``G < 2 ATOMS``
beyond; otherwise the group count),
``K`` options, ``F <= FRONT_CAP`` states per boundary, ``A`` the sources of one boundary (live
source boundaries plus busy states). Each boundary costs ``O(A K log(A K))`` vectorised work; with
fusion ``A <= G + G F``, so a plan is ``O(G^2 F K log)`` in the worst case, and ``O(G F K log)``
without fusion; pre-fusion and baselines add ``O(L K)``. No chunk discretisation (the paper's DP is
``O(S L^2 Z^2 K)``). Measured: 1,000 layers with 8 options plan in about 0.1-0.3 s on a 2-core VM
(``benchmarks/results/planner_speed.md``). `simulate` is ``O(L)``. `plan_exhaustive`
enumerates all ``K (K+1)^(L-1)`` plans with fusion (``K^L`` without, ``K^G`` for a fixed grouping)
in vectorised chunks and refuses more than ``EXHAUSTIVE_LIMIT``.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, TypeGuard

import numpy as np

from libra_jax import collectives

__all__ = [
    "BLOCK_PENALTY",
    "COLLECTIVES",
    "CollectiveTerms",
    "HOROVOD_FUSION_BYTES",
    "LIBRA_DEFAULT_THREADS",
    "default_allocation",
    "POLICIES",
    "Comparison",
    "compare_policies",
    "prefuse_groups",
    "DEFAULT_PREFUSE",
    "no_overlap_allocation",
    "EXHAUSTIVE_LIMIT",
    "TIE_RTOL",
    "Bucket",
    "CostModel",
    "Layer",
    "Plan",
    "plan",
    "plan_default",
    "plan_exhaustive",
    "plan_fusion_only",
    "plan_mgwfbp",
    "simulate",
    "timeline",
    "Timeline",
    "Phases",
    "within_reach",
    "GatherStep",
    "GatherSpan",
    "GatherTimeline",
    "GatherPlan",
    "gather_timeline",
    "simulate_gathers",
    "held_bytes",
    "plan_gathers",
    "MAX_PREFETCH_DISTANCE",
]

# Constants.
EXHAUSTIVE_LIMIT = 10**7  # most candidate plans plan_exhaustive will enumerate
TIE_RTOL = 1e-12  # backward times within this relative distance are a tie
ATOMS = 128  # with fusion, layers beyond this count are pre-fused into about this many groups
FRONT_CAP = 48  # most states kept per boundary; more are thinned with a bounded loss
_BOUND_RTOL = 1e-9  # slack on branch-and-bound pruning, far above float rounding of the bounds
_EXHAUSTIVE_CHUNK = 1 << 16  # candidates simulated per vectorised step in plan_exhaustive
#: Horovod 0.20.3's HOROVOD_FUSION_THRESHOLD default (the version Libra patched): the default
#: policy's fusion threshold.
HOROVOD_FUSION_BYTES = 64 << 20
#: The Libra artifact's "default" baseline allocation: 2048 threads for every group.
LIBRA_DEFAULT_THREADS = 2048
_HOROVOD_THRESHOLDS = (HOROVOD_FUSION_BYTES, 2 * HOROVOD_FUSION_BYTES)  # scored as a safety net


def default_allocation(options: Iterable[int], key_unit: str) -> int:
    """The baselines' fixed allocation among a cost model's `options`: 2048 threads (the
    artifact's default) where allocations count total threads, else the largest option
    (NCCL opens as many channels as the topology allows)."""
    keys = sorted(options)
    if key_unit == "total_threads" and LIBRA_DEFAULT_THREADS in keys:
        return LIBRA_DEFAULT_THREADS
    return keys[-1]


#: With no overlap known, a block costs this fraction of the all-reduce's time (the SM
#: penalty NCCL's symmetric kernels used): `no_overlap_allocation`.
BLOCK_PENALTY = 0.025


def no_overlap_allocation(cost: CostModel, nbytes: float, blocks_of: Callable[[int], int],
                          collective: str = "all-reduce") -> int:
    """The allocation of a `collective` of `nbytes` per rank (a reduce-scatter's input, an
    all-gather's output) with no overlapped compute known (``psum(blocks=None)`` outside
    `optimize`): the option that minimises its predicted time times (1 + `BLOCK_PENALTY` x
    blocks), `blocks_of(key)` being the option's block count, so that more blocks must buy
    proportionally more speed. Ties go to fewer blocks."""
    terms = cost.terms(collective)

    def score(key: int) -> tuple[float, int]:
        blocks = blocks_of(key)
        seconds = terms.latency_s + nbytes * terms.traffic / cost.solo_bw[key]
        return seconds * (1 + BLOCK_PENALTY * blocks), blocks

    return min(sorted(cost.solo_bw), key=score)


# ---------------------------------------------------------------------------------------------
# Inputs and outputs
# ---------------------------------------------------------------------------------------------


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: The collectives a bucket may issue (the model's names of `libra_jax.collectives`' rows). A
#: data-parallel gradient is all-reduced; a sharded parameter's (FSDP, ZeRO-3) is
#: reduce-scattered; the all-gather is priced by the same terms.
COLLECTIVES: tuple[str, ...] = collectives.KINDS


@dataclass(frozen=True)
class Layer:
    """One layer of the backward pass, listed in backward order (first = finishes first).

    ``compute_s`` is its backward compute at full speed (seconds); ``grad_bytes`` the size of the
    gradient it produces, ready for its collective when the layer ends (the unsharded buffer:
    a reduce-scatter's input); ``collective`` (one of `COLLECTIVES`) what reduces it. A bucket
    holds layers of one collective only.
    """

    compute_s: float
    grad_bytes: int
    collective: str = "all-reduce"

    def __post_init__(self) -> None:
        if not _is_real(self.compute_s) or not math.isfinite(self.compute_s) or self.compute_s < 0:
            raise ValueError(f"Layer.compute_s must be a finite number >= 0, got {self.compute_s!r}")
        if not _is_int(self.grad_bytes) or self.grad_bytes < 0:
            raise ValueError(f"Layer.grad_bytes must be an integer >= 0, got {self.grad_bytes!r}")
        if self.collective not in COLLECTIVES:
            raise ValueError(f"Layer.collective must be one of {', '.join(COLLECTIVES)}, "
                             f"got {self.collective!r}")
        object.__setattr__(self, "compute_s", float(self.compute_s))
        object.__setattr__(self, "grad_bytes", int(self.grad_bytes))


@dataclass(frozen=True)
class CollectiveTerms:
    """How a collective other than the all-reduce is priced against a `CostModel`'s tables.

    ``latency_s`` replaces the all-reduce's latency; ``traffic`` multiplies its bytes: the
    seconds per gradient byte it takes over the all-reduce's at the same allocation (a ring
    reduce-scatter moves half of an all-reduce's bytes in half its steps: 0.5). Allocation
    and contention are the all-reduce's (the same blocks move the bytes beside the same
    compute), so ``slowdown`` applies as it is.
    """

    latency_s: float
    traffic: float

    def __post_init__(self) -> None:
        for name in ("latency_s", "traffic"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 0 or (name == "traffic" and value == 0):
                need = "> 0" if name == "traffic" else ">= 0"
                raise ValueError(f"CollectiveTerms.{name} must be a finite number {need}, got {value!r}")
            object.__setattr__(self, name, float(value))


def _frozen_table(name: str, table: Mapping[int, float], minimum: float, strict: bool) -> Mapping[int, float]:
    """Validate one per-allocation table and return a read-only copy sorted by key."""
    if not isinstance(table, Mapping):
        raise ValueError(f"CostModel.{name} must be a mapping from allocation to value, got {type(table).__name__}")
    if not table:
        raise ValueError(f"CostModel.{name} is empty: at least one allocation is needed")
    out: dict[int, float] = {}
    for key in sorted(table, key=lambda k: (not _is_int(k), k if _is_int(k) else 0)):
        value = table[key]
        if not _is_int(key) or key <= 0:
            raise ValueError(f"CostModel.{name} keys must be positive integers, got {key!r}")
        bad = not _is_real(value) or not math.isfinite(value) or (value <= minimum if strict else value < minimum)
        if bad:
            need = f"> {minimum:g}" if strict else f">= {minimum:g}"
            raise ValueError(f"CostModel.{name}[{key}] must be finite and {need}, got {value!r}")
        out[int(key)] = float(value)
    return MappingProxyType(out)


@dataclass(frozen=True)
class CostModel:
    """Per-allocation communication and contention costs.

    The keys of the three tables are the allowed allocations (block counts for this package's
    kernels; a profile may use another integer unit such as total threads) and must be the same
    in all three. Bandwidths are in gradient bytes per second: ``solo_bw[k]`` when no compute
    runs, ``overlap_bw[k]`` while compute runs. ``slowdown[k] >= 1`` divides compute speed while a
    collective with allocation ``k`` is active, its ``latency_s`` included. ``pack_s_per_byte``
    prices fused buckets (`pack_s`): packing them into one buffer takes the compute stream
    that long before the collective's latency starts (0: fusion is free, as in the paper).

    The tables and ``latency_s`` are the all-reduce's; ``collectives`` prices the others a
    layer may ask for (`Layer.collective`), each by its `CollectiveTerms`: a bucket of
    ``b`` bytes of collective ``c`` costs ``pack_s + terms(c).latency_s + b * terms(c).traffic
    / bw[k]`` (`terms`).
    """

    latency_s: float
    solo_bw: Mapping[int, float]
    overlap_bw: Mapping[int, float]
    slowdown: Mapping[int, float]
    pack_s_per_byte: float = 0.0
    collectives: Mapping[str, CollectiveTerms] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        lat = self.latency_s
        if not _is_real(lat) or not math.isfinite(lat) or lat < 0:
            raise ValueError(f"CostModel.latency_s must be a finite number >= 0, got {lat!r}")
        object.__setattr__(self, "latency_s", float(lat))
        pack = self.pack_s_per_byte
        if not _is_real(pack) or not math.isfinite(pack) or pack < 0:
            raise ValueError(f"CostModel.pack_s_per_byte must be a finite number >= 0, got {pack!r}")
        object.__setattr__(self, "pack_s_per_byte", float(pack))
        object.__setattr__(self, "solo_bw", _frozen_table("solo_bw", self.solo_bw, 0.0, strict=True))
        object.__setattr__(self, "overlap_bw", _frozen_table("overlap_bw", self.overlap_bw, 0.0, strict=True))
        object.__setattr__(self, "slowdown", _frozen_table("slowdown", self.slowdown, 1.0, strict=False))
        keys = [tuple(t) for t in (self.solo_bw, self.overlap_bw, self.slowdown)]
        if not keys[0] == keys[1] == keys[2]:
            raise ValueError(
                "CostModel tables must have the same keys: "
                f"solo_bw {list(keys[0])}, overlap_bw {list(keys[1])}, slowdown {list(keys[2])}")
        if not isinstance(self.collectives, Mapping):
            raise ValueError("CostModel.collectives must map a collective to its CollectiveTerms, "
                             f"got {type(self.collectives).__name__}")
        others = {}
        for name in COLLECTIVES[1:]:  # in table order
            if name in self.collectives:
                if not isinstance(self.collectives[name], CollectiveTerms):
                    raise ValueError(f"CostModel.collectives[{name!r}] must be CollectiveTerms, "
                                     f"got {type(self.collectives[name]).__name__}")
                others[name] = self.collectives[name]
        unknown = [c for c in self.collectives if c not in others]
        if unknown:
            raise ValueError(f"CostModel.collectives: {unknown[0]!r} is not priced this way "
                             f"(one of {', '.join(COLLECTIVES[1:])}; the all-reduce's terms are "
                             "latency_s and the tables)")
        object.__setattr__(self, "collectives", MappingProxyType(others))

    def __hash__(self) -> int:
        return hash((self.latency_s, tuple(self.solo_bw.items()), tuple(self.overlap_bw.items()),
                     tuple(self.slowdown.items()), self.pack_s_per_byte,
                     tuple(self.collectives.items())))

    def terms(self, collective: str) -> CollectiveTerms:
        """The latency and traffic of `collective` (the all-reduce's: ``latency_s`` and 1)."""
        if collective == "all-reduce":
            return CollectiveTerms(self.latency_s, 1.0)
        terms = self.collectives.get(collective)
        if terms is None:
            raise ValueError(f"this CostModel does not price the {collective}: give "
                             f"CostModel(collectives={{{collective!r}: CollectiveTerms(...)}}) "
                             "(`model.derive` prices every collective)")
        return terms

    def pack_s(self, nbytes: float, tensors: int) -> float:
        """Seconds to pack (and unpack) a bucket of ``tensors`` non-empty gradients of ``nbytes``.

        Zero for a single tensor: it is all-reduced where it lies. A fused bucket is copied into
        one buffer on the compute stream before its collective can start (and split after it).
        """
        return self.pack_s_per_byte * nbytes if tensors >= 2 else 0.0

    @property
    def keys(self) -> tuple[int, ...]:
        """The allowed allocations, ascending."""
        return tuple(self.solo_bw)


@dataclass(frozen=True)
class Bucket:
    """Layers ``first..last`` (inclusive, backward order) all-reduced together with ``blocks``."""

    first: int
    last: int
    blocks: int

    def __post_init__(self) -> None:
        for name in ("first", "last", "blocks"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"Bucket.{name} must be an integer, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.first < 0:
            raise ValueError(f"Bucket.first must be >= 0, got {self.first}")
        if self.last < self.first:
            raise ValueError(f"Bucket.last ({self.last}) must be >= Bucket.first ({self.first})")
        if self.blocks <= 0:
            raise ValueError(f"Bucket.blocks must be positive, got {self.blocks}")


@dataclass(frozen=True)
class Plan:
    """Buckets in backward order and their simulated backward time (``simulate`` of them)."""

    buckets: list[Bucket]
    backward_s: float


# ---------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------


def _check_layers(layers: Sequence[Layer]) -> list[Layer]:
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty: at least one layer is needed")
    for i, layer in enumerate(layers):
        if not isinstance(layer, Layer):
            raise ValueError(f"layers[{i}] must be a Layer, got {type(layer).__name__}")
    return layers


def _check_cost(cost: CostModel) -> CostModel:
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a CostModel, got {type(cost).__name__}")
    return cost


def _check_blocks(blocks: object, cost: CostModel) -> int:
    if not _is_int(blocks) or int(blocks) not in cost.slowdown:
        raise ValueError(f"blocks={blocks!r} is not an allocation of the cost model (keys {list(cost.keys)})")
    return int(blocks)


def _check_tiling(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    """Raise unless the inclusive ranges are contiguous, in order and cover 0..n_layers-1."""
    if not ranges:
        raise ValueError("buckets is empty: the buckets must tile the layers")
    expected = 0
    for j, (first, last) in enumerate(ranges):
        if first != expected:
            raise ValueError(f"buckets do not tile the layers: bucket {j} starts at layer {first}, expected {expected}")
        if last < first:
            raise ValueError(f"buckets do not tile the layers: bucket {j} ends at {last} before it starts at {first}")
        expected = last + 1
    if expected != n_layers:
        raise ValueError(f"buckets do not tile the layers: they cover layers 0..{expected - 1}, "
                         f"but there are {n_layers} layers")


def _grouping_ranges(buckets: Iterable[object], n_layers: int) -> list[tuple[int, int]]:
    ranges = []
    for j, b in enumerate(buckets):
        if isinstance(b, Bucket):
            first, last = b.first, b.last
        else:
            try:
                first, last = b  # type: ignore[misc]
            except (TypeError, ValueError):
                raise ValueError(f"buckets[{j}] must be a (first, last) pair, got {b!r}") from None
        if not (_is_int(first) and _is_int(last)):
            raise ValueError(f"buckets[{j}] must hold integer layer indices, got {b!r}")
        ranges.append((int(first), int(last)))
    _check_tiling(ranges, n_layers)
    return ranges


# ---------------------------------------------------------------------------------------------
# The cost formula: one collective
# ---------------------------------------------------------------------------------------------


class Phases(NamedTuple):
    """One collective's phases as the model times them (`_phases`): issued at ``start``
    with compute progress ``progress_start``; packing (compute stalls) until ``pack_end``,
    latency until ``latency_end``, overlapped transfer until ``solo_start`` (= ``latency_end``
    when compute had finished, = ``end`` when the transfer ended first), solo transfer until
    ``end``, with compute progress ``progress_end`` then."""

    start: float
    progress_start: float
    pack_end: float
    latency_end: float
    solo_start: float
    end: float
    progress_end: float


def _phases(T: float, P: float, ready: float, nbytes: float, lat: float, ob: float, sb: float,
            s: float, C: float, pack: float = 0.0) -> Phases:
    """One collective issued when the comm stream is free at time ``T`` with progress ``P``.

    ``ready`` is the progress at which the bucket's last layer ends. Phases: ``pack`` seconds of
    packing on the compute stream (compute makes no progress), ``lat`` seconds, then bytes at
    ``ob`` until compute ends and at ``sb`` after; compute runs at ``1/s`` from the latency on.
    """
    if P < ready:  # wait for the bucket at full compute speed
        T, P = T + (ready - P), ready
    start, P0 = T, P
    T += pack
    busy = (C - P) * s  # wall time compute still needs under this collective's contention
    window = busy - lat  # overlapped transfer time available after the latency
    if window <= 0:  # compute ends during the latency: all bytes at the solo rate
        return Phases(start, P0, T, T + lat, T + lat, T + lat + nbytes / sb, C)
    if nbytes <= window * ob:  # the transfer ends while compute still runs
        d = lat + nbytes / ob
        return Phases(start, P0, T, T + lat, T + d, T + d, min(C, P + d / s))
    return Phases(start, P0, T, T + lat, T + busy, T + busy + (nbytes - window * ob) / sb, C)


def _collective(T: float, P: float, ready: float, nbytes: float, lat: float, ob: float, sb: float,
                s: float, C: float, pack: float = 0.0) -> tuple[float, float]:
    """(end time, progress then) of `_phases`."""
    ph = _phases(T, P, ready, nbytes, lat, ob, sb, s, C, pack)
    return ph.end, ph.progress_end


def _collective_np(T: np.ndarray, P: np.ndarray, ready: float, nbytes: np.ndarray, lat: float, ob: np.ndarray,
                   sb: np.ndarray, s: np.ndarray, C: float,
                   pack: np.ndarray | float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """`_collective` over broadcast arrays (same formula, branch by branch)."""
    late = P < ready
    T = np.where(late, T + (ready - P), T) + pack
    P = np.where(late, ready, P)
    busy = (C - P) * s
    window = busy - lat
    cap = window * ob
    solo_only = window <= 0
    hidden = ~solo_only & (nbytes <= cap)
    d_hidden = lat + nbytes / ob
    d = np.where(solo_only, lat + nbytes / sb, np.where(hidden, d_hidden, busy + (nbytes - cap) / sb))
    Q = np.where(hidden, np.minimum(C, P + d_hidden / s), C)
    return T + d, Q


def _prefix(values: Iterable[float]) -> list[float]:
    return [0.0, *itertools.accumulate(float(v) for v in values)]


def _simulate_ranges(comp_prefix: list[float], byte_prefix: list[int], pricing: _Pricing,
                     ranges: Sequence[tuple[int, int]], ks: Sequence[int], cost: CostModel,
                     tensor_prefix: Sequence[int] | None = None) -> float:
    """`simulate` on prefix sums; `tensor_prefix` (`_tensor_prefix`, made here if not given)
    counts the layers with bytes, so that a plan scored many times counts them once."""
    C = comp_prefix[-1]
    wire, lat = pricing.wire, pricing.lat
    T = P = 0.0
    if tensor_prefix is None:
        tensor_prefix = _tensor_prefix(byte_prefix)
    for (first, last), k in zip(ranges, ks):
        nbytes = byte_prefix[last + 1] - byte_prefix[first]
        if nbytes:
            tensors = tensor_prefix[last + 1] - tensor_prefix[first]
            T, P = _collective(T, P, comp_prefix[last + 1], wire[last + 1] - wire[first], lat[last],
                               cost.overlap_bw[k], cost.solo_bw[k], cost.slowdown[k], C,
                               cost.pack_s(nbytes, tensors))
    return T + (C - P)


class _Pricing(NamedTuple):
    """What each layer's collective (`Layer.collective`, `CostModel.terms`) makes of it:
    ``wire``, prefix sums of the bytes as the tables price them (bytes times the collective's
    traffic; the bytes themselves for the all-reduce); ``lat``, per layer, its collective's
    latency; ``runs``, per layer, the last layer of its run of one collective (a bucket holds
    one collective: `plan`'s ``reach`` is cut there), or None where all are one."""

    wire: list[float]
    lat: list[float]
    runs: list[int] | None


def _pricing(layers: Sequence[Layer], cost: CostModel) -> _Pricing:
    terms = {c: cost.terms(c) for c in dict.fromkeys(layer.collective for layer in layers)}
    wire = [0.0, *itertools.accumulate(layer.grad_bytes * terms[layer.collective].traffic
                                       for layer in layers)]
    lat = [terms[layer.collective].latency_s for layer in layers]
    if len(terms) == 1:
        return _Pricing(wire, lat, None)
    runs = [len(layers) - 1] * len(layers)
    for i in range(len(layers) - 2, -1, -1):
        same = layers[i + 1].collective == layers[i].collective
        runs[i] = runs[i + 1] if same else i
    return _Pricing(wire, lat, runs)


def _with_runs(reach: Sequence[int] | None, pricing: _Pricing) -> list[int] | None:
    """`reach` cut at the end of each layer's run of one collective."""
    if pricing.runs is None:
        return None if reach is None else list(reach)
    if reach is None:
        return list(pricing.runs)
    return [min(r, e) for r, e in zip(reach, pricing.runs)]


def _check_one_collective(layers: Sequence[Layer], ranges: Sequence[tuple[int, int]]) -> None:
    """Raise unless every bucket of `ranges` holds layers of one collective."""
    for j, (first, last) in enumerate(ranges):
        for i in range(first + 1, last + 1):
            if layers[i].collective != layers[first].collective:
                raise ValueError(f"bucket {j} (layers {first}..{last}) mixes the "
                                 f"{layers[first].collective} of layer {first} and the "
                                 f"{layers[i].collective} of layer {i}: a bucket holds one "
                                 "collective")


def _tensor_prefix(byte_prefix: Sequence[int]) -> list[int]:
    """Prefix counts of the layers that have bytes (the tensors a bucket packs)."""
    return [0, *itertools.accumulate(int(byte_prefix[i + 1] > byte_prefix[i])
                                     for i in range(len(byte_prefix) - 1))]


def simulate(layers: Sequence[Layer], buckets: Sequence[Bucket], cost: CostModel) -> float:
    """Backward seconds of ``buckets`` (which must tile ``layers``) under ``cost``; see the module doc."""
    layers = _check_layers(layers)
    cost = _check_cost(cost)
    buckets = list(buckets)
    for j, b in enumerate(buckets):
        if not isinstance(b, Bucket):
            raise ValueError(f"buckets[{j}] must be a Bucket, got {type(b).__name__}")
        if b.blocks not in cost.slowdown:
            raise ValueError(f"buckets[{j}].blocks={b.blocks} is not an allocation of the cost model "
                             f"(keys {list(cost.keys)})")
    ranges = [(b.first, b.last) for b in buckets]
    _check_tiling(ranges, len(layers))
    _check_one_collective(layers, ranges)
    return _simulate_ranges(_prefix(l.compute_s for l in layers), _byte_prefix(layers),
                            _pricing(layers, cost), ranges, [b.blocks for b in buckets], cost)


@dataclass(frozen=True)
class Timeline:
    """A plan as the model times it (`timeline`): each non-empty bucket's collective
    (``collectives``: bucket index, blocks, bytes, its `Phases`) and the compute stream as
    segments ``(t0, t1, progress at t0, progress at t1, slowdown)`` of constant speed, in time
    order, back to back from 0 until compute ends (slowdown inf: a bucket being packed on the
    compute stream, no progress; after compute ends, only those). ``backward_s`` equals
    `simulate`."""

    collectives: tuple[tuple[int, int, int, Phases], ...]
    compute: tuple[tuple[float, float, float, float, float], ...]
    compute_end: float
    backward_s: float


def timeline(layers: Sequence[Layer], buckets: Sequence[Bucket], cost: CostModel) -> Timeline:
    """The phases of every collective of ``buckets`` and the compute stream's progress over time,
    from the same formula `simulate` uses (`_phases`)."""
    layers = _check_layers(layers)
    if not layers:
        raise ValueError("layers must not be empty")
    ranges = [(b.first, b.last) for b in buckets]
    _check_tiling(ranges, len(layers))
    _check_one_collective(layers, ranges)
    for b in buckets:
        if b.blocks not in cost.slowdown:
            raise ValueError(f"bucket {b} uses allocation {b.blocks}, which is not in the cost model")
    comp, byts = _prefix(l.compute_s for l in layers), _byte_prefix(layers)
    pricing = _pricing(layers, cost)
    C = comp[-1]
    T = P = 0.0
    colls: list[tuple[int, int, int, Phases]] = []
    segments: list[tuple[float, float, float, float, float]] = []
    for j, b in enumerate(buckets):
        nbytes = byts[b.last + 1] - byts[b.first]
        if not nbytes:
            continue
        k = b.blocks
        tensors = sum(byts[i + 1] > byts[i] for i in range(b.first, b.last + 1))
        ph = _phases(T, P, comp[b.last + 1], pricing.wire[b.last + 1] - pricing.wire[b.first],
                     pricing.lat[b.last], cost.overlap_bw[k], cost.solo_bw[k], cost.slowdown[k], C,
                     cost.pack_s(nbytes, tensors))
        if ph.start > T:  # waited for the bucket: compute alone at full speed
            segments.append((T, ph.start, P, ph.progress_start, 1.0))
        if ph.pack_end > ph.start:
            segments.append((ph.start, ph.pack_end, ph.progress_start, ph.progress_start, math.inf))
        # Contended from the end of packing until compute ends or the collective does.
        compute_stop = (ph.end if ph.progress_end < C
                        else ph.pack_end + (C - ph.progress_start) * cost.slowdown[k])
        if ph.progress_end > ph.progress_start:
            segments.append((ph.pack_end, compute_stop, ph.progress_start, ph.progress_end, cost.slowdown[k]))
        colls.append((j, k, nbytes, ph))
        T, P = ph.end, ph.progress_end
    if P < C:
        segments.append((T, T + (C - P), P, C, 1.0))
    compute_end = next((seg[1] for seg in reversed(segments) if seg[3] >= C), 0.0) if C > 0 else 0.0
    return Timeline(tuple(colls), tuple(segments), compute_end, T + (C - P))


# ---------------------------------------------------------------------------------------------
# All-gathers issued ahead of their use (FSDP's prefetch)
# ---------------------------------------------------------------------------------------------
#
# In a sharded step each layer's parameters are all-gathered before the compute that reads
# them, in the forward pass and (under remat) again in the backward pass. Here the compute
# waits for the collective, not the other way round: gather ``i`` must end before step ``i``'s
# compute starts. Issued ``distance`` gathers ahead, gather ``i`` starts when step ``i -
# distance``'s compute starts (its own gather done: the point `optimize` anchors it to), so it
# runs beside that compute and the ones up to its use; distance 0 issues it where it is used
# (one call: compute waits for all of it). The phases are `simulate`'s: latency, then bytes at
# ``overlap_bw[k]`` while compute runs and ``solo_bw[k]`` while it waits, and compute at
# ``1/slowdown[k]`` while a gather is active (latency included). Gathers run one at a time in
# order (one communication stream), so a larger distance only helps until the stream is busy,
# and every gather issued but not yet used holds its gathered buffer: the memory bound.


@dataclass(frozen=True)
class GatherStep:
    """One all-gather of a pass and the compute that reads it: ``nbytes`` is the gathered
    buffer's size per rank; ``compute_s`` the full-speed compute from its use to the next
    gather's use (the last one's: to the end of the pass)."""

    compute_s: float
    nbytes: int

    def __post_init__(self) -> None:
        if not _is_real(self.compute_s) or not math.isfinite(self.compute_s) or self.compute_s < 0:
            raise ValueError(f"GatherStep.compute_s must be a finite number >= 0, got {self.compute_s!r}")
        if not _is_int(self.nbytes) or self.nbytes < 0:
            raise ValueError(f"GatherStep.nbytes must be an integer >= 0, got {self.nbytes!r}")
        object.__setattr__(self, "compute_s", float(self.compute_s))
        object.__setattr__(self, "nbytes", int(self.nbytes))


@dataclass(frozen=True)
class GatherSpan:
    """One gather as the model times it: issued at ``issue``, latency from ``start`` to
    ``latency_end``, bytes until ``end``; its compute (step ``index``) runs ``compute_start``
    to ``compute_end``."""

    index: int
    blocks: int
    nbytes: int
    issue: float
    start: float
    latency_end: float
    end: float
    compute_start: float
    compute_end: float


@dataclass(frozen=True)
class GatherTimeline:
    """`gather_timeline`'s result: each gather's span, the compute stream as segments
    ``(step, t0, t1, slowdown)`` (step -1: the compute before the first use), and the pass's
    end (``total_s``: when the last step's compute ends)."""

    gathers: tuple[GatherSpan, ...]
    compute: tuple[tuple[int, float, float, float], ...]
    total_s: float


@dataclass(frozen=True)
class GatherPlan:
    """The prefetch `plan_gathers` chose: ``distance`` (gather ``i`` issued when gather ``i -
    distance`` is done; 0: each one call where it is used), each gather's ``blocks``
    (allocation), the predicted pass ``total_s``, and ``one_call_s``: the pass with every
    gather one call at its one-call allocation."""

    distance: int
    blocks: tuple[int, ...]
    total_s: float
    one_call_s: float


def _check_steps(steps: Sequence[GatherStep]) -> list[GatherStep]:
    steps = list(steps)
    for i, s in enumerate(steps):
        if not isinstance(s, GatherStep):
            raise ValueError(f"steps[{i}] must be a GatherStep, got {type(s).__name__}")
    return steps


def gather_timeline(steps: Sequence[GatherStep], cost: CostModel, *, distance: int,
                    blocks: int | Sequence[int], lead_s: float = 0.0) -> GatherTimeline:
    """The pass of ``steps`` with every gather issued ``distance`` ahead at allocation
    ``blocks`` (one for all, or one per gather), after ``lead_s`` seconds of compute that reads
    none of them (see the section's comment for the model)."""
    steps = _check_steps(steps)
    cost = _check_cost(cost)
    if not _is_int(distance) or distance < 0:
        raise ValueError(f"distance must be an integer >= 0, got {distance!r}")
    distance = int(distance)
    m = len(steps)
    if isinstance(blocks, Sequence):
        if len(blocks) != m:
            raise ValueError(f"blocks must give one allocation per gather ({m}), got {len(blocks)}")
        ks = [_check_blocks(b, cost) for b in blocks]
    else:
        ks = [_check_blocks(blocks, cost)] * m
    if not _is_real(lead_s) or not math.isfinite(lead_s) or lead_s < 0:
        raise ValueError(f"lead_s must be a finite number >= 0, got {lead_s!r}")
    terms = cost.terms("all-gather")
    if not m:  # the lead's compute alone
        return GatherTimeline((), ((-1, 0.0, float(lead_s), 1.0),) if lead_s else (), float(lead_s))
    issue = [0.0 if i < distance else math.inf for i in range(m)]
    start, lat_end, end = [math.nan] * m, [math.nan] * m, [math.nan] * m
    c_start, c_end = [math.nan] * m, [math.nan] * m
    segments: list[tuple[int, float, float, float]] = []
    t = 0.0
    step, work, waiting = -1, float(lead_s), False  # compute: its step (-1: the lead), work left
    g, active, lat_left, bytes_left = 0, False, 0.0, 0.0  # the stream: gather g, its phase
    while True:
        if not active and g < m and issue[g] <= t:  # the stream takes the next issued gather
            active, lat_left, bytes_left = True, terms.latency_s, steps[g].nbytes * terms.traffic
            start[g], lat_end[g] = t, t + terms.latency_s
        if waiting and g > step:  # its gather is done: the step's compute starts
            waiting, work, c_start[step] = False, steps[step].compute_s, t
            if distance and step + distance < m:
                issue[step + distance] = t
            continue
        if not waiting and work <= 0:  # the step's compute ended
            if step >= 0:
                c_end[step] = t
            if step == m - 1:
                break
            step, waiting = step + 1, True
            if not distance:
                issue[step] = t
            continue
        if active and lat_left <= 0 and bytes_left <= 0:  # the gather ended
            end[g], active, g = t, False, g + 1
            continue
        computing = not waiting
        assert computing or active, "compute waits for a gather never issued"
        k = ks[min(g, m - 1)]
        ob, sb, slow = cost.overlap_bw[k], cost.solo_bw[k], cost.slowdown[k]
        rate = 1.0 / slow if active else 1.0
        dt_compute = work / rate if computing else math.inf
        bw = ob if computing else sb
        dt_comm = (lat_left if lat_left > 0 else bytes_left / bw) if active else math.inf
        dt = min(dt_compute, dt_comm)
        if computing:
            segments.append((step, t, t + dt, slow if active else 1.0))
            work = 0.0 if dt == dt_compute else work - dt * rate
        if active:
            if lat_left > 0:
                lat_left = 0.0 if dt == dt_comm else lat_left - dt
            else:
                bytes_left = 0.0 if dt == dt_comm else bytes_left - dt * bw
        t += dt
    spans = tuple(GatherSpan(i, ks[i], steps[i].nbytes, issue[i], start[i], lat_end[i], end[i],
                             c_start[i], c_end[i]) for i in range(m))
    return GatherTimeline(spans, tuple(segments), t)


def simulate_gathers(steps: Sequence[GatherStep], cost: CostModel, *, distance: int,
                     blocks: int | Sequence[int], lead_s: float = 0.0) -> float:
    """Seconds of the pass of ``steps`` (`gather_timeline`'s ``total_s``)."""
    return gather_timeline(steps, cost, distance=distance, blocks=blocks, lead_s=lead_s).total_s


def held_bytes(steps: Sequence[GatherStep], distance: int) -> int:
    """The most gathered bytes issued ahead at once: while step ``i`` computes, gathers ``i+1``
    to ``i+distance`` are in flight or done and waiting (0 for one call each)."""
    sizes = [s.nbytes for s in steps]
    return max((sum(sizes[i + 1:i + 1 + distance]) for i in range(len(sizes))), default=0)


#: The farthest ahead `plan_gathers` looks: beyond a few gathers the stream is busy anyway.
MAX_PREFETCH_DISTANCE = 4


def plan_gathers(steps: Sequence[GatherStep], cost: CostModel, *,
                 one_call_blocks: Sequence[int], max_bytes: int, lead_s: float = 0.0,
                 max_distance: int = MAX_PREFETCH_DISTANCE, distance: int | None = None
                 ) -> GatherPlan:
    """The distance and allocation that minimise the pass of ``steps``, with at most
    ``max_bytes`` of gathered buffers issued ahead (`held_bytes`) and a distance of at most
    ``max_distance``; ``distance`` fixes it (the memory bound then does not apply). Distance 0
    (one call each) runs each gather at its ``one_call_blocks``; a longer distance at the one
    allocation best for it. Within `TIE_RTOL`, the shorter distance wins (less memory held),
    then fewer blocks."""
    steps = _check_steps(steps)
    cost = _check_cost(cost)
    one_ks = [_check_blocks(k, cost) for k in one_call_blocks]
    if len(one_ks) != len(steps):
        raise ValueError(f"one_call_blocks must give one allocation per gather ({len(steps)}), "
                         f"got {len(one_ks)}")
    if not _is_int(max_bytes) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
    max_bytes = int(max_bytes)
    if distance is not None and (not _is_int(distance) or distance < 0):
        raise ValueError(f"distance must be an integer >= 0, got {distance!r}")
    one_s = simulate_gathers(steps, cost, distance=0, blocks=one_ks, lead_s=lead_s)
    if distance is not None:
        distances = [min(int(distance), len(steps))] if distance else []
    else:
        distances = [d for d in range(1, min(max_distance, len(steps)) + 1)
                     if held_bytes(steps, d) <= max_bytes]
    best: tuple[float, int, int] = (one_s if distance in (None, 0) else math.inf, 0, 0)
    for d in distances:
        for k in cost.keys:
            t = simulate_gathers(steps, cost, distance=d, blocks=k, lead_s=lead_s)
            if t < best[0] * (1 - TIE_RTOL):
                best = (t, d, k)
    blocks = tuple(one_ks) if best[1] == 0 else (best[2],) * len(steps)
    return GatherPlan(best[1], blocks, best[0], one_s)


def _byte_prefix(layers: Sequence[Layer]) -> list[int]:
    return [0, *itertools.accumulate(l.grad_bytes for l in layers)]


# ---------------------------------------------------------------------------------------------
# Plans, ties
# ---------------------------------------------------------------------------------------------


def _plan_key(buckets: Sequence[Bucket], byte_prefix: Sequence[int]) -> tuple:
    """Tie order after time: blocks of the collectives issued, bucket count, the plan itself."""
    blocks = sum(b.blocks for b in buckets if byte_prefix[b.last + 1] > byte_prefix[b.first])
    return (blocks, len(buckets), tuple((b.first, b.last, b.blocks) for b in buckets))


Ranges = list[tuple[int, int]]


def _best(candidates: Iterable[tuple[float, Ranges, Sequence[int]]], byte_prefix: Sequence[int]) -> list[Bucket]:
    """Least time; within TIE_RTOL of it, least `_plan_key`. Candidates: (time, ranges, keys)."""
    candidates = list(candidates)
    best_t = min(c[0] for c in candidates)
    tied = [[Bucket(f, l, k) for (f, l), k in zip(r, ks)] for t, r, ks in candidates if t <= best_t * (1 + TIE_RTOL)]
    return min(tied, key=lambda b: _plan_key(b, byte_prefix))


def _make_plan(layers: list[Layer], buckets: list[Bucket], cost: CostModel) -> Plan:
    return Plan(buckets=buckets, backward_s=simulate(layers, buckets, cost))


# ---------------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------------


def _check_reach(reach: Sequence[int] | None, n: int) -> list[int] | None:
    """Validate ``reach``: one integer per layer, ``i <= reach[i] <= n - 1``."""
    if reach is None:
        return None
    reach = list(reach)
    if len(reach) != n:
        raise ValueError(f"reach must give one layer index per layer ({n}), got {len(reach)}")
    for i, r in enumerate(reach):
        if not _is_int(r) or not i <= int(r) < n:
            raise ValueError(f"reach[{i}] must be an integer in [{i}, {n - 1}], got {r!r}")
    return [int(r) for r in reach]


def _within_reach(ranges: Ranges, reach: Sequence[int] | None) -> Ranges:
    """``ranges`` with every bucket that ``reach`` forbids cut, greedily, into allowed ones."""
    if reach is None:
        return ranges
    out: Ranges = []
    for first, last in ranges:
        start, limit = first, reach[first]
        for i in range(first + 1, last + 1):
            if i > limit:  # layer i may not join the bucket that starts at `start`
                out.append((start, i - 1))
                start, limit = i, reach[i]
            else:
                limit = min(limit, reach[i])
        out.append((start, last))
    return out


def plan(layers: Sequence[Layer], cost: CostModel, *, fusion: bool = True,
         buckets: Sequence[tuple[int, int]] | None = None, reach: Sequence[int] | None = None) -> Plan:
    """Minimise backward time over allocations and, with ``fusion``, bucket boundaries.

    ``fusion=False`` makes every layer its own bucket; ``buckets=[(first, last), ...]`` keeps
    that grouping (it takes precedence over ``fusion``) and only chooses allocations. With
    fusion, ``reach[i]`` (default: the last layer) is the last layer that may share a bucket with
    layer ``i``: a bucket ``first..last`` is allowed when ``last <= reach[i]`` for every layer
    ``i < last`` in it (e.g. a gradient that is used before a later one is computed cannot wait
    for it). A bucket also holds one collective (`Layer.collective`): layers of another one
    are out of its reach. Exact when ``solo_bw[k] >= overlap_bw[k]`` for all ``k``; see the
    module docstring.
    """
    layers = _check_layers(layers)
    cost = _check_cost(cost)
    n = len(layers)
    reach = _check_reach(reach, n)
    pricing = _pricing(layers, cost)
    if buckets is not None:
        ranges = _grouping_ranges(buckets, n)
        _check_one_collective(layers, ranges)
        cuts, free, reach = [0, *(last + 1 for _, last in ranges)], False, None
    elif fusion:
        reach = _with_runs(reach, pricing)
        cuts, free = _atoms(layers, ATOMS, reach), True
    else:
        cuts, free, reach = list(range(n + 1)), False, None
    comp = _prefix(l.compute_s for l in layers)
    byts = _byte_prefix(layers)
    groups = [(cuts[i], cuts[i + 1] - 1) for i in range(len(cuts) - 1)]

    # Upper bound and safety net: complete plans (ranges, one key) scored before the search.
    seeds: list[tuple[Ranges, int]] = [(groups, k) for k in cost.keys]
    if free:  # one bucket, and the baselines, so that an inexact search never loses to them
        fixed = [_within_reach(r, reach) for r in
                 ([(0, n - 1)], *(_horovod_ranges(layers, thr) for thr in _HOROVOD_THRESHOLDS))]
        seeds += [(r, k) for r in fixed for k in cost.keys]
        seeds += [(_within_reach(_mgwfbp_ranges(comp, pricing, k, cost), reach), k)
                  for k in cost.keys]
    tensors = _tensor_prefix(byts)
    # Seeds cut to the same buckets (many runs of one collective cut them all alike) score once.
    seeds = list({(tuple(r), k): (r, k) for r, k in seeds}.values())
    scored = [(_simulate_ranges(comp, byts, pricing, r, [k] * len(r), cost, tensors), r, [k] * len(r))
              for r, k in seeds]
    upper = min(c[0] for c in scored)
    found, _ = _search(comp, byts, cuts, free, cost, upper, reach=reach, pricing=pricing)
    if found is not None:
        r, ks = [(b.first, b.last) for b in found], [b.blocks for b in found]
        scored.append((_simulate_ranges(comp, byts, pricing, r, ks, cost, tensors), r, ks))
    return _make_plan(layers, _best(scored, byts), cost)


def _lipschitz(cost: CostModel) -> float | None:
    """How many seconds one second of lost compute progress can cost at most, or None.

    For a fixed sequence of decisions the final time is continuous and piecewise smooth in the
    progress of a state; its slope is -1 (compute then waits for nobody) or -s(1 - ob/sb) (the
    collective during which compute ends) or 0. Valid when ``solo_bw >= overlap_bw`` everywhere.
    """
    if any(cost.overlap_bw[k] > cost.solo_bw[k] for k in cost.keys):
        return None
    return max(1.0, max(cost.slowdown[k] * (1.0 - cost.overlap_bw[k] / cost.solo_bw[k]) for k in cost.keys))


def _thin(E: np.ndarray, Q: np.ndarray, keys: Callable[[np.ndarray], tuple[np.ndarray, ...]],
          lam: float | None, cap: int, scale: float) -> tuple[np.ndarray, float]:
    """Indices of the states to keep (progress ascending) and the time this may cost.

    Exact: Pareto dominance, then the Lipschitz rule (a state with less progress dominates one
    with more when ``T + lam * (P' - P) <= T'``). Bounded: if more than ``cap`` remain, keep the
    most advanced state of each of ``cap`` equal progress cells, costing at most ``lam * width``.
    ``keys(indices)`` gives those states' tie keys, asked only for the states the sort sees.
    """
    # Compare on a grid of TIE_RTOL * scale so that states equal up to rounding tie, and the tie
    # keys (blocks, buckets, then the path) decide between them.
    quantum = TIE_RTOL * scale
    E, Q = np.round(E / quantum), np.round(Q / quantum)
    live = _beaten_from_above(E, Q)
    order = live[np.lexsort((*keys(live)[::-1], E[live], -Q[live]))]
    # progress descending, then time, then tie keys
    Es = E[order]
    keep = np.empty(order.size, dtype=bool)
    keep[0] = True
    keep[1:] = Es[1:] < np.minimum.accumulate(Es)[:-1]
    sel = order[keep][::-1]
    if lam is not None and sel.size > 1:
        phi = E[sel] - lam * Q[sel]
        keep = np.empty(sel.size, dtype=bool)
        keep[0] = True
        keep[1:] = phi[1:] < np.minimum.accumulate(phi)[:-1]
        sel = sel[keep]
    if sel.size <= cap:
        return sel, 0.0
    lo, hi = float(Q[sel[0]]), float(Q[sel[-1]])
    width = (hi - lo) / cap
    cell = np.minimum(((Q[sel] - lo) / width).astype(np.int64), cap - 1)
    width *= quantum
    last = np.empty(sel.size, dtype=bool)
    last[-1] = True
    last[:-1] = cell[1:] != cell[:-1]
    return sel[last], (math.inf if lam is None else lam * width)


def _beaten_from_above(E: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """Indices of the states (rounded times ``E``, progress ``Q``) that no state of a higher
    cell of progress matches or beats on time (cells: about half as many as states, equal
    widths between the least progress and the most).

    A prefilter for `_thin`'s sort on every key, which is its cost: a state dropped here has a
    state of strictly more progress and no more time, so the Pareto step would drop it too,
    and what it dominates that state dominates as well: the selection is the same. Linear
    passes only (no sort).
    """
    cells = max(64, E.size // 2)
    lo, hi = float(Q.min()), float(Q.max())
    if E.size <= 64 or hi <= lo:
        return np.arange(E.size)
    cell = ((Q - lo) * (cells / (hi - lo))).astype(np.int64)  # monotone in Q
    np.minimum(cell, cells - 1, out=cell)
    best = np.full(cells + 1, np.inf)
    np.minimum.at(best, cell, E)
    best = np.minimum.accumulate(best[::-1])[::-1]  # the best time in this cell or above
    return np.flatnonzero(E < best[cell + 1])


def _atoms(layers: Sequence[Layer], target: int, reach: Sequence[int] | None = None) -> list[int]:
    """Allowed bucket boundaries: every layer boundary, or about ``target`` pre-fused groups.

    Up to ``target`` layers nothing is fused. Beyond, consecutive layers are grouped while their
    share of compute plus their share of bytes stays under ``2 / target`` (a layer above it is a
    group of its own), which gives fewer than ``2 * target`` groups (adjacent groups weigh more than the limit).
    A group also ends where ``reach`` forbids the next layer to join it (more groups, never fewer).
    """
    n = len(layers)
    if n <= target:
        return list(range(n + 1))
    C = sum(l.compute_s for l in layers) or 1.0
    B = sum(l.grad_bytes for l in layers) or 1
    limit = 2.0 / target
    cuts, acc, allowed = [0], 0.0, n - 1
    for i, layer in enumerate(layers):
        w = layer.compute_s / C + layer.grad_bytes / B
        if (acc > 0 and acc + w > limit) or i > allowed:
            cuts.append(i)
            acc, allowed = 0.0, n - 1
        acc += w
        if reach is not None:
            allowed = min(allowed, reach[i])
    cuts.append(n)
    return cuts


def _lowest_sources(cuts: list[int], reach: Sequence[int] | None) -> np.ndarray:
    """Per boundary ``t``: the lowest boundary a bucket ending at ``t`` may start from.

    A bucket covering groups ``s..t-1`` is allowed when every layer but its last reaches its last
    layer. Non-decreasing in ``t``. Without ``reach``: 0 everywhere.
    """
    M = len(cuts) - 1
    lo = np.zeros(M + 1, dtype=np.int64)
    if reach is None:
        return lo
    group_min = [min(reach[cuts[g]:cuts[g + 1]]) for g in range(M)]
    for t in range(1, M + 1):
        last = cuts[t] - 1
        low = min(reach[cuts[t - 1]:last], default=last)  # the group itself (allowed by _atoms)
        s = t - 1
        while s > 0 and min(low, group_min[s - 1]) >= last:
            low = min(low, group_min[s - 1])
            s -= 1
        lo[t] = s
    return np.maximum.accumulate(lo)


def _tail(Bc: np.ndarray, Rb: np.ndarray, Nc: np.ndarray, lo: np.ndarray, free: bool, lat: np.ndarray,
          bw: float, key: int, pack_per_byte: float, scale: float
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The best way to finish once compute is over, from every boundary: all remaining layers are
    ready and contention is over, so every bucket runs alone at the best solo bandwidth ``bw``
    (allocation ``key``) and costs ``lat + pack + bytes / bw`` (nothing without bytes): ``lat``
    of the bucket's collective (per boundary it ends at), its bytes as priced (``Bc``, prefix
    sums at the boundaries) and packed (``Rb``, the bytes themselves).

    With fusion, a backward dynamic program over the boundaries (buckets allowed by ``lo``)
    chooses the cuts: fewer latencies against the packing of fused buckets. Returns, per
    boundary, the time, the blocks and buckets (tie keys) and the next cut.
    """
    M = len(Bc) - 1
    t_best = np.zeros(M + 1)
    blk = np.zeros(M + 1, dtype=np.int64)
    nb = np.zeros(M + 1, dtype=np.int64)
    nxt = np.full(M + 1, M, dtype=np.int64)
    quantum = TIE_RTOL * scale
    for t in range(M - 1, -1, -1):
        u = np.arange(t + 1, M + 1) if free else np.array([t + 1])
        u = u[lo[u] <= t]
        nbytes = Bc[u] - Bc[t]
        real = Rb[u] - Rb[t]
        packed = np.where(Nc[u] - Nc[t] >= 2, real * pack_per_byte, 0.0)
        some = real > 0
        time = np.where(some, lat[u] + packed + nbytes / bw, 0.0) + t_best[u]
        blocks = np.where(some, key, 0) + blk[u]
        buckets = 1 + nb[u]
        i = np.lexsort((buckets, blocks, np.round(time / quantum)))[0]
        t_best[t], blk[t], nb[t], nxt[t] = time[i], blocks[i], buckets[i], u[i]
    return t_best, blk, nb, nxt


@dataclass
class _Front:
    """The live states of the search, one entry per state, grouped by boundary (ascending) and by
    progress within a group: time ``T``, progress ``P``, boundary ``B``, blocks and buckets so
    far (tie keys), the state's id in the store, and ``loc``: the offset within the group of the
    least-lag (``T - P``) state among the group's states up to this one."""

    T: np.ndarray
    P: np.ndarray
    B: np.ndarray
    blk: np.ndarray
    nb: np.ndarray
    id: np.ndarray
    loc: np.ndarray

    def _fields(self) -> tuple[np.ndarray, ...]:
        return self.T, self.P, self.B, self.blk, self.nb, self.id, self.loc

    @property
    def size(self) -> int:
        return int(self.T.size)

    def take(self, sel: np.ndarray) -> _Front:
        return _Front(*(x[sel] for x in self._fields()))

    def extended(self, other: _Front) -> _Front:
        return _Front(*(np.concatenate((a, b)) for a, b in zip(self._fields(), other._fields())))

    def group_starts(self) -> np.ndarray:
        return np.flatnonzero(np.concatenate(([True], self.B[1:] != self.B[:-1])))


class _Search:
    """The dynamic program of the module docstring, as its named steps (`run` applies them per
    boundary): `sources` (idle sources), `expand` (one collective per source and allocation, with
    normalisation), `finish` (compute finished), `bound`, `grow` (dominance and cap, into the
    front), `prune` (reach and bound on sources, idle groups collapsed), `backtrack`."""

    def __init__(self, comp: list[float], byts: list[int], cuts: list[int], free: bool, cost: CostModel,
                 upper: float, cap: int, reach: Sequence[int] | None, pricing: _Pricing) -> None:
        self.byts, self.cuts, self.free, self.upper, self.cap = byts, cuts, free, upper, cap
        self.keys = np.array(cost.keys, dtype=np.int64)
        self.ob = np.array([cost.overlap_bw[k] for k in cost.keys])
        self.sb = np.array([cost.solo_bw[k] for k in cost.keys])
        self.sl = np.array([cost.slowdown[k] for k in cost.keys])
        # Per boundary t: the latency of a bucket ending there (its collective's).
        self.lat = np.array([0.0] + [pricing.lat[c - 1] for c in cuts[1:]])
        self.lam = _lipschitz(cost)
        bw_max = float(max(self.ob.max(), self.sb.max()))
        self.best_solo = int(np.argmax(self.sb))  # first maximum: the fewest blocks among the fastest
        self.M = len(cuts) - 1
        self.C = C = comp[-1]
        self.R = np.array([comp[c] for c in cuts] + [C])  # ready progress of a bucket ending at each boundary
        self.Bc = Bc = np.array([pricing.wire[c] for c in cuts])  # bytes before each boundary, priced
        self.Rb = np.array([float(byts[c]) for c in cuts])  # ... and as they are (packing)
        nonempty_prefix = _prefix(byts[i + 1] > byts[i] for i in range(len(byts) - 1))
        self.Nc = np.array([nonempty_prefix[c] for c in cuts])  # non-empty layers before each boundary
        self.lo = _lowest_sources(cuts, reach if free else None)
        self.pack_c = cost.pack_s_per_byte
        total = Bc[-1]
        # Best rest once compute is over, and a lower bound on the communication still due.
        group_bytes = np.diff(Bc)
        nonempty = group_bytes > 0
        self.tail_t, self.tail_blk, self.tail_nb, self.tail_next = _tail(
            Bc, self.Rb, self.Nc, self.lo, free, self.lat, float(self.sb[self.best_solo]),
            int(self.keys[self.best_solo]), self.pack_c, max(upper, C, 1e-300))
        if free:
            rest = total - Bc
            # The least latency of a collective still due: of the layers from each boundary on.
            lat_after = np.minimum.accumulate(np.array([*pricing.lat, math.inf])[::-1])[::-1]
            self.comm_lb = np.where(rest > 0, lat_after[cuts] + rest / bw_max, 0.0)
        else:
            self.comm_lb = np.concatenate(
                [np.cumsum(np.where(nonempty, self.lat[1:] + group_bytes / bw_max, 0.0)[::-1])[::-1], [0]])
        self.rest_lb = (total - Bc) / bw_max  # seconds of bytes still due from each boundary, at best
        # Store of every kept state: parent id, allocation index, boundary. Id 0 is the start.
        self.parents: list[np.ndarray] = [np.array([-1])]
        self.kidx: list[np.ndarray] = [np.array([0])]
        self.bound_of: list[np.ndarray] = [np.array([0])]
        self.n_states = 1
        self.upper_b = upper * (1 + _BOUND_RTOL)
        self.fin: list[tuple] = []  # (time, blocks, buckets, src id, k index, boundary) of complete plans
        self.best_t = math.inf
        self.err = 0.0

    def run(self) -> tuple[list[Bucket] | None, float]:
        start = float(self.R[1])  # normalised: compute runs alone up to the first ready time
        zeros = np.zeros(1, dtype=np.int64)
        front = _Front(np.array([start]), np.array([start]), zeros, zeros, zeros, zeros, zeros)
        for t in range(1, self.M + 1):
            if self.free and self.lo[t] > 0 and front.size and front.B[0] < self.lo[t]:
                # Buckets ending here or later cannot start this early (reach): drop those sources.
                front = front.take(front.B >= self.lo[t])
            if front.size == 0:
                break
            src_i = self.sources(front, t)
            E, Q, r, nbytes = self.expand(front, src_i, t)
            tie = functools.partial(self.tie_keys, front, src_i, nbytes)
            E, Q, r = self.finish(t, E, Q, r, tie)
            if t == self.M:
                break
            E, Q, r = self.bound(t, *self.normalise(t, E, Q), r)
            front = self.grow(front, t, E, Q, r, tie)
            if self.free and front.size:
                front = self.prune(front, t)
        return self.backtrack()

    def sources(self, front: _Front, t: int) -> np.ndarray:
        """Idle sources: per group, the least-lag state among those idle at ``R[t]`` (they all start
        the bucket at ``R[t]`` and differ only by a time shift), plus every busy state."""
        Rt = float(self.R[t])
        starts = front.group_starts() if self.free else np.zeros(1, dtype=np.int64)
        idle = front.P <= Rt
        cnt = np.add.reduceat(idle.astype(np.int64), starts)
        has = cnt > 0
        reps = starts[has] + front.loc[starts[has] + cnt[has] - 1]
        return np.concatenate([reps, np.flatnonzero(~idle)])

    def expand(self, front: _Front, src_i: np.ndarray, t: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every source times every allocation: the bucket from the source's boundary to ``t``
        (packed if fused). Returns (E, Q, r, bytes per source), ``r`` the row-major index into
        (source, allocation); a bucket of no bytes carries its state over, with the smallest key."""
        T0, P0 = front.T[src_i], front.P[src_i]
        nbytes = self.Bc[t] - self.Bc[front.B[src_i]]
        real = self.Rb[t] - self.Rb[front.B[src_i]]
        packed = np.where(self.Nc[t] - self.Nc[front.B[src_i]] >= 2, real * self.pack_c, 0.0)
        E, Q = _collective_np(T0[:, None], P0[:, None], float(self.R[t]), nbytes[:, None], float(self.lat[t]),
                              self.ob, self.sb, self.sl, self.C, packed[:, None])
        empty = nbytes == 0
        r = np.arange(E.size)
        if empty.any():
            E[empty] = T0[empty, None]
            Q[empty] = P0[empty, None]
            valid = np.ones(E.shape, dtype=bool)
            valid[empty, 1:] = False
            keep = valid.ravel()
            return E.ravel()[keep], Q.ravel()[keep], r[keep], nbytes
        return E.ravel(), Q.ravel(), r, nbytes

    def tie_keys(self, front: _Front, src_i: np.ndarray, nbytes: np.ndarray, r: np.ndarray
                 ) -> tuple[np.ndarray, ...]:
        """(blocks, buckets, source id, allocation index) of the new states ``r``."""
        row, kk = np.divmod(r, len(self.keys))
        src = src_i[row]
        blk = front.blk[src] + np.where(nbytes[row] > 0, self.keys[kk], 0)
        return blk, front.nb[src] + 1, front.id[src], kk

    def finish(self, t: int, E: np.ndarray, Q: np.ndarray, r: np.ndarray,
               tie: Callable[[np.ndarray], tuple[np.ndarray, ...]]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Compute finished (or the last boundary): the state becomes a complete plan with the best
        rest (`_tail`); kept among the plans within a tie of the best. Returns the other states."""
        done = Q >= self.C
        if t == self.M:
            done[:] = True
        if not done.any():
            return E, Q, r
        ft = E[done] + (self.C - Q[done]) + self.tail_t[t]
        m = float(ft.min())
        if m < self.best_t:
            self.best_t = m
            self.fin = [f for f in self.fin if f[0] <= self.best_t * (1 + TIE_RTOL)]
            self.upper_b = min(self.upper_b, self.best_t * (1 + _BOUND_RTOL))
        keep = ft <= self.best_t * (1 + TIE_RTOL)
        blk, nb, src, kk = tie(r[done][keep])
        for f, b, c, s, k in zip(ft[keep], blk + self.tail_blk[t], nb + self.tail_nb[t], src, kk):
            self.fin.append((float(f), int(b), int(c), int(s), int(k), t))
        live = ~done
        return E[live], Q[live], r[live]

    def normalise(self, t: int, E: np.ndarray, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """No collective starts before the next bucket's ready progress: ``(T + R - P, R)``."""
        nxt = float(self.R[t + 1])
        late = Q < nxt
        return np.where(late, E + (nxt - Q), E), np.where(late, nxt, Q)

    def bound(self, t: int, E: np.ndarray, Q: np.ndarray, r: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Branch and bound: drop states that cannot beat the best complete plan."""
        ok = E + np.maximum(self.C - Q, self.comm_lb[t]) <= self.upper_b
        return E[ok], Q[ok], r[ok]

    def grow(self, front: _Front, t: int, E: np.ndarray, Q: np.ndarray, r: np.ndarray,
             tie: Callable[[np.ndarray], tuple[np.ndarray, ...]]) -> _Front:
        """Dominance and cap (`_thin`) on the new states at ``t``, stored and added to the front
        (with fusion; a fixed grouping's front is only the new states)."""
        if not E.size:
            return front if self.free else front.take(np.zeros(0, dtype=np.int64))
        sel, loss = _thin(E, Q, lambda idx: tie(r[idx]), self.lam, self.cap,
                          max(self.upper, self.C, 1e-300))
        self.err += loss
        E, Q, r = E[sel], Q[sel], r[sel]
        blk, nb, src, kk = tie(r)
        lag = E - Q
        run = np.minimum.accumulate(lag)
        first_min = np.concatenate(([True], lag[1:] < run[:-1]))
        loc = np.maximum.accumulate(np.where(first_min, np.arange(E.size), 0))
        ids = np.arange(self.n_states, self.n_states + E.size)
        self.n_states += E.size
        self.parents.append(src)
        self.kidx.append(kk)
        self.bound_of.append(np.full(E.size, t))
        new = _Front(E, Q, np.full(E.size, t, dtype=np.int64), blk, nb, ids, loc)
        return front.extended(new) if self.free else new

    def prune(self, front: _Front, t: int) -> _Front:
        """Drop what can no longer beat the bound; collapse groups idle from now on to their
        least-lag state (R only grows, so both are for good)."""
        nxt = float(self.R[t + 1])
        lb = front.T + np.maximum(nxt - front.P, 0.0) + self.rest_lb[front.B]
        starts = front.group_starts()
        sizes = np.diff(np.append(starts, front.size))
        g_alive = np.minimum.reduceat(lb, starts) <= self.upper_b
        g_idle = np.maximum.reduceat(front.P, starts) <= nxt
        g_rep = starts + front.loc[starts + sizes - 1]
        keep = np.repeat(g_alive & ~g_idle, sizes)
        keep[g_rep[g_alive & g_idle]] = True
        if keep.all():
            return front
        collapsed = np.zeros(front.size, dtype=bool)
        collapsed[g_rep[g_alive & g_idle]] = True
        return dataclasses.replace(front, loc=np.where(collapsed, 0, front.loc)).take(keep)

    def backtrack(self) -> tuple[list[Bucket] | None, float]:
        """The best complete plan's buckets (ties: fewest blocks, then buckets, then bytes order),
        from its store path and the tail, and the error bound."""
        fin, keys, cuts, byts, M = self.fin, self.keys, self.cuts, self.byts, self.M
        if not fin:
            return None, self.err
        par = np.concatenate(self.parents)
        kid = np.concatenate(self.kidx)
        bnd = np.concatenate(self.bound_of)
        fin.sort(key=lambda f: (f[1], f[2]))
        lead = [f for f in fin if f[1:3] == fin[0][1:3]]
        plans = []
        for f in lead:
            _, _, _, s, k, t = f
            steps = [(t, int(keys[k]))]
            while s > 0:
                steps.append((int(bnd[s]), int(keys[kid[s]])))
                s = int(par[s])
            steps.reverse()
            out, prev = [], 0
            for tb, kb in steps:
                first, last = cuts[prev], cuts[tb] - 1
                out.append(Bucket(first, last, kb if byts[last + 1] > byts[first] else int(keys[0])))
                prev = tb
            while prev < M:  # the best rest after compute ended (_tail)
                first, last = cuts[prev], cuts[int(self.tail_next[prev])] - 1
                nonzero = byts[last + 1] > byts[first]
                out.append(Bucket(first, last, int(keys[self.best_solo]) if nonzero else int(keys[0])))
                prev = int(self.tail_next[prev])
            plans.append(out)
        return min(plans, key=lambda b: _plan_key(b, byts)[2]), self.err


def _search(comp: list[float], byts: list[int], cuts: list[int], free: bool, cost: CostModel,
            upper: float, *, pricing: _Pricing, cap: int = FRONT_CAP,
            reach: Sequence[int] | None = None) -> tuple[list[Bucket] | None, float]:
    """The dynamic program of the module docstring: the best plan it finds and its error bound."""
    return _Search(comp, byts, cuts, free, cost, upper, cap, reach, pricing).run()


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def _horovod_ranges(layers: Sequence[Layer], fusion_bytes: int) -> Ranges:
    out: Ranges = []
    first, size = 0, 0
    for i, layer in enumerate(layers):
        if i > first and (fusion_bytes == 0 or size + layer.grad_bytes > fusion_bytes):
            out.append((first, i - 1))
            first, size = i, 0
        size += layer.grad_bytes
    out.append((first, len(layers) - 1))
    return out


def plan_default(layers: Sequence[Layer], cost: CostModel, *, blocks: int, fusion_bytes: int) -> Plan:
    """Horovod-NCCL: one fixed allocation, buckets cut by a byte threshold.

    Layers are walked in order and the bucket is closed before a layer that would push it past
    ``fusion_bytes``, or of another collective; a layer larger than the threshold is a bucket of
    its own; ``fusion_bytes=0`` gives one bucket per layer.
    """
    layers = _check_layers(layers)
    cost = _check_cost(cost)
    k = _check_blocks(blocks, cost)
    if not _is_int(fusion_bytes) or fusion_bytes < 0:
        raise ValueError(f"fusion_bytes must be an integer >= 0, got {fusion_bytes!r}")
    ranges = _within_reach(_horovod_ranges(layers, int(fusion_bytes)), _pricing(layers, cost).runs)
    return _make_plan(layers, [Bucket(f, l, k) for f, l in ranges], cost)


def plan_fusion_only(layers: Sequence[Layer], cost: CostModel, *, blocks: int,
                     reach: Sequence[int] | None = None) -> Plan:
    """The planner with the allocation fixed to ``blocks``: it only chooses bucket boundaries
    (within ``reach``, as `plan`)."""
    cost = _check_cost(cost)
    k = _check_blocks(blocks, cost)
    fixed = dataclasses.replace(cost, solo_bw={k: cost.solo_bw[k]}, overlap_bw={k: cost.overlap_bw[k]},
                                slowdown={k: cost.slowdown[k]})
    return plan(layers, fixed, fusion=True, reach=reach)


def within_reach(buckets: Sequence[Bucket], reach: Sequence[int] | None) -> list[Bucket]:
    """``buckets`` with every bucket that ``reach`` forbids (see `plan`) cut, greedily from
    its first layer, into allowed ones with the same allocation.

    Why: a plan made without ``reach`` (a baseline, a hand-written plan) runs that way -- a fused
    bucket whose early gradient is needed before its last one is ready cannot be one all-reduce
    -- so its predicted time must be that of the cut plan.
    """
    buckets = list(buckets)
    if reach is None:
        return buckets
    n = max((b.last for b in buckets), default=-1) + 1
    reach = _check_reach(reach, n)
    return [Bucket(f, l, b.blocks) for b in buckets for f, l in _within_reach([(b.first, b.last)], reach)]


def _mgwfbp_ranges(comp: list[float], pricing: _Pricing, k: int, cost: CostModel) -> Ranges:
    """MG-WFBP's buckets, cut where the collective changes (`_Pricing.runs`)."""
    wire, lat, bw = pricing.wire, pricing.lat, cost.solo_bw[k]
    n = len(comp) - 1
    out: Ranges = []
    first, comm_free = 0, 0.0
    for i in range(n):
        nbytes = wire[i + 1] - wire[first]
        if i + 1 < n and (pricing.runs is None or pricing.runs[i] > i):
            start = max(comm_free, comp[i + 1])  # when this bucket's all-reduce would begin
            if nbytes == 0 or start + lat[i] > comp[i + 2]:
                continue  # waiting for the next gradient costs less than one start-up: merge it
            comm_free = start + lat[i] + nbytes / bw
        out.append((first, i))
        first = i + 1
    return out


def plan_mgwfbp(layers: Sequence[Layer], cost: CostModel, *, blocks: int) -> Plan:
    """MG-WFBP (Shi et al., INFOCOM'19): the paper's "fusion only" baseline.

    With the contention-free alpha-beta model ``latency_s + bytes / solo_bw[blocks]`` and
    contention-free ready times, layers are walked in backward order; a gradient is merged with
    the next one when its all-reduce could not start before the next gradient is ready minus one
    start-up latency (waiting costs less than an extra start-up), and not across a change of
    collective. All buckets use ``blocks``;
    the returned time is the contention-aware `simulate`.
    """
    layers = _check_layers(layers)
    cost = _check_cost(cost)
    k = _check_blocks(blocks, cost)
    ranges = _mgwfbp_ranges(_prefix(l.compute_s for l in layers), _pricing(layers, cost), k, cost)
    return _make_plan(layers, [Bucket(f, l, k) for f, l in ranges], cost)


# ---------------------------------------------------------------------------------------------
# Exhaustive reference
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The policies compared (the paper's table; ``libra-jax simulate``)
# ---------------------------------------------------------------------------------------------

#: The Libra artifact's PREPROCESS_LAYER_NUM: layers are pre-fused into 40 groups.
DEFAULT_PREFUSE = 40

# Policy key -> description, in table order.
POLICIES: dict[str, str] = {
    "default": "Horovod-NCCL: fixed allocation, 64 MiB fusion",
    "mgwfbp": "fusion only: MG-WFBP merge, fixed allocation",
    "fusion-only": "fusion only: planner grouping, fixed allocation",
    "libra-alloc": "Libra allocation, default grouping",
    "libra": "Libra: allocation co-optimised with fusion",
}


@dataclass(frozen=True)
class Comparison:
    """Plans of every policy in `POLICIES` for one workload and cost model."""

    plans: dict[str, Plan]
    default_alloc: int
    fusion_bytes: int

    def backward_s(self, policy: str) -> float:
        return self.plans[policy].backward_s

    def best_baseline(self) -> str:
        """The fastest of the baselines (everything except the two Libra policies)."""
        return min(("default", "mgwfbp", "fusion-only"), key=self.backward_s)


def prefuse_groups(layers: Sequence[Layer], groups: int) -> list[tuple[int, int]]:
    """Cut ``layers`` into at most ``groups`` contiguous groups of about equal weight.

    A layer's weight is the mean of its share of the backward compute and of the gradient bytes,
    so both long compute stretches and large gradients stay resolved. This is the Libra artifact's
    pre-fusion step (it plans 40 pre-fused groups); any plan over the groups is a valid plan over
    the layers, and `compare_policies` evaluates it on the exact layers. A group also ends where
    the collective changes (`Layer.collective`: up to one more group per change).
    """
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    n = len(layers)
    total_c = sum(l.compute_s for l in layers) or 1.0
    total_b = sum(l.grad_bytes for l in layers) or 1
    out: list[tuple[int, int]] = []
    first, c, b = 0, 0.0, 0
    for i, layer in enumerate(layers):
        c += layer.compute_s
        b += layer.grad_bytes
        share = 0.5 * (c / total_c + b / total_b)
        if (i == n - 1 or layers[i + 1].collective != layer.collective
                or (share >= (len(out) + 1) / groups - 1e-12 and len(out) < groups - 1)):
            out.append((first, i))
            first = i + 1
    return out


def compare_policies(layers: Sequence[Layer], cost: CostModel, *, default_alloc: int,
                     fusion_bytes: int = HOROVOD_FUSION_BYTES,
                     prefuse: int = DEFAULT_PREFUSE) -> Comparison:
    """Plan ``layers`` under every policy of `POLICIES`.

    The fusion-searching planner policies (``fusion-only`` and ``libra``) plan over
    `prefuse_groups` of at most ``prefuse`` groups (0: the exact layers); their buckets are
    mapped back to layer indices and every reported time is ``simulate`` on the exact layers.
    """
    layers = list(layers)
    default = plan_default(layers, cost, blocks=default_alloc, fusion_bytes=fusion_bytes)
    grouping = [(b.first, b.last) for b in default.buckets]
    if prefuse and len(layers) > prefuse:
        groups = prefuse_groups(layers, prefuse)
        coarse = [Layer(sum(layers[i].compute_s for i in range(a, z + 1)),
                        sum(layers[i].grad_bytes for i in range(a, z + 1)), layers[a].collective)
                  for a, z in groups]

        def exact(plan: Plan) -> Plan:
            buckets = [Bucket(groups[b.first][0], groups[b.last][1], b.blocks)
                       for b in plan.buckets]
            return Plan(buckets, simulate(layers, buckets, cost))
    else:
        coarse = layers

        def exact(plan: Plan) -> Plan:
            return plan
    plans = {
        "default": default,
        "mgwfbp": plan_mgwfbp(layers, cost, blocks=default_alloc),
        "fusion-only": exact(plan_fusion_only(coarse, cost, blocks=default_alloc)),
        "libra-alloc": plan(layers, cost, buckets=grouping),
        "libra": exact(plan(coarse, cost, fusion=True)),
    }
    return Comparison(plans, default_alloc, fusion_bytes)


def plan_exhaustive(layers: Sequence[Layer], cost: CostModel, *, fusion: bool = True,
                    buckets: Sequence[tuple[int, int]] | None = None,
                    reach: Sequence[int] | None = None) -> Plan:
    """Exact optimum by enumerating every plan (vectorised), with the same tie order as `plan`.

    Candidates: ``K (K+1)^(L-1)`` with fusion, ``K^L`` without, ``K^G`` for a fixed grouping of
    ``G`` buckets; with fusion, those ``reach`` forbids (see `plan`) or that mix collectives are
    discarded. Raises ``ValueError`` if that exceeds ``EXHAUSTIVE_LIMIT``.
    """
    layers = _check_layers(layers)
    cost = _check_cost(cost)
    n, K = len(layers), len(cost.keys)
    reach = _check_reach(reach, n)
    pricing = _pricing(layers, cost)
    reach = _with_runs(reach, pricing) if buckets is None and fusion else reach
    if buckets is not None:
        ranges = _grouping_ranges(buckets, n)
        _check_one_collective(layers, ranges)
        free = False
    else:
        ranges = [(i, i) for i in range(n)]
        free = bool(fusion)
    if not free:
        reach = None
    G = len(ranges)
    count = K * (K + 1) ** (n - 1) if free else K ** G
    if count > EXHAUSTIVE_LIMIT:
        raise ValueError(f"plan_exhaustive would enumerate {count} candidates, more than the limit "
                         f"{EXHAUSTIVE_LIMIT}; use plan()")
    comp = _prefix(l.compute_s for l in layers)
    byts = _byte_prefix(layers)
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
                packed = np.where(tensors[fire] >= 2, acc[fire] * cost.pack_s_per_byte, 0.0)
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


# ---------------------------------------------------------------------------------------------
# FSDP: a sharded training step (forward gathers, backward re-gathers and reduce-scatters)
# ---------------------------------------------------------------------------------------------

#: XLA's default combiner threshold for all-reduces, all-gathers and reduce-scatters alike
#: (``kDefaultReduceScatterCombineThreshold``, xla/service/collective_utils.h: 30 MiB + 7):
#: the default FSDP policy's fusion.
XLA_COMBINE_BYTES = 30 * 1024 * 1024 + 7

#: The FSDP comparison's policies, in table order.
FSDP_POLICIES: dict[str, str] = {
    "default": "XLA on NCCL: fixed allocation, each gather one ahead, 30 MiB combiner",
    "fusion-only": "planner grouping of the reduce-scatters, fixed allocation, gathers one ahead",
    "libra": "Libra: gathers' distance and allocation planned, reduce-scatters' allocation "
             "co-optimised with fusion",
}


@dataclass(frozen=True)
class FsdpStep:
    """One FSDP (ZeRO-3) training step at full speed, per rank. ``forward``: a `GatherStep`
    per parameterised op in forward order (its weights gathered, the compute from its use to
    the next one's), after ``forward_lead_s`` of compute that reads none. ``backward``: remat's
    re-gathers, one per `layers` entry, each needed from the start of that layer's compute.
    ``layers``: the backward pass, every gradient reduce-scattered (`Layer.collective`)."""

    forward: tuple[GatherStep, ...]
    forward_lead_s: float
    backward: tuple[GatherStep, ...]
    layers: tuple[Layer, ...]

    def __post_init__(self) -> None:
        if len(self.backward) != len(self.layers):
            raise ValueError(f"FsdpStep: {len(self.backward)} backward gathers for "
                             f"{len(self.layers)} layers (one re-gather per layer)")


@dataclass(frozen=True)
class FsdpPlan:
    """A policy's FSDP step: each pass's gathers (distance, allocation per gather), the
    reduce-scatters' buckets, and the predicted forward and backward seconds."""

    forward: GatherPlan
    backward: GatherPlan
    buckets: tuple[Bucket, ...]
    forward_s: float
    backward_s: float


def regathered_layers(step: FsdpStep, cost: CostModel, *, distance: int,
                      blocks: int | Sequence[int]) -> list[Layer]:
    """The backward pass's layers as the re-gathers leave them: layer i's compute stretched to
    the time from layer i - 1's end to its own in the re-gathers' `gather_timeline` (waits for
    its gather and the gathers' contention included), so its gradient is ready when it is.

    The sequential composition of the two streams is this function's assumption: the
    reduce-scatters are then priced on these layers by `simulate` (their contention slows the
    stretched compute, waits included), and a reduce-scatter and a gather in flight together
    do not slow each other; on one NCCL communicator they would share the link."""
    tl = gather_timeline(step.backward, cost, distance=distance, blocks=blocks)
    ends = [span.compute_end for span in tl.gathers]
    return [Layer(end - prev, layer.grad_bytes, layer.collective)
            for layer, end, prev in zip(step.layers, ends, [0.0, *ends[:-1]])]


def compare_fsdp(step: FsdpStep, cost: CostModel, *, default_alloc: int,
                 fusion_bytes: int = XLA_COMBINE_BYTES, prefuse: int = DEFAULT_PREFUSE,
                 max_bytes: int = 1 << 30) -> dict[str, FsdpPlan]:
    """The FSDP step under each of `FSDP_POLICIES`. The baselines issue each gather one ahead
    (XLA's latency-hiding scheduler) at ``default_alloc`` and reduce-scatter in the default's
    (``fusion_bytes``) or the planner's fusion-only grouping; Libra plans each pass's gathers
    (`plan_gathers`, at most ``max_bytes`` held ahead) and then the reduce-scatters on the
    layers they leave (`regathered_layers`, `compare_policies`' ``libra``); in the backward
    pass it keeps the baselines' re-gathers where those leave the shorter pass, so it is never
    slower than either baseline in this model."""
    default_alloc = _check_blocks(default_alloc, cost)

    def fixed(steps: Sequence[GatherStep], lead_s: float) -> GatherPlan:
        d = min(1, len(steps))
        one = simulate_gathers(steps, cost, distance=0, blocks=default_alloc, lead_s=lead_s)
        total = simulate_gathers(steps, cost, distance=d, blocks=default_alloc, lead_s=lead_s)
        return GatherPlan(d, (default_alloc,) * len(steps), total, one)

    def planned(steps: Sequence[GatherStep], lead_s: float) -> GatherPlan:
        return plan_gathers(steps, cost, one_call_blocks=[default_alloc] * len(steps),
                            max_bytes=max_bytes, lead_s=lead_s)

    out: dict[str, FsdpPlan] = {}
    fwd, bwd = fixed(step.forward, step.forward_lead_s), fixed(step.backward, 0.0)
    layers = regathered_layers(step, cost, distance=bwd.distance, blocks=bwd.blocks)
    baselines = compare_policies(layers, cost, default_alloc=default_alloc,
                                 fusion_bytes=fusion_bytes, prefuse=prefuse)
    for name in ("default", "fusion-only"):
        p = baselines.plans[name]
        out[name] = FsdpPlan(fwd, bwd, tuple(p.buckets), fwd.total_s, p.backward_s)
    # Libra: the planned gathers; in the backward pass the baselines' re-gathers too, whichever
    # leaves the shorter pass once the reduce-scatters are planned on it (the two streams are
    # planned one after the other, so the gathers' best alone need not be the step's best).
    fwd = planned(step.forward, step.forward_lead_s)
    best: tuple[float, GatherPlan, Plan] | None = None
    for gathers in (planned(step.backward, 0.0), bwd):
        layers = regathered_layers(step, cost, distance=gathers.distance, blocks=gathers.blocks)
        p = (baselines if gathers is bwd else compare_policies(
            layers, cost, default_alloc=default_alloc, fusion_bytes=fusion_bytes,
            prefuse=prefuse)).plans["libra"]
        if best is None or p.backward_s < best[0] * (1 - TIE_RTOL):
            best = (p.backward_s, gathers, p)
    assert best is not None
    out["libra"] = FsdpPlan(fwd, best[1], tuple(best[2].buckets), fwd.total_s, best[0])
    return out
