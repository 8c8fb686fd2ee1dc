"""Every JAX-internal name libra_jax uses, in one place.

JAX renames and moves its internals often (``psum_invariant``, ``jit``,
``remat2``, ``manual_axis_type``...). Code outside this module uses only public
JAX APIs and the names defined here, so a JAX upgrade is fixed here alone.
Tested with jax 0.10.2 and 0.12.x.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import mesh as _mesh_lib
from jax._src import shard_map as _shard_map
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.interpreters import pxla as _pxla
from jax._src.lax import parallel as _parallel
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax._src.sharding_impls import SPMDAxisContext
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive, Var
from jax.extend.core import jaxpr_as_fun as _jaxpr_as_fun
from jax.extend.core import jaxprs_in_params as _jaxprs_in_params

from libra_jax import collectives

__all__ = [
    "ClosedJaxpr", "Jaxpr", "Var", "jaxpr_as_fun", "closed_jaxpr", "jaxprs_in_params",
    "memoized_sub_jaxprs", "register_psum_rooflines", "dce", "keep_in_dce",
    "mesh_axis_sizes", "shard_aval", "unshard_aval", "distributed_client", "on_stream",
    "Primitive", "Tracer", "ShapedArray", "ir", "hlo",
    "psum_p", "psum_invariant_p", "reduce_scatter_p", "all_gather_p", "all_to_all_p", "all_gather_invariant_p",
    "canonicalize_axis", "axis_effects",
    "apply_primitive", "deflinear", "register_batcher", "register_lowering", "lower_fun",
    "ir_constant", "ir_tensor_type", "jit_static_args", "made_by_transpose", "is_var", "is_ref",
    "is_dropped", "with_varying", "pvary_eqn", "scan_num_carry",
    "check_vma_enabled", "auto_pcast_enabled", "varying_axes", "input_state",
    "pvary", "skip_size_one_axes", "axis_is_bound", "bound_axis_sizes", "context_mesh", "manual_axes", "replica_groups",
    "mesh_devices", "ffi_target_registration", "device_index", "is_traced_argument", "is_zero_cotangent",
    "zero_cotangent",
    "jax_version", "PSUM_PRIMITIVES", "DEVICE_MAPS", "OTHER_COLLECTIVES", "HigherOrder", "HIGHER_ORDER",
]

Tracer = _core.Tracer
ShapedArray = _core.ShapedArray
psum_p: Primitive = _parallel.psum_p
psum_invariant_p: Primitive = _parallel.psum_invariant_p
#: What `jax.lax.psum_scatter` and `jax.lax.all_gather` bind (`libra_jax.ops.reduce_scatter`,
#: `.all_gather` stand for them).
reduce_scatter_p: Primitive = _parallel.reduce_scatter_p
all_gather_p: Primitive = _parallel.all_gather_p
all_to_all_p: Primitive = _parallel.all_to_all_p
all_gather_invariant_p: Primitive = _parallel.all_gather_invariant_p


def all_gather_invariant(x: Any, axis_name: Any) -> Any:
    """`jax.lax.all_gather` (untiled, along a new leading axis) whose result is the same on
    every device of the axes and typed so under check_vma (a shard_map's ``P()`` output may
    be it): ``to="invarying"`` from jax 0.12, `all_gather_invariant` before."""
    if "to" in inspect.signature(jax.lax.all_gather).parameters:
        return jax.lax.all_gather(x, axis_name, to="invarying")
    return _parallel.all_gather_invariant(x, axis_name)
jax_version: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3])


# --- JAX's primitive names -------------------------------------------------------

#: JAX's psum primitives -> whether the primitive is `psum_invariant` (check_vma's).
PSUM_PRIMITIVES: dict[str, bool] = {"psum": False, "psum_invariant": True}
#: Primitives that map a function over devices (where psums can be bound).
DEVICE_MAPS = ("shard_map", "xla_pmap", "pmap")
#: JAX's collectives other than psum (name -> what a user calls it), which `optimize` leaves to
#: XLA: the kinds' primitives by their rows (`collectives.Collective.jax_primitives`:
#: `reduce_scatter` is `psum_scatter`, the gradient collective of sharded parameters), then
#: those of no kind.
OTHER_COLLECTIVES: dict[str, str] = {
    **{name: row.lax for row in collectives.ROWS for name in row.jax_primitives
       if name not in PSUM_PRIMITIVES},
    "ppermute": "ppermute", "pmax": "pmax", "pmin": "pmin",
    "ragged_all_to_all": "ragged_all_to_all",
}


class HigherOrder(NamedTuple):
    """What libra needs to know of a JAX higher-order primitive."""
    loop: bool  # its body may run many times (scan, while)
    mesh_param: str | None  # the param holding the mesh that binds its axes
    aligned: str | None  # the param holding a sub-jaxpr whose inputs and outputs are the
    #                      equation's, position by position (None: not so, e.g. cond, scan)


#: The higher-order primitives whose sub-jaxprs `optimize` rewrites and `explain` follows.
HIGHER_ORDER: dict[str, HigherOrder] = {
    "jit": HigherOrder(False, None, "jaxpr"),
    "pjit": HigherOrder(False, None, "jaxpr"),
    "closed_call": HigherOrder(False, None, "call_jaxpr"),
    "core_call": HigherOrder(False, None, "call_jaxpr"),
    "remat2": HigherOrder(False, None, "jaxpr"),
    "checkpoint": HigherOrder(False, None, "jaxpr"),
    "custom_jvp_call": HigherOrder(False, None, "call_jaxpr"),
    "custom_vjp_call": HigherOrder(False, None, "call_jaxpr"),
    "custom_vjp_call_jaxpr": HigherOrder(False, None, "fun_jaxpr"),
    "cond": HigherOrder(False, None, None),
    "shard_map": HigherOrder(False, "mesh", "jaxpr"),
    "scan": HigherOrder(True, None, None),
    "while": HigherOrder(True, None, None),
}


# --- Primitive rules --------------------------------------------------------

def apply_primitive(prim: Primitive, *args: Any, **params: Any) -> Any:
    """Eager evaluation of a primitive by compiling it alone."""
    return _dispatch.apply_primitive(prim, *args, **params)


def deflinear(prim: Primitive, transpose_rule: Callable[..., Any]) -> None:
    """JVP (linear: the primitive of the tangent) and transpose of `prim`."""
    _ad.deflinear2(prim, transpose_rule)


def is_zero_cotangent(ct: Any) -> bool:
    return type(ct) is _ad.Zero


def zero_cotangent(x: Any) -> Any:
    return _ad.Zero(x.aval)


def register_batcher(prim: Primitive, rule: Callable[..., Any]) -> None:
    """`rule(axis_data, vals_in, dims_in, **params)`; `axis_data.name` is the vmapped axis."""
    _batching.fancy_primitive_batchers[prim] = rule


def jax_batcher(prim: Primitive) -> Callable[..., Any]:
    """JAX's own batching rule of one of its primitives."""
    return _batching.fancy_primitive_batchers[prim]


def register_lowering(prim: Primitive, rule: Callable[..., Any], platform: str | None = None) -> None:
    _mlir.register_lowering(prim, rule, platform=platform)


def lower_fun(fun: Callable[..., Any], multiple_results: bool = False) -> Callable[..., Any]:
    return _mlir.lower_fun(fun, multiple_results=multiple_results)


def ir_constant(value: np.ndarray | np.generic) -> ir.Value:
    return _mlir.ir_constant(value)


def ir_tensor_type(ctx: Any, shape: tuple, dtype: Any) -> ir.Type:
    """The MLIR tensor type of an array of `shape` and `dtype` (in a lowering rule)."""
    return _mlir.aval_to_ir_type(ctx.module_context,
                                 _core.ShapedArray(tuple(shape), np.dtype(dtype)))


# --- Varying manual axes (check_vma) ----------------------------------------

def check_vma_enabled() -> bool:
    """True inside `shard_map(check_vma=True)`, where psum is `psum_invariant`."""
    return bool(_config._check_vma.value)


def auto_pcast_enabled() -> bool:
    return bool(_config.auto_pcast.value)


def varying_axes(aval: Any) -> frozenset:
    """The manual axes over which a value differs from device to device."""
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def input_state(aval: Any, axes: tuple) -> str:
    """'varying', 'invarying', 'unreduced' or 'reduced' (as `lax.psum` sees it)."""
    return _parallel._get_from(aval, axes, "libra_jax.psum")


def pvary(x: Any, axes: tuple) -> Any:
    """Cast an invariant value to varying over `axes` (psum's transpose)."""
    return _core.pvary(x, axis_name=axes)


def axis_effects(axes: Sequence[Any]) -> set:
    """The effects of a collective over `axes`, as JAX's collectives declare them."""
    return {_core.NamedAxisEffect(a) for a in axes}


def canonicalize_axis(axis: int, ndim: int) -> int:
    """`axis` in [0, ndim), negative counted from the end, as `jax.lax`'s collectives take it;
    JAX's own error where it is out of range."""
    return int(_parallel.canonicalize_axis(axis, ndim))


def skip_size_one_axes(axes: tuple) -> tuple:
    """Drop size-1 mesh axes exactly when `lax.psum` does."""
    return _parallel._maybe_skip_one_sized_axes(axes)


# --- Axis environment -------------------------------------------------------

def axis_is_bound(name: Any) -> bool:
    return bool(_core.get_axis_env().axis_exists(name))


def bound_axis_sizes() -> dict:
    """Axis name -> size of the named axes bound where this runs: an enclosing `pmap`'s or
    `shard_map`'s, while a function called inside one is traced."""
    return dict(_core.get_axis_env().axis_sizes)


def context_mesh() -> jax.sharding.Mesh | None:
    """The concrete mesh of a `jax.set_mesh` context, or None."""
    mesh = _mesh_lib.get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh


def manual_axes() -> frozenset:
    """Mesh axes made manual by the enclosing `shard_map` (or `pmap`)."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


# --- Lowering helpers -------------------------------------------------------

def replica_groups(ctx: Any, axes: tuple) -> tuple[tuple[int, ...], ...] | None:
    """XLA's replica groups of a psum over `axes`: the same groups, in the same
    order, that `lax.psum` lowers to. None outside a fully manual SPMD context."""
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext):
        return None
    if axis_ctx.manual_axes != frozenset(axis_ctx.mesh.axis_names):
        return None  # Partially automatic shard_map: XLA's psum handles it.
    return tuple(tuple(int(d) for d in g) for g in _pxla.axis_groups(axis_ctx, axes))


def mesh_devices(ctx: Any) -> tuple[Any, ...] | None:
    """The devices of the SPMD mesh being lowered, indexed as `replica_groups`
    numbers them (the mesh's flat order); None for an abstract mesh."""
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext):
        return None
    mesh = axis_ctx.mesh
    if not isinstance(mesh, jax.sharding.Mesh):
        return None  # AbstractMesh: lowering without devices (e.g. for export).
    return tuple(mesh.devices.flat)


def ffi_target_registration(name: str, platform: str) -> str | None:
    """How jaxlib holds FFI target `name` for `platform`: "pending" (queued until
    that platform's backend starts), "handled" (the backend took it, or takes
    registrations directly) or None (never registered)."""
    from jax._src.lib import xla_client as _xc
    xla_platform = _xc.xla_platform_names.get(platform, platform)
    with _xc._custom_callback_lock:
        if any(entry[0] == name for entry in _xc._custom_callback.get(xla_platform, [])):
            return "pending"
        if xla_platform in _xc._custom_callback_handler:
            return "handled"
    return None


def device_index(ctx: Any) -> ir.Value:
    """The running device's index in the replica-group numbering (SPMD partition id)."""
    del ctx
    pid = hlo.partition_id()
    return hlo.convert(ir.RankedTensorType.get([], ir.IntegerType.get_signless(32)), pid)



def is_traced_argument(x: Any) -> bool:
    """Whether `x` is an input (or a constant) of the function being traced,
    rather than the result of an operation in it."""
    return isinstance(x, _pe.DynamicJaxprTracer) and x.parent is None


# --- Jaxprs ---------------------------------------------------------------------

def jaxpr_as_fun(closed: ClosedJaxpr) -> Callable[..., Any]:
    return _jaxpr_as_fun(closed)


def closed_jaxpr(jaxpr: Jaxpr, consts: Any) -> ClosedJaxpr:
    return ClosedJaxpr(jaxpr, consts)


_memo = threading.local()  # per thread: `memoized_sub_jaxprs`'s table, or none


def dce(jaxpr: Jaxpr) -> Jaxpr:
    """`jaxpr` without the equations no output, effect or kept equation needs, through every
    sub-jaxpr JAX's dead-code elimination reaches (`pjit`, `shard_map`, loops, `cond`); its
    inputs and outputs unchanged."""
    return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def keep_in_dce(prim: Primitive) -> None:
    """JAX's dead-code elimination keeps every equation of `prim`, and every input it reads,
    used or not (as it keeps an effect): a collective's done, whose start is in flight."""
    def rule(*args: Any) -> tuple[list[bool], Any]:
        # (used outputs, eqn) up to jax 0.11; (used outputs, live inputs, eqn) since 0.12.
        eqn = args[-1]
        return [True] * len(eqn.invars), eqn
    _pe.dce_rules[prim] = rule


def jaxprs_in_params(params: dict) -> list[Jaxpr]:
    """The (open) jaxprs among an equation's parameters (do not modify the list: inside
    `memoized_sub_jaxprs` it is shared)."""
    table = getattr(_memo, "table", None)
    if table is None:
        return list(_jaxprs_in_params(params))
    hit = table.get(id(params))
    if hit is not None and hit[0] is params:
        return hit[1]
    found = list(_jaxprs_in_params(params))
    table[id(params)] = (params, found)  # the params stay referenced: their id stays theirs
    return found


@contextlib.contextmanager
def memoized_sub_jaxprs() -> Iterator[None]:
    """Within the block (on this thread), `jaxprs_in_params` looks at each equation's
    parameters once: a rewrite asks for every equation's sub-jaxprs several times, and
    JAX's scan of the parameters is a fifth of its time on a large program."""
    outer = getattr(_memo, "table", None)
    if outer is None:
        _memo.table = {}
    try:
        yield
    finally:
        if outer is None:
            _memo.table = None


def ir_values(x: Any) -> list[ir.Value]:
    """A lowering rule's result (a value, a list of values, or an OpResultList) as a list."""
    return [x] if isinstance(x, ir.Value) else list(x)


def new_var(aval: Any) -> Any:
    """A fresh jaxpr variable of type `aval`."""
    return _core.Var(aval)


def shard_aval(mesh: Any, manual_axes: Any, check_vma: bool, spec: Any, aval: Any) -> Any:
    """The type of one device's block of a `shard_map` input of type `aval` laid out as
    `spec` (what its body's binder is typed as)."""
    return _shard_map.shard_aval(mesh, manual_axes, check_vma, spec, aval)


def unshard_aval(mesh: Any, check_vma: bool, spec: Any, aval: Any) -> Any:
    """The type of a `shard_map` result whose body returns `aval` laid out as `spec`."""
    return _shard_map.unshard_aval(mesh, check_vma, spec, aval)


def mesh_axis_sizes(mesh: Any) -> dict:
    """Axis name -> size of a (concrete or abstract) mesh."""
    return dict(mesh.shape)


def is_ref(x: Any) -> bool:
    """Whether `x` is a mutable array reference (`jax.new_ref`'s, traced or not): a value
    that is not passed to a shard_map as an input."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        return False
    return type(aval).__name__ == "AbstractRef"


def is_var(v: Any) -> bool:
    """Whether a jaxpr atom is a variable (not a literal)."""
    return isinstance(v, Var)


def is_dropped(v: Any) -> bool:
    """Whether an equation's output variable is unused (``_`` in a jaxpr)."""
    return isinstance(v, _core.DropVar)


def scan_num_carry(params: dict) -> int:
    """How many of a `scan` body's outputs (and equation's) are the carry, the rest being ys."""
    if "num_carry" in params:
        return int(params["num_carry"])
    return len(params["ft_out"].unpack()[0].vals)  # jax >= 0.11: the scan's flat trees


def with_varying(aval: Any, axes: Sequence[Any]) -> Any:
    """`aval` typed as varying over `axes` too (an unreduced value under `check_vma`)."""
    mat = getattr(aval, "mat", None)
    if mat is not None:  # jax >= 0.11: the manual axis type
        return aval.update(manual_axis_type=mat.update(varying=mat.varying | frozenset(axes)))
    if not hasattr(aval, "vma"):
        return aval
    return aval.update(vma=frozenset(aval.vma) | frozenset(axes))


def pvary_eqn(operand: Any, axes: Sequence[Any], like: Any) -> Any:
    """An equation casting jaxpr variable `operand` to varying over `axes` (check_vma's
    `pvary`, as autodiff writes it), with `like`'s source; None where this JAX has no
    `pvary` primitive."""
    prim = getattr(_core, "pvary_p", None)
    if prim is None:  # pragma: no cover - depends on the JAX version
        return None
    out = new_var(with_varying(operand.aval, axes))
    return like.replace(primitive=prim, invars=[operand], outvars=[out],
                        params={"axes": tuple(axes)}, effects=_core.no_effects)


def made_by_transpose(eqn: Any, deep: bool = True) -> bool:
    """Whether autodiff's transpose made `eqn` (a `transpose` transform on its name stack:
    the backward pass of `jax.grad` and friends), or (`deep`) an equation of one of its
    sub-jaxprs. A loop autodiff transposed has it on its own stack, not on its body's."""
    stack = getattr(getattr(eqn, "source_info", None), "name_stack", None)
    for entry in getattr(stack, "stack", ()):
        if type(entry).__name__ == "Transform" and getattr(entry, "name", None) == "transpose":
            return True
    return deep and any(made_by_transpose(e) for sub in jaxprs_in_params(eqn.params)
                        for e in getattr(sub, "jaxpr", sub).eqns)


def jit_static_args(fn: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The static argument positions and names of a `jax.jit`-ed `fn` (its `PjitInfo`), or
    empty ones for anything else."""
    info = getattr(fn, "_jit_info", None)
    if info is None:
        return (), ()
    return (tuple(getattr(info, "static_argnums", ()) or ()),
            tuple(getattr(info, "static_argnames", ()) or ()))


def distributed_client() -> Any:
    """JAX's distributed key-value store client, or None without `jax.distributed`."""
    from jax._src import distributed

    return distributed.global_state.client


def on_stream(fn: Callable[..., Any], stream: int) -> Callable[..., Any]:
    """`fn` annotated to run on XLA:GPU's stream `stream` (needs the XLA flag
    --xla_gpu_experimental_stream_annotation=true). jax < 0.11 takes
    `compute_on(type)` as a context manager; later versions as a decorator that
    also names the outputs' memory space."""
    from jax.experimental.compute_on import compute_on

    compute_type = f"gpu_stream:{stream}"
    if "out_memory_spaces" not in inspect.signature(compute_on).parameters:
        def annotated(*args: Any, **kwargs: Any) -> Any:
            with compute_on(compute_type):
                return jax.jit(fn)(*args, **kwargs)
        return annotated
    # Typed for one jax version only: the ignore is unused on the other.
    return compute_on(compute_type=compute_type,  # type: ignore[call-arg, unused-ignore]
                      out_memory_spaces=jax.memory.Space.Device)(fn)


# --- jax.experimental.roofline ---------------------------------------------------------

def register_psum_rooflines(reducing: Sequence[Any], waiting: Sequence[Any]) -> bool:
    """Make `jax.experimental.roofline` count libra's all-reduces as the all-reduces they are:
    each of `reducing` (its operands all-reduced over its ``axes``) with the rule JAX has for
    its own psum, each of `waiting` (a done: its start was counted) as free. False, and
    nothing registered, where this JAX has no roofline or no psum rule."""
    try:  # the module: the package's `roofline` is its function of that name
        _roofline: Any = importlib.import_module("jax.experimental.roofline.roofline")
    except ImportError:  # pragma: no cover - depends on the JAX version
        return False
    rules = getattr(_roofline, "_rooflines", None)
    psum_rule = rules.get(psum_invariant_p) if isinstance(rules, dict) else None
    if psum_rule is None:
        return False

    def reduce_rule(ctx: Any, *args: Any, axes: tuple, **params: Any) -> Any:
        kind = params.get("collective")  # a bucket's, a start's: its row
        if kind is not None and kind.gathers:  # gathers: no all-reduce to count
            return _roofline.RooflineResult()
        return psum_rule(ctx, *args, axes=axes)

    def free_rule(ctx: Any, *args: Any, **params: Any) -> Any:
        return _roofline.RooflineResult()

    for prim in reducing:
        _roofline.register_roofline(prim)(reduce_rule)
    for prim in waiting:
        _roofline.register_roofline(prim)(free_rule)
    return True
