"""The functional forms: a ring collective's steps, bytes and latency, the three forms'
bandwidth and slowdown curves (the package docstring derives each), and each form's tables of
options per allocation (`FORM_TABLE`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from libra_jax.collectives import ROWS, Collective, Shape
from libra_jax.model.profile import (
    BYTES_PER_GBYTE,
    BYTES_PER_S_PER_MIB_PER_MS,
    FORMS,
    NetworkSpec,
    Profile,
)
from libra_jax.planner import KINDS


def check_workers(workers: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
        raise ValueError(f"workers must be an integer >= 2 (a ring needs two ranks), got {workers!r}")


#: A kind's model terms: its row's (`collectives.Shape`).
CollectiveShape = Shape

#: The per-collective terms by the model's name of each kind, read from the kinds' rows
#: (`collectives.ROWS`: a kind's terms are written there once).
COLLECTIVE_SHAPES: Mapping[str, CollectiveShape] = MappingProxyType(
    {row.kind: row.shape for row in ROWS})
assert tuple(COLLECTIVE_SHAPES) == KINDS


def shape_of(collective: Collective) -> CollectiveShape:
    """The model's terms of `collective` (its row), read from the row when asked; a row
    without them is refused by the kind's name, never priced as another kind."""
    shape = collective.shape
    if not isinstance(shape, Shape):
        raise ValueError(f"the {collective.kind} collective's row has no model shape "
                         "(collectives.Shape: ring steps, bus fraction, engine traffic)")
    return shape


def ring_steps(workers: int, collective: Collective) -> int:
    """Communication steps of a ring `collective` (its row): ``2(n-1)`` for the all-reduce (a
    reduce-scatter plus an all-gather), ``n-1`` for either half."""
    check_workers(workers)
    return shape_of(collective).steps(workers)


def ring_bytes_per_rank(grad_bytes: float, workers: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``grad_bytes``: ``2(n-1)/n``."""
    check_workers(workers)
    return grad_bytes * 2.0 * (workers - 1) / workers


def ring_algo_factor(workers: int) -> float:
    """Gradient bytes per second per bus byte per second: ``n / (2(n-1))`` (1 at two ranks)."""
    check_workers(workers)
    return workers / (2.0 * (workers - 1))


def ring_latency_s(network: NetworkSpec, workers: int, collective: Collective) -> float:
    """Latency of one ring `collective` (its row): base plus one hop latency per step (NCCL tuning.cc
    shape).

    Steps that cross nodes (the collective's steps over the nodes: ``2(nodes-1)`` for the
    all-reduce) pay the inter-node hop latency, the others the intra-node one.
    """
    steps = ring_steps(workers, collective)
    nodes = math.ceil(workers / network.devices_per_node)
    inter = shape_of(collective).steps(nodes)
    return (network.base_latency_s + (steps - inter) * network.intra_step_latency_s
            + inter * network.inter_step_latency_s)



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


# --- Each form's options per allocation ---------------------------------------------------

_OptionTables = tuple[dict[int, float], dict[int, float], dict[int, float]]  # solo, overlap, slowdown


class _Option(NamedTuple):
    """One allocation's entries: gradient bytes per second alone and beside compute, and the
    slowdown of the compute beside it."""

    solo: float
    overlap: float
    slowdown: float


def _tables(keys: Iterable[int], row: Callable[[int], _Option | str],
            dropped: dict[int, str]) -> _OptionTables:
    """The cost model's three tables from a form's allocations `keys` (in order; a repeated key
    counts once) and its `row(key)`: the key's entries, or why it is dropped (said in
    `dropped`, `Derivation.dropped`)."""
    solo: dict[int, float] = {}
    overlap: dict[int, float] = {}
    slowdown: dict[int, float] = {}
    for key in keys:
        if key in slowdown or key in dropped:
            continue
        entry = row(key)
        if isinstance(entry, str):
            dropped[key] = entry
            continue
        solo[key], overlap[key], slowdown[key] = entry
    return solo, overlap, slowdown


def _libra_fit_options(profile: Profile, link: float, algo: float, dropped: dict[int, str],
                       notes: list[str]) -> _OptionTables:
    fit = profile.libra_fit
    assert fit is not None
    scale = link / fit.reference_link_bytes_per_s

    def row(key: int) -> _Option | str:
        eff = key / scale  # bandwidth fits evaluated at T/k ...
        bw_o = libra_bandwidth_mib_per_ms(eff, *fit.overlap_bw) * scale  # ... and multiplied by k
        bw_s = libra_bandwidth_mib_per_ms(eff, *fit.solo_bw) * scale
        slow = libra_slowdown(key, *fit.slowdown)  # slowdown at T itself
        if not math.isfinite(slow):
            pole = fit.slowdown[1] / fit.slowdown[2]
            return (f"slowdown fit {fit.slowdown[0]:g}/({fit.slowdown[1]:g} - {fit.slowdown[2]:g}*T) "
                    f"has its pole at T = {pole:.0f}; T = {key} is beyond it")
        if bw_o <= 0 or bw_s <= 0:
            return (f"bandwidth fit is not positive at T/k = {eff:g} threads "
                    f"(overlapped {bw_o:.3g}, solo {bw_s:.3g} MiB/ms)")
        if slow < 1.0:
            notes.append(f"T = {key}: fitted slowdown {slow:.4f} < 1 raised to 1")
            slow = 1.0
        if bw_o > bw_s:
            notes.append(f"T = {key}: overlapped fit {bw_o:.4f} > solo fit {bw_s:.4f} MiB/ms; capped at solo")
            bw_o = bw_s
        to_grad = BYTES_PER_S_PER_MIB_PER_MS * algo
        return _Option(bw_s * to_grad, bw_o * to_grad, slow)
    return _tables((max(1, round(base * scale)) for base in fit.thread_options), row, dropped)


def _nccl_style_options(profile: Profile, link: float, algo: float, dropped: dict[int, str],
                        notes: list[str]) -> _OptionTables:
    c = profile.nccl_style
    assert c is not None
    dev = profile.device

    def row(k: int) -> _Option | str:
        if k * c.units_per_block >= dev.compute_units:
            return (f"{k} blocks would occupy all {dev.compute_units} "
                    f"{dev.compute_unit_kind}s, leaving none for compute")
        bus_s = nccl_bus_bandwidth(k, c.per_block_bytes_per_s, link, c.softmin_p)
        bus_o = nccl_bus_bandwidth(k, c.per_block_bytes_per_s, link, c.softmin_p, c.overlap_block_efficiency)
        traffic = c.memory_bytes_per_bus_byte * bus_o
        slow = nccl_slowdown(k, compute_units=dev.compute_units, units_per_block=c.units_per_block,
                             memory_bound_fraction=c.memory_bound_fraction,
                             memory_bytes_per_s=dev.memory_bytes_per_s, comm_memory_bytes_per_s=traffic)
        if not math.isfinite(slow):
            return (f"the collective's memory traffic {traffic / BYTES_PER_GBYTE:.0f} GB/s "
                    f"would take all {dev.memory_bytes_per_s / BYTES_PER_GBYTE:.0f} GB/s")
        return _Option(bus_s * algo, bus_o * algo, slow)
    return _tables(c.block_options, row, dropped)


def fair_share_oversubscribed(compute_threads: float, cores: float) -> bool:
    """Whether ``compute_threads`` busy compute threads fill a host's ``cores`` cores (``D >
    P``, as 8 XLA host devices do on 2 cores). Then the devices take turns on the cores and
    reach each call milliseconds apart: a gradient bucket's reduction starts when the last one
    arrives, the others waiting at their calls, and runs at its solo rate beside no compute it
    slows. Measured (benchmarks/results/call_timeline.md, 8 devices on 2 cores): the last rank
    in 12-28 ms after the first, each reduction then within 1.0-1.7x its solo time (beside all
    ``D`` threads the form priced 3-7x); the MLP example's step at 1 and at 8 blocks within
    the spread (contention_sweep.md). Where the threads leave cores idle, the devices run side
    by side and a reduction runs beside their compute."""
    fair_share_core_share(compute_threads, cores)  # (both positive)
    return compute_threads > cores


def _fair_share_options(profile: Profile, link: float, algo: float, dropped: dict[int, str],
                        notes: list[str]) -> _OptionTables:
    c = profile.fair_share
    assert c is not None
    waiting = fair_share_oversubscribed(c.compute_threads, c.cores)
    if waiting:
        notes.append(f"{c.compute_threads:g} compute threads fill {c.cores:g} cores: a bucket's "
                     "reduction runs at its solo rate while the other devices wait, slowing no "
                     "compute")

    def row(k: int) -> _Option:
        cores_alone = k * fair_share_core_share(k, c.cores)  # min(k, P)
        solo = nccl_bus_bandwidth(1, cores_alone * c.per_block_bytes_per_s, link, c.softmin_p) * algo
        if waiting:
            return _Option(solo, solo, 1.0)
        cores_beside = k * fair_share_core_share(k + c.compute_threads, c.cores)
        return _Option(
            solo,
            nccl_bus_bandwidth(1, cores_beside * c.per_block_bytes_per_s, link, c.softmin_p,
                               c.overlap_block_efficiency) * algo,
            fair_share_slowdown(k, compute_threads=c.compute_threads, cores=c.cores))
    return _tables(c.block_options, row, dropped)


class _Form(NamedTuple):
    """One profile form: its section of the document (and field of `Profile`), and how it
    becomes a cost model's options, keys and fusion cost (how it is read: its reader in
    `libra_jax.model.read`, keyed alike)."""

    section: str
    options: Callable[[Profile, float, float, dict[int, str], list[str]], _OptionTables]
    key_unit: str  # what the cost model's keys count
    threads_per_block: Callable[[Any], int]  # of the section's value
    #: The bucket bytes per second at which a fused bucket is packed and split back: the
    #: profile's ``fusion_copy_gbyte_per_s`` (inf: nothing is copied); the Libra artifact's
    #: fit prices fusion at nothing (as the paper does).
    fusion_copy_rate: Callable[[Any], float]
    #: What one more call costs the compute stream beside its latency (``call_us``); the
    #: artifact's fit: nothing, as the paper prices a call by its latency alone.
    call_s: Callable[[Any], float]


#: Every form, by name: the one place a form is dispatched on (its reader: `read.FORM_READERS`).
FORM_TABLE: Mapping[str, _Form] = MappingProxyType({
    "libra-fit": _Form("libra_fit", _libra_fit_options, "total_threads",
                       lambda f: f.max_threads_per_block, lambda f: math.inf, lambda f: 0.0),
    "nccl-style": _Form("nccl_style", _nccl_style_options, "blocks",
                        lambda f: f.threads_per_block, lambda f: f.fusion_copy_bytes_per_s,
                        lambda f: f.call_s),
    "fair-share": _Form("fair_share", _fair_share_options, "blocks",
                        lambda f: f.threads_per_block, lambda f: f.fusion_copy_bytes_per_s,
                        lambda f: f.call_s),
})
assert tuple(FORM_TABLE) == FORMS

