"""The one helper that wires a libra primitive into JAX, and what every op shares.

`register_op` gives a primitive its eager implementation, abstract evaluation, optional
transpose (its JVP is then linear) and batching rule, and a lowering per platform, built by
the op's `lowering(platform)` from the platform's one rule for any collective
(`libra_jax.ops.lowering.rule`, over the kind's row):

* ``None``: every platform without its own rule (TPU, ...): XLA's all-reduce, with a notice;
* ``"cpu"``, ``"cuda"``: libra's engine and kernels, where they serve the call;
* ``"xla"``: the op's *XLA twin*, a second primitive with the same types whose one lowering
  uses XLA's collective on every platform, quietly (`optimize(collectives="xla")`, the
  control that isolates the engine from the rewrite). `XLA_TWINS` maps each op to it.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from libra_jax import _compat, collectives
from libra_jax.collectives import Collective
from libra_jax.config import notice, notice_text

__all__ = ["Platform", "PLATFORMS", "XLA_TWINS", "register_op", "warn_once", "OldName"]

#: What a lowering is built for: None (the default rule), "cpu", "cuda", or "xla" (the twin).
Platform = str | None
#: The platforms an op registers a rule of its own for (None: every other one).
PLATFORMS: tuple[Platform, ...] = (None, "cpu", "cuda")
Rule = Callable[..., Any]

#: Each libra primitive -> its XLA twin.
XLA_TWINS: dict[Any, Any] = {}


class _Primitive(_compat.Primitive):
    """A libra primitive: a ``collective`` param given by its name when bound (by hand, or by
    an old name: `OldName`) is bound as its row (`collectives.row_of`, the boundary where a
    name becomes a row), so that every equation's params hold rows."""

    def bind(self, *args: Any, **params: Any) -> Any:
        if "collective" in params:
            params["collective"] = collectives.row_of(params["collective"])
        return super().bind(*args, **params)


def _primitive(name: str, abstract_eval: Callable[..., Any], multiple_results: bool) -> Any:
    prim = _Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(functools.partial(_compat.apply_primitive, prim))
    prim.def_effectful_abstract_eval(abstract_eval)
    return prim


def register_op(name: str, *, abstract_eval: Callable[..., Any],
                lowering: Callable[[Platform], Rule], multiple_results: bool = False,
                transpose: Rule | None = None, batcher: Rule | None = None) -> Any:
    """A new primitive `name`, wired as the module docstring says, and its XLA twin.

    `abstract_eval` returns (types, effects). `transpose(ct, x, **params)` makes the primitive
    linear (JAX derives its JVP). `batcher(axis_data, vals_in, dims_in, **params)` is a
    `vmap` rule. The twin is neither differentiable nor batchable: it only ever appears in a
    rewritten program's jaxpr. A ``collective`` param bound by its name is bound as its row
    (`_Primitive.bind`).
    """
    prim = _primitive(name, abstract_eval, multiple_results)
    if transpose is not None:
        _compat.deflinear(prim, transpose)
    if batcher is not None:
        _compat.register_batcher(prim, batcher)
    for platform in PLATFORMS:
        _compat.register_lowering(prim, lowering(platform), platform=platform)
    twin = _primitive(f"{name}_xla", abstract_eval, multiple_results)
    _compat.register_lowering(twin, lowering("xla"))
    XLA_TWINS[prim] = twin
    return prim


_warned: set[str] = set()


def warn_once(notice_id: str, message: str, stacklevel: int = 4) -> None:
    """Warn with `message` (and the pointer to notice `notice_id`'s troubleshooting entry,
    `libra_jax.config.notice_text`) the first time it is said in this process, and never again:
    libra's notices come from tracing and lowering, which run again for every new program."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(notice_text(notice_id, message), stacklevel=stacklevel)


class OldName:
    """A former primitive's name, kept for a release after its kind became a param of one
    primitive for every kind (`fused.libra_bucket_p`, `start_done.libra_start_p`): `bind`
    binds `primitive` with ``collective`` and the params as the old primitive took them
    (`params` maps them), its results as the old one gave them (`results`), with a
    DeprecationWarning (notice ``primitive-renamed``)."""

    def __init__(self, name: str, primitive: Any, collective: Collective | None,
                 params: Callable[[dict], dict] = dict,
                 results: Callable[[Any], Any] = lambda out: out) -> None:
        self.name, self.primitive, self.collective = name, primitive, collective
        self._params, self._results = params, results

    def bind(self, *xs: Any, **params: Any) -> Any:
        kind = f" with collective={self.collective.lax!r}" if self.collective else ""
        notice("primitive-renamed",
               f"libra_jax.ops.{self.name}_p is {self.primitive.name}_p{kind} (its old name, "
               "kept for a release)", DeprecationWarning, stacklevel=2)
        params = self._params(params)
        if self.collective:
            params["collective"] = self.collective
        return self._results(self.primitive.bind(*xs, **params))

    def __repr__(self) -> str:
        kind = self.collective.lax if self.collective else None
        return f"OldName({self.name!r} -> {self.primitive.name}, collective={kind!r})"
