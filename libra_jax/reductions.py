"""How the route's loss and aux combine over the batch's shards (`libra_jax.value_and_grad`'s
``loss_reduce=`` and ``aux_reduce=``): each shard computes them from its own part of the batch,
and what GSPMD computes from the whole batch is, per value, a mean of the shards' values (a mean
over examples), their sum (T5X's sum over tokens, a count), or a ratio of two sums (a loss or
metric normalised by a count over the whole batch). The user says which; nothing is inferred
from the program.

Layer: imports `libra_jax._compat` and `config`; used by `data_parallel` alone.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from libra_jax import _compat, config

__all__ = ["LOSS_REDUCTIONS", "AUX_REDUCTIONS", "check_aux_reduce", "reduce_loss",
           "reduce_aux", "refuse_invariant_terms", "notice_unnormalised_sum"]

#: `value_and_grad(loss_reduce=...)`: the mean of the shards' losses (a mean over examples),
#: their sum (a sum over examples or tokens), or a loss written as the pair it divides,
#: ``(numerator, denominator)``, both summed over the shards, then divided (normalised by a
#: count over the whole batch).
LOSS_REDUCTIONS = ("mean", "sum", "ratio")

#: `value_and_grad(aux_reduce=...)`, per leaf: "auto" (float leaves averaged, others the same
#: on every shard), "sum", "mean" (`jax.lax.pmean`'s), "ratio" (a ``(numerator,
#: denominator)`` pair, both summed, then divided), None (one row per shard, stacked).
AUX_REDUCTIONS = ("auto", "sum", "mean", "ratio", None)

_WHO = "libra_jax.value_and_grad"


def _is_reduction(x: Any) -> bool:
    return x is None or isinstance(x, str)


def check_aux_reduce(aux_reduce: Any) -> Any:
    """`aux_reduce` as given: one of `AUX_REDUCTIONS`, or a pytree prefix of aux whose every
    leaf is one (a dict of them, per metric); a one-line ValueError naming the leaf else."""
    if _is_reduction(aux_reduce):
        if aux_reduce not in AUX_REDUCTIONS:
            raise ValueError(f"{_WHO}: aux_reduce must be one of "
                             f"{', '.join(map(repr, AUX_REDUCTIONS))}, got {aux_reduce!r}")
        return aux_reduce
    for path, how in jax.tree_util.tree_flatten_with_path(aux_reduce, is_leaf=_is_reduction)[0]:
        if not _is_reduction(how) or how not in AUX_REDUCTIONS:
            raise ValueError(f"{_WHO}: aux_reduce{jax.tree_util.keystr(path)} must be one of "
                             f"{', '.join(map(repr, AUX_REDUCTIONS))}, got {how!r}")
    return aux_reduce


def _float_scalar(value: Any, what: str) -> Any:
    shape, dtype = np.shape(value), jax.numpy.result_type(value)
    if shape != () or not jax.numpy.issubdtype(dtype, np.floating):
        raise TypeError(f"{_WHO}: {what} must be a float scalar (as for jax.value_and_grad), "
                        f"got {dtype}{list(shape)}")
    return value


def _summed(value: Any, axes: tuple) -> Any:
    """`value` summed over `axes`, made varying over them first where it is the same on every
    shard (under check_vma a psum of an invariant value is refused or scaled by JAX)."""
    value = jax.numpy.asarray(value)
    missing = tuple(a for a in axes if a not in _compat.varying_axes(jax.typeof(value)))
    if missing and _compat.check_vma_enabled():
        value = _compat.pvary(value, missing)
    return jax.lax.psum(value, axes)


def _ratio(pair: Any, axes: tuple, what: str) -> Any:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise TypeError(f"{_WHO}: {what} must be a pair (numerator, denominator), both summed "
                        f"over the batch's shards, then divided; got {type(pair).__name__}")
    numerator, denominator = pair
    return _summed(numerator, axes) / _summed(denominator, axes)


def reduce_loss(loss: Any, axes: tuple, how: str) -> Any:
    """The per-shard `loss` combined over `axes` as `how` (`LOSS_REDUCTIONS`) says."""
    if how == "ratio":
        numerator, denominator = loss if isinstance(loss, (tuple, list)) and len(loss) == 2 \
            else (None, None)
        if numerator is None:
            raise TypeError(f"{_WHO}: with loss_reduce='ratio' the loss must return a pair "
                            "(numerator, denominator), both summed over the batch's shards, "
                            f"then divided; got {type(loss).__name__}")
        _float_scalar(numerator, "the loss's numerator")
        _float_scalar(denominator, "the loss's denominator")
        return _ratio(loss, axes, "the loss")
    _float_scalar(loss, "the loss")
    return jax.lax.psum(loss, axes) if how == "sum" else jax.lax.pmean(loss, axes)


def reduce_aux(aux: Any, axes: tuple, how: Any) -> Any:
    """`aux` made the same on every shard as `how` says: one reduction for every leaf, or a
    pytree prefix of them (`check_aux_reduce`), each applied to its subtree ("ratio": to a
    pair)."""
    if _is_reduction(how):
        return _reduce_subtree((), aux, axes, how)
    flat, tree = jax.tree_util.tree_flatten_with_path(how, is_leaf=_is_reduction)
    subtrees = tree.flatten_up_to(aux)  # type: ignore[attr-defined]
    return jax.tree.unflatten(tree, [_reduce_subtree(path, sub, axes, h)
                                     for (path, h), sub in zip(flat, subtrees)])


def _reduce_subtree(prefix: tuple, tree: Any, axes: tuple, how: str | None) -> Any:
    if how == "ratio":
        return _ratio(tree, axes, f"aux{jax.tree_util.keystr(prefix)} (aux_reduce='ratio')")
    return jax.tree_util.tree_map_with_path(
        lambda p, v: _reduce_leaf((*prefix, *p), v, axes, how), tree)


def _reduce_leaf(path: Any, value: Any, axes: tuple, how: str | None) -> Any:
    """An aux leaf made the same on every shard as `how` says."""
    if how == "auto":
        return _mean_aux(path, value, axes)
    if how == "sum":
        return _summed(value, axes)
    value = jax.numpy.asarray(value)
    missing = tuple(a for a in axes if a not in _compat.varying_axes(jax.typeof(value)))
    if missing and _compat.check_vma_enabled():
        value = _compat.pvary(value, missing)  # the same on those shards: varying for the mean
    if how == "mean":
        return jax.lax.pmean(value, axes)
    # None: one row per shard, the same stack on every shard (the shard_map's P() output).
    return _compat.all_gather_invariant(value, axes)


def _mean_aux(path: Any, value: Any, axes: tuple) -> Any:
    """An aux leaf, the same on every shard: averaged over `axes` where it differs (a float),
    else as it is (averaging the same value would round it, on a mesh of other than a power
    of two devices)."""
    value = jax.numpy.asarray(value)
    varying = set(axes) & _compat.varying_axes(jax.typeof(value))
    if varying and jax.numpy.issubdtype(value.dtype, np.inexact):
        return jax.lax.pmean(value, axes)
    if varying:
        raise TypeError(
            f"{_WHO}: aux{jax.tree_util.keystr(path)} is a {value.dtype} that "
            f"differs from shard to shard (it varies over {sorted(varying)}); by default float "
            "aux is averaged over the batch's shards and other aux must be the same on every "
            "shard: pass aux_reduce='sum' (a count over the whole batch), 'mean', None (one "
            "value per shard), or one per leaf")
    return value


#: Primitives through which a term of the loss reaches it additively (`refuse_invariant_terms`).
_ADDITIVE = {"add", "sub", "add_any", "neg", "convert_element_type", "copy", "copy_p",
             "reduce_precision",
             # JAX's casts of an invariant term to varying, inserted where it meets one
             "pvary", "pbroadcast"}
_SCALING = {"mul", "div"}


def refuse_invariant_terms(closed: Any, axes: tuple) -> None:
    """Under ``loss_reduce="sum"``: refuse a loss (the jaxpr `closed` of the per-shard loss,
    its first output) to which a term that is the same on every shard is added (a weight
    penalty, a constant): the sum over the shards would count it once per shard, where
    GSPMD's loss counts it once. Read from the types (varying axes) of the terms that reach
    the output through additions; a factor of a product is not a term."""
    producers = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
    batch = set(axes)
    stack: list[Any] = [closed.jaxpr.outvars[0]]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if not _compat.is_var(v):
            value = np.asarray(getattr(v, "val", 0))
            if value.size and np.any(value != 0):
                raise ValueError(_invariant_refusal("a constant"))
            continue
        if not batch <= _compat.varying_axes(v.aval):
            raise ValueError(_invariant_refusal(f"a {v.aval.str_short()}"))
        eqn = producers.get(v)
        if eqn is None:
            continue
        name = eqn.primitive.name
        if name in _ADDITIVE:
            stack.extend(eqn.invars)
        elif name in _SCALING:
            stack.extend(x for x in eqn.invars[:1 if name == "div" else 2]
                         if _compat.is_var(x) and batch <= _compat.varying_axes(x.aval))


def _invariant_refusal(term: str) -> str:
    return (f"{_WHO}: with loss_reduce='sum' the loss adds a term that is the same on every "
            f"shard ({term}: a weight penalty, a constant), which the sum over the shards "
            "would count once per shard; add it outside the route (to the value, and its "
            "gradient to the gradients), or divide it by the shard count")


#: Primitives that carry a value on at its scale: a cast, a reshape (`notice_unnormalised_sum`).
_SAME_SCALE = {"reshape", "squeeze"}


def notice_unnormalised_sum(closed: Any, axes: tuple, shards: int) -> None:
    """Under the default ``loss_reduce``: say where the loss (the jaxpr `closed` of the
    per-shard loss, its first output) is a sum over its shard's examples, a ``reduce_sum`` of
    a value that varies over the batch's `axes` reaching the output through additions and
    casts only: the mean of the shards' sums is 1/`shards` of GSPMD's loss over the whole
    batch, and so is every gradient (T5X's default loss). Read from the program's structure
    (a division or a product after the sum is a normaliser: no notice), never from its
    literals; the reduction itself stays the user's to say."""
    producers = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
    batch = set(axes)
    stack: list[Any] = [closed.jaxpr.outvars[0]]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if id(v) in seen or not _compat.is_var(v):
            continue
        seen.add(id(v))
        eqn = producers.get(v)
        if eqn is None:
            continue
        name = eqn.primitive.name
        if name == "reduce_sum":
            operand = eqn.invars[0]
            if (_compat.is_var(operand) and operand.aval.ndim
                    and batch <= _compat.varying_axes(operand.aval)):
                config.notice(
                    "loss-is-a-sum",
                    f"{_WHO}: the loss is a sum over its shard's examples, and the default "
                    "loss_reduce averages the shards' losses: the value and every gradient "
                    f"are 1/{shards} of the loss's over the whole batch. Pass "
                    "loss_reduce='sum' for a sum over the batch (T5X's default), 'ratio' "
                    "with the pair (numerator, denominator) for one normalised by a count "
                    "over the whole batch, or 'mean' to say the mean of the shards' sums is "
                    "meant")
                return
        elif name in _ADDITIVE or name in _SAME_SCALE:
            stack.extend(eqn.invars)
