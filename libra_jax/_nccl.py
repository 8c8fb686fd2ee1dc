"""NCCL for libra's GPU all-reduces (the ``nccl`` path, and groups across processes).

The C++ side (cpp/libra/nccl.h) resolves NCCL at run time, picks how a call's
block count reaches NCCL (per collective on NCCL >= 2.31, else one communicator
per block count; `$LIBRA_JAX_NCCL_CTA_ROUTE` may force either where the version has it,
`config.nccl_cta_route`), and creates and caches communicators when XLA initialises a
program. This module gives it what only Python has: the unique id of each communicator,
made by the process that holds the group's rank 0 and fetched by the others
through JAX's distributed key-value store (the store `jax.distributed` already
runs, so no extra rendezvous service and no extra port).

Communicators are identified by their members' global device ids (and, on the
per-communicator route, the block count), so every process derives the same
key without talking to the others, and a second program over the same devices
reuses the communicator.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from libra_jax import (
    _compat,
    collectives,
    config,
)

try:
    from libra_jax import _libra_ffi
except ImportError:  # a source tree without its build: one line saying so (libra_jax._unbuilt)
    from libra_jax import _unbuilt_error

    if (_error := _unbuilt_error()) is None:
        raise
    raise _error from None

#: Environment variable naming the NCCL library to use (default: the
#: libnccl.so.2 already loaded, e.g. by XLA, else the loader's search).
LIBRARY_ENV = "LIBRA_JAX_NCCL_LIBRARY"
KEY_PREFIX = "libra_jax/nccl"


@dataclasses.dataclass(frozen=True)
class Library:
    """The NCCL libra uses: where it came from, its version, and how the CTA limit reaches it."""
    path: str
    version_code: int
    version: str
    #: "per-collective" (ncclAllReduceConfig, >= 2.31), "per-communicator" (a communicator per
    #: block count, 2.17-2.30, or forced on any later one) or "none" (older: the block count
    #: cannot be honoured).
    route: str
    #: The largest per-call CTA limit libra asks of it (0: none); block counts above are capped.
    max_ctas: int
    #: On the per-communicator route: whether each block count's communicator is split from
    #: the group's with shared resources (NCCL >= 2.18: one unique id and the memory of one
    #: communicator per group) or made on its own (2.17: a unique id and buffers each).
    splits: bool = False

    @property
    def launch_order(self) -> str:
        """How this NCCL orders the launches of several communicators on one GPU (libra's
        and XLA's), without which they may deadlock: "config" (>= 2.31: libra's communicators
        ask for it, XLA's through NCCL_LAUNCH_ORDER_IMPLICIT), "env" (2.26-2.30: only
        through NCCL_LAUNCH_ORDER_IMPLICIT=1) or "streams" (older: only stream dependencies;
        libra's calls are ordered on its one stream per GPU, XLA's are not ordered with them).
        """
        if self.version_code >= 23100:
            return "config"
        return "env" if self.version_code >= 22600 else "streams"


_lock = threading.Lock()
_ids: dict[str, int] = {}


def library() -> Library:
    """Load NCCL (once per process) and describe it; RuntimeError naming the problem.

    The CTA route is `config.nccl_cta_route`'s (a ValueError for a value that is none), taken
    the first time NCCL is opened in the process: a forced route the loaded version lacks
    (per-collective below NCCL 2.31), or another forced route once NCCL is open, is a
    RuntimeError naming both."""
    path, code, version, route, max_ctas, splits = _libra_ffi.nccl_open(config.nccl_cta_route())
    return Library(path, int(code), version, route, int(max_ctas), bool(splits))


def available() -> tuple[bool, str]:
    """Whether NCCL can be used, and if not, why (for a fallback notice)."""
    try:
        library()
    except RuntimeError as e:
        return False, str(e)
    return True, ""


def communicator_key(global_ids: Sequence[int], blocks: int, lib: Library) -> str:
    """The job-wide name of the communicator over `global_ids` (in rank order): one per
    group, or per (group, block count) where each block count needs a unique id of its own
    (the per-communicator route without splits, NCCL 2.17)."""
    key = "devices=" + ",".join(str(int(i)) for i in global_ids)
    own = lib.route == "per-communicator" and not lib.splits
    return key + (f"/ctas={int(blocks)}" if own else "")


def communicator(global_ids: Sequence[int], *, blocks: int, holds_root: bool,
                 timeout_s: float) -> int:
    """This process's id of the communicator over `global_ids`, its unique id
    registered with the C++ side.

    The process that holds rank 0 (`holds_root`) makes the unique id and
    publishes it; the others wait for it at most `timeout_s` (then a
    RuntimeError naming the group, never a hang). Without `jax.distributed`
    every member is in this process and the id is made here.
    """
    lib = library()
    key = communicator_key(global_ids, blocks, lib)
    with _lock:
        if key in _ids:
            return _ids[key]
        client = _compat.distributed_client()
        store_key = f"{KEY_PREFIX}/{key}"
        if client is None or holds_root:
            unique_id = _libra_ffi.nccl_unique_id()
            if client is not None:
                client.key_value_set_bytes(store_key, unique_id)
        else:
            try:
                unique_id = client.blocking_key_value_get_bytes(store_key,
                                                                config.kv_wait_ms(timeout_s))
            except Exception as e:
                raise RuntimeError(
                    f"libra_jax: no NCCL unique id for the all-reduce over devices "
                    f"{list(global_ids)} after {timeout_s:g} s: the process holding its rank 0 "
                    f"did not publish one (it failed, or runs a different program). "
                    f"[{type(e).__name__}: {e}]") from e
        comm_id = len(_ids) + 1
        _libra_ffi.nccl_register_id(comm_id, bytes(unique_id))
        _ids[key] = comm_id
        return comm_id


def allreduce_host(comm_id: int, nranks: int, rank: int, blocks: int, array: object) -> None:
    """One rank's in-place all-reduce of a host numpy array on communicator `comm_id`
    (the GPU path's control flow with host buffers: for tests against a host NCCL). A rank
    that never joins is a RuntimeError after `LIBRA_JAX_TIMEOUT_S`, as on the GPU path."""
    _libra_ffi.nccl_allreduce_host(comm_id, nranks, rank, blocks, array,
                                   timeout_ms=config.timeout_ms())


def collective_host(kind: collectives.Collective | str, comm_id: int, nranks: int, rank: int,
                    blocks: int, input: object, output: object) -> None:
    """One rank's `kind` (a row, or its name as a test writes it: "all-reduce",
    "reduce-scatter", "all-gather", `collectives.row_of`) from host array `input` into
    `output` on communicator `comm_id`, as `allreduce_host`: NCCL's counts (a reduce-scatter's
    output and an all-gather's input are one rank's share) and in-place rule (views of one
    buffer at rank x share). The extension takes the kind by its model's name."""
    _libra_ffi.nccl_collective_host(collectives.row_of(kind).kind, comm_id, nranks, rank,
                                    blocks, input, output, timeout_ms=config.timeout_ms())


def collective_group_host(kind: collectives.Collective | str, comm_id: int, nranks: int,
                          rank: int, blocks: int, inputs: Sequence[object],
                          outputs: Sequence[object]) -> None:
    """One rank's bucket, `kind` from each host array of `inputs` into the same place of
    `outputs` (each pair as `collective_host` takes it), as one NCCL group through the
    communicator cache: what the start and one-call handlers issue for a bucket on the GPU,
    for tests of what each CTA route issues."""
    _libra_ffi.nccl_collective_group_host(collectives.row_of(kind).kind, comm_id, nranks, rank,
                                          blocks, list(inputs), list(outputs),
                                          timeout_ms=config.timeout_ms())


def communicators_created() -> int:
    """NCCL communicators this process has created."""
    return int(_libra_ffi.nccl_communicators())
