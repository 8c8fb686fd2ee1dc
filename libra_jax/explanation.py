"""`libra_jax.explain(fn, *args)`: what `libra_jax.optimize` decides for a train step, and why.

It traces `fn` as `optimize` does, rewrites it, and returns an `Explanation`: per planned
scope (a stream of backward compute with its gradient psums), the buckets in backward order with
the tensors in each (by the parameter path they update, where the data flow shows it), bytes,
allocation, the compute that produces them and the predicted all-reduce time; and the predicted
backward time of Libra's plan against the default allocation (fixed allocation, 64 MiB fusion)
and against fusion only (the planner's grouping at the fixed allocation). Every predicted time is
the planner's simulation (`planner.simulate`, replayed by `gantt.timeline`), so the numbers are
exactly those the planner optimised. It prints a table (with `rich` if installed, else text).
"""
from __future__ import annotations

import dataclasses
import io
import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import jax

from libra_jax import collectives, gantt, gradient_names, planner, rewrite
from libra_jax.collectives import Collective
from libra_jax.loss_inputs import closure_parts
from libra_jax.model import probe
from libra_jax.rewrite.edits import pairs_bucket

__all__ = ["explain", "Explanation", "ScopePlan", "BucketRow", "GatherScope", "GatherRow"]



@dataclasses.dataclass(frozen=True)
class BucketRow:
    """One gradient bucket (one all-reduce, or one reduce-scatter) of a scope, in backward
    order."""

    index: int
    tensors: tuple[str, ...]        # parameter paths (or "psum #i: shape" where unknown)
    nbytes: int                     # bytes per rank
    blocks: int                     # engine blocks (CPU worker tasks / CUDA thread blocks)
    allocation: int                 # the cost model's option (blocks, or total threads)
    overlap: str                    # issued as one call ("sync") or a start/done pair
    compute_s: float                # compute of its layers (the gradients it carries), full speed
    ready_s: float                  # predicted time its last gradient is ready
    start_s: float                  # predicted start and end of its collective
    end_s: float
    collective: Collective          # its kind (its layers': `planner.Layer.collective`)
    #: Where in the backward pass its last gradient is ready (`rewrite.ready`): the equation
    #: that produces it, and why readiness stopped there if it is a call or a loop ("" where
    #: planned as written: `optimize(ready="written")`).
    ready_after: str = ""
    ready_why: str = ""

    @property
    def comm_s(self) -> float:
        return self.end_s - self.start_s


@dataclasses.dataclass(frozen=True)
class ScopePlan:
    """The plan of one scope: the planner's layers and buckets and what they predict."""

    scope: str
    axes: tuple
    world: int
    profile: str
    key_unit: str
    layers: tuple[planner.Layer, ...]
    buckets: tuple[planner.Bucket, ...]
    cost: planner.CostModel
    rows: tuple[BucketRow, ...]
    backward_s: float               # Libra's plan (= planner.simulate(layers, buckets, cost))
    default_s: float                # default allocation with 64 MiB fusion
    fusion_only_s: float            # planner's fusion at the default allocation
    default_allocation: int
    compute_s: float                # backward compute at full speed
    limit: str = ""                 # a cap on the blocks of an all-reduce, and why (or "")
    in_loop: bool = False           # a loop body's scope: the plan of one iteration


@dataclasses.dataclass(frozen=True)
class GatherRow:
    """One all-gather of a scope (a sharded parameter gathered before the compute that reads
    it), in jaxpr order, and how it is issued."""

    index: int
    tensor: str                     # the parameter it gathers (or "all_gather #i: shape")
    kind: str                       # "forward", or "backward" (remat's re-gather)
    nbytes: int                     # the gathered buffer's bytes per rank
    blocks: int                     # engine blocks it runs with
    ahead: int                      # gathers ahead it is issued (0: one call where it is used)
    start_s: float                  # predicted start and end of the gather
    end_s: float
    compute_start_s: float          # predicted start of the compute that reads it
    overlaps: tuple[str, ...]       # the gathers whose compute it runs beside (issued ahead)


@dataclasses.dataclass(frozen=True)
class GatherScope:
    """A scope's all-gathers (`planner.plan_gathers`): the model's inputs and choice, what was
    issued, and the predicted pass (compute from the first gather's use on, plus ``lead_s``
    of compute reading none) as issued and with each call where it is used."""

    scope: str
    axes: tuple
    world: int
    profile: str
    key_unit: str
    steps: tuple[planner.GatherStep, ...]
    plan: planner.GatherPlan        # the model's choice (or the distance asked for)
    distance: int                   # the distance issued
    why: str                        # why it differs from the model's, or ""
    cost: planner.CostModel
    lead_s: float
    blocks: tuple[int, ...]         # the allocation each gather was issued with (cost keys)
    rows: tuple[GatherRow, ...]
    total_s: float                  # predicted pass as issued
    one_call_s: float               # predicted pass with each call where it is used
    groups: planner.Groups = ()     # the calls issued (`planner.Groups`; (): one call each)

    def timeline(self) -> planner.GatherTimeline:
        """The pass as issued, as the model times it (for `gantt.chart`)."""
        return planner.gather_timeline(list(self.steps), self.cost, distance=self.distance,
                                       blocks=list(self.blocks), lead_s=self.lead_s,
                                       groups=self.groups or None)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What `explain` returns: the plan of each planned scope, the all-reduces left unplanned
    (`others`) and the rewrite's report; printed, the table `table` renders."""

    scopes: tuple[ScopePlan, ...]
    others: tuple[rewrite.CallPlan, ...]   # forward / loop / user all-reduces (not planned)
    report: rewrite.OptimizeReport
    gathers: tuple[GatherScope, ...] = ()  # all-gathers issued one call each or ahead

    @property
    def backward_s(self) -> float:
        return sum(s.backward_s for s in self.scopes)

    @property
    def step(self) -> planner.StepPrice | None:
        """The whole step priced both ways (`rewrite.OptimizeReport.step`): its terms, the
        predicted ``plain_s`` and ``optimized_s``; None where not priced."""
        return self.report.step

    @property
    def predicted_ratio(self) -> float | None:
        """The model's optimized / plain step time (`rewrite.OptimizeReport.predicted_ratio`)."""
        return self.report.predicted_ratio

    @property
    def default_s(self) -> float:
        return sum(s.default_s for s in self.scopes)

    @property
    def fusion_only_s(self) -> float:
        return sum(s.fusion_only_s for s in self.scopes)

    def table(self, *, use_rich: bool | None = None, width: int | None = None) -> str:
        """The explanation as text (rich's rendering when available and not disabled), `width`
        columns wide (default: the terminal's, 120 where there is none).

        rich is used where installed, not required: the plain table (aligned columns, the
        terminal's width) keeps the package's dependencies at jax and numpy."""
        if width is None:
            width = shutil.get_terminal_size((120, 24)).columns
        if use_rich is None or use_rich:
            try:
                return _rich_text(self, width)
            except ImportError:
                if use_rich:
                    raise
        return _plain_text(self, width)

    def __str__(self) -> str:
        """The plain table, unwrapped (as `explain` prints it to a file or a pipe)."""
        return self.table(use_rich=False, width=_PIPED_WIDTH)


def explain(fn: Callable[..., Any], *args: Any, profile: Any = None, fusion: bool = True,
            blocks: int | None = None, overlap: str | None = None, loops: str = "auto",
            prefetch: str | int | None = None, prefetch_bytes: int | None = None,
            ready: str = "dataflow", static_argnums: int | Sequence[int] | None = None,
            static_argnames: str | Sequence[str] | None = None,
            file: TextIO | None = sys.stdout, use_rich: bool | None = None,
            **kwargs: Any) -> Explanation:
    """Plan `fn(*args, **kwargs)` as `libra_jax.optimize(fn, profile=..., fusion=...,
    blocks=..., overlap=..., loops=..., prefetch=..., prefetch_bytes=..., ready=...,
    static_argnums=..., static_argnames=...)` would, print the plan
    to `file` (None: print nothing) and return it as an `Explanation`.

    `fn` may be jitted, `shard_map`ped, call `jax.pmap`, or be an `optimize`d function (its
    original is explained, with the static arguments it was given). Keyword arguments other
    than this function's own go to `fn`. Nothing is compiled or run.
    """
    statics = rewrite.StaticArgs.of(fn, static_argnums, static_argnames)
    if getattr(fn, "last_report", _MISSING) is not _MISSING and hasattr(fn, "__wrapped__"):
        own = getattr(fn, "static_args", rewrite.StaticArgs())
        statics = rewrite.StaticArgs(statics.argnums + own.argnums,
                                     statics.argnames + own.argnames)
        fn = fn.__wrapped__  # an `optimize`d function: explain what it wraps
    call, dynamic, key = statics.split(fn, args, kwargs)
    call, (dyn_args, dyn_kwargs), _ = rewrite.outer_statics(call, dynamic, key)
    outputs = rewrite.Outputs()
    closed = jax.make_jaxpr(outputs.arrays_of(call))(*dyn_args, **dyn_kwargs)
    # "params.Dense_0.kernel": jax's own spelling of a key path (a dict key, attribute or
    # index), for each output the program returns (a function leaf is not one of them).
    flat = jax.tree_util.tree_flatten_with_path(outputs.rebuild(closed.out_avals))[0]
    out_paths = [jax.tree_util.keystr(path, simple=True, separator=".")
                 for i, (path, _) in enumerate(flat) if i not in outputs.static]
    _, report = rewrite.rewrite_jaxpr(closed, profile=profile, fusion=fusion, blocks=blocks,
                                      overlap=overlap, loops=loops, prefetch=prefetch,
                                      prefetch_bytes=prefetch_bytes, ready=ready,
                                      inputs=jax.tree.leaves((dyn_args, dyn_kwargs)))
    def spelled(flat: Any) -> list[tuple[str, Any]]:
        return [(jax.tree_util.keystr(path, simple=True, separator="."), x) for path, x in flat]
    flat_in = spelled(jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))[0])
    # A value the step reads as a constant (a `jax.Ref` argument, which `outer_statics` keeps
    # static; one it closes over) is named by its path among the arguments given, else in
    # what the step captures.
    given = {id(x): path for path, x in spelled(jax.tree_util.tree_flatten_with_path(
        (args, kwargs))[0])}
    for name, content in _captured(fn):
        for path, x in spelled(jax.tree_util.tree_flatten_with_path(content)[0]):
            given.setdefault(id(x), f"{name}.{path}" if path else name)
    operand_names = gradient_names.input_names(closed.jaxpr, [path for path, _ in flat_in],
                                 [given.get(id(c)) for c in closed.consts])
    names = gradient_names.result_names(closed, out_paths, report, operand_names)
    scopes = tuple(_scope_plan(entry, report, names) for entry in report.predicted)
    others = tuple(p for p in report.plans if p.kind != "gradient"
                   and not any(p.scope == g["scope"] for g in report.gathers))
    gathers = tuple(_gather_scope(entry, report, operand_names) for entry in report.gathers)
    result = Explanation(scopes, others, report, gathers)
    if file is not None:
        # Piped or written to a file, the table runs as wide as its names: none is broken.
        tty = getattr(file, "isatty", lambda: False)()
        print(result.table(use_rich=use_rich, width=None if tty else _PIPED_WIDTH), file=file)
    return result


_MISSING = object()


def _captured(fn: Any) -> list[tuple[str, Any]]:
    """(name, value) of what the step function captures: its closure (`loss_inputs.
    closure_parts`) and the globals its code names, for naming the references it updates."""
    import inspect
    fn = inspect.unwrap(fn, stop=lambda f: not hasattr(f, "__wrapped__"))
    parts = list((closure_parts(fn) or ([], None))[0])
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is not None:
        parts += [(name, scope[name]) for name in code.co_names if name in scope]
    return parts


# --- Per-scope plan -------------------------------------------------------------------------

def _scope_plan(entry: dict, report: rewrite.OptimizeReport, names: dict) -> ScopePlan:
    layers = tuple(entry["layers"])
    buckets = tuple(entry["buckets"])
    cost = entry["cost"]
    derivation = entry["derivation"]
    default_alloc = derivation.default_allocation()
    if default_alloc not in cost.slowdown:
        default_alloc = max(cost.slowdown)
    # The baselines as they would run: a bucket that cannot be one fused all-reduce (`reach`,
    # see `planner.plan`) is cut, as `optimize` cuts it.
    reach = entry.get("reach")
    default_buckets = planner.within_reach(
        planner.plan_default(list(layers), cost, blocks=default_alloc,
                             fusion_bytes=planner.HOROVOD_FUSION_BYTES).buckets,
        reach)
    default = planner.Plan(default_buckets, planner.simulate(list(layers), default_buckets, cost))
    fusion_only = planner.plan_fusion_only(list(layers), cost, blocks=default_alloc, reach=reach)
    tl = gantt.timeline(list(layers), list(buckets), cost)
    spans = {c.bucket: c for c in tl.collectives}
    members, results = entry["members"], entry["results"]
    planned = {(p.scope, p.members[-1]): p for p in report.plans if p.kind == "gradient"}
    rows = []
    for j, b in enumerate(buckets):
        idx = range(b.first, b.last + 1)
        tensors = tuple(names.get(id(results[i]), _unnamed(results[i], members[i],
                                                           layers[i].collective)) for i in idx)
        span = spans.get(j)
        issued = planned.get((entry["scope"], members[b.last]))
        ready = max((c.end for c in tl.compute if b.first <= c.layer <= b.last), default=0.0)
        point = entry.get("ready", (None,) * len(members))[b.last]
        rows.append(BucketRow(
            index=j, tensors=tensors, nbytes=sum(layers[i].grad_bytes for i in idx),
            blocks=getattr(issued, "blocks", b.blocks), allocation=b.blocks,
            overlap=getattr(issued, "overlap", "sync"),
            compute_s=sum(layers[i].compute_s for i in idx),
            ready_s=span.ready if span else ready,
            start_s=span.start if span else ready, end_s=span.end if span else ready,
            collective=layers[b.first].collective,
            ready_after=f"{tensors[-1]}'s gradient, {point.after}" if point else "",
            ready_why=point.why if point else ""))
    return ScopePlan(
        scope=entry["scope"], axes=tuple(entry["axes"]), world=entry["world"],
        profile=entry["profile"].name, key_unit=entry["key_unit"], layers=layers, buckets=buckets,
        cost=cost, rows=tuple(rows), backward_s=tl.backward_s, default_s=default.backward_s,
        fusion_only_s=fusion_only.backward_s, default_allocation=default_alloc,
        compute_s=sum(layer.compute_s for layer in layers), limit=entry.get("limit", ""),
        in_loop=entry.get("in_loop", False))


def _gather_scope(entry: dict, report: rewrite.OptimizeReport, names: dict) -> GatherScope:
    plan, d = entry["plan"], entry["distance"]
    blocks = (plan.blocks if d == plan.distance else
              plan.one_call_blocks or tuple(entry["one_call"]))
    steps = tuple(entry["steps"])
    groups = planner.each_alone(len(steps)) if not entry.get("groups") else entry["groups"]
    tl = planner.gather_timeline(list(steps), entry["cost"], distance=d, blocks=list(blocks),
                                 lead_s=entry["lead_s"], groups=groups)
    # Every member of a call of several is said by that call's plan.
    issued = {i: p for p in report.plans
              if p.scope == entry["scope"] and p.collective is entry["collective"]
              for i in p.members}
    group_of = {j: gi for gi, (a, b) in enumerate(groups) for j in range(a, b + 1)}
    known = gradient_names.shorten({i: names[id(v)] for i, v in enumerate(entry["operands"])
                      if id(v) in names})
    tensors = [known.get(i, _unnamed(v, i, entry["collective"]))
               for i, v in enumerate(entry["operands"])]
    rows = []
    for j, (span, position) in enumerate(zip(tl.gathers, entry["positions"])):
        p = issued.get(position)
        ahead = p.ahead if p is not None else 0
        rows.append(GatherRow(
            index=j, tensor=tensors[j], kind=p.kind if p is not None else "forward",
            nbytes=steps[j].nbytes,
            blocks=p.blocks if p is not None else span.blocks, ahead=ahead,
            start_s=span.start, end_s=span.end, compute_start_s=span.compute_start,
            # Beside the compute of the gathers of the `ahead` calls before its own.
            overlaps=tuple(tensors[groups[max(0, group_of[j] - ahead)][0]:groups[group_of[j]][0]])
            if ahead else ()))
    why = entry["why"] or (f"prefetch={entry['distance']} was asked for"
                           if d != plan.distance else "")
    return GatherScope(
        scope=entry["scope"], axes=tuple(entry["axes"]), world=entry["world"],
        profile=entry["profile"].name, key_unit=entry["key_unit"], steps=steps, plan=plan,
        distance=d, why=why, cost=entry["cost"], lead_s=entry["lead_s"], blocks=tuple(blocks),
        rows=tuple(rows), total_s=tl.total_s, one_call_s=plan.one_call_s, groups=groups)


#: The width `explain` renders to where its output is not a terminal: wide enough that no
#: column folds a name (rich sizes a table to its content, not to this width).
_PIPED_WIDTH = 1000


#: The end of the label of a scalar psum that no parameter's path reaches (`_unnamed`).
_SCALAR = " of a scalar (a loss or metric)"


def _unnamed(var: Any, index: int, collective: Collective) -> str:
    """A member no parameter's path reaches, by its kind's `jax.lax` name and its position."""
    shape = tuple(getattr(getattr(var, "aval", None), "shape", ()))
    name = collective.lax
    if not shape:  # no parameter's path reaches it: the loss or a metric
        return f"{name} #{index}{_SCALAR}"
    return f"{name} #{index} {list(shape)}"


def _is_loss_or_metric(name: str) -> bool:
    """Whether a bucket member's name is `_unnamed`'s for a scalar no parameter's path
    reaches: a loss or a metric, not a gradient."""
    return name.endswith(_SCALAR)





# --- Rendering ------------------------------------------------------------------------------

def _fmt_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _tensor_list(tensors: Sequence[str], limit: int = 48) -> str:
    """`tensors` for a table's cell of about `limit` characters: the parameters' names first
    (a loss's pmean planned with the gradients is ready before them, and says less), as many
    as fit, the first always (cut in the middle where it alone is longer), then how many more;
    the whole list, in planning order, is printed under the table (`_member_lines`)."""
    tensors = sorted(tensors, key=_is_loss_or_metric)  # stable: planning order within each
    text = ", ".join(tensors)
    if len(text) <= limit:
        return text
    room = limit - 10
    shown = [_clip(tensors[0], room)]
    total = len(shown[0])
    for t in tensors[1:]:
        if total + len(t) + 2 > room:
            break
        shown.append(t)
        total += len(t) + 2
    more = len(tensors) - len(shown)
    return ", ".join(shown) + (f" +{more} more" if more else "")


def _clip(name: str, room: int) -> str:
    """`name` in at most `room` characters, its middle left out (``params…kernel``)."""
    if len(name) <= room:
        return name
    head = (room - 1) // 2
    return name[:head] + "\u2026" + name[len(name) - (room - 1 - head):]


def _member_lines(rows: Sequence[BucketRow], width: int) -> list[str]:
    """Every member of each bucket whose cell could not hold all of them, wrapped to `width`:
    a gradient is named, never dropped."""
    lines = []
    for r in rows:
        if _tensor_list(r.tensors) != ", ".join(r.tensors):
            lines.extend(textwrap.wrap(f"#{r.index} ({len(r.tensors)}): " + ", ".join(r.tensors),
                                       width=max(width, 40), initial_indent="  ",
                                       subsequent_indent="      ", break_on_hyphens=False,
                                       break_long_words=False))
    return (["  members of the buckets above:"] + lines) if lines else []


def _gradient_rows(s: ScopePlan) -> list[BucketRow]:
    """The scope's buckets that carry a gradient: a bucket of losses and metrics alone (a
    scalar no parameter's path reaches) is planned as the gradients are, and said apart."""
    return [r for r in s.rows if not all(_is_loss_or_metric(t) for t in r.tensors)]


def _header(s: ScopePlan) -> str:
    kinds = [s.layers[i].collective for b in s.buckets for i in range(b.first, b.last + 1)]
    names = [t for r in s.rows for t in r.tensors]
    losses = sum(map(_is_loss_or_metric, names))
    gradient = [k for k, t in zip(kinds, names) if not _is_loss_or_metric(t)]
    counted = [_gradient_count(gradient)] if gradient or not losses else []
    if losses:
        counted.append(_plural(losses, "psum") + " of a loss or metric")
    return (f"scope {s.scope}{' (a loop body: each iteration)' if s.in_loop else ''}, axes "
            f"{', '.join(map(str, s.axes))}, {s.world} ranks, profile "
            f"{s.profile} (allocation in {s.key_unit.replace('_', ' ')}); "
            f"{', '.join(counted)} -> {_plural(len(s.buckets), 'bucket')}")


def _gradient_count(kinds: Sequence[Collective]) -> str:
    """"3 gradient psums", or "2 gradient psums, 4 gradient psum_scatters" in a mixed scope
    (in the rows' order; "0 gradient psums", the unmarked kind's, where there are none)."""
    counts = {row: kinds.count(row) for row in collectives.ROWS if not row.gathers}
    return ", ".join(_plural(n, f"gradient {row.lax}") for row, n in counts.items()
                     if n or (not _marked(row) and not any(counts.values())))


def _marked(row: Collective) -> bool:
    """Whether a bucket's kind is said by its `jax.lax` name where it is listed: every kind
    but the all-reduce, as the Gantt chart marks them (`Collective.label`)."""
    return bool(row.label)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _columns() -> list[str]:
    return ["#", "tensors", "bytes", "blocks", "issued", "compute ms",
            "ready ms", "collective ms", "start-end ms"]


def _cells(r: BucketRow) -> list[str]:
    ms = 1e3
    alloc = f"{r.blocks}" if r.blocks == r.allocation else f"{r.blocks} ({r.allocation})"
    issued = f"{r.overlap} ({r.collective.lax})" if _marked(r.collective) else r.overlap
    return [str(r.index), _tensor_list(r.tensors), _fmt_bytes(r.nbytes), alloc, issued,
            f"{r.compute_s * ms:.3f}", f"{r.ready_s * ms:.3f}", f"{r.comm_s * ms:.3f}",
            f"{r.start_s * ms:.3f}-{r.end_s * ms:.3f}"]


def _summary(s: ScopePlan, width: int) -> list[str]:
    """The lines under a scope's table: its buckets' members where a cell could not hold them,
    the losses and metrics planned with the gradients, the predicted backward times (the
    backward pass's: the whole step's ratio is `_prediction_lines`'), where each bucket is
    issued."""
    ms = 1e3
    rows = _gradient_rows(s)
    lines = _member_lines(rows, width) + _loss_lines(s)
    if not rows:
        return lines
    return lines + [
        f"predicted backward: Libra {s.backward_s * ms:.3f} ms (compute alone "
        f"{s.compute_s * ms:.3f} ms)",
        f"  default allocation ({s.default_allocation}, 64 MiB fusion): "
        f"{s.default_s * ms:.3f} ms",
        f"  fusion only (allocation {s.default_allocation}): {s.fusion_only_s * ms:.3f} ms"
    ] + ([f"  {s.limit}"] if s.limit else []) + _ready_lines(s)


def _loss_lines(s: ScopePlan) -> list[str]:
    """The scope's psums of a loss or metric (a scalar no parameter's path reaches): planned
    with the gradients (the plan is the same), listed apart from them, identical ones once."""
    lines = []
    for r in s.rows:
        losses = [t for t in r.tensors if _is_loss_or_metric(t)]
        if not losses:
            continue
        where = (f"in bucket #{r.index}" if len(losses) < len(r.tensors) else
                 f"{_fmt_bytes(r.nbytes)}, {r.blocks} blocks, {r.overlap}")
        lines.append(f"  {', '.join(t[:-len(_SCALAR)] for t in losses)}: a scalar no "
                     f"parameter's path reaches (a loss or metric), not a gradient; {where}")
    return lines


def _ready_lines(s: ScopePlan) -> list[str]:
    """Where each bucket is ready in the backward pass (its issue point), and why readiness
    stopped at a call or a loop; said once that a scope is planned where the code wrote its
    collectives (``ready="written"``)."""
    if not any(r.ready_after for r in s.rows):
        return ["  buckets planned where the code wrote their collectives (ready=\"written\")"]
    lines = ["  ready (issued) in the backward pass:"]
    for r in _gradient_rows(s):
        if r.ready_after:
            lines.append(f"    #{r.index} after {r.ready_after}"
                         + (f" ({r.ready_why})" if r.ready_why else ""))
    return lines


def _prediction_lines(e: Explanation) -> list[str]:
    """What the predicted times above cover, and the whole step priced both ways where the
    profile prices plain's XLA collectives (`planner.StepPrice`, the CPU profiles): the
    number to hold a measured optimized/plain ratio against (its fidelity per example:
    benchmarks/results/step_prediction.md)."""
    if not e.scopes:
        return []
    # The fair-share form on a host whose compute threads fill its cores prices a reduction
    # at its solo rate beside compute it does not slow (`model.fair_share_oversubscribed`).
    waiting = all(s.cost.slowdown[k] == 1 and s.cost.overlap_bw[k] == s.cost.solo_bw[k]
                  for s in e.scopes for k in s.cost.keys)
    overlapped = ("at its solo rate, slowing no compute (the devices' compute threads fill the "
                  "cores: a reduction runs when the last device reaches it, the others waiting)"
                  if waiting else "the compute it overlaps slowed by those blocks")
    lines = ["what the prediction covers: the contention model's backward time (each bucket's "
             f"collective at its block count, {overlapped}, "
             "each call's latency and what issuing it takes from compute: the profile's "
             "call_us), for this plan against the two baselines above; not how an "
             "all-reduce's result is written"]
    price = e.report.step
    if price is not None:
        ms = 1e3
        lines.append(
            f"predicted step: {price.optimized_s * ms:.2f} ms optimized, "
            f"{price.plain_s * ms:.2f} ms plain ({price.predicted_ratio:.2f}x): compute "
            f"{price.compute_s * ms:.2f} ms (the roofline of the step's equations, a device's part"
            " of each); plain's "
            f"collectives {price.plain_collectives_s * ms:.2f} ms (XLA's "
            f"{_plural(price.plain_calls, 'call')} of {_plural(price.plain_operands, 'operand')}"
            f", each operand a rendezvous and a fresh output) and "
            f"{price.plain_stagger_s * ms:.2f} ms of the devices' stagger at them, the plan's "
            f"{price.optimized_collectives_s * ms:.2f} ms ({_plural(price.optimized_calls, 'call')}"
            f" of libra's, {price.optimized_stagger_s * ms:.2f} ms of it stagger) "
            "(benchmarks/results/step_prediction.md: how close it came on the examples)")
    return lines


def _profile_lines(e: Explanation) -> list[str]:
    """Which profile planned (`model.probe.describe`: shipped, rescaled by this machine's
    probe with its numbers, or calibrated with its path), and ``libra-jax calibrate`` where the
    probe puts this machine far from the profile; nothing where nothing was planned."""
    entries = list(e.report.predicted) + list(e.report.gathers) if e.scopes or e.gathers else []
    profiles = list(dict.fromkeys(entry["profile"] for entry in entries))
    return [line for profile in profiles for line in probe.describe(profile)]


def _counted(lines: Sequence[str]) -> list[str]:
    """`lines` with each repeated one given once, where it first appears, with its count
    (a step's loss and accuracy pmeans: two identical lines)."""
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return [line + (f" (x{n})" if n > 1 else "") for line, n in counts.items()]


def _others_lines(e: Explanation) -> list[str]:
    lines = []
    if e.others:
        lines.append("other collectives (not planned with the backward pass):")
    lines.extend(_counted([
        f"  {p.kind:<8} {p.scope} axes {', '.join(map(str, p.axes))}: {_fmt_bytes(p.nbytes)}, "
        f"blocks {p.blocks}"
        + (f" ({p.collective.lax})" if _marked(p.collective) else "")
        for p in e.others]))
    if e.report.loops:
        lines.append("loops (each iteration issues its body's plan; stacked slices may leave "
                     "a scan: libra_jax.loops):")
    for loop in e.report.loops:
        iterations = (f"{loop.length} iterations" if loop.length is not None
                      else "iterations counted at run time")
        line = f"  {loop.scope} equation {loop.index}, {iterations}: "
        if loop.gradient:
            line += (f"each iteration {_plural(loop.gradient, 'gradient psum')} in "
                     f"{_plural(loop.calls, 'call')} (scope {loop.body})")
        else:
            line += "no gradient psum left in the body"
        if loop.psums and loop.in_loop_s is not None and loop.hoisted_s is not None:
            done = ("hoisted: one all-reduce of every iteration's slices after the loop"
                    if loop.choice == "hoist" else "kept in the body")
            line += (f"; {_plural(loop.psums, 'stacked slice psum')} of "
                     f"{_fmt_bytes(loop.nbytes)} per iteration {done} (predicted loop "
                     f"{loop.hoisted_s * 1e3:.3f} ms hoisted, {loop.in_loop_s * 1e3:.3f} ms in "
                     "the body)")
        if loop.kept:
            line += f"; {loop.kept} other psum(s) of the body unplanned (kind loop)"
        lines.append(line)
    if e.report.unplanned:
        lines.append("collectives optimize leaves unplanned (it plans psums and psum_scatters "
                     "and runs all_gathers and all_to_alls): "
                     + "; ".join(e.report.unplanned))
    if e.report.copied:
        lines.append("gradients copied before their in-place all-reduce (another equation "
                     "reads the local gradient too): " + "; ".join(e.report.copied))
    if e.report.dropped:
        lines.append("collectives removed before planning, their results unused by the step "
                     "(dead code, with the work only they needed): "
                     + "; ".join(e.report.dropped))
    return lines


def _to_try(e: Explanation) -> list[str]:
    """The report's last line: the options of `optimize` that would change this plan, to
    time against it (docs/optimize.md); nothing where none would."""
    rows = [r for s in e.scopes for r in _gradient_rows(s)]
    options = []
    overlaps = {r.overlap for r in rows if pairs_bucket(r.collective)}
    if "start-done" in overlaps:
        options.append('overlap="sync" (one call per bucket, where it is ready)')
    elif overlaps:
        options.append('overlap="start-done" (each bucket started when ready, done when used)')
    if any(len(r.tensors) > 1 for r in rows):
        options.append("fusion=False (one call per gradient)")
    elif sum(len(r.tensors) for r in rows) > 1:
        options.append("fusion=True with a profile that prices calls higher (fewer, larger calls)")
    if rows:
        blocks = sorted({r.blocks for r in rows})
        options.append(f"blocks=N (every bucket at N blocks; planned: {', '.join(map(str, blocks))})")
    for g in e.gathers:
        options.append("prefetch=0 (one all-gather where it is used)" if g.distance else
                       "prefetch=1 or 2 (all-gathers issued ahead of their use)")
        break
    if e.report.loops:
        options.append('loops="body" or "hoist" (a loop\'s stacked psums kept or hoisted)')
    if not options:
        return []
    return ["to try (time each against this plan: docs/optimize.md): " + "; ".join(options)]


def _calls(g: GatherScope) -> str:
    """How many calls its gathers are, where several share one (""where one call each)."""
    calls = len(g.groups) if g.groups else len(g.rows)
    return f" in {_plural(calls, 'call')}" if calls < len(g.rows) else ""


def _gather_header(g: GatherScope) -> str:
    how = (f"issued {g.distance} ahead{_calls(g)}" if g.distance else
           "one call each where used" if not _calls(g) else f"where used{_calls(g)}")
    return (f"scope {g.scope}, axes {', '.join(map(str, g.axes))}, {g.world} ranks: "
            f"{_plural(len(g.rows), 'all_gather')}, {how}")


def _gather_columns() -> list[str]:
    return ["#", "gathers", "pass", "bytes", "blocks", "issued", "beside the compute of",
            "gather ms", "used at ms"]


def _gather_cells(r: GatherRow) -> list[str]:
    ms = 1e3
    issued = f"{r.ahead} ahead" if r.ahead else "one call"
    beside = (_tensor_list(r.overlaps, 40) or "(before the first use)") if r.ahead else "-"
    return [str(r.index), r.tensor, r.kind, _fmt_bytes(r.nbytes), str(r.blocks), issued, beside,
            f"{r.start_s * ms:.3f}-{r.end_s * ms:.3f}", f"{r.compute_start_s * ms:.3f}"]


def _gather_summary(g: GatherScope) -> list[str]:
    ms = 1e3
    model = (f"the model's choice: {g.plan.distance} ahead, "
             f"{g.plan.total_s * ms:.3f} ms" if g.plan.distance else
             "the model's choice: one call each")
    where = "where used" if any(a != b for a, b in g.plan.one_call_groups) else "one call each"
    lines = [f"predicted pass: {g.total_s * ms:.3f} ms as issued, {g.one_call_s * ms:.3f} ms "
             f"{'with ' if where == 'one call each' else 'issued '}{where}; {model}"]
    if g.why:
        lines.append(f"  issued {where}: {g.why}" if not g.distance else f"  {g.why}")
    return lines


def _tables(e: Explanation, width: int
            ) -> list[tuple[str, list[str], list[list[str]], tuple[int, ...], list[str]]]:
    """Each table either rendering prints: (title, columns, rows, the left-aligned columns,
    the lines under it): one per planned scope (no rows where it holds no gradient), then one
    per scope's all-gathers."""
    return ([(_header(s), _columns(), [_cells(r) for r in _gradient_rows(s)], (1,),
              _summary(s, width)) for s in e.scopes]
            + [(_gather_header(g), _gather_columns(), [_gather_cells(r) for r in g.rows],
                (1, 2, 6), _gather_summary(g)) for g in e.gathers])


def _aligned(columns: list[str], rows: list[list[str]], left: tuple[int, ...]) -> list[str]:
    """The plain table: a header, a rule, the rows, columns aligned."""
    table = [columns] + rows
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    out = []
    for n, r in enumerate(table):
        out.append("  ".join(c.ljust(w) if i in left else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _stacked(columns: list[str], rows: list[list[str]], width: int) -> list[str]:
    """The rows where the table is wider than the terminal: each its own lines, the first
    column's value, then each other column's as ``name value``, wrapped to `width` (a name is
    never cut or folded apart)."""
    out = []
    for r in rows:
        out.extend(textwrap.wrap(f"#{r[0]}  " + "; ".join(f"{c}: {v}" for c, v in
                                                        zip(columns[1:], r[1:])),
                                 width=max(width, 40), subsequent_indent="    ",
                                 break_long_words=False, break_on_hyphens=False))
    return out


def _plain_text(e: Explanation, width: int = _PIPED_WIDTH) -> str:
    out: list[str] = []
    if not e.scopes and not e.gathers:
        out.extend(e.report.notes or ["no gradient psums to plan"])
    for title, columns, rows, left, summary in _tables(e, width):
        out.append(title)
        if rows:
            table = _aligned(columns, rows, left)
            out.extend(table if max(map(len, table)) <= width
                       else _stacked(columns, rows, width))
        out.extend(summary)
        out.append("")
    out.extend(_prediction_lines(e))
    out.extend(_profile_lines(e))
    out.extend(_others_lines(e))
    out.extend(_to_try(e))
    return "\n".join(_wrapped(out, width)).rstrip()


def _wrapped(lines: Sequence[str], width: int) -> list[str]:
    """`lines` wrapped to `width`, each continuation indented under its line's text; a word
    longer than the width is left whole."""
    out: list[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()))
        out.extend(textwrap.wrap(line, width=max(width, 40), subsequent_indent=indent + "  ",
                                 break_long_words=False, break_on_hyphens=False))
    return out


def _rich_text(e: Explanation, width: int) -> str:
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)

    def say(lines: Sequence[str]) -> None:  # wrapped here: indented as the plain text's
        for line in _wrapped(lines, width):
            console.print(line, highlight=False, markup=False, overflow="ignore", crop=False)
    if not e.scopes and not e.gathers:
        say(e.report.notes or ["no gradient psums to plan"])
    for title, columns, rows, left, summary in _tables(e, width):
        # Where the table cannot fit the terminal (its plain form, plus rich's borders),
        # each row is stacked as lines: rich would fold the names apart.
        if not rows or max(map(len, _aligned(columns, rows, left))) + 3 * len(columns) > width:
            say([title] + _stacked(columns, rows, width) + summary + [""])
            continue
        table = Table(title=title, title_justify="left")
        for i, c in enumerate(columns):
            table.add_column(c, justify="left" if i in left else "right", overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        say(summary + [""])
    say(_prediction_lines(e) + _profile_lines(e) + _others_lines(e) + _to_try(e))
    return buf.getvalue().rstrip()
