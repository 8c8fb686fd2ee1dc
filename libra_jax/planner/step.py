"""The whole step as it runs, both ways: plain (XLA's collectives) and as `optimize` issues it,
and the predicted ratio of the two (issue 73).

The planner's `simulate` prices one scope's backward pass under a plan; a user measures the
step, plain against optimized. `price_step` prices both programs of one step from the same
terms, so that their ratio is the number to compare with a measurement:

    plain     = compute_s + Σ_operands_of_XLA's_calls (xla.call_s + wire_bytes / xla.bytes_per_s)
                          + stagger(plain's synchronizations)
    optimized = compute_s + Σ_scopes (simulate(layers, buckets, cost) - Σ layer.compute_s)
                          + Σ pending_at(pending_s, its ready point) (one-call buckets
                            outside loops that the planner priced as pairs)
                          + Σ_other_calls libra_s
                          + stagger(its synchronizations)
    stagger(t_1 < ... < t_k) = sync_stagger * (Σ_segments sqrt(segment) - sqrt(compute_s))

* ``compute_s``: the step's own compute (forward, backward, update) at the profile's rates,
  the same in both programs (`libra_jax.rewrite.report.price_step` sums the roofline of the
  step's equations, as the planner's layers are priced, each at the part one device runs: a
  GSPMD update of sharded parameters outside the shard_map at its shard,
  `rewrite.costs.step_roofline_s`).
* Plain: XLA:CPU runs each collective as a blocking call of every device thread, writing a
  fresh output buffer, after the backward pass (nothing overlaps it). Its all-reduce combiner
  joins the independent all-reduces of one computation into one call per
  `XLA_CPU_COMBINE_COUNT` operands with no byte limit (``CpuAllReduceCombiner(kCombineBytes =
  int64 max, kCombineCount = 256)``, xla/service/cpu/cpu_compiler.cc; the compiled HLO of each
  example's plain step holds one all-reduce); every other kind is one call each. A combined
  call still meets once per operand (XLA:CPU's all-reduce thunk runs one ``comm.AllReduce``, a
  rendezvous of every rank, per operand: xla/backends/cpu/runtime/all_reduce_thunk.cc), so each
  operand costs `XlaTerms.call_s` plus its bytes, times the kind's traffic against the
  all-reduce's (the profile's, `CostModel.terms`), at
  `XlaTerms.bytes_per_s`: the profile's ``xla_allreduce_call_us`` and
  ``xla_allreduce_gbyte_per_s`` (fair-share form), measured (benchmarks/results/
  allreduce_cpu.md).
* Optimized: per planned scope what the planner's model adds to the compute it overlaps: the
  exposed part of each bucket's collective, its issue (``call_s``), and the compute's slowdown
  under its blocks (`simulate` minus the layers' compute); each bucket issued as one call
  (``sync``) mid-backward leaves a collective pending in XLA:CPU's program, which costs the
  step the profile's ``pending_allreduce_us``, at most the compute left after its ready point
  (`core.pending_at`: the cost `optimize(overlap="auto")` weighs): the planner prices it for
  the kinds whose buckets are one call (`CollectiveTerms.pending_s`, in `simulate`), this
  sum the all-reduce buckets planned as pairs that were issued as one call; the
  collectives planned apart from the backward pass (a loss's pmean, an all-gather's exposed
  time) at what the model prices each (`OtherCall.libra_s`), each the calls it makes
  (`OtherCall.calls`: the members of a fused forward all-gather after its first make none).

* Stagger: where the devices' threads share the cores, each runs ahead or falls behind by the
  scheduler's time slices (a random walk), so at a blocking collective the last device
  arrives about ``sync_stagger * sqrt(T)`` after the others, T the compute since they last
  met; the step pays it at each synchronization (measured: benchmarks/results/
  sync_stagger.md). The segments are those between a program's synchronizations on one
  device's compute, each planned scope's backward pass at the end of the step (the forward
  before it), less the scope's compute that waits for its gradients (`PlannedScope.after_s`:
  the optimizer's update, which runs after the devices have met at the gradients; on the
  2-core VM the Flax AdamW step's devices reach its calls 6.7 ms apart, its update a third
  of the step: benchmarks/results/call_timeline.md): plain's at each of XLA's calls (a
  combined all-reduce where its last operand is ready, any other kind at its operand's ready
  point, as XLA:CPU's schedule issues a reduce-scatter where its gradient is made), the
  optimized program's at each one-call bucket's ready point and at the end of the backward
  pass (a pair's done). Less what one segment, the whole step, already pays: the compute's
  rates are measured over a step's devices, which meet at its end. The collectives planned
  apart (a loss's pmean, forward all-gathers) have no ready point here and add none.

Plain is the step jitted without `optimize`: for the GSPMD route (`libra_jax.value_and_grad`)
the route's own program, not the program XLA's partitioner makes of `jax.value_and_grad`
(which lays out compute and collectives its own way: benchmarks/results/step_prediction.md
times both). The probe (`model.probe`) rescales the XLA bytes rate with the machine's memory
rate and keeps its call cost, as it does the engine's.

Not priced: a start/done pair's deferred work beside idle cores (0 where the compute threads
fill the cores, as 8 host devices do on 2), a loop body's iterations (each side once), and
the GPU forms (no XLA terms known: `StepPrice` is None there).

Layer 1: pure Python, no JAX.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from libra_jax import collectives
from libra_jax.collectives import Collective
from libra_jax.planner.core import Bucket, CostModel, Layer, pending_at, simulate

__all__ = ["XLA_CPU_COMBINE_COUNT", "XlaTerms", "PlannedScope", "OtherCall", "StepPrice",
           "price_step", "synchronizations", "stagger_s"]

#: Operands XLA:CPU's all-reduce combiner joins into one all-reduce (``kCombineCount``;
#: its byte threshold is unlimited): xla/service/cpu/cpu_compiler.cc.
XLA_CPU_COMBINE_COUNT = 256


@dataclass(frozen=True)
class XlaTerms:
    """How XLA runs a collective of the plain step: ``call_s`` per operand (the device threads'
    rendezvous; a combined all-reduce meets once per operand), ``bytes_per_s`` the bytes per
    rank a second of an all-reduce that writes a fresh output buffer; ``combine_count`` the
    all-reduce operands its combiner joins into one call."""

    call_s: float
    bytes_per_s: float
    combine_count: int = XLA_CPU_COMBINE_COUNT

    def __post_init__(self) -> None:
        if not (math.isfinite(self.call_s) and self.call_s >= 0):
            raise ValueError(f"XlaTerms.call_s must be a finite number >= 0, got {self.call_s!r}")
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"XlaTerms.bytes_per_s must be a finite number > 0, got "
                             f"{self.bytes_per_s!r}")
        if self.combine_count < 1:
            raise ValueError(f"XlaTerms.combine_count must be >= 1, got {self.combine_count!r}")

    def calls_s(self, operands: int, wire_bytes: float) -> float:
        """Seconds of `operands` operands' calls moving `wire_bytes` (bytes times their kind's
        traffic)."""
        return operands * self.call_s + wire_bytes / self.bytes_per_s


@dataclass(frozen=True)
class PlannedScope:
    """One planned scope as `optimize` issues it: the planner's layers, buckets and cost model,
    ``sync`` per bucket (issued as one call: True; a start/done pair: False), ``calls`` the
    calls its buckets make (a bucket whose members cannot be one call makes several; None: one
    per bucket with bytes), ``in_loop`` a loop body's scope (no pending cost: each iteration's
    calls are done within it), ``after_s`` its compute that waits for its gradients (the
    optimizer's update: it runs after the backward pass, where the devices have met).
    ``key``: what XLA's combiner joins on in plain (the scope and its axes): the all-reduces
    of one key are one computation's."""

    key: Hashable
    layers: tuple[Layer, ...]
    buckets: tuple[Bucket, ...]
    cost: CostModel
    sync: tuple[bool, ...] = ()
    calls: int | None = None
    in_loop: bool = False
    after_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.after_s) and self.after_s >= 0):
            raise ValueError(f"PlannedScope.after_s must be a finite number >= 0, got "
                             f"{self.after_s!r}")


@dataclass(frozen=True)
class OtherCall:
    """A collective of the step not planned with a backward pass (a loss's pmean, a psum given
    ``blocks=``, an all-gather): its ``nbytes`` per rank, its kind, ``traffic`` (its seconds
    per byte over the all-reduce's: `CostModel.terms`), ``libra_s`` what it costs the
    optimized step (not overlapped), and ``key`` as `PlannedScope.key` (None: never
    combined, as XLA:CPU combines all-reduces only)."""

    key: Hashable
    nbytes: int
    collective: Collective
    traffic: float
    libra_s: float
    #: The calls it makes in the optimized step: 1, or 0 for a member of a call over several
    #: (a fused forward all-gather's members after its first).
    calls: int = 1


@dataclass(frozen=True)
class StepPrice:
    """The step's predicted time both ways and their terms (seconds; see the module doc).

    ``compute_s`` the step's compute (both programs); ``plain_calls`` / ``plain_operands`` /
    ``plain_bytes`` / ``plain_collectives_s`` the calls XLA makes in plain (after its
    combiner), the rendezvous they make (one per operand), their bytes per rank and their cost;
    ``optimized_calls`` the calls libra's engine makes, ``exposed_s`` what the planned scopes
    add to their compute (`simulate` minus compute: exposed collective, issue, contention),
    ``pending_s`` the one-call buckets left pending in XLA:CPU's program that the planner
    priced as pairs (the others' is in ``exposed_s``),
    ``others_s`` the other collectives' cost; ``plain_stagger_s`` / ``optimized_stagger_s``
    what each program's synchronizations cost it in the devices' stagger (the module doc)."""

    compute_s: float
    plain_calls: int
    plain_operands: int
    plain_bytes: int
    plain_collectives_s: float
    optimized_calls: int
    exposed_s: float
    pending_s: float
    others_s: float
    plain_stagger_s: float = 0.0
    optimized_stagger_s: float = 0.0

    @property
    def plain_s(self) -> float:
        """Predicted plain step: its compute plus XLA's collectives and their stagger."""
        return self.compute_s + self.plain_collectives_s + self.plain_stagger_s

    @property
    def optimized_collectives_s(self) -> float:
        """What libra's collectives add to the optimized step's compute, stagger included."""
        return self.exposed_s + self.pending_s + self.others_s + self.optimized_stagger_s

    @property
    def optimized_s(self) -> float:
        """Predicted optimized step: its compute plus what libra's collectives add."""
        return self.compute_s + self.optimized_collectives_s

    @property
    def predicted_ratio(self) -> float:
        """Predicted optimized / plain step time (1.0 for a step that costs nothing)."""
        return self.optimized_s / self.plain_s if self.plain_s > 0 else 1.0


def price_step(compute_s: float, scopes: Sequence[PlannedScope], others: Sequence[OtherCall],
               xla: XlaTerms, pending_s: float | None, sync_stagger: float = 0.0) -> StepPrice:
    """`StepPrice` of a step of `compute_s` seconds of compute whose collectives are `scopes`
    (planned) and `others`, plain's at `xla`, an issued one-call bucket's pending cost
    `pending_s` (None: not known, 0), the devices' stagger `sync_stagger` (seconds per root
    second of compute between synchronizations; 0: none)."""
    if not (math.isfinite(compute_s) and compute_s >= 0):
        raise ValueError(f"compute_s must be a finite number >= 0, got {compute_s!r}")
    if not (math.isfinite(sync_stagger) and sync_stagger >= 0):
        raise ValueError(f"sync_stagger must be a finite number >= 0, got {sync_stagger!r}")
    combined: dict[Hashable, list[int]] = {}   # plain's all-reduce operands, per computation
    plain_calls, plain_operands, plain_bytes, plain_s = 0, 0, 0, 0.0

    def plain_one(key: Hashable, nbytes: int, collective: Collective, traffic: float) -> None:
        nonlocal plain_calls, plain_operands, plain_bytes, plain_s
        if combined_by_xla(collective) and key is not None:
            combined.setdefault(key, []).append(nbytes)
            return
        plain_calls += 1
        plain_operands += 1
        plain_bytes += nbytes
        plain_s += xla.calls_s(1, nbytes * traffic)

    exposed = pending = 0.0
    optimized_calls = 0
    for scope in scopes:
        for layer in scope.layers:
            if layer.grad_bytes:
                plain_one(scope.key, layer.grad_bytes, layer.collective,
                          scope.cost.terms(layer.collective).traffic)
        exposed += (simulate(scope.layers, scope.buckets, scope.cost)
                    - sum(layer.compute_s for layer in scope.layers))
        full = [b for b in scope.buckets
                if any(scope.layers[i].grad_bytes for i in range(b.first, b.last + 1))]
        optimized_calls += scope.calls if scope.calls is not None else len(full)
        if not scope.in_loop and pending_s:
            # The one-call buckets the planner priced as pairs (`CollectiveTerms.pending_s` 0:
            # `overlap="auto"` chose one call after planning), at what `pending_at` gives them.
            sync = scope.sync or (True,) * len(scope.buckets)
            done = list(itertools.accumulate(layer.compute_s for layer in scope.layers))
            pending += sum(
                pending_at(pending_s, done[b.last], done[-1])
                for b, one_call in zip(scope.buckets, sync)
                if one_call and b in full
                and scope.cost.terms(scope.layers[b.first].collective).pending_s == 0)
    for other in others:
        plain_one(other.key, other.nbytes, other.collective, other.traffic)
        optimized_calls += other.calls
    for operands in combined.values():
        plain_calls += -(-len(operands) // xla.combine_count)
        plain_operands += len(operands)
        plain_bytes += sum(operands)
        plain_s += xla.calls_s(len(operands), sum(operands))
    plain_syncs, optimized_syncs = synchronizations(compute_s, scopes)
    return StepPrice(compute_s=float(compute_s), plain_calls=plain_calls,
                     plain_operands=plain_operands, plain_bytes=plain_bytes, plain_collectives_s=plain_s,
                     optimized_calls=optimized_calls, exposed_s=exposed, pending_s=pending,
                     others_s=sum(o.libra_s for o in others),
                     plain_stagger_s=stagger_s(plain_syncs, compute_s, sync_stagger),
                     optimized_stagger_s=stagger_s(optimized_syncs, compute_s, sync_stagger))


def combined_by_xla(collective: Collective) -> bool:
    """Whether XLA:CPU's combiner joins `collective`'s calls of one computation into one: its
    ``CpuAllReduceCombiner`` takes the all-reduce alone (xla/service/cpu/cpu_compiler.cc);
    every other kind is one call per operand, where its operand is made."""
    return collective is collectives.REFERENCE


def synchronizations(compute_s: float, scopes: Sequence[PlannedScope]
                     ) -> tuple[list[float], list[float]]:
    """(plain's, the optimized program's) blocking collectives in the planned `scopes`, as
    seconds into one device's `compute_s` (the module doc: each scope's backward pass at the
    end of the step, less the update that waits for its gradients; plain's combined
    all-reduce of a key where its last operand is ready and any other kind where its operand
    is; a one-call bucket where it is ready, a pair's done at the end of the backward
    pass)."""
    plain: list[float] = []
    combined: dict[Hashable, float] = {}
    optimized: list[float] = []
    for scope in scopes:
        done = list(itertools.accumulate(layer.compute_s for layer in scope.layers))
        if not done:
            continue
        start = max(0.0, compute_s - scope.after_s - done[-1])
        for layer, t in zip(scope.layers, done):
            if not layer.grad_bytes:
                continue
            if combined_by_xla(layer.collective):
                combined[scope.key] = max(combined.get(scope.key, 0.0), start + t)
            else:
                plain.append(start + t)
        sync = scope.sync or (True,) * len(scope.buckets)
        for bucket, one_call in zip(scope.buckets, sync):
            if any(scope.layers[i].grad_bytes for i in range(bucket.first, bucket.last + 1)):
                optimized.append(start + (done[bucket.last] if one_call else done[-1]))
    return plain + list(combined.values()), optimized


def stagger_s(syncs: Sequence[float], compute_s: float, sync_stagger: float) -> float:
    """What synchronizations at `syncs` (seconds into `compute_s`) cost a step in the devices'
    stagger: ``sync_stagger`` times the square roots of the segments between them, less the
    one segment of a step without any (the module doc)."""
    if sync_stagger == 0 or compute_s <= 0:
        return 0.0
    points = sorted({min(max(t, 0.0), compute_s) for t in syncs} | {0.0, float(compute_s)})
    roots = sum(math.sqrt(b - a) for a, b in zip(points, points[1:]))
    return sync_stagger * max(0.0, roots - math.sqrt(compute_s))
