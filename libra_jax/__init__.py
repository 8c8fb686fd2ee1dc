"""libra_jax: contention-aware all-reduce for data-parallel JAX (Libra, INFOCOM 2023).

The pure-Python parts (``libra_jax.planner``, ``libra_jax.model``) import without JAX
or the compiled extension; the JAX front end is loaded on first attribute access.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> module that defines it. Loaded lazily so that `import libra_jax.planner`
# needs neither JAX nor the compiled extension.
_LAZY = {
    "psum": "libra_jax.allreduce",
    "pmean": "libra_jax.allreduce",
    "patch_lax": "libra_jax.allreduce",
    "MAX_BLOCKS": "libra_jax.allreduce",
    "optimize": "libra_jax.rewrite",
    "explain": "libra_jax.explanation",
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
