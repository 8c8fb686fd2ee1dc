"""The drop-ins: `libra_jax.psum` (and `pmean`), `psum_scatter` and `all_gather`, for
`jax.lax`'s functions of those names, run by Libra's engine with a chosen block count.

`psum_scatter` and `all_gather` follow the same rules as `psum` below, with their own
primitives (`libra_jax.ops.sharded`): `psum_scatter` serves `reduce_scatter` (the dtypes the
engine sums), `all_gather` serves `all_gather` and `all_gather_invariant` (``to='varying'``
and ``to='invarying'``; any dtype of whole bytes, copied). Delegated to `jax.lax`, with the
one-time notice: `axis_index_groups`, ``to='reduced'``, unreduced inputs (JAX's
`unreduced_reduce_scatter`), axes bound by `vmap`, and dtypes they do not serve.

The primitive `libra_psum` stands for exactly the psum that `jax.lax.psum` would
bind (`psum_invariant` under `shard_map(check_vma=True)`, `psum` otherwise): its
abstract evaluation *is* that primitive's, so output types (shape, dtype,
weak type, varying axes) and effects are the same by construction. It differs
in its lowering: on CPU it becomes the `libra_allreduce_cpu` custom call, which
carries its block count; elsewhere it lowers to XLA's all-reduce.

Cases the engine does not serve are handed to `jax.lax.psum` itself (with a
one-time warning): axes bound by `vmap` or positional axes, `axis_index_groups`,
bool and dtypes outside f32/f64/bf16/f16/s32/s64, unreduced inputs. Values that
are not traced (Python scalars, constants) need no communication and also go
to `jax.lax.psum`, silently.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable, Iterator, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np

from libra_jax import _compat, collectives, model, planner
from libra_jax.collectives import Collective
from libra_jax.ops import blocks as block_rule
from libra_jax.ops import lowering
from libra_jax.ops.base import warn_once
from libra_jax.ops.exchange import ALL_TO_ALL, libra_all_to_all_p
from libra_jax.ops.psum import ALL_REDUCE, libra_psum_p
from libra_jax.ops.sharded import (
    ALL_GATHER,
    REDUCE_SCATTER,
)

__all__ = ["psum", "pmean", "psum_scatter", "all_gather", "all_to_all", "patch_lax",
           "default_blocks", "check_blocks", "engine_dtype",
           "warn_invariant_operand", "MAX_BLOCKS", "DEFAULT_PROFILES", "BLOCK_PENALTY",
           "libra_psum_p"]

# JAX's own functions, taken at import: libra_jax calls these (for constants, the axis
# size, delegated psums), never `jax.lax.psum` by its live name, which code may have
# patched to `libra_jax.psum` (`patch_lax`).
_JAX_PSUM = jax.lax.psum
_JAX_PMEAN = jax.lax.pmean
_JAX_PSUM_SCATTER = jax.lax.psum_scatter
_JAX_ALL_GATHER = jax.lax.all_gather
_JAX_ALL_TO_ALL = jax.lax.all_to_all
#: Each kind's: `jax.lax`'s function of that name (the row's `lax`), as JAX defined it.
_JAX_FUNCTIONS: dict[Collective, Any] = {
    ALL_REDUCE: _JAX_PSUM, REDUCE_SCATTER: _JAX_PSUM_SCATTER, ALL_GATHER: _JAX_ALL_GATHER,
    ALL_TO_ALL: _JAX_ALL_TO_ALL}

#: Largest block count (engine worker tasks per all-reduce).
MAX_BLOCKS: int = lowering.MAX_BLOCKS

AxisName = Hashable
_SUPPORTED_DTYPES = lowering.ENGINE_DTYPES
#: Built-in profile per platform, used until the backend is calibrated: `model`'s table,
#: its one home (named here too, where the docs look for it).
DEFAULT_PROFILES = model.BUILTIN_PROFILES
#: With no overlap known, a block costs this fraction of the all-reduce's time (`planner`'s).
BLOCK_PENALTY = planner.BLOCK_PENALTY


def default_blocks(nbytes: int, world: int, profile: Any = "cpu-host",
                   collective: Collective | str = ALL_REDUCE) -> int:
    """Block count of a call with `blocks=None` outside `@libra_jax.optimize`, chosen when it
    is lowered: the model's choice with no overlapped compute known, 1..MAX_BLOCKS
    (`libra_jax.ops.blocks.resolve_blocks`, the one rule every layer calls). `profile` is a
    profile name, path or `model.Profile`; `nbytes` the full (unsharded) buffer's size per
    device; `collective` the kind (a name, "psum_scatter" or "reduce-scatter", or its row:
    `collectives.row_of`), priced by its own terms; the all-reduce by default."""
    return block_rule.resolve_blocks(collectives.row_of(collective), nbytes, world, profile)


def psum(x: Any, axis_name: AxisName | Sequence[AxisName], *,
         axis_index_groups: Sequence[Sequence[int]] | None = None,
         blocks: int | None = None, inplace: bool | None = None) -> Any:
    """All-reduce sum over mapped axes, like `jax.lax.psum`, with a chosen block count.

    Args:
      x: array or pytree of arrays, inside `jax.shard_map` or `jax.pmap`.
      axis_name: a mesh axis name or a tuple of them.
      axis_index_groups: as in `jax.lax.psum`; such psums are delegated to it.
      blocks: how many engine worker tasks (the CPU counterpart of CUDA thread
        blocks) carry out each all-reduce, 1..`MAX_BLOCKS`. ``None``: the
        contention model chooses (`default_blocks`) when the program is lowered,
        or `libra_jax.optimize` plans it. Recorded in the HLO either way.
      inplace: write the result over the input buffer (the custom call's output
        aliases its input). Free when the input is an intermediate value or a
        donated argument; for a live value XLA copies the input first. ``None``
        (default): in place unless `x` is an argument of the traced function.

    Returns:
      The same as `jax.lax.psum(x, axis_name)`, bit for bit on CPU.

    Raises:
      NameError: an axis name is not bound.
      ValueError: `blocks` is outside 1..MAX_BLOCKS.
      TypeError: `blocks` is not an int, or is given for a psum that is
        delegated to `jax.lax.psum` (which has no block count).
    """
    check_blocks(blocks)
    if inplace is not None and not isinstance(inplace, bool):
        raise TypeError(f"libra_jax.psum: inplace must be True, False or None, got {inplace!r}")
    if axis_index_groups is not None:
        return _delegate(x, axis_name, "axis_index_groups is not supported", blocks,
                         ALL_REDUCE, axis_index_groups=axis_index_groups)
    mesh_axes = _mesh_axes(x, axis_name, ALL_REDUCE)
    if isinstance(mesh_axes, str):
        # Only axes bound by vmap (or positional ones): a sum within each device, no
        # communication, so nothing to warn about (shape-only traces under vmap, such as
        # eqx.filter_pmap's, see nothing else). With a mesh axis among them, XLA's
        # all-reduce does the communication: said once.
        return _delegate(x, axis_name, mesh_axes or _VMAP_AXES, blocks, ALL_REDUCE,
                         quiet=not mesh_axes)
    if not mesh_axes:
        return x
    return jax.tree_util.tree_map(partial(_psum_leaf, axes=mesh_axes, blocks=blocks,
                                          inplace=inplace), x)


@contextlib.contextmanager
def patch_lax() -> Iterator[None]:
    """Within the block, `jax.lax.psum`, `pmean`, `psum_scatter` and `all_gather` are
    libra_jax's: a way to try the drop-ins on existing code without editing it. The
    previous functions come back on exit (also on an error).

    Limits: it acts when code is traced, so a function jitted and traced before the block
    keeps XLA's psum (trace it inside); a ``from jax.lax import psum`` taken earlier still
    names JAX's; the psums autodiff inserts (`check_vma`) are not `lax.psum` calls (use
    `libra_jax.optimize` for those). It does reach library code that calls
    ``jax.lax.psum``/``pmean`` by that name, such as Flax's BatchNorm with ``axis_name``.
    It changes a module attribute: not for several threads tracing at once.
    """
    # `jax.lax`'s functions of these names: the kinds' (their rows' `lax`), and pmean.
    names = (ALL_REDUCE.lax, "pmean", REDUCE_SCATTER.lax, ALL_GATHER.lax)
    saved = [getattr(jax.lax, name) for name in names]
    for name in names:
        setattr(jax.lax, name, globals()[name])
    try:
        yield
    finally:
        for name, previous in zip(names, saved):
            setattr(jax.lax, name, previous)


def pmean(x: Any, axis_name: AxisName | Sequence[AxisName], *,
          axis_index_groups: Sequence[Sequence[int]] | None = None,
          blocks: int | None = None, inplace: bool | None = None) -> Any:
    """All-reduce mean: `psum` divided by the number of participants, like `jax.lax.pmean`."""
    if axis_index_groups is not None:
        check_blocks(blocks)
        return _delegate(x, axis_name, "axis_index_groups is not supported", blocks,
                         ALL_REDUCE, axis_index_groups=axis_index_groups, op=_JAX_PMEAN)
    total = psum(x, axis_name, blocks=blocks, inplace=inplace)
    n = _JAX_PSUM(1, axis_name)
    return jax.tree_util.tree_map(lambda v: v / n, total)


def psum_scatter(x: Any, axis_name: AxisName | Sequence[AxisName], *, scatter_dimension: int = 0,
                 axis_index_groups: Sequence[Sequence[int]] | None = None, tiled: bool = False,
                 blocks: int | None = None) -> Any:
    """Reduce-scatter, like `jax.lax.psum_scatter`, with a chosen block count.

    Each device keeps its part of ``psum(x, axis_name)``, split along `scatter_dimension`:
    the part of index ``axis_index(axis_name)``. On CPU, libra's engine reads each device's
    `x` once and writes only that part.

    Args:
      x: array or pytree of arrays, inside `jax.shard_map` or `jax.pmap`.
      axis_name: a mesh axis name or a tuple of them.
      scatter_dimension: the dimension split among the devices, as in `jax.lax.psum_scatter`
        (negative counts from the end).
      axis_index_groups: as in `jax.lax.psum_scatter`; such calls are delegated to it.
      tiled: as in `jax.lax.psum_scatter`: untiled, that dimension's size is the axis size,
        and it is removed; tiled, it is divisible by the axis size, and divided.
      blocks: engine worker tasks, 1..`MAX_BLOCKS`; ``None``: `default_blocks` (the model's
        choice for a reduce-scatter of the buffer), chosen when the program is lowered; under
        `optimize`, a gradient's is planned.

    Returns:
      The same as `jax.lax.psum_scatter`, bit for bit on CPU (the rank-order sum, from +0).

    Raises:
      NameError: an axis name is not bound.
      ValueError: the dimension does not match or divide the axis size (JAX's error, with a
        note), or `blocks` is outside 1..MAX_BLOCKS.
      TypeError: `blocks` is not an int, or is given for a call delegated to
        `jax.lax.psum_scatter`.
    """
    row = REDUCE_SCATTER
    check_blocks(blocks, f"libra_jax.{row.lax}")
    axes = _mesh_axes(x, axis_name, row)
    kwargs = dict(scatter_dimension=scatter_dimension, tiled=tiled)
    if axis_index_groups is not None or isinstance(axes, str):
        reason = axes if isinstance(axes, str) else "axis_index_groups is not supported"
        return _delegate(x, axis_name, reason, blocks, row, quiet=reason == "",
                         axis_index_groups=axis_index_groups, **kwargs)
    if not axes:
        return x

    def leaf_call(leaf: Any) -> Any:
        aval = jax.typeof(leaf)
        state = _compat.input_state(aval, axes)
        reason = (f"{state} inputs are not supported" if state in ("unreduced", "reduced")
                  else "" if engine_dtype(aval.dtype) is not None
                  else f"dtype {aval.dtype} is not one the engine sums")
        if reason or not isinstance(leaf, _compat.Tracer):
            return _delegate(leaf, axes, reason, blocks, row, quiet=not reason, **kwargs)
        leaf = _vary(leaf, axes)
        dimension = _compat.canonicalize_axis(scatter_dimension, np.ndim(leaf))
        return _bind_noting(row, leaf, axis_name=axes,
                            scatter_dimension=dimension, axis_size=_axis_size(axes),
                            tiled=bool(tiled), blocks=_blocks(blocks))
    return jax.tree_util.tree_map(leaf_call, x)


def all_gather(x: Any, axis_name: AxisName | Sequence[AxisName], *,
               axis_index_groups: Sequence[Sequence[int]] | None = None, axis: int = 0,
               tiled: bool = False, to: str = "varying", blocks: int | None = None) -> Any:
    """All-gather, like `jax.lax.all_gather`, with a chosen block count.

    Every device gets every device's `x`, stacked along a new dimension `axis` (or, `tiled`,
    concatenated along the existing one). A copy: on CPU, libra's engine serves every dtype
    of whole bytes (floats, ints, bool, fp8 ...) by its bytes.

    Args:
      x: array or pytree of arrays, inside `jax.shard_map` or `jax.pmap`.
      axis_name: a mesh axis name or a tuple of them.
      axis: where the devices' values go, as in `jax.lax.all_gather`.
      tiled: as in `jax.lax.all_gather`: untiled, a new dimension `axis` of the axis size;
        tiled, concatenated along the existing dimension `axis`.
      to: ``'varying'`` (the default) or ``'invarying'`` (under `check_vma`, a result
        invariant over the axes: JAX's `all_gather_invariant`, whose gradient is a slice);
        ``'reduced'`` is delegated to `jax.lax.all_gather`.
      axis_index_groups: as in `jax.lax.all_gather`; such calls are delegated to it.
      blocks: engine worker tasks, 1..`MAX_BLOCKS`; ``None``: `default_blocks` (the model's
        choice for an all-gather of the gathered buffer), chosen when the program is lowered.

    Returns:
      The same as `jax.lax.all_gather`, bit for bit. Its transpose (`jax.grad`) is
      libra's reduce-scatter (`psum_scatter`'s primitive), as JAX's is its own.

    Raises:
      NameError: an axis name is not bound.
      ValueError: a bad `to` or `axis` (JAX's error), or `blocks` outside 1..MAX_BLOCKS.
      TypeError: `blocks` is not an int, or is given for a call delegated to
        `jax.lax.all_gather`.
    """
    row = ALL_GATHER
    check_blocks(blocks, f"libra_jax.{row.lax}")
    if to not in ("varying", "invarying", "reduced"):
        _JAX_ALL_GATHER(x, axis_name, axis=axis, tiled=tiled, to=to)  # JAX's error
    kwargs = dict(axis=axis, tiled=tiled, to=to)
    axes = _mesh_axes(x, axis_name, row)
    if axis_index_groups is not None or to == "reduced" or isinstance(axes, str):
        reason = ("axis_index_groups is not supported" if axis_index_groups is not None
                  else "to='reduced' is not supported" if to == "reduced"
                  else axes if isinstance(axes, str) else "")
        return _delegate(x, axis_name, reason, blocks, row, quiet=reason == "",
                         axis_index_groups=axis_index_groups, **kwargs)
    if not axes:
        return x
    invariant = to == "invarying" and _compat.check_vma_enabled()

    def leaf_call(leaf: Any) -> Any:
        reason = _copy_refused(jax.typeof(leaf), axes)
        if reason or not isinstance(leaf, _compat.Tracer):
            return _delegate(leaf, axes, reason, blocks, row, quiet=not reason, **kwargs)
        leaf = _vary(leaf, axes)
        ndim = np.ndim(leaf) if tiled else np.ndim(leaf) + 1
        return _bind_noting(row, leaf, axis_name=axes,
                            all_gather_dimension=_compat.canonicalize_axis(axis, ndim),
                            axis_size=_axis_size(axes), tiled=bool(tiled),
                            invariant=invariant, blocks=_blocks(blocks))
    return jax.tree_util.tree_map(leaf_call, x)


def all_to_all(x: Any, axis_name: AxisName | Sequence[AxisName], split_axis: int,
               concat_axis: int, *, axis_index_groups: Sequence[Sequence[int]] | None = None,
               tiled: bool = False, blocks: int | None = None) -> Any:
    """All-to-all, like `jax.lax.all_to_all`, with a chosen block count.

    Each device splits `x` along `split_axis` into one segment per device and sends segment
    ``d`` to device ``d``; what it receives it concatenates (`tiled`) or stacks along
    `concat_axis`, in device order: an expert-parallel layer's dispatch and combine. A copy:
    on CPU, libra's engine serves every dtype of whole bytes by its bytes.

    Args:
      x: array or pytree of arrays, inside `jax.shard_map` or `jax.pmap`.
      axis_name: a mesh axis name or a tuple of them.
      split_axis: the dimension split into one segment per device, as in
        `jax.lax.all_to_all`.
      concat_axis: the dimension the received segments are concatenated (or stacked) along.
      axis_index_groups: as in `jax.lax.all_to_all`; such calls are delegated to it.
      tiled: as in `jax.lax.all_to_all`: untiled, `split_axis`'s size is the axis size and it
        is removed, and a new dimension of that size is inserted at `concat_axis`.
      blocks: engine worker tasks, 1..`MAX_BLOCKS`; ``None``: `default_blocks` (the model's
        choice for an all-to-all of the buffer), chosen when the program is lowered.

    Returns:
      The same as `jax.lax.all_to_all`, bit for bit. Its transpose (`jax.grad`) is libra's
      all-to-all back, as JAX's is its own.

    Raises:
      NameError: an axis name is not bound.
      ValueError: `split_axis` does not split over the devices (JAX's error), or `blocks`
        outside 1..MAX_BLOCKS.
      TypeError: `blocks` is not an int, or is given for a call delegated to
        `jax.lax.all_to_all`.
    """
    row = ALL_TO_ALL
    check_blocks(blocks, f"libra_jax.{row.lax}")
    kwargs = dict(split_axis=split_axis, concat_axis=concat_axis, tiled=tiled)
    axes = _mesh_axes(x, axis_name, row)
    if axis_index_groups is not None or isinstance(axes, str):
        reason = ("axis_index_groups is not supported" if axis_index_groups is not None
                  else axes if isinstance(axes, str) else "")
        return _delegate(x, axis_name, reason, blocks, row, quiet=reason == "",
                         axis_index_groups=axis_index_groups, **kwargs)

    def leaf_call(leaf: Any) -> Any:
        reason = _copy_refused(jax.typeof(leaf), axes)
        if reason or not axes or not isinstance(leaf, _compat.Tracer):
            return _delegate(leaf, axis_name, reason, blocks, row, quiet=not reason,
                             **kwargs)
        return _bind_all_to_all(_vary(leaf, axes), axes, split_axis, concat_axis, bool(tiled),
                                _blocks(blocks))
    return jax.tree_util.tree_map(leaf_call, x)


def _bind_all_to_all(x: Any, axes: tuple, split: int, concat: int, tiled: bool,
                     blocks: int | None) -> Any:
    """libra's all-to-all primitive bound as `jax.lax.all_to_all` binds JAX's: an untiled
    call's stacked axis inserted before and its split axis taken out after (the primitive
    always splits and concatenates), with JAX's checks of the split axis's size."""
    size = _axis_size(axes)
    split = _compat.canonicalize_axis(split, np.ndim(x))
    concat = _compat.canonicalize_axis(concat, np.ndim(x))
    if tiled and x.shape[split] % size:
        raise ValueError(f"The size of all_to_all split_axis ({x.shape[split]}) has to be "
                         f"divisible by the size of the named axis {axes} ({size})")
    if not tiled and x.shape[split] != size:
        raise ValueError("all_to_all requires the size of the mapped axis axis_name to equal "
                         f"x.shape[split_axis], but they are {size} and {x.shape[split]} "
                         "respectively.")
    if not tiled and split != concat:
        if split < concat:
            concat += 1  # a position after the split axis is taken out
        else:
            split += 1
        x = jax.lax.expand_dims(x, (concat,))
    result = libra_all_to_all_p.bind(x, axis_name=axes, split_axis=split, concat_axis=concat,
                                     tiled=tiled, blocks=blocks)
    if not tiled and split != concat:
        result = jax.lax.squeeze(result, (split,))
    return result


#: Why a collective over axes bound by vmap (or positional ones) is `jax.lax`'s.
_VMAP_AXES = "axes bound by vmap or positional axes are done by XLA"


def _mesh_axes(x: Any, axis_name: Any, row: Collective) -> tuple | str:
    """The mesh axes a sharded collective (`row`) runs over (size-1 axes dropped, as JAX
    does), or, where `jax.lax` must do it, why ("" where nothing needs saying: only vmap's
    axes)."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    for name in axes:
        if not isinstance(name, int) and not _compat.axis_is_bound(name):
            _unbound_axis(x, axis_name, name, row)
    manual = _compat.manual_axes()
    mapped = [name for name in axes if not isinstance(name, int) and name in manual]
    if len(mapped) < len(axes):
        return _VMAP_AXES if mapped else ""
    return _compat.skip_size_one_axes(axes)


def _vary(leaf: Any, axes: tuple) -> Any:
    """As `jax.lax`'s collectives: under check_vma, the value made varying over `axes`."""
    if _compat.check_vma_enabled() and _compat.auto_pcast_enabled():
        missing = tuple(a for a in axes if a not in _compat.varying_axes(jax.typeof(leaf)))
        if missing:
            leaf = _compat.pvary(leaf, missing)
    return leaf


def _axis_size(axes: tuple) -> int:
    return int(jax.lax.axis_size(axes))


def _blocks(blocks: int | None) -> int | None:
    return None if blocks is None else int(blocks)


def _copy_refused(aval: Any, axes: tuple) -> str:
    """Why libra's copying collectives (all-gather, all-to-all) do not serve a leaf of type
    `aval` over `axes`, or "" where they do."""
    state = _compat.input_state(aval, axes)
    if state in ("unreduced", "reduced"):
        return f"{state} inputs are not supported"
    return "" if copyable(aval.dtype) else f"dtype {aval.dtype} is not of whole bytes"


def copyable(dtype: Any) -> bool:
    """Whether libra's all-gather serves `dtype`: it copies it by its bytes, so whole bytes
    (not int4 and the like, which XLA packs), and not JAX's extended dtypes (PRNG keys)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    bits = int(jax.dtypes.itemsize_bits(dtype))
    return bits >= 8 and bits % 8 == 0


def _bind_noting(row: Collective, leaf: Any, **params: Any) -> Any:
    """Bind `row`'s libra primitive (its "primitive" form), adding to JAX's error (from its
    abstract evaluation) what libra was asked."""
    try:
        return row.form("primitive").bind(leaf, **params)
    except (ValueError, TypeError) as e:
        dim = next(k for k in params if k.endswith("dimension"))
        rule = ""
        if row.scatters:
            rule = (": that dimension's size must "
                    + ("be divisible by" if params["tiled"] else "equal") + " the axis size")
        e.add_note(f"libra_jax.{row.lax}: {jax.typeof(leaf).str_short()} over "
                   f"{params['axis_name']} (axis size {params['axis_size']}), {dim}="
                   f"{params[dim]}, tiled={params['tiled']}{rule}.")
        raise


# --- Front end helpers ------------------------------------------------------

def engine_dtype(dtype: Any) -> np.dtype | None:
    """`dtype` as the numpy dtype the engine reduces, or None where it does not: outside
    `_SUPPORTED_DTYPES`, and JAX's extended dtypes (PRNG keys, ``key<fry>``), which numpy
    cannot even name."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None
    dtype = np.dtype(dtype)
    return dtype if dtype in _SUPPORTED_DTYPES else None


def check_blocks(blocks: Any, who: str = "libra_jax.psum") -> None:
    """TypeError or ValueError (from `who`) unless `blocks` is None or an int in
    1..MAX_BLOCKS."""
    if blocks is None:
        return
    if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)):
        raise TypeError(f"{who}: blocks must be an int or None, got {blocks!r}")
    if not 1 <= blocks <= MAX_BLOCKS:
        raise ValueError(f"{who}: blocks must be in [1, {MAX_BLOCKS}], got {blocks}")


def warn_invariant_operand(axes: tuple, who: str) -> None:
    """Say once that a psum's operand is already the same on every device of `axes` (under
    `check_vma`), which is almost always a gradient summed twice: `jax.grad` of a
    replicated parameter already sums its cotangent over the axis, so a psum of it
    multiplies by the axis size and a pmean leaves that sum, not the mean."""
    warn_once(
        "invariant-operand",
        f"{who}: a psum over {', '.join(map(repr, axes))} of an array that is already "
        "invariant over it (check_vma): the result is the axis size times the array (pmean: "
        "the array itself). Under jax.shard_map's default check_vma=True, jax.grad already "
        "sums a replicated parameter's gradient over the axis: pmean the loss inside the "
        "differentiated function instead, or use check_vma=False for per-device gradients.")


def _unbound_axis(x: Any, axis_name: Any, name: Any, row: Collective) -> None:
    """Raise what `jax.lax`'s function of `row` raises for an unbound axis in this context (its
    message differs between eager and traced code), with libra's hint added."""
    op = _JAX_FUNCTIONS[row]
    hint = (f"libra_jax.{row.lax}: call it inside jax.shard_map or jax.pmap over a mesh with an "
            f"axis named {name!r}.")
    try:
        op(x, axis_name)
    except Exception as e:
        e.add_note(hint)
        raise
    raise NameError(f"unbound axis name: {name}. {hint}")  # JAX accepted it: say so anyway


def _delegate(x: Any, axis_name: Any, reason: str, blocks: int | None, row: Collective, *,
              op: Any = None, quiet: bool = False, **kwargs: Any) -> Any:
    """`op` (by default `jax.lax`'s function of `row`, as JAX defined it) does the call: said
    once, unless `quiet`."""
    who = row.lax
    op = _JAX_FUNCTIONS[row] if op is None else op
    if blocks is not None:
        raise TypeError(
            f"libra_jax.{who}: blocks={blocks} cannot be honoured: {reason}, so this {who} is "
            f"done by jax.lax.{who}, which has no block count. Drop blocks= here.")
    if not quiet:
        warn_once("psum-delegated",
                  f"libra_jax.{who}: {reason}; delegating to jax.lax.{who}.")
    return op(x, axis_name, **kwargs)


def _psum_leaf(leaf: Any, *, axes: tuple, blocks: int | None, inplace: bool | None) -> Any:
    if not isinstance(leaf, _compat.Tracer):
        return _JAX_PSUM(leaf, axes)  # A constant: no communication needed.
    aval = jax.typeof(leaf)
    if not math.prod(aval.shape):
        # The sum of an empty array is itself: a constant, no call (nor XLA's all-reduce of
        # it, which jaxlib 0.11.2's XLA crashes compiling beside other results).
        return jax.numpy.zeros(aval.shape, aval.dtype)
    state = _compat.input_state(aval, axes)
    if state in ("unreduced", "reduced"):
        return _delegate(leaf, axes, f"{state} inputs are not supported", blocks, ALL_REDUCE)
    dtype = engine_dtype(aval.dtype)
    if dtype is None:
        return _delegate(leaf, axes, f"dtype {aval.dtype} is not supported by the engine",
                         blocks, ALL_REDUCE)
    if inplace is None:
        inplace = not _compat.is_traced_argument(leaf)
    invariant = _compat.check_vma_enabled()
    if invariant and _compat.auto_pcast_enabled():
        # As lax.psum: make the value varying over every reduced axis first.
        missing = tuple(a for a in axes if a not in _compat.varying_axes(aval))
        if missing:
            warn_invariant_operand(missing, "libra_jax.psum")
            leaf = _compat.pvary(leaf, missing)
    return libra_psum_p.bind(leaf, axes=axes, blocks=None if blocks is None else int(blocks),
                             inplace=inplace, invariant=invariant)
