"""Psums issued after the linear maps that shrink them (`shrink_psums`).

Under ``check_vma`` a replicated value that is cast to varying after it is broadcast (haliax's
style, Levanter's GPT-2 bias: ``x + jnp.broadcast_to(b, x.shape)``; T5X's relative-position
bias, contracted with a one-hot) gets its cotangent psummed at the broadcast's size: the
`pvary`'s transpose psums the ``[rows, positions, features]`` cotangent, and only then the
broadcast's transpose (a `reduce_sum`) or the contraction's (a `dot_general` with the
invariant one-hot) reduces it to the parameter's size. A psum commutes with a linear map
whose other operands are the same on every rank, so the psum is issued after the map, on its
smaller result: ``reduce_sum(psum(x)) -> psum(reduce_sum(x))``, ``dot_general(psum(x), w) ->
psum(dot_general(x, w))`` for `w` invariant over the psum's axes. The rewrite then plans it as
the gradient it is, at the map's output size.

Contract:

- Moved: a `psum`/`psum_invariant` of one operand, over named axes, without
  `axis_index_groups`, whose result has exactly one reader (not a result of the scope) that is
  a `reduce_sum`, or a `dot_general` whose other operand is invariant over the psum's axes (as
  its type says: only a `psum_invariant` is moved past a `dot_general`, where types carry
  varying axes), and whose result has fewer bytes than the psum's operand; or a chain of
  maps to one, each the one reader of the last's result, that only move data (`DATA_MOVEMENT`,
  a `reduce_sum` over axes of size 1: a broadcast bias ``b[None]``'s transpose), which the
  psum is moved past too. A moved psum that again feeds such a chain moves on.
- The map then reads the unreduced operand (its result typed varying over the psum's axes
  where the psum is `psum_invariant`; a `dot_general`'s other operand gets a `pvary` over them, as
  ``check_vma`` types a contraction of a varying operand); the psum equation (its primitive,
  axes and source kept, so autodiff's transpose still shows as its maker) follows, writing
  the map's old result.
- Values: the same sums in another order (each rank reduces before the ranks are summed):
  class 3 of the program as written, and bitwise its ``collectives="xla"`` control, which is
  rewritten the same (docs/bitwise.md).
- Scope: the equations of one scope, and the bodies of its `scan` equations (so that a moved
  psum of a scan body is seen by `loops.hoistable` before the scope hoists; each body is a
  scope of its own later, where the pass finds nothing left to move). Called from
  `rewriter.Rewriter.jaxpr`, before loops are hoisted.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from libra_jax import _compat
from libra_jax.rewrite.sites import aval_bytes

__all__ = ["shrink_psums", "LINEAR_MAPS", "DATA_MOVEMENT"]

#: The linear maps a psum is moved past where their result is smaller than its operand (by
#: primitive name).
LINEAR_MAPS = frozenset({"reduce_sum", "dot_general"})
#: Maps that only move data (a reduce_sum over axes of size 1 too: the same bytes), which a
#: psum is moved past on its way to one of `LINEAR_MAPS` (`loops.DATA_MOVEMENT` but the
#: broadcast, which grows it).
DATA_MOVEMENT = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p"})
#: The most maps a psum is moved past.
_MAX_CHAIN = 8


def shrink_psums(eqns: Sequence[Any], outvars: Sequence[Any]) -> list[Any]:
    """The scope's equations with each psum that feeds only a shrinking linear map issued
    after it, in this scope and in its scans' bodies (module docstring)."""
    eqns = [_in_scan_body(e) for e in eqns]
    uses: collections.Counter[Any] = collections.Counter(
        v for e in eqns for v in e.invars if _compat.is_var(v))
    uses.update(v for v in outvars if _compat.is_var(v))
    reader = {v: e for e in eqns for v in e.invars if _compat.is_var(v)}
    held: dict[Any, Any] = {}  # a psum's result -> the psum, not yet issued (`_moves`)
    out: list[Any] = []
    for eqn in eqns:
        if _moves(eqn, uses, reader):
            held[eqn.outvars[0]] = eqn
            continue
        summed = [v for v in eqn.invars if _compat.is_var(v) and v in held]
        if not summed:
            out.append(eqn)
            continue
        out.extend(held.pop(v) for v in summed[1:])  # dot_general(psum(a), psum(b)): one moves
        psum = held.pop(summed[0])
        mapped, moved = _past(psum, eqn, out)
        out.append(mapped)
        if _moves(moved, uses, reader):
            held[moved.outvars[0]] = moved
        else:
            out.append(moved)
    assert not held, "a held psum's reader was not found"
    return out


def _in_scan_body(eqn: Any) -> Any:
    """A `scan` equation with its body's psums moved (`shrink_psums`); others as they are."""
    if eqn.primitive.name != "scan":
        return eqn
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    moved = shrink_psums(body.eqns, body.outvars)
    if len(moved) == len(body.eqns) and all(a is b for a, b in zip(moved, body.eqns)):
        return eqn
    return eqn.replace(params={**eqn.params, "jaxpr": _compat.closed_jaxpr(
        body.replace(eqns=moved), closed.consts)})


def _moves(eqn: Any, uses: collections.Counter[Any], reader: dict[Any, Any]) -> bool:
    """Whether psum `eqn` is issued after its result's one reader (module docstring)."""
    if eqn.primitive.name not in _compat.PSUM_PRIMITIVES or len(eqn.invars) != 1:
        return False
    axes = tuple(eqn.params["axes"])
    operand = eqn.invars[0]
    if (not axes or any(isinstance(a, int) for a in axes)
            or eqn.params.get("axis_index_groups") is not None or not _compat.is_var(operand)):
        return False
    typed = _compat.PSUM_PRIMITIVES[eqn.primitive.name]
    v = eqn.outvars[0]
    for _ in range(_MAX_CHAIN):  # through data movement to the map that shrinks it
        m = reader.get(v) if uses[v] == 1 else None
        if m is None or len(m.outvars) != 1 or _compat.is_dropped(m.outvars[0]):
            return False
        name, others = m.primitive.name, [u for u in m.invars if u is not v]
        if name == "dot_general":
            other = others[0]  # `v` is read once: the other operand is another
            if not (typed and _compat.is_var(other)
                    and not set(axes) & _compat.varying_axes(other.aval)
                    and _compat.pvary_eqn(other, axes, eqn) is not None):
                return False
        elif name not in DATA_MOVEMENT and name != "reduce_sum" or others:
            return False
        out = m.outvars[0]
        if aval_bytes(out.aval) < aval_bytes(operand.aval):
            return name in LINEAR_MAPS
        if name == "dot_general" or aval_bytes(out.aval) > aval_bytes(operand.aval):
            return False
        v = out
    return False


def _past(psum: Any, map_eqn: Any, out: list[Any]) -> tuple[Any, Any]:
    """(the map reading the psum's operand, the psum of the map's result): a `pvary` of the
    map's other operand, where its type needs one, appended to `out`."""
    axes = tuple(psum.params["axes"])
    typed = _compat.PSUM_PRIMITIVES[psum.primitive.name]  # types carry varying axes
    result, operand = psum.outvars[0], psum.invars[0]
    invars = []
    for v in map_eqn.invars:
        if v is result:
            v = operand
        elif typed and _compat.is_var(v) and set(axes) - _compat.varying_axes(v.aval):
            cast = _compat.pvary_eqn(v, axes, psum)
            assert cast is not None  # `_moves` checked
            out.append(cast)
            v = cast.outvars[0]
        invars.append(v)
    old = map_eqn.outvars[0]
    unreduced = _compat.new_var(_compat.with_varying(old.aval, axes) if typed else old.aval)
    return (map_eqn.replace(invars=invars, outvars=[unreduced]),
            psum.replace(invars=[unreduced], outvars=[old]))
