"""A profile and a world size become the planner's `CostModel` (`derive`), with the
`Derivation` that says which options were dropped and why, and what a launch's block count is.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from libra_jax import collectives
from libra_jax.collectives import REFERENCE, Collective
from libra_jax.model.forms import (
    FORM_TABLE,
    check_workers,
    ring_algo_factor,
    ring_latency_s,
    shape_of,
)
from libra_jax.model.profile import BYTES_PER_GBIT, MAX_LAUNCH_BLOCKS, Profile
from libra_jax.model.read import resolve_profile
from libra_jax.planner import CollectiveTerms, CostModel, no_overlap_allocation
from libra_jax.planner import default_allocation as planner_default_allocation


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
        return _launch_shape(key, self.key_unit, self.threads_per_block)

    # An allocation key becomes a block count here, once (`_launch_shape`): the planner works
    # in keys, and every call's ``blocks`` comes from one of these (the planner's buckets, and
    # `libra_jax.ops.blocks.resolve_blocks` for a call left at ``blocks=None``).

    def launch_blocks(self, key: int) -> int:
        """The block count a call is launched with for allocation ``key``: `launch_shape`'s
        blocks, 1..`MAX_LAUNCH_BLOCKS`."""
        return min(MAX_LAUNCH_BLOCKS, max(1, self.launch_shape(key)[0]))

    def key_for_blocks(self, blocks: int) -> int:
        """The allocation that stands for a fixed block count in the model: the option whose
        launch is nearest `blocks` (the smaller on a tie)."""
        return min(self.cost.slowdown, key=lambda k: (abs(self.launch_shape(k)[0] - blocks), k))

    def no_overlap_key(self, nbytes: int, collective: Collective) -> int:
        """The allocation of a `collective` (its row) of `nbytes` with no overlapped compute
        known (`planner.no_overlap_allocation`)."""
        return no_overlap_allocation(self.cost, nbytes, lambda k: self.launch_shape(k)[0],
                                     collective)

    def no_overlap_blocks(self, nbytes: int, collective: Collective) -> int:
        """`no_overlap_key`'s block count (`launch_blocks`): a call's ``blocks=None``."""
        return self.launch_blocks(self.no_overlap_key(nbytes, collective))


def _launch_shape(key: int, key_unit: str, threads_per_block: int) -> tuple[int, int]:
    """`Derivation.launch_shape`'s conversion, for an option not yet in a cost model (the
    options `derive` drops above ``max_blocks`` are measured by it too)."""
    if key_unit == "blocks":
        return key, threads_per_block
    return max(1, key // threads_per_block), min(threads_per_block, key)


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
    check_workers(workers)
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
            blocks = _launch_shape(key, key_unit, tpb)[0]
            if blocks > max_blocks:
                dropped[key] = (f"{blocks} blocks, above the {max_blocks} the all-reduce may take"
                                + (f" ({max_blocks_why})" if max_blocks_why else ""))
                del solo[key], overlap[key], slowdown[key]
    if not slowdown:
        reasons = "; ".join(f"{k}: {why}" for k, why in sorted(dropped.items()))
        raise ValueError(f"profile {profile.name!r} leaves no valid allocation for {workers} workers ({reasons})")
    others: dict[Collective, CollectiveTerms] = {}
    for row in collectives.ROWS:  # every kind but the tables' own, by its row's terms
        if row is not REFERENCE:
            traffic, _ = collective_traffic(profile, row, workers)
            others[row] = CollectiveTerms(ring_latency_s(profile.network, workers, row), traffic)
    cost = CostModel(latency_s=ring_latency_s(profile.network, workers, REFERENCE), solo_bw=solo,
                     overlap_bw=overlap, slowdown=slowdown,
                     pack_s_per_byte=1.0 / spec.fusion_copy_rate(section),
                     call_s=spec.call_s(section), collectives=others)
    return Derivation(cost=cost, profile=profile.name, form=profile.form, workers=workers, link_bytes_per_s=link,
                      key_unit=key_unit, threads_per_block=tpb,
                      dropped=MappingProxyType(dict(sorted(dropped.items()))),
                      notes=tuple(notes))


def collective_traffic(profile: Profile, collective: Collective, workers: int) -> tuple[float, str]:
    """`collective`'s (its row's) seconds per gradient byte over the all-reduce's (the row
    without a traffic key, `collectives.REFERENCE`), at the same allocation
    (`planner.CollectiveTerms.traffic`), and where the number comes from.

    The GPU forms price rings: the ratio of the collectives' bus fractions (their rows' shapes;
    1/2 for either half of the all-reduce). The CPU engine is no ring: the fair-share form
    takes the profile's measured ratio (``fair_share.<its row's traffic_key>``,
    ``benchmarks/sharded_cpu.py``) where it has one, else the ratio of the memory each moves
    (``engine_traffic``: (n+1)/(2n), 9/16 at 8 ranks).
    """
    row, reference = collective, REFERENCE
    if row is reference:
        return 1.0, "the all-reduce"
    shape, ring = shape_of(row), shape_of(reference)
    if profile.fair_share is None:
        return shape.bus_fraction(workers) / ring.bus_fraction(workers), "ring bus fractions"
    if row.traffic_key is None:
        raise ValueError(f"the {row.kind} collective's row has no traffic_key: the fair-share "
                         "form has no measured traffic of it to read")
    measured = getattr(profile.fair_share, row.traffic_key)
    if measured is not None:
        return measured, f"fair_share.{row.traffic_key}"
    return (shape.engine_traffic(workers) / ring.engine_traffic(workers),
            "the engine's memory traffic (not measured)")


def cost_model(profile: Profile | str | Path, workers: int, *, link_gbit_per_s: float | None = None) -> CostModel:
    """Shorthand for ``derive(...).cost``."""
    return derive(profile, workers, link_gbit_per_s=link_gbit_per_s).cost
