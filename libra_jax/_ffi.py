"""The compiled extension and its lazy registration with XLA.

Registration waits for the CPU backend: registering FFI types before the
backend exists breaks its start-up (jaxlib replays handlers before types), and
waiting also lets users choose the device count after importing libra_jax.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator

import jax

from libra_jax import _libra_ffi

ALLREDUCE_CPU_TARGET = "libra_allreduce_cpu"
#: The same call split in two (libra_jax.overlap): start arrives, done waits.
ALLREDUCE_CPU_START_TARGET = "libra_allreduce_cpu_start"
ALLREDUCE_CPU_DONE_TARGET = "libra_allreduce_cpu_done"
MAX_BLOCKS: int = _libra_ffi.MAX_BLOCKS
MIN_CHUNK_BYTES: int = _libra_ffi.MIN_CHUNK_BYTES

_lock = threading.Lock()
_registered = False

# Names a shared library to take the FFI types and targets from instead of the
# pip-built module, e.g. Bazel's bazel-bin/libra_jax_ffi.so (docs/bazel.md).
# The constants and helpers above and below still come from the module.
FFI_LIBRARY_ENV = "LIBRA_JAX_FFI_LIBRARY"


def _cpu_handlers() -> tuple[dict, dict]:
    """FFI types and CPU targets (name -> capsules): the module's, or $LIBRA_JAX_FFI_LIBRARY's."""
    path = os.environ.get(FFI_LIBRARY_ENV)
    if not path:
        return _libra_ffi.types(), _libra_ffi.registrations()
    try:
        lib = ctypes.CDLL(os.path.abspath(path))
        type_id, type_info = lib.LibraCpuAllReduceSiteTypeId, lib.LibraCpuAllReduceSiteTypeInfo
        instantiate, execute = lib.kCpuAllReduceInstantiate, lib.kCpuAllReduceExecute
        start_instantiate = lib.kCpuAllReduceStartInstantiate
        start, done = lib.kCpuAllReduceStart, lib.kCpuAllReduceDone
    except (OSError, AttributeError) as e:
        raise RuntimeError(f"{FFI_LIBRARY_ENV}={path}: not a libra_jax FFI library: {e}") from e
    type_id.restype = type_info.restype = ctypes.c_void_p
    site = {"type_id": jax.ffi.pycapsule(type_id()), "type_info": jax.ffi.pycapsule(type_info())}
    cpu = {"instantiate": jax.ffi.pycapsule(instantiate), "execute": jax.ffi.pycapsule(execute)}
    cpu_start = {"instantiate": jax.ffi.pycapsule(start_instantiate),
                 "execute": jax.ffi.pycapsule(start)}
    return {"libra_allreduce_cpu_site": site}, {ALLREDUCE_CPU_TARGET: cpu,
                                                ALLREDUCE_CPU_START_TARGET: cpu_start,
                                                ALLREDUCE_CPU_DONE_TARGET: jax.ffi.pycapsule(done)}


def ensure_registered() -> None:
    """Register the FFI types and targets with the CPU backend, once."""
    global _registered
    with _lock:
        if _registered:
            return
        jax.devices("cpu")  # The backend must exist before anything is registered.
        types, targets = _cpu_handlers()
        for name, registration in types.items():
            jax.ffi.register_ffi_type(name, registration, platform="cpu")
        for name, target in targets.items():
            jax.ffi.register_ffi_target(name, target, platform="cpu", api_version=1)
        _registered = True


@contextlib.contextmanager
def recording(capacity: int = 1 << 16) -> Iterator[list[dict]]:
    """Record every all-reduce the engine completes while the block runs.

    Yields a list that is filled when the block exits: one dict per call (label,
    group, iteration, world, dtype, bytes, blocks, tasks, and first_arrival_us,
    start_us, end_us on the engine's microsecond clock, see `now_us`), oldest
    first, at most `capacity` of them. Used by calibration and overlap studies.
    """
    records: list[dict] = []
    _libra_ffi.take_call_records()
    _libra_ffi.set_call_recording(capacity)
    try:
        yield records
    finally:
        records.extend(_libra_ffi.take_call_records())
        _libra_ffi.set_call_recording(0)


def now_us() -> int:
    """Now, on the clock of `recording`'s timestamps."""
    return int(_libra_ffi.now_us())


def effective_blocks(count: int, itemsize: int, blocks: int) -> int:
    """Worker tasks the engine uses for `count` elements when `blocks` are asked for."""
    return int(_libra_ffi.effective_blocks(count, itemsize, blocks))


# --- CUDA -------------------------------------------------------------------

ALLREDUCE_CUDA_TARGET = "libra_allreduce_cuda"
#: The same kernel on libra's own stream, and the wait for it (libra_jax.overlap).
ALLREDUCE_CUDA_START_TARGET = "libra_allreduce_cuda_start"
ALLREDUCE_CUDA_DONE_TARGET = "libra_allreduce_cuda_done"
#: Across processes: NCCL with a per-call CTA limit (cpp/libra/nccl.h).
ALLREDUCE_NCCL_TARGET = "libra_allreduce_nccl"
#: Whether the extension was built with the CUDA kernels (nvcc was found).
HAS_CUDA: bool = bool(getattr(_libra_ffi, "HAS_CUDA", False))
#: The largest replica group the CUDA kernels serve.
CUDA_MAX_RANKS: int = int(getattr(_libra_ffi, "CUDA_MAX_RANKS", 8))

_cuda_registered = False


def ensure_cuda_registered() -> bool:
    """Register the CUDA targets (platform "CUDA"), once; False without CUDA.

    Targets (no FFI types) may be registered before the CUDA backend exists:
    jax keeps them until the plugin starts."""
    global _cuda_registered
    with _lock:
        if not _cuda_registered:
            for name, target in _libra_ffi.cuda_registrations().items():
                jax.ffi.register_ffi_target(name, target, platform="CUDA", api_version=1)
            _cuda_registered = True
    return HAS_CUDA


def cuda_effective_blocks(nbytes: int, nranks: int, algorithm: int, blocks: int) -> int:
    """Blocks the CUDA kernel launches for a call (algorithm: 0 auto, 1 one-shot,
    2 two-shot), given this process's staging capacity."""
    if not HAS_CUDA:
        raise RuntimeError("libra_jax was built without CUDA")
    return int(_libra_ffi.cuda_effective_blocks(nbytes, nranks, algorithm, blocks))
