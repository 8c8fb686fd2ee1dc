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
4. the front ends: `allreduce` (`psum`), `rewrite` (`optimize`), `data_parallel`
   (`value_and_grad` for GSPMD steps);
5. tools: `explanation`, `calibrate` (its fits, `calibrate.fit`, are pure), `cli`, `testing`.

The JAX front end is loaded on first attribute access, so that ``import libra_jax.planner``
needs neither JAX nor the compiled extension.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# NCCL reads NCCL_LAUNCH_ORDER_IMPLICIT once, at the process's first NCCL launch (XLA's
# included): where libra's NCCL path is chosen, ask for it now, before any program runs.
from libra_jax import config as _config  # pure Python: no JAX, no extension

_config.request_nccl_launch_order()

if TYPE_CHECKING:  # what a type checker sees; at run time they load lazily (`__getattr__`)
    from libra_jax._ffi import build_info
    from libra_jax.allreduce import MAX_BLOCKS, all_gather, default_blocks, patch_lax, pmean, psum, psum_scatter
    from libra_jax.data_parallel import grad, value_and_grad
    from libra_jax.explanation import Explanation, explain
    from libra_jax.model import Profile, load_profile
    from libra_jax.rewrite import OptimizeReport, PsumPlan, optimize, rewrite_jaxpr

__all__ = [
    "psum", "pmean", "psum_scatter", "all_gather", "patch_lax", "default_blocks", "MAX_BLOCKS",
    "optimize", "rewrite_jaxpr", "OptimizeReport", "PsumPlan",
    "value_and_grad", "grad",
    "explain", "Explanation",
    "Profile", "load_profile",
    "build_info",
]

# Public name -> module that defines it.
_LAZY = {
    "build_info": "libra_jax._ffi",
    "psum": "libra_jax.allreduce",
    "pmean": "libra_jax.allreduce",
    "psum_scatter": "libra_jax.allreduce",
    "all_gather": "libra_jax.allreduce",
    "patch_lax": "libra_jax.allreduce",
    "default_blocks": "libra_jax.allreduce",
    "MAX_BLOCKS": "libra_jax.allreduce",
    "optimize": "libra_jax.rewrite",
    "rewrite_jaxpr": "libra_jax.rewrite",
    "OptimizeReport": "libra_jax.rewrite",
    "PsumPlan": "libra_jax.rewrite",
    "value_and_grad": "libra_jax.data_parallel",
    "grad": "libra_jax.data_parallel",
    "explain": "libra_jax.explanation",
    "Explanation": "libra_jax.explanation",
    "Profile": "libra_jax.model",
    "load_profile": "libra_jax.model",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'libra_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
