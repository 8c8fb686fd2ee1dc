"""Scan over layers: which gradient psums of a loop body can leave the loop, and how.

A backward `scan` over stacked layers (Flax ``nn.scan``, a `lax.scan` over stacked weights,
MaxText-style) computes one layer's weight cotangent per iteration and psums it in the body
(the psum `check_vma`'s transpose inserts); the psum'd slice is a ``ys`` output, and the scan
stacks the slices into the weights' gradient. Summation is elementwise, so summing the stacked,
unreduced slices once after the loop sums the same values in the same order (compiled, the
loop around it may still round differently: docs/bitwise.md, class 3): the psum
is *hoisted* out of the loop, where `optimize` plans it with the scope's other gradient psums
(one bucket for every layer's weights, instead of one default-blocks all-reduce per layer per
weight).

Contract (`hoistable`, `hoist`; tests in tests/test_loops.py):

- Hoistable: a `psum`/`psum_invariant` directly in a `scan` body, over named axes and without
  `axis_index_groups`, whose result reaches exactly one ``ys`` output of the body and nothing
  else, through data movement only (`DATA_MOVEMENT`: reshape, transpose, squeeze, a
  broadcast, a sum over axes of size 1). Data movement commutes with an elementwise sum bit for
  bit (a sum over one element only turns -0.0 into +0.0, and so does summing it first).
- Not hoistable, and left in the loop: a psum whose result goes into the carry or feeds other
  work of the body. That is the psum of a weight the scan closes over (shared by every
  iteration): its cotangent is psum'd per iteration and accumulated in the carry, and a psum
  of the accumulated sum would round differently from the sum of psums.
- `hoist` returns the scan equation without those psums (the outputs unreduced, typed as
  varying over the psums' axes) followed by one psum per hoisted output, over the stacked
  array, made from the original psum equation (same primitive, axes and source, so autodiff's
  transpose still shows as its maker).
- `sink` is the converse for a step written ``pmean(jax.grad(...))`` over scanned layers: a
  `psum` after the backward scan of the stacked slices that scan returns (a ``ys`` output
  nothing else reads) moves into the scan's body, one psum per iteration of that iteration's
  slice (the same sums, elementwise). It is then a hoistable psum of the body like autodiff's,
  and `optimize` keeps it there or hoists it back, as the model prices each
  (`rewrite.rewriter.loop_plan`): the slices are ready per iteration of the transposed scan.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from libra_jax import _compat, dropins

__all__ = ["Hoist", "hoistable", "hoist", "sink", "DATA_MOVEMENT"]

#: Primitives that only move data: psum(f(x)) == f(psum(x)) bit for bit for each of them.
DATA_MOVEMENT = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim",
                           "copy", "copy_p"})


@dataclasses.dataclass(frozen=True)
class Hoist:
    """One hoistable psum of a scan body: where it is, what follows it, where it ends."""

    psum: int                 # its equation's position in the body
    chain: tuple[int, ...]    # the data movement between it and the output, in order
    output: int               # the body output (and scan output) it ends in: a ys position
    axes: tuple               # its axes
    nbytes: int               # bytes per iteration


def hoistable(eqn: Any) -> list[Hoist]:
    """The psums of scan equation `eqn`'s body that may leave the loop (module docstring)."""
    if eqn.primitive.name != "scan":
        return []
    body = eqn.params["jaxpr"].jaxpr
    num_carry = _compat.scan_num_carry(eqn.params)
    readers: dict[Any, list[int]] = {}
    for i, e in enumerate(body.eqns):
        for v in e.invars:
            if _compat.is_var(v):
                readers.setdefault(v, []).append(i)
    outputs: dict[Any, list[int]] = {}
    for j, v in enumerate(body.outvars):
        if _compat.is_var(v):
            outputs.setdefault(v, []).append(j)
    found = []
    for i, e in enumerate(body.eqns):
        if e.primitive.name not in _compat.PSUM_PRIMITIVES or len(e.invars) != 1:
            continue
        axes = tuple(e.params["axes"])
        aval = e.invars[0].aval
        if (e.params.get("axis_index_groups") is not None or not axes
                or any(isinstance(a, int) for a in axes)
                or dropins.engine_dtype(aval.dtype) is None):
            continue
        v, chain = e.outvars[0], list[int]()
        while True:
            reads, outs = readers.get(v, []), outputs.get(v, [])
            if not reads and len(outs) == 1 and outs[0] >= num_carry:
                found.append(Hoist(i, tuple(chain), outs[0], axes,
                                   int(aval.dtype.itemsize * _size(aval.shape))))
                break
            if outs or len(reads) != 1 or not _moves_data(body.eqns[reads[0]], v):
                break
            chain.append(reads[0])
            v = body.eqns[reads[0]].outvars[0]
    return found


def hoist(eqn: Any, hoists: Sequence[Hoist]) -> list[Any]:
    """Scan equation `eqn` with `hoists` taken out of its body, then their psums (module
    docstring). Equations are rebuilt with `replace`; no other equation of the body changes."""
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    by_psum = {h.psum: h for h in hoists}

    def unreduced(aval: Any, h: Hoist) -> Any:  # typed varying only where types say so
        invariant = _compat.PSUM_PRIMITIVES[body.eqns[h.psum].primitive.name]
        return _compat.with_varying(aval, h.axes) if invariant else aval

    in_chain = {i: h for h in hoists for i in h.chain}
    subst: dict[Any, Any] = {}
    eqns = []
    for i, e in enumerate(body.eqns):
        if i in by_psum:
            subst[e.outvars[0]] = e.invars[0]  # its readers get the unreduced operand
            continue
        if i in in_chain:
            outvars = [_compat.new_var(unreduced(v.aval, in_chain[i])) for v in e.outvars]
            subst.update(zip(e.outvars, outvars))
            e = e.replace(invars=[subst.get(v, v) if _compat.is_var(v) else v
                                  for v in e.invars], outvars=outvars)
        eqns.append(e)
    new_body = body.replace(eqns=eqns, outvars=[subst.get(v, v) if _compat.is_var(v) else v
                                                for v in body.outvars])
    outvars = list(eqn.outvars)
    psums = []
    for h in hoists:
        old = outvars[h.output]
        outvars[h.output] = new = _compat.new_var(unreduced(old.aval, h))
        if _compat.is_var(old) and not _compat.is_dropped(old):
            psums.append(body.eqns[h.psum].replace(invars=[new], outvars=[old]))
    scan = eqn.replace(params={**eqn.params, "jaxpr": _compat.closed_jaxpr(new_body,
                                                                            closed.consts)},
                       outvars=outvars)
    return [scan, *psums]


def sink(eqns: Sequence[Any], outvars: Sequence[Any]) -> list[Any]:
    """The scope's equations with each `psum` of a backward scan's stacked output moved into
    the scan's body (module docstring): the psum (JAX's, one operand, over named axes, no
    `axis_index_groups`, not `psum_invariant`, whose types carry varying axes) of a ``ys``
    output of a `scan` autodiff's transpose made, read by nothing else (and not a result of
    the scope, `outvars`)."""
    readers: dict[Any, int] = {}
    for e in eqns:
        for v in e.invars:
            if _compat.is_var(v):
                readers[v] = readers.get(v, 0) + 1
    for v in outvars:
        if _compat.is_var(v):
            readers[v] = readers.get(v, 0) + 1
    made = {v: (i, j) for i, e in enumerate(eqns) for j, v in enumerate(e.outvars)}
    sunk: dict[int, dict[int, Any]] = {}  # scan position -> ys position -> the psum
    for e in eqns:
        operand = e.invars[0] if len(e.invars) == 1 else None
        if (e.primitive is not _compat.psum_p or operand is None or not _compat.is_var(operand)
                or operand not in made or readers.get(operand) != 1
                or e.params.get("axis_index_groups") is not None or not e.params["axes"]
                or any(isinstance(a, int) for a in e.params["axes"])
                or dropins.engine_dtype(operand.aval.dtype) is None):
            continue
        i, j = made[operand]
        scan = eqns[i]
        if (scan.primitive.name != "scan" or j < _compat.scan_num_carry(scan.params)
                or not _compat.made_by_transpose(scan, deep=False)
                or not _compat.is_var(scan.params["jaxpr"].jaxpr.outvars[j])):
            continue
        sunk.setdefault(i, {})[j] = e
    if not sunk:
        return list(eqns)
    moved = {id(e) for psums in sunk.values() for e in psums.values()}
    out = []
    for i, e in enumerate(eqns):
        if id(e) in moved:
            continue
        if i in sunk:
            closed = e.params["jaxpr"]
            body = closed.jaxpr
            body_eqns, body_outvars, scan_outvars = list(body.eqns), list(body.outvars), list(e.outvars)
            for j, psum in sunk[i].items():
                slice_var = body_outvars[j]
                reduced = _compat.new_var(slice_var.aval)
                body_eqns.append(psum.replace(invars=[slice_var], outvars=[reduced]))
                body_outvars[j] = reduced
                scan_outvars[j] = psum.outvars[0]  # the scan now returns the reduced stack
            new_body = body.replace(eqns=body_eqns, outvars=body_outvars)
            e = e.replace(params={**e.params, "jaxpr": _compat.closed_jaxpr(new_body,
                                                                            closed.consts)},
                          outvars=scan_outvars)
        out.append(e)
    return out


def _moves_data(eqn: Any, v: Any) -> bool:
    """Whether `eqn` reads `v` as its only variable operand and only moves its data."""
    if [x for x in eqn.invars if _compat.is_var(x)] != [v] or len(eqn.outvars) != 1:
        return False
    name = eqn.primitive.name
    if name in DATA_MOVEMENT:
        return True
    if name == "reduce_sum":  # over axes of size 1: a reshape (-0.0 aside, see above)
        shape = v.aval.shape
        return all(shape[a] == 1 for a in eqn.params["axes"])
    return False


def _size(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
