"""`libra_start` / `libra_done`: a collective issued early and waited for where it is needed.

One pair of primitives for every kind, the kind a param (``collective``, a row of
`libra_jax.collectives` with a "pair" form, `Pair`: what the kind's params say of its members
and how each is held in flight, which this module provides the all-reduce's and the two
sharded kinds' rows; another kind's is refused by its row, `collectives.NoForm`), as
`libra_bucket` is every kind's bucket; one start rule and one done rule lower every kind's.
The names the pairs had before (`libra_psum_start_p` / `libra_psum_done_p`,
`libra_sharded_start_p` / `libra_sharded_done_p`) remain for a release as `base.OldName`s
binding these.

The all-reduce's pair (``collective=psum``, its row): `libra_jax.optimize(step, overlap="start-done")`
splits each planned gradient all-reduce (``overlap="auto"``, the default: each one the model
picks) into two equations of the rewritten program:

* ``libra_start(*xs, collective=psum)``, where the bucket's last gradient is ready:
  launches the all-reduce *in place* on the members where XLA put them (no packed copy). Its
  results are the members' buffers, in flight (each typed as its psum's result), and a token.
* ``libra_done(*buffers, token, ...)``, after the rest of the backward pass (`rewrite`: the
  pure equations downstream of its results, the optimizer update, move with it; an effect or
  another all-reduce that reads a result places it first): waits for the all-reduce; its
  results are the buffers (aliased), the psums' results.

What runs in between is the compute the all-reduce overlaps. Per platform:

* CUDA: start is one call per dtype over its members, on libra's own stream after an event
  from XLA's stream: on the ``nccl`` path ``libra_allreduce_nccl_start`` (NCCL's all-reduce
  of each member, as one NCCL group), with the P2P kernels ``libra_allreduce_cuda_start``
  (one launch over a table of the members' pointers, a launch per 32), a member they cannot
  take as it is (not whole 16-byte vectors) all-reduced in start. Done is ``libra_allreduce_cuda_done`` for both
  (XLA's stream waits for the call's end event) and its outputs alias its operands, the
  members' buffers, so XLA keeps them alive and unread until done.
* CPU: start is ``libra_allreduce_cpu_start``, one per dtype over its members: the device's
  buffers join their round; the call's future completes when the round ends (XLA runs what
  does not read start's results meanwhile, and a failing execution does not end, nor free the
  buffers, before the round has written them: docs/architecture.md, "Failed calls"); the
  engine reduces when the last rank arrives. done is ``libra_allreduce_cpu_done``: a future
  for the end of that round (usually over by then), outputs aliased as on CUDA.
* A buffer the engine does not serve (CUDA: dtype, group size, groups across processes; CPU:
  groups across processes) is all-reduced in start by the platform's one-call lowering, and
  done passes it through; elsewhere (TPU...) the same with XLA's all-reduce.

Start has one more result, a token (`TOKEN_AVAL`). A bucket of several dtypes is one call per
dtype; each call after the first reads the previous call's token (read by nothing: it orders
them), and start's token is the last call's (a constant where every member is empty, none
started). Done reads its own start's buffers and token, then any tokens it must not run
before, read by nothing (`optimize` passes the latest start's: XLA orders by data only, so
this keeps every done after the last start), while the in-flight buffers have one reader,
done, which XLA therefore never copies. A done is never dead code: lowered with a side
effect, XLA keeps it, and JAX's dead-code elimination keeps it too, so a start always has its
done. On a GPU, whether XLA's schedule keeps the kernel beside compute is what
`benchmarks/gpu_check.sh` measures.
`call_id` ties a start to its done: the CPU engine keys a started call by (call id, run id,
group, rank), a run id being unique per execution; the CUDA handlers key their events by (GPU,
call id); the id both see is the pair's key (`call_key`: of its call id, its kind and its dtype
group, one scheme for every kind). Both halves are emitted by the platform's
`lowering.PairCall` (`emit`, the `lowering.Call`'s ``phase`` saying which half), every kind's
alike. `optimize` numbers a program's pairs
from a fingerprint of the program's structure, so a retrace yields the same program (JAX's
compilation cache keeps working) and programs of another structure do not share ids. A GPU
start whose id is still in flight (the same program dispatched from two threads at once) fails
with an error rather than mixing the two; a pair inside a loop body is started and waited for
in each iteration, in order. A start whose execution failed before its done leaves its entry
behind, on either platform (on CPU, a libra call that fails first waits for its run's started
rounds still in flight; the CUDA handlers give no such guarantee); a later start drops it once
its all-reduce has ended and its done has not come within the timeout
(``_libra_ffi.cpu_pending_starts`` / ``cuda_pending_starts`` count the entries).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from libra_jax import _compat, collectives
from libra_jax.collectives import Collective
from libra_jax.ops import lowering, packing, shards
from libra_jax.ops.base import OldName, Platform, Rule, register_op
from libra_jax.ops.psum import ALL_REDUCE, allreduce_call, members_abstract_eval
from libra_jax.ops.sharded import ALL_GATHER, REDUCE_SCATTER, flat_call

__all__ = ["libra_start_p", "libra_done_p", "Pair", "register_pair", "TOKEN_AVAL",
           "libra_psum_start_p", "libra_psum_done_p", "libra_sharded_start_p",
           "libra_sharded_done_p"]

#: Start's last result, read by its own done after the buffers (and by later dones as an
#: ordering operand): written by start, it orders a done after a start by data (XLA orders by
#: data only), and no buffer is passed twice (a second reader of the in-flight buffer would
#: make XLA copy it while it is being reduced).
TOKEN_AVAL = _compat.ShapedArray((1,), np.int32)


# --- the pair ---------------------------------------------------------------------
#
# A start whose done is not in its program would hand XLA a buffer the engine still writes
# after start returns (XLA frees or reuses it, and the heap is corrupted). `optimize` makes
# both equations together; for the primitives bound by hand, a start is lowered only where a
# done of the same call was traced (its abstract evaluation registers the call), so a start
# bound alone (eagerly, or in a program that returns or drops its buffer) is refused, naming
# the call. A call id names one pair: two pairs of one program need two ids.

_DONES: set[tuple[Collective, int]] = set()


def register_pair(collective: Collective | str, call_id: int) -> None:
    """Says that the done of `collective`'s call `call_id` is in the program being made
    (`optimize` calls it for the pairs it makes; a done's abstract evaluation, for those bound
    by hand). `collective` is a row with a "pair" form, or its name where a pair is bound by
    hand (`collectives.row_of`: the boundary where a name becomes a row)."""
    _DONES.add((collectives.row_of(collective), int(call_id)))


def _check_paired(collective: Collective, call_id: int) -> None:
    if (collective, int(call_id)) not in _DONES:
        raise ValueError(
            f"libra_start (collective={collective.lax!r}, call_id={call_id}) has no libra_done of "
            "the same call in its program: its collective writes the in-flight buffer after "
            "start returns, so start must be followed by its done, which reads start's results "
            "(bound with the same collective and call_id). Bind the done, or let "
            "libra_jax.optimize place both.")


# --- call keys ----------------------------------------------------------------------
#
# One key scheme for the start/done of every kind: the engine keys a started call by
# ``call_id * KEY_SLOTS + slot`` (and run, group, rank on CPU; the GPU on CUDA), the slot the
# kind's first (`_first_slot`) plus the call's dtype group, so that a program's pairs of every
# kind may share ids.

#: Slots per call id; call ids are below `MAX_CALL_ID` so that every key fits an int64.
KEY_SLOTS = 4096
MAX_CALL_ID = 2**48
#: Where the kinds whose start is one call (the sharded kinds: one in-flight row of shards per
#: member, all of one call) have their slot, by their enum value: after the all-reduce's, one
#: start per dtype group from slot 0.
_ONE_CALL_SLOTS = KEY_SLOTS - 8


def _first_slot(collective: Collective) -> int:
    return 0 if collective is ALL_REDUCE else _ONE_CALL_SLOTS + collective.enum


def call_key(call_id: int, collective: Collective, group: int = 0) -> np.int64:
    """The key of `collective`'s start (and its done) of call `call_id` over its `group`-th
    dtype's members (`_groups`; a sharded start has one group)."""
    if not 0 <= call_id < MAX_CALL_ID:
        raise ValueError(f"libra_jax start/done: call_id must be in [0, 2**48), got {call_id}")
    return np.int64(call_id * KEY_SLOTS + _first_slot(collective) + group)


def _groups(ctx: Any, avals_in: Sequence[Any], avals_out: Sequence[Any]
            ) -> list[tuple[list[int], Any]]:
    """Per dtype (first-appearance order): the members' indices and a lowering context whose
    operands and results are theirs (`lowering.pair_call` decides per group)."""
    return [(idx, ctx.replace(primitive=None, avals_in=[avals_in[i] for i in idx],
                              avals_out=[avals_out[i] for i in idx]))
            for _, idx, _ in packing.packed_layout(avals_in, align_bytes=1)]


def _nbytes(aval: Any) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _started(pair: lowering.PairCall | None, idx: list[int], avals: Sequence[Any]
             ) -> list[int]:
    """The members a start of one dtype's members `idx` takes (start and done deciding
    alike): none where `pair` is None (all-reduced in start); else those that hold data: on
    CPU the engine's one call, on NCCL one group of a call per member (the same communicator
    and limit), with libra's P2P kernels one call over the members they take as they are (a
    table of their pointers; a member that is not whole 16-byte vectors is all-reduced in
    start, padded). An empty member is never started (its result is a constant), so a group
    of empty members has no start and no done: a start whose only in-flight buffers are empty
    has nothing XLA keeps alive, and XLA would delete it as dead code while its done, a side
    effect, stays (a done without its start)."""
    if pair is None:
        return []
    gpu_kernels = pair.engine not in ("cpu", "nccl")

    def takes(i: int) -> bool:
        nbytes = _nbytes(avals[i])
        return nbytes > 0 and not (gpu_kernels and nbytes % lowering.CUDA_VECTOR_BYTES)
    return [i for i in idx if takes(i)]


def _empty(aval: Any) -> Any:
    """The all-reduce of an empty member: itself, a constant (as the one-call path has it)."""
    return _compat.ir_constant(np.zeros(aval.shape, aval.dtype))


# --- One start rule and one done rule for every kind ------------------------------------
#
# A kind's pair form (`Pair`) says what differs: how many operands are members, the call over
# the in-flight buffers, each member's in-flight buffer (the operand itself, or its flat row
# of shards) and its result after done, and where a member libra does not start is done
# instead. Everything else is one rule each: the members per dtype (`_groups`: start and done
# decide alike), where libra splits them (`lowering.pair_call`), which it starts (`_started`),
# the start and the done of those (`lowering.PairCall.emit`, keyed by `call_key`), an empty
# member a constant.

def _start_rule(platform: Platform) -> Rule:
    def rule(ctx: Any, *operands: Any, collective: Collective, call_id: int,
             **params: Any) -> list[Any]:
        _check_paired(collective, call_id)
        form: Pair = collective.form("pair")
        n = form.members(params, len(operands))
        after, after_avals = list(operands[n:]), list(ctx.avals_in[n:])
        call = form.call(collective, params)
        flights, flight_avals = [], []
        for i, x in enumerate(operands[:n]):
            flight, flight_aval = form.flight(ctx.replace(avals_in=[ctx.avals_in[i]]), x, i,
                                              collective, params)
            flights.append(flight)
            flight_avals.append(flight_aval)
        outs: list[Any] = [None] * n
        # Start's token is its last call's; each call reads the one before's (the first, the
        # values start must not run before; read by nothing), so every call started feeds the
        # token each done reads: XLA deletes no call, and no done runs before every call of
        # its equation has started.
        token = _compat.ir_constant(np.zeros(TOKEN_AVAL.shape, TOKEN_AVAL.dtype))
        started = False
        for j, (idx, group) in enumerate(_groups(ctx, flight_avals, ctx.avals_out[:n])):
            pair = lowering.pair_call(group, call, platform)
            members = _started(pair, idx, flight_avals)
            if members:  # one start over the members' in-flight buffers where they are
                assert pair is not None
                before, before_avals = ([token], [TOKEN_AVAL]) if started else (after, after_avals)
                *results, token = pair.emit(
                    ctx.replace(primitive=None,
                                avals_in=[*(flight_avals[i] for i in members), *before_avals],
                                avals_out=[*(ctx.avals_out[i] for i in members), TOKEN_AVAL]),
                    call._replace(phase="start", key=int(call_key(call_id, collective, j)),
                                  inplace=form.in_place(collective)),
                    [*(flights[i] for i in members), *before])
                started = True
                for i, result in zip(members, results):
                    outs[i] = result
            for i in idx:
                if outs[i] is None and _nbytes(flight_avals[i]) == 0:
                    outs[i] = _empty(ctx.avals_out[i])
            rest = [i for i in idx if outs[i] is None]  # not started: its kind says where
            if rest:
                for i, result in zip(rest, form.unstarted(ctx, flights, flight_avals, rest, call,
                                                          collective, platform)):
                    outs[i] = result
        return [*outs, token]
    return rule


def _done_rule(platform: Platform) -> Rule:
    def rule(ctx: Any, *operands: Any, collective: Collective, out_avals: tuple, call_id: int,
             **params: Any) -> list[Any]:
        # Its own start's buffers and token (done reads only its own start's results: where
        # done goes, its start goes), then tokens it must not run before (optimize's: the
        # latest start's), read by nothing. Each of start's calls gets its done (the same
        # members, the same key); a member start did not start is its kind's to finish.
        form: Pair = collective.form("pair")
        n = len(out_avals)
        bufs, (token, *after) = list(operands[:n]), operands[n:]
        buf_avals = list(ctx.avals_in[:n])
        call = form.call(collective, params)
        flight_avals = [form.flight_of(a, collective, params) for a in buf_avals]
        tokens = [TOKEN_AVAL] * (1 + len(after))
        outs: list[Any] = [None] * n
        for j, (idx, group) in enumerate(_groups(ctx, flight_avals, buf_avals)):
            pair = lowering.pair_call(group, call, platform)
            members = _started(pair, idx, flight_avals)
            if members:  # the in-flight buffers once each (aliased to the outputs), the tokens
                assert pair is not None
                results = pair.emit(
                    ctx.replace(primitive=None,
                                avals_in=[*(buf_avals[i] for i in members), *tokens],
                                avals_out=[buf_avals[i] for i in members]),
                    call._replace(phase="done", key=int(call_key(call_id, collective, j))),
                    [*(bufs[i] for i in members), token, *after])
                for i, result in zip(members, results):
                    outs[i] = form.landed(ctx, result, buf_avals[i], out_avals[i], i, collective,
                                          params, pair.rank_group)
            for i in idx:
                if outs[i] is None:
                    outs[i] = form.finished(ctx, bufs[i], buf_avals[i], out_avals[i], i, call,
                                            collective, params, platform)
        return outs
    return rule


# --- The all-reduce's form ----------------------------------------------------------------
#
# Its members' buffers are summed in place where XLA keeps them (no packed copy), each typed
# as its psum's result; a member libra does not start (CUDA's P2P kernels: not whole 16-byte
# vectors; a platform or group the engine does not serve) is all-reduced in start by the
# platform's one-call lowering, and done passes it through. Params: ``axes``, ``blocks``,
# ``invariant`` (start), ``call_id``.

def _psum_start_eval(*avals: Any, collective: Collective, axes: tuple, blocks: int,
                     invariant: bool, call_id: int) -> Any:
    """Each member's buffer in flight, typed as its psum's result, and the token."""
    outs, effects = members_abstract_eval(*avals, axes=axes, blocks=blocks, invariant=invariant)
    return [*outs, TOKEN_AVAL], effects


def _psum_done_eval(*operands: Any, collective: Collective, out_avals: tuple, axes: tuple,
                    blocks: int, call_id: int) -> Any:
    register_pair(collective, call_id)
    return list(out_avals), set()


def _psum_call(collective: Collective, params: dict[str, Any]) -> lowering.Call:
    return allreduce_call(params["axes"], params["blocks"], params.get("invariant", False),
                          inplace=True)


def _one_call(ctx: Any, xs: Sequence[Any], avals: Sequence[Any], idx: Sequence[int],
              call: lowering.Call, collective: Collective, platform: Platform) -> list[Any]:
    """Members `idx` (one dtype) all-reduced in start by the platform's one-call lowering: as
    they are where its call takes several buffers, else packed into one buffer and split back
    (`avals`: the members' types; their results are typed alike)."""
    group = ctx.replace(primitive=None, avals_in=[avals[i] for i in idx],
                        avals_out=[ctx.avals_out[i] for i in idx])
    results = lowering.lower_members(group, [xs[i] for i in idx], call, platform)
    if results is not None:
        return results
    dtype = np.dtype(avals[idx[0]].dtype)
    count = sum(math.prod(avals[i].shape) for i in idx)
    flat = _compat.ShapedArray((count,), dtype)
    flat_ctx = ctx.replace(primitive=None, avals_in=[flat], avals_out=[flat])
    result, = _compat.ir_values(lowering.lower(flat_ctx, packing.pack(ctx, xs, idx, count),
                                               call, platform))
    outs: list[Any] = [None] * len(ctx.avals_out)
    packing.split(ctx, result, flat, ctx.avals_out, idx, outs)
    return [outs[i] for i in idx]


# --- The sharded kinds' form (reduce-scatter, all-gather) --------------------------------
#
# One form for both collectives (`collective`: the reduce-scatter's or the all-gather's row,
# each holding this pair), each start's operand one array, or several (a bucket's members, as
# `optimize` issues a group of forward all-gathers ahead: ``dimension`` then holds one
# dimension per member, the start one call over them all, done one result each). Each
# member's in-flight value is one flat buffer of the full size per device, the devices'
# shards in rank order (the scattered or gathered dimension moved to the front: no copy where
# it is the first), worked on in place as NCCL's in-place collectives are (cpp/libra/engine.h,
# "In place"):
#
# * reduce-scatter: start's buffer *is* its (flattened) operand, aliased; the engine writes
#   rank r's shard of the sum over it at offset r * shard; done waits and slices that shard.
# * all-gather: start's buffer is a fresh full-size result; the handler copies the device's
#   shard to offset r * shard in it before it joins the round, so the operand need not live
#   until done, and the round fills in the other shards; done waits and reshapes.
#
# On CPU start is ``libra_reduce_scatter_cpu_start`` / ``libra_all_gather_cpu_start`` and done
# is the all-reduce's ``libra_allreduce_cpu_done`` (keyed alike by call id, run, group, rank;
# its pending entries expire alike). Where the engine does not serve the call (other
# platforms, CUDA until libra has GPU versions, groups across processes) the collective is
# XLA's, with `lowering.rule`'s notice: the all-gather in start, the reduce-scatter in
# done (its start then only flattens); the values are the same. Params: ``collective``,
# ``axes``, ``dimension`` (the scattered dimension of the operand, or the gathered one of the
# result; a tuple, one per member), ``axis_size``, ``tiled``, ``blocks``, ``call_id``; done's
# ``out_avals`` is the one-call form's result types (one per member). Start may take more
# operands after its members: values it must not run before, read by nothing (the engine's
# and NCCL's starts accept and ignore them; XLA orders by data only and drops an
# `optimization_barrier` on CPU, so this is how `optimize` issues an all-gather when the
# gather before it is done); the one-call fallback ignores them too. The
# engine keys the pair by `call_key`, as every kind's.


def _flat_aval(aval: Any, collective: Collective, axis_size: int) -> Any:
    """The in-flight buffer's type: the full buffer, flat, typed as the operand otherwise."""
    size = int(np.prod(aval.shape)) * (axis_size if collective.gathers else 1)
    return aval.update(shape=(size,))


def _dimensions(dimension: int | tuple[int, ...]) -> tuple[int, ...]:
    """The members' dimensions: ``dimension`` an int for one member, a tuple (one each) for a
    bucket's start (its members lead its operands, then the values it waits for)."""
    return tuple(dimension) if isinstance(dimension, tuple) else (int(dimension),)


def _sharded_start_eval(*operands: Any, collective: Collective, axes: tuple,
                        dimension: int | tuple[int, ...], axis_size: int, tiled: bool,
                        blocks: int | None, call_id: int) -> Any:
    n = len(_dimensions(dimension))
    return ([*(_flat_aval(a, collective, axis_size) for a in operands[:n]), TOKEN_AVAL],
            _compat.axis_effects(axes))


def _sharded_done_eval(*operands: Any, collective: Collective, axes: tuple,
                       dimension: int | tuple[int, ...], axis_size: int, tiled: bool,
                       blocks: int | None, call_id: int, out_avals: tuple) -> Any:
    register_pair(collective, call_id)
    return list(out_avals), set()


def _sharded_call(collective: Collective, params: dict[str, Any]) -> lowering.Call:
    return flat_call(collective, params["axes"], params["axis_size"], params["blocks"])


def _to_row(ctx: Any, x: Any, i: int, collective: Collective, params: dict[str, Any]
            ) -> tuple[Any, Any]:
    """Member `i` as one flat row of shards (`shards.to_row_of_shards`)."""
    return shards.to_row_of_shards(ctx, x, collective.gathers,
                                   _dimensions(params["dimension"])[i], params["tiled"])


def _flat_in(aval: Any, collective: Collective, params: dict[str, Any]) -> Any:
    """The flat row start took, of an in-flight buffer typed `aval` (a gather's is its shard)."""
    return aval.update(shape=(aval.shape[0] // params["axis_size"] if collective.gathers
                              else aval.shape[0],))


def _gathered_now(ctx: Any, flats: Sequence[Any], flat_avals: Sequence[Any],
                  idx: Sequence[int], call: lowering.Call, collective: Collective,
                  platform: Platform) -> list[Any]:
    """Members `idx` not started: an all-gather's gathered in start by the platform's one-call
    lowering, each alone; a reduce-scatter's row passed on flat (its done reduce-scatters)."""
    if not collective.gathers:
        return [flats[i] for i in idx]
    return [_compat.ir_values(lowering.lower(
        ctx.replace(primitive=None, avals_in=[flat_avals[i]], avals_out=[ctx.avals_out[i]]),
        flats[i], call, platform))[0] for i in idx]


def _from_row(ctx: Any, flat: Any, flat_aval: Any, out_aval: Any, i: int,
              collective: Collective, params: dict[str, Any], rank_group: Any) -> Any:
    """Member `i`'s result of its done's row (`shards.from_row_of_shards`: an in-place
    reduce-scatter's shard sliced by `rank_group`)."""
    result, = shards.from_row_of_shards(
        ctx, flat, flat_aval, out_aval, collective.gathers, _dimensions(params["dimension"])[i],
        params["tiled"], rank_group=None if collective.gathers else rank_group)
    return result


def _scattered_now(ctx: Any, flat: Any, flat_aval: Any, out_aval: Any, i: int,
                   call: lowering.Call, collective: Collective, params: dict[str, Any],
                   platform: Platform) -> Any:
    """Member `i` not started: a reduce-scatter's row reduce-scattered now by the platform's
    one-call lowering (an all-gather's was gathered in start), made the op's result."""
    result_flat = flat_aval
    if not collective.gathers:
        result_flat = flat_aval.update(shape=(flat_aval.shape[0] // params["axis_size"],))
        flat, = _compat.ir_values(lowering.lower(
            ctx.replace(primitive=None, avals_in=[flat_aval], avals_out=[result_flat]), flat,
            call, platform))
    return _from_row(ctx, flat, result_flat, out_aval, i, collective, params, None)


# --- One pair for every kind --------------------------------------------------------------

class Pair(NamedTuple):
    """A kind's start/done form: what its params say of its members and how each is held in
    flight; the start and done rules (`_start_rule`, `_done_rule`) are every kind's.

    ``start_eval`` / ``done_eval`` type start's and done's results; ``members(params,
    operands)`` how many of start's operands are members (the rest are values it must not run
    before); ``call(collective, params)`` the call over the in-flight buffers, started in
    place where ``in_place(collective)``; ``flight(ctx, x, i, collective, params)`` member
    `i`'s in-flight buffer and its type, of which ``flight_of(buffer type, collective,
    params)`` gives done the type start took; ``landed(ctx, buffer, type, out type, i,
    collective, params, rank_group)`` member `i`'s result of its buffer after done;
    ``unstarted(ctx, flights, types, idx, call, collective, platform)`` in start the members
    `idx` libra does not start, and ``finished(ctx, buffer, type, out type, i, call,
    collective, params, platform)`` in done each of them."""

    start_eval: Callable[..., Any]
    done_eval: Callable[..., Any]
    members: Callable[[dict[str, Any], int], int]
    call: Callable[[Collective, dict[str, Any]], lowering.Call]
    in_place: Callable[[Collective], bool]
    flight: Callable[..., tuple[Any, Any]]
    flight_of: Callable[[Any, Collective, dict[str, Any]], Any]
    landed: Callable[..., Any]
    unstarted: Callable[..., list[Any]]
    finished: Callable[..., Any]


# The kinds with a start/done form: their rows hold it (`collectives.Collective.provide`);
# the two sharded kinds share one.
ALL_REDUCE.provide("pair", Pair(
    _psum_start_eval, _psum_done_eval,
    members=lambda params, operands: operands,
    call=_psum_call, in_place=lambda collective: True,
    flight=lambda ctx, x, i, collective, params: (x, ctx.avals_in[0]),
    flight_of=lambda aval, collective, params: aval,
    landed=lambda ctx, buffer, *rest: buffer,
    unstarted=lambda ctx, xs, avals, idx, call, collective, platform: _one_call(
        ctx, xs, avals, idx, call, collective, platform),
    finished=lambda ctx, buffer, *rest: buffer))
_SHARDED_PAIR = Pair(
    _sharded_start_eval, _sharded_done_eval,
    members=lambda params, operands: len(_dimensions(params["dimension"])),
    call=_sharded_call, in_place=lambda collective: not collective.gathers,
    flight=_to_row, flight_of=_flat_in, landed=_from_row, unstarted=_gathered_now,
    finished=_scattered_now)
REDUCE_SCATTER.provide("pair", _SHARDED_PAIR)
ALL_GATHER.provide("pair", _SHARDED_PAIR)


def start_abstract_eval(*operands: Any, collective: Collective, **params: Any) -> Any:
    """The kind's in-flight buffers (typed as its `Pair` says) and the token; its effects. A
    kind without a pair is refused by its row (`collectives.NoForm`)."""
    return collective.form("pair").start_eval(*operands, collective=collective, **params)


def done_abstract_eval(*operands: Any, collective: Collective, **params: Any) -> Any:
    """The kind's results (``out_avals``); registers the call as paired (`register_pair`)."""
    return collective.form("pair").done_eval(*operands, collective=collective, **params)


libra_start_p = register_op("libra_start", abstract_eval=start_abstract_eval,
                            lowering=_start_rule, multiple_results=True)
libra_done_p = register_op("libra_done", abstract_eval=done_abstract_eval,
                           lowering=_done_rule, multiple_results=True)
# A done is never dead code: JAX's dead-code elimination keeps it as it keeps an effect (and
# XLA's, its side effect), so a start never outlives its done.
_compat.keep_in_dce(libra_done_p)


def _sharded_params(params: dict) -> dict:
    params = dict(params)
    params["axes"] = params.pop("axis_name")
    if "out_aval" in params:
        params["out_avals"] = (params.pop("out_aval"),)
    return params


def _only(results: Any) -> Any:
    return results[0]


# The pairs' names before (kept for a release): the all-reduce's, and the sharded pair's,
# whose kind was already a param.
libra_psum_start_p = OldName("libra_psum_start", libra_start_p, ALL_REDUCE)
libra_psum_done_p = OldName("libra_psum_done", libra_done_p, ALL_REDUCE)
libra_sharded_start_p = OldName("libra_sharded_start", libra_start_p, None, _sharded_params)
libra_sharded_done_p = OldName("libra_sharded_done", libra_done_p, None, _sharded_params, _only)
