"""Where a scope's collectives are and what each is for: its sites, found by one rule per
primitive, and their kinds.

A *site* (`Site`) is an equation the rewrite serves: a psum or psum_scatter the planner may
allocate and fuse, or an all_gather given the model's block count (and grouped with its
neighbours where the model says so: `gathers.prefetch_gathers`). `SITE_RULES` holds the rule
of each primitive (`find_site`), as equinox's `_finalise_jaxpr` holds its rules. A *gradient*
site is on the backward pass and feeds no later collective (`gradient_sites`); `site_kinds`
names every site's kind. What the members of one bucket share is its kind's "bucket class"
form (`Site.bucket_class`), provided here for the kinds the planner buckets (the all-reduce,
the reduce-scatter, the all-gather). The helpers the other concerns share to read collectives in a jaxpr
(`is_psum`, `axis_names`, `contains_psum`, `collective_counts`) live here too.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from libra_jax import _compat, collectives, dropins
from libra_jax.collectives import Collective, NoForm
from libra_jax.ops import (
    libra_all_gather_p,
    libra_all_to_all_p,
    libra_bucket_p,
    libra_psum_p,
    libra_reduce_scatter_p,
)
from libra_jax.ops.lowering import ENGINE_DTYPES
from libra_jax.ops.start_done import libra_start_p

__all__ = ["Site", "no_form", "exchange_site", "SITE_RULES", "site_rule", "find_site", "gather_site", "gradient_sites",
           "site_kinds", "split_empty_operands", "fold_zero_psums", "scatter_sliced_psums", "is_psum", "axis_names",
           "contains_psum", "collective_counts", "backward_sites", "warn_invariant_operands",
           "aval_bytes", "group_size", "same_type", "GATHERS", "libras_row",
           "row_of_eqn", "UNPLANNED_NOTICE"]


def no_form(row: Collective, what: str) -> NoForm:
    """The error of a site of kind `row` without `what` its form needs (`Site.scatter`, a
    bucket's parameters), said as `Collective.form` says a missing form, by the kind's name:
    never issued as another kind (the all-reduce, which every branch's last case used to
    be)."""
    return NoForm(f"libra_jax.optimize: the {row.kind} collective ({row.lax}) has no {what} "
                  "in the rewrite (docs/architecture.md, \"Adding a collective\")")


@dataclasses.dataclass
class Site:
    """A psum or psum_scatter equation that the planner may allocate (and fuse), or an
    all_gather given the model's block count (`gather_site`)."""

    index: int
    axes: tuple
    invariant: bool
    nbytes: int                     # the operand's bytes (a psum_scatter's: the unsharded buffer)
    explicit_blocks: int | None
    result: Any                     # the psum's result variable (for `libra_jax.explain`)
    #: Its kind (a row of `collectives`): given by its site rule, never assumed.
    collective: Collective
    # A psum_scatter's JAX params: (scatter_dimension, axis_size, tiled).
    scatter: tuple[int, int, bool] | None = None
    # An all_gather's: (all_gather_dimension, axis_size, tiled, invariant); `nbytes` is then
    # its result's (the gathered buffer's).
    gather: tuple[int, int, bool, bool] | None = None
    # An all_to_all's: (split_axis, concat_axis, tiled), of the primitive (`exchange_site`).
    exchange: tuple[int, int, bool] | None = None

    @property
    def bucket_class(self) -> tuple:
        """What the members of one bucket share (its kind's "bucket class" form: the kind,
        and what else its members must share); `collectives.NoForm` for a kind that has no
        bucket."""
        return self.collective.form("bucket class")(self)


# --- Each kind's bucket class (its row's "bucket class" form) -------------------------------

def _all_reduce_class(site: Site) -> tuple:
    """A psum's: its invariance (a bucket's results are all invariant or none)."""
    return (site.collective, site.invariant)


def _reduce_scatter_class(site: Site) -> tuple:
    """A psum_scatter's: its group size; its scattered dimension is its own (the engine takes
    each member along its own dimension: `lowering.Call.member_dimensions`)."""
    if site.scatter is None:
        raise no_form(site.collective, "psum_scatter parameters (Site.scatter)")
    _, size, _ = site.scatter
    return (site.collective, size)


def _all_gather_class(site: Site) -> tuple:
    """An all_gather's: its group size, tiling and dtype (one engine call copies one dtype);
    its gathered dimension and invariance are its own (the engine takes each member along its
    own dimension: `lowering.Call.member_dimensions`)."""
    if site.gather is None:
        raise no_form(site.collective, "all_gather parameters (Site.gather)")
    _, size, tiled, _ = site.gather
    return (site.collective, size, tiled, np.dtype(site.result.aval.dtype))


collectives.BY_LAX["psum"].provide("bucket class", _all_reduce_class)
collectives.BY_LAX["psum_scatter"].provide("bucket class", _reduce_scatter_class)
collectives.BY_LAX["all_gather"].provide("bucket class", _all_gather_class)


def gradient_sites(eqns: Sequence[Any], sites: Sequence[Site], outvars: Sequence[Any],
                    transposed: bool = False, values: bool = True
                    ) -> tuple[set[int], set[int] | None]:
    """(the gradient psums, the backward psums or None where no backward pass is visible):
    a gradient psum is on the backward pass (`backward_sites`; every one, in the body of a
    transposed loop) and feeds no later psum (`_terminal_sites`), or reduces a value that
    leaves the scope only as its result (`value_sites`: the loss's pmean, a metric's, which
    nothing waits for) where such psums of its stream (axes and bucket class) are there to
    join, with `values` (``ready="dataflow"``: "written" issues them where the program
    does); with no backward pass visible, every terminal psum."""
    terminal = _terminal_sites(eqns, sites, outvars)
    backward = {s.index for s in sites} if transposed else backward_sites(eqns, sites)
    if backward is None:
        return terminal, backward
    gradient = terminal & backward
    streams = {(s.axes, s.bucket_class) for s in sites if s.index in gradient}
    joining = value_sites(eqns, sites, outvars) if values and streams else set()
    return gradient | {s.index for s in sites if s.index in joining
                       and (s.axes, s.bucket_class) in streams}, backward


def value_sites(eqns: Sequence[Any], sites: Sequence[Site], outvars: Sequence[Any]) -> set[int]:
    """Indices of the all-reduces whose results leave the scope only as its results, through
    equations computed from such results and literals alone (a loss's `pmean`: its psum and
    division; a ratio's two psums and the division of their sums). Nothing in the scope waits
    for them, so they may wait for the backward pass and join its gradients' buckets instead
    of making every device meet mid-step (the loss's pmean at the end of the forward pass)."""
    reduces = {s.index for s in sites if s.explicit_blocks is None
               and s.collective.layout == "replicated" and len(eqns[s.index].invars) == 1}
    from_sites: dict[Any, set[int]] = {}  # a value -> the all-reduces it is computed from
    tail: set[int] = set()
    for i, eqn in enumerate(eqns):
        read = [v for v in eqn.invars if _compat.is_var(v)]
        if i in reduces:
            from_sites.update({v: {i} for v in eqn.outvars})
        elif (read and all(v in from_sites for v in read) and not eqn.effects
              and not _compat.jaxprs_in_params(eqn.params)):
            tail.add(i)
            both = set().union(*(from_sites[v] for v in read))
            from_sites.update({v: both for v in eqn.outvars})
    waited: set[int] = set()  # read by an equation that is neither a reduce nor its tail
    for i, eqn in enumerate(eqns):
        if i not in tail:
            for v in eqn.invars:
                if _compat.is_var(v) and v in from_sites:
                    waited |= from_sites[v]
    return reduces - waited


def site_kinds(sites: Sequence[Site], gradient: set[int], backward: set[int] | None,
           in_loop: bool) -> dict[int, str]:
    """Each site's kind, by its equation's position: "user" (an explicit block count),
    "gradient" (planned; in a loop body, for one iteration), "loop" (any other psum of a
    loop body), "backward" or "forward"."""
    kinds = {}
    for site in sites:
        if site.explicit_blocks is not None:
            kind = "user"
        elif site.index in gradient:
            kind = "gradient"  # in a loop body too: planned for one iteration
        elif in_loop:
            kind = "loop"
        else:
            kind = "backward" if backward is not None and site.index in backward else "forward"
        kinds[site.index] = kind
    return kinds


#: What `optimize` does with the collectives of sharded steps, said with those it leaves.
UNPLANNED_NOTICE = ("optimize plans the gradient psum_scatters of sharded parameters (FSDP, "
                    "ZeRO) with the psums, and runs every all_gather it can serve on libra's "
                    "engine at the model's block count (consecutive forward ones as one "
                    "call where the model says so); these it cannot serve "
                    "(axis_index_groups, positional axes, dtypes not of whole bytes) or does "
                    "not run (all_to_all, ppermute, pmax, pmin) keep their lowering.")


def libras_row(primitive: Any) -> Collective | None:
    """The kind of libra's own collective `primitive` (its row's "primitive" form), which
    `optimize` leaves at its own blocks where it does not serve it; None for JAX's and
    others."""
    row = collectives.of_primitive(primitive)
    return row if row is not None and row.has("primitive") and row.form(
        "primitive") is primitive else None


def row_of_eqn(eqn: Any) -> Collective | None:
    """The kind of a collective equation: its primitive's (`collectives.of_primitive`), or a
    bucket's or a start's (their ``collective`` param); None for others."""
    if eqn.primitive is libra_bucket_p or eqn.primitive is libra_start_p:
        row: Collective = eqn.params["collective"]
        return row
    return collectives.of_primitive(eqn.primitive)


def is_psum(eqn: Any) -> bool:
    """A psum or a psum_scatter (the collectives `optimize` plans: the kinds that sum), as
    JAX's or libra's, one call, a bucket or a start."""
    row = row_of_eqn(eqn)
    return row is not None and row.sums


#: Scalar integer primitives `_rank_values` evaluates (a slice start computed from
#: `axis_index`, as JAX's `all_gather_invariant` transpose and `dynamic_slice_in_dim` write it).
_INDEX_OPS: dict[str, Callable[..., Any]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative,
    "rem": np.remainder, "max": np.maximum, "min": np.minimum, "lt": np.less,
    "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "convert_element_type": lambda x: x, "pvary": lambda x: x,
    "select_n": lambda which, *cases: cases[int(which)],
}


def _rank_values(v: Any, producer: dict, axis: Any, world: int) -> list[int] | None:
    """The value of scalar `v` on each rank 0..world-1 of `axis`, where it is computed from
    `axis_index(axis)` and literals by `_INDEX_OPS` alone; else None."""
    def value(u: Any, rank: int, depth: int) -> Any:
        if not _compat.is_var(u):
            return np.asarray(u.val)
        eqn = producer.get(u)
        if eqn is None or depth > 32:
            raise LookupError
        name = eqn.primitive.name
        if name == "axis_index":
            if axis_names(eqn.params) != (axis,):
                raise LookupError
            return np.int64(rank)
        op = _INDEX_OPS.get(name)
        if op is None or len(eqn.outvars) != 1 or getattr(u.aval, "shape", None) != ():
            raise LookupError
        return op(*(value(w, rank, depth + 1) for w in eqn.invars))
    try:
        return [int(value(v, rank, 0)) for rank in range(world)]
    except (LookupError, TypeError, ValueError, IndexError):
        return None


def scatter_sliced_psums(eqns: Sequence[Any], outvars: Sequence[Any], axis_sizes: dict
                          ) -> list[Any]:
    """`eqns` with each psum whose only use is this rank's slice of its result (the gradient
    of ``all_gather(to='invarying')``: a `psum_invariant`, a `pvary`, a `dynamic_slice` of
    ``size / n`` rows at ``axis_index * size / n``, and for an untiled gather a `squeeze`)
    turned into the `reduce_scatter` (psum_scatter) that computes that slice: bitwise the
    same, since libra sums each element over the ranks in the same order either way, and half
    the bytes. The psum's equation becomes the reduce-scatter (so it is ready as early), the
    slice's equations go; the start index's arithmetic is left to XLA's dead-code pass. Each
    rank's start is checked by evaluating it for every rank (`_rank_values`)."""
    producer = {v: e for e in eqns for v in e.outvars if _compat.is_var(v)}
    uses: collections.Counter[Any] = collections.Counter(
        v for e in eqns for v in e.invars if _compat.is_var(v))
    uses.update(v for v in outvars if _compat.is_var(v))
    readers = {v: e for e in eqns for v in e.invars if _compat.is_var(v)}
    out = list(eqns)
    position = {id(e): i for i, e in enumerate(eqns)}
    for i, eqn in enumerate(eqns):
        if eqn.primitive.name not in _compat.PSUM_PRIMITIVES or len(eqn.invars) != 1:
            continue
        axes = axis_names(eqn.params)
        world = axis_sizes.get(axes[0]) if len(axes) == 1 else None
        result = eqn.outvars[0]
        cast = readers.get(result) if uses[result] == 1 else None
        if cast is not None and cast.primitive.name == "pvary":
            sliced = readers.get(cast.outvars[0]) if uses[cast.outvars[0]] == 1 else None
        else:
            sliced, cast = (cast, None)
        if (world is None or world < 2 or eqn.params.get("axis_index_groups") is not None
                or sliced is None or sliced.primitive.name != "dynamic_slice"):
            continue
        shape = tuple(result.aval.shape)
        sizes = tuple(sliced.params["slice_sizes"])
        cut = [d for d, (a, b) in enumerate(zip(shape, sizes)) if a != b]
        if len(cut) != 1 or shape[cut[0]] != sizes[cut[0]] * world:
            continue
        d = cut[0]
        starts = [_rank_values(v, producer, axes[0], world) for v in sliced.invars[1:]]
        if any(s is None for s in starts) or any(
                starts[k] != ([r * sizes[d] for r in range(world)] if k == d else [0] * world)
                for k in range(len(starts))):
            continue
        target, tiled, gone = sliced, True, [sliced]
        squeeze = readers.get(sliced.outvars[0]) if uses[sliced.outvars[0]] == 1 else None
        if (sizes[d] == 1 and squeeze is not None and squeeze.primitive.name == "squeeze"
                and tuple(squeeze.params["dimensions"]) == (d,)):
            target, tiled, gone = squeeze, False, [sliced, squeeze]
        out[i] = eqn.replace(
            primitive=_compat.reduce_scatter_p, outvars=list(target.outvars),
            params=dict(axis_name=axes, scatter_dimension=d, axis_index_groups=None,
                        axis_size=world, tiled=tiled))
        for e in gone + ([cast] if cast is not None else []):
            out[position[id(e)]] = None
    return [e for e in out if e is not None]


def axis_names(params: dict) -> tuple:
    """A collective equation's axes as a tuple (``axis_name`` or ``axes``, one or several)."""
    axes = params.get("axis_name", params.get("axes"))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


#: JAX's all-gather primitives (`to='varying'` and `to='invarying'`): the gathering kinds'.
GATHERS = tuple(name for row in collectives.ROWS if row.gathers for name in row.jax_primitives)


def collective_counts(jaxpr: Any) -> collections.Counter[str]:
    """How many collectives of each kind `jaxpr` holds (one call each, JAX's or libra's),
    sub-jaxprs included, by the name `jax.lax` gives them (a psum, pmean's too: "psum"):
    text for the report (`OptimizeReport.dropped`)."""
    counts: collections.Counter[str] = collections.Counter()
    for eqn in jaxpr.eqns:
        row = collectives.of_primitive(eqn.primitive)
        if row is not None:
            counts[row.lax] += 1
        for sub in _compat.jaxprs_in_params(eqn.params):
            counts.update(collective_counts(sub))
    return counts


def contains_psum(jaxpr: Any) -> bool:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(is_psum(eqn) or any(contains_psum(j) for j in _compat.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def warn_invariant_operands(eqns: Sequence[Any], sites: Sequence[Site]) -> None:
    """`dropins.warn_invariant_operand` for a psum whose operand is a `pvary` of the
    program (not of autodiff's transpose) over its axes: `lax.psum` casts an array that is
    already invariant that way (under `check_vma`) before summing it."""
    producer = {v: eqn for eqn in eqns for v in eqn.outvars if _compat.is_var(v)}
    for site in sites:
        operand = eqns[site.index].invars[0]
        cast = producer.get(operand) if _compat.is_var(operand) else None
        if (cast is not None and cast.primitive.name == "pvary"
                and not _compat.made_by_transpose(cast)
                and set(site.axes) <= set(cast.params.get("axes", ()))):
            dropins.warn_invariant_operand(site.axes, "libra_jax.optimize")


def backward_sites(eqns: Sequence[Any], sites: Sequence[Site]) -> set[int] | None:
    """Indices of the psums on the backward pass: made by autodiff's transpose (the psum of
    a replicated input's cotangent that `check_vma` inserts) or reading a value that depends
    on an equation it made (an explicit `pmean(grads)`). None where no equation of the scope
    was made by a transpose: no backward pass is visible (a hand-written one, or none)."""
    site_index = {s.index for s in sites}
    derived: set[Any] = set()
    seen_backward = False
    out: set[int] = set()
    for i, eqn in enumerate(eqns):
        made = _compat.made_by_transpose(eqn)
        seen_backward |= made
        if made or any(_compat.is_var(v) and v in derived for v in eqn.invars):
            derived.update(v for v in eqn.outvars if _compat.is_var(v))
            if i in site_index:
                out.add(i)
    return out if seen_backward else None


def _terminal_sites(eqns: Sequence[Any], sites: Sequence[Site], outvars: Sequence[Any]) -> set[int]:
    """Indices of psums whose results feed no later psum. A later equation with a psum in
    a sub-jaxpr (a jit, a loop) counts as a psum. The gradient psums are the terminal psums
    on the backward pass (`backward_sites`), or all terminal ones where none is visible."""
    site_index = {s.index for s in sites}
    # Backwards over the equations: does a value (transitively) reach a psum?
    feeds_psum: set[Any] = set()
    terminal: set[int] = set()
    for i in range(len(eqns) - 1, -1, -1):
        eqn = eqns[i]
        hides_psum = any(contains_psum(j) for j in _compat.jaxprs_in_params(eqn.params))
        reaches = (i in site_index or hides_psum
                   or any(_compat.is_var(v) and v in feeds_psum for v in eqn.outvars))
        if i in site_index and not any(v in feeds_psum for v in eqn.outvars if _compat.is_var(v)):
            terminal.add(i)
        if reaches:
            feeds_psum.update(v for v in eqn.invars if _compat.is_var(v))
    return terminal


def same_type(a: Any, b: Any) -> bool:
    """Shape, dtype and varying axes alike (a weak type aside)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and _compat.varying_axes(a) == _compat.varying_axes(b))


def aval_bytes(aval: Any) -> int:
    """The bytes of a value of type `aval`."""
    # `dtype.itemsize`, not np.dtype(...): JAX's extended dtypes (a PRNG key's key<fry>, 8
    # bytes) have one too, and numpy cannot interpret them.
    return int(math.prod(aval.shape)) * int(getattr(aval.dtype, "itemsize", 0))


def group_size(axis_sizes: dict, axes: tuple) -> int:
    """The devices a collective over `axes` runs among."""
    return int(math.prod(axis_sizes.get(a, 1) for a in axes))


# --- Site rules: one per primitive ----------------------------------------------------------
#
# How each primitive's equation becomes a site: ``rule(index, eqn)`` returns a `Site`, the
# reason it is skipped (a str: said in `OptimizeReport.skipped`, with its scope), or None (not
# a site: an all-gather libra does not serve stays as it is, listed as unplanned). Keyed by
# the primitive's name; `find_site` looks one up. A site's kind is its primitive's row
# (`collectives.of_primitive`), read as the rule runs: a primitive no row claims (libra's,
# its row's "primitive" form taken out) is no site. A new collective the rewrite plans joins
# as a rule here.

SiteRule = Callable[[int, Any], "Site | str | None"]
SITE_RULES: dict[str, SiteRule] = {}


def site_rule(*names: str) -> Callable[[SiteRule], SiteRule]:
    """Registers the decorated rule for the primitives `names`."""
    def register(rule: SiteRule) -> SiteRule:
        for name in names:
            SITE_RULES[name] = rule
        return rule
    return register


def find_site(index: int, eqn: Any) -> Site | str | None:
    """The site equation `index` is, or why it is skipped, by its primitive's rule."""
    rule = SITE_RULES.get(eqn.primitive.name)
    return None if rule is None else rule(index, eqn)


def _unserved_axes(name: str, params: dict, axes: tuple) -> str:
    """Why a collective over these axes is skipped ("" where it is not)."""
    if params.get("axis_index_groups") is not None:
        return f"{name} with axis_index_groups"
    if any(isinstance(a, int) for a in axes):
        return f"{name} over positional axes"
    return ""


@site_rule(*_compat.PSUM_PRIMITIVES)
def _psum_site(index: int, eqn: Any) -> Site | str | None:
    """JAX's psum (or psum_invariant) of a dtype the engine sums."""
    name = eqn.primitive.name
    row = collectives.of_primitive(eqn.primitive)
    if row is None:
        return None
    axes = tuple(eqn.params["axes"])
    aval = eqn.invars[0].aval
    why = _unserved_axes(name, eqn.params, axes)
    if not why and dropins.engine_dtype(aval.dtype) is None:
        why = f"{name} of {aval.dtype}"
    return why or Site(index, axes, _compat.PSUM_PRIMITIVES[name], aval_bytes(aval), None,
                       eqn.outvars[0], row)


@site_rule(libra_psum_p.name)
def _libra_psum_site(index: int, eqn: Any) -> Site | None:
    """libra's psum: planned unless it carries a block count of its own (kind "user")."""
    p, row = eqn.params, collectives.of_primitive(eqn.primitive)
    return None if row is None else Site(
        index, tuple(p["axes"]), p["invariant"], aval_bytes(eqn.invars[0].aval), p["blocks"],
        eqn.outvars[0], row)


@site_rule(_compat.reduce_scatter_p.name, libra_reduce_scatter_p.name)
def _reduce_scatter_site(index: int, eqn: Any) -> Site | str | None:
    """A psum_scatter (JAX's or libra's) of a dtype the engine sums."""
    p, row = eqn.params, collectives.of_primitive(eqn.primitive)
    if row is None:
        return None
    axes = axis_names(p)
    aval = eqn.invars[0].aval
    why = _unserved_axes(row.lax, p, axes)
    if not why and np.dtype(aval.dtype) not in ENGINE_DTYPES:
        why = f"{row.lax} of {aval.dtype}"
    return why or Site(index, axes, False, aval_bytes(aval), p.get("blocks"), eqn.outvars[0],
                       row, (int(p["scatter_dimension"]), int(p["axis_size"]), bool(p["tiled"])))


def _engine_copies(params: dict, axes: tuple, aval: Any) -> bool:
    """Whether libra's engine serves a copying collective (all-gather, all-to-all) with
    JAX's `params` over `axes` of an operand `aval`: not over `axis_index_groups` or
    positional axes, of a dtype of whole bytes, not of unreduced or reduced inputs."""
    return (params.get("axis_index_groups") is None
            and not any(isinstance(a, int) for a in axes)
            and dropins.copyable(aval.dtype)
            and _compat.input_state(aval, axes) not in ("unreduced", "reduced"))


@site_rule(*GATHERS, libra_all_gather_p.name)
def gather_site(index: int, eqn: Any) -> Site | None:
    """An all_gather (JAX's, either kind, or libra's) that libra's engine can serve: not
    over `axis_index_groups` or positional axes, of a dtype of whole bytes, not of
    unreduced or reduced inputs. Others stay as they are (`OptimizeReport.unplanned`)."""
    if SITE_RULES.get(eqn.primitive.name) is not gather_site:
        return None  # not an all-gather (the rule is also asked of any equation)
    p, aval, row = eqn.params, eqn.invars[0].aval, collectives.of_primitive(eqn.primitive)
    axes = axis_names(p)
    if row is None or not _engine_copies(p, axes, aval):
        return None
    invariant = p.get("invariant", eqn.primitive.name == _compat.all_gather_invariant_p.name)
    return Site(index, axes, False, aval_bytes(eqn.outvars[0].aval), p.get("blocks"),
                eqn.outvars[0], row,
                gather=(int(p["all_gather_dimension"]), int(p["axis_size"]),
                        bool(p["tiled"]), bool(invariant)))


@site_rule(_compat.all_to_all_p.name, libra_all_to_all_p.name)
def exchange_site(index: int, eqn: Any) -> Site | None:
    """An all_to_all (JAX's or libra's) that libra's engine can serve: not over
    `axis_index_groups` or positional axes, of a dtype of whole bytes, not of unreduced or
    reduced inputs; issued as libra's at the model's block count (`rewrite.exchanges`).
    Others stay as they are (`OptimizeReport.unplanned`)."""
    p, aval, row = eqn.params, eqn.invars[0].aval, collectives.of_primitive(eqn.primitive)
    axes = axis_names(p)
    if row is None or not _engine_copies(p, axes, aval):
        return None
    return Site(index, axes, False, aval_bytes(aval), p.get("blocks"), eqn.outvars[0], row,
                exchange=(int(p["split_axis"]), int(p["concat_axis"]), bool(p["tiled"])))


def split_empty_operands(eqns: list[Any]) -> list[Any]:
    """The equations, each psum's empty operands taken out of it: the sum of an empty array
    is itself, written as a constant of its type (no collective, and nothing computed from
    the operand). jaxlib 0.11.2's XLA crashes (SIGSEGV) compiling a shard_map that returns
    an empty array computed from an operand beside a non-empty one, which a psum left to
    XLA (a dtype the engine does not sum) or an engine call of the empty member would be."""
    out: list[Any] = []
    for eqn in eqns:
        if eqn.primitive.name in _compat.PSUM_PRIMITIVES or eqn.primitive is libra_psum_p:
            pairs = list(zip(eqn.invars, eqn.outvars))
            full = [(v, o) for v, o in pairs if math.prod(v.aval.shape)]
            if len(full) < len(pairs):
                out.extend(_zeros_eqn(o) for v, o in pairs if not math.prod(v.aval.shape))
                if full:
                    out.append(eqn.replace(invars=[v for v, _ in full],
                                           outvars=[o for _, o in full]))
                continue
        out.append(eqn)
    return out


def _zeros_eqn(outvar: Any) -> Any:
    """An equation that writes zeros of `outvar`'s shape and dtype to it."""
    aval = outvar.aval
    eqn, = jax.make_jaxpr(lambda: jax.lax.full(aval.shape, 0, aval.dtype))().jaxpr.eqns
    return eqn.replace(outvars=[outvar])


def fold_zero_psums(eqns: list[Any]) -> tuple[list[Any], list[str]]:
    """(the equations, the names of the psums folded): psums whose operand is a known zero
    (a literal, or broadcast from one), computed as ``z + z`` without a call: the gradient of
    a float leaf that no derivative reaches (Equinox's ``Dropout.p``) is a constant zero, and
    each ``pmean`` of it was a 4-byte all-reduce of its own. Bitwise `jax.lax.psum`'s: XLA's
    simplifier turns a sum all-reduce of an operand the same on every rank (a constant) into
    the operand times the group size, so a zero keeps its sign (-0 stays -0), as it does in
    ``z + z``. Only where the psum's result has its operand's type (no varying axes to drop);
    other constants stay psums, planned (their product and a rank-order sum round
    differently)."""
    zeros: set[Any] = set()

    def is_zero(v: Any) -> bool:
        if _compat.is_var(v):
            return v in zeros
        value = np.asarray(getattr(v, "val", np.nan))
        return value.size > 0 and bool(np.all(value == 0))

    out, folded = [], []
    for eqn in eqns:
        name = eqn.primitive.name
        operand = eqn.invars[0] if len(eqn.invars) == 1 else None
        if name in ("broadcast_in_dim", "convert_element_type") and is_zero(operand):
            zeros.add(eqn.outvars[0])
        elif ((name in _compat.PSUM_PRIMITIVES or eqn.primitive is libra_psum_p)
              and operand is not None and is_zero(operand)
              and same_type(operand.aval, eqn.outvars[0].aval)):
            eqn = eqn.replace(primitive=jax.lax.add_p, invars=[operand, operand], params={})
            zeros.add(eqn.outvars[0])
            folded.append(name)
        out.append(eqn)
    return out, folded
