"""`libra_jax.optimize` and `rewrite_jaxpr`: the public transformation, what outer
transformations hand it (statics, NNX objects, pytrees of outputs), its cache of rewritten
programs, and the notices of steps it cannot plan (a GSPMD step).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from libra_jax import _compat, _deprecated, config, dropins, model
from libra_jax.ops import XLA_TWINS
from libra_jax.ops.base import warn_once
from libra_jax.rewrite.edits import map_jaxprs
from libra_jax.rewrite.report import (
    LatestReport,
    OptimizeReport,
    check_plan_agreement,
    price_step,
    shared_profile,
)
from libra_jax.rewrite.rewriter import Rewriter
from libra_jax.rewrite.scope import Options, _loop_mode
from libra_jax.rewrite.sites import UNPLANNED_NOTICE, collective_counts, is_psum

__all__ = ["optimize", "rewrite_jaxpr", "StaticArgs", "outer_statics", "Outputs",
           "nnx_objects", "gspmd_notice", "with_xla_collectives", "DISABLE_ENV", "OVERLAP_ENV",
           "COLLECTIVE_CHOICES", "OVERLAP_MODES", "GSPMD_ROUTE"]


#: Environment switch that turns `optimize` into a pass-through (`config`).
DISABLE_ENV = config.DISABLE_ENV
#: Environment default of `optimize(overlap=...)`.
OVERLAP_ENV = config.OVERLAP_ENV
#: What carries out the rewritten program's all-reduces: Libra's engine ("libra"), or XLA's
#: all-reduce in each call's place, the program otherwise the same ("xla": a control).
COLLECTIVE_CHOICES = ("libra", "xla")
#: How a gradient all-reduce is issued: one call ("sync"; on CPU already asynchronous), a
#: start/done pair around the compute it overlaps ("start-done", `libra_jax.ops.start_done`), or
#: per bucket whichever the model prices lower ("auto", `buckets.split_buckets`).
OVERLAP_MODES = config.OVERLAP_MODES


def optimize(fn: Callable[..., Any] | None = None, *, profile: Any = None, fusion: bool = True,
             blocks: int | None = None, overlap: str | None = None, loops: str = "auto",
             prefetch: str | int | None = None, prefetch_bytes: int | None = None,
             ready: str = "dataflow", static_argnums: int | Sequence[int] | None = None,
             static_argnames: str | Sequence[str] | None = None,
             collectives: str = "libra", enabled: bool = True) -> Any:
    """Rewrite the psums of a train step into Libra all-reduces planned at trace time.

    Use as ``jax.jit(libra_jax.optimize(step))`` or ``@libra_jax.optimize(profile="h100")``.
    `fn` may itself be jitted, `shard_map`ped, or call `jax.pmap`.

    Args:
      fn: the function; without it, a decorator is returned.
      profile: the hardware profile (a name, a path, a `model.Profile` or its JSON document
        as a dict); default: the
        built-in profile of the default backend (`dropins.DEFAULT_PROFILES`). Under
        multi-process JAX every process plans with process 0's (`shared_profile`).
      fusion: fuse gradient psums into buckets (Libra's co-optimisation), and consecutive
        forward all-gathers into one call where the model says so (within
        `prefetch_bytes`). False: one all-reduce per psum and one call per all-gather,
        allocations still planned. A bool (Python's or NumPy's), as
        `enabled`: anything else, 0, 1 or a string such as "off" included, is a TypeError
        naming the option (``bool("off")`` is True: a string would turn fusion on).
      blocks: fix every planned allocation to this block count and plan fusion only.
      overlap: "sync" issues each gradient all-reduce as one call (on CPU the engine's
        call is asynchronous already). "start-done" splits it into a start where the
        gradients are ready and a done after the backward pass, where the result is first
        needed (on a GPU the kernel runs on libra's own stream beside the backward pass).
        "auto" chooses per bucket: a start/done pair where the work it defers (the bucket's
        optimizer update, as far as the backward pass would have hidden it: not at all where
        its compute threads fill the cores) and its one call more are predicted to cost less
        than leaving the one call pending in the program (the profile's
        ``pending_allreduce_us``, at most the compute left after the bucket); on a GPU under
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
      prefetch_bytes: the most gathered bytes per device held ahead of their use at once
        (the memory prefetching, and a fused all-gather's later members, hold); None:
        ``$LIBRA_JAX_PREFETCH_BYTES``, else 1 GiB.
      ready: where a gradient collective is planned and issued. "dataflow" (default): where
        its operand is ready in the backward pass (`libra_jax.rewrite.ready`), however the
        code was written (``pmean(jax.grad(...))`` writes every psum after the backward
        pass; autodiff's psums sit inside it): the same step gets the same plan either way.
        "written": where the code wrote it (the placement before 0.2; a control).
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
      enabled: False returns `fn` unchanged (as does ``LIBRA_JAX_DISABLE=1``); a bool, as
        `fusion`. The string options (`overlap`, `loops`, `prefetch`, `ready`,
        `collectives`) take one of the strings listed (`prefetch` also its numbers); any
        other value, a non-string included, is a ValueError naming the option.

    Returns:
      A function with `fn`'s signature and results. Its other arguments are handled as by
      `jax.jit`: array-likes (Python scalars included) are traced, anything else is an
      error (under an outer transformation: static, above); the rewritten program is cached
      per argument structure and types (and static values), so the same call retraces
      nothing. Flax NNX objects among the arguments (modules, `nnx.Optimizer`, metrics,
      `Rngs`) are updated in place as `fn` updates them, as under `nnx.jit`; called inside
      `nnx.jit`, or wrapping an `nnx.jit`ted `fn`, likewise. ``wrapped.last_report`` holds
      the latest plan (an `OptimizeReport`); before the first call, a `LatestReport` (false,
      a view of the latest plan), which ``jax.jit(wrapped)`` copies and so reads each plan.
    """
    # Every option is checked (`config`: one home for the checks), in the decorator form and
    # where `enabled` is False too. The decorator's partial holds the options as given: a
    # default from the environment is read again where it is applied.
    enabled = config.bool_option(enabled, "enabled")
    fusion = config.bool_option(fusion, "fusion")
    if blocks is not None:
        dropins.check_blocks(blocks)
    config.choice_option(collectives, COLLECTIVE_CHOICES, "collectives")
    options = Options(profile=profile, fusion=fusion, blocks=blocks,
                       overlap=config.overlap_mode(overlap), loops=_loop_mode(loops),
                       prefetch=config.prefetch_mode(prefetch),
                       prefetch_bytes=config.prefetch_bytes(prefetch_bytes), ready=ready)
    if fn is None:
        return functools.partial(optimize, profile=profile, fusion=fusion, blocks=blocks,
                                 overlap=overlap, loops=loops, prefetch=prefetch,
                                 prefetch_bytes=prefetch_bytes, ready=ready,
                                 static_argnums=static_argnums,
                                 static_argnames=static_argnames, collectives=collectives,
                                 enabled=enabled)
    if not callable(fn):
        raise TypeError(f"libra_jax.optimize: expected a function to optimize, got {fn!r}")
    statics = StaticArgs.of(fn, static_argnums, static_argnames)
    if not enabled:
        return fn
    cache: dict[Any, tuple[Callable[..., Any], Outputs, OptimizeReport]] = {}
    latest = LatestReport()

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
            rewritten, report = rewrite_with(closed, options, profile, inputs=leaves)
            check_plan_agreement(report, program=program)
            if collectives == "xla":
                rewritten = with_xla_collectives(rewritten)
            entry = (jax.jit(_compat.jaxpr_as_fun(rewritten)), outputs, report)
            cache[key] = entry
        run, outputs, report = entry
        latest.report = wrapped.last_report = report  # type: ignore[attr-defined]
        out = outputs.rebuild(run(*leaves))
        if nodes:
            out, states = out
            for node, state in zip(nodes, states):
                _nnx_update(node, state)
        return out

    # Until the first call plans, a view of the latest plan: `jax.jit(wrapped)` copies the
    # attribute as it is at wrap time, and so keeps reading each new plan.
    wrapped.last_report = latest  # type: ignore[attr-defined]
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
    """A step's outputs split into the arrays (jax or NumPy; tracers), which leave the program,
    and every other leaf, kept from the trace and put back as the step returned it: a function
    in an Equinox model, and a Python number or bool too (an `eqx.nn.Dropout`'s ``inference``
    flag). `optimize` converts no output: the outer transformation decides, as it would for
    the step itself (`jax.jit` returns a number as an array, `eqx.filter_jit` as it was; a
    model whose flag came back an array would fail its next step under `eqx.filter_jit`). A
    non-array leaf is no function of the traced arguments, so the trace's value is the value."""

    tree: Any = None
    static: dict[int, Any] = dataclasses.field(default_factory=dict)

    def arrays_of(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call`, returning its array leaves only (recording the rest in `self`)."""
        def traced(*args: Any, **kwargs: Any) -> list[Any]:
            flat, self.tree = jax.tree.flatten(call(*args, **kwargs))
            self.static = {i: x for i, x in enumerate(flat) if not _is_array(x)}
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


def rewrite_jaxpr(closed: Any, *, profile: Any = None, fusion: bool = True,
                  blocks: int | None = None, overlap: str | None = None, loops: str = "auto",
                  prefetch: str | int | None = None, prefetch_bytes: int | None = None,
                  ready: str = "dataflow", inputs: Sequence[Any] = ()
                  ) -> tuple[Any, OptimizeReport]:
    """Rewrite `closed` (a ClosedJaxpr) as the module docstring states. The options are
    `optimize`'s, checked as it checks them (`fusion` a bool: a string is a TypeError).

    `inputs`: the values `closed` was traced from (arrays or tracers), where known. Only their
    shardings are read: a step with no psum whose inputs are sharded is a GSPMD step, and the
    notice says so (`gspmd_notice`)."""
    if blocks is not None:
        dropins.check_blocks(blocks)
    options = Options(profile=profile, fusion=fusion, blocks=blocks,
                       overlap=config.overlap_mode(overlap), loops=_loop_mode(loops),
                       prefetch=config.prefetch_mode(prefetch),
                       prefetch_bytes=config.prefetch_bytes(prefetch_bytes), ready=ready)
    return rewrite_with(closed, options, options.resolved_profile(), inputs=inputs)


def rewrite_with(closed: Any, options: Options, profile: model.Profile,
                 inputs: Sequence[Any] = ()) -> tuple[Any, OptimizeReport]:
    """`rewrite_jaxpr` under `options` as built and checked once (by `optimize`, at wrap
    time, or by `rewrite_jaxpr` from its keywords) and `profile` as resolved once (by
    `optimize`: every process's, `shared_profile`): nothing is read or checked again."""
    report = OptimizeReport()
    # A collective whose result the step never uses (a frozen parameter's gradient zeroed
    # after its pmean, a psum'd metric nobody returns) is no gradient to plan, and as a
    # start/done pair it would lose its done to XLA's dead-code elimination while its
    # start wrote into a buffer XLA reuses: it goes first, with the work only it needed.
    live = _compat.dce(closed.jaxpr)
    dropped = collective_counts(closed.jaxpr) - collective_counts(live)
    report.dropped = [f"{name}" + (f" (x{n})" if n > 1 else "") for name, n in dropped.items()]
    closed = _compat.closed_jaxpr(live, closed.consts)
    with _compat.memoized_sub_jaxprs():
        rewriter = Rewriter(options, report, closed, profile)
        # A step traced inside a `pmap` or `shard_map` (``pmap(optimize(step))``) sees its
        # axes bound there: their sizes come from where it is traced.
        new_jaxpr = rewriter.jaxpr(closed.jaxpr, axis_sizes=_compat.bound_axis_sizes(),
                                   scope="top", in_loop=False)
        maps_devices = _maps_devices(closed.jaxpr)
    report.step = price_step(report, closed.jaxpr)  # the step both ways (issue 73)
    for line in report.skipped:
        warn_once("psum-left-in-place", f"libra_jax.optimize left an XLA psum in place: {line}")
    counts = collections.Counter(rewriter.unplanned)
    report.unplanned = [f"{what}" + (f" (x{n})" if n > 1 else "") for what, n in counts.items()]
    if report.unplanned:
        warn_once("unplanned-collectives",
                  "libra_jax.optimize plans psums and psum_scatters and runs all_gathers and "
                  "all_to_alls; these "
                  "collectives keep their own lowering (XLA's, or libra's at their own blocks): "
                  + "; ".join(report.unplanned) + ". " + UNPLANNED_NOTICE)
    if not report.plans and not report.skipped and not maps_devices:
        gspmd, notice = gspmd_notice([*(v.aval for v in closed.jaxpr.invars), *inputs])
        report.notes.append(notice)
        warn_once("gspmd-step" if gspmd else "no-psum", f"libra_jax.optimize: {notice}")
    return _compat.closed_jaxpr(new_jaxpr, closed.consts), report


def _aval_key(x: Any) -> Any:
    aval = jax.typeof(x) if hasattr(x, "shape") else type(x)
    return (type(x), str(aval), getattr(aval, "weak_type", None))


#: Where `optimize`'s notices point a GSPMD step: the route that puts its gradient
#: all-reduces in the traced program (`libra_jax.data_parallel`).
GSPMD_ROUTE = ("to have its gradient all-reduces planned, compute the gradient with "
               "libra_jax.value_and_grad(loss_fn, axis_name=...) in jax.value_and_grad's place "
               "(docs/gspmd.md)")


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
        if is_psum(eqn) or eqn.primitive.name in _compat.DEVICE_MAPS:
            return True
        if any(_maps_devices(getattr(j, "jaxpr", j)) for j in _compat.jaxprs_in_params(eqn.params)):
            return True
    return False


def with_xla_collectives(closed: Any) -> Any:
    """`closed` (a rewritten ClosedJaxpr) with every Libra all-reduce equation lowering to
    XLA's all-reduce instead, and nothing else changed (`optimize(collectives="xla")`)."""
    def visit(jaxpr: Any) -> Any:
        eqns = [eqn.replace(primitive=XLA_TWINS.get(eqn.primitive, eqn.primitive),
                            params={k: map_jaxprs(v, visit) for k, v in eqn.params.items()})
                for eqn in jaxpr.eqns]
        return jaxpr.replace(eqns=eqns)
    return _compat.closed_jaxpr(visit(closed.jaxpr), closed.consts)


def __getattr__(name: str) -> Any:
    return _deprecated.alias(__name__, name, {"COLLECTIVES": ("COLLECTIVE_CHOICES",
                                                              COLLECTIVE_CHOICES)})
