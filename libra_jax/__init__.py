"""libra_jax: contention-aware all-reduce for data-parallel JAX (Libra, INFOCOM 2023).

The public API is `__all__`; the documented modules are `libra_jax.model` (profiles and the
contention model), `libra_jax.planner` (the dynamic program), `libra_jax.config` (the
``LIBRA_JAX_*`` settings), `libra_jax.calibrate`, `libra_jax.ops` (the primitives) and
`libra_jax.testing` (comparing a step with its plain form: what is bitwise, and the bound).

Layers, lowest first; a module imports only from its own layer or below
(`tests/test_layout.py` checks it):

1. pure Python, no JAX: `config`, `planner`, `model`, `zoo`, `gantt`, `gpu_calibration`;
2. JAX and the extension: `_compat`, `_ffi`, `_nccl`;
3. the primitives: `ops`;
4. the front ends: `dropins` (`psum` and the other drop-ins), `rewrite` (`optimize`), `data_parallel`
   (`value_and_grad` for GSPMD steps);
5. tools: `explanation` (its gradients' names, `gradient_names`), `calibrate` (its fits,
   `calibrate.fit`, are pure), `cli`, `testing`.

The JAX front end is loaded on first attribute access, so that ``import libra_jax.planner``
needs neither JAX nor the compiled extension.

A source tree without its build (a clone that ``pip install .`` installed elsewhere, imported
because Python puts the script's or the current folder first on the path) imports, and its pure
layer and `build_info` work; importing it warns in one line where an installed copy exists,
and the first use of the extension raises a one-line ImportError naming the folder and the fix.
"""
from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# NCCL reads NCCL_LAUNCH_ORDER_IMPLICIT once, at the process's first NCCL launch (XLA's
# included): where libra's NCCL path is chosen, ask for it now, before any program runs.
from libra_jax import config as _config  # pure Python: no JAX, no extension

_config.request_nccl_launch_order()


class _SourceTreeWarning(UserWarning):
    """libra_jax was imported from a source tree without its extension while an installed
    copy exists elsewhere on the path."""


def _unbuilt() -> tuple[str, str | None] | None:
    """(error, warning) where this copy of the package has no compiled extension for this
    Python (a source tree), else None. The error is what the first use of the extension
    raises; the warning, said at import, is there only where an installed copy with its
    extension exists elsewhere on the path. Costs a look-up at import, no import of JAX."""
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    try:
        if importlib.util.find_spec(__name__ + "._libra_ffi") is not None:
            return None
    except (ImportError, ValueError):
        pass
    here = Path(__file__).resolve().parent

    def built(folder: Path) -> bool:
        return any((folder / f"_libra_ffi{suffix}").is_file()
                   for suffix in importlib.machinery.EXTENSION_SUFFIXES)

    other = None
    for entry in sys.path:  # an installed copy (with its extension) that this tree shadows
        try:
            spec = importlib.machinery.PathFinder.find_spec(__name__, [entry or "."])
        except (ImportError, ValueError, OSError):
            continue
        if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
            continue
        folder = Path(spec.origin).resolve().parent
        if folder != here and built(folder):
            other = folder
            break
    other_python = "" if built(here) or not any(here.glob("_libra_ffi.*.so")) else (
        " for this Python")
    fix = "run from another folder, or build the clone in place: pip install -e ."
    if other is None:
        return (f"libra_jax: the compiled extension is not built{other_python} in {here} (a "
                f"source tree without its build); build it: pip install -e . in the clone, "
                f"then run from any folder"), None
    return (f"libra_jax: the compiled extension is not built{other_python} in {here}, a source "
            f"tree imported instead of the installed copy in {other} (Python puts the script's "
            f"or the current folder first on the path); {fix}",
            f"importing the source tree {here} (no built extension), not the "
            f"installed copy {other}: the first call that needs the extension will fail; {fix}")


_UNBUILT = _unbuilt()
if _UNBUILT is not None and _UNBUILT[1] is not None:
    import warnings

    # One line: line 0 of no file has no source line to show under it.
    warnings.warn_explicit(_UNBUILT[1], _SourceTreeWarning, filename=__name__, lineno=0,
                           module=__name__)


def _unbuilt_error() -> ImportError | None:
    """The one-line ImportError the first use of the extension raises where this copy has
    none (`_unbuilt`); None where it has one (a failure to load it is then its own)."""
    if _UNBUILT is None:
        return None
    return ImportError(_UNBUILT[0], name=f"{__name__}._libra_ffi")


def _build_info_unbuilt() -> dict[str, Any]:
    """`build_info` in a source tree without its extension: that nothing of libra's runs,
    and why (``runs_here``, ``extension``)."""
    assert _UNBUILT is not None
    try:
        import jax

        gpus = len(jax.devices("gpu"))
    except RuntimeError:
        gpus = 0
    return {"version": __version__, "cuda": False, "cuda_path": _config.cuda_path(),
            "extension": None, "nccl": {"error": "the compiled extension is not built"},
            "gpus_visible": gpus, "runs_here": _UNBUILT[0]}


if TYPE_CHECKING:  # what a type checker sees; at run time they load lazily (`__getattr__`)
    from libra_jax._ffi import build_info
    from libra_jax.data_parallel import grad, value_and_grad
    from libra_jax.dropins import (
        MAX_BLOCKS,
        all_gather,
        all_to_all,
        default_blocks,
        patch_lax,
        pmean,
        psum,
        psum_scatter,
    )
    from libra_jax.explanation import Explanation, explain
    from libra_jax.model import Profile, load_profile
    from libra_jax.rewrite import CallPlan, OptimizeReport, optimize, rewrite_jaxpr

__all__ = [
    "psum", "pmean", "psum_scatter", "all_gather", "all_to_all", "patch_lax", "default_blocks", "MAX_BLOCKS",
    "optimize", "rewrite_jaxpr", "OptimizeReport", "CallPlan",
    "value_and_grad", "grad",
    "explain", "Explanation",
    "Profile", "load_profile",
    "build_info",
]

# Public name -> module that defines it.
_LAZY = {
    "build_info": "libra_jax._ffi",
    "psum": "libra_jax.dropins",
    "pmean": "libra_jax.dropins",
    "psum_scatter": "libra_jax.dropins",
    "all_gather": "libra_jax.dropins",
    "all_to_all": "libra_jax.dropins",
    "patch_lax": "libra_jax.dropins",
    "default_blocks": "libra_jax.dropins",
    "MAX_BLOCKS": "libra_jax.dropins",
    "optimize": "libra_jax.rewrite",
    "rewrite_jaxpr": "libra_jax.rewrite",
    "OptimizeReport": "libra_jax.rewrite",
    "CallPlan": "libra_jax.rewrite",
    "PsumPlan": "libra_jax.rewrite",  # CallPlan's deprecated name (warns), not in __all__
    "value_and_grad": "libra_jax.data_parallel",
    "grad": "libra_jax.data_parallel",
    "explain": "libra_jax.explanation",
    "Explanation": "libra_jax.explanation",
    "Profile": "libra_jax.model",
    "load_profile": "libra_jax.model",
}


#: The lazy modules that work without the compiled extension.
_PURE = frozenset({"libra_jax.model"})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'libra_jax' has no attribute {name!r}")
    error = _unbuilt_error()
    if error is not None and module not in _PURE:
        if name != "build_info":
            # Here, in one line, not from deep in the import (inside the user's tracing).
            raise error
        value: Any = _build_info_unbuilt
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
