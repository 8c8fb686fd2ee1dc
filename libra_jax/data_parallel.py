"""`libra_jax.value_and_grad`: a data-parallel gradient that `optimize` can plan, for GSPMD code.

In a GSPMD step (`jax.jit` over `NamedSharding` inputs, no psum) XLA's partitioner inserts the
gradient all-reduces after tracing, where `optimize` cannot see them. This module's
`value_and_grad(loss_fn, axis_name="data")` computes the same gradient with the all-reduces in
the traced program: it takes `jax.value_and_grad` *outside* a `jax.shard_map` of the
`pmean`ed loss, with the differentiated arguments replicated (``P()``) and the others split
along their leading (batch) dimension (``P(axis_name)``). Autodiff's transpose then sums each
replicated parameter's cotangent over the axis (the psums of `check_vma`): those are the
gradient all-reduces `optimize` plans. (Taking the gradient inside the shard_map and then
`pmean`ing it is wrong under `check_vma`: the gradient is already summed, and the pmean would
scale it again.)

Contract (what the tests check, tests/test_data_parallel.py and tests/test_loss_inputs.py):

- Under `jax.jit`, the value, gradients and a mean metric in `aux` agree with those of
  ``jax.jit(jax.value_and_grad(loss_fn))`` on the same sharded inputs within class 3's
  bound (`libra_jax.testing`: two programs, which XLA compiles differently on each CPU), for
  a loss that is a mean over the batch's examples (each shard's mean, averaged).
- Differentiated arguments are replicated, or sharded over the batch's axes (FSDP, ZeRO-3:
  MaxText's ``fsdp`` axis): a sharded one enters the shard_map as its shards and the loss
  reads it all-gathered (`_gather_sharded`; `optimize` moves each all-gather to its first use
  and issues it as `optimize(prefetch=)` plans); its gradient is the all-gather's transpose,
  a reduce-scatter, and leaves with the parameter's sharding. Its sharding must be visible
  (a concrete array's, an explicit-sharding mesh's traced value's, or ``in_specs``): under
  `jax.jit` on an auto-sharding mesh a traced value carries none, and it is treated as
  replicated (XLA all-gathers it before the shard_map). Sharding the route cannot serve is
  refused with the leaf and the axis named (`_check_parameters`): over a mesh axis the batch
  is not split over (tensor parallelism: keep `jax.value_and_grad`), or a dimension that does
  not divide by its axes' devices. A layout over mesh axes of one device each is replicated
  (a ``model`` axis of 1); the gradients come back laid out as their parameters.
- A Flax NNX object (a model, `Rngs`) passed as an argument of its own is taken as
  `nnx.value_and_grad` takes it: differentiated, its gradient is the `nnx.State` of its
  `nnx.Param`s; its other state is written back after the loss (`NnxObjects`).
- Calls in the loss that lay arrays out over mesh axes, which JAX refuses where every axis is
  manual, change no value: those looked up at each call (`jax.lax.with_sharding_constraint`,
  so Flax's `with_logical_constraint`; `jax.sharding.reshard`, `auto_axes`, `explicit_axes`,
  so `nnx.Embed`'s ``out_sharding=``) are left out while the route traces the loss
  (`_layouts_dropped`: each wrapped once, gated by a context variable, so that no other thread
  sees the route's behaviour); the others (an ``out_sharding=`` argument of a `jax.numpy` function,
  checked inside JAX) are refused by name, with the ways out (`_SHARDING_CALLS`).
- Other arguments are split along their leading dimension (it must divide by the axis's
  size) where no layout says otherwise (`_followed_layout`: a visible replicated layout
  enters whole, one split over the batch's axes along the leading dimension is split, any
  other is refused asking for ``in_specs``); 0-d leaves (scalars, a typed PRNG key) are
  replicated; leaves that are not arrays (a model module, a config) and arguments whose
  ``in_specs`` entry is None are passed as they are (`loss_inputs.NonArrays`). Arrays the
  loss closes over enter whole, as GSPMD reads them (`loss_inputs.Closure`; split as the
  batch only with ``split_closed_over=True``). Nothing is split by guess. ``in_specs``
  overrides the rule, one spec (or pytree of specs) per positional argument, as in
  `jax.shard_map`. Called eagerly, the compiled program is keyed by the closure's values
  too (`Closure.key`): none outlives what it was traced with. On an
  explicit-sharding mesh, inputs whose sharding differs from their spec are resharded
  (`jax.reshard`), as the auto-sharding partitioner would do.
- The shard_map is manual over every mesh axis: on a 2-D mesh (``data`` x ``model``) with
  parameters replicated or sharded over ``data`` each ``model`` shard computes its ``data``
  shard's loss, as GSPMD does there, and the gradient collectives are Libra's.
- Semantics that change from GSPMD's global batch (documented in docs/gspmd.md, not detected):
  anything that couples examples across the batch sees one shard only: batch-norm statistics
  are per shard, an in-batch contrastive loss has per-shard negatives, a token-weighted
  loss with padding becomes a mean of shard means (not the global token mean); a PRNG key
  argument is replicated, so dropout draws the same mask on every shard (fold
  ``jax.lax.axis_index(axis_name)`` into it for distinct masks: the bits still differ
  from GSPMD's).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from libra_jax import _compat, config, reductions
from libra_jax.loss_inputs import (
    Closure,
    EqxModules,
    NnxObjects,
    NonArrays,
    resizing_named_arrays,
    shown_layout,
    spec_axes,
)

__all__ = ["value_and_grad", "grad"]


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, *, axis_name: str | Sequence[str] = "data",
                   mesh: Any = None, in_specs: Any = None,
                   aux_reduce: Any = "auto", loss_reduce: str | None = None,
                   split_closed_over: bool = False) -> Callable[..., Any]:
    """`jax.value_and_grad` of a data-parallel loss, with its all-reduces where `optimize` sees them.

    Use it in place of `jax.value_and_grad` in a GSPMD train step; then
    ``jax.jit(libra_jax.optimize(step))`` plans the gradient all-reduces (the module docstring
    states the contract).

    Args:
      fun: the per-batch loss, as for `jax.value_and_grad`: a scalar float (and aux, with
        `has_aux`) computed from the batch it is given; here it sees one shard of the batch.
      argnums: as in `jax.value_and_grad`. The differentiated arguments are replicated over
        the mesh or sharded over `axis_name`'s axes (FSDP: gathered for the loss, their
        gradients reduce-scattered); a Flax NNX model among them is differentiated with
        respect to its `nnx.Param` state, as by `nnx.value_and_grad`.
      has_aux: as in `jax.value_and_grad`.
      axis_name: the mesh axis (or axes) the batch is split over. Axes of one device are
        left out of every collective the route makes (they move no data), so naming all of
        a framework's batch axes, as MaxText's rules do, plans what naming the others would.
      mesh: the `jax.sharding.Mesh`; default: the context mesh (`jax.set_mesh`), else the
        mesh of the inputs' `NamedSharding`.
      in_specs: per positional argument, its `PartitionSpec` (or a pytree prefix of them);
        default: for the differentiated arguments, each leaf's visible sharding (``P()``
        where none shows), ``P(axis_name)`` for the other leaves, ``P()`` for 0-d ones.
      aux_reduce: what becomes of aux's leaves, which each shard computes from its own part of
        the batch: ``"auto"`` (default) averages float leaves over the axis and requires the
        others to be the same on every shard (an integer that differs is refused, naming this
        option); ``"sum"`` sums every leaf over the shards (a token count); ``"mean"``
        averages every leaf as `jax.lax.pmean` does: an integer's mean is a float of the
        default float dtype, no integer division (int32 counts summing to 37 over 8 shards:
        float32 4.625); ``"ratio"`` takes a leaf that is a pair (numerator, denominator),
        sums both over the shards and divides (an accuracy over the whole batch's real
        tokens); ``None`` stacks them, one row per shard (a leading axis of the shard count).
        Or a pytree prefix of aux with one of these per subtree, as clu-style metrics need
        (``{"loss_sum": "sum", "tokens": "sum", "accuracy": "ratio"}``).
      loss_reduce: how the shards' losses make the value GSPMD computes from the whole
        batch: ``"mean"`` (a loss that is a mean over examples; the default, None, is the
        mean, with a notice where the loss is a sum over the shard's examples, as no mean
        is), ``"sum"`` (a sum
        over examples or tokens, T5X's default: the mean would be 1/shards of it, and so
        would every gradient; a term added to the loss that is the same on every shard, a
        weight penalty, is refused, as the sum would count it once per shard), or
        ``"ratio"``: the loss returns the pair it divides, ``(numerator, denominator)``, both
        summed over the shards, then divided (a loss normalised by the whole batch's real-token
        count). Never inferred from the program.
      split_closed_over: whether an array the loss closes over that is laid out over
        `axis_name`'s axes along its leading dimension is split as the batch (as JAX's
        Training Cookbook's loss reads the step's batch from its scope). Default False: every
        closed-over array enters whole, as GSPMD reads it (a sharded one is gathered for the
        loss); the route never takes an array for the batch by its layout alone.

    Returns:
      A function of `fun`'s arguments returning ``(value, grads)`` (``((value, aux), grads)``
      with `has_aux`). The value is the loss combined over the axis as `loss_reduce` says;
      aux as `aux_reduce` says. Keyword arguments are passed to `fun` whole, on every shard.
    """
    aux_reduce = reductions.check_aux_reduce(aux_reduce)
    read_sum = loss_reduce is None  # the default: the mean, said where the loss is a sum
    loss_reduce = config.choice_option("mean" if read_sum else loss_reduce,
                                       reductions.LOSS_REDUCTIONS, "loss_reduce",
                                       "libra_jax.value_and_grad")
    argnums = _check_argnums(argnums)
    split_closed_over = config.bool_option(split_closed_over, "split_closed_over",
                                           "libra_jax.value_and_grad")
    axes_named = ((axis_name,) if isinstance(axis_name, str) else
                  tuple(axis_name) if isinstance(axis_name, (tuple, list)) else ())
    if not axes_named or not all(isinstance(a, str) for a in axes_named):
        raise TypeError(f"libra_jax.value_and_grad: axis_name must be a mesh axis name or a "
                        f"sequence of them, got {axis_name!r}")
    jitted: dict[Any, Callable[..., Any]] = {}

    def route(*args: Any, **kwargs: Any) -> Any:
        nums = (argnums,) if isinstance(argnums, int) else argnums
        if any(not -len(args) <= i < len(args) for i in nums):
            raise TypeError(f"libra_jax.value_and_grad: argnums {argnums} but only "
                            f"{len(args)} positional arguments")
        argnums_t = tuple(i % len(args) for i in nums)  # negative ones count from the end
        manual = set(jax.sharding.get_abstract_mesh().manual_axes)
        if manual & set(axes_named):
            raise ValueError(
                f"libra_jax.value_and_grad: called where {sorted(manual & set(axes_named))} "
                "are already mapped (inside another route's loss, or a shard_map over them): "
                "the loss there sees one shard, and the route would split it again; use "
                "jax.value_and_grad there (and jax.lax.pmean over the axes), or one route")
        objects = NnxObjects.of(args, argnums_t)
        n_args = len(args)
        the_mesh = _mesh(mesh, args)
        missing = [a for a in axes_named if a not in the_mesh.axis_names]
        if missing:
            raise ValueError(f"libra_jax.value_and_grad: axis_name {missing[0]!r} is not an axis "
                             f"of the mesh {dict(the_mesh.shape)}")
        axes = _moving_axes(axes_named, the_mesh)
        closure = Closure.of(fun, axes, the_mesh, split_closed_over)
        closure.notice_whole(axes)
        modules = EqxModules.of(args, argnums_t)
        args = modules.values(objects.values(args))
        non_arrays, args, given_specs = NonArrays.of(args, argnums_t, in_specs,
                                                     len(modules.where))
        specs = _specs(args[:n_args], argnums_t, axes, the_mesh, given_specs)
        # The NNX objects' other state, the Equinox modules' static part: replicated.
        specs += (P(),) * (len(args) - n_args)
        _check_parameters(args, argnums_t, specs, the_mesh, axes)
        closure.notice_unsplit(axes, _splits_batch(
            [s for i, s in enumerate(specs[:n_args]) if i not in argnums_t] + closure.specs))
        # The arrays the loss closes over that the shard_map takes (`Closure`): last.
        args, specs = args + tuple(closure.hoisted), specs + tuple(closure.specs)
        loss_fn = closure.taking(lambda f: non_arrays.restoring(modules.merging(
            objects.merging(f, has_aux) if objects else f)))
        aux = has_aux or bool(objects)

        def run(*args: Any) -> Any:
            local = _local_loss(_gather_sharded(resizing_named_arrays(loss_fn), argnums_t, args,
                                                specs),
                                kwargs, aux, axes, aux_reduce, nnx_state=bool(objects),
                                inputs=_whole_and_split(args, specs, argnums_t, n_args,
                                                        closure.names, axes),
                                loss_reduce=loss_reduce, read_sum=read_sum,
                                shards=math.prod(the_mesh.shape[a] for a in axes))
            mapped = jax.shard_map(local, mesh=the_mesh, in_specs=specs, out_specs=P())

            def loss(*args: Any) -> Any:
                # Resharded inside the differentiated function: autodiff reshards each
                # gradient back, so it is laid out as its parameter (as jax.grad's are).
                return mapped(*(_reshard(a, s, the_mesh) for a, s in zip(args, specs)))
            # Layout calls left out for the whole trace: the loss's own, and those traced
            # while autodiff transposes it (a custom_vjp's backward rule).
            with _layouts_dropped():
                return jax.value_and_grad(
                    loss, argnums_t[0] if isinstance(argnums, int) else argnums_t, aux)(*args)

        if any(isinstance(leaf, _compat.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
            out = run(*args)  # already traced (under jit, grad...): the caller compiles it
        else:
            # Eagerly: one compiled program (an explicit-sharding mesh needs jit for its
            # scalars), kept per mesh, argument structure (NNX graphs included), specs and
            # keyword values; with a keyword value that cannot key a cache (an array),
            # compiled for this call alone.
            # The closure's values that are not inputs (a number, a function) key it too
            # (`Closure.key`), so that no program outlives what it was traced with.
            key = (the_mesh, jax.tree.structure(args), objects.graphs, tuple(jax.tree.leaves(
                specs, is_leaf=lambda s: isinstance(s, P))), non_arrays.key(), closure.key(),
                _hashable(kwargs))
            if None in key[-3:]:
                out = jax.jit(run)(*args)
            else:
                if key not in jitted:
                    jitted[key] = jax.jit(run)
                out = jitted[key](*args)
        return objects.write_back(out, has_aux) if objects else out

    route.__name__ = f"value_and_grad({getattr(fun, '__name__', 'fun')})"
    route.__doc__ = fun.__doc__
    return route


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
         axis_name: str | Sequence[str] = "data", mesh: Any = None,
         in_specs: Any = None, aux_reduce: Any = "auto", loss_reduce: str | None = None,
         split_closed_over: bool = False) -> Callable[..., Any]:
    """`jax.grad` of a data-parallel loss: `value_and_grad` without the value (``(grads, aux)``
    with `has_aux`, as `jax.grad` returns)."""
    both = value_and_grad(fun, argnums, has_aux, axis_name=axis_name, mesh=mesh,
                          in_specs=in_specs, aux_reduce=aux_reduce, loss_reduce=loss_reduce,
                          split_closed_over=split_closed_over)

    def gradient(*args: Any, **kwargs: Any) -> Any:
        value, grads = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    gradient.__name__ = f"grad({getattr(fun, '__name__', 'fun')})"
    return gradient


# --- The pieces -----------------------------------------------------------------------

def _check_argnums(argnums: Any) -> int | tuple[int, ...]:
    """`argnums` as `jax.value_and_grad` takes it (an int, NumPy's included, negative ones
    counting from the last argument, or a sequence of them), as Python ints; TypeError else."""
    def is_int(n: Any) -> bool:
        return isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_))
    if is_int(argnums):
        return int(argnums)
    nums = tuple(argnums) if isinstance(argnums, (tuple, list)) else ()
    if not nums or not all(is_int(n) for n in nums):
        raise TypeError(f"libra_jax.value_and_grad: argnums must be an int or a sequence of "
                        f"ints, got {argnums!r}")
    return tuple(int(n) for n in nums)


def _describe(value: Any) -> str:
    """A value's type in an error: ``float32[]``, ``tuple of 3``, ``dict``."""
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{value.dtype}{list(value.shape)}"
    return f"a {type(value).__name__}"


def _moving_axes(axes: tuple, mesh: Any) -> tuple:
    """The batch axes the route's collectives run over: those of `axes` with more than one
    device. An axis of one device moves no data (MaxText names ('data', 'fsdp', 'sequence',
    ...) as the batch's axes, all but ``fsdp`` of one device on one slice): left out, the
    route gathers, reduce-scatters and averages over the others alone, and its plan is the
    plan of those axes. Every axis where none has more than one device (one device: the
    collectives move nothing either way)."""
    sizes = dict(mesh.shape)
    moving = tuple(a for a in axes if sizes[a] > 1)
    return moving or axes


def _local_loss(fun: Callable[..., Any], kwargs: dict, has_aux: bool, axes: tuple,
                aux_reduce: Any = "auto", nnx_state: bool = False,
                inputs: str = "", loss_reduce: str = "mean", read_sum: bool = False,
                shards: int = 1) -> Callable[..., Any]:
    """The per-shard loss, combined over `axes` as `loss_reduce` says (`reductions`): the
    function the shard_map maps; with `read_sum` (the default reduction), a notice where the
    loss is a sum over the shard's examples (of `shards`). `inputs`
    (`_whole_and_split`): which non-differentiated arrays entered whole and which split,
    said where the loss fails on them (JAX's broadcasting error names neither)."""
    def local(*args: Any) -> Any:
        try:
            out = fun(*args, **kwargs)
        except (NotImplementedError, ValueError) as e:
            refusal = _sharding_call_refusal(e) or _closure_refusal(e)
            if refusal is None:
                if inputs:
                    raise ValueError(_failed_on_shards(e, inputs)) from e
                raise
            raise ValueError(refusal) from e
        except TypeError as e:
            if inputs:
                raise ValueError(_failed_on_shards(e, inputs)) from e
            raise
        if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError("libra_jax.value_and_grad: with has_aux=True the loss function must "
                            "return a pair (loss, aux), as for jax.value_and_grad; got "
                            f"{_describe(out)}")
        if not has_aux and loss_reduce != "ratio" and isinstance(out, (tuple, list)):
            raise TypeError("libra_jax.value_and_grad: the loss function returned a "
                            f"{type(out).__name__} of {len(out)}; if it is (loss, aux), pass "
                            "has_aux=True, as for jax.value_and_grad")
        loss, aux = out if has_aux else (out, None)
        if loss_reduce == "sum" or read_sum:
            # Read from the loss's own jaxpr: a second trace of it, under "sum" and the
            # default (an explicit "mean" skips it).
            closed = jax.make_jaxpr(
                lambda *a: fun(*a, **kwargs)[0] if has_aux else fun(*a, **kwargs))(*args)
            if read_sum:
                reductions.notice_unnormalised_sum(closed, axes, shards)
            else:
                reductions.refuse_invariant_terms(closed, axes)
        loss = reductions.reduce_loss(loss, axes, loss_reduce)
        if not has_aux:
            return loss
        if nnx_state:  # (the loss's aux, the NNX objects' other state: "auto"'s rule)
            user, state = out[1]
            return loss, (reductions.reduce_aux(user, axes, aux_reduce),
                          reductions.reduce_aux(state, axes, "auto"))
        return loss, reductions.reduce_aux(aux, axes, aux_reduce)
    return local


def _whole_and_split(args: tuple, specs: tuple, argnums: tuple, n_args: int,
                     closed: Sequence[str], axes: tuple) -> str:
    """Where the loss's non-differentiated arrays (arguments and closed-over values) are some
    whole and some split over `axes`, each named with its global type and how it entered;
    else "" (nothing to mix up)."""
    whole: list[str] = []
    split: list[str] = []
    first_closed = len(args) - len(closed)  # the hoisted closed-over values come last
    for i, (arg, spec_tree) in enumerate(zip(args, specs)):
        if i in argnums or n_args <= i < first_closed:  # (an NNX object's other state)
            continue
        name = f"argument {i}" if i < n_args else f"the closed-over {closed[i - first_closed]}"
        for path, leaf, spec in _leaf_specs(arg, spec_tree):
            if not hasattr(leaf, "shape") or np.ndim(leaf) == 0:
                continue
            what = f"{name}{jax.tree_util.keystr(path)} {np.dtype(leaf.dtype).name}{list(leaf.shape)}"
            (split if any(spec_axes(e) for e in spec) else whole).append(what)
    if not whole or not split:
        return ""
    return (f"split over {list(axes)}: {', '.join(split[:4])}; whole on every shard (a layout "
            f"that is replicated, or a closed-over value): {', '.join(whole[:4])}")


def _failed_on_shards(error: Exception, inputs: str) -> str:
    """The route's error for a loss that failed on its shard's inputs, mixed (`inputs`)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"libra_jax.value_and_grad: the loss failed on one shard's inputs ({first}); "
            f"{inputs}. If a whole one is batch, place it as the batch is (split along its "
            "leading dimension), or give in_specs")


def _every_axis_manual() -> bool:
    """Whether the context's mesh has axes and every one is manual (the route's shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and set(mesh.manual_axes) == set(mesh.axis_names)


#: Whether this thread (this context) is tracing a route's loss: the layout calls
#: (`_LAYOUT_CALLS`) defer to JAX's functions everywhere else, other threads included.
_DROPPING_LAYOUTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "libra_jax_layouts_dropped", default=False)


def _dropping() -> bool:
    """Whether a layout call made now is the route's to leave out: in this context's trace
    of a route's loss, where every axis is manual (its shard_map)."""
    return _DROPPING_LAYOUTS.get() and _every_axis_manual()


def _returning_operand(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dropped(x: Any, *args: Any, **kwargs: Any) -> Any:
        return x if _dropping() else original(x, *args, **kwargs)
    return dropped


def _calling_directly(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dropped(f: Any = None, /, **kwargs: Any) -> Any:
        if not _dropping():
            return original(f, **kwargs)
        return (lambda g: g) if f is None else f
    return dropped


#: Calls that lay arrays out over mesh axes that the route serves by leaving the layout out while
#: it traces the loss (`_layouts_dropped`): where every axis is manual (the route's shard_map)
#: each device computes its own shard's loss, there is nothing to lay out, and none of them
#: changes a value. (module, attribute, the replacement made from JAX's function.) They are the
#: attributes looked up at each call (`jax.lax.with_sharding_constraint`, which Flax's
#: `with_logical_constraint` calls; `jax.sharding.auto_axes`, which `nnx.Embed` calls with
#: ``out_sharding=``); an ``out_sharding=`` argument of a `jax.numpy` function is checked
#: inside JAX, out of reach, and stays refused (`_SHARDING_CALLS`).
_LAYOUT_CALLS = (
    (jax.lax, "with_sharding_constraint", _returning_operand),
    (jax.sharding, "reshard", _returning_operand),
    (jax.sharding, "auto_axes", _calling_directly),
    (jax.sharding, "explicit_axes", _calling_directly),
)
_layout_calls_lock = threading.Lock()


def _install_layout_calls() -> None:
    """Each of `_LAYOUT_CALLS` wrapped once, for good: the wrapper is JAX's function (its
    name, signature and docstring) except within a route's trace in the calling context
    (`_DROPPING_LAYOUTS`, a context variable: per thread, so that another thread tracing
    meanwhile, a route's or not, gets JAX's own behaviour). Nothing is swapped per trace:
    a swap and its restore were process-wide, and two threads' swaps interleaved."""
    with _layout_calls_lock:
        for module, name, replacement in _LAYOUT_CALLS:
            original = getattr(module, name, None)
            if original is None or getattr(original, "__libra_original__", None) is not None:
                continue
            new = replacement(original)
            new.__libra_original__ = original  # type: ignore[attr-defined]
            setattr(module, name, new)


@contextlib.contextmanager
def _layouts_dropped() -> Iterator[None]:
    """`_LAYOUT_CALLS` left out in this context for the duration (the route's trace of the
    loss and of its gradient); a nested route keeps the outer route's."""
    _install_layout_calls()
    token = _DROPPING_LAYOUTS.set(True)
    try:
        yield
    finally:
        _DROPPING_LAYOUTS.reset(token)


#: JAX's errors for a call that lays arrays out over mesh axes, made inside a region where every
#: axis is manual (the route's shard_map), and what to do instead: (pattern, the call, remedy).
_SHARDING_CALLS = (
    (r"Going from `?Manual`? AxisType",
     "jax.sharding.auto_axes or explicit_axes (as nnx.Embed does with out_sharding=)",
     "call the function it wraps directly (nnx.Embed: without out_sharding=)"),
    (r"PartitionSpec passed to (\S+) cannot contain axis names that are of type .*Manual",
     "{0} with a sharding (an out_sharding= argument, or jax.sharding.reshard)",
     "drop that sharding (the out_sharding= argument, the reshard)"),
    (r"passed to with_sharding_constraint can only refer to Auto axes",
     "jax.lax.with_sharding_constraint", "drop the constraint"),
)


def _sharding_call_refusal(error: Exception) -> str | None:
    """The route's error for JAX's `error`, when it is one of `_SHARDING_CALLS` (else None):
    it names the call, where the loss makes it, and the ways out."""
    import os
    import re
    import traceback

    found = next(((m, call, remedy) for pattern, call, remedy in _SHARDING_CALLS
                  if (m := re.search(pattern, str(error)))), None)
    if found is None:
        return None
    match, call, remedy = found
    # Where: the innermost frame outside jax (the loss, or a library's layer such as
    # nnx.Embed) and, if it is not the loss's own, the loss's line that leads there.
    jax_dir = os.path.dirname(jax.__file__) + os.sep
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(jax_dir) and f.filename != __file__]

    def at(frame: traceback.FrameSummary) -> str:
        return f"{frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"
    where = f" at {at(frames[-1])}" if frames else ""
    if len(frames) > 1:
        where += f", reached from the loss at {at(frames[0])}"
    return (f"libra_jax.value_and_grad: the loss calls {call.format(*match.groups())}{where}. "
            "In the route's shard_map every mesh axis is manual (each device computes the loss "
            "of its own batch shard, so there is nothing to lay out) and JAX refuses calls that "
            f"lay arrays out over mesh axes there. Either {remedy} in the loss (code shared "
            "with a GSPMD step can skip it where jax.sharding.get_abstract_mesh().manual_axes "
            "is not empty), or keep jax.value_and_grad for this step: its gradient all-reduces "
            "then stay XLA's, which optimize does not plan")


def _closure_refusal(error: Exception) -> str | None:
    """The route's error for JAX's refusal of a value closed over on an explicit mesh that
    `Closure` could not reach (else None)."""
    import re
    if "Closing over inputs to shard_map" not in str(error):
        return None
    shape = re.search(r"Got input with shape ([^\s(]+)", str(error))
    return ("libra_jax.value_and_grad: the loss reads an array of an explicit-sharding mesh"
            f"{' (' + shape.group(1) + ')' if shape else ''} that is neither its argument nor in "
            "its own closure (a global, an object's attribute, or a function it calls closes "
            "over it), and JAX takes no such value into the route's shard_map: pass it to the "
            "loss as an argument (an array is split along its leading dimension as the batch; "
            "in_specs says otherwise), or close over it in the loss itself")


def _mesh(mesh: Any, args: tuple) -> Any:
    """The mesh to map over: the argument, the context's (`jax.set_mesh`), or the inputs'.
    A concrete mesh (with devices) is preferred to an abstract one: libra's NCCL path needs
    the devices to make its communicators, and under `jax.jit` traced inputs carry only an
    abstract mesh."""
    if mesh is not None:
        if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
            raise TypeError(f"libra_jax.value_and_grad: mesh must be a jax.sharding.Mesh, got "
                            f"{type(mesh).__name__}")
        return mesh
    context = _compat.context_mesh()
    if context is not None:
        return context
    leaves = jax.tree.leaves(args)
    for leaf in leaves:  # a concrete array's
        sharding = None if isinstance(leaf, _compat.Tracer) else getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        return abstract
    for leaf in leaves:  # a traced value's (an explicit mesh's)
        sharding = getattr(_typeof(leaf), "sharding", None)
        if sharding is not None and not sharding.mesh.empty:
            return sharding.mesh
    raise ValueError("libra_jax.value_and_grad: no mesh: pass mesh=, call it under "
                     "jax.set_mesh(mesh), or give it inputs placed with a NamedSharding")


def _specs(args: tuple, argnums: tuple, axes: tuple, mesh: Any, in_specs: Any) -> tuple:
    """Per positional argument, its spec tree: `in_specs`, or the default rule (module
    docstring). A mesh axis of one device other than the batch's splits nothing: it is left
    out, so the loss does not vary over it (the shard_map's P() output could not be
    inferred); an axis the mesh lacks is kept, for `_check_parameters` to name."""
    sizes = dict(mesh.shape)

    def split_only(spec: P) -> P:
        def keep(d: Any) -> Any:
            if d is None or d is P.UNCONSTRAINED:
                return d
            kept = tuple(a for a in ((d,) if isinstance(d, str) else d)
                         if a in axes or sizes.get(a, 2) > 1)
            return None if not kept else kept[0] if len(kept) == 1 else kept
        return P(*(keep(d) for d in spec))

    if in_specs is not None:
        specs = tuple(in_specs) if isinstance(in_specs, (tuple, list)) else (in_specs,)
        if len(specs) != len(args):
            raise ValueError(f"libra_jax.value_and_grad: in_specs has {len(specs)} entries for "
                             f"{len(args)} positional arguments")
        return tuple(_spec_tree(i, s, a, split_only) for i, (s, a) in enumerate(zip(specs, args)))
    batch = axes[0] if len(axes) == 1 else axes
    shards = math.prod(sizes[a] for a in axes)

    def spec(i: int, path: Any, leaf: Any) -> P:
        if i in argnums:
            return split_only(_visible_spec(leaf, f"argument {i}{jax.tree_util.keystr(path)}"))
        if np.ndim(leaf) == 0:
            return P()
        where = f"argument {i}{jax.tree_util.keystr(path)}"
        shown = shown_layout(leaf)
        if shown is not None:
            return _followed_layout(shown, where, axes, batch, sizes)
        rows = np.shape(leaf)[0]
        if rows % shards:
            raise ValueError(
                f"libra_jax.value_and_grad: argument {i}{jax.tree_util.keystr(path)} has leading "
                f"dimension {rows}, which does not split over the {shards} shards of "
                f"{axes if len(axes) > 1 else axes[0]!r}; every non-differentiated array is "
                "split along its leading (batch) dimension unless in_specs says otherwise")
        return P(batch)
    return tuple(jax.tree_util.tree_map_with_path(lambda p, x, i=i: spec(i, p, x), a)
                 for i, a in enumerate(args))


def _followed_layout(shown: P, where: str, axes: tuple, batch: Any, sizes: dict) -> P:
    """The spec of a non-differentiated leaf whose layout shows (`shown`, size-one axes left
    out): replicated, it enters whole (``P()``); split over the batch's axes along its
    leading dimension, it is split as the batch (``P(batch)``); laid out otherwise, it is
    refused in one line: the rule would split it against its layout."""
    entries = [tuple(a for a in spec_axes(e) if sizes.get(a, 2) > 1) for e in shown]
    if not any(entries):
        return P()
    if set(entries[0]) == set(axes) and not any(entries[1:]):
        return P(batch)
    raise ValueError(
        f"libra_jax.value_and_grad: {where} is laid out as {shown}, which is neither "
        f"replicated nor split over {list(axes)} along its leading dimension; give its "
        "PartitionSpec in in_specs (the route splits a non-differentiated array along its "
        "leading dimension only where no layout says otherwise)")


def _spec_tree(i: int, spec: Any, arg: Any, split_only: Callable[[P], P]) -> Any:
    """in_specs' entry `spec` for argument `i`, each leaf a `PartitionSpec` (or None) and the
    tree a prefix of the argument's, as `jax.shard_map` takes it; a clear error naming
    in_specs otherwise."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec)[0]:
        if not isinstance(leaf, P):
            hint = f"; write P({leaf!r})" if isinstance(leaf, str) else ""
            raise TypeError(f"libra_jax.value_and_grad: in_specs[{i}]"
                            f"{jax.tree_util.keystr(path)} must be a PartitionSpec (or None), "
                            f"got {leaf!r}{hint}")
    try:
        jax.tree.map(lambda s, a: None, spec, arg, is_leaf=_is_spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"libra_jax.value_and_grad: in_specs[{i}] is not a pytree prefix of "
                         f"positional argument {i} (every leaf of the argument needs a spec): "
                         f"{e}") from None
    return jax.tree.map(split_only, spec, is_leaf=_is_spec)


def _splits_batch(specs: Sequence[Any]) -> bool:
    """Whether any of `specs` (spec trees) splits something over a mesh axis."""
    return any(spec_axes(e) for tree in specs
               for spec in jax.tree.leaves(tree, is_leaf=_is_spec) for e in spec)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _visible_spec(leaf: Any, where: str) -> P:
    """A differentiated leaf's layout where it shows (a concrete array's `NamedSharding`, an
    explicit-sharding mesh's traced value's), else ``P()``: under `jax.jit` on an auto mesh a
    traced value carries none."""
    if isinstance(leaf, jax.Array) and not isinstance(leaf, _compat.Tracer):
        sharding = leaf.sharding
        if sharding.is_fully_replicated:
            return P()
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.spec
        raise ValueError(f"libra_jax.value_and_grad: {where} is sharded by a "
                         f"{type(sharding).__name__}, not a NamedSharding: place it with one, "
                         "or give its PartitionSpec in in_specs")
    traced: Any = getattr(_typeof(leaf), "sharding", None)
    if traced is None or traced.mesh.empty:
        return P()
    return traced.spec


def _leaf_specs(arg: Any, spec_tree: Any) -> list[tuple[Any, Any, P]]:
    """(path, leaf, spec) for each leaf of `arg`, its spec from `spec_tree` (a pytree prefix
    of `arg`, as `jax.shard_map`'s in_specs)."""
    full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), spec_tree, arg,
                        is_leaf=_is_spec)
    specs = jax.tree.leaves(full, is_leaf=_is_spec)
    leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
    return [(path, leaf, spec) for (path, leaf), spec in zip(leaves, specs)]


def _check_parameters(args: tuple, argnums: tuple, specs: tuple, mesh: Any, axes: tuple
                      ) -> None:
    """Refuse a differentiated leaf laid out as the route cannot serve, naming the leaf and
    the axis: sharded over a mesh axis of more than one device that the batch is not split
    over (its gradient would be one shard's: tensor parallelism is GSPMD's), or along a
    dimension that does not divide by its axes' devices (a shard_map needs equal shards)."""
    sizes = dict(mesh.shape)
    for i in argnums:
        for path, leaf, spec in _leaf_specs(args[i], specs[i]):
            where = f"argument {i}{jax.tree_util.keystr(path)}"
            shape = np.shape(leaf)
            if len(spec) > len(shape):
                raise ValueError(f"libra_jax.value_and_grad: {where} of shape {shape} is laid "
                                 f"out by {spec}, which has more dimensions")
            for dim, entry in enumerate(spec):
                names = spec_axes(entry)
                for axis in names:
                    if axis not in sizes:
                        raise ValueError(
                            f"libra_jax.value_and_grad: {where} is sharded over {axis!r} "
                            f"({spec}), which is not an axis of the mesh {sizes}")
                    if axis not in axes:
                        raise ValueError(
                            f"libra_jax.value_and_grad: {where} is sharded over {axis!r} "
                            f"({spec}), an axis the batch is not split over: the route serves "
                            f"parameters replicated or sharded over the batch's axes "
                            f"{list(axes)} (FSDP); for tensor parallelism keep "
                            "jax.value_and_grad (GSPMD), whose collectives stay XLA's")
                devices = math.prod(sizes[a] for a in names)
                if names and shape[dim] % devices:
                    raise ValueError(
                        f"libra_jax.value_and_grad: {where} has dimension {dim} of size "
                        f"{shape[dim]}, which does not split evenly over the {devices} "
                        f"devices of {names[0] if len(names) == 1 else names!r} ({spec}); "
                        "the route's shard_map needs equal shards: pad it, or keep it "
                        "replicated")


def _gather_sharded(fun: Callable[..., Any], argnums: tuple, args: tuple, specs: tuple
                    ) -> Callable[..., Any]:
    """`fun` reading its sharded differentiated leaves all-gathered (tiled, along each
    dimension its spec splits): the shard_map passes them in as shards. Autodiff transposes
    each all-gather to a reduce-scatter, so the gradient leaves as shards again; `optimize`
    moves each all-gather to its first use (`rewrite`)."""
    gathers = {i: [tuple((dim, names) for dim, entry in enumerate(spec)
                         if (names := spec_axes(entry)))
                   for _, _, spec in _leaf_specs(args[i], specs[i])] for i in argnums}
    if not any(any(g) for g in gathers.values()):
        return fun

    def gather(x: Any, plan: tuple) -> Any:
        for dim, names in plan:
            x = jax.lax.all_gather(x, names[0] if len(names) == 1 else names, axis=dim,
                                   tiled=True)
        return x

    def gathered(*args: Any, **kwargs: Any) -> Any:
        full = list(args)
        for i, plans in gathers.items():
            leaves, tree = jax.tree.flatten(full[i])
            full[i] = jax.tree.unflatten(tree, [gather(x, g) for x, g in zip(leaves, plans)])
        return fun(*full, **kwargs)
    return gathered


def _reshard(arg: Any, spec_tree: Any, mesh: Any) -> Any:
    """`arg` with each leaf placed as its spec says, where the mesh is explicit (jax checks
    shard_map inputs there; an auto mesh's partitioner reshards by itself)."""
    if jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return arg

    def place(spec: P, leaf: Any) -> Any:
        sharding = getattr(_typeof(leaf), "sharding", None)
        if sharding is not None and not sharding.mesh.empty and _same_spec(sharding.spec, spec):
            return leaf
        return jax.reshard(leaf, jax.sharding.NamedSharding(mesh, spec))
    return jax.tree.map(place, spec_tree, arg, is_leaf=lambda s: isinstance(s, P))


def _same_spec(a: Any, b: P) -> bool:
    x, y = tuple(a), tuple(b)
    n = max(len(x), len(y))
    return x + (None,) * (n - len(x)) == y + (None,) * (n - len(y))


def _typeof(x: Any) -> Any:
    try:
        return jax.typeof(x)
    except TypeError:
        return None


def _hashable(kwargs: dict) -> tuple | None:
    """`kwargs` as a cache key, or None where a value is unhashable."""
    try:
        key = tuple(sorted(kwargs.items()))
        hash(key)
        return key
    except TypeError:
        return None
