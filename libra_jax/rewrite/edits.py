"""What a scope's rewrite changes, the equations it writes, and the order they run in.

`Edits` records the changes by equation position; `schedule` applies them (a start/done
pair's done waits, with the compute downstream of its results, until something needs them).
The equations the rewrite writes for a site or a bucket (`single_eqn`: its kind's "emitter"
form, provided here for each kind; `fused_eqn`, `start_done_eqns`, `gather_pair_eqns`) and the
rules of what may be fused and moved (`fusable_reach`, `within_class`, `can_fuse`,
`sunk_after`, `sink_gathers`) are here. Every equation binds its kind's libra primitive (its
row's "primitive" form) or names its row (``collective=<row>``); a kind without the form asked
for is refused by name (`collectives.NoForm`), never issued as another kind.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from libra_jax import _compat, collectives
from libra_jax.collectives import Collective
from libra_jax.ops import libra_bucket_p
from libra_jax.ops.start_done import (
    TOKEN_AVAL,
    libra_done_p,
    libra_start_p,
    register_pair,
)
from libra_jax.rewrite.sites import Site, is_psum, no_form

__all__ = ["Edits", "schedule", "downstream_of", "sunk_after", "can_fuse", "fusable_reach",
           "within_class", "single_eqn", "fused_eqn", "pairs_bucket", "start_done_eqns",
           "gather_pair_eqns", "gather_bucket_pair_eqns", "program_fingerprint", "sink_gathers",
           "map_jaxprs"]


@dataclasses.dataclass
class Edits:
    """What one scope's rewrite changes, by equation position; `schedule` applies it."""

    replacements: dict[int, Any] = dataclasses.field(default_factory=dict)
    removed: set[int] = dataclasses.field(default_factory=set)  # fused into a later member
    sink: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # moves after a bucket
    dones: dict[int, Any] = dataclasses.field(default_factory=dict)  # a start's -> its done
    # Equations placed right before / after the one at a position (an all-gather's start,
    # issued ahead: `gathers.prefetch_gathers`); scheduled as the equations around them.
    before: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    after: dict[int, list[Any]] = dataclasses.field(default_factory=dict)

    @property
    def moved(self) -> set[int]:
        return {j for after in self.sink.values() for j in after}


def schedule(eqns: Sequence[Any], edits: Edits) -> list[Any]:
    """The scope's equations with `edits` applied, in order.

    Start/done: each started bucket waits with its done, the uses that moved and, as they
    come, every pure equation downstream of its results (the optimizer update), so the
    compute in between overlaps the all-reduce. An effect or another all-reduce reading a
    waiting result places it (and those started before) first. A done reads its own start's
    buffers and token, then the latest start's token: XLA orders by data only, and this keeps
    every done after the last start (after the backward pass), with no buffer passed twice (a
    second reader of the in-flight buffer would make XLA copy it while it is reduced)."""
    out: list[Any] = []
    waiting: list[tuple[set, list[Any]]] = []  # (variables defined, equations)
    latest: list[Any] = []  # the latest start's token
    skipped = edits.removed | edits.moved

    def place(groups: list[tuple[set, list[Any]]]) -> None:
        for _, (done, *rest) in groups:
            out.append(done.replace(invars=[*done.invars[:-1], latest[-1]]))
            out.extend(rest)

    def items() -> Iterable[tuple[int, Any, bool]]:  # (position, equation, the position's own)
        for i in range(len(eqns)):
            yield from ((i, e, False) for e in edits.before.get(i, ()))
            if i not in skipped:
                yield i, edits.replacements.get(i, eqns[i]), True
            yield from ((i, e, False) for e in edits.after.get(i, ()))

    for i, eqn, own in items():
        reads = {v for v in eqn.invars if _compat.is_var(v)}
        needed = [n for n, (defined, _) in enumerate(waiting) if defined & reads]
        if needed and not (eqn.effects or is_psum(eqn) or (own and i in edits.dones)):
            defined, group = waiting[needed[-1]]
            group.append(eqn)
            defined.update(v for v in eqn.outvars if _compat.is_var(v))
            continue
        if needed:
            place(waiting[:needed[-1] + 1])
            del waiting[:needed[-1] + 1]
        out.append(eqn)
        if not own:
            continue
        after = [eqns[j] for j in edits.sink.get(i, ())]
        if i in edits.dones:
            latest.append(eqn.outvars[-1])
            group = [edits.dones[i]] + after
            waiting.append(({v for e in group for v in e.outvars if _compat.is_var(v)}, group))
        else:
            out.extend(after)
    place(waiting)
    return out


def downstream_of(eqns: Sequence[Any], seeds: Sequence[Any]) -> set[int]:
    """Indices of the equations that (transitively) use one of the `seeds` variables."""
    tainted = {v for v in seeds if _compat.is_var(v)}
    out: set[int] = set()
    for i, eqn in enumerate(eqns):
        if any(_compat.is_var(v) and v in tainted for v in eqn.invars):
            out.add(i)
            tainted.update(v for v in eqn.outvars if _compat.is_var(v))
    return out


def sunk_after(eqns: Sequence[Any], bucket: Sequence[Site]) -> list[int]:
    """The equations between a bucket's first and last member that use (transitively) an
    earlier member's result. The fused all-reduce lands where the last member was, so these
    move to just after it; `fusable_reach` guarantees that no member needs them."""
    first, last = bucket[0].index, bucket[-1].index
    members = {s.index for s in bucket}
    tainted = {v for s in bucket[:-1] for v in eqns[s.index].outvars if _compat.is_var(v)}
    out = []
    for i in range(first + 1, last):
        eqn = eqns[i]
        if i not in members and any(_compat.is_var(v) and v in tainted for v in eqn.invars):
            out.append(i)
            tainted.update(v for v in eqn.outvars if _compat.is_var(v))
    return out


def can_fuse(eqns: Sequence[Any], bucket: Sequence[Site]) -> bool:
    """Whether the bucket can be one all-reduce where its last member was: the equations that
    must move after it (`sunk_after`) hold no psum (another group's plan may move or fuse it) and
    no effect (their order with other effects is kept)."""
    return not any(is_psum(eqns[i]) or eqns[i].effects for i in sunk_after(eqns, bucket))


def fusable_reach(eqns: Sequence[Any], members: Sequence[Site]) -> list[int]:
    """Per member psum, the last member it may share a fused bucket with (`planner.plan`'s
    `reach`). A fused bucket lands where its last member is, and what uses an earlier member's
    result in between moves after it (`sunk_after`): so member m reaches up to (not including) the
    first later member whose operand depends on m's result, or the first effectful equation
    that does. One pass, with each variable's dependence on members as a bit set."""
    index = [s.index for s in members]
    member_of = {i: m for m, i in enumerate(index)}
    depends: dict[Any, int] = {}
    limit = [len(members)] * len(members)  # the first member m may not share a bucket with
    for i, eqn in enumerate(eqns):
        mask = 0
        for v in eqn.invars:
            if _compat.is_var(v):
                mask |= depends.get(v, 0)
        m = member_of.get(i)
        stop = m if m is not None else (bisect.bisect_left(index, i) if eqn.effects else None)
        if mask and stop is not None:
            bits = mask
            while bits:
                low = bits & -bits
                j = low.bit_length() - 1
                limit[j] = min(limit[j], stop)
                bits ^= low
        if m is not None:
            mask |= 1 << m
        if mask:
            for v in eqn.outvars:
                if _compat.is_var(v):
                    depends[v] = mask
    return [max(m, limit[m] - 1) for m in range(len(members))]


def within_class(members: Sequence[Site], reach: Sequence[int] | None) -> list[int]:
    """`reach` (`fusable_reach`) cut at the end of each member's run of one `Site.bucket_class`: a
    bucket is one collective of one kind."""
    end = len(members) - 1
    out = [end] * len(members) if reach is None else list(reach)
    for m in range(len(members) - 1, -1, -1):
        if m + 1 < len(members) and members[m + 1].bucket_class != members[m].bucket_class:
            end = m
        out[m] = min(out[m], end)
    return out


#: An "emitter" form: ``emit(eqn, site, blocks, invars)``, the site's equation as libra's
#: single call of its kind at `blocks` (`invars`: the scope's inputs, which a psum may not
#: overwrite).
Emitter = Callable[[Any, Site, int, set], Any]


def single_eqn(eqn: Any, site: Site, blocks: int, invars: set) -> Any:
    """The site's equation as libra's single call of its kind, at `blocks`: its row's
    "emitter" form (`collectives.NoForm` naming the kind where it has none)."""
    emit: Emitter = site.collective.form("emitter")
    return emit(eqn, site, blocks, invars)


def _emits(lax: str) -> Callable[[Emitter], Emitter]:
    """Provides the decorated function as the "emitter" form of the kind `jax.lax` calls
    `lax`: where this module defines that kind's equation, its one naming of the kind."""
    return lambda emit: collectives.BY_LAX[lax].provide("emitter", emit)


@_emits("psum")
def _all_reduce(eqn: Any, site: Site, blocks: int, invars: set) -> Any:
    """libra's psum, in place unless its operand is one of the scope's inputs."""
    operand = eqn.invars[0]
    inplace = not (_compat.is_var(operand) and operand in invars)
    return eqn.replace(primitive=site.collective.form("primitive"),
                       params=dict(axes=site.axes, blocks=int(blocks), inplace=inplace,
                                   invariant=site.invariant))


def _libra_eqn(field: str, names: tuple[str, ...]) -> Emitter:
    """The emitter of a kind whose site carries its JAX params in `field` (`Site.scatter`,
    `Site.gather`, `Site.exchange`), in the order of `names`: libra's primitive with them."""
    def emit(eqn: Any, site: Site, blocks: int, invars: set) -> Any:
        values = getattr(site, field)
        if values is None:
            raise no_form(site.collective, f"{site.collective.lax} parameters (Site.{field})")
        return eqn.replace(primitive=site.collective.form("primitive"),
                           params=dict(axis_name=site.axes, **dict(zip(names, values)),
                                       blocks=int(blocks)))
    return emit


_emits("psum_scatter")(_libra_eqn("scatter", ("scatter_dimension", "axis_size", "tiled")))
_emits("all_gather")(_libra_eqn("gather", ("all_gather_dimension", "axis_size", "tiled",
                                           "invariant")))
_emits("all_to_all")(_libra_eqn("exchange", ("split_axis", "concat_axis", "tiled")))


def fused_eqn(eqns: Sequence[Any], bucket: Sequence[Site], axes: tuple, invariant: bool,
           blocks: int) -> Any:
    """A bucket as one `libra_bucket` equation of its kind (its row's "bucket" form:
    `collectives.NoForm` where it has none): a reduce-scatter's with its members' group size,
    tiling and scattered dimensions, an all-reduce's with its invariance."""
    members = [eqns[s.index] for s in bucket]
    effects = set().union(*(e.effects for e in members))
    row = bucket[0].collective
    row.form("bucket")
    params: dict[str, Any]
    if row.scatters:
        scatter = bucket[0].scatter
        if scatter is None:
            raise no_form(row, "psum_scatter parameters (Site.scatter)")
        params = dict(collective=row, axes=axes, axis_size=scatter[1],
                      tiled=tuple(s.scatter[2] for s in bucket if s.scatter is not None),
                      blocks=int(blocks))
        dims = tuple(s.scatter[0] for s in bucket if s.scatter is not None)
        if any(dims):  # (absent where every member scatters its first dimension)
            params["dimension"] = dims
    elif row.sums:
        params = dict(collective=row, axes=axes, blocks=int(blocks), invariant=invariant)
    elif row.gathers:
        gathers = _gathers_of(row, bucket)
        params = dict(collective=row, axes=axes, axis_size=gathers[0][1], tiled=gathers[0][2],
                      dimension=tuple(g[0] for g in gathers),
                      invariant=tuple(g[3] for g in gathers), blocks=int(blocks))
    else:
        raise no_form(row, "bucket parameters")
    # From the equation of the member it replaces (a gradient bucket's last, a group of
    # all-gathers' first: `gathers.prefetch_gathers`), so that its context (the mesh JAX checks
    # the types against, under `jax.set_mesh`) and source info carry over, as `single_eqn`'s.
    return members[0 if row.gathers else -1].replace(
        invars=[e.invars[0] for e in members], outvars=[e.outvars[0] for e in members],
        primitive=libra_bucket_p, params=params, effects=effects)


def _gathers_of(row: Collective, sites: Sequence[Site]) -> list[tuple[int, int, bool, bool]]:
    """The sites' all_gather params (`Site.gather`); `collectives.NoForm` where one has none."""
    gathers = [s.gather for s in sites]
    if any(g is None for g in gathers):
        raise no_form(row, "all_gather parameters (Site.gather)")
    return [g for g in gathers if g is not None]


def pairs_bucket(row: Collective) -> bool:
    """Whether `start_done_eqns` issues a bucket of kind `row` as a start/done pair: a kind
    with a pair (`ops.start_done`) whose members' results are their operands' shape (the
    replicated layout, the all-reduce's). A bucket of another kind (psum_scatters) is one
    call: no start/done pair of a bucket of it yet."""
    return row.has("pair") and row.layout == "replicated"


def start_done_eqns(eqns: Sequence[Any], bucket: Sequence[Site], axes: tuple, invariant: bool,
                blocks: int, call_id: int) -> tuple[Any, Any]:
    """A bucket as a `libra_start` equation of its kind (the all-reduce's: `pairs_bucket`; its
    operands -> each member's buffer in flight and a token) and a `libra_done` equation (those
    buffers, that token and an ordering token -> the members' results; `schedule` makes the
    ordering token the latest start's)."""
    row = bucket[0].collective
    if not pairs_bucket(row):
        raise no_form(row, "start/done pair of a bucket")
    members = [eqns[s.index] for s in bucket]
    effects = set().union(*(e.effects for e in members))
    operands = [e.invars[0] for e in members]
    results = [e.outvars[0] for e in members]
    flat_vars = [_compat.new_var(v.aval) for v in results]
    token = _compat.new_var(TOKEN_AVAL)
    # Both from the last member's equation: its context and source info carry over (`fused_eqn`).
    start = members[-1].replace(
        invars=operands, outvars=[*flat_vars, token], primitive=libra_start_p,
        params=dict(collective=row, axes=axes, blocks=int(blocks), invariant=invariant,
                    call_id=call_id), effects=effects)
    register_pair(row, call_id)
    done = members[-1].replace(
        invars=[*flat_vars, token, token], outvars=results, primitive=libra_done_p,
        params=dict(collective=row, out_avals=tuple(v.aval for v in results), axes=axes,
                    blocks=int(blocks), call_id=call_id), effects=set())
    return start, done


def gather_pair_eqns(eqn: Any, site: Site, blocks: int, call_id: int,
                 after: Any = None) -> tuple[Any, Any]:
    """An all_gather as a `libra_start` equation of its kind's pair (its operand, and `after`
    where given: a value it must not start before, which it reads and ignores -> the full
    buffer in flight and a token) and a `libra_done` equation (those -> the gather's result),
    both from the gather's equation (its context and source info carry over)."""
    return gather_bucket_pair_eqns([eqn], [site], blocks, call_id, after)


def gather_bucket_pair_eqns(members: Sequence[Any], sites: Sequence[Site], blocks: int,
                            call_id: int, after: Any = None) -> tuple[Any, Any]:
    """All_gathers over the same axes (`members`, their `sites`: a group `prefetch_gathers`
    issues ahead) as one `libra_start` over them (their operands, then `after` where given
    -> each full buffer in flight and a token) and one `libra_done` (-> each gather's
    result), both from the first member's equation. One member: the pair's params as one
    gather's (``dimension`` an int)."""
    row = sites[0].collective
    row.form("pair")
    gathers = _gathers_of(row, sites)
    dims = tuple(g[0] for g in gathers)
    params = dict(collective=row, axes=sites[0].axes,
                  dimension=dims[0] if len(dims) == 1 else dims, axis_size=gathers[0][1],
                  tiled=gathers[0][2], blocks=int(blocks), call_id=call_id)
    operands = [e.invars[0] for e in members]
    results = [e.outvars[0] for e in members]
    *flat_avals, token_aval = libra_start_p.abstract_eval(*(v.aval for v in operands),
                                                          **params)[0]
    flats, token = [_compat.new_var(a) for a in flat_avals], _compat.new_var(token_aval)
    first = members[0]
    start = first.replace(primitive=libra_start_p,
                          invars=operands + ([after] if after is not None else []),
                          outvars=[*flats, token], params=params,
                          effects=set().union(*(e.effects for e in members)))
    register_pair(row, call_id)
    done = first.replace(primitive=libra_done_p, invars=[*flats, token], outvars=results,
                         params=dict(params, out_avals=tuple(v.aval for v in results)),
                         effects=set())
    return start, done


def program_fingerprint(jaxpr: Any) -> int:
    """A 64-bit hash of a jaxpr's structure: every equation's primitive and result types,
    sub-jaxprs included (printing the jaxpr would take a second for 8000 equations)."""
    parts: list[str] = []
    types: dict[Any, str] = {}  # per aval: programs repeat a few types many times

    def type_of(aval: Any) -> str:
        text = types.get(aval)
        if text is None:
            dtype = getattr(aval, "dtype", None)
            text = types[aval] = f"{getattr(aval, 'shape', ())}{getattr(dtype, 'char', '')};"
        return text

    def visit(j: Any) -> None:
        for eqn in j.eqns:
            parts.append(eqn.primitive.name)
            parts.extend(type_of(v.aval) for v in eqn.outvars)
            for sub in _compat.jaxprs_in_params(eqn.params):
                visit(getattr(sub, "jaxpr", sub))
    visit(jaxpr)
    digest = hashlib.blake2b("".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def sink_gathers(eqns: Sequence[Any]) -> list[Any]:
    """The scope's equations with each all-gather moved down to just before its first reader.
    FSDP code often gathers every parameter up front (the GSPMD route does: `data_parallel`),
    which holds them all gathered from the scope's start and leaves no compute to issue a
    gather ahead of; at its first use it is where `gathers.prefetch_gathers` expects it. An
    all-gather is pure and its operand is defined earlier still, so the values are unchanged;
    one that nothing in the scope reads (a scope's output) stays where it is."""
    first_use: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if _compat.is_var(v):
                first_use.setdefault(v, i)
    moved: dict[int, list[Any]] = {}
    out: list[Any] = []
    for i, eqn in enumerate(eqns):
        out.extend(moved.pop(i, ()))
        use = first_use.get(eqn.outvars[0], i + 1) if eqn.outvars else i + 1
        row = collectives.of_primitive(eqn.primitive)
        if row is not None and row.gathers and use > i + 1:
            moved.setdefault(use, []).append(eqn)
        else:
            out.append(eqn)
    return out


def map_jaxprs(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` to every Jaxpr in a param value (ClosedJaxpr, Jaxpr or a tuple of them)."""
    if isinstance(value, _compat.ClosedJaxpr):
        return _compat.closed_jaxpr(fn(value.jaxpr), value.consts)
    if isinstance(value, _compat.Jaxpr):
        return fn(value)
    if isinstance(value, tuple) and any(isinstance(v, (_compat.ClosedJaxpr, _compat.Jaxpr))
                                        for v in value):
        return tuple(map_jaxprs(v, fn) for v in value)
    return value
