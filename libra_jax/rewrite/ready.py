"""When each gradient is ready: a scope's gradient collectives planned in the order the
backward pass produces their operands (data flow), not where the code wrote them.

``pmean(jax.grad(loss)(params))``, the common form, writes every gradient psum after the
backward pass; autodiff's psums (``shard_map(check_vma=True)``) sit where each cotangent is
made. The computation is the same, so the plan must be: `to_ready_points` moves each gradient
collective, with the equations that only move its operand on the way (`MOVES`: casts,
scalings, reshapes), to just after the equation that produces that operand, its *ready
point*. Collectives ready at the same point keep their written order. Every moved equation
reads only what is defined by its ready point, and is read only later than before, so the
program computes the same values in another order; the planner's layers (the compute between
one collective and the next, `buckets.plan`) are then the backward pass's, and a bucket's
call (or start) sits where its last member is ready.

A `jax.jit` inside the step is only a function boundary: its body is inlined into the scope
first (`inline_calls`, where it sets no sharding and holds no collective and no constants),
so readiness sees the backward pass inside it. Readiness stops at an equation it cannot see
into: another call (`checkpoint`, `custom_vjp_call`, ...), a loop (a gradient summed over
iterations, a shared weight's accumulated cotangent: moving the sum would change it) or a
conditional; the collective is then ready after that whole equation, which `Ready.why` says.
``optimize(ready="written")`` keeps the written order (the placement before this module: a
control).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from libra_jax import _compat

__all__ = ["READY_MODES", "MOVES", "INLINED", "Ready", "to_ready_points", "inline_calls"]

#: `optimize(ready=...)`: "dataflow" plans each gradient collective where its operand is
#: ready; "written" where the code wrote it.
READY_MODES = ("dataflow", "written")

#: Equations that only move a value on its way to a collective (no reduction, no mixing of
#: elements): they travel with the collective to its ready point.
MOVES = frozenset({
    "convert_element_type", "reshape", "squeeze", "expand_dims", "transpose", "mul", "div",
    "neg", "copy", "copy_p", "pvary", "reduce_precision", "broadcast_in_dim",
})


#: Calls that are only a function boundary, inlined before readiness (`inline_calls`), by
#: the param holding their body.
INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
           "core_call": "call_jaxpr"}


def _has_collective(jaxpr: Any) -> bool:
    """Whether `jaxpr` (or a jaxpr inside it) holds a collective or a device map: a call
    holding one stays a scope of its own (`optimize` plans its collectives there)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if (name in _compat.PSUM_PRIMITIVES or name in _compat.OTHER_COLLECTIVES
                or name in _compat.DEVICE_MAPS or name.startswith("libra_")
                or name in (_compat.reduce_scatter_p.name, _compat.all_gather_p.name,
                            _compat.all_gather_invariant_p.name)):
            return True
        if any(_has_collective(getattr(j, "jaxpr", j))
               for j in _compat.jaxprs_in_params(eqn.params)):
            return True
    return False


def _unconstrained(params: dict) -> bool:
    """Whether a call sets no sharding or layout of its own (inlining would drop it)."""
    return all(type(v).__name__ == "UnspecifiedValue" or v is None
               for key in ("in_shardings", "out_shardings", "in_layouts", "out_layouts")
               for v in params.get(key, ()))


def inline_calls(eqns: Sequence[Any]) -> list[Any]:
    """The equations with each `INLINED` call replaced by its body's equations (recursively),
    where the call sets no sharding or layout, the body holds no collective, no constants and
    no effects, and each of its results
    is a value its own equations make, once: the call's results are then written by those
    equations, and every other variable of the body is fresh (a body may be called twice)."""
    out: list[Any] = []
    for eqn in eqns:
        closed = eqn.params.get(INLINED.get(eqn.primitive.name, ""))
        body = getattr(closed, "jaxpr", None)
        made = {v for e in body.eqns for v in e.outvars} if body is not None else set()
        if (body is None or len(getattr(closed, "consts", [])) or eqn.effects or body.effects
                or not _unconstrained(eqn.params)
                or len(set(body.outvars)) != len(body.outvars)
                or not all(_compat.is_var(v) and v in made for v in body.outvars)
                or _has_collective(body)):
            out.append(eqn)
            continue
        env: dict[Any, Any] = dict(zip(body.invars, eqn.invars))
        env.update(zip(body.outvars, eqn.outvars))
        for inner in inline_calls(body.eqns):
            invars = [env.get(v, v) if _compat.is_var(v) else v for v in inner.invars]
            outvars = []
            for v in inner.outvars:
                if v not in env:
                    env[v] = v if _compat.is_dropped(v) else _compat.new_var(v.aval)
                outvars.append(env[v])
            out.append(inner.replace(invars=invars, outvars=outvars))
    return out


@dataclasses.dataclass(frozen=True)
class Ready:
    """Where a gradient collective is ready: after the equation at `point` (in the
    reordered scope; -1: at the scope's start, its operand an input), a `producer`
    primitive; `why` says why readiness stopped there when that equation is a call, a loop
    or a conditional ("" otherwise)."""

    point: int
    producer: str
    why: str = ""
    #: The ready point as a report says it (`rewriter`'s label of the equation there).
    after: str = ""


def _why(eqn: Any) -> str:
    name = eqn.primitive.name
    if name in ("scan", "while"):
        return (f"its operand is a result of a '{name}' loop (a sum over iterations, or a "
                "value the loop carries): ready after the loop")
    if name == "cond":
        return "its operand is a result of a 'cond': ready after it"
    if _compat.jaxprs_in_params(eqn.params):
        return (f"its operand is a result of a '{name}' call, which readiness does not look "
                "into: ready after the call")
    return ""


def to_ready_points(eqns: Sequence[Any], sites: Sequence[int]
                    ) -> tuple[list[Any], list[int], dict[int, Ready]]:
    """(the equations reordered, each new position's old one, each moved collective's `Ready`
    by its new position): the collectives at positions `sites` (one operand each), each with
    the `MOVES` equations that lead to it from its operand's producer, placed right after
    that producer (module docstring). Unchanged where nothing moves."""
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars if _compat.is_var(v)}

    def defined_at(v: Any) -> int:
        return producer.get(v, -1) if _compat.is_var(v) else -1

    groups: list[tuple[int, int, list[int]]] = []  # (ready point, site, positions moved)
    for site in sorted(sites):
        chain: list[int] = []
        value = eqns[site].invars[0]
        while _compat.is_var(value) and value in producer:
            q = producer[value]
            eqn = eqns[q]
            inputs = [w for w in eqn.invars if _compat.is_var(w)]
            if (eqn.primitive.name not in MOVES or eqn.effects or len(eqn.outvars) != 1
                    or not inputs):
                break
            chain.append(q)
            value = max(inputs, key=defined_at)  # the operand it moves
        inside = {v for q in chain for v in eqns[q].outvars}
        point = max((defined_at(w) for q in chain + [site] for w in eqns[q].invars
                     if _compat.is_var(w) and w not in inside), default=-1)
        # An equation never moves later: one before the point stays (its value is defined).
        chain = [q for q in chain if q > point]
        groups.append((point, site, sorted(chain) + [site]))
    placed: dict[int, list[int]] = {}
    claimed: set[int] = set()
    for point, _, group in sorted(groups, key=lambda g: (g[0], g[1])):
        fresh = [q for q in group if q not in claimed]
        claimed.update(fresh)
        placed.setdefault(point, []).extend(fresh)
    order = list(placed.get(-1, ()))
    for i in range(len(eqns)):
        if i not in claimed:
            order.append(i)
        order.extend(placed.get(i, ()))
    new_position = {old: new for new, old in enumerate(order)}
    ready = {}
    for point, site, _ in groups:
        producer_eqn = eqns[point] if point >= 0 else None
        ready[new_position[site]] = Ready(
            new_position[point] if point >= 0 else -1,
            producer_eqn.primitive.name if producer_eqn is not None else "",
            _why(producer_eqn) if producer_eqn is not None else "")
    return [eqns[i] for i in order], order, ready
