"""The compiled extension and its lazy registration with XLA.

Registration waits for the CPU backend: registering FFI types before the
backend exists breaks its start-up (jaxlib replays handlers before types), and
waiting also lets users choose the device count after importing libra_jax.
"""
from __future__ import annotations

import threading

import jax

from libra_jax import _libra_ffi  # type: ignore[attr-defined]

ALLREDUCE_CPU_TARGET = "libra_allreduce_cpu"
MAX_BLOCKS: int = _libra_ffi.MAX_BLOCKS
MIN_CHUNK_BYTES: int = _libra_ffi.MIN_CHUNK_BYTES

_lock = threading.Lock()
_registered = False


def ensure_registered() -> None:
    """Register the FFI types and targets with the CPU backend, once."""
    global _registered
    with _lock:
        if _registered:
            return
        jax.devices("cpu")  # The backend must exist before anything is registered.
        for name, registration in _libra_ffi.types().items():
            jax.ffi.register_ffi_type(name, registration, platform="cpu")
        for name, target in _libra_ffi.registrations().items():
            jax.ffi.register_ffi_target(name, target, platform="cpu", api_version=1)
        _registered = True


def effective_blocks(count: int, itemsize: int, blocks: int) -> int:
    """Worker tasks the engine uses for `count` elements when `blocks` are asked for."""
    return int(_libra_ffi.effective_blocks(count, itemsize, blocks))
