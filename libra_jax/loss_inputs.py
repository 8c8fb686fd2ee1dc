"""What a data-parallel loss reads besides its positional arrays, made inputs of the route's
`jax.shard_map` (`libra_jax.data_parallel`): Flax NNX objects passed as arguments
(`NnxObjects`), and arrays the loss closes over (`Closure`).

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

__all__ = ["NnxObjects", "Closure", "closure_parts", "spec_axes"]


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
    it is written back into the object, as `_mean_aux` makes aux (float values averaged over
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


class Closure:
    """The arrays the loss closes over that the route's shard_map must take as inputs.

    A loss often reads the batch from its enclosing scope (JAX's Training Cookbook:
    ``def loss_fn(params): ... batch["x"] ...`` inside the jitted step). Read from inside the
    shard_map, such an array is every shard's whole (an auto mesh: not data-parallel, though
    the values are right), or refused by JAX (a traced value on an explicit mesh). So the
    arrays in the loss's own closure (its cells, and a `functools.partial`'s arguments) whose
    layout shows are made inputs: one laid out over the batch's axes along its leading
    dimension is split as a batch argument is (``P(batch)``); any other traced value of an
    explicit mesh enters whole (``P()``, resharded so: the loss reads it as GSPMD's would).
    The loss is rebuilt around them for the trace (`taking`: a copy of the function with new
    cells; the caller's are untouched). A traced value of an auto mesh shows no layout: it
    stays closed over, and `notice_unsplit` says so where nothing else is split."""

    def __init__(self, fun: Callable[..., Any]) -> None:
        self.fun = fun
        self.parts: list[tuple[str, Any]] = []  # what it closes over (`closure_parts`)
        self.make: Callable[[dict], Any] = lambda new: fun
        self.hoisted: list[Any] = []  # the arrays made inputs
        self.specs: list[P] = []  # theirs
        self.touched: set[int] = set()  # the parts holding them
        self.unseen: list[Any] = []  # traced arrays of an auto mesh, left closed over

    @classmethod
    def of(cls, fun: Callable[..., Any], axes: tuple, mesh: Any) -> Closure:
        closure = cls(fun)
        found = closure_parts(fun)
        if found is None:
            return closure
        closure.parts, closure.make = found
        shards = math.prod(dict(mesh.shape)[a] for a in axes)
        batch = axes[0] if len(axes) == 1 else axes
        for part, (name, content) in enumerate(closure.parts):
            for path, leaf in jax.tree_util.tree_flatten_with_path(content, is_leaf=_is_opaque)[0]:
                spec = _closed_over_spec(leaf)
                if spec is None:
                    if (isinstance(leaf, _compat.Tracer) and not _compat.is_ref(leaf)
                            and np.ndim(leaf) > 0):
                        closure.unseen.append(leaf)
                    continue
                if spec and set(spec_axes(spec[0])) & set(axes) and np.ndim(leaf) > 0:
                    if np.shape(leaf)[0] % shards:
                        raise ValueError(
                            f"libra_jax.value_and_grad: the loss closes over "
                            f"{name}{jax.tree_util.keystr(path)}, laid out over the batch's axes "
                            f"({spec}) with leading dimension {np.shape(leaf)[0]}, which does "
                            f"not split over the {shards} shards of "
                            f"{axes if len(axes) > 1 else axes[0]!r}")
                    spec = P(batch)
                elif not isinstance(leaf, _compat.Tracer):
                    continue  # a concrete array not split over the batch: a constant, as before
                else:
                    spec = P()  # an explicit mesh's: JAX takes no closed-over value there
                closure.hoisted.append(leaf)
                closure.specs.append(spec)
                closure.touched.add(part)
        return closure

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


def _closed_over_spec(leaf: Any) -> P | None:
    """A closed-over leaf's layout where it shows: a concrete array's `NamedSharding` spec
    (``P()`` where replicated), an explicit mesh's traced value's; else None (not an array,
    or traced on an auto mesh)."""
    if _compat.is_ref(leaf):
        return None  # a mutable reference (`jax.new_ref`): read in place, closed over
    if isinstance(leaf, jax.Array) and not isinstance(leaf, _compat.Tracer):
        sharding = leaf.sharding
        return (sharding.spec if isinstance(sharding, jax.sharding.NamedSharding)
                and not sharding.is_fully_replicated else P())
    if not isinstance(leaf, _compat.Tracer):
        return None
    traced: Any = getattr(jax.typeof(leaf), "sharding", None)
    mesh = getattr(traced, "mesh", None)
    if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return None
    return traced.spec


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
