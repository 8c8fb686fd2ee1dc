"""libra_jax's settings from the environment: every ``LIBRA_JAX_*`` variable is read here.

Each setting is read when it is used (at trace or lowering time), not at import, so a test or
a launcher may set it after importing libra_jax. A value that is not one of the accepted ones is
a ValueError naming the variable. Pure Python: imports nothing of JAX or the extension, so the
planner's layer may use it.

| Variable                           | Setting                                                         |
| ---------------------------------- | --------------------------------------------------------------- |
| ``LIBRA_JAX_TIMEOUT_S``            | how long a rank waits for the others (`timeout_s`)              |
| ``LIBRA_JAX_CUDA``                 | the GPU data path: ``xla`` (default), ``p2p``, ``nccl``         |
| ``LIBRA_JAX_CUDA_ALGORITHM``       | the P2P kernels' algorithm: ``auto``, ``oneshot``, ``twoshot``  |
| ``LIBRA_JAX_NCCL_CTA_ROUTE``       | NCCL's CTA route: ``auto`` or one forced (`NCCL_CTA_ROUTES`)    |
| ``LIBRA_JAX_OVERLAP``              | `optimize`'s default ``overlap=``                               |
| ``LIBRA_JAX_PREFETCH``             | `optimize`'s default ``prefetch=``                              |
| ``LIBRA_JAX_PREFETCH_BYTES``       | `optimize`'s default ``prefetch_bytes=``                        |
| ``LIBRA_JAX_DISABLE``              | ``1``: `optimize` passes every call through unchanged           |
| ``LIBRA_JAX_NO_PROFILE_BROADCAST`` | ``1``: each process plans with its own profile                  |
| ``LIBRA_JAX_PROFILE_DIR``          | where calibrated profiles are written and found                 |
| ``LIBRA_JAX_PROFILE_PROBE``        | ``0``/``off``: plan with the shipped CPU profile as shipped     |

``LIBRA_JAX_FFI_LIBRARY`` (the FFI library to register from) and ``LIBRA_JAX_NCCL_LIBRARY``
(the NCCL to open) name libraries and are read where they are loaded (``_ffi``, ``_nccl``).

XLA's own ``XLA_FLAGS`` is not libra's, but the CLI, the examples, the benchmarks and the tests
all need host devices from it: `xla_flags` is the one place that edits it, keeping every flag
the caller gave (an ISA limit such as ``--xla_cpu_max_isa=AVX2`` must reach the program).

Every notice libra_jax prints (a warning: `notice` here, `libra_jax.ops.base.warn_once` once
per process) has a stable id and ends with the pointer `notice_text` adds: its entry in
``docs/troubleshooting.md``, whose anchor is the id.
"""
from __future__ import annotations

import math
import numbers
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "timeout_s", "timeout_ms", "kv_wait_ms",
    "kv_timeout_ms",
    "CUDA_PATH_ENV", "CUDA_PATHS", "cuda_path", "CUDA_ALGORITHM_ENV", "CUDA_ALGORITHMS",
    "cuda_algorithm", "bool_option", "choice_option", "OVERLAP_ENV", "OVERLAP_MODES",
    "overlap_mode", "PREFETCH_ENV",
    "prefetch_mode", "PREFETCH_BYTES_ENV", "DEFAULT_PREFETCH_BYTES", "prefetch_bytes", "DISABLE_ENV",
    "optimize_disabled", "NO_PROFILE_BROADCAST_ENV", "profile_broadcast", "PROFILE_DIR_ENV",
    "calibrated_profile_dir", "PROFILE_PROBE_ENV", "profile_probe", "NCCL_CTA_ENVS",
    "nccl_cta_overrides", "NCCL_CTA_ROUTE_ENV", "NCCL_CTA_ROUTES", "nccl_cta_route",
    "NCCL_LAUNCH_ORDER_ENV",
    "nccl_launch_order_implicit", "request_nccl_launch_order", "HOST_DEVICES_FLAG", "xla_flags",
    "TROUBLESHOOTING_PAGE", "notice_text", "notice",
]

#: How long a rank waits for the others: `$LIBRA_JAX_TIMEOUT_S` seconds (default 300).
TIMEOUT_ENV = "LIBRA_JAX_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
#: The longest finite timeout accepted (116 days): the engine's and the CUDA kernels' clocks
#: add it to a time stamp in nanoseconds, which must not overflow.
MAX_TIMEOUT_S = 1e7

#: The GPU data path switch: which all-reduce a psum lowered for CUDA becomes.
CUDA_PATH_ENV = "LIBRA_JAX_CUDA"
#: ``xla`` (the default): XLA's own all-reduce (NCCL, scheduled by XLA); libra's plan is
#: made and reported, its block counts are not applied. ``p2p``: libra's peer-to-peer
#: kernels among the GPUs of one process (groups across processes: libra's NCCL call).
#: ``nccl``: libra's NCCL call with the block count as its CTA limit, in one process and
#: across processes, every GPU one NCCL rank, on libra's own stream (one call, or start/done).
#: None of libra's GPU paths has run on a GPU yet, so both are opt-in.
CUDA_PATHS = ("xla", "p2p", "nccl")

#: The P2P kernels' algorithm (the value is the kernels' code: 0 chooses by size).
CUDA_ALGORITHM_ENV = "LIBRA_JAX_CUDA_ALGORITHM"
CUDA_ALGORITHMS = {"auto": 0, "oneshot": 1, "twoshot": 2}

#: `optimize`'s default ``overlap=``: how a gradient all-reduce is issued. One call
#: ("sync"; on CPU already asynchronous), a start/done pair around the compute it overlaps
#: ("start-done", `libra_jax.ops.start_done`), or per bucket whichever the model prices
#: lower ("auto").
OVERLAP_ENV = "LIBRA_JAX_OVERLAP"
OVERLAP_MODES = ("auto", "sync", "start-done")

#: `optimize`'s default ``prefetch=``: how far ahead of its use an all-gather is issued. "auto"
#: (the model's distance, `planner.plan_gathers`), "off" (one call where it is used), or a
#: number of gathers ahead.
PREFETCH_ENV = "LIBRA_JAX_PREFETCH"
#: `optimize`'s default ``prefetch_bytes=``: the most gathered bytes per device issued ahead of
#: their use at once (the memory prefetching may hold): 1 GiB.
PREFETCH_BYTES_ENV = "LIBRA_JAX_PREFETCH_BYTES"
DEFAULT_PREFETCH_BYTES = 1 << 30

#: Set (to anything but 0) to turn `optimize` into a pass-through.
DISABLE_ENV = "LIBRA_JAX_DISABLE"
#: Set to 1 (on every process) to plan with each process's own profile under multi-process JAX.
NO_PROFILE_BROADCAST_ENV = "LIBRA_JAX_NO_PROFILE_BROADCAST"
#: Directory of calibrated profiles (overrides the per-user cache directory).
PROFILE_DIR_ENV = "LIBRA_JAX_PROFILE_DIR"
#: ``0`` or ``off``: the CPU default is the shipped profile exactly, not rescaled by this
#: machine's probe (`libra_jax.model.probe`); ``1``, ``on`` or unset: rescaled.
PROFILE_PROBE_ENV = "LIBRA_JAX_PROFILE_PROBE"


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def timeout_s() -> float:
    """`$LIBRA_JAX_TIMEOUT_S` in seconds: inf for "wait forever" (``inf`` or ``0``), else
    0 < t <= MAX_TIMEOUT_S; anything else is a ValueError naming the variable."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value == 0 or value == math.inf:
        return math.inf
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                         f"or inf or 0 to wait forever; got {raw!r}")
    return value


def timeout_ms() -> int:
    """The timeout as the engine's and the CUDA handler's milliseconds: 0 waits forever, and
    any positive timeout is at least 1 ms (rounded up: 0.4 ms must not become "forever")."""
    seconds = timeout_s()
    return 0 if seconds == math.inf else max(1, math.ceil(seconds * 1000))


def kv_wait_ms(seconds: float) -> int:
    """`seconds` (inf: forever) as the wait of JAX's key-value store's blocking gets: whole
    milliseconds, at least 1, at most what its C int holds."""
    most = 2**31 - 1
    return most if seconds == math.inf else max(1, min(most, math.ceil(seconds * 1000)))


def kv_timeout_ms() -> int:
    """The timeout for a wait in JAX's key-value store, in its milliseconds."""
    return kv_wait_ms(timeout_s())


def cuda_path() -> str:
    """The GPU data path `$LIBRA_JAX_CUDA` selects (`CUDA_PATHS`); ValueError naming the
    variable for anything else."""
    raw = os.environ.get(CUDA_PATH_ENV, "")
    path = raw.strip().lower() or "xla"
    if path not in CUDA_PATHS:
        raise ValueError(f"{CUDA_PATH_ENV} must be one of {', '.join(CUDA_PATHS)}, got {raw!r}")
    return path


def cuda_algorithm() -> int:
    """The P2P kernels' algorithm code `$LIBRA_JAX_CUDA_ALGORITHM` selects (default auto)."""
    raw = os.environ.get(CUDA_ALGORITHM_ENV, "auto").strip().lower() or "auto"
    if raw not in CUDA_ALGORITHMS:
        raise ValueError(f"{CUDA_ALGORITHM_ENV} must be one of "
                         f"{', '.join(CUDA_ALGORITHMS)}, got {raw!r}")
    return CUDA_ALGORITHMS[raw]


def bool_option(value: object, name: str, who: str = "libra_jax.optimize") -> bool:
    """A boolean option (``fusion=``, ``enabled=``) as its type says: a Python or NumPy bool,
    returned as a Python bool. Anything else, 0 and 1 included, is a one-line TypeError naming
    the option and the value: ``bool("off")`` is True, so taking a string's truth would turn
    an option on that the caller meant off; no test, doc or example passes 0 or 1."""
    numpy = sys.modules.get("numpy")  # looked up, never imported (module docstring)
    if isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_)):
        return bool(value)
    raise TypeError(f"{who}: {name} must be True or False (a bool), got {value!r} "
                    f"({type(value).__name__})")


def choice_option(value: object, choices: Sequence[str], name: str,
                  who: str = "libra_jax.optimize") -> str:
    """`value` if it is a string among `choices`. Anything else, a non-string included (None, a
    bool, a number, an array), is a one-line ValueError naming the option, the choices and the
    value; the string is checked first, so no value is compared with the choices elementwise."""
    if isinstance(value, str) and value in choices:
        return value
    raise ValueError(f"{who}: {name} must be one of {', '.join(map(repr, choices))}, "
                     f"got {value!r}")


def overlap_mode(overlap: str | None, who: str = "libra_jax.optimize") -> str:
    """`overlap` if given, else `$LIBRA_JAX_OVERLAP`, else "auto"; ValueError naming the source
    for anything outside `OVERLAP_MODES`."""
    mode = (os.environ.get(OVERLAP_ENV, "").strip() or "auto") if overlap is None else overlap
    source = f"${OVERLAP_ENV}" if overlap is None else "overlap"
    return choice_option(mode, OVERLAP_MODES, source, who)


def prefetch_mode(prefetch: str | int | None, who: str = "libra_jax.optimize") -> str | int:
    """`prefetch` if given, else `$LIBRA_JAX_PREFETCH`, else "auto": "auto", or a distance (an
    int >= 0; "off" is 0). ValueError naming the source for anything else."""
    source = f"${PREFETCH_ENV}" if prefetch is None else "prefetch"
    value: object = ((os.environ.get(PREFETCH_ENV, "").strip() or "auto") if prefetch is None
                     else prefetch)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, str) and value in ("off", "auto"):
        return 0 if value == "off" else "auto"
    if _is_integer(value) and 0 <= value <= 64:  # type: ignore[operator]
        return int(value)  # type: ignore[call-overload]
    raise ValueError(f"{who}: {source} must be 'auto', 'off' or a number of all-gathers ahead "
                     f"(0 to 64), got {value!r}")


def prefetch_bytes(limit: int | None, who: str = "libra_jax.optimize") -> int:
    """`limit` if given, else `$LIBRA_JAX_PREFETCH_BYTES`, else `DEFAULT_PREFETCH_BYTES`: a
    number of bytes >= 0; ValueError naming the source for anything else."""
    source = f"${PREFETCH_BYTES_ENV}" if limit is None else "prefetch_bytes"
    value: object = limit
    if limit is None:
        raw = os.environ.get(PREFETCH_BYTES_ENV, "").strip()
        value = int(raw) if raw.isdigit() else (raw or DEFAULT_PREFETCH_BYTES)
    if _is_integer(value) and value >= 0:  # type: ignore[operator]
        return int(value)  # type: ignore[call-overload]
    raise ValueError(f"{who}: {source} must be a number of bytes >= 0, got {value!r}")


def _is_integer(value: object) -> bool:
    """An integer as JAX takes one: a Python int or a NumPy integer (both `numbers.Integral`),
    not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def optimize_disabled() -> bool:
    """Whether `$LIBRA_JAX_DISABLE` turns `optimize` into a pass-through."""
    return _flag(DISABLE_ENV)


def profile_broadcast() -> bool:
    """Whether multi-process `optimize` plans with process 0's profile (the default)."""
    return not _flag(NO_PROFILE_BROADCAST_ENV)


def profile_probe() -> bool:
    """Whether the CPU default profile is the shipped one rescaled by this machine's probe
    (`$LIBRA_JAX_PROFILE_PROBE`: unset, ``1`` or ``on``) or the shipped one exactly (``0`` or
    ``off``, what the tests set: their plans must not depend on the machine); ValueError naming
    the variable for anything else."""
    raw = os.environ.get(PROFILE_PROBE_ENV, "")
    value = raw.strip().lower()
    if value in ("", "1", "on"):
        return True
    if value in ("0", "off"):
        return False
    raise ValueError(f"{PROFILE_PROBE_ENV} must be 1, on, 0 or off, got {raw!r}")


#: NCCL's own settings that override the CTA limits libra passes (NCCL reads them itself).
NCCL_CTA_ENVS = ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS")


#: How the NCCL path's block count reaches NCCL (cpp/libra/nccl.h's CTA routes): ``auto`` (the
#: default: the loaded version's, per collective from NCCL 2.31, per communicator on 2.17-2.30),
#: ``per-collective`` (``ncclAllReduceConfig`` and its kin with a per-call limit; NCCL >= 2.31
#: only) or ``per-communicator`` (communicators whose config pins the CTAs, the plain entry
#: points; any NCCL >= 2.17). Why choose: NCCL >= 2.32 launches a call with a per-call CTA
#: limit apart from the rest of its group, so a bucket may cost a kernel per member per
#: collective and one per communicator; neither is measured yet (docs/gpu.md).
NCCL_CTA_ROUTE_ENV = "LIBRA_JAX_NCCL_CTA_ROUTE"
NCCL_CTA_ROUTES = ("auto", "per-collective", "per-communicator")


def nccl_cta_route() -> str:
    """The CTA route `$LIBRA_JAX_NCCL_CTA_ROUTE` asks for (`NCCL_CTA_ROUTES`; unset: "auto");
    ValueError naming the variable for anything else. The extension takes it when the process
    first opens NCCL (`libra_jax._nccl.library`), and refuses a route the loaded NCCL lacks
    (per-collective below 2.31) or another route once NCCL is open, naming it."""
    raw = os.environ.get(NCCL_CTA_ROUTE_ENV, "")
    route = raw.strip().lower() or "auto"
    if route not in NCCL_CTA_ROUTES:
        raise ValueError(f"{NCCL_CTA_ROUTE_ENV} must be one of {', '.join(NCCL_CTA_ROUTES)}, "
                         f"got {raw!r}")
    return route


#: NCCL's switch (2.26+) that orders a GPU's communicators' launches by the host's launch
#: order, without which several communicators on one GPU may deadlock (libra/streams.h).
NCCL_LAUNCH_ORDER_ENV = "NCCL_LAUNCH_ORDER_IMPLICIT"


def nccl_launch_order_implicit() -> bool:
    """Whether `$NCCL_LAUNCH_ORDER_IMPLICIT` asks NCCL for implicit launch order (``1``)."""
    return os.environ.get(NCCL_LAUNCH_ORDER_ENV, "").strip() == "1"


def request_nccl_launch_order() -> bool:
    """Set ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` where libra's NCCL path is chosen
    (`$LIBRA_JAX_CUDA` ``nccl`` or ``p2p``) and the variable is unset; True if it set it.
    NCCL reads it once, at the process's first NCCL launch (XLA's included), so libra_jax
    calls this when it is imported; a value the user set is left alone. A malformed
    `$LIBRA_JAX_CUDA` is reported where it is used (`cuda_path`), not here."""
    chosen = os.environ.get(CUDA_PATH_ENV, "").strip().lower() in ("nccl", "p2p")
    if not chosen or os.environ.get(NCCL_LAUNCH_ORDER_ENV, "").strip():
        return False
    os.environ[NCCL_LAUNCH_ORDER_ENV] = "1"
    return True


def nccl_cta_overrides() -> dict[str, str]:
    """NCCL's CTA settings present in the environment (`NCCL_CTA_ENVS`), by name: NCCL applies
    them over every communicator's and collective's configuration."""
    return {name: os.environ[name] for name in NCCL_CTA_ENVS if os.environ.get(name, "").strip()}


def calibrated_profile_dir() -> Path:
    """Where ``libra-jax calibrate`` writes and the default lookup finds calibrated profiles:
    ``$LIBRA_JAX_PROFILE_DIR``, else ``$XDG_CACHE_HOME/libra_jax/profiles`` (``~/.cache`` without
    ``XDG_CACHE_HOME``)."""
    override = os.environ.get(PROFILE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "libra_jax" / "profiles"


#: XLA's flag that splits the host CPU into that many devices.
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(host_devices: int | None, flags: str | None = None) -> str:
    """`flags` (default ``$XLA_FLAGS``) with the forced host device count as asked, every other
    flag kept in its place.

    ``host_devices=n`` adds ``--xla_force_host_platform_device_count=n`` where the flags force
    no count (a count the caller forced is theirs, and kept); ``None`` removes the forced count,
    for a process whose devices come from elsewhere (``jax_num_cpu_devices``,
    ``jax.distributed``). Set the result as ``XLA_FLAGS`` before JAX starts its CPU backend."""
    if host_devices is not None and (isinstance(host_devices, bool) or
                                     not isinstance(host_devices, int) or host_devices < 1):
        raise ValueError(f"host_devices must be a positive int or None, got {host_devices!r}")
    words = (os.environ.get("XLA_FLAGS", "") if flags is None else flags).split()
    forced = [w for w in words if w == HOST_DEVICES_FLAG or w.startswith(HOST_DEVICES_FLAG + "=")]
    if host_devices is None:
        words = [w for w in words if w not in forced]
    elif not forced:
        words.append(f"{HOST_DEVICES_FLAG}={host_devices}")
    return " ".join(words)


#: The page with one entry per notice, each anchored at the notice's id.
TROUBLESHOOTING_PAGE = "docs/troubleshooting.md"
_NOTICE_ID = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


def notice_text(notice_id: str, message: str) -> str:
    """`message` with the pointer to its troubleshooting entry appended: the one format of every
    notice, ``<message> [libra_jax notice <id>: docs/troubleshooting.md#<id>]``. `notice_id` is
    kebab-case (ValueError otherwise)."""
    if not _NOTICE_ID.fullmatch(notice_id):
        raise ValueError(f"a notice id is kebab-case, got {notice_id!r}")
    return f"{message} [libra_jax notice {notice_id}: {TROUBLESHOOTING_PAGE}#{notice_id}]"


def notice(notice_id: str, message: str, category: type[Warning] = UserWarning,
           stacklevel: int = 2) -> None:
    """`warnings.warn` of `notice_text` (every time: no dedupe); `stacklevel` counts as
    `warnings.warn`'s does from the caller of `notice`."""
    warnings.warn(notice_text(notice_id, message), category, stacklevel=stacklevel + 1)
