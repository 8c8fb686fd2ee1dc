"""What a data-parallel loss reads besides its positional arrays, made inputs of the route's
`jax.shard_map` (`libra_jax.data_parallel`): Flax NNX objects passed as arguments
(`NnxObjects`) and Equinox modules (`EqxModules`), arrays the loss closes over (`Closure`);
what it takes that is not an array, passed to it as it is (`NonArrays`); and Haliax named
arrays, whose axes are resized to their shard (`resizing_named_arrays`).

Layer: imports `libra_jax._compat` and `config` (and `rewrite.nnx_objects`, late); used by
`data_parallel` alone.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from libra_jax import _compat, config

__all__ = ["NnxObjects", "EqxModules", "NonArrays", "Closure", "closure_parts", "spec_axes",
           "resizing_named_arrays"]


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one dimension of a spec names."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


class NnxObjects:
    """Flax NNX objects (a model, `Rngs`) passed to the route as arguments of their own, as to
    `nnx.value_and_grad`: a differentiated one is differentiated with respect to its
    `nnx.Param` state, and the gradient is that `nnx.State`; each object's other state (batch
    statistics, random streams) enters the shard_map replicated, and what the loss makes of
    it is written back into the object, as `reductions` makes "auto" aux (float values averaged over
    the batch's shards, others the same on every shard).

    Traced values cannot carry objects through `jax.shard_map` and `jax.value_and_grad`:
    `values` replaces each by its `Param` state (differentiated) or None, and appends the
    other states as arguments; `merging` wraps the loss to rebuild the objects and return
    their other state as aux; `write_back` updates the caller's objects."""

    def __init__(self, where: list[tuple[int, Any, bool]]) -> None:
        self.where = where  # (argument, object, differentiated)
        self.graphs: tuple = ()

    @classmethod
    def of(cls, args: tuple, argnums: tuple) -> NnxObjects:
        from libra_jax.rewrite import nnx_objects
        where = [(i, a, i in argnums) for i, a in enumerate(args) if nnx_objects(a) == [a]]
        top = {id(a) for _, a, _ in where}
        nested = [o for o in nnx_objects(args) if id(o) not in top]
        if nested:
            raise TypeError(
                f"libra_jax.value_and_grad: a Flax NNX {type(nested[0]).__name__} inside an "
                "argument's pytree: pass NNX objects as arguments of their own (the route "
                "writes their state back after the loss, as nnx.value_and_grad does)")
        return cls(where)

    def __bool__(self) -> bool:
        return bool(self.where)

    def values(self, args: tuple) -> tuple:
        if not self.where:
            return args
        nnx = sys.modules["flax.nnx"]
        values, rest, graphs = list(args), [], []
        for i, obj, differentiated in self.where:
            if differentiated:
                graph, values[i], other = nnx.split(obj, nnx.Param, ...)
            else:
                graph, other = nnx.split(obj)
                values[i] = None
            graphs.append(graph)
            rest.append(other)
        self.graphs = tuple(graphs)
        return tuple(values) + tuple(rest)

    def merging(self, fun: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
        nnx = sys.modules["flax.nnx"]
        where, graphs, n = self.where, self.graphs, len(self.where)

        def loss(*values: Any, **kwargs: Any) -> Any:
            args, rest = list(values[:-n]), values[-n:]
            for (i, _, differentiated), graph, other in zip(where, graphs, rest):
                args[i] = (nnx.merge(graph, args[i], other) if differentiated
                           else nnx.merge(graph, other))
            out = fun(*args, **kwargs)
            value, aux = out if has_aux else (out, None)
            after = tuple(nnx.state(args[i], nnx.Not(nnx.Param)) if differentiated
                          else nnx.state(args[i]) for i, _, differentiated in where)
            return value, (aux, after)
        return loss

    def write_back(self, out: Any, has_aux: bool) -> Any:
        nnx = sys.modules["flax.nnx"]
        (value, (aux, after)), grads = out
        for (_, obj, _), state in zip(self.where, after):
            nnx.update(obj, state)
        return ((value, aux) if has_aux else value), grads


class EqxModules:
    """Equinox modules passed to the route as differentiated arguments of their own (Levanter's
    GPT-2, with `bool` fields such as ``inference``), differentiated as
    `eqx.filter_value_and_grad` differentiates them: with respect to their inexact arrays, the
    other leaves (bools, ints, integer arrays, functions) static. The gradient is the module's
    inexact part, None elsewhere, as `eqx.filter_value_and_grad` returns it. A plain pytree
    with non-float leaves keeps JAX's refusal.

    `values` replaces each by its inexact part (`eqx.partition`) and appends the rest as
    arguments (entering whole; `NonArrays` passes its non-arrays as they are); `merging` wraps
    the loss to combine them again (`eqx.combine`)."""

    def __init__(self, where: list[int]) -> None:
        self.where = where

    @classmethod
    def of(cls, args: tuple, argnums: tuple) -> EqxModules:
        eqx = sys.modules.get("equinox")
        if eqx is None:
            return cls([])
        return cls([i for i in argnums if isinstance(args[i], eqx.Module)])

    def __bool__(self) -> bool:
        return bool(self.where)

    def values(self, args: tuple) -> tuple:
        if not self.where:
            return args
        eqx = sys.modules["equinox"]
        values, rest = list(args), []
        for i in self.where:
            values[i], static = eqx.partition(args[i], eqx.is_inexact_array)
            rest.append(static)
        return tuple(values) + tuple(rest)

    def merging(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        if not self.where:
            return fun
        eqx = sys.modules["equinox"]
        where, n = self.where, len(self.where)

        def loss(*values: Any, **kwargs: Any) -> Any:
            args, rest = list(values[:-n]), values[-n:]
            for i, static in zip(where, rest):
                args[i] = eqx.combine(args[i], static)
            return fun(*args, **kwargs)
        return loss


def resizing_named_arrays(fun: Callable[..., Any]) -> Callable[..., Any]:
    """`fun` called with each Haliax `NamedArray` among its arguments given the axis sizes of
    its own array. The route's shard_map splits a NamedArray's array as it splits any array
    (along its leading dimension, or as in_specs says), and JAX rebuilds the NamedArray
    around the shard with the whole batch's axes (``batch`` 16 over a shard of 2), which
    Haliax's operations then broadcast against the wrong sizes. Resized here, after the
    FSDP gathers (a gathered parameter's axes match again and are left as they are)."""
    haliax = sys.modules.get("haliax")
    if haliax is None:
        return fun

    def is_named(x: Any) -> bool:
        return isinstance(x, haliax.NamedArray)

    def resized(x: Any) -> Any:
        if not is_named(x) or not hasattr(x.array, "shape"):  # (an Equinox static part's)
            return x
        shape = tuple(x.array.shape)
        if len(shape) != len(x.axes) or shape == tuple(axis.size for axis in x.axes):
            return x
        return haliax.named(x.array, tuple(axis.resize(n) for axis, n in zip(x.axes, shape)))

    def loss(*args: Any, **kwargs: Any) -> Any:
        return fun(*jax.tree.map(resized, args, is_leaf=is_named), **kwargs)
    return loss


class NonArrays:
    """What the loss takes that is not an array: the leaves of its non-differentiated
    arguments that are not arrays (a model module, a config's strings; MaxText's
    ``loss_fn(model, config, data, ...)``), and every leaf of an argument `in_specs` marks
    ``None``. They are passed to the loss as they are, on every shard: not inputs of the
    route's shard_map, which takes arrays only (the arguments keep their place, these leaves
    left out as ``None``, an empty subtree, and put back inside)."""

    def __init__(self) -> None:
        #: argument index -> (its tree, {leaf index: value})
        self.held: dict[int, tuple[Any, dict[int, Any]]] = {}

    @classmethod
    def of(cls, args: tuple, argnums: tuple, in_specs: Any, static_numbers: int = 0
           ) -> tuple[NonArrays, tuple, Any]:
        """The non-arrays of `args`, the arguments without them, and `in_specs` with each
        ``None`` entry (an argument that is not an array) made ``P()``. In the last
        `static_numbers` arguments (the Equinox modules' static parts) a Python number is
        static too, as Equinox takes it."""
        found = cls()
        entries = (tuple(in_specs) if isinstance(in_specs, (tuple, list)) else
                   None if in_specs is None else (in_specs,))
        marked = {i for i, e in enumerate(entries or ()) if e is None}
        out = list(args)
        for i, arg in enumerate(args):
            if i in argnums:
                continue
            leaves, tree = jax.tree.flatten(arg)
            numbers = i >= len(args) - static_numbers
            held = {k: x for k, x in enumerate(leaves)
                    if i in marked or not _is_array(x) or (numbers and not hasattr(x, "shape"))}
            if held:
                found.held[i] = (tree, held)
                out[i] = jax.tree.unflatten(tree, [None if k in held else x
                                                  for k, x in enumerate(leaves)])
        if entries is not None and marked:
            in_specs = tuple(P() if e is None else e for e in entries)
        return found, tuple(out), in_specs

    def __bool__(self) -> bool:
        return bool(self.held)

    def restoring(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """`fun` called with the held leaves back in their arguments."""
        if not self.held:
            return fun

        def restored(*args: Any, **kwargs: Any) -> Any:
            full = list(args)
            for i, (tree, held) in self.held.items():
                leaves = tree.flatten_up_to(full[i])
                full[i] = jax.tree.unflatten(tree, [held.get(k, x) for k, x in enumerate(leaves)])
            return fun(*full, **kwargs)
        return restored

    def key(self) -> tuple | None:
        """The held values as a compiled program's key (`Closure.key`'s terms), or None."""
        keys: list[Any] = []
        for i, (tree, held) in sorted(self.held.items()):
            keys.append((i, tree))
            for k, x in sorted(held.items()):
                v = _value_key(x, depth=0)
                if v is None:
                    return None
                keys.append((k, v))
        return tuple(keys)


def _is_array(x: Any) -> bool:
    """Whether a leaf is a value a shard_map takes (an array, or a number that becomes one)."""
    return (isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
            or hasattr(x, "__jax_array__"))


class Closure:
    """The arrays the loss closes over that the route's shard_map must take as inputs.

    A loss often reads arrays from its enclosing scope (a frozen weight; JAX's Training
    Cookbook's ``def loss_fn(params): ... batch["x"] ...`` inside the jitted step). They enter
    as GSPMD reads them: whole on every shard (``P()``; one sharded over the mesh is gathered
    for the loss), never split by guess. With ``split_closed_over=True`` (the opt-in), one
    laid out over the batch's axes along its leading dimension is split as a batch argument
    is (``P(batch)``). The arrays the loss's own closure holds (its cells, and a
    `functools.partial`'s arguments) whose values are known (concrete arrays, NumPy's
    included) or whose layout shows (an explicit mesh's traced values) are made inputs, so
    that the compiled program reads their values at each call, not the first call's; the
    loss is rebuilt around them for the trace (`taking`: a copy of the function with new
    cells; the caller's are untouched). A traced value of an auto mesh shows no layout: it
    stays closed over (whole), and `notice_unsplit` says so where nothing else is split."""

    def __init__(self, fun: Callable[..., Any]) -> None:
        self.fun = fun
        self.parts: list[tuple[str, Any]] = []  # what it closes over (`closure_parts`)
        self.make: Callable[[dict], Any] = lambda new: fun
        self.hoisted: list[Any] = []  # the arrays made inputs
        self.specs: list[P] = []  # theirs
        self.names: list[str] = []  # theirs, as the closure names them ("batch['x']")
        self.touched: set[int] = set()  # the parts holding them
        self.unseen: list[Any] = []  # traced arrays of an auto mesh, left closed over
        self.whole_batch_shaped: list[str] = []  # laid out over the batch, entered whole

    @classmethod
    def of(cls, fun: Callable[..., Any], axes: tuple, mesh: Any,
           split_closed_over: bool = False) -> Closure:
        closure = cls(fun)
        found = closure_parts(fun)
        if found is None:
            return closure
        closure.parts, closure.make = found
        shards = math.prod(dict(mesh.shape)[a] for a in axes)
        batch = axes[0] if len(axes) == 1 else axes
        for part, (name, content) in enumerate(closure.parts):
            for path, leaf in jax.tree_util.tree_flatten_with_path(content, is_leaf=_is_opaque)[0]:
                where = f"{name}{jax.tree_util.keystr(path)}"
                spec = _closed_over_spec(leaf)
                if spec is None:
                    if (isinstance(leaf, _compat.Tracer) and not _compat.is_ref(leaf)
                            and np.ndim(leaf) > 0):
                        closure.unseen.append(leaf)
                    continue
                over_batch = (np.ndim(leaf) > 0 and bool(spec)
                              and bool(set(spec_axes(spec[0])) & set(axes)))
                if over_batch and split_closed_over:
                    if np.shape(leaf)[0] % shards:
                        raise ValueError(
                            f"libra_jax.value_and_grad: the loss closes over {where}, laid out "
                            f"over the batch's axes ({spec}) with leading dimension "
                            f"{np.shape(leaf)[0]}, which does not split over the {shards} "
                            f"shards of {axes if len(axes) > 1 else axes[0]!r} "
                            "(split_closed_over=True)")
                    spec = P(batch)
                else:
                    if over_batch:
                        closure.whole_batch_shaped.append(
                            f"{where} {np.dtype(leaf.dtype).name}{list(np.shape(leaf))}")
                    spec = P()
                closure.hoisted.append(leaf)
                closure.specs.append(spec)
                closure.names.append(where)
                closure.touched.add(part)
        return closure

    def key(self) -> tuple | None:
        """What of the closure a compiled program depends on beyond its inputs: the
        hoisted arrays' specs and every other leaf's value (a number, a string, a module, a
        function by its code and its own closure), so that an eager route compiles again
        where any of them changed; None where a leaf's value cannot key a cache (an object
        whose attributes the loss may read): the route then compiles for the call alone."""
        hoisted = {id(x) for x in self.hoisted}
        keys: list[Any] = [tuple(self.specs)]
        for _, content in self.parts:
            leaves, treedef = jax.tree.flatten(content, is_leaf=_is_opaque)
            keys.append(treedef)
            for leaf in leaves:
                k = ("input",) if id(leaf) in hoisted else _value_key(leaf, depth=0)
                if k is None:
                    return None
                keys.append(k)
        return tuple(keys)

    def notice_whole(self, axes: tuple) -> None:
        """The one-release notice: arrays laid out over the batch's axes that the route
        split as batch before this release enter whole now."""
        if not self.whole_batch_shaped:
            return
        config.notice(
            "closed-over-whole",
            f"libra_jax.value_and_grad: the loss closes over {', '.join(self.whole_batch_shaped[:3])}, "
            f"laid out over {list(axes)}: it enters whole, as GSPMD reads it (every shard "
            "computes with all of it). Before this release the route split such an array as "
            "the batch; if it is the batch, pass it to the loss as an argument, or pass "
            "split_closed_over=True")

    def __len__(self) -> int:
        return len(self.hoisted)

    def taking(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
               ) -> Callable[..., Any]:
        """`wrap` of the loss, as a function of its arguments followed by the hoisted arrays'
        values (the shard_map's inputs), the loss rebuilt around those."""
        if not self.hoisted:
            return wrap(self.fun)
        n, ids = len(self.hoisted), [id(x) for x in self.hoisted]

        def loss(*args: Any, **kwargs: Any) -> Any:
            values = dict(zip(ids, args[-n:]))
            new = {part: jax.tree.map(lambda x: values.get(id(x), x), self.parts[part][1],
                                      is_leaf=_is_opaque) for part in self.touched}
            return wrap(self.make(new))(*args[:-n], **kwargs)
        return loss

    def notice_unsplit(self, axes: tuple, split_inputs: bool) -> None:
        """Say, where no input of the loss is split over the batch's axes, that it closes over
        traced arrays whose layout does not show (the batch, likely: every shard would compute
        the loss of all of it)."""
        if split_inputs or not self.unseen:
            return
        shapes = ", ".join(f"{x.dtype}{list(x.shape)}" for x in self.unseen[:3])
        config.notice(
            "closed-over-batch",
            f"libra_jax.value_and_grad: no input of the loss is split over {list(axes)}, and "
            f"it closes over {shapes} traced on an auto-sharding mesh, whose layout does not "
            "show: if that is the batch, every shard computes the loss of all of it (the "
            "values are right, nothing is data-parallel). Pass the batch as an argument of "
            "the loss, or use an explicit-sharding mesh, where a closed-over array laid out "
            "over the batch's axes is split as an argument is")


#: Closed-over values that key a compiled program by their value.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, np.generic, np.dtype)


def _value_key(leaf: Any, depth: int) -> Any:
    """`leaf`'s part of `Closure.key`, or None where its value cannot key a cache."""
    import types
    if isinstance(leaf, _VALUE_TYPES):
        return (type(leaf), leaf)
    if leaf is _EMPTY_CELL or isinstance(leaf, (types.ModuleType, type,
                                                  types.BuiltinFunctionType)):
        return ("object", id(leaf))
    if isinstance(leaf, _compat.Tracer):
        return ("traced", id(leaf))  # under a trace: the caller's trace decides
    if callable(leaf) and type(leaf).__module__.split(".")[0] in ("jax", "jaxlib"):
        return ("object", id(leaf))  # JAX's functions (jax.nn.gelu): fixed
    if isinstance(leaf, types.FunctionType) and depth < 4:
        found = closure_parts(leaf)
        inner: list[Any] = [id(leaf.__code__), leaf.__defaults__ is None]
        for _, content in (found[0] if found else []):
            leaves, treedef = jax.tree.flatten(content, is_leaf=_is_opaque)
            inner.append(treedef)
            for x in leaves:
                k = _value_key(x, depth + 1)
                if k is None:
                    return None
                inner.append(k)
        for x in leaf.__defaults__ or ():
            k = _value_key(x, depth + 1)
            if k is None:
                return None
            inner.append(k)
        return ("function", tuple(inner))
    return None


def shown_layout(leaf: Any) -> P | None:
    """A leaf's layout over a mesh where it shows (a concrete array's `NamedSharding`, ``P()``
    where replicated; an explicit-sharding mesh's traced value's), else None: a NumPy array,
    an array on one device, a value traced on an auto mesh."""
    if isinstance(leaf, jax.Array) and not isinstance(leaf, _compat.Tracer):
        sharding = leaf.sharding
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return None
        return P() if sharding.is_fully_replicated else sharding.spec
    if not isinstance(leaf, _compat.Tracer):
        return None
    traced: Any = getattr(jax.typeof(leaf), "sharding", None)
    mesh = getattr(traced, "mesh", None)
    if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return None
    return traced.spec


def _closed_over_spec(leaf: Any) -> P | None:
    """A closed-over leaf's layout where it is an input of the route: `shown_layout`, and
    ``P()`` for a concrete array whose layout does not show (on one device, or NumPy's);
    else None (not an array, or traced on an auto mesh)."""
    if _compat.is_ref(leaf):
        return None  # a mutable reference (`jax.new_ref`): read in place, closed over
    shown = shown_layout(leaf)
    if shown is None and (isinstance(leaf, np.ndarray) or (
            isinstance(leaf, jax.Array) and not isinstance(leaf, _compat.Tracer))):
        return P()
    return shown


def closure_parts(fun: Any) -> tuple[list[tuple[str, Any]], Callable[[dict], Any]] | None:
    """What `fun` closes over, in parts (name, content): a Python function's cells, a
    `functools.partial`'s arguments and keywords (then its function's parts); and
    ``make({part: new content})``, `fun` again with those parts replaced and the others as
    they are (a copy of the function with new cells: the caller's are untouched). None where
    it closes over nothing this can see (a builtin, a bound method, a callable object)."""
    import functools
    import types
    if isinstance(fun, functools.partial):
        inner = closure_parts(fun.func)
        parts = [("the partial's arguments", fun.args), ("the partial's keywords", fun.keywords),
                 *(inner[0] if inner else [])]

        def make_partial(new: dict) -> Any:
            inner_new = {i - 2: c for i, c in new.items() if i >= 2}
            func = inner[1](inner_new) if inner and inner_new else fun.func
            return functools.partial(func, *new.get(0, fun.args), **new.get(1, fun.keywords))
        return parts, make_partial
    if not isinstance(fun, types.FunctionType) or not fun.__closure__:
        return None
    cells = fun.__closure__

    def content(cell: Any) -> Any:
        try:
            return cell.cell_contents
        except ValueError:  # an empty cell: a name the enclosing scope assigns later
            return _EMPTY_CELL

    def make_function(new: dict) -> Any:
        new_cells = tuple(types.CellType(new[i]) if i in new else cell
                          for i, cell in enumerate(cells))
        copy = types.FunctionType(fun.__code__, fun.__globals__, fun.__name__,
                                  fun.__defaults__, new_cells)
        copy.__kwdefaults__ = fun.__kwdefaults__
        return functools.update_wrapper(copy, fun, updated=())
    return [(name, content(c)) for name, c in zip(fun.__code__.co_freevars, cells)], make_function


#: An empty cell's content.
_EMPTY_CELL = object()


def _is_opaque(x: Any) -> bool:
    """Not looked into for arrays: a Flax NNX object or variable (a graph, not a pytree to
    rebuild), an empty cell."""
    if x is _EMPTY_CELL:
        return True
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and (isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x))
