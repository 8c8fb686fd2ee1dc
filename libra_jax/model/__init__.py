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
    bus_overlap(k) = softmin_p(eta * k * min(1, P / (D + k)) * beta,   L)
    slowdown(k)    = max(1, (D + k) / P) / max(1, D / P)          ((D + k) / D once D >= P)

``beta`` is one worker's rate with a core to itself, ``eta`` the fraction of it a worker keeps
beside compute (caches and memory shared: measured, see below). The GPU form's SM partition (``U / (U - k u)``)
does not describe threads time-sliced on a few cores.

Where the compute threads fill the cores (``D > P``, as 8 host devices do on 2 cores:
`fair_share_oversubscribed`) the devices take turns on the cores and reach each call
milliseconds apart: a bucket's reduction starts when the last one arrives, the others waiting
at their calls, and runs at its solo rate, slowing no compute:

    bus_overlap(k) = bus_solo(k),   slowdown(k) = 1                    (D > P)

Measured (benchmarks/results/call_timeline.md, 8 devices on 2 cores): the last rank reaches a
call 12-28 ms after the first, and each reduction then takes 1.0-1.7x its solo time, where the
form above beside all ``D`` priced it 3-7x; the MLP example's step at 1 and at 8 blocks (the
same buckets) within the spread of 40 interleaved rounds (contention_sweep.md), where a form
beside one device's compute made 8 blocks 5% slower. There a block count matters through its
solo rate alone.

The price of a call and of fusion (both analytic forms)
-------------------------------------------------------
Issuing a collective takes the compute stream ``call_us`` (``CostModel.call_s``): what one more
call costs a step beside its latency, the ranks' hand-offs. A fused bucket (two or more
gradients) packed into one buffer first adds ``pack_s = bytes / fusion_copy_gbyte_per_s``
(``CostModel.pack_s_per_byte``); ``null`` there: nothing is copied (the CPU engine and NCCL's
grouped calls take a bucket's members where they are). On GPUs the copy is a datasheet rate
(half the HBM rate) and a call's stand-in is its latency (``call_us`` 0, on its own stream,
until a GPU measures it). On CPU hosts calibration fits ``call_us`` and the workers' efficiency
beside compute (``fair_share.overlap_block_efficiency`` ``eta``: ``bus_overlap(k) =
softmin_p(eta k min(1, P/(D+k)) beta, L)``) to train steps run as `optimize` runs them, one
call per gradient against one call for all: what the model's prediction of those two plans
misses. ``libra-fit`` prices neither, as the paper does.

One time formula for all forms (NCCL ``tuning.cc`` style): a collective of ``b`` bytes costs
``issue + latency + b / bw`` (``issue = call_s + pack_s``) with ``bw`` the solo or overlapped
table entry of its allocation, and slows overlapped compute by the ``slowdown`` table entry; the
per-form tables above fill them.

Other collectives (sharded data parallelism)
--------------------------------------------
The tables are the all-reduce's. A reduce-scatter or an all-gather of an unsharded buffer of
``b`` bytes costs ``issue + latency_c + traffic_c * b / bw`` with the same ``bw`` and the same
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

The package, along its seams: `profile` (the dataclasses, the schema, the units), `forms`
(the ring's terms, the three forms' curves and option tables), `read` (validation and
where profiles are found), `derive` (profile and world size to `Derivation` and `CostModel`).
Pure Python: no JAX, no compiled extension.
"""
from __future__ import annotations

from libra_jax.model import probe  # noqa: F401  (sets read.probe_hook: the CPU default's probe)
from libra_jax.model.derive import (
    Derivation,
    collective_traffic,
    cost_model,
    derive,
)
from libra_jax.model.forms import (
    COLLECTIVE_SHAPES,
    FORM_TABLE,
    CollectiveShape,
    fair_share_core_share,
    fair_share_oversubscribed,
    fair_share_slowdown,
    libra_bandwidth_mib_per_ms,
    libra_slowdown,
    nccl_bus_bandwidth,
    nccl_slowdown,
    ring_algo_factor,
    ring_bytes_per_rank,
    ring_latency_s,
    ring_steps,
    softmin,
)
from libra_jax.model.profile import (
    BYTES_PER_GBIT,
    BYTES_PER_GBYTE,
    BYTES_PER_MIB,
    BYTES_PER_S_PER_MIB_PER_MS,
    FLOP_PER_TFLOP,
    FORMS,
    MAX_LAUNCH_BLOCKS,
    MS_PER_S,
    PROFILE_DIR,
    S_PER_MS,
    S_PER_US,
    SCHEMA_CHANGES,
    SCHEMA_VERSION,
    SOURCES,
    DeviceSpec,
    FairShare,
    LibraFit,
    NcclStyle,
    NetworkSpec,
    Profile,
    Quantity,
)
from libra_jax.model.read import (
    BUILTIN_PROFILES,
    PROFILE_DIR_ENV,
    calibrated_profile_dir,
    calibrated_profile_path,
    default_profile,
    list_profiles,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    resolve_profile,
)

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
    "fair_share_oversubscribed",
    "profile_to_dict",
    "PROFILE_DIR_ENV",
    "BYTES_PER_GBYTE",
    "FLOP_PER_TFLOP",
    "BYTES_PER_S_PER_MIB_PER_MS",
    "S_PER_MS",
    "S_PER_US",
    "BYTES_PER_GBIT",
    "BYTES_PER_MIB",
    "MS_PER_S",
    "SCHEMA_CHANGES",
    "FORM_TABLE",
]
