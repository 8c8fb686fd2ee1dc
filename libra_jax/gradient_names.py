"""Which parameter a gradient collective updates, read from a traced step's data flow: the
names `libra_jax.explain` gives each gradient (``layer0.w``, the Cookbook's ``linear_out.kernel``
for the references it is written into) and each all-gather's parameter.

Layer 5: imports `libra_jax._compat` and `rewrite` (its report's predicted scopes); used by
`explanation` alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from libra_jax import _compat, rewrite

__all__ = ["input_names", "result_names", "shorten"]


def input_names(jaxpr: Any, paths: Sequence[str], constants: Sequence[str | None] = ()
                 ) -> dict[int, str]:
    """id(variable) -> the input path it is (a parameter, its shard inside a `shard_map`, the
    same input of a `jit` or `checkpoint` body), for naming what an all-gather gathers and
    the references a gradient is written into; `constants` names `jaxpr`'s constants."""
    out: dict[int, str] = {id(v): name for v, name in zip(jaxpr.constvars, constants)
                           if name is not None}

    def visit(j: Any, names: Sequence[str | None]) -> None:
        for v, name in zip(j.invars, names):
            if name is not None:
                out[id(v)] = name
        for eqn in j.eqns:
            known = [out.get(id(v)) if _compat.is_var(v) else None for v in eqn.invars]
            if not any(known):
                continue
            for sub in _aligned_subjaxprs(eqn):
                if len(sub.invars) >= len(eqn.invars):
                    visit(sub, known)

    visit(jaxpr, list(paths))
    return out


# --- Which parameter does a gradient psum update? ---------------------------------------------

def result_names(closed: Any, out_paths: Sequence[str], report: rewrite.OptimizeReport,
                  input_names: dict[int, str] | None = None) -> dict:
    """id(psum result var) -> the path of the output it updates.

    The result is followed through the data flow (into and out of `jit`, `shard_map`,
    `custom_jvp/vjp` and `checkpoint` bodies; conservatively through anything else) to the
    outputs of the traced function, through values of its own size only: what a reduction
    of it (a global gradient norm, read by every update) feeds is not its parameter's. A
    step that keeps its state in `jax.Ref`s (JAX's Training Cookbook) updates it in place:
    a reference the result is written into (and what is read from it after) counts as the
    input it is (`input_names`: id(variable) -> input path). The path that all the outputs and
    references it reaches with its size end with (the updated parameter and its optimizer
    state: `_common_run`) names it, else the first of them. Paths are shortened by their
    common prefix.
    """
    wanted = {id(v): v for entry in report.predicted for v in entry["results"] if v is not None}
    if not wanted:
        return {}
    out_avals = [getattr(v, "aval", None) for v in closed.jaxpr.outvars]
    input_names = input_names or {}
    found: dict[int, tuple[list[int], set[int]]] = {}

    def visit(jaxpr: Any, chain: list[tuple[Any, Any]]) -> None:
        for k, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                if id(v) in wanted:
                    refs: set[int] = set()
                    found[id(v)] = (_reach_top(jaxpr, {v}, k, chain, _size(v.aval.shape),
                                               refs), refs)
            for sub in _aligned_subjaxprs(eqn):
                visit(sub, chain + [(jaxpr, (k, eqn))])

    visit(closed.jaxpr, [])
    raw: dict[int, str] = {}
    for key, (positions, refs) in found.items():
        # Reached through values of the result's size (bias gradients may carry extra unit
        # axes; pmap outputs a leading device axis unless out_axes=None), or out of a
        # shard_map of the global array's (`_reach_top`); or the references written.
        paths = ([out_paths[i] for i in positions if out_avals[i] is not None]
                 + sorted(input_names[r] for r in refs if r in input_names))
        shared = _common_run(paths)
        if not wanted[key].aval.shape:
            # A scalar: the loss or a metric reaches an output of its own; a scalar
            # parameter's gradient reaches the parameter and its optimizer state, which
            # share its path.
            if len(paths) > 1 and shared:
                raw[key] = shared
        elif paths:
            raw[key] = shared or paths[0]
    return shorten(raw)


def _common_run(paths: Sequence[str]) -> str:
    """The longest run of path components every one of `paths` holds: a gradient reaches its
    parameter and that parameter's optimizer state, all of which hold the parameter's own
    path: at their end (``params.layer0.b``, ``opt.0.mu.layer0.b``) or before a moment's
    name (JAX's Training Cookbook's references: ``params.linear_out.kernel``,
    ``opt.linear_out.kernel.mu``). Of runs as long, the last in the first path; "" where
    they share none."""
    split = [p.split(".") for p in paths]
    if not split:
        return ""
    first, rest = split[0], split[1:]

    def held(run: list[str], path: list[str]) -> bool:
        n = len(run)
        return any(path[i:i + n] == run for i in range(len(path) - n + 1))
    for n in range(len(first), 0, -1):
        for start in range(len(first) - n, -1, -1):
            run = first[start:start + n]
            if all(held(run, p) for p in rest):
                return ".".join(run)
    return ""


def _reach_top(jaxpr: Any, seeds: set, start: int, chain: list[tuple[Any, Any]],
               size: int, refs: set[int]) -> list[int]:
    """Positions of the top-level outputs that values `seeds` of `jaxpr` reach through
    values of `size` elements (`_reach`); the references they are written into join `refs`."""
    positions = _reach(jaxpr, seeds, start, size, refs)
    for parent, (k, eqn) in reversed(chain):
        # Each output at its own size out there: a shard_map's is the global array, its
        # shards stacked (a sharded parameter's gradient shard updates that parameter).
        positions = set().union(*(_reach(parent, {eqn.outvars[i]}, k + 1,
                                         _size(eqn.outvars[i].aval.shape), refs)
                                  for i in positions if i < len(eqn.outvars)))
    return sorted(positions)


#: `jax.Ref` writes: the reference is operand 0, the value written operand 1.
_REF_WRITES = frozenset({"swap", "addupdate"})


def _reach(jaxpr: Any, seeds: set, start: int, size: int, refs: set[int] | None = None
           ) -> set[int]:
    """Positions of `jaxpr`'s outputs that `seeds` reach, from equation `start` on, through
    values whose element count is `size` (or that many per device: a pmap's leading axis).
    A reference written with a reached value is reached (what is read from it after too)
    and joins `refs`."""
    def same_size(v: Any) -> bool:
        shape = getattr(getattr(v, "aval", None), "shape", None)
        return shape is not None and size in (_size(shape), _size(shape[1:]))

    live = {id(v) for v in seeds}
    for eqn in jaxpr.eqns[start:]:
        hit = [i for i, v in enumerate(eqn.invars) if _compat.is_var(v) and id(v) in live]
        if not hit:
            continue
        if eqn.primitive.name in _REF_WRITES:
            if 1 in hit and same_size(eqn.invars[0]):
                live.add(id(eqn.invars[0]))
                if refs is not None:
                    refs.add(id(eqn.invars[0]))
            continue
        subs = _aligned_subjaxprs(eqn)
        if len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
            sub = subs[0]
            outs = _reach(sub, {sub.invars[i] for i in hit}, 0, size, refs)
        elif eqn.primitive.name == "cond" and 0 not in hit:
            # Operand i + 1 is each branch's input i; outputs align (optax.MultiSteps).
            outs = set()
            for branch in eqn.params["branches"]:
                b = getattr(branch, "jaxpr", branch)
                outs |= _reach(b, {b.invars[i - 1] for i in hit}, 0, size, refs)
        else:
            outs = set(range(len(eqn.outvars)))
        live.update(id(eqn.outvars[i]) for i in outs
                    if i < len(eqn.outvars) and same_size(eqn.outvars[i]))
    return {i for i, v in enumerate(jaxpr.outvars) if _compat.is_var(v) and id(v) in live}


def _aligned_subjaxprs(eqn: Any) -> list[Any]:
    rule = _compat.HIGHER_ORDER.get(eqn.primitive.name)
    if rule is None:
        return []
    name = rule.aligned
    if name is None:
        return [getattr(j, "jaxpr", j) for j in _compat.jaxprs_in_params(eqn.params)]
    value = eqn.params.get(name)
    if value is None:
        value = eqn.params.get("fun_jaxpr", eqn.params.get("call_jaxpr"))
    if value is None:
        return []
    return [getattr(value, "jaxpr", value)]


def _size(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def shorten(paths: dict[int, str]) -> dict[int, str]:
    """Drop the leading components all paths share (e.g. ``0.0.params.``); a path alone
    drops its leading argument indices (``0.w``: ``w``)."""
    split = {k: v.split(".") for k, v in paths.items()}
    if len(split) < 2:
        def own(v: list[str]) -> list[str]:
            while len(v) > 1 and v[0].isdigit():
                v = v[1:]
            return v
        return {k: ".".join(own(v)) for k, v in split.items()}
    common = 0
    values = list(split.values())
    while all(len(v) > common + 1 for v in values) and len({v[common] for v in values}) == 1:
        common += 1
    return {k: ".".join(v[common:]) for k, v in split.items()}
