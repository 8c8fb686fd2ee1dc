"""The roofline costs the rewrite gives the planner: the compute between a scope's collectives.

Each equation is priced at the profile's sustained rates (`model.Profile.device`): FLOPs of
matmuls and convolutions over peak FLOP/s, bytes moved by anything else over memory bandwidth;
a collective costs nothing here (the model prices it). A region XLA fuses into one kernel (an
optimizer's elementwise chain) is priced as one (`region_roofline_s`). Outside a shard_map a
program's equations are GSPMD's, at global shapes: `step_roofline_s` prices each at one
device's part of it (`device_parts`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from libra_jax import _compat
from libra_jax.rewrite.sites import aval_bytes, is_psum

__all__ = ["roofline_s", "region_roofline_s", "step_roofline_s", "device_parts", "FREE"]

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


def step_roofline_s(eqns: Sequence[Any], profile: Any) -> float:
    """Seconds of one device's compute in a program's top-level `eqns`: a shard_map's body at
    its per-device shapes (`roofline_s`), every other equation at the part of its global
    shapes one device runs (`device_parts`). Why: XLA's partitioner splits the work of a
    value laid out over the mesh (a GSPMD optimizer update of FSDP-sharded parameters runs
    on each device's shard), so its roofline at the global shape counts it once a device."""
    parts = device_parts(eqns)
    return sum(roofline_s(eqn, profile) / (1 if eqn.primitive.name == "shard_map" else
                                           max((parts.get(v, 1) for v in eqn.outvars), default=1))
               for eqn in eqns)


def device_parts(eqns: Sequence[Any]) -> dict[Any, int]:
    """Per variable of a program's top-level `eqns`, the parts XLA's partitioner splits it
    into across the devices (absent: 1, whole on each). Known where the program says so: a
    shard_map's results by its ``out_specs``, a sharding constraint's by its sharding; carried
    both ways through equations whose result has an operand's shape, as XLA's sharding
    propagation carries a layout through elementwise code (an update that reads a sharded
    gradient is sharded, and so is the scaling of a moment it adds to it). Nothing is guessed
    from a shape alone: a value no laid-out value reaches counts whole."""
    parts: dict[Any, int] = {}
    producer = {v: e for e in eqns for v in e.outvars}
    for eqn in eqns:  # the seeds, then forward
        laid = _laid_out(eqn)
        if laid is not None:
            parts.update((v, n) for v, n in zip(eqn.outvars, laid) if n > 1)
            continue
        for v in eqn.outvars:
            n = max(_alike(eqn, v, parts), default=1)
            if n > 1:
                parts[v] = n
    for eqn in reversed(eqns):  # backward: an operand computed for a sharded result of its shape
        if eqn.primitive.name == "shard_map":
            continue
        n = max((parts.get(v, 1) for v in eqn.outvars), default=1)
        if n == 1:
            continue
        for x in eqn.invars:
            source = producer.get(x) if _compat.is_var(x) else None
            if (source is not None and source.primitive.name != "shard_map"
                    and parts.get(x, 1) < n
                    and getattr(x.aval, "shape", None) == getattr(eqn.outvars[0].aval, "shape", ())):
                parts[x] = n
    return parts


def _laid_out(eqn: Any) -> list[int] | None:
    """The parts of each of `eqn`'s results where the equation lays them out (a shard_map's
    out_specs, a sharding constraint's spec); None where it does not say."""
    if eqn.primitive.name == "shard_map":
        sizes = dict(eqn.params["mesh"].shape)
        return [_spec_parts(spec, sizes) for spec in eqn.params["out_specs"]]
    if eqn.primitive.name == "sharding_constraint":
        sharding = eqn.params.get("sharding")
        spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
        if spec is not None and mesh is not None:
            return [_spec_parts(spec, dict(mesh.shape))] * len(eqn.outvars)
    return None


def _alike(eqn: Any, v: Any, parts: dict[Any, int]) -> list[int]:
    """The parts of `eqn`'s operands that have result `v`'s shape."""
    shape = getattr(v.aval, "shape", None)
    return [parts.get(x, 1) for x in eqn.invars
            if _compat.is_var(x) and getattr(x.aval, "shape", None) == shape]


def _spec_parts(spec: Any, axis_sizes: dict[str, int]) -> int:
    """The number of pieces a `PartitionSpec` cuts a value into over a mesh of `axis_sizes`."""
    n = 1
    for entry in spec if spec is not None else ():
        names = entry if isinstance(entry, tuple) else (entry,)
        for a in names:
            if a is not None:
                n *= int(axis_sizes.get(a, 1))
    return n
