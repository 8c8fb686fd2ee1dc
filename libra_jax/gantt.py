"""A plan's predicted timeline, and a Gantt chart of it.

`timeline` cuts the planner's own timeline (``libra_jax.planner.timeline``: the formula
``simulate`` uses, phase by phase) into what a chart shows: each stretch of a layer's compute with
the speed it ran at, and each collective's packing, latency, overlapped and solo phases. Its end
time is ``simulate``'s, so the chart shows exactly what the planner optimised.

`chart` renders the timeline with matplotlib (a Figure with a legend, every bucket named)
and `draw` writes it to a file. They also draw a pass of all-gathers
(`libra_jax.planner.gather_timeline`: FSDP's parameter gathers, each one call where it is used
or issued ahead of it): each gather from its issue to its end, and the compute that reads it.

matplotlib is an optional dependency: it is imported only when a chart is drawn, without
pyplot (so the user's backend is left alone), and its absence raises a `MissingDependencyError`
that says how to install it.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libra_jax.collectives import REFERENCE, Collective

if TYPE_CHECKING:  # pragma: no cover
    from libra_jax.planner import Bucket, CostModel, GatherTimeline, Layer

__all__ = ["ComputeSpan", "CollectiveSpan", "Timeline", "timeline", "chart", "draw", "LEGEND",
           "MissingDependencyError"]


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
    """One collective (an all-reduce, or a reduce-scatter: ``collective``, its row): issuing it (the
    profile's call cost, and packing a fused bucket where it is packed) until ``pack_end``
    (compute stalls; = ``start`` where issuing costs nothing), latency until
    ``latency_end``, overlapped transfer until ``solo_start``
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
    collective: Collective = field(kw_only=True)


@dataclass(frozen=True)
class Timeline:
    compute: tuple[ComputeSpan, ...]
    collectives: tuple[CollectiveSpan, ...]
    compute_end: float
    backward_s: float


def timeline(layers: Sequence[Layer], buckets: Sequence[Bucket], cost: CostModel) -> Timeline:
    """The chart's spans of ``buckets`` (which must tile ``layers``) under ``cost``: the planner's
    own timeline (`libra_jax.planner.timeline`), its compute progress cut at layer ends."""
    from libra_jax import planner

    tl = planner.timeline(layers, buckets, cost)
    ends = list(itertools.accumulate((layer.compute_s for layer in layers), initial=0.0))

    def time_at(progress: float) -> float:
        """When compute first reached `progress` (the end of a layer: its gradient is ready)."""
        for t0, t1, p0, p1, _ in tl.compute:
            if p1 >= progress and p1 > p0:
                if progress <= p0 or progress == p1:
                    return t0 if progress <= p0 else t1
                return t0 + (t1 - t0) * (progress - p0) / (p1 - p0)
        return 0.0 if progress <= 0 else tl.compute_end

    spans: list[ComputeSpan] = []
    for t0, t1, p0, p1, slowdown in tl.compute:
        if p1 <= p0:
            continue  # a bucket being packed: no progress
        for layer in range(len(layers)):
            a, b = max(p0, ends[layer]), min(p1, ends[layer + 1])
            if b > a:  # the segment's own end where the layer runs to it: spans join exactly
                spans.append(ComputeSpan(layer, t0 if a == p0 else t0 + (a - p0) * slowdown,
                                         t1 if b == p1 else t0 + (b - p0) * slowdown, slowdown))
    collectives = tuple(
        # A collective never starts before it is ready (min: against interpolation's rounding).
        CollectiveSpan(j, blocks, nbytes, min(ph.start, time_at(ends[buckets[j].last + 1])), ph.start,
                       ph.latency_end, ph.solo_start, ph.end, ph.pack_end,
                       collective=layers[buckets[j].first].collective)
        for j, blocks, nbytes, ph in tl.collectives)
    return Timeline(tuple(_merge(spans)), collectives, tl.compute_end, tl.backward_s)


def _merge(spans: list[ComputeSpan]) -> list[ComputeSpan]:
    """Join consecutive pieces of the same layer that ran at the same speed."""
    out: list[ComputeSpan] = []
    for s in spans:
        if out and out[-1].layer == s.layer and out[-1].slowdown == s.slowdown and out[-1].end == s.start:
            out[-1] = ComputeSpan(s.layer, out[-1].start, s.end, s.slowdown)
        else:
            out.append(s)
    return out


def _figure_class() -> Any:
    """matplotlib's Figure, drawn without pyplot (so without choosing a backend for the user:
    a notebook keeps its own)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError(
            "drawing a Gantt chart needs matplotlib, which is not installed; "
            "install it with `pip install matplotlib` (or the package's `plot` extra)") from exc
    return Figure


#: The chart's parts, as its legend names them.
LEGEND = ("compute (darker: slowed by a collective)", "all-reduce latency",
          "all-reduce beside compute", "all-reduce alone")
#: A bucket narrower than this share of the backward pass is listed under the chart, not labelled.
LABEL_MIN_SHARE = 0.03


def chart(tl: Timeline | GatherTimeline, *, title: str = "", key_unit: str = "blocks",
          names: Sequence[str] = ()) -> Any:
    """The Gantt chart of ``tl`` as a matplotlib Figure (what `draw` writes).

    Row "compute": each layer's stretches, darker where a collective slowed it. Row
    "all-reduce": each collective (bucket ``#i``, in order), hatched during its latency, light
    while overlapped with compute, dark once alone. Every bucket is named: on the bar when it is
    wide enough (``#i: allocation``; ``#i RS: allocation`` for a reduce-scatter, the row then
    "collective"), else in the list under the chart, with its times.

    A pass of all-gathers (`libra_jax.planner.GatherTimeline`) is drawn by `_gather_chart`;
    `names` then names each gather (the parameter it gathers).
    """
    figure = _figure_class()  # first: says how to install matplotlib if it is missing
    if not isinstance(tl, Timeline):
        return _gather_chart(figure, tl, title=title, key_unit=key_unit, names=names)
    from matplotlib import cm
    from matplotlib.patches import Patch

    fig = figure(figsize=(12, 3.6))
    ax = fig.add_subplot()
    ms = 1e3
    max_slow = max([s.slowdown for s in tl.compute] + [1.0])
    for s in tl.compute:
        shade = 0.25 + 0.65 * ((s.slowdown - 1.0) / (max_slow - 1.0) if max_slow > 1 else 0.0)
        ax.barh(1, (s.end - s.start) * ms, left=s.start * ms, height=0.6, color=cm.Oranges(shade),
                linewidth=0)
    listed = []
    # The row is named for the tables' own kind (the all-reduce), or "collective" where other
    # kinds (marked by their rows' labels) share it.
    mixed = any(c.collective is not REFERENCE for c in tl.collectives)
    row = "collective" if mixed else REFERENCE.kind
    for c in tl.collectives:
        ax.barh(0, (c.latency_end - c.start) * ms, left=c.start * ms, height=0.6, color="lightgray",
                hatch="///", edgecolor="gray", linewidth=0.3)
        ax.barh(0, (c.solo_start - c.latency_end) * ms, left=c.latency_end * ms, height=0.6,
                color=cm.Blues(0.45), edgecolor="white", linewidth=0.3)
        ax.barh(0, (c.end - c.solo_start) * ms, left=c.solo_start * ms, height=0.6,
                color=cm.Blues(0.85), edgecolor="white", linewidth=0.3)
        ax.axvline(c.start * ms, ymin=0.05, ymax=0.45, color="black", linewidth=0.4)
        label = c.collective.label
        name = f"#{c.bucket}{' ' + label if label else ''}: {c.blocks}"
        if (c.end - c.start) > LABEL_MIN_SHARE * tl.backward_s:
            ax.text((c.start + c.end) / 2 * ms, 0, name, ha="center", va="center", fontsize=7,
                    color="black")
        else:
            listed.append(f"{name} {c.start * ms:.2f}-{c.end * ms:.2f}")
    ax.set_yticks([0, 1], [f"{row}\n(#bucket: {key_unit})",
                           f"compute\n(up to {max_slow:.2f}x slower)"])
    ax.set_xlabel("time since backward start (ms)")
    ax.set_xlim(0, tl.backward_s * ms * 1.01)
    ax.set_ylim(-0.6, 1.9)
    ax.set_title(title or f"predicted backward pass: {tl.backward_s * ms:.2f} ms")
    handles = [Patch(color=cm.Oranges(0.6)), Patch(facecolor="lightgray", hatch="///",
                                                 edgecolor="gray"),
               Patch(color=cm.Blues(0.45)), Patch(color=cm.Blues(0.85))]
    legend = [entry.replace(REFERENCE.kind, row) for entry in LEGEND]
    ax.legend(handles, legend, loc="upper center", ncol=4, fontsize=7, frameon=False,
              bbox_to_anchor=(0.5, 1.0))
    _list_narrow(fig, "narrow buckets (ms): ", listed)
    return fig


def _gather_chart(figure: Any, tl: GatherTimeline, *, title: str, key_unit: str,
                  names: Sequence[str]) -> Any:
    """Row "compute": the compute reading each gather (``#i``, darker where a gather in flight
    slowed it; the compute before the first use unlabelled). Row "all-gather": each gather,
    a thin line from when it was issued to when it started (waiting for the one before it),
    hatched during its latency, then its bytes; a gather issued ahead overlaps the compute
    of the ones before it."""
    from matplotlib import cm
    from matplotlib.patches import Patch

    fig = figure(figsize=(12, 3.6))
    ax = fig.add_subplot()
    ms = 1e3
    max_slow = max([seg[3] for seg in tl.compute] + [1.0])
    listed: list[str] = []
    for _, t0, t1, slowdown in tl.compute:
        shade = 0.25 + 0.65 * ((slowdown - 1.0) / (max_slow - 1.0) if max_slow > 1 else 0.0)
        ax.barh(1, (t1 - t0) * ms, left=t0 * ms, height=0.6, color=cm.Oranges(shade), linewidth=0)
    for g in tl.gathers:
        name = names[g.index] if g.index < len(names) else ""
        mid = (g.compute_start + g.compute_end) / 2
        if (g.compute_end - g.compute_start) > LABEL_MIN_SHARE * tl.total_s:
            ax.text(mid * ms, 1, f"#{g.index}", ha="center", va="center", fontsize=7)
        ax.plot([g.issue * ms, g.start * ms], [0, 0], color="black", linewidth=0.6)
        ax.barh(0, (g.latency_end - g.start) * ms, left=g.start * ms, height=0.6,
                color="lightgray", hatch="///", edgecolor="gray", linewidth=0.3)
        ax.barh(0, (g.end - g.latency_end) * ms, left=g.latency_end * ms, height=0.6,
                color=cm.Greens(0.55), edgecolor="white", linewidth=0.3)
        label = f"#{g.index} AG: {g.blocks}" + (f" {name}" if name else "")
        if (g.end - g.start) > LABEL_MIN_SHARE * tl.total_s:
            ax.text((g.start + g.end) / 2 * ms, 0, label, ha="center", va="center", fontsize=7)
        else:
            listed.append(f"{label} {g.start * ms:.2f}-{g.end * ms:.2f}")
    ax.set_yticks([0, 1], [f"all-gather\n(#gather: {key_unit})",
                           f"compute\n(up to {max_slow:.2f}x slower)"])
    ax.set_xlabel("time since the pass started (ms)")
    ax.set_xlim(0, tl.total_s * ms * 1.01 if tl.total_s > 0 else 1)
    ax.set_ylim(-0.6, 1.9)
    ax.set_title(title or f"predicted pass of all-gathers: {tl.total_s * ms:.2f} ms")
    handles = [Patch(color=cm.Oranges(0.6)), Patch(facecolor="lightgray", hatch="///",
                                                 edgecolor="gray"), Patch(color=cm.Greens(0.55))]
    ax.legend(handles, ["compute reading gather #i (darker: slowed by a gather)",
                        "all-gather latency", "all-gather (line: issued, waiting)"],
              loc="upper center", ncol=3, fontsize=7, frameon=False, bbox_to_anchor=(0.5, 1.0))
    _list_narrow(fig, "narrow gathers (ms): ", listed)
    return fig


def _list_narrow(fig: Any, title: str, listed: list[str]) -> None:
    """The spans too narrow to label, listed under the chart with their times."""
    if listed:
        lines = _wrap(title + ", ".join(listed), 190)
        fig.text(0.01, 0.01, "\n".join(lines), fontsize=6, va="bottom")
        fig.tight_layout(rect=(0, 0.04 + 0.03 * len(lines), 1, 1))
    else:
        fig.tight_layout()


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def draw(tl: Timeline | GatherTimeline, path: str | Path, *, title: str = "",
         key_unit: str = "blocks", names: Sequence[str] = ()) -> Path:
    """Write `chart` of ``tl`` to ``path`` (PNG, or any format matplotlib infers)."""
    path = Path(path)
    chart(tl, title=title, key_unit=key_unit, names=names).savefig(path, dpi=120)
    return path
