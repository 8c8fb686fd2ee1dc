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
from typing import Any

import jax

from libra_jax import collectives

try:
    from libra_jax import _libra_ffi
except ImportError:  # a source tree without its build: one line saying so (libra_jax._unbuilt)
    from libra_jax import _unbuilt_error

    if (_error := _unbuilt_error()) is None:
        raise
    raise _error from None

#: Role -> FFI target name, from the extension's one registration table
#: (xla_ffi/registry.cc), which also names the CUDA targets in a build without CUDA. Roles and
#: names follow from a collective's row (`collectives.Collective.role`, `.target`); `target`
#: looks one up.
TARGETS: dict[str, str] = dict(_libra_ffi.TARGETS)


def target(kind: collectives.Collective | str, engine: str, phase: str = "") -> str:
    """The registered FFI target of collective `kind` (its row; or a name, "all-reduce" or
    "psum", where a test or a tool asks: `collectives.row_of`) on `engine` ("cpu", "cuda":
    libra's P2P kernels, "nccl"), for one call or a pair's "start"; "done" is every pair's done
    on that engine's platform (`collectives.done_target`). RuntimeError where the extension
    registers none (libra's P2P kernels are all-reduces)."""
    row = collectives.row_of(kind)
    name = (collectives.done_target(engine) if phase == "done" else row.target(engine, phase))
    if name not in _NAMES:
        raise RuntimeError(f"libra_jax: the extension registers no {row.kind} target for "
                           f"{engine}{' ' + phase if phase else ''} ({name})")
    return name


def has_target(kind: collectives.Collective | str, engine: str, phase: str = "") -> bool:
    """Whether the extension registers `target(kind, engine, phase)` (the P2P kernels serve
    the all-reduce only, say)."""
    try:
        target(kind, engine, phase)
    except RuntimeError:
        return False
    return True


_NAMES = frozenset(TARGETS.values())
MAX_BLOCKS: int = _libra_ffi.MAX_BLOCKS
MIN_CHUNK_BYTES: int = _libra_ffi.MIN_CHUNK_BYTES

_lock = threading.Lock()
_registered = False

# Names a shared library to take the FFI types and targets from instead of the
# pip-built module, e.g. Bazel's bazel-bin/libra_jax_ffi.so (docs/bazel.md).
# The constants and helpers above and below still come from the module.
FFI_LIBRARY_ENV = "LIBRA_JAX_FFI_LIBRARY"


# The layout of xla_ffi/registry.h's structs (LibraFfiRegistry() of a shared library).
_STAGES = ("instantiate", "prepare", "initialize", "execute")


class _Target(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char_p), ("name", ctypes.c_char_p),
                ("platform", ctypes.c_char_p)] + [(stage, ctypes.c_void_p) for stage in _STAGES]


class _Type(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("platform", ctypes.c_char_p),
                ("type_id", ctypes.CFUNCTYPE(ctypes.c_void_p)),
                ("type_info", ctypes.CFUNCTYPE(ctypes.c_void_p))]


class _Table(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("num_targets", ctypes.c_int),
                ("targets", ctypes.POINTER(_Target)), ("num_types", ctypes.c_int),
                ("types", ctypes.POINTER(_Type))]


def library_registry(path: str) -> tuple[list[dict], list[dict]]:
    """The registration table of the FFI library at `path` (LibraFfiRegistry()).

    Returns (targets, types): targets as `_libra_ffi.registry()` lists them, each with
    `handlers` (stage -> address) added; types as {name, platform, type_id, type_info}
    (addresses). RuntimeError if `path` is not a libra_jax FFI library of this version."""
    try:
        lib = ctypes.CDLL(os.path.abspath(path))
        accessor = lib.LibraFfiRegistry
    except (OSError, AttributeError) as e:
        raise RuntimeError(f"{FFI_LIBRARY_ENV}={path}: not a libra_jax FFI library: {e}") from e
    accessor.restype = ctypes.POINTER(_Table)
    accessor.argtypes = []
    table = accessor()
    if not table or table.contents.version != _libra_ffi.REGISTRY_VERSION:
        version = table.contents.version if table else None
        raise RuntimeError(f"{FFI_LIBRARY_ENV}={path}: not a libra_jax FFI library: registry "
                           f"version {version}, expected {_libra_ffi.REGISTRY_VERSION}")
    table = table.contents
    targets = []
    for t in table.targets[:table.num_targets]:
        handlers = {stage: getattr(t, stage) for stage in _STAGES if getattr(t, stage)}
        targets.append({"role": t.role.decode(), "name": t.name.decode(),
                        "platform": t.platform.decode(),
                        "stages": [stage for stage in _STAGES if stage in handlers],
                        "handlers": handlers})
    types = [{"name": t.name.decode(), "platform": t.platform.decode(),
              "type_id": t.type_id(), "type_info": t.type_info()}
             for t in table.types[:table.num_types]]
    return targets, types


def _cpu_handlers() -> tuple[dict, dict]:
    """FFI types and CPU targets (name -> capsules): the module's, or $LIBRA_JAX_FFI_LIBRARY's."""
    path = os.environ.get(FFI_LIBRARY_ENV)
    if not path:
        return _libra_ffi.types(), _libra_ffi.registrations()
    targets, types = library_registry(path)
    cpu = [t for t in targets if t["platform"] == "cpu" and "execute" in t["handlers"]]
    names = {t["role"]: t["name"] for t in cpu}
    want = {t["role"]: t["name"] for t in _libra_ffi.registry() if t["platform"] == "cpu"}
    if names != want:
        raise RuntimeError(f"{FFI_LIBRARY_ENV}={path}: not a libra_jax FFI library of this "
                           f"version: its CPU targets are {names}, the module's {want}")
    registrations: dict = {}
    for t in cpu:
        capsules = {stage: jax.ffi.pycapsule(address) for stage, address in t["handlers"].items()}
        # A bare capsule for an execute-only target, as the module gives it.
        registrations[t["name"]] = capsules if len(capsules) > 1 else capsules["execute"]
    sites = {t["name"]: {"type_id": jax.ffi.pycapsule(t["type_id"]),
                         "type_info": jax.ffi.pycapsule(t["type_info"])}
             for t in types if t["platform"] == "cpu"}
    return sites, registrations


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


def build_info() -> dict[str, Any]:
    """What this build of libra_jax can do on a GPU, and what it finds at run time.

    ``cuda``: whether the CUDA calls were compiled (they are when the build finds a CUDA
    compiler: a system toolkit, or the nvidia-cuda-nvcc wheel in the building Python's
    site-packages, docs/install.md, "CUDA build with pip's CUDA"); with them, the compiler's path and
    version and the GPU architectures built for.
    ``nccl``: the NCCL libra loads at run time (`libra_jax._nccl`): its path, version and CTA
    route, or why there is none. A GPU user whose build has no CUDA calls gets XLA's all-reduce,
    with a one-time notice, whatever ``LIBRA_JAX_CUDA`` says.
    ``gpus_visible``: how many GPUs JAX sees here. ``runs_here``: one sentence saying which
    collectives this machine runs (the CPU engine; on a GPU, XLA's, libra's P2P kernels or NCCL)
    and why (built with CUDA or not, a GPU visible or not, NCCL found or not).
    ``extension``: the compiled module's path; None in a source tree without its build, where
    ``runs_here`` says so and what to do (`libra_jax` imports there, and warns where an
    installed copy exists elsewhere on the path)."""
    from libra_jax import _nccl, config

    info: dict[str, Any] = {"version": _package_version(), "cuda": HAS_CUDA,
                            "cuda_path": config.cuda_path(), "extension": _libra_ffi.__file__}
    info.update(getattr(_libra_ffi, "CUDA_BUILD", {}))
    ok, why = _nccl.available()
    if ok:
        lib = _nccl.library()
        info["nccl"] = {"path": lib.path, "version": lib.version, "route": lib.route,
                        "max_ctas": lib.max_ctas}
    else:
        info["nccl"] = {"error": why}
    info["gpus_visible"] = _visible_gpus()
    info["runs_here"] = _runs_here(info)
    return info


def _visible_gpus() -> int:
    """The GPUs JAX sees (0 where its GPU backend is absent or finds none)."""
    import jax

    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def _runs_here(info: dict[str, Any]) -> str:
    """`build_info`'s ``runs_here``: what runs on this machine, said plainly."""
    nccl = info["nccl"]
    nccl_said = ("NCCL not found" if "error" in nccl else
                 f"NCCL {nccl['version']} found")
    if not info["gpus_visible"]:
        built = ("built with CUDA, no GPU visible, " + nccl_said if info["cuda"]
                 else "built without CUDA, no GPU visible")
        return f"{built}: the CPU path runs (libra's engine on the host devices)"
    gpus = f"{info['gpus_visible']} GPU(s) visible"
    if not info["cuda"]:
        return (f"{gpus}, but this build has no CUDA calls: XLA's collectives run on them "
                "(rebuild with CUDA: docs/install.md)")
    path = info["cuda_path"]
    if path == "xla":
        return (f"{gpus}, built with CUDA, {nccl_said}: XLA's collectives run on them "
                "(the default; LIBRA_JAX_CUDA=p2p or nccl opts into libra's, not yet run on a "
                "GPU: docs/gpu.md)")
    if path == "p2p":
        return (f"{gpus}, built with CUDA: libra's P2P kernels run within a process "
                f"(LIBRA_JAX_CUDA=p2p; {nccl_said} for groups across processes)")
    if "error" in nccl:
        return (f"{gpus}, built with CUDA, NCCL not found: XLA's collectives run on them "
                "(LIBRA_JAX_CUDA=nccl needs NCCL: docs/gpu.md)")
    return f"{gpus}, built with CUDA, {nccl_said}: NCCL runs libra's collectives (LIBRA_JAX_CUDA=nccl)"


def _package_version() -> str:
    from libra_jax import __version__
    return __version__


def cuda_peer_access(devices: list[int]) -> bool | None:
    """Whether every pair of these CUDA devices (ordinals) can access each other's memory,
    which the P2P kernels need; None where CUDA cannot say (no GPU here: lowering for export
    or from a CPU mesh), and the handler finds out when it makes the team."""
    if not HAS_CUDA:
        return None
    found = int(_libra_ffi.cuda_peer_access(list(devices)))
    return None if found < 0 else bool(found)


def cuda_effective_blocks(nbytes: int, nranks: int, algorithm: int, blocks: int) -> int:
    """Blocks the CUDA kernel launches for a call (algorithm: 0 auto, 1 one-shot,
    2 two-shot), given this process's staging capacity."""
    if not HAS_CUDA:
        raise RuntimeError("libra_jax was built without CUDA")
    return int(_libra_ffi.cuda_effective_blocks(nbytes, nranks, algorithm, blocks))
