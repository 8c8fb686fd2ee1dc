"""A forward `shard_map`'s reductions of its results issued with the backward pass
(`defer_reductions`).

`jax.value_and_grad` of a `shard_map`ped loss (the GSPMD route, `libra_jax.value_and_grad`,
traces one) makes two shard_maps: the forward pass, whose last equations reduce the loss and
aux's metrics over the batch's axes (`pmean`: a psum, then a division), and autodiff's
transpose of it, the backward pass with the gradient collectives. The loss's psum is of one
number, but it makes every device meet in the middle of the step, where they arrive apart: on
CPU it cost 3.6 points of the FSDP example's step against GSPMD's
(benchmarks/results/fsdp_gspmd.md). Nothing in the backward pass reads the reduced value, so
the rewrite issues it there: one more gradient member, planned with the backward pass's
all-reduces, at no call of its own.

Contract:

- Moved: from a `shard_map` A of the scope, its psums (JAX's all-reduce primitives over named
  axes, one operand, no ``axis_index_groups``) of operands of at most `MAX_BYTES` typed varying
  over exactly the psum's axes, with the equations after them computed from their results
  and literals alone (`pmean`'s division, a ratio's), where every value so computed is read
  only by those equations or is a result of A laid out as ``P()``; into B, the last
  `shard_map` after A that autodiff's transpose made, over the same mesh, manual axes and
  ``check_vma``, where B reads none of those results (directly or through the equations
  between A and B). Under ``check_vma=False`` (no varying types to check the move by),
  nothing moves.
- A returns each moved psum's operand instead, with a leading axis of 1, laid out over the
  psum's axes; B takes them as its last inputs and ends with the psums and the equations
  after them (their primitives and params as they were), returning A's old results as the
  same variables. The scope's equations between A and B that read them are moved after B.
- Values: the same primitive sums the same operands: what the psum's lowering makes of them
  alone or as one member of a bucket (every engine sums each element in rank order), and
  the equations after it are the same.
- Called as a `passes.NORMALISE` pass with ``ready="dataflow"`` (the default): the readiness
  rule places a collective where its operand is ready, and this one's operand is ready
  before the backward pass begins; ``ready="written"`` keeps the program's order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from libra_jax import _compat, collectives
from libra_jax.rewrite.edits import downstream_of
from libra_jax.rewrite.sites import aval_bytes

__all__ = ["defer_reductions", "MAX_BYTES"]

#: The largest psum operand moved: the reductions of a loss and its metrics (a few scalars).
#: A larger one is a value the forward pass computes for its own use, and A would return it
#: unreduced, a copy per device.
MAX_BYTES = 4096


@dataclasses.dataclass
class _Moved:
    """What leaves a forward shard_map: its psums' and the following equations' indices in
    its body (in order) and the indices of its results they compute."""

    psums: list[int]
    after: list[int]
    results: list[int]


def defer_reductions(eqns: Sequence[Any]) -> list[Any]:
    """The scope's equations with each forward shard_map's reductions of its results moved
    into the backward shard_map (the module docstring's contract)."""
    eqns = list(eqns)
    for a, eqn in enumerate(eqns):
        if eqn.primitive.name != "shard_map":
            continue
        moved = _movable(eqn)
        if moved is None:
            continue
        results = [eqn.outvars[j] for j in moved.results]
        b = _backward_map(eqns, a, results)
        if b is not None:
            eqns = _moved_into(eqns, a, b, moved)
    return eqns


def _is_psum(eqn: Any) -> bool:
    row = collectives.of_primitive(eqn.primitive)
    return (row is not None and row.layout == "replicated"
            and eqn.primitive.name in row.jax_primitives)


def _movable_psum(eqn: Any) -> bool:
    axes = eqn.params.get("axes")
    if not (_is_psum(eqn) and len(eqn.invars) == 1 and _compat.is_var(eqn.invars[0])
            and not eqn.params.get("axis_index_groups") and isinstance(axes, tuple) and axes
            and all(isinstance(a, str) for a in axes)):
        return False
    aval = eqn.invars[0].aval
    return aval_bytes(aval) <= MAX_BYTES and _compat.varying_axes(aval) == frozenset(axes)


def _replicated(spec: Any) -> bool:
    return isinstance(spec, P) and all(part is None for part in spec)


def _movable(eqn: Any) -> _Moved | None:
    """The reductions of `eqn`'s (a shard_map's) results that may move, or None."""
    if not eqn.params.get("check_vma"):
        return None
    body = eqn.params["jaxpr"]
    # Each computed value's group: the psums it is computed from (a ratio's division joins
    # two). A group moves whole or not at all.
    group: dict[Any, int] = {}
    parent: dict[int, int] = {}

    def root(g: int) -> int:
        while parent[g] != g:
            g = parent[g]
        return g

    psums, after = [], []
    for k, e in enumerate(body.eqns):
        if _movable_psum(e):
            parent[k] = k
            group[e.outvars[0]] = k
            psums.append(k)
            continue
        read = [v for v in e.invars if _compat.is_var(v)]
        if (read and all(v in group for v in read) and not e.effects
                and not _compat.jaxprs_in_params(e.params)):
            roots = {root(group[v]) for v in read}
            first = min(roots)
            for r in roots:
                parent[r] = first
            for v in e.outvars:
                group[v] = first
            after.append(k)
    if not psums:
        return None
    # A group stays where any value of it is read by other equations or leaves A otherwise
    # than as a replicated result; one that nothing reads is dead (no move).
    staying: set[int] = set()
    results: list[int] = []
    tail = set(after)
    for k, e in enumerate(body.eqns):
        if k not in tail:
            staying.update(root(group[v]) for v in e.invars if _compat.is_var(v) and v in group)
    for j, (v, spec) in enumerate(zip(body.outvars, eqn.params["out_specs"])):
        if _compat.is_var(v) and v in group:
            if _replicated(spec):
                results.append(j)
            else:
                staying.add(root(group[v]))
    results = [j for j in results if root(group[body.outvars[j]]) not in staying]
    moving = {root(group[body.outvars[j]]) for j in results}
    if not results:
        return None
    return _Moved([k for k in psums if root(k) in moving],
                  [k for k in after if root(group[body.eqns[k].outvars[0]]) in moving],
                  results)


def _backward_map(eqns: Sequence[Any], a: int, results: Sequence[Any]) -> int | None:
    """The index of the last shard_map after `eqns[a]` that autodiff's transpose made, over
    its mesh and manual axes, which does not read `results`; None where there is none."""
    forward = eqns[a]
    reads = {a + 1 + i for i in downstream_of(eqns[a + 1:], results)}
    keys = ("mesh", "newly_manual_axes", "check_vma")
    for b in range(len(eqns) - 1, a, -1):
        e = eqns[b]
        if (e.primitive.name == "shard_map" and b not in reads
                and all(e.params.get(k) == forward.params.get(k) for k in keys)
                and _compat.made_by_transpose(e, deep=False)):
            return b
    return None


def _reshaped(like: Any, x: Any, shape: tuple, aval: Any) -> tuple[Any, Any]:
    """(an equation reshaping `x` to `shape`, typed `aval` (its varying axes kept), its
    result), with `like`'s source."""
    template = jax.make_jaxpr(lambda v: jax.lax.reshape(v, shape))(
        jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype)).eqns[0]
    out = _compat.new_var(aval)
    return like.replace(primitive=template.primitive, params=dict(template.params),
                        invars=[x], outvars=[out], effects=template.effects), out


def _with_io(jaxpr: Any, invars: Sequence[Any], outvars: Sequence[Any], eqns: Sequence[Any],
             effects: Any = None) -> Any:
    """`jaxpr` with new inputs, results and equations (its debug info's names padded)."""
    info = jaxpr.debug_info
    if info is not None:
        names, paths = info.arg_names, info.safe_result_paths(len(jaxpr.outvars))
        info = info._replace(
            arg_names=None if names is None else
            tuple(names) + ("deferred",) * (len(invars) - len(names)),
            result_paths=tuple(paths)[:len(outvars)]
            + ("deferred",) * (len(outvars) - len(paths)))
    return jaxpr.replace(invars=list(invars), outvars=list(outvars), eqns=list(eqns),
                         effects=jaxpr.effects if effects is None else effects,
                         debug_info=info)


def _moved_into(eqns: list[Any], a: int, b: int, moved: _Moved) -> list[Any]:
    """`eqns` with `moved` taken from shard_map ``eqns[a]`` into ``eqns[b]``."""
    forward, backward = eqns[a], eqns[b]
    mesh, check_vma = forward.params["mesh"], forward.params["check_vma"]
    manual = backward.params["newly_manual_axes"]
    body = forward.params["jaxpr"]
    gone = set(moved.psums) | set(moved.after)
    kept_eqns = [e for k, e in enumerate(body.eqns) if k not in gone]
    kept = [j for j in range(len(body.outvars)) if j not in set(moved.results)]
    out_specs = [forward.params["out_specs"][j] for j in kept]
    body_outs = [body.outvars[j] for j in kept]
    outer_outs = [forward.outvars[j] for j in kept]
    # The psums' operands leave A unreduced, one row per device.
    handed: list[Any] = []  # (outer variable, its spec) per psum
    for k in moved.psums:
        psum = body.eqns[k]
        x = psum.invars[0]
        spec = P(psum.params["axes"])
        eqn, row = _reshaped(psum, x, (1, *x.aval.shape), x.aval.update(shape=(1, *x.aval.shape)))
        kept_eqns.append(eqn)
        body_outs.append(row)
        out_specs.append(spec)
        outer = _compat.new_var(_compat.unshard_aval(mesh, check_vma, spec, row.aval))
        outer_outs.append(outer)
        handed.append((outer, spec))
    new_forward = forward.replace(
        outvars=outer_outs,
        params={**forward.params, "out_specs": tuple(out_specs),
                "jaxpr": _with_io(body, body.invars, body_outs, kept_eqns)})
    # B takes them last and ends with the psums and what follows them.
    inner = backward.params["jaxpr"]
    like = inner.eqns[-1] if inner.eqns else body.eqns[moved.psums[0]]
    new_in, tail, subst = [], [], {}
    for (outer, spec), k in zip(handed, moved.psums):
        psum = body.eqns[k]
        x = psum.invars[0]
        y = _compat.new_var(_compat.shard_aval(mesh, manual, check_vma, spec, outer.aval))
        new_in.append(y)
        eqn, z = _reshaped(like, y, x.aval.shape, x.aval)
        tail.append(eqn)
        summed = _compat.new_var(psum.outvars[0].aval)
        subst[psum.outvars[0]] = summed
        tail.append(psum.replace(invars=[z], outvars=[summed], source_info=like.source_info))
    for k in moved.after:
        e = body.eqns[k]
        outs = [_compat.new_var(v.aval) for v in e.outvars]
        subst.update(zip(e.outvars, outs))
        tail.append(e.replace(invars=[subst.get(v, v) if _compat.is_var(v) else v
                                      for v in e.invars],
                              outvars=outs, source_info=like.source_info))
    results = [body.outvars[j] for j in moved.results]
    effects = inner.effects.union(*(e.effects for e in tail))
    new_backward = backward.replace(
        invars=[*backward.invars, *(outer for outer, _ in handed)],
        outvars=[*backward.outvars, *(forward.outvars[j] for j in moved.results)],
        params={**backward.params,
                "in_specs": (*backward.params["in_specs"], *(spec for _, spec in handed)),
                "out_specs": (*backward.params["out_specs"],
                              *(forward.params["out_specs"][j] for j in moved.results)),
                "jaxpr": _with_io(inner, [*inner.invars, *new_in],
                                  [*inner.outvars, *(subst[v] for v in results)],
                                  [*inner.eqns, *tail], effects)})
    # What reads A's old results between A and B waits for B.
    between = eqns[a + 1:b]
    waiting = downstream_of(between, [forward.outvars[j] for j in moved.results])
    return [*eqns[:a], new_forward, *(e for i, e in enumerate(between) if i not in waiting),
            new_backward, *(between[i] for i in sorted(waiting)), *eqns[b + 1:]]
