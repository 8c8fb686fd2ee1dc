"""The passes that bring a scope's equations into the form the rewrite plans: an ordered list
(`NORMALISE`) of functions over one `ScopeState`, each returning the scope's new equations.

A scope (a jaxpr: the step's, a `shard_map`'s body, a loop's body) is rewritten by
`Rewriter.jaxpr`: these passes first, in this order, then its sites found, classified,
planned, edited and scheduled. Why an order, pass by pass:

1. ``inline``: with ``ready="dataflow"``, a `jit` inside the step is a boundary only (its body
   inlined, `ready.inline_calls`), and a backward scan's stacked-slice psums go into its body
   (`loops.sink`), so that the passes below see every gradient psum where it is computed;
2. ``shrink``: a psum feeding only a linear map that shrinks it is issued after the map
   (`shrink.shrink_psums`), at the map's size;
3. ``transposes``: a psum_scatter of a transpose is issued before it
   (`transposes.scatter_before_transpose`), after ``shrink`` (which may move a psum there);
4. ``loops``: a scan's hoistable psums leave its body where the model prices that lower
   (`Rewriter.hoist_loops`), before the bodies are rewritten (so a body plans what stays);
5. ``regathers``: remat's re-gathers taken out of their checkpoints to be issued ahead
   (`gathers.hoist_regathers`; outside loops, where the prefetch distance is not 0);
6. ``sub_jaxprs``: every sub-jaxpr rewritten as a scope of its own (`Rewriter.sub_jaxprs`);
7. ``zeros``: psums of empty operands split off and psums of zeros folded
   (`sites.split_empty_operands`, `sites.fold_zero_psums`; said in the report);
8. ``sliced``: a psum whose result is only sliced to this rank's shard becomes a
   psum_scatter (`sites.scatter_sliced_psums`);
9. ``gathers``: each all-gather moved to just before its first use (`edits.sink_gathers`).

Each pass is a function ``(rw, state) -> equations`` of the rewrite's shared state
(`scope.Scope`) and this scope's (`ScopeState`); tests/test_passes.py runs each alone on a
small jaxpr.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from libra_jax import loops
from libra_jax.rewrite.edits import sink_gathers
from libra_jax.rewrite.gathers import hoist_regathers
from libra_jax.rewrite.ready import inline_calls
from libra_jax.rewrite.scope import Scope
from libra_jax.rewrite.shrink import shrink_psums
from libra_jax.rewrite.sites import (
    fold_zero_psums,
    is_psum,
    scatter_sliced_psums,
    split_empty_operands,
)
from libra_jax.rewrite.transposes import scatter_before_transpose

__all__ = ["ScopeState", "Pass", "NORMALISE", "normalise"]


@dataclasses.dataclass
class ScopeState:
    """One scope as the passes see it: its equations (each pass replaces them), its outputs,
    the sizes of the mesh axes in scope, its name, and where it is: in (a) loop body
    (`in_loop`), the body of a loop or shard_map autodiff's transpose made (`transposed`: all
    backward pass), the body of any equation autodiff's transpose made (`in_backward`)."""

    eqns: list[Any]
    outvars: Sequence[Any]
    axis_sizes: dict
    scope: str
    in_loop: bool = False
    transposed: bool = False
    in_backward: bool = False


#: A pass: the scope's new equations from the shared state and the scope's.
Pass = Callable[[Scope, ScopeState], list[Any]]


def inline(rw: Scope, st: ScopeState) -> list[Any]:
    """Calls inlined and a backward scan's slice psums sunk into its body (``ready="dataflow"``,
    where the scope has a psum)."""
    if rw.options.ready != "dataflow" or not any(is_psum(e) for e in st.eqns):
        return st.eqns
    return loops.sink(inline_calls(st.eqns), st.outvars)


def shrink(rw: Scope, st: ScopeState) -> list[Any]:
    """Each psum feeding only a shrinking linear map issued after the map."""
    return shrink_psums(st.eqns, st.outvars)


def transposes(rw: Scope, st: ScopeState) -> list[Any]:
    """Each psum_scatter of a transpose issued before it (the renamed results recorded)."""
    return scatter_before_transpose(st.eqns, st.outvars, rw.renamed)


def hoisted_loops(rw: Scope, st: ScopeState) -> list[Any]:
    """Each scan's hoistable psums out of its body where the model says so."""
    return rw.hoist_loops(st.eqns, st.axis_sizes, st.scope)


def regathers(rw: Scope, st: ScopeState) -> list[Any]:
    """Remat's re-gathers out of their checkpoints (outside loops, prefetch not 0)."""
    if st.in_loop or rw.prefetch == 0:
        return st.eqns
    return hoist_regathers(rw, st.eqns, st.axis_sizes)


def sub_jaxprs(rw: Scope, st: ScopeState) -> list[Any]:
    """Every sub-jaxpr rewritten as a scope of its own."""
    return [rw.sub_jaxprs(eqn, i, st.axis_sizes, st.scope, st.in_loop, st.in_backward)
            for i, eqn in enumerate(st.eqns)]


def zeros(rw: Scope, st: ScopeState) -> list[Any]:
    """Empty operands split off and psums of zeros folded (the report says which)."""
    eqns, folded = fold_zero_psums(split_empty_operands(st.eqns))
    rw.report.folded.extend(f"{name} of zeros in {st.scope}" for name in folded)
    return eqns


def sliced(rw: Scope, st: ScopeState) -> list[Any]:
    """A psum only sliced to this rank's shard made a psum_scatter."""
    return scatter_sliced_psums(st.eqns, st.outvars, st.axis_sizes)


def gathers(rw: Scope, st: ScopeState) -> list[Any]:
    """Each all-gather just before its first use."""
    return sink_gathers(st.eqns)


#: The passes, in the order the module docstring gives and why.
NORMALISE: tuple[tuple[str, Pass], ...] = (
    ("inline", inline), ("shrink", shrink), ("transposes", transposes),
    ("loops", hoisted_loops), ("regathers", regathers), ("sub_jaxprs", sub_jaxprs),
    ("zeros", zeros), ("sliced", sliced), ("gathers", gathers))


def normalise(rw: Scope, st: ScopeState) -> ScopeState:
    """`st` after every pass of `NORMALISE`, in order (its equations replaced)."""
    for _, run in NORMALISE:
        st.eqns = list(run(rw, st))
    return st
