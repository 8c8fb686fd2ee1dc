"""The planner's inputs and outputs, its checks, and the cost formula: `simulate` and
`timeline` of a plan, the one-collective phases every planner prices with (the model: the
package docstring)."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple, TypeGuard

import numpy as np

from libra_jax import collectives
from libra_jax.collectives import Collective

TIE_RTOL = 1e-12  # backward times within this relative distance are a tie
#: Horovod 0.20.3's HOROVOD_FUSION_THRESHOLD default (the version Libra patched): the default
#: policy's fusion threshold.
HOROVOD_FUSION_BYTES = 64 << 20
#: The Libra artifact's "default" baseline allocation: 2048 threads for every group.
LIBRA_DEFAULT_THREADS = 2048


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
                          collective: Collective) -> int:
    """The allocation of a `collective` (its row) of `nbytes` per rank (a reduce-scatter's input, an
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
KINDS: tuple[str, ...] = collectives.KINDS
#: The kind a `CostModel`'s tables and ``latency_s`` price, every other kind's terms measured
#: against it (`CollectiveTerms`), a `Layer`'s default: `collectives.REFERENCE`.
REFERENCE: Collective = collectives.REFERENCE


def _others() -> list[Collective]:
    """The kinds priced by their `CollectiveTerms`, in table order (the rows as they are now)."""
    return [row for row in collectives.ROWS if row is not REFERENCE]


@dataclass(frozen=True)
class Layer:
    """One layer of the backward pass, listed in backward order (first = finishes first).

    ``compute_s`` is its backward compute at full speed (seconds); ``grad_bytes`` the size of the
    gradient it produces, ready for its collective when the layer ends (the unsharded buffer:
    a reduce-scatter's input); ``collective`` what reduces it: its row (`libra_jax.collectives`),
    or its name (one of `KINDS`, or its `jax.lax` name), which becomes its row; the
    all-reduce by default. A bucket holds layers of one collective only.
    """

    compute_s: float
    grad_bytes: int
    collective: Collective = REFERENCE

    def __post_init__(self) -> None:
        if not _is_real(self.compute_s) or not math.isfinite(self.compute_s) or self.compute_s < 0:
            raise ValueError(f"Layer.compute_s must be a finite number >= 0, got {self.compute_s!r}")
        if not _is_int(self.grad_bytes) or self.grad_bytes < 0:
            raise ValueError(f"Layer.grad_bytes must be an integer >= 0, got {self.grad_bytes!r}")
        try:
            row = collectives.row_of(self.collective)
        except (ValueError, TypeError):
            row = None
        if row is None or row not in collectives.ROWS:
            raise ValueError(f"Layer.collective must be one of {', '.join(KINDS)}, "
                             f"got {self.collective!r}")
        object.__setattr__(self, "collective", row)
        object.__setattr__(self, "compute_s", float(self.compute_s))
        object.__setattr__(self, "grad_bytes", int(self.grad_bytes))


@dataclass(frozen=True)
class CollectiveTerms:
    """How a collective other than the all-reduce is priced against a `CostModel`'s tables.

    ``latency_s`` replaces the all-reduce's latency; ``traffic`` multiplies its bytes: the
    seconds per gradient byte it takes over the all-reduce's at the same allocation (a ring
    reduce-scatter moves half of an all-reduce's bytes in half its steps: 0.5). Allocation
    and contention are the all-reduce's (the same blocks move the bytes beside the same
    compute), so ``slowdown`` applies as it is. ``pending_s``: what a bucket of it issued as
    one call takes from the compute stream while compute remains after its ready point (at
    most that compute): the rank-wait a one-call collective leaves pending in XLA:CPU's
    program (the profile's ``pending_allreduce_us``); 0 where its buckets are start/done
    pairs or the platform has no such wait.
    """

    latency_s: float
    traffic: float
    pending_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("latency_s", "traffic", "pending_s"):
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
    collective with allocation ``k`` is active, its ``latency_s`` included. Issuing a bucket
    takes the compute stream `issue_s` before the collective's latency starts: ``call_s`` for
    any call (what one more call costs a step beside its latency: the hand-off to the
    collective's workers, the ranks' arrival), plus, for a fused bucket, ``pack_s_per_byte``
    per byte packed into one buffer (`pack_s`; 0: the members are taken as they are). Both 0:
    a call costs only its latency and fusion is free, as in the paper. ``pending_s`` (the
    all-reduce's; another kind's is its `CollectiveTerms.pending_s`): what a bucket issued as
    one call takes from the compute stream beside, at most the compute left after its ready
    point (`pending_at`).

    The tables and ``latency_s`` are the all-reduce's; ``collectives`` prices the others a
    layer may ask for (`Layer.collective`), each by its `CollectiveTerms` under its row (given
    by its row or its name, which becomes its row): a bucket of ``b`` bytes of collective ``c``
    costs ``issue_s + terms(c).latency_s + b * terms(c).traffic / bw[k]`` (`terms`).
    """

    latency_s: float
    solo_bw: Mapping[int, float]
    overlap_bw: Mapping[int, float]
    slowdown: Mapping[int, float]
    pack_s_per_byte: float = 0.0
    call_s: float = 0.0
    collectives: Mapping[Collective, CollectiveTerms] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))
    pending_s: float = 0.0

    def __post_init__(self) -> None:
        lat = self.latency_s
        if not _is_real(lat) or not math.isfinite(lat) or lat < 0:
            raise ValueError(f"CostModel.latency_s must be a finite number >= 0, got {lat!r}")
        object.__setattr__(self, "latency_s", float(lat))
        for name in ("pack_s_per_byte", "call_s", "pending_s"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
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
        others = _others()
        given: dict[Collective, CollectiveTerms] = {}
        for key, terms in self.collectives.items():  # a row, or its name (the public form)
            try:
                row: Collective | None = collectives.row_of(key)
            except (ValueError, TypeError):
                row = None
            if row is None or row not in others:
                given_as = key if row is None else row.kind
                raise ValueError(f"CostModel.collectives: {given_as!r} is not priced this way "
                                 f"(one of {', '.join(r.kind for r in others)}; the all-reduce's "
                                 "terms are latency_s and the tables)")
            if not isinstance(terms, CollectiveTerms):
                raise ValueError(f"CostModel.collectives[{row.kind!r}] must be CollectiveTerms, "
                                 f"got {type(terms).__name__}")
            given[row] = terms
        object.__setattr__(self, "collectives", MappingProxyType(  # in table order
            {row: given[row] for row in others if row in given}))

    def __hash__(self) -> int:
        return hash((self.latency_s, tuple(self.solo_bw.items()), tuple(self.overlap_bw.items()),
                     tuple(self.slowdown.items()), self.pack_s_per_byte, self.call_s,
                     tuple(self.collectives.items()), self.pending_s))

    def terms(self, collective: Collective) -> CollectiveTerms:
        """The latency and traffic of `collective` (its row; the all-reduce's: ``latency_s``
        and 1)."""
        if collective is REFERENCE:
            return CollectiveTerms(self.latency_s, 1.0, self.pending_s)
        terms = self.collectives.get(collective)
        if terms is None:
            raise ValueError(f"this CostModel does not price the {collective.kind}: give "
                             f"CostModel(collectives={{{collective.kind!r}: CollectiveTerms(...)}}) "
                             "(`model.derive` prices every collective)")
        return terms

    def pack_s(self, nbytes: float, tensors: int) -> float:
        """Seconds to pack (and unpack) a bucket of ``tensors`` non-empty gradients of ``nbytes``.

        Zero for a single tensor: it is all-reduced where it lies. A fused bucket is copied into
        one buffer on the compute stream before its collective can start (and split after it).
        """
        return self.pack_s_per_byte * nbytes if tensors >= 2 else 0.0

    def issue_s(self, nbytes: float, tensors: int) -> float:
        """Seconds the compute stream gives to issuing a bucket of ``tensors`` non-empty
        gradients of ``nbytes`` (one or more): ``call_s`` plus its packing (`pack_s`)."""
        return self.call_s + self.pack_s(nbytes, tensors)

    @property
    def keys(self) -> tuple[int, ...]:
        """The allowed allocations, ascending."""
        return tuple(self.solo_bw)


def pending_at(pending_s: float, ready: float, compute: float) -> float:
    """What a one-call bucket of a collective with `CollectiveTerms.pending_s` `pending_s`,
    ready at compute progress `ready` of `compute` in all, takes from the compute stream: the
    rank-wait, at most the compute left to hide it (none for a bucket ready at the end: the
    step waits for every rank there anyway). Measured on XLA:CPU (2026-12-07, FSDP example):
    its reduce-scatters in two one-call buckets against one cost 1.5 to 3% of the step."""
    return min(pending_s, max(compute - ready, 0.0))


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
    """One collective's phases as the model times them (`_collective`): issued at ``start``
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


# `_collective`'s selections on Python floats: NumPy's `where`, `maximum` and `minimum` for one
# float each (the builtins `max` and `min` take several times longer to call, on the path that
# scores every plan).


def _pick(cond: bool, a: float, b: float) -> float:
    return a if cond else b


def _larger(a: float, b: float) -> float:
    return a if a >= b else b


def _smaller(a: float, b: float) -> float:
    return a if a <= b else b


def _collective(T: Any, P: Any, ready: float, nbytes: Any, lat: float, ob: Any, sb: Any, s: Any,
                C: float, pack: Any = 0.0, *, where: Callable[..., Any] = _pick,
                maximum: Callable[..., Any] = _larger, minimum: Callable[..., Any] = _smaller,
                phases: bool = False) -> Any:
    """One collective issued when the comm stream is free at time ``T`` with progress ``P``:
    (end time, progress then), or with ``phases`` its `Phases`.

    ``ready`` is the progress at which the bucket's last layer ends. Phases: ``pack`` seconds of
    packing on the compute stream (compute makes no progress), ``lat`` seconds, then bytes at
    ``ob`` until compute ends and at ``sb`` after; compute runs at ``1/s`` from the latency on.
    Three cases: compute ends during the latency (all bytes at the solo rate), the transfer
    ends while compute still runs (hidden), or compute ends during the transfer.

    The model's only statement of this formula: `simulate`, `timeline`, `plan`'s search and
    `plan_exhaustive` all price a collective here, so that they cannot drift apart (their plans
    are compared exactly). It runs on Python floats with the defaults and on NumPy arrays that
    broadcast together with NumPy's ``where``, ``maximum`` and ``minimum`` (`_collective_np`):
    every value is computed and then selected, one expression tree for both, so both give the
    same floats. The sums keep the order `simulate` has always used, which scored the committed
    plans: end = (start of the solo phase) + (its bytes) / ``sb``.
    """
    # Wait for the bucket at full compute speed (adding 0.0 leaves a time as it is).
    start = T + maximum(ready - P, 0.0)
    P = maximum(P, ready)
    T = start + pack
    busy = (C - P) * s  # wall time compute still needs under this collective's contention
    window = busy - lat  # overlapped transfer time available after the latency
    cap = window * ob  # bytes that fit in it
    hidden = (window > 0) & (nbytes <= cap)  # the transfer ends while compute still runs
    d_hidden = lat + nbytes / ob
    # Otherwise the solo phase starts once the latency and compute are both over, with the
    # bytes that did not fit in the window (all of them when compute ended during the latency;
    # none when hidden, as they all fit).
    # Maxima rather than a `where` per case: the same floats, as `window <= 0` exactly when
    # `busy <= lat`, and cheaper on arrays (a `where` costs the array path most).
    solo_start = T + where(hidden, d_hidden, maximum(lat, busy))
    end = solo_start + maximum(nbytes - maximum(cap, 0.0), 0.0) / sb
    Q = where(hidden, minimum(C, P + d_hidden / s), C)
    if phases:
        return Phases(start, P, T, T + lat, solo_start, end, Q)
    return end, Q


#: `_collective` over NumPy arrays that broadcast together (the search, the enumeration).
_collective_np = functools.partial(_collective, where=np.where, maximum=np.maximum, minimum=np.minimum)


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
                               cost.issue_s(nbytes, tensors)
                               + pending_at(pricing.pend[last], comp_prefix[last + 1], C))
    return T + (C - P)


class _Pricing(NamedTuple):
    """What each layer's collective (`Layer.collective`, `CostModel.terms`) makes of it:
    ``wire``, prefix sums of the bytes as the tables price them (bytes times the collective's
    traffic; the bytes themselves for the all-reduce); ``lat``, per layer, its collective's
    latency; ``runs``, per layer, the last layer of its run of one collective (a bucket holds
    one collective: `plan`'s ``reach`` is cut there), or None where all are one; ``pend``, per
    layer, its collective's `CollectiveTerms.pending_s`."""

    wire: list[float]
    lat: list[float]
    runs: list[int] | None
    pend: list[float]


def _pricing(layers: Sequence[Layer], cost: CostModel) -> _Pricing:
    terms = {c: cost.terms(c) for c in dict.fromkeys(layer.collective for layer in layers)}
    wire = [0.0, *itertools.accumulate(layer.grad_bytes * terms[layer.collective].traffic
                                       for layer in layers)]
    lat = [terms[layer.collective].latency_s for layer in layers]
    pend = [terms[layer.collective].pending_s for layer in layers]
    if len(terms) == 1:
        return _Pricing(wire, lat, None, pend)
    runs = [len(layers) - 1] * len(layers)
    for i in range(len(layers) - 2, -1, -1):
        same = layers[i + 1].collective is layers[i].collective
        runs[i] = runs[i + 1] if same else i
    return _Pricing(wire, lat, runs, pend)


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
            if layers[i].collective is not layers[first].collective:
                raise ValueError(f"bucket {j} (layers {first}..{last}) mixes the "
                                 f"{layers[first].collective.kind} of layer {first} and the "
                                 f"{layers[i].collective.kind} of layer {i}: a bucket holds one "
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
    from the same formula `simulate` uses (`_collective`)."""
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
        ph = _collective(T, P, comp[b.last + 1], pricing.wire[b.last + 1] - pricing.wire[b.first],
                         pricing.lat[b.last], cost.overlap_bw[k], cost.solo_bw[k], cost.slowdown[k], C,
                         cost.issue_s(nbytes, tensors) + pending_at(pricing.pend[b.last],
                                                                    comp[b.last + 1], C),
                         phases=True)
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


# Shared by the planner, its baselines and the reference: byte prefixes, the reach of a
# bucket, and the baselines' groupings (scored by `plan` too, as a safety net).

def _byte_prefix(layers: Sequence[Layer]) -> list[int]:
    return [0, *itertools.accumulate(l.grad_bytes for l in layers)]


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


_HOROVOD_THRESHOLDS = (HOROVOD_FUSION_BYTES, 2 * HOROVOD_FUSION_BYTES)  # scored as a safety net


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


class _Problem(NamedTuple):
    """A planner's inputs, checked and priced: what `plan` and `plan_exhaustive` start from."""

    layers: list[Layer]
    cost: CostModel
    reach: list[int] | None  # with free boundaries only (`_with_runs` applied); else None
    pricing: _Pricing
    ranges: Ranges | None    # a fixed grouping (`buckets`), or None
    free: bool               # bucket boundaries are chosen (fusion and no fixed grouping)
    comp: list[float]        # compute prefix sums
    byts: list[int]          # byte prefix sums


def _problem(layers: Sequence[Layer], cost: CostModel, *, fusion: bool,
             buckets: Sequence[tuple[int, int]] | None,
             reach: Sequence[int] | None) -> _Problem:
    """`plan`'s and `plan_exhaustive`'s arguments as one `_Problem`: ValueError for bad
    layers, cost, reach or grouping (a fixed grouping's buckets each hold one collective)."""
    layers = _check_layers(layers)
    cost = _check_cost(cost)
    n = len(layers)
    checked = _check_reach(reach, n)
    pricing = _pricing(layers, cost)
    ranges = None
    if buckets is not None:
        ranges = _grouping_ranges(buckets, n)
        _check_one_collective(layers, ranges)
    free = ranges is None and bool(fusion)
    return _Problem(layers, cost, _with_runs(checked, pricing) if free else None, pricing,
                    ranges, free, _prefix(layer.compute_s for layer in layers),
                    _byte_prefix(layers))
