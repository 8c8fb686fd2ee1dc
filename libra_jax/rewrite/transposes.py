"""A reduce-scatter of a transpose issued before the transpose (`scatter_before_transpose`).

Why: the weight gradient of ``x @ w`` is, as autodiff writes it, ``transpose(dot_general(dy,
x))``; an FSDP step reduce-scatters it (`jax.lax.psum_scatter`), and a reduce-scatter, XLA's
or libra's engine's, takes a row-major operand. So XLA:CPU materializes the transpose and
folds it into the contraction: a dot with a transposed copy of ``dy``, a form its YNNPACK
fusions do not take (the FSDP example's route: 7 plain dots and their copies, where GSPMD's
program, whose combined all-reduce takes any layout, has 2). Scattering the contraction's own
result along the dimension the transpose moves to the scattered one, then transposing the
shard, is the same sums on an n-th of the bytes transposed:

    psum_scatter(transpose(y, p), d, tiled=True) == transpose(psum_scatter(y, p[d], tiled=True), p)

(rank ``r``'s block of dimension ``d`` of the transpose is the transpose of its block of
dimension ``p[d]``; each element is summed over the ranks in rank order either way). The
engine takes a reduce-scatter along any dimension (`lowering.Call.member_dimensions`), so the
moved one still joins its stream's bucket.

Contract:

- Moved: a `transpose` whose result has one reader, not a result of the scope, that is a
  `psum_scatter` of that one operand over named axes, tiled, without `axis_index_groups`.
- The psum_scatter then reads the transpose's operand, scattered along ``p[d]`` (its result a
  new variable, the transpose's shape permuted back), and the transpose follows it, writing
  the psum_scatter's old result; the transpose keeps its params and source.
- Values: bitwise the program as written where XLA compiles the producer alike; XLA may now
  fuse the contraction otherwise (a YNNPACK fusion for the dot with a copy), so class 3 of
  plain, and bitwise its ``collectives="xla"`` control, which is rewritten the same
  (docs/bitwise.md).
- Scope: the equations of one scope (each scope is rewritten as its own). Called from
  `rewriter.Rewriter.jaxpr` after `shrink.shrink_psums`.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from libra_jax import _compat

__all__ = ["scatter_before_transpose"]


def scatter_before_transpose(eqns: Sequence[Any], outvars: Sequence[Any],
                             renamed: dict[Any, Any] | None = None) -> list[Any]:
    """The scope's equations with each psum_scatter of a transpose issued before it (module
    docstring); the equations as they are where there is none. Each moved psum_scatter's new
    result maps to its old one in `renamed` (`explain` names a gradient by the variable the
    program as written has)."""
    uses: collections.Counter[Any] = collections.Counter(
        v for e in eqns for v in e.invars if _compat.is_var(v))
    uses.update(v for v in outvars if _compat.is_var(v))
    reader = {v: e for e in eqns for v in e.invars if _compat.is_var(v)}
    moved: dict[int, tuple[Any, Any]] = {}  # the scatter's id -> (scatter, transpose), rewritten
    dropped: set[int] = set()  # the transposes moved
    for eqn in eqns:
        scatter = _movable_scatter(eqn, uses, reader)
        if scatter is not None:
            moved[id(scatter)] = _swapped(eqn, scatter)
            dropped.add(id(eqn))
            if renamed is not None:
                renamed[moved[id(scatter)][0].outvars[0]] = scatter.outvars[0]
    if not moved:
        return list(eqns)
    out: list[Any] = []
    for eqn in eqns:
        if id(eqn) in dropped:
            continue
        out.extend(moved.get(id(eqn), (eqn,)))
    return out


def _movable_scatter(eqn: Any, uses: collections.Counter[Any],
                     reader: dict[Any, Any]) -> Any | None:
    """The psum_scatter that reads transpose `eqn`'s result alone, where it may be issued
    before the transpose (module docstring); else None."""
    if eqn.primitive.name != "transpose" or len(eqn.outvars) != 1:
        return None
    result = eqn.outvars[0]
    scatter = reader.get(result) if uses[result] == 1 else None
    if scatter is None or scatter.primitive is not _compat.reduce_scatter_p:
        return None
    p = scatter.params
    axes = p.get("axis_name")
    axes = axes if isinstance(axes, tuple) else (axes,)
    if (len(scatter.invars) != 1 or not p.get("tiled") or p.get("axis_index_groups") is not None
            or not axes or any(isinstance(a, int) for a in axes)
            or _compat.is_dropped(scatter.outvars[0])):
        return None
    return scatter


def _swapped(transpose: Any, scatter: Any) -> tuple[Any, Any]:
    """(the psum_scatter of the transpose's operand along the moved dimension, the transpose of
    its result writing the psum_scatter's old result)."""
    permutation = tuple(transpose.params["permutation"])
    d = int(scatter.params["scatter_dimension"])
    old = scatter.outvars[0]
    inverse = [0] * len(permutation)
    for k, axis in enumerate(permutation):
        inverse[axis] = k
    shard = _compat.new_var(old.aval.update(shape=tuple(old.aval.shape[inverse[i]]
                                                         for i in range(len(permutation)))))
    return (scatter.replace(invars=[transpose.invars[0]], outvars=[shard],
                            params={**scatter.params, "scatter_dimension": permutation[d]}),
            transpose.replace(invars=[shard], outvars=[old]))
