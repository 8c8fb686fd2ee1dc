"""The roofline costs the rewrite gives the planner: the compute between a scope's collectives.

Each equation is priced at the profile's sustained rates (`model.Profile.device`): FLOPs of
matmuls and convolutions over peak FLOP/s, bytes moved by anything else over memory bandwidth;
a collective costs nothing here (the model prices it). A region XLA fuses into one kernel (an
optimizer's elementwise chain) is priced as one (`region_roofline_s`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from libra_jax import _compat
from libra_jax.rewrite.sites import aval_bytes, is_psum

__all__ = ["roofline_s", "region_roofline_s", "FREE"]

#: Equations that compile to nothing: `pvary` (``check_vma``'s cast of a replicated value to
#: varying) changes a type, not a byte. Priced at 0, so that a step costs the same whichever
#: way its collectives were written (`libra_jax.rewrite.ready`).
FREE = frozenset({"pvary"})


def roofline_s(eqn: Any, profile: Any) -> float:
    """Seconds of one equation at the profile's sustained rates: FLOPs of matmuls and
    convolutions over peak FLOP/s, bytes moved by anything else over memory bandwidth."""
    device = profile.device
    name = eqn.primitive.name
    if is_psum(eqn) or name in FREE:
        return 0.0
    subs = _compat.jaxprs_in_params(eqn.params)
    if subs:
        per_call = [sum(roofline_s(e, profile) for e in getattr(j, "jaxpr", j).eqns) for j in subs]
        if name == "cond":
            return max(per_call)
        return sum(per_call) * (eqn.params.get("length", 1) if name == "scan" else 1)
    moved = sum(aval_bytes(v.aval) for v in list(eqn.invars) + list(eqn.outvars)
                if hasattr(v.aval, "shape"))
    memory_s = moved / device.bytes_per_s()
    flops = _flops(eqn)
    return max(memory_s, flops / device.flop_per_s()) if flops else memory_s


def region_roofline_s(eqns: Sequence[Any], region: Sequence[int],
                       readers: dict[Any, list[int]], profile: Any) -> float:
    """Seconds of equations `region` run as one fused kernel at the profile's rates: it
    reads what it uses from outside once and writes what is used outside once (the sum of
    `roofline_s` over an elementwise chain counts every intermediate twice). `readers`:
    per variable, the positions of the equations that read it (past the end: an output)."""
    inside = set(region)
    defined = {v for i in region for v in eqns[i].outvars if _compat.is_var(v)}
    read = {v for i in region for v in eqns[i].invars if _compat.is_var(v) and v not in defined}
    written = {v for v in defined if any(j not in inside for j in readers.get(v, ()))}
    moved = sum(aval_bytes(v.aval) for v in read | written if hasattr(v.aval, "shape"))
    device = profile.device
    flops = sum(_flops(eqns[i]) for i in region)
    return max(moved / device.bytes_per_s(), flops / device.flop_per_s())


def _flops(eqn: Any) -> float:
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        contracted = math.prod(lhs.shape[d] for d in lhs_contract)
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs.shape) / out_features
    return 0.0
