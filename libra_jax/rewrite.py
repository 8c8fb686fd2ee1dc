"""`libra_jax.optimize`: rewrite a train step's psums into Libra all-reduces planned at trace time.

Contract of the rewrite (`rewrite_jaxpr`):

- Input: a closed jaxpr. Output: a closed jaxpr with the same input and output
  types whose equations compute the same values bit for bit (each psum's result
  is `jax.lax.psum`'s; compiled, XLA may still fuse and contract the two programs
  differently: docs/bitwise.md, class 3), in which every psum that
  can be served (`psum`, `psum_invariant`, and `libra_psum` without an
  explicit block count) is a `libra_psum` with a planned block count, or part
  of a `libra_psum_fused` bucket.
- Scope: psums are found in the jaxpr and, recursively, in the sub-jaxprs of
  `jit`, `shard_map`, `scan`, `while`, `cond`, `checkpoint` (remat),
  `custom_jvp_call`, `custom_vjp_call` and `closed_call` (`_compat.HIGHER_ORDER`). A psum
  that cannot be served (`axis_index_groups`, positional axes) or that hides
  in a higher-order primitive without a rule stays an XLA psum, and a one-time
  warning lists it.
- Planning happens per jaxpr (one scope = one stream of compute). A *gradient*
  psum is one on the backward pass (made by autodiff's transpose, e.g. the psum
  of a replicated input's cotangent that `check_vma` inserts, or reading a value
  the backward pass computed, e.g. an explicit `pmean(grads)`) whose result
  feeds no later psum (it goes to outputs or to the optimizer update); in a
  scope where no backward pass is visible, every psum whose result feeds no
  later psum. Gradient psums are handed to the planner in jaxpr order (the
  order the backward pass produces them), with the compute between them
  estimated by a roofline of the profile; psums over the same axes are fused
  into buckets. Other psums (kind "forward": the loss, metrics, forward
  statistics; "backward": a psum the rest of the backward pass depends on, such
  as a batch statistic's cotangent) get an allocation from
  `allreduce.default_blocks` and no fusion.
- Loops: a `scan` body's psums whose result only goes, by data movement, into a
  stacked output (a stacked weight's gradient slice, `libra_jax.loops`) are
  hoisted before the scope is planned: the scan returns the slices unreduced and
  one psum of the stacked array follows it, a psum of this scope like any other
  (the same sums: summation is elementwise). `loops="auto"` hoists where the
  model prices that lower than keeping them in the body (`_Rewriter.loop_plan`).
  Then every loop body (`scan`, `while`, so `fori_loop`) is a scope of its own,
  planned by the same rule where the body shows a backward pass: its gradient
  psums (a train step scanned over substeps, gradient accumulation that
  all-reduces each microbatch, a kept stacked slice, a shared weight's
  cotangent) are planned for one iteration, fused into buckets with the body's
  compute between them, and every iteration issues that plan; each bucket is one
  call (no start/done pair in a body: its all-reduces are done within the
  iteration, where a pair could only overlap the rest of it). The body's other
  psums (kind "loop": a loss, a statistic, a forward loop's) get
  `allreduce.default_blocks`. `OptimizeReport.loops` has a `LoopPlan` per loop.
- A bucket is one `libra_psum_fused` equation placed where its last member
  was; it concatenates its operands per dtype, all-reduces each dtype once,
  and splits them back. Summation is elementwise in rank order either way,
  so results are bitwise those of the unfused psums. Equations between the
  bucket's members that use an earlier member's result move after it.
- A gradient bucket (fused or not) is issued either as that one call or as a
  `libra_psum_start` where its last member was and a `libra_psum_done`, with
  the uses that moved, just before the first equation that reads a result
  (`libra_jax.ops.start_done`); the values are the same. ``overlap="sync"`` or
  ``"start-done"`` forces one way; ``"auto"`` (the default) chooses per bucket
  (`_Rewriter.split_buckets`).
- A psum of a known zero (a literal, or broadcast from one) is folded to ``z + z``,
  bitwise `jax.lax.psum`'s, with no call (`_Rewriter.fold_zero_psums`).
- Sharded data parallelism: a `psum_scatter` (JAX's `reduce_scatter`, or
  `libra_reduce_scatter` without an explicit block count) is a site as a psum is,
  classified by the same rule: the gradient of a sharded parameter (the transpose of a
  forward `all_gather`, or an explicit `psum_scatter` of gradients) is a gradient
  collective. A scope's gradient psums and psum_scatters over the same axes are planned
  together (`planner.Layer.collective`: one backward stream), a bucket holding one
  `_Site.bucket_class`; a bucket of psum_scatters along their first dimension is one
  `libra_reduce_scatter_fused` equation (bitwise the unfused ones: the same sums), issued as
  one call. The gradient of ``all_gather(to='invarying')`` (a psum, then this rank's
  slice) becomes that slice's reduce-scatter first (`_scatter_sliced_psums`). Every
  `all_gather` it can serve becomes libra's, one call at the model's block count
  (`_Rewriter.edit_gathers`); others stay XLA's, listed as unplanned.
- Deterministic: everything is visited in jaxpr order; no set or dict
  iteration order, hash or timing enters the plan.
"""
from __future__ import annotations

import bisect
import collections
import collections.abc
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from libra_jax import _compat, _nccl, allreduce, collectives, config, loops, model, planner
from libra_jax.ops import (
    XLA_TWINS,
    libra_all_gather_p,
    libra_psum_fused_p,
    libra_psum_p,
    libra_reduce_scatter_fused_p,
    libra_reduce_scatter_p,
)
from libra_jax.ops import lowering as _lowering
from libra_jax.ops.base import warn_once
from libra_jax.ops.start_done import (
    TOKEN_AVAL,
    libra_psum_done_p,
    libra_psum_start_p,
    libra_sharded_done_p,
    libra_sharded_start_p,
    register_pair,
)

__all__ = ["optimize", "rewrite_jaxpr", "PsumPlan", "LoopPlan", "OptimizeReport",
           "libra_psum_fused_p"]

#: Environment switch that turns `optimize` into a pass-through (`config`).
DISABLE_ENV = config.DISABLE_ENV
#: Environment default of `optimize(overlap=...)`.
OVERLAP_ENV = config.OVERLAP_ENV
#: What carries out the rewritten program's all-reduces: Libra's engine ("libra"), or XLA's
#: all-reduce in each call's place, the program otherwise the same ("xla": a control).
COLLECTIVES = ("libra", "xla")
#: How a gradient all-reduce is issued: one call ("sync"; on CPU already asynchronous), a
#: start/done pair around the compute it overlaps ("start-done", `libra_jax.ops.start_done`), or
#: per bucket whichever the model prices lower ("auto", `_Rewriter.split_buckets`).
OVERLAP_MODES = config.OVERLAP_MODES


# --- Public API ---------------------------------------------------------------

def optimize(fn: Callable[..., Any] | None = None, *, profile: Any = None, fusion: bool = True,
             blocks: int | None = None, overlap: str | None = None, loops: str = "auto",
             prefetch: str | int | None = None, prefetch_bytes: int | None = None,
             static_argnums: int | Sequence[int] | None = None,
             static_argnames: str | Sequence[str] | None = None,
             collectives: str = "libra", enabled: bool = True) -> Any:
    """Rewrite the psums of a train step into Libra all-reduces planned at trace time.

    Use as ``jax.jit(libra_jax.optimize(step))`` or ``@libra_jax.optimize(profile="h100")``.
    `fn` may itself be jitted, `shard_map`ped, or call `jax.pmap`.

    Args:
      fn: the function; without it, a decorator is returned.
      profile: the hardware profile (a name, a path, a `model.Profile` or its JSON document
        as a dict); default: the
        built-in profile of the default backend (`allreduce.DEFAULT_PROFILES`). Under
        multi-process JAX every process plans with process 0's (`shared_profile`).
      fusion: fuse gradient psums into buckets (Libra's co-optimisation). False: one
        all-reduce per psum, allocations still planned.
      blocks: fix every planned allocation to this block count and plan fusion only.
      overlap: "sync" issues each gradient all-reduce as one call (on CPU the engine's
        call is asynchronous already). "start-done" splits it into a start where the
        gradients are ready and a done after the backward pass, where the result is first
        needed (on a GPU the kernel runs on libra's own stream beside the backward pass).
        "auto" chooses per bucket: a start/done pair where the work it defers (the bucket's
        optimizer update) is predicted to cost less than leaving the one call pending in
        the program (the profile's ``pending_allreduce_us``); on a GPU under
        ``LIBRA_JAX_CUDA=nccl`` always a pair; other GPU profiles, until measured, issue one
        call. None: ``$LIBRA_JAX_OVERLAP``, else "auto".
      loops: what happens to a `scan` body's psums that may leave the loop (a stacked
        weight's gradient slice: `libra_jax.loops`): "hoist" all-reduces the stacked slices
        once after the loop, planned with the other gradients (the same sums); "in-loop"
        keeps them in the body, planned there with the body's other gradient psums (one
        iteration's plan); "auto" (default) takes whichever the model predicts faster.
      prefetch: how far ahead of its use each all-gather (FSDP's parameter gathers, forward
        and, under remat, backward) is issued: "auto" takes the model's distance
        (`planner.plan_gathers`: the gathers' time beside the compute they overlap, its
        slowdown included), "off" (or 0) issues each as one call where it is used, a number
        d issues gather i as a start/done pair when gather i - d is done. Remat's re-gathers
        leave their `checkpoint` to be issued ahead (only when prefetching). None:
        ``$LIBRA_JAX_PREFETCH``, else "auto".
      prefetch_bytes: the most gathered bytes per device issued ahead at once (the memory
        prefetching holds); None: ``$LIBRA_JAX_PREFETCH_BYTES``, else 1 GiB.
      static_argnums: positions of arguments that are not traced, as in `jax.jit`:
        Python values (a ``train`` flag, a config, a schedule function) passed to `fn` as
        they are; they must be hashable, and each distinct value is its own program. A
        jitted `fn`'s own static arguments are taken from it. Under an outer transformation
        (`jax.jit` with its own ``static_argnums``, `eqx.filter_jit`, `nnx.jit`) nothing
        needs marking here: where some argument leaf is a tracer, every leaf that is
        neither a tracer nor an array is static (`outer_statics`).
      static_argnames: names of arguments that are not traced, as in `jax.jit`; as
        `static_argnums`.
      collectives: "libra" (default): the engine's calls. "xla": the same rewritten program
        (buckets packed and split, start/done where they were) with XLA's all-reduce in
        each call's place: the control that isolates the engine from the rewrite (their
        results are compared bit for bit in tests/test_corpus.py). Not differentiable.
      enabled: False returns `fn` unchanged (as does ``LIBRA_JAX_DISABLE=1``).

    Returns:
      A function with `fn`'s signature and results. Its other arguments are handled as by
      `jax.jit`: array-likes (Python scalars included) are traced, anything else is an
      error (under an outer transformation: static, above); the rewritten program is cached
      per argument structure and types (and static values), so the same call retraces
      nothing. Flax NNX objects among the arguments (modules, `nnx.Optimizer`, metrics,
      `Rngs`) are updated in place as `fn` updates them, as under `nnx.jit`; called inside
      `nnx.jit`, or wrapping an `nnx.jit`ted `fn`, likewise. ``wrapped.last_report`` holds
      the latest plan.
    """
    if fn is None:
        return functools.partial(optimize, profile=profile, fusion=fusion, blocks=blocks,
                                 overlap=overlap, loops=loops, prefetch=prefetch,
                                 prefetch_bytes=prefetch_bytes, static_argnums=static_argnums,
                                 static_argnames=static_argnames, collectives=collectives,
                                 enabled=enabled)
    if not callable(fn):
        raise TypeError(f"libra_jax.optimize: expected a function to optimize, got {fn!r}")
    if blocks is not None:
        allreduce.check_blocks(blocks)
    if collectives not in COLLECTIVES:
        raise ValueError(f"libra_jax.optimize: collectives must be one of "
                         f"{', '.join(map(repr, COLLECTIVES))}, got {collectives!r}")
    statics = StaticArgs.of(fn, static_argnums, static_argnames)
    if not enabled:
        return fn
    options = _Options(profile=profile, fusion=bool(fusion), blocks=blocks,
                       overlap=config.overlap_mode(overlap), loops=_loop_mode(loops),
                       prefetch=config.prefetch_mode(prefetch),
                       prefetch_bytes=config.prefetch_bytes(prefetch_bytes))
    cache: dict[Any, tuple[Callable[..., Any], Outputs, OptimizeReport]] = {}

    # Name, docstring and signature of `fn`, but not its attributes: a jitted or
    # pmapped `fn` carries attributes that would make `jax.jit(wrapped)` compile `fn`.
    @functools.wraps(fn, updated=())
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if config.optimize_disabled():
            return fn(*args, **kwargs)
        call, dynamic, static_key = statics.split(fn, args, kwargs)
        nodes = nnx_objects(dynamic, variables=True)
        if nodes:  # NNX's in-place updates leave the program as outputs, written back below
            call = _returning_nnx_state(call)
        call, dynamic, static_key = outer_statics(call, dynamic, static_key)
        leaves, treedef = jax.tree.flatten(dynamic)
        key = (treedef, tuple(_aval_key(x) for x in leaves), static_key, options.cache_key(),
               collectives)
        entry = cache.get(key)
        if entry is None:
            outputs = Outputs()
            closed = jax.make_jaxpr(outputs.arrays_of(call))(*dynamic[0], **dynamic[1])
            program = str(closed.jaxpr)
            profile = shared_profile(options.resolved_profile, program=program)
            rewritten, report = rewrite_jaxpr(closed, profile=profile, fusion=options.fusion,
                                              blocks=options.blocks, overlap=options.overlap,
                                              loops=options.loops, prefetch=options.prefetch,
                                              prefetch_bytes=options.prefetch_bytes,
                                              inputs=leaves)
            check_plan_agreement(report, program=program)
            if collectives == "xla":
                rewritten = with_xla_collectives(rewritten)
            entry = (jax.jit(_compat.jaxpr_as_fun(rewritten)), outputs, report)
            cache[key] = entry
        run, outputs, report = entry
        wrapped.last_report = report  # type: ignore[attr-defined]
        out = outputs.rebuild(run(*leaves))
        if nodes:
            out, states = out
            for node, state in zip(nodes, states):
                _nnx_update(node, state)
        return out

    wrapped.last_report = None  # type: ignore[attr-defined]
    wrapped.static_args = statics  # type: ignore[attr-defined]  # for `libra_jax.explain`
    return wrapped


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    """Which arguments of a step are static, `jax.jit`'s way: by position and by name."""

    argnums: tuple[int, ...] = ()
    argnames: tuple[str, ...] = ()

    @classmethod
    def of(cls, fn: Callable[..., Any], argnums: Any = None, argnames: Any = None
           ) -> StaticArgs:
        """The static arguments given, and a jitted `fn`'s own (`_compat.jit_static_args`)."""
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums or ())
        names = (argnames,) if isinstance(argnames, str) else tuple(argnames or ())
        if any(isinstance(n, bool) or not isinstance(n, int) for n in nums):
            raise TypeError(f"libra_jax.optimize: static_argnums must be ints, got {argnums!r}")
        if any(not isinstance(n, str) for n in names):
            raise TypeError(f"libra_jax.optimize: static_argnames must be strings, "
                            f"got {argnames!r}")
        jit_nums, jit_names = _compat.jit_static_args(fn)
        return cls(tuple(dict.fromkeys(nums + jit_nums)), tuple(dict.fromkeys(names + jit_names)))

    def split(self, fn: Callable[..., Any], args: tuple, kwargs: dict
              ) -> tuple[Callable[..., Any], tuple[tuple, dict], tuple]:
        """(a function of the dynamic arguments that calls `fn` with the static ones in
        place, the dynamic (args, kwargs), the static values as a hashable cache key)."""
        if not self.argnums and not self.argnames:
            return fn, (args, kwargs), ()
        positions = {n % len(args) if -len(args) <= n < len(args) else n for n in self.argnums}
        static_pos = {i: args[i] for i in sorted(positions) if 0 <= i < len(args)}
        static_kw = {k: kwargs[k] for k in self.argnames if k in kwargs}
        key = (tuple(static_pos.items()), tuple(sorted(static_kw.items())))
        for where, value in [*((f"argument {i}", v) for i, v in static_pos.items()),
                             *((f"argument {k!r}", v) for k, v in static_kw.items())]:
            try:
                hash(value)
            except TypeError:
                raise ValueError(
                    f"libra_jax.optimize: static {where} is not hashable "
                    f"({type(value).__name__}): static arguments key the program cache, as "
                    "in jax.jit; pass a hashable value (a tuple, a frozen dataclass) or make "
                    "it a traced argument") from None
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_kw}

        def call(*d_args: Any, **d_kwargs: Any) -> Any:
            it = iter(d_args)
            full = [static_pos[i] if i in static_pos else next(it) for i in range(len(args))]
            return fn(*full, **d_kwargs, **static_kw)
        return call, (dyn_args, dyn_kwargs), key


# --- What an outer transformation hands over -------------------------------------------------

def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.core.Tracer, jax.Array, np.ndarray, np.generic))


def outer_statics(call: Callable[..., Any], dynamic: tuple[tuple, dict], static_key: tuple
                  ) -> tuple[Callable[..., Any], tuple[tuple, dict], tuple]:
    """Leaves an outer transformation made static, taken out of the traced arguments.

    Under `jax.jit` with ``static_argnums``, `eqx.filter_jit` or `nnx.jit`, the arguments
    arrive as tracers beside the Python objects the outer transformation kept static (a
    config, a schedule function, an Equinox model's activation). So when some leaf is a
    `Tracer`, every leaf that is neither a tracer nor an array (jax or numpy; Python scalars
    included) is static: passed to the step as it is, and part of the cache key (hashable,
    or a TypeError naming the leaf). Called without tracers, `jax.jit`'s rule holds for
    Python scalars (traced), and a leaf that is no JAX value at all (a function in an
    Equinox model, called eagerly) is static too, as `eqx.filter_jit` takes it. Returns (a
    function of the remaining leaves, those leaves as positional arguments, the key with the
    static leaves added)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
    tracing = any(isinstance(x, jax.core.Tracer) for _, x in flat)
    static = {i: (path, x) for i, (path, x) in enumerate(flat)
              if not (_is_array(x) if tracing else _is_jax_value(x))}
    if not static:
        return call, dynamic, static_key
    for path, x in static.values():
        try:
            hash(x)
        except TypeError:
            raise TypeError(
                f"libra_jax.optimize: argument leaf {_arg_path(path)} ({type(x).__name__}) is "
                "neither an array nor a tracer, so under the outer transformation it is "
                "static and keys the program cache, but it is not hashable; make it hashable "
                "(a tuple, a frozen dataclass) or an array") from None
    values = {i: x for i, (_, x) in static.items()}

    def call_with_statics(*leaves: Any) -> Any:
        it = iter(leaves)
        args, kwargs = jax.tree.unflatten(
            treedef, [values[i] if i in values else next(it) for i in range(len(flat))])
        return call(*args, **kwargs)

    key = static_key + (treedef, tuple((i, type(x), x) for i, x in values.items()))
    dyn = tuple(x for i, (_, x) in enumerate(flat) if i not in values)
    return call_with_statics, (dyn, {}), key


def _arg_path(path: tuple) -> str:
    """``args[0].activation`` from a flattened (args, kwargs) path."""
    text = jax.tree_util.keystr(path)
    return ("args" + text[3:]) if text.startswith("[0]") else ("kwargs" + text[3:])


@dataclasses.dataclass
class Outputs:
    """A step's outputs split as its arguments are: the arrays leave the program; any other
    leaf (a function in an Equinox model that `eqx.filter_jit` returns as it was) is kept
    from the trace and put back. Python numbers are arrays here, as `jax.jit` returns them."""

    tree: Any = None
    static: dict[int, Any] = dataclasses.field(default_factory=dict)

    def arrays_of(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call`, returning its array leaves only (recording the rest in `self`)."""
        def traced(*args: Any, **kwargs: Any) -> list[Any]:
            flat, self.tree = jax.tree.flatten(call(*args, **kwargs))
            self.static = {i: x for i, x in enumerate(flat) if not _is_jax_value(x)}
            return [x for i, x in enumerate(flat) if i not in self.static]
        return traced

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        it = iter(arrays)
        n = self.tree.num_leaves
        return jax.tree.unflatten(
            self.tree, [self.static[i] if i in self.static else next(it) for i in range(n)])


def _is_jax_value(x: Any) -> bool:
    return _is_array(x) or isinstance(x, (bool, int, float, complex))


def nnx_objects(tree: Any, *, variables: bool = False) -> list[Any]:
    """The Flax NNX objects (modules, optimizers, metrics, `Rngs`) in `tree`, in flattening
    order; with `variables`, also the `nnx.Variable`s outside them (a bare `nnx.Param` or
    counter passed to the step, updated in place as `nnx.jit` allows). Not an `nnx.State`
    nor the variables in one: a functional step's `nnx.split` state is values, which it
    returns updated. NNX is looked up, never imported: a program without it has none."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return []
    state = getattr(nnx, "State", ())

    def stop(x: Any) -> bool:  # not looked into: an object, a variable, a State
        return isinstance(x, state) or nnx.graph.is_graph_node(x)

    def wanted(x: Any) -> bool:
        if isinstance(x, nnx.Variable):
            return variables
        return nnx.graph.is_graph_node(x) and not isinstance(x, state)
    return [x for x in jax.tree.leaves(tree, is_leaf=stop) if wanted(x)]


def _nnx_state(node: Any) -> Any:
    """What `_returning_nnx_state` returns of an NNX object: its `nnx.state`, or a bare
    variable's value."""
    nnx = sys.modules["flax.nnx"]
    return node.get_value() if isinstance(node, nnx.Variable) else nnx.state(node)


def _nnx_update(node: Any, state: Any) -> None:
    """Write `_nnx_state`'s result back into the caller's object."""
    nnx = sys.modules["flax.nnx"]
    if isinstance(node, nnx.Variable):
        node.set_value(state)
    else:
        nnx.update(node, state)


def _returning_nnx_state(call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` that also returns the state of the NNX objects in its arguments after the call.

    An NNX step updates its arguments in place (``optimizer.update(model, grads)``, metrics,
    `Rngs`, batch statistics). Traced, those arguments are copies made from the leaves, so
    their updates must leave the program as outputs and be written back into the caller's
    objects (`nnx.update`; a bare variable's value set), as `nnx.jit` does; under an outer
    `nnx.jit` the objects written back are its own, which it propagates."""
    def traced(*args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        return out, tuple(_nnx_state(node) for node in nnx_objects((args, kwargs),
                                                                    variables=True))
    return traced


@dataclasses.dataclass(frozen=True)
class PsumPlan:
    """One planned collective (a bucket of one or more psums, or of psum_scatters) in one
    jaxpr scope."""

    scope: str                      # where: "shard_map/jit/..." path of the jaxpr
    axes: tuple                     # the reduced mesh axes
    members: tuple[int, ...]        # positions of the psums in the scope's equations
    nbytes: int                     # bytes per rank
    blocks: int                     # the allocation (engine worker tasks / thread blocks)
    # "gradient" (planned and fused: `_Rewriter.jaxpr`), "backward" (of the backward pass,
    # feeding more of it: e.g. a batch norm statistic's cotangent), "forward" (the forward
    # pass, metrics), "loop" (in a loop body) or "user" (blocks= given)
    kind: str
    overlap: str = "sync"           # "sync" (one call) or "start-done" (`libra_jax.ops.start_done`)
    # What the bucket issues (`planner.COLLECTIVES`): "all-reduce" (psums), "reduce-scatter"
    # (psum_scatters: a sharded parameter's gradient; `nbytes` is then the unsharded buffers'
    # bytes per rank) or "all-gather" (one all_gather; `nbytes`: the gathered buffer's).
    collective: str = "all-reduce"
    # An all-gather issued ahead of its use (`overlap` "prefetch": a start/done pair): how many
    # gathers of its scope ahead (`planner.GatherPlan.distance`); 0 for one call.
    ahead: int = 0


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """What `optimize` did with one loop (`scan`, `while`) whose body holds gradient psums:
    each iteration's plan (the body's scope, whose `PsumPlan`s run once per iteration) and,
    for a scan whose psums could leave the body (a stacked weight's gradient slices:
    `libra_jax.loops`), the choice to hoist them or keep them in the body."""

    scope: str                      # the scope the loop equation is in
    index: int                      # its position among the scope's equations
    length: int | None              # iterations (a scan's; None: a while loop's)
    body: str                       # the body's scope: its PsumPlans are each iteration's
    gradient: int                   # gradient psums planned in the body, per iteration
    calls: int                      # the calls they make per iteration (their buckets)
    # A scan's hoistable psums: how many, their bytes per iteration, "hoist" (all-reduced
    # after the loop, planned with the scope's gradients) or "in-loop" (planned in the body),
    # and the model's predicted seconds of the loop each way; 0 and "in-loop" where none.
    psums: int = 0
    nbytes: int = 0
    choice: str = "in-loop"
    in_loop_s: float | None = None
    hoisted_s: float | None = None
    kept: int = 0                   # the body's psums not planned as gradients (kind loop)


@dataclasses.dataclass
class OptimizeReport:
    """What the rewrite did: every planned all-reduce, and what it left alone."""

    plans: list[PsumPlan] = dataclasses.field(default_factory=list)
    predicted: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # why nothing was planned
    # Collectives other than psum (JAX's, `_compat.OTHER_COLLECTIVES`, left to XLA; libra's
    # psum_scatter and all_gather, marked "(libra's)", at their own blocks): one line per kind,
    # axes and scope, with its count.
    unplanned: list[str] = dataclasses.field(default_factory=list)
    loops: list[LoopPlan] = dataclasses.field(default_factory=list)
    # Collectives whose results the step never uses, removed before planning with the
    # computation only they needed (dead code): one line per kind, with its count.
    dropped: list[str] = dataclasses.field(default_factory=list)
    # psums of a known zero, computed without a call (`_Rewriter.fold_zero_psums`): one line
    # per psum, with its scope.
    folded: list[str] = dataclasses.field(default_factory=list)
    # Per scope whose all-gathers were planned together (`_Rewriter.prefetch_gathers`): the
    # model's inputs and choice (`planner.GatherStep`s, `planner.GatherPlan`), for `explain`.
    gathers: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def num_psums(self) -> int:
        return sum(len(p.members) for p in self.plans)

    def plan_lines(self) -> list[str]:
        """One line per planned collective: what every process must agree on."""
        return ([f"{p.scope} axes={p.axes} psums={p.members} bytes={p.nbytes} blocks={p.blocks} "
                 f"kind={p.kind} overlap={p.overlap} collective={p.collective}"
                 + (f" ahead={p.ahead}" if p.collective == "all-gather" else "")
                 for p in self.plans]
                + [f"{p.scope} loop={p.index} body={p.body} gradient={p.gradient} "
                   f"calls={p.calls} psums={p.psums} {p.choice}" for p in self.loops])


def block_cap(profile: model.Profile) -> tuple[int | None, str]:
    """The most blocks one all-reduce of a GPU plan may take, and why: on the ``nccl`` path the
    loaded NCCL's CTA limit (`libra_jax._nccl.Library.max_ctas`: a larger count would run with
    that many CTAs, so the planner must not price it); ``(None, "")`` otherwise (CPU profiles,
    the other paths, no NCCL, or an NCCL that cannot limit CTAs at all)."""
    if profile.form == "fair-share" or config.cuda_path() != "nccl" or not _nccl.available()[0]:
        return None, ""
    lib = _nccl.library()
    if lib.max_ctas == 0:
        return None, ""
    return lib.max_ctas, (f"NCCL {lib.version} ({lib.route} CTA limits) runs an all-reduce on "
                          f"at most {lib.max_ctas} CTAs")


#: Set to 1 (on every process) to plan with each process's own profile under multi-process JAX.
NO_PROFILE_BROADCAST_ENV = config.NO_PROFILE_BROADCAST_ENV
_profile_broadcasts: dict[str, int] = {}


def shared_profile(resolve: Callable[[], model.Profile], *, program: str) -> model.Profile:
    """Under multi-process JAX, the profile every process plans `program` with: process 0's.

    Why: plans must be identical on every process (same all-reduces, same order, same block
    counts), but each host resolves its own profile -- its own calibration (``libra-jax
    calibrate`` measures the host it runs on) or whatever `profile=` its code passed. So
    process 0 publishes its resolved profile's JSON document in JAX's distributed key-value
    store (key ``libra_jax/profile/<program hash>/<n>``) and every other process plans with
    that one. This holds for an explicit `profile=` too: SPMD code runs the same program
    everywhere, so a per-process difference is a deployment accident (a path that resolves
    to different files per host), not a request for mismatched plans. A process whose own
    profile differs from process 0's says so in a one-time warning.

    ``LIBRA_JAX_NO_PROFILE_BROADCAST=1`` (set it on every process) turns the broadcast off;
    `check_plan_agreement` still catches any difference. A process that waits longer than
    ``LIBRA_JAX_TIMEOUT_S`` for process 0's profile raises RuntimeError. `resolve` resolves
    this process's profile (once); in a single process, its result is returned.
    """
    client = _compat.distributed_client()
    if (client is None or jax.process_count() == 1
            or not config.profile_broadcast()):
        return resolve()
    tag = hashlib.sha256(program.encode()).hexdigest()[:16]
    _profile_broadcasts[tag] = sequence = _profile_broadcasts.get(tag, 0) + 1
    key = f"libra_jax/profile/{tag}/{sequence}"
    if jax.process_index() == 0:
        try:
            profile = resolve()
            document = model.profile_to_dict(profile)
        except (ValueError, OSError, TypeError) as exc:  # tell the others, not let them wait
            client.key_value_set(key, json.dumps({"error": str(exc)}))
            raise
        client.key_value_set(key, json.dumps({"name": _profile_label(profile),
                                              "document": document}))
        return profile
    timeout_s = config.timeout_s()
    try:
        payload = json.loads(client.blocking_key_value_get(key, config.kv_timeout_ms()))
    except Exception as exc:
        raise RuntimeError(
            f"libra_jax.optimize: process {jax.process_index()} waited {timeout_s:g} s "
            "(LIBRA_JAX_TIMEOUT_S) for process 0's profile and got none: process 0 may have "
            f"died, be tracing a different program, or run with {NO_PROFILE_BROADCAST_ENV}=1 "
            f"while this process does not ({type(exc).__name__}: {exc})") from exc
    if "error" in payload:
        raise RuntimeError(f"libra_jax.optimize: process 0 could not load its profile, so no "
                           f"process can plan this step: {payload['error']}")
    theirs = model.profile_from_dict(payload["document"],
                                     origin=f"process 0's profile {payload['name']}")
    try:
        mine: model.Profile | None = resolve()
    except (ValueError, OSError, TypeError):
        mine = None
    if mine != theirs:  # equal by value (`model.Profile`: origin aside)
        warn_once(
            "profile-mismatch",
            f"libra_jax.optimize: the profile of process {jax.process_index()} "
            f"({_profile_label(mine)}) differs from process 0's ({payload['name']}); every "
            "process plans with process 0's so that their all-reduces match "
            f"({NO_PROFILE_BROADCAST_ENV}=1 turns this off)")
    return theirs


def _profile_label(profile: model.Profile | None) -> str:
    if profile is None:
        return "which does not load"
    return f"profile {profile.name!r} from {profile.origin}"


_agreement_checks: dict[str, int] = {}


def data_path_lines() -> list[str]:
    """What every process must also agree on where libra's GPU path is chosen (`$LIBRA_JAX_CUDA`
    ``p2p`` or ``nccl``): the NCCL it loaded and how block counts reach it (version, CTA route
    and limit, launch order, NCCL's own CTA settings), which decide each call's CTA limit and
    communicators (one per block count on 2.17-2.30). None under ``xla``."""
    path = config.cuda_path()
    if path == "xla":
        return []
    line = f"data path: LIBRA_JAX_CUDA={path}"
    if not _nccl.available()[0]:
        return [f"{line} NCCL=none"]
    lib = _nccl.library()
    overrides = " ".join(f"{k}={v}" for k, v in config.nccl_cta_overrides().items())
    return [f"{line} NCCL={lib.version} route={lib.route} max_ctas={lib.max_ctas} "
            f"splits={int(lib.splits)} launch_order={lib.launch_order} "
            f"{config.NCCL_LAUNCH_ORDER_ENV}={int(config.nccl_launch_order_implicit())}"
            + (f" {overrides}" if overrides else "")]


def check_plan_agreement(report: OptimizeReport, *, program: str) -> None:
    """Under multi-process JAX, check that every process planned `program` the same way.

    Every process must run the same all-reduces in the same order with the same block
    counts, and on libra's GPU path with the same NCCL configuration (`data_path_lines`);
    profiles may differ from host to host. Each process publishes its plan in
    JAX's distributed key-value store and compares it with everyone's, so a mismatch is a
    clear error naming the differing all-reduces instead of a hang or silent skew. A
    no-op in a single process.
    """
    client = _compat.distributed_client()
    if client is None or jax.process_count() == 1:
        return
    tag = hashlib.sha256(program.encode()).hexdigest()[:16]
    _agreement_checks[tag] = sequence = _agreement_checks.get(tag, 0) + 1
    prefix = f"libra_jax/plan/{tag}/{sequence}"
    mine = report.plan_lines() + data_path_lines()
    client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(mine))
    timeout_ms = config.kv_timeout_ms()
    for process in range(jax.process_count()):
        if process == jax.process_index():
            continue
        theirs = json.loads(client.blocking_key_value_get(f"{prefix}/{process}", timeout_ms))
        if theirs != mine:
            diff = [f"  here:          {a}\n  process {process}: {b}"
                    for a, b in zip(mine + ["(none)"] * len(theirs), theirs + ["(none)"] * len(mine))
                    if a != b]
            raise RuntimeError(
                f"libra_jax.optimize: process {jax.process_index()} and process {process} planned "
                "this step differently, so their all-reduces would not match. Use the same "
                "profile everywhere (optimize(profile=...)), and the same LIBRA_JAX_CUDA and "
                "NCCL. Differing all-reduces:\n" + "\n".join(diff))


def rewrite_jaxpr(closed: Any, *, profile: Any = None, fusion: bool = True,
                  blocks: int | None = None, overlap: str | None = None, loops: str = "auto",
                  prefetch: str | int | None = None, prefetch_bytes: int | None = None,
                  inputs: Sequence[Any] = ()) -> tuple[Any, OptimizeReport]:
    """Rewrite `closed` (a ClosedJaxpr) as the module docstring states.

    `inputs`: the values `closed` was traced from (arrays or tracers), where known. Only their
    shardings are read: a step with no psum whose inputs are sharded is a GSPMD step, and the
    notice says so (`gspmd_notice`)."""
    if blocks is not None:
        allreduce.check_blocks(blocks)
    report = OptimizeReport()
    options = _Options(profile=profile, fusion=fusion, blocks=blocks,
                       overlap=config.overlap_mode(overlap), loops=_loop_mode(loops),
                       prefetch=config.prefetch_mode(prefetch),
                       prefetch_bytes=config.prefetch_bytes(prefetch_bytes))
    # A collective whose result the step never uses (a frozen parameter's gradient zeroed
    # after its pmean, a psum'd metric nobody returns) is no gradient to plan, and as a
    # start/done pair it would lose its done to XLA's dead-code elimination while its
    # start wrote into a buffer XLA reuses: it goes first, with the work only it needed.
    live = _compat.dce(closed.jaxpr)
    dropped = _collective_counts(closed.jaxpr) - _collective_counts(live)
    report.dropped = [f"{name}" + (f" (x{n})" if n > 1 else "") for name, n in dropped.items()]
    closed = _compat.closed_jaxpr(live, closed.consts)
    with _compat.memoized_sub_jaxprs():
        rewriter = _Rewriter(options, report, closed)
        # A step traced inside a `pmap` or `shard_map` (``pmap(optimize(step))``) sees its
        # axes bound there: their sizes come from where it is traced.
        new_jaxpr = rewriter.jaxpr(closed.jaxpr, axis_sizes=_compat.bound_axis_sizes(),
                                   scope="top", in_loop=False)
        maps_devices = _maps_devices(closed.jaxpr)
    for line in report.skipped:
        warn_once("psum-left-in-place", f"libra_jax.optimize left an XLA psum in place: {line}")
    counts = collections.Counter(rewriter.unplanned)
    report.unplanned = [f"{what}" + (f" (x{n})" if n > 1 else "") for what, n in counts.items()]
    if report.unplanned:
        warn_once("unplanned-collectives",
                  "libra_jax.optimize plans psums and psum_scatters and runs all_gathers; these "
                  "collectives keep their own lowering (XLA's, or libra's at their own blocks): "
                  + "; ".join(report.unplanned) + ". " + UNPLANNED_NOTICE)
    if not report.plans and not report.skipped and not maps_devices:
        gspmd, notice = gspmd_notice([*(v.aval for v in closed.jaxpr.invars), *inputs])
        report.notes.append(notice)
        warn_once("gspmd-step" if gspmd else "no-psum", f"libra_jax.optimize: {notice}")
    return _compat.closed_jaxpr(new_jaxpr, closed.consts), report


# --- Options ------------------------------------------------------------------

#: `optimize(loops=...)`: what happens to the psums that may leave a scan body (`loops`).
LOOP_MODES = ("auto", "hoist", "in-loop")


def _loop_mode(loops: str) -> str:
    if loops not in LOOP_MODES:
        raise ValueError(f"libra_jax.optimize: loops must be one of "
                         f"{', '.join(map(repr, LOOP_MODES))}, got {loops!r}")
    return loops


@dataclasses.dataclass(frozen=True)
class _Options:
    profile: Any
    fusion: bool
    blocks: int | None
    overlap: str = "auto"
    loops: str = "auto"
    prefetch: str | int = "auto"    # `config.prefetch_mode`
    prefetch_bytes: int = config.DEFAULT_PREFETCH_BYTES

    def __post_init__(self) -> None:
        profile = self.profile  # checked when made; a JSON document is read now, once
        if isinstance(profile, collections.abc.Mapping):
            object.__setattr__(self, "profile", model.resolve_profile(profile))
        elif not (profile is None or isinstance(profile, (str, os.PathLike, model.Profile))):
            raise TypeError("libra_jax.optimize: profile must be a profile name, a path, a "
                            "model.Profile or its JSON document (a dict), got "
                            f"{type(profile).__name__}")

    def cache_key(self) -> tuple:
        profile = self.profile
        if isinstance(profile, model.Profile):
            profile = ("profile", profile)  # a value (`model.Profile`): equal ones share
        elif profile is not None:
            profile = ("name", os.fspath(profile))
        return (profile, self.fusion, self.blocks, self.overlap, self.loops, self.prefetch,
                self.prefetch_bytes)

    def resolved_profile(self) -> model.Profile:
        """The profile as a loaded `model.Profile`: resolved once per trace (None: the
        default backend's, `model.default_profile`)."""
        return model.resolve_profile(self.profile, jax.default_backend(),
                                     who="libra_jax.optimize")


def _aval_key(x: Any) -> Any:
    aval = jax.typeof(x) if hasattr(x, "shape") else type(x)
    return (type(x), str(aval), getattr(aval, "weak_type", None))


# --- The rewriter -------------------------------------------------------------

@dataclasses.dataclass
class _Site:
    """A psum or psum_scatter equation that the planner may allocate (and fuse), or an
    all_gather given the model's block count (`_Rewriter.gather_site`)."""

    index: int
    axes: tuple
    invariant: bool
    nbytes: int                     # the operand's bytes (a psum_scatter's: the unsharded buffer)
    explicit_blocks: int | None
    result: Any = None              # the psum's result variable (for `libra_jax.explain`)
    collective: str = "all-reduce"  # or "reduce-scatter" (a psum_scatter), "all-gather"
    # A psum_scatter's JAX params: (scatter_dimension, axis_size, tiled).
    scatter: tuple[int, int, bool] | None = None
    # An all_gather's: (all_gather_dimension, axis_size, tiled, invariant); `nbytes` is then
    # its result's (the gathered buffer's).
    gather: tuple[int, int, bool, bool] | None = None

    @property
    def bucket_class(self) -> tuple:
        """What the members of one bucket share: the collective, and a psum's invariance or a
        psum_scatter's group size; one scattered along another dimension than the first is a
        class of its own (its shards are not rows: fusing it would take a transposed copy)."""
        if self.scatter is None:
            return ("all-reduce", self.invariant)
        dimension, size, _ = self.scatter
        return ("reduce-scatter", size) if dimension == 0 else ("reduce-scatter", size, self.index)




@dataclasses.dataclass
class _Edits:
    """What one scope's rewrite changes, by equation position; `_schedule` applies it."""

    replacements: dict[int, Any] = dataclasses.field(default_factory=dict)
    removed: set[int] = dataclasses.field(default_factory=set)  # fused into a later member
    sink: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # moves after a bucket
    dones: dict[int, Any] = dataclasses.field(default_factory=dict)  # a start's -> its done
    # Equations placed right before / after the one at a position (an all-gather's start,
    # issued ahead: `_Rewriter.prefetch_gathers`); scheduled as the equations around them.
    before: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    after: dict[int, list[Any]] = dataclasses.field(default_factory=dict)

    @property
    def moved(self) -> set[int]:
        return {j for after in self.sink.values() for j in after}


def _gradient_sites(eqns: Sequence[Any], sites: Sequence[_Site], outvars: Sequence[Any],
                    transposed: bool = False) -> tuple[set[int], set[int] | None]:
    """(the gradient psums, the backward psums or None where no backward pass is visible):
    a gradient psum is on the backward pass (`_backward_sites`; every one, in the body of a
    transposed loop) and feeds no later psum (`_terminal_sites`); with no backward pass
    visible, every terminal psum."""
    terminal = _terminal_sites(eqns, sites, outvars)
    backward = {s.index for s in sites} if transposed else _backward_sites(eqns, sites)
    return (terminal if backward is None else terminal & backward), backward


def _kinds(sites: Sequence[_Site], gradient: set[int], backward: set[int] | None,
           in_loop: bool) -> dict[int, str]:
    """Each site's kind, by its equation's position: "user" (an explicit block count),
    "gradient" (planned; in a loop body, for one iteration), "loop" (any other psum of a
    loop body), "backward" or "forward"."""
    kinds = {}
    for site in sites:
        if site.explicit_blocks is not None:
            kind = "user"
        elif site.index in gradient:
            kind = "gradient"  # in a loop body too: planned for one iteration
        elif in_loop:
            kind = "loop"
        else:
            kind = "backward" if backward is not None and site.index in backward else "forward"
        kinds[site.index] = kind
    return kinds


def _schedule(eqns: Sequence[Any], edits: _Edits) -> list[Any]:
    """The scope's equations with `edits` applied, in order.

    Start/done: each started bucket waits with its done, the uses that moved and, as they
    come, every pure equation downstream of its results (the optimizer update), so the
    compute in between overlaps the all-reduce. An effect or another all-reduce reading a
    waiting result places it (and those started before) first. A done reads its own start's
    buffers and token, then the latest start's token: XLA orders by data only, and this keeps
    every done after the last start (after the backward pass), with no buffer passed twice (a
    second reader of the in-flight buffer would make XLA copy it while it is reduced)."""
    out: list[Any] = []
    waiting: list[tuple[set, list[Any]]] = []  # (variables defined, equations)
    latest: list[Any] = []  # the latest start's token
    skipped = edits.removed | edits.moved

    def place(groups: list[tuple[set, list[Any]]]) -> None:
        for _, (done, *rest) in groups:
            out.append(done.replace(invars=[*done.invars[:-1], latest[-1]]))
            out.extend(rest)

    def items() -> Iterable[tuple[int, Any, bool]]:  # (position, equation, the position's own)
        for i in range(len(eqns)):
            yield from ((i, e, False) for e in edits.before.get(i, ()))
            if i not in skipped:
                yield i, edits.replacements.get(i, eqns[i]), True
            yield from ((i, e, False) for e in edits.after.get(i, ()))

    for i, eqn, own in items():
        reads = {v for v in eqn.invars if _compat.is_var(v)}
        needed = [n for n, (defined, _) in enumerate(waiting) if defined & reads]
        if needed and not (eqn.effects or _is_psum(eqn) or (own and i in edits.dones)):
            defined, group = waiting[needed[-1]]
            group.append(eqn)
            defined.update(v for v in eqn.outvars if _compat.is_var(v))
            continue
        if needed:
            place(waiting[:needed[-1] + 1])
            del waiting[:needed[-1] + 1]
        out.append(eqn)
        if not own:
            continue
        after = [eqns[j] for j in edits.sink.get(i, ())]
        if i in edits.dones:
            latest.append(eqn.outvars[-1])
            group = [edits.dones[i]] + after
            waiting.append(({v for e in group for v in e.outvars if _compat.is_var(v)}, group))
        else:
            out.extend(after)
    place(waiting)
    return out


class _Rewriter:
    def __init__(self, options: _Options, report: OptimizeReport, program: Any) -> None:
        self.options = options
        self.report = report
        # Resolved once: the rewrite, its cost estimates and the report share this value.
        self.profile = options.resolved_profile()
        self.program = program  # the ClosedJaxpr being rewritten (for `call_id`)
        self.fingerprint: int | None = None
        self.calls = 0
        self.scope_names: collections.Counter[str] = collections.Counter()
        self.unplanned: list[str] = []  # `OptimizeReport.unplanned`, one entry per equation
        # (scope, a scan equation's position) -> the choice hoist_loops made for its stacked
        # slices: a LoopPlan, completed once the body is planned (`loop_report`).
        self.hoisting: dict[tuple[str, int], LoopPlan] = {}
        # Remat's re-gathers taken out of their `checkpoint` to be issued ahead
        # (`hoist_regathers`): their results, each with the checkpoint's cotangent it must
        # not start before.
        self.regathered: dict[Any, Any] = {}
        self.prefetch, self.prefetch_why = self.prefetch_mode()

    def prefetch_mode(self) -> tuple[int | None, str]:
        """(the distance all-gathers are issued at, None: the model's per scope; why "auto"
        issues one call each, or ""). ``prefetch="auto"`` takes the model's distance only on
        a GPU under ``LIBRA_JAX_CUDA=nccl`` (libra's GPU all-gather, issued on its own stream;
        not yet run on a GPU: opt-in with that path). On CPU one call each: it measures best
        on jax 0.10.2, whose XLA:CPU merges remat's re-gathers with the forward's for one call;
        on jax 0.12 the model's distance beat it on one FSDP MLP of three
        (benchmarks/results/fsdp_prefetch.md, fsdp_prefetch_jax0.12.md: the engine's copies
        and the compute share the same cores). On the other GPU paths the all-gathers are
        XLA's, which its own scheduler moves."""
        mode = self.options.prefetch
        if mode != "auto":
            return int(mode), ""
        if self.profile.fair_share is not None:
            return 0, ("on CPU one call where it is used measures as fast as issuing ahead or "
                       "faster (benchmarks/results/fsdp_prefetch.md); time prefetch=1 and 2 "
                       "for a large model")
        if config.cuda_path() != "nccl":
            return 0, ("libra's GPU all-gather is NCCL's (LIBRA_JAX_CUDA=nccl); on this path "
                       "the all-gathers are XLA's")
        return None, ""

    def call_id(self) -> int:
        """The id of the program's next start/done pair (`libra_jax.ops.start_done`): a fingerprint
        of the program's structure plus a count. The same program always gets the same ids,
        so a retrace hits JAX's compilation cache; programs of another structure get others."""
        if self.fingerprint is None:
            self.fingerprint = _fingerprint(self.program.jaxpr) >> 8
        self.calls += 1
        return (self.fingerprint + self.calls) % 2**56

    # One jaxpr scope, in phases: rewrite sub-jaxprs, find the psum sites, classify them,
    # plan the gradient ones, turn the plan into edits, schedule the equations.
    def jaxpr(self, jaxpr: Any, *, axis_sizes: dict, scope: str, in_loop: bool,
              transposed: bool = False, in_backward: bool = False) -> Any:
        """One scope rewritten. `in_loop`: it is (in) a loop body; `transposed`: it is the body
        of a loop autodiff's transpose made (the backward scan of scan-over-layers), all of
        it backward pass though its own equations do not say so; `in_backward`: it is (in) the
        body of any equation autodiff's transpose made (a `checkpoint`'s backward pass: its
        all-gathers are remat's re-gathers)."""
        eqns = self.hoist_loops(jaxpr.eqns, axis_sizes, scope)
        if not in_loop and self.prefetch != 0:
            eqns = self.hoist_regathers(eqns, axis_sizes)
        eqns = [self.sub_jaxprs(eqn, i, axis_sizes, scope, in_loop, in_backward)
                for i, eqn in enumerate(eqns)]
        eqns = self.fold_zero_psums(eqns, scope)
        eqns = _scatter_sliced_psums(eqns, jaxpr.outvars, axis_sizes)
        eqns = _sink_gathers(eqns)
        sites = [site for i, eqn in enumerate(eqns)
                 if (site := self.site(i, eqn, scope)) is not None]
        gathers = [site for i, eqn in enumerate(eqns)
                   if (site := self.gather_site(i, eqn)) is not None]
        served = {site.index for site in sites + gathers}
        for i, eqn in enumerate(eqns):
            other = _compat.OTHER_COLLECTIVES.get(eqn.primitive.name)
            libras = _LIBRA_UNPLANNED.get(eqn.primitive)
            if (other is not None or libras is not None) and i not in served:
                self.unplanned.append(f"{other or libras} over {_axis_names(eqn.params)} in "
                                      f"{scope}" + (" (libra's)" if libras else ""))
        edits = _Edits()
        invars = set(jaxpr.invars)
        self.edit_gathers(eqns, gathers, axis_sizes, scope, in_loop, in_backward or transposed,
                          invars, edits)
        if not sites:
            return jaxpr.replace(eqns=_schedule(eqns, edits))
        _warn_invariant_operands(eqns, sites)
        gradient, backward = _gradient_sites(eqns, sites, jaxpr.outvars, transposed)
        if in_loop and backward is None:
            # No backward pass in the body: a forward loop (a metric, a statistic per layer)
            # whose psums are no gradients; at top level this is a hand-written backward pass.
            gradient = set()
        kinds = _kinds(sites, gradient, backward, in_loop)
        # Compute that consumes a gradient all-reduce (the optimizer update) waits for it
        # and overlaps nothing: it is not part of the backward stream the planner sees.
        waits = _downstream_of(eqns, [eqns[i].outvars[0] for i in sorted(gradient)])
        costs = [0.0 if i in waits else _roofline_s(eqn, self.profile)
                 for i, eqn in enumerate(eqns)]
        # Gradient collectives over the same axes are one backward stream: their psums and
        # psum_scatters are planned together, a bucket holding one `_Site.bucket_class`.
        groups: dict[tuple, list[_Site]] = {}
        for site in sites:  # in jaxpr order: the report lists them so
            kind = kinds[site.index]
            if kind == "gradient":
                groups.setdefault(site.axes, []).append(site)
                continue
            k = site.explicit_blocks
            if k is None:
                k = allreduce.default_blocks(site.nbytes, _world(axis_sizes, site.axes),
                                             self.profile,
                                             collective=collectives.lax_name(site.collective))
                edits.replacements[site.index] = _single(eqns[site.index], site, k, invars)
            self.report.plans.append(PsumPlan(scope, site.axes, (site.index,), site.nbytes,
                                              k, kind, collective=site.collective))
        planned = [(axes, bucket, k)
                   for axes, members in groups.items()
                   for bucket, k in self.plan(members, costs, _world(axis_sizes, axes), scope,
                                              _reach(eqns, members), in_loop)]
        # In a loop body each bucket is one call: every iteration's all-reduces are done
        # within it, so a start/done pair could only overlap the rest of that iteration.
        # A bucket of psum_scatters is one call too (no start/done pair for it yet).
        splits = ([False] * len(planned) if in_loop else
                  self.split_buckets(eqns, jaxpr.outvars, [b for _, b, _ in planned]))
        for (axes, bucket, k), split in zip(planned, splits):
            split = split and bucket[0].collective == "all-reduce"
            self.edit_bucket(eqns, bucket, axes, bucket[0].invariant, k, split, scope, invars,
                             edits)
        return jaxpr.replace(eqns=_schedule(eqns, edits))

    def edit_gathers(self, eqns: Sequence[Any], gathers: Sequence[_Site], axis_sizes: dict,
                     scope: str, in_loop: bool, in_backward: bool, invars: set,
                     edits: _Edits) -> None:
        """Each all-gather (`gather_site`) as libra's, at the model's block count, or the count
        it was given (kind "user"). Kind "loop" in a loop body (one call each), "backward" on
        the backward pass (remat's re-gathers: in a scope autodiff's transpose made, reading
        what it computed, or taken out of their checkpoint by `hoist_regathers`), else
        "forward". A scope's forward and backward gathers over the same axes are issued as
        `prefetch_gathers` plans them: each one call where it is used
        (`allreduce.default_blocks`), or a start/done pair issued ahead."""
        if not gathers:
            return
        backward = _backward_sites(eqns, gathers) or set()
        kinds: dict[int, str] = {}
        ahead: dict[tuple, list[_Site]] = {}
        for site in gathers:
            if site.explicit_blocks is not None:
                kinds[site.index] = "user"
            elif in_loop:
                kinds[site.index] = "loop"
            else:
                kinds[site.index] = ("backward" if in_backward or site.index in backward
                                     or site.result in self.regathered else "forward")
                ahead.setdefault(site.axes, []).append(site)
        issued: dict[int, tuple[int, str, int]] = {}  # position -> (blocks, overlap, ahead)
        for sites in ahead.values():
            issued.update(self.prefetch_gathers(eqns, sites, axis_sizes, scope, edits))
        for site in gathers:
            k, overlap, distance = issued.get(site.index, (site.explicit_blocks, "sync", 0))
            if k is None:
                k = allreduce.default_blocks(site.nbytes, _world(axis_sizes, site.axes),
                                             self.profile, collective="all_gather")
            if site.explicit_blocks is None and site.index not in issued:
                edits.replacements[site.index] = _single(eqns[site.index], site, k, invars)
            self.report.plans.append(PsumPlan(scope, site.axes, (site.index,), site.nbytes,
                                              int(k), kinds[site.index], overlap,
                                              "all-gather", distance))

    def prefetch_gathers(self, eqns: Sequence[Any], sites: Sequence[_Site], axis_sizes: dict,
                         scope: str, edits: _Edits) -> dict[int, tuple[int, str, int]]:
        """Issue a scope's gathers over one set of axes (in jaxpr order: the forward pass's,
        then remat's re-gathers) ahead of their use, as the model plans them
        (`planner.plan_gathers`; ``optimize(prefetch=d)``: at distance d): gather i starts
        when gather i - d is done, reading that gather's result as an operand it ignores (XLA
        orders by data only, and drops an `optimization_barrier` on CPU: this keeps the start
        from moving earlier and holding its buffer longer), and is done where the one call
        was, before its first use. One that cannot start earlier (its operand is computed
        after that point) stays one call, except a re-gather out of its checkpoint
        (`hoist_regathers`), which is a pair at its place, its start reading the
        checkpoint's cotangent. Returns, per position issued as a pair, (blocks, "prefetch"
        and the distance, or "sync" and 0 at its place); positions left out are one call
        each."""
        world = _world(axis_sizes, sites[0].axes)
        if world < 2:
            return {}
        cap, cap_why = block_cap(self.profile)
        derivation = model.derive(self.profile, world, max_blocks=cap, max_blocks_why=cap_why)
        cost = derivation.cost
        positions = [site.index for site in sites]
        costs = [0.0 if i in positions else _roofline_s(eqn, self.profile)
                 for i, eqn in enumerate(eqns)]
        bounds = [*positions, len(eqns)]
        steps = [planner.GatherStep(float(sum(costs[bounds[j] + 1:bounds[j + 1]])),
                                    int(site.nbytes)) for j, site in enumerate(sites)]
        one_call = [derivation.no_overlap_key(site.nbytes, "all-gather") for site in sites]
        lead_s = float(sum(costs[:positions[0]]))
        if len(sites) == 1 and lead_s == 0:
            return {}  # no compute before its use: nothing to issue it ahead of
        # The model's choice (or the distance asked for), shown by `explain` even where
        # "auto" issues one call each (`prefetch_mode`).
        plan = planner.plan_gathers(
            steps, cost, one_call_blocks=one_call, max_bytes=self.options.prefetch_bytes,
            lead_s=lead_s, distance=None if self.options.prefetch == "auto" or
            not self.options.prefetch else int(self.options.prefetch))
        d = plan.distance if self.prefetch is None else min(plan.distance, self.prefetch)
        self.report.gathers.append({
            "scope": scope, "axes": sites[0].axes, "world": world, "steps": steps,
            "plan": plan, "distance": d, "why": self.prefetch_why if d != plan.distance else "",
            "cost": cost, "lead_s": lead_s, "positions": tuple(positions), "one_call": one_call,
            "operands": tuple(eqns[i].invars[0] for i in positions),
            "key_unit": derivation.key_unit, "profile": self.profile})
        defined = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
        results: dict[int, Any] = {}  # position -> the done's result (its gathered value)
        issued = {}
        for j, site in enumerate(sites):
            eqn = eqns[site.index]
            operand = eqn.invars[0]
            k = derivation.launch_blocks(plan.blocks[j])
            made = defined.get(operand, -1) if _compat.is_var(operand) else -1
            # Where it starts: right after gather j - d is done, or at the scope's start.
            at = positions[j - d] if j >= d else 0
            after = results.get(at) if j >= d else None
            ahead, place = d, edits.after if j >= d else edits.before
            if not d or made >= at:  # not issued ahead (its operand is computed later)
                cotangent = self.regathered.get(site.result)
                if cotangent is None:
                    continue  # one call where it is used
                # A re-gather out of its checkpoint: at its place, after its pass's cotangent
                # (else XLA could run it in the forward pass, holding its buffer).
                at, after, ahead, place = site.index, cotangent, 0, edits.before
            start, done = _gather_pair(eqn, site, k, self.call_id(), after)
            place.setdefault(at, []).append(start)
            edits.replacements[site.index] = done
            results[site.index] = done.outvars[0]
            issued[site.index] = (k, "prefetch" if ahead else "sync", ahead)
        return issued

    def hoist_regathers(self, eqns: Sequence[Any], axis_sizes: dict) -> list[Any]:
        """The scope's equations with remat's re-gathers taken out of their checkpoint: a
        `checkpoint` autodiff's transpose made (a layer's backward pass under `jax.checkpoint`)
        whose body all-gathers one of its inputs gets that gather's result as an input
        instead, the gather placed just before it, where `prefetch_gathers` may issue it
        ahead. The values are the same; what remat saves is unchanged (the gather still runs in
        the backward pass, not kept from the forward one). Each is noted with the
        checkpoint's last input computed in this scope (its cotangent), which its start waits
        for unless prefetched (so XLA cannot move it into the forward pass)."""
        out: list[Any] = []
        defined = {v for eqn in eqns for v in eqn.outvars}
        for eqn in eqns:
            body = eqn.params.get("jaxpr")
            if (eqn.primitive.name not in ("remat2", "checkpoint")
                    or not isinstance(body, _compat.Jaxpr) or body.constvars
                    or not _compat.made_by_transpose(eqn, deep=False)):
                out.append(eqn)
                continue
            position: dict[Any, int] = {v: i for i, v in enumerate(body.invars)}
            taken = [e for e in body.eqns
                     if self.gather_site(0, e) is not None and e.params.get("blocks") is None
                     and _compat.is_var(e.invars[0]) and e.invars[0] in position
                     and all(a in axis_sizes for a in _axis_names(e.params))]
            computed = [v for v in eqn.invars if _compat.is_var(v) and v in defined]
            if not taken or not computed:
                out.append(eqn)
                continue
            hoisted = []
            for e in taken:
                result = _compat.new_var(e.outvars[0].aval)
                hoisted.append(e.replace(invars=[eqn.invars[position[e.invars[0]]]],
                                         outvars=[result], source_info=eqn.source_info))
                self.regathered[result] = computed[-1]
            kept = [e for e in body.eqns if not any(e is t for t in taken)]
            new_body = body.replace(invars=[*body.invars, *(e.outvars[0] for e in taken)],
                                    eqns=kept)
            out.extend(hoisted)
            out.append(eqn.replace(invars=[*eqn.invars, *(e.outvars[0] for e in hoisted)],
                                   params={**eqn.params, "jaxpr": new_body}))
        return out

    def gather_site(self, index: int, eqn: Any) -> _Site | None:
        """An all_gather (JAX's, either kind, or libra's) that libra's engine can serve: not
        over `axis_index_groups` or positional axes, of a dtype of whole bytes, not of
        unreduced or reduced inputs. Others stay as they are (`OptimizeReport.unplanned`)."""
        name = eqn.primitive.name
        if name not in _GATHERS and eqn.primitive is not libra_all_gather_p:
            return None
        p = eqn.params
        axes = _axis_names(p)
        aval = eqn.invars[0].aval
        if (p.get("axis_index_groups") is not None or any(isinstance(a, int) for a in axes)
                or not allreduce.copyable(aval.dtype)
                or _compat.input_state(aval, axes) in ("unreduced", "reduced")):
            return None
        invariant = p.get("invariant", name == _compat.all_gather_invariant_p.name)
        return _Site(index, axes, False, _nbytes(eqn.outvars[0].aval), p.get("blocks"),
                     eqn.outvars[0], "all-gather",
                     gather=(int(p["all_gather_dimension"]), int(p["axis_size"]),
                             bool(p["tiled"]), bool(invariant)))

    def hoist_loops(self, eqns: Sequence[Any], axis_sizes: dict, scope: str) -> list[Any]:
        """The scope's equations with each scan's hoistable psums (`loops.hoistable`) taken out
        of the loop where `loop_plan` says so; the others' loops get its block count."""
        out: list[Any] = []
        for eqn in eqns:
            hoists = [h for h in loops.hoistable(eqn) if all(a in axis_sizes for a in h.axes)]
            hoists = [h for h in hoists if hoists and h.axes == hoists[0].axes]
            if not hoists or _world(axis_sizes, hoists[0].axes) < 2:
                out.append(eqn)
                continue
            plan = self.loop_plan(eqn, hoists, _world(axis_sizes, hoists[0].axes), scope,
                                  len(out))
            self.hoisting[(scope, len(out))] = plan
            if plan.choice == "hoist":
                out.extend(loops.hoist(eqn, hoists))
            else:
                out.append(eqn)
        return out

    def loop_plan(self, eqn: Any, hoists: list[loops.Hoist], world: int, scope: str,
                  index: int) -> LoopPlan:
        """Hoist or keep one scan's hoistable psums: the model's predicted time of the loop with
        them planned in the body (the planner's buckets for one iteration, overlapping the
        rest of it), against the loop's compute followed by one all-reduce of every
        iteration's slices (what hoisting gives before the planner fuses and overlaps it with
        the scope's other gradients: an upper bound). The body's other psums are the same
        either way and left out of both. `gradient` and `calls` are filled in once the body
        is planned (`sub_jaxprs`)."""
        body = eqn.params["jaxpr"].jaxpr
        length = int(eqn.params["length"])
        costs = [_roofline_s(e, self.profile) for e in body.eqns]
        layers, start = [], 0
        for h in sorted(hoists, key=lambda h: h.psum):
            layers.append(planner.Layer(compute_s=float(sum(costs[start:h.psum])),
                                        grad_bytes=h.nbytes))
            start = h.psum + 1
        layers.append(planner.Layer(compute_s=float(sum(costs[start:])), grad_bytes=0))
        cap, cap_why = block_cap(self.profile)
        cost = model.derive(self.profile, world, max_blocks=cap, max_blocks_why=cap_why).cost
        nbytes = sum(h.nbytes for h in hoists)
        whole = [planner.Layer(compute_s=length * sum(layer.compute_s for layer in layers),
                               grad_bytes=length * nbytes)]
        in_loop_s = length * planner.plan(layers, cost, fusion=self.options.fusion).backward_s
        hoisted_s = min(planner.simulate(whole, [planner.Bucket(0, 0, k)], cost)
                        for k in cost.keys)
        choice = self.options.loops
        if choice == "auto":
            choice = "hoist" if hoisted_s <= in_loop_s else "in-loop"
        return LoopPlan(scope, index, length, body="", gradient=0, calls=0, psums=len(hoists),
                        nbytes=nbytes, choice=choice, in_loop_s=in_loop_s, hoisted_s=hoisted_s)

    def edit_bucket(self, eqns: Sequence[Any], bucket: list[_Site], axes: tuple,
                    invariant: bool, k: int, split: bool, scope: str, invars: set,
                    edits: _Edits) -> None:
        """The edits that issue one planned gradient bucket: fused (or, where its members
        cannot be one call, each alone), as one call or a start/done pair; and its report."""
        mode = "start-done" if split else "sync"
        if len(bucket) == 1 or not _can_fuse(eqns, bucket):
            for site in bucket:
                if split:
                    edits.replacements[site.index], edits.dones[site.index] = _start_done(
                        eqns, [site], axes, invariant, k, self.call_id())
                else:
                    edits.replacements[site.index] = _single(eqns[site.index], site, k, invars)
            self.report.plans.extend(
                PsumPlan(scope, axes, (s.index,), s.nbytes, k, "gradient", mode, s.collective)
                for s in bucket)
            return
        last = bucket[-1].index
        if split:
            edits.replacements[last], edits.dones[last] = _start_done(
                eqns, bucket, axes, invariant, k, self.call_id())
        else:
            edits.replacements[last] = _fused(eqns, bucket, axes, invariant, k)
        edits.removed.update(site.index for site in bucket[:-1])
        edits.sink[last] = _sunk(eqns, bucket)
        self.report.plans.append(PsumPlan(scope, axes, tuple(s.index for s in bucket),
                                          sum(s.nbytes for s in bucket), k, "gradient", mode,
                                          bucket[0].collective))

    def split_buckets(self, eqns: Sequence[Any], outvars: Sequence[Any],
                      buckets: list[list[_Site]]) -> list[bool]:
        """Per gradient bucket, whether it is issued as a start/done pair (else one call).

        "auto" weighs what each way costs. A start/done pair defers the bucket's own
        downstream work (its optimizer update) until after the backward pass, where nothing
        hides it: it costs that work's roofline time. One call lets that work run beside the
        rest of the backward pass, but leaves the all-reduce pending in the device's program
        until the last rank arrives: on XLA:CPU that costs the step about the profile's
        `pending_allreduce_us` (measured, benchmarks/results/end_to_end.md). On a GPU under
        ``LIBRA_JAX_CUDA=nccl`` every bucket is a pair: libra's NCCL call as one call makes
        XLA's stream wait for it at once, which serialises it with the backward pass. Other
        profiles without `pending_allreduce_us` (the GPU forms on the other paths, until
        `benchmarks/gpu_check.sh` has measured start/done) issue one call."""
        mode = self.options.overlap
        if mode != "auto":
            return [mode == "start-done"] * len(buckets)
        fair_share = self.profile.fair_share
        if fair_share is None and config.cuda_path() == "nccl":
            return [True] * len(buckets)
        pending_s = fair_share.pending_allreduce_s if fair_share is not None else None
        if pending_s is None:
            return [False] * len(buckets)
        return [deferred < pending_s for deferred in self.deferred_s(eqns, outvars, buckets)]

    def deferred_s(self, eqns: Sequence[Any], outvars: Sequence[Any],
                   buckets: list[list[_Site]]) -> list[float]:
        """Per bucket, the predicted seconds of the work that waits for its all-reduce alone:
        the pure equations downstream of its results and of no other bucket's, priced as one
        fused region (`_region_roofline_s`), as XLA fuses an optimizer's elementwise chain."""
        reached = [_downstream_of(eqns, [eqns[s.index].outvars[0] for s in bucket])
                   for bucket in buckets]
        shared = collections.Counter(i for r in reached for i in r)
        readers: dict[Any, list[int]] = {}
        for i, eqn in enumerate(eqns):
            for v in eqn.invars:
                if _compat.is_var(v):
                    readers.setdefault(v, []).append(i)
        for v in outvars:
            if _compat.is_var(v):
                readers.setdefault(v, []).append(len(eqns))  # read after the last equation
        return [_region_roofline_s(eqns, [i for i in sorted(r) if shared[i] == 1
                                          and not eqns[i].effects], readers, self.profile)
                for r in reached]

    def plan(self, members: list[_Site], costs: list[float], world: int, scope: str,
             reach: list[int] | None = None, in_loop: bool = False
             ) -> Iterable[tuple[list[_Site], int]]:
        """Buckets (lists of sites) and their block counts for one group of gradient psums.
        `reach` (`_reach`): which psums can share a fused bucket; the plan keeps to it.
        `in_loop`: the scope is a loop body, and this is one iteration's plan."""
        if world < 2:
            return [([site], 1) for site in members]
        cap, cap_why = block_cap(self.profile)
        derivation = model.derive(self.profile, world, max_blocks=cap, max_blocks_why=cap_why)
        layers, start = [], 0
        for site in members:
            layers.append(planner.Layer(compute_s=float(sum(costs[start:site.index])),
                                        grad_bytes=int(site.nbytes), collective=site.collective))
            start = site.index + 1
        reach = _within_class(members, reach)
        cost = derivation.cost
        fixed = self.options.blocks
        if fixed is not None:
            key = derivation.key_for_blocks(fixed)  # stands for it in the model
            if self.options.fusion:
                buckets = planner.plan_fusion_only(layers, cost, blocks=key, reach=reach).buckets
            else:
                buckets = [planner.Bucket(i, i, key) for i in range(len(layers))]
        else:
            buckets = planner.plan(layers, cost, fusion=self.options.fusion, reach=reach).buckets
        # A bucket that cannot be one fused all-reduce runs as several: predict what runs.
        buckets = planner.within_reach(buckets, reach)
        self.report.predicted.append({
            "scope": scope, "layers": layers, "buckets": list(buckets), "in_loop": in_loop,
            "backward_s": planner.simulate(layers, buckets, cost),
            # The loaded profile and its derivation: `explain` reads these, never a name.
            "profile": self.profile, "derivation": derivation, "world": world,
            # For `libra_jax.explain`: per layer, the psum's equation index and result variable;
            # the cost model and what its keys count.
            "axes": members[0].axes, "members": tuple(s.index for s in members),
            "results": tuple(s.result for s in members), "cost": cost,
            "key_unit": derivation.key_unit, "reach": reach,
            # Said where the cap took an option away.
            "limit": (f"block counts at most {cap}: {cap_why}"
                      if cap is not None and any(cap_why in why
                                                 for why in derivation.dropped.values())
                      else ""),
        })
        out = []
        for bucket in buckets:
            if self.options.blocks is not None:
                k = self.options.blocks
            else:
                k = derivation.launch_blocks(bucket.blocks)
            out.append((members[bucket.first:bucket.last + 1], k))
        return out

    def fold_zero_psums(self, eqns: list[Any], scope: str) -> list[Any]:
        """psums whose operand is a known zero (a literal, or broadcast from one), computed
        as ``z + z`` without a call: the gradient of a float leaf that no derivative reaches
        (Equinox's ``Dropout.p``) is a constant zero, and each ``pmean`` of it was a 4-byte
        all-reduce of its own. Bitwise `jax.lax.psum`'s: XLA's simplifier turns a sum
        all-reduce of an operand the same on every rank (a constant) into the operand times
        the group size, so a zero keeps its sign (-0 stays -0), as it does in ``z + z``.
        Only where the psum's result has its operand's type (no varying axes to drop); other
        constants stay psums, planned (their product and a rank-order sum round
        differently)."""
        zeros: set[Any] = set()

        def is_zero(v: Any) -> bool:
            if _compat.is_var(v):
                return v in zeros
            value = np.asarray(getattr(v, "val", np.nan))
            return value.size > 0 and bool(np.all(value == 0))

        out = []
        for eqn in eqns:
            name = eqn.primitive.name
            operand = eqn.invars[0] if len(eqn.invars) == 1 else None
            if name in ("broadcast_in_dim", "convert_element_type") and is_zero(operand):
                zeros.add(eqn.outvars[0])
            elif ((name in _compat.PSUM_PRIMITIVES or eqn.primitive is libra_psum_p)
                  and operand is not None and is_zero(operand)
                  and _same_type(operand.aval, eqn.outvars[0].aval)):
                eqn = eqn.replace(primitive=jax.lax.add_p, invars=[operand, operand], params={})
                zeros.add(eqn.outvars[0])
                self.report.folded.append(f"{name} of zeros in {scope}")
            out.append(eqn)
        return out

    def site(self, index: int, eqn: Any, scope: str) -> _Site | None:
        name = eqn.primitive.name
        if name in _compat.PSUM_PRIMITIVES:
            axes = tuple(eqn.params["axes"])
            if eqn.params.get("axis_index_groups") is not None:
                self.report.skipped.append(f"{name} with axis_index_groups in {scope}")
                return None
            if any(isinstance(a, int) for a in axes):
                self.report.skipped.append(f"{name} over positional axes in {scope}")
                return None
            aval = eqn.invars[0].aval
            if allreduce.engine_dtype(aval.dtype) is None:
                self.report.skipped.append(f"{name} of {aval.dtype} in {scope}")
                return None
            return _Site(index, axes, _compat.PSUM_PRIMITIVES[name], _nbytes(aval), None,
                         eqn.outvars[0])
        if eqn.primitive is libra_psum_p:
            p = eqn.params
            return _Site(index, tuple(p["axes"]), p["invariant"], _nbytes(eqn.invars[0].aval),
                         p["blocks"], eqn.outvars[0])
        if name == _compat.reduce_scatter_p.name or eqn.primitive is libra_reduce_scatter_p:
            p = eqn.params
            axes = _axis_names(p)
            aval = eqn.invars[0].aval
            if p.get("axis_index_groups") is not None:
                why = "with axis_index_groups"
            elif any(isinstance(a, int) for a in axes):
                why = "over positional axes"
            elif np.dtype(aval.dtype) not in _lowering.ENGINE_DTYPES:
                why = f"of {aval.dtype}"
            else:
                return _Site(index, axes, False, _nbytes(aval), p.get("blocks"), eqn.outvars[0],
                             "reduce-scatter",
                             (int(p["scatter_dimension"]), int(p["axis_size"]), bool(p["tiled"])))
            self.report.skipped.append(f"psum_scatter {why} in {scope}")
        return None

    def sub_jaxprs(self, eqn: Any, index: int, axis_sizes: dict, scope: str,
                   in_loop: bool, in_backward: bool = False) -> Any:
        rule = _compat.HIGHER_ORDER.get(eqn.primitive.name)
        if rule is None:
            if any(_contains_psum(j) for j in _compat.jaxprs_in_params(eqn.params)):
                self.report.skipped.append(
                    f"psum inside '{eqn.primitive.name}' (no rewrite rule) in {scope}")
            return eqn
        loop, mesh_param = rule.loop, rule.mesh_param
        sizes = dict(axis_sizes)
        if mesh_param is not None:
            sizes.update(_compat.mesh_axis_sizes(eqn.params[mesh_param]))
        base = f"{scope}/{eqn.primitive.name}"
        bodies: list[str] = []
        first_plan = len(self.report.plans)

        made_by_transpose = _compat.made_by_transpose(eqn, deep=False)
        transposed = loop and made_by_transpose

        def rewrite(j: Any) -> Any:
            bodies.append(self.unique_scope(base))
            return self.jaxpr(j, axis_sizes=sizes, scope=bodies[-1], in_loop=in_loop or loop,
                              transposed=transposed, in_backward=in_backward or made_by_transpose)
        params = {name: _map_jaxprs(value, rewrite) for name, value in eqn.params.items()}
        hoisting = self.hoisting.pop((scope, index), None)
        if loop:
            self.loop_report(eqn, index, scope, bodies, first_plan, hoisting)
        return eqn.replace(params=params)

    def loop_report(self, eqn: Any, index: int, scope: str, bodies: list[str], first_plan: int,
                    hoisting: LoopPlan | None) -> None:
        """The `LoopPlan` of a loop whose body was just planned: its gradient buckets, run once
        per iteration, and the hoisting choice `hoist_loops` made for it, if any."""
        planned = [p for p in self.report.plans[first_plan:]
                   if p.kind == "gradient" and p.scope in bodies]
        if not planned and hoisting is None:
            return
        body = planned[0].scope if planned else bodies[-1]
        length = int(eqn.params["length"]) if "length" in eqn.params else None
        kept = sum(len(p.members) for p in self.report.plans[first_plan:]
                   if p.scope in bodies and p.kind != "gradient" and p.collective != "all-gather")
        gradient = sum(len(p.members) for p in planned)
        if hoisting is None:
            hoisting = LoopPlan(scope, index, length, body, gradient, len(planned))
        self.report.loops.append(dataclasses.replace(
            hoisting, body=body, gradient=gradient, calls=len(planned), kept=kept))

    def unique_scope(self, base: str) -> str:
        """`base`, or ``base#n`` for its n-th sub-jaxpr of the program (two shard_maps in one
        step, a cond's branches): every scope of a report has its own name."""
        self.scope_names[base] += 1
        n = self.scope_names[base]
        return base if n == 1 else f"{base}#{n}"


#: Where `optimize`'s notices point a GSPMD step: the route that puts its gradient
#: all-reduces in the traced program (`libra_jax.data_parallel`).
GSPMD_ROUTE = ("to have its gradient all-reduces planned, compute the gradient with "
               "libra_jax.value_and_grad(loss_fn, axis_name=...) in jax.value_and_grad's place "
               "(docs/gspmd.md)")
#: What `optimize` does with the collectives of sharded steps, said with those it leaves.
UNPLANNED_NOTICE = ("optimize plans the gradient psum_scatters of sharded parameters (FSDP, "
                    "ZeRO) with the psums, and runs every all_gather it can serve on libra's "
                    "engine, one call each at the model's block count; these it cannot serve "
                    "(axis_index_groups, positional axes, dtypes not of whole bytes) or does "
                    "not run (all_to_all, ppermute, pmax, pmin) keep their lowering.")
#: libra's own collectives that `optimize` leaves at their own blocks where it does not serve
#: them (named as `jax.lax` names them).
_LIBRA_UNPLANNED = {libra_reduce_scatter_p: "psum_scatter", libra_all_gather_p: "all_gather"}


def gspmd_notice(values: Iterable[Any]) -> tuple[bool, str]:
    """What `optimize` says of a step with no psum and no `shard_map`/`pmap`, and whether it is
    a GSPMD step: with inputs sharded over a mesh (their avals' or arrays' `NamedSharding`; a
    `jax.set_mesh` context), a GSPMD step (True), whose collectives XLA's partitioner inserts
    after tracing; else (False) possibly a single-device step."""
    axes: dict[str, None] = {}
    for value in values:
        sharding = getattr(value, "sharding", None)
        spec = getattr(sharding, "spec", None)
        if spec is None:
            continue
        for entry in spec:
            for name in (entry if isinstance(entry, tuple) else (entry,)):
                if name is not None:
                    axes[str(name)] = None
    context = jax.sharding.get_abstract_mesh()
    if axes or not context.empty:
        where = (f"its inputs are sharded over mesh axes {tuple(axes)}" if axes
                 else f"it is traced under the mesh {dict(context.shape)}")
        return True, (f"the step has no psum and {where}: a GSPMD step, whose all-reduces "
                      "XLA's partitioner inserts after tracing, where optimize cannot see them, "
                      f"so it is left as it is; {GSPMD_ROUTE}")
    return False, ("the step has no psum and no jax.shard_map or jax.pmap, so there is nothing "
                   "to plan. If it runs on several devices through shardings (GSPMD: jax.jit "
                   "with NamedSharding inputs), XLA's partitioner inserts its all-reduces after "
                   f"tracing, where optimize cannot see them; {GSPMD_ROUTE}")


def _maps_devices(jaxpr: Any) -> bool:
    """Whether `jaxpr` holds a psum or a `shard_map`/`pmap` (where psums could be)."""
    for eqn in jaxpr.eqns:
        if _is_psum(eqn) or eqn.primitive.name in _compat.DEVICE_MAPS:
            return True
        if any(_maps_devices(getattr(j, "jaxpr", j)) for j in _compat.jaxprs_in_params(eqn.params)):
            return True
    return False


def _map_jaxprs(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` to every Jaxpr in a param value (ClosedJaxpr, Jaxpr or a tuple of them)."""
    if isinstance(value, _compat.ClosedJaxpr):
        return _compat.closed_jaxpr(fn(value.jaxpr), value.consts)
    if isinstance(value, _compat.Jaxpr):
        return fn(value)
    if isinstance(value, tuple) and any(isinstance(v, (_compat.ClosedJaxpr, _compat.Jaxpr))
                                        for v in value):
        return tuple(_map_jaxprs(v, fn) for v in value)
    return value


def _is_psum(eqn: Any) -> bool:
    """A psum or a psum_scatter (the collectives `optimize` plans), as JAX's or libra's."""
    return (eqn.primitive.name in _compat.PSUM_PRIMITIVES
            or eqn.primitive.name == _compat.reduce_scatter_p.name
            or eqn.primitive in (libra_psum_p, libra_psum_fused_p, libra_psum_start_p,
                                 libra_reduce_scatter_p, libra_reduce_scatter_fused_p))


#: Scalar integer primitives `_rank_values` evaluates (a slice start computed from
#: `axis_index`, as JAX's `all_gather_invariant` transpose and `dynamic_slice_in_dim` write it).
_INDEX_OPS: dict[str, Callable[..., Any]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative,
    "rem": np.remainder, "max": np.maximum, "min": np.minimum, "lt": np.less,
    "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "convert_element_type": lambda x: x, "pvary": lambda x: x,
    "select_n": lambda which, *cases: cases[int(which)],
}


def _rank_values(v: Any, producer: dict, axis: Any, world: int) -> list[int] | None:
    """The value of scalar `v` on each rank 0..world-1 of `axis`, where it is computed from
    `axis_index(axis)` and literals by `_INDEX_OPS` alone; else None."""
    def value(u: Any, rank: int, depth: int) -> Any:
        if not _compat.is_var(u):
            return np.asarray(u.val)
        eqn = producer.get(u)
        if eqn is None or depth > 32:
            raise LookupError
        name = eqn.primitive.name
        if name == "axis_index":
            if _axis_names(eqn.params) != (axis,):
                raise LookupError
            return np.int64(rank)
        op = _INDEX_OPS.get(name)
        if op is None or len(eqn.outvars) != 1 or getattr(u.aval, "shape", None) != ():
            raise LookupError
        return op(*(value(w, rank, depth + 1) for w in eqn.invars))
    try:
        return [int(value(v, rank, 0)) for rank in range(world)]
    except (LookupError, TypeError, ValueError, IndexError):
        return None


def _scatter_sliced_psums(eqns: Sequence[Any], outvars: Sequence[Any], axis_sizes: dict
                          ) -> list[Any]:
    """`eqns` with each psum whose only use is this rank's slice of its result (the gradient
    of ``all_gather(to='invarying')``: a `psum_invariant`, a `pvary`, a `dynamic_slice` of
    ``size / n`` rows at ``axis_index * size / n``, and for an untiled gather a `squeeze`)
    turned into the `reduce_scatter` (psum_scatter) that computes that slice: bitwise the
    same, since libra sums each element over the ranks in the same order either way, and half
    the bytes. The psum's equation becomes the reduce-scatter (so it is ready as early), the
    slice's equations go; the start index's arithmetic is left to XLA's dead-code pass. Each
    rank's start is checked by evaluating it for every rank (`_rank_values`)."""
    producer = {v: e for e in eqns for v in e.outvars if _compat.is_var(v)}
    uses: collections.Counter[Any] = collections.Counter(
        v for e in eqns for v in e.invars if _compat.is_var(v))
    uses.update(v for v in outvars if _compat.is_var(v))
    readers = {v: e for e in eqns for v in e.invars if _compat.is_var(v)}
    out = list(eqns)
    position = {id(e): i for i, e in enumerate(eqns)}
    for i, eqn in enumerate(eqns):
        if eqn.primitive.name not in _compat.PSUM_PRIMITIVES or len(eqn.invars) != 1:
            continue
        axes = _axis_names(eqn.params)
        world = axis_sizes.get(axes[0]) if len(axes) == 1 else None
        result = eqn.outvars[0]
        cast = readers.get(result) if uses[result] == 1 else None
        if cast is not None and cast.primitive.name == "pvary":
            sliced = readers.get(cast.outvars[0]) if uses[cast.outvars[0]] == 1 else None
        else:
            sliced, cast = (cast, None)
        if (world is None or world < 2 or eqn.params.get("axis_index_groups") is not None
                or sliced is None or sliced.primitive.name != "dynamic_slice"):
            continue
        shape = tuple(result.aval.shape)
        sizes = tuple(sliced.params["slice_sizes"])
        cut = [d for d, (a, b) in enumerate(zip(shape, sizes)) if a != b]
        if len(cut) != 1 or shape[cut[0]] != sizes[cut[0]] * world:
            continue
        d = cut[0]
        starts = [_rank_values(v, producer, axes[0], world) for v in sliced.invars[1:]]
        if any(s is None for s in starts) or any(
                starts[k] != ([r * sizes[d] for r in range(world)] if k == d else [0] * world)
                for k in range(len(starts))):
            continue
        target, tiled, gone = sliced, True, [sliced]
        squeeze = readers.get(sliced.outvars[0]) if uses[sliced.outvars[0]] == 1 else None
        if (sizes[d] == 1 and squeeze is not None and squeeze.primitive.name == "squeeze"
                and tuple(squeeze.params["dimensions"]) == (d,)):
            target, tiled, gone = squeeze, False, [sliced, squeeze]
        out[i] = eqn.replace(
            primitive=_compat.reduce_scatter_p, outvars=list(target.outvars),
            params=dict(axis_name=axes, scatter_dimension=d, axis_index_groups=None,
                        axis_size=world, tiled=tiled))
        for e in gone + ([cast] if cast is not None else []):
            out[position[id(e)]] = None
    return [e for e in out if e is not None]


def _sink_gathers(eqns: Sequence[Any]) -> list[Any]:
    """The scope's equations with each all-gather moved down to just before its first reader.
    FSDP code often gathers every parameter up front (the GSPMD route does: `data_parallel`),
    which holds them all gathered from the scope's start and leaves no compute to issue a
    gather ahead of; at its first use it is where `_Rewriter.prefetch_gathers` expects it. An
    all-gather is pure and its operand is defined earlier still, so the values are unchanged;
    one that nothing in the scope reads (a scope's output) stays where it is."""
    first_use: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if _compat.is_var(v):
                first_use.setdefault(v, i)
    moved: dict[int, list[Any]] = {}
    out: list[Any] = []
    for i, eqn in enumerate(eqns):
        out.extend(moved.pop(i, ()))
        use = first_use.get(eqn.outvars[0], i + 1) if eqn.outvars else i + 1
        if (eqn.primitive.name in _GATHERS or eqn.primitive is libra_all_gather_p) and use > i + 1:
            moved.setdefault(use, []).append(eqn)
        else:
            out.append(eqn)
    return out


def _axis_names(params: dict) -> tuple:
    """A collective equation's axes as a tuple (``axis_name`` or ``axes``, one or several)."""
    axes = params.get("axis_name", params.get("axes"))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


#: JAX's all-gather primitives (`to='varying'` and `to='invarying'`).
_GATHERS = (_compat.all_gather_p.name, _compat.all_gather_invariant_p.name)


def _within_class(members: Sequence[_Site], reach: Sequence[int] | None) -> list[int]:
    """`reach` (`_reach`) cut at the end of each member's run of one `_Site.bucket_class`: a
    bucket is one collective of one kind."""
    end = len(members) - 1
    out = [end] * len(members) if reach is None else list(reach)
    for m in range(len(members) - 1, -1, -1):
        if m + 1 < len(members) and members[m + 1].bucket_class != members[m].bucket_class:
            end = m
        out[m] = min(out[m], end)
    return out


def _collective_counts(jaxpr: Any) -> collections.Counter[str]:
    """How many collectives of each kind `jaxpr` holds, sub-jaxprs included, by the name
    `jax.lax` gives them (a psum, pmean's too: "psum")."""
    counts: collections.Counter[str] = collections.Counter()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _compat.PSUM_PRIMITIVES or eqn.primitive is libra_psum_p:
            counts["psum"] += 1
        elif name == _compat.reduce_scatter_p.name or eqn.primitive is libra_reduce_scatter_p:
            counts["psum_scatter"] += 1
        elif name in _GATHERS or eqn.primitive is libra_all_gather_p:
            counts["all_gather"] += 1
        for sub in _compat.jaxprs_in_params(eqn.params):
            counts.update(_collective_counts(sub))
    return counts


def _contains_psum(jaxpr: Any) -> bool:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(_is_psum(eqn) or any(_contains_psum(j) for j in _compat.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def _warn_invariant_operands(eqns: Sequence[Any], sites: Sequence[_Site]) -> None:
    """`allreduce.warn_invariant_operand` for a psum whose operand is a `pvary` of the
    program (not of autodiff's transpose) over its axes: `lax.psum` casts an array that is
    already invariant that way (under `check_vma`) before summing it."""
    producer = {v: eqn for eqn in eqns for v in eqn.outvars if _compat.is_var(v)}
    for site in sites:
        operand = eqns[site.index].invars[0]
        cast = producer.get(operand) if _compat.is_var(operand) else None
        if (cast is not None and cast.primitive.name == "pvary"
                and not _compat.made_by_transpose(cast)
                and set(site.axes) <= set(cast.params.get("axes", ()))):
            allreduce.warn_invariant_operand(site.axes, "libra_jax.optimize")


def _backward_sites(eqns: Sequence[Any], sites: Sequence[_Site]) -> set[int] | None:
    """Indices of the psums on the backward pass: made by autodiff's transpose (the psum of
    a replicated input's cotangent that `check_vma` inserts) or reading a value that depends
    on an equation it made (an explicit `pmean(grads)`). None where no equation of the scope
    was made by a transpose: no backward pass is visible (a hand-written one, or none)."""
    site_index = {s.index for s in sites}
    derived: set[Any] = set()
    seen_backward = False
    out: set[int] = set()
    for i, eqn in enumerate(eqns):
        made = _compat.made_by_transpose(eqn)
        seen_backward |= made
        if made or any(_compat.is_var(v) and v in derived for v in eqn.invars):
            derived.update(v for v in eqn.outvars if _compat.is_var(v))
            if i in site_index:
                out.add(i)
    return out if seen_backward else None


def _terminal_sites(eqns: Sequence[Any], sites: Sequence[_Site], outvars: Sequence[Any]) -> set[int]:
    """Indices of psums whose results feed no later psum. A later equation with a psum in
    a sub-jaxpr (a jit, a loop) counts as a psum. The gradient psums are the terminal psums
    on the backward pass (`_backward_sites`), or all terminal ones where none is visible."""
    site_index = {s.index for s in sites}
    # Backwards over the equations: does a value (transitively) reach a psum?
    feeds_psum: set[Any] = set()
    terminal: set[int] = set()
    for i in range(len(eqns) - 1, -1, -1):
        eqn = eqns[i]
        hides_psum = any(_contains_psum(j) for j in _compat.jaxprs_in_params(eqn.params))
        reaches = (i in site_index or hides_psum
                   or any(_compat.is_var(v) and v in feeds_psum for v in eqn.outvars))
        if i in site_index and not any(v in feeds_psum for v in eqn.outvars if _compat.is_var(v)):
            terminal.add(i)
        if reaches:
            feeds_psum.update(v for v in eqn.invars if _compat.is_var(v))
    return terminal


def _downstream_of(eqns: Sequence[Any], seeds: Sequence[Any]) -> set[int]:
    """Indices of the equations that (transitively) use one of the `seeds` variables."""
    tainted = {v for v in seeds if _compat.is_var(v)}
    out: set[int] = set()
    for i, eqn in enumerate(eqns):
        if any(_compat.is_var(v) and v in tainted for v in eqn.invars):
            out.add(i)
            tainted.update(v for v in eqn.outvars if _compat.is_var(v))
    return out


def _sunk(eqns: Sequence[Any], bucket: Sequence[_Site]) -> list[int]:
    """The equations between a bucket's first and last member that use (transitively) an
    earlier member's result. The fused all-reduce lands where the last member was, so these
    move to just after it; `_reach` guarantees that no member needs them."""
    first, last = bucket[0].index, bucket[-1].index
    members = {s.index for s in bucket}
    tainted = {v for s in bucket[:-1] for v in eqns[s.index].outvars if _compat.is_var(v)}
    out = []
    for i in range(first + 1, last):
        eqn = eqns[i]
        if i not in members and any(_compat.is_var(v) and v in tainted for v in eqn.invars):
            out.append(i)
            tainted.update(v for v in eqn.outvars if _compat.is_var(v))
    return out


def _can_fuse(eqns: Sequence[Any], bucket: Sequence[_Site]) -> bool:
    """Whether the bucket can be one all-reduce where its last member was: the equations that
    must move after it (`_sunk`) hold no psum (another group's plan may move or fuse it) and
    no effect (their order with other effects is kept)."""
    return not any(_is_psum(eqns[i]) or eqns[i].effects for i in _sunk(eqns, bucket))


def _reach(eqns: Sequence[Any], members: Sequence[_Site]) -> list[int]:
    """Per member psum, the last member it may share a fused bucket with (`planner.plan`'s
    `reach`). A fused bucket lands where its last member is, and what uses an earlier member's
    result in between moves after it (`_sunk`): so member m reaches up to (not including) the
    first later member whose operand depends on m's result, or the first effectful equation
    that does. One pass, with each variable's dependence on members as a bit set."""
    index = [s.index for s in members]
    member_of = {i: m for m, i in enumerate(index)}
    depends: dict[Any, int] = {}
    limit = [len(members)] * len(members)  # the first member m may not share a bucket with
    for i, eqn in enumerate(eqns):
        mask = 0
        for v in eqn.invars:
            if _compat.is_var(v):
                mask |= depends.get(v, 0)
        m = member_of.get(i)
        stop = m if m is not None else (bisect.bisect_left(index, i) if eqn.effects else None)
        if mask and stop is not None:
            bits = mask
            while bits:
                low = bits & -bits
                j = low.bit_length() - 1
                limit[j] = min(limit[j], stop)
                bits ^= low
        if m is not None:
            mask |= 1 << m
        if mask:
            for v in eqn.outvars:
                if _compat.is_var(v):
                    depends[v] = mask
    return [max(m, limit[m] - 1) for m in range(len(members))]


def _same_type(a: Any, b: Any) -> bool:
    """Shape, dtype and varying axes alike (a weak type aside)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and _compat.varying_axes(a) == _compat.varying_axes(b))


def _single(eqn: Any, site: _Site, blocks: int, invars: set) -> Any:
    if site.gather is not None:
        dimension, size, tiled, invariant = site.gather
        return eqn.replace(primitive=libra_all_gather_p,
                           params=dict(axis_name=site.axes, all_gather_dimension=dimension,
                                       axis_size=size, tiled=tiled, invariant=invariant,
                                       blocks=int(blocks)))
    if site.scatter is not None:
        dimension, size, tiled = site.scatter
        return eqn.replace(primitive=libra_reduce_scatter_p,
                           params=dict(axis_name=site.axes, scatter_dimension=dimension,
                                       axis_size=size, tiled=tiled, blocks=int(blocks)))
    operand = eqn.invars[0]
    inplace = not (_compat.is_var(operand) and operand in invars)
    return eqn.replace(primitive=libra_psum_p,
                       params=dict(axes=site.axes, blocks=int(blocks), inplace=inplace,
                                   invariant=site.invariant))


def _fused(eqns: Sequence[Any], bucket: Sequence[_Site], axes: tuple, invariant: bool,
           blocks: int) -> Any:
    members = [eqns[s.index] for s in bucket]
    effects = set().union(*(e.effects for e in members))
    if bucket[0].scatter is not None:  # psum_scatters along their first dimension
        primitive = libra_reduce_scatter_fused_p
        params = dict(axis_name=axes, axis_size=bucket[0].scatter[1],
                      tiled=tuple(s.scatter[2] for s in bucket if s.scatter is not None),
                      blocks=int(blocks))
    else:
        primitive = libra_psum_fused_p
        params = dict(axes=axes, blocks=int(blocks), invariant=invariant)
    # From the last member's equation, so that its context (the mesh JAX checks the psum's
    # types against, under `jax.set_mesh`) and source info carry over, as `_single`'s do.
    return members[-1].replace(
        invars=[e.invars[0] for e in members], outvars=[e.outvars[0] for e in members],
        primitive=primitive, params=params, effects=effects)


def _start_done(eqns: Sequence[Any], bucket: Sequence[_Site], axes: tuple, invariant: bool,
                blocks: int, call_id: int) -> tuple[Any, Any]:
    """A bucket as a `libra_psum_start` equation (its operands -> packed buffers in flight and
    a token) and a `libra_psum_done` equation (those buffers, that token and an ordering
    token -> the members' results; `_schedule` makes the ordering token the latest start's)."""
    members = [eqns[s.index] for s in bucket]
    effects = set().union(*(e.effects for e in members))
    operands = [e.invars[0] for e in members]
    flat_vars = [_compat.new_var(a) for a in _lowering.packed_avals([v.aval for v in operands])]
    token = _compat.new_var(TOKEN_AVAL)
    results = [e.outvars[0] for e in members]
    # Both from the last member's equation: its context and source info carry over (`_fused`).
    start = members[-1].replace(
        invars=operands, outvars=[*flat_vars, token], primitive=libra_psum_start_p,
        params=dict(axes=axes, blocks=int(blocks), invariant=invariant, call_id=call_id),
        effects=effects)
    register_pair("psum", call_id)
    done = members[-1].replace(
        invars=[*flat_vars, token, token], outvars=results, primitive=libra_psum_done_p,
        params=dict(out_avals=tuple(v.aval for v in results), axes=axes, blocks=int(blocks),
                    call_id=call_id), effects=set())
    return start, done


def _gather_pair(eqn: Any, site: _Site, blocks: int, call_id: int,
                 after: Any = None) -> tuple[Any, Any]:
    """An all_gather as a `libra_sharded_start` equation (its operand, and `after` where given:
    a value it must not start before, which it reads and ignores -> the full buffer in flight
    and a token) and a `libra_sharded_done` equation (those -> the gather's result), both from
    the gather's equation (its context and source info carry over)."""
    dimension, size, tiled, _ = site.gather  # type: ignore[misc]
    params = dict(collective="all_gather", axis_name=site.axes, dimension=dimension,
                  axis_size=size, tiled=tiled, blocks=int(blocks), call_id=call_id)
    operand, result = eqn.invars[0], eqn.outvars[0]
    flat_aval, token_aval = libra_sharded_start_p.abstract_eval(operand.aval, **params)[0]
    flat, token = _compat.new_var(flat_aval), _compat.new_var(token_aval)
    start = eqn.replace(primitive=libra_sharded_start_p,
                        invars=[operand] + ([after] if after is not None else []),
                        outvars=[flat, token],
                        params=params, effects=eqn.effects)
    register_pair("all_gather", call_id)
    done = eqn.replace(primitive=libra_sharded_done_p, invars=[flat, token], outvars=[result],
                       params=dict(params, out_aval=result.aval), effects=set())
    return start, done


def _fingerprint(jaxpr: Any) -> int:
    """A 64-bit hash of a jaxpr's structure: every equation's primitive and result types,
    sub-jaxprs included (printing the jaxpr would take a second for 8000 equations)."""
    parts: list[str] = []
    types: dict[Any, str] = {}  # per aval: programs repeat a few types many times

    def type_of(aval: Any) -> str:
        text = types.get(aval)
        if text is None:
            dtype = getattr(aval, "dtype", None)
            text = types[aval] = f"{getattr(aval, 'shape', ())}{getattr(dtype, 'char', '')};"
        return text

    def visit(j: Any) -> None:
        for eqn in j.eqns:
            parts.append(eqn.primitive.name)
            parts.extend(type_of(v.aval) for v in eqn.outvars)
            for sub in _compat.jaxprs_in_params(eqn.params):
                visit(getattr(sub, "jaxpr", sub))
    visit(jaxpr)
    digest = hashlib.blake2b("".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")



def _nbytes(aval: Any) -> int:
    # `dtype.itemsize`, not np.dtype(...): JAX's extended dtypes (a PRNG key's key<fry>, 8
    # bytes) have one too, and numpy cannot interpret them.
    return int(math.prod(aval.shape)) * int(getattr(aval.dtype, "itemsize", 0))


def _world(axis_sizes: dict, axes: tuple) -> int:
    return int(math.prod(axis_sizes.get(a, 1) for a in axes))


# --- Roofline cost of the compute between psums --------------------------------

def _roofline_s(eqn: Any, profile: Any) -> float:
    """Seconds of one equation at the profile's sustained rates: FLOPs of matmuls and
    convolutions over peak FLOP/s, bytes moved by anything else over memory bandwidth."""
    device = profile.device
    name = eqn.primitive.name
    if _is_psum(eqn):
        return 0.0
    subs = _compat.jaxprs_in_params(eqn.params)
    if subs:
        per_call = [sum(_roofline_s(e, profile) for e in getattr(j, "jaxpr", j).eqns) for j in subs]
        if name == "cond":
            return max(per_call)
        return sum(per_call) * (eqn.params.get("length", 1) if name == "scan" else 1)
    moved = sum(_nbytes(v.aval) for v in list(eqn.invars) + list(eqn.outvars)
                if hasattr(v.aval, "shape"))
    memory_s = moved / device.bytes_per_s()
    flops = _flops(eqn)
    return max(memory_s, flops / device.flop_per_s()) if flops else memory_s


def _region_roofline_s(eqns: Sequence[Any], region: Sequence[int],
                       readers: dict[Any, list[int]], profile: Any) -> float:
    """Seconds of equations `region` run as one fused kernel at the profile's rates: it
    reads what it uses from outside once and writes what is used outside once (the sum of
    `_roofline_s` over an elementwise chain counts every intermediate twice). `readers`:
    per variable, the positions of the equations that read it (past the end: an output)."""
    inside = set(region)
    defined = {v for i in region for v in eqns[i].outvars if _compat.is_var(v)}
    read = {v for i in region for v in eqns[i].invars if _compat.is_var(v) and v not in defined}
    written = {v for v in defined if any(j not in inside for j in readers.get(v, ()))}
    moved = sum(_nbytes(v.aval) for v in read | written if hasattr(v.aval, "shape"))
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


def with_xla_collectives(closed: Any) -> Any:
    """`closed` (a rewritten ClosedJaxpr) with every Libra all-reduce equation lowering to
    XLA's all-reduce instead, and nothing else changed (`optimize(collectives="xla")`)."""
    def visit(jaxpr: Any) -> Any:
        eqns = [eqn.replace(primitive=XLA_TWINS.get(eqn.primitive, eqn.primitive),
                            params={k: _map_jaxprs(v, visit) for k, v in eqn.params.items()})
                for eqn in jaxpr.eqns]
        return jaxpr.replace(eqns=eqns)
    return _compat.closed_jaxpr(visit(closed.jaxpr), closed.consts)
