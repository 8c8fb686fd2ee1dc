"""A plan's predicted timeline, and a Gantt chart of it.

:func:`timeline` replays the planner's simulation semantics (``libra_jax.planner.simulate``) event
by event and records what happens when: each stretch of compute with the speed it ran at, and each
collective's latency, overlapped and solo phases. Its end time equals ``simulate`` (the tests check
this), so the chart shows exactly what the planner optimised.

:func:`draw` renders the timeline with matplotlib, which is an optional dependency: it is imported
only when a chart is drawn, and its absence raises a :class:`MissingDependencyError` that says how
to install it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from libra_jax.planner import Bucket, CostModel, Layer

__all__ = ["ComputeSpan", "CollectiveSpan", "Timeline", "timeline", "draw", "MissingDependencyError"]


class MissingDependencyError(ImportError):
    """An optional dependency needed for this feature is not installed."""


@dataclass(frozen=True)
class ComputeSpan:
    """Layer ``layer`` computed from ``start`` to ``end`` at ``1/slowdown`` of full speed."""

    layer: int
    start: float
    end: float
    slowdown: float


@dataclass(frozen=True)
class CollectiveSpan:
    """One all-reduce: packing a fused bucket until ``pack_end`` (compute stalls; = ``start``
    for a single tensor), latency until ``latency_end``, overlapped transfer until ``solo_start``
    (= ``latency_end`` when compute had already finished), solo transfer until ``end``."""

    bucket: int
    blocks: int
    grad_bytes: int
    ready: float
    start: float
    latency_end: float
    solo_start: float
    end: float
    pack_end: float = math.nan


@dataclass(frozen=True)
class Timeline:
    compute: tuple[ComputeSpan, ...]
    collectives: tuple[CollectiveSpan, ...]
    compute_end: float
    backward_s: float


def timeline(layers: Sequence[Layer], buckets: Sequence[Bucket], cost: CostModel) -> Timeline:
    """Replay the planner's semantics for ``buckets`` (which must tile ``layers``) under ``cost``."""
    n = len(layers)
    if n == 0:
        raise ValueError("layers must not be empty")
    expected = 0
    for b in buckets:
        if b.first != expected or b.last < b.first or b.last >= n:
            raise ValueError(f"buckets must tile layers 0..{n - 1} in order; got {b}")
        if b.blocks not in cost.slowdown:
            raise ValueError(f"bucket {b} uses allocation {b.blocks}, which is not in the cost model")
        expected = b.last + 1
    if expected != n:
        raise ValueError(f"buckets must tile layers 0..{n - 1}; they stop at {expected - 1}")

    colls = [(j, b, sum(layers[i].grad_bytes for i in range(b.first, b.last + 1)),
              sum(layers[i].grad_bytes > 0 for i in range(b.first, b.last + 1)))
             for j, b in enumerate(buckets)]
    colls = [c for c in colls if c[2] > 0]  # a bucket of zero bytes issues no collective
    layer_end = [math.nan] * n

    compute_spans: list[ComputeSpan] = []
    coll_spans: list[CollectiveSpan] = []
    t = 0.0
    li = 0  # current layer
    rem_work = layers[0].compute_s
    seg_start = 0.0
    compute_done = False
    ci = 0  # next collective
    active: dict | None = None

    def finish_zero_layers() -> None:
        nonlocal li, rem_work, compute_done, seg_start
        while not compute_done and rem_work <= 0.0:
            layer_end[li] = t
            li += 1
            if li == n:
                compute_done = True
            else:
                rem_work = layers[li].compute_s
            seg_start = t

    finish_zero_layers()
    while True:
        if active is None and ci < len(colls):
            j, b, nbytes, tensors = colls[ci]
            ready = layer_end[b.last]
            if not math.isnan(ready) and ready <= t:
                active = dict(j=j, b=b, bytes=nbytes, ready=ready, start=t, phase="pack",
                              rem=cost.pack_s(nbytes, tensors),
                              pack_end=math.nan, latency_end=math.nan, solo_start=math.nan)
                ci += 1
                if active["rem"] <= 0.0:
                    active.update(phase="latency", rem=cost.latency_s, pack_end=t)
                if active["rem"] <= 0.0:
                    active.update(phase="transfer", rem=float(nbytes), latency_end=t)
                    if compute_done:
                        active["solo_start"] = t
        if active is None and compute_done:
            break
        packing = active is not None and active["phase"] == "pack"
        slow = cost.slowdown[active["b"].blocks] if active is not None else 1.0
        # While a bucket is packed, the compute stream copies it: no backward progress.
        dt_compute = rem_work * slow if not compute_done and not packing else math.inf
        if active is None:
            dt_coll = math.inf
        elif active["phase"] in ("pack", "latency"):
            dt_coll = active["rem"]
        else:
            bw = (cost.solo_bw if compute_done else cost.overlap_bw)[active["b"].blocks]
            dt_coll = active["rem"] / bw
        dt = min(dt_compute, dt_coll)
        # Advance both streams by dt.
        if not compute_done and not packing:
            rem_work -= dt / slow
        if active is not None:
            if active["phase"] in ("pack", "latency"):
                active["rem"] -= dt
            else:
                bw = (cost.solo_bw if compute_done else cost.overlap_bw)[active["b"].blocks]
                active["rem"] -= dt * bw
        t_prev, t = t, t + dt
        if not compute_done and not packing and t > t_prev:
            compute_spans.append(ComputeSpan(li, t_prev, t, slow))
        compute_event = dt == dt_compute
        coll_event = dt == dt_coll
        if compute_event:
            rem_work = 0.0
            finish_zero_layers()
            if compute_done and active is not None and active["phase"] == "transfer" and not coll_event:
                active["solo_start"] = t
        if coll_event:
            assert active is not None
            if active["phase"] == "pack":
                active.update(phase="latency", rem=cost.latency_s, pack_end=t)
                if active["rem"] <= 0.0:
                    active.update(phase="transfer", rem=float(active["bytes"]), latency_end=t)
                    if compute_done:
                        active["solo_start"] = t
            elif active["phase"] == "latency":
                active.update(phase="transfer", rem=float(active["bytes"]), latency_end=t)
                if compute_done:
                    active["solo_start"] = t
            else:
                if math.isnan(active["solo_start"]):
                    active["solo_start"] = t
                coll_spans.append(CollectiveSpan(active["j"], active["b"].blocks, active["bytes"], active["ready"],
                                                 active["start"], active["latency_end"], active["solo_start"], t,
                                                 active["pack_end"]))
                active = None
        if not compute_done and rem_work <= 0.0:
            finish_zero_layers()
    compute_end = max(layer_end)
    end = max([compute_end] + [c.end for c in coll_spans])
    return Timeline(tuple(_merge(compute_spans)), tuple(coll_spans), compute_end, end)


def _merge(spans: list[ComputeSpan]) -> list[ComputeSpan]:
    """Join consecutive pieces of the same layer that ran at the same speed."""
    out: list[ComputeSpan] = []
    for s in spans:
        if out and out[-1].layer == s.layer and out[-1].slowdown == s.slowdown and out[-1].end == s.start:
            out[-1] = ComputeSpan(s.layer, out[-1].start, s.end, s.slowdown)
        else:
            out.append(s)
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError(
            "drawing a Gantt chart needs matplotlib, which is not installed; "
            "install it with `pip install matplotlib` (or the package's `plot` extra)") from exc
    return plt


def draw(tl: Timeline, path: str | Path, *, title: str = "", key_unit: str = "blocks") -> Path:
    """Write a Gantt chart of ``tl`` to ``path`` (PNG, or any format matplotlib infers).

    Row "compute": each layer's stretches, darker where a collective slowed it (label: slowdown).
    Row "all-reduce": each collective, hatched during its latency, light while overlapped with
    compute, dark once alone; labelled with its allocation in ``key_unit``.
    """
    plt = _pyplot()
    ms = 1e3
    fig, ax = plt.subplots(figsize=(12, 3.2))
    max_slow = max([s.slowdown for s in tl.compute] + [1.0])
    for s in tl.compute:
        shade = 0.25 + 0.65 * ((s.slowdown - 1.0) / (max_slow - 1.0) if max_slow > 1 else 0.0)
        ax.barh(1, (s.end - s.start) * ms, left=s.start * ms, height=0.6, color=plt.cm.Oranges(shade),
                linewidth=0)
    for c in tl.collectives:
        ax.barh(0, (c.latency_end - c.start) * ms, left=c.start * ms, height=0.6, color="lightgray",
                hatch="///", edgecolor="gray", linewidth=0.3)
        ax.barh(0, (c.solo_start - c.latency_end) * ms, left=c.latency_end * ms, height=0.6,
                color=plt.cm.Blues(0.45), edgecolor="white", linewidth=0.3)
        ax.barh(0, (c.end - c.solo_start) * ms, left=c.solo_start * ms, height=0.6, color=plt.cm.Blues(0.85),
                edgecolor="white", linewidth=0.3)
        if (c.end - c.start) > 0.03 * tl.backward_s:
            ax.text((c.start + c.end) / 2 * ms, 0, f"{c.blocks}", ha="center", va="center", fontsize=7,
                    color="black")
    ax.set_yticks([0, 1], [f"all-reduce\n(label: {key_unit})", f"compute\n(darker: slower,\nup to {max_slow:.2f}x)"])
    ax.set_xlabel("time since backward start (ms)")
    ax.set_xlim(0, tl.backward_s * ms * 1.01)
    ax.set_title(title or f"predicted backward pass: {tl.backward_s * ms:.2f} ms")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
