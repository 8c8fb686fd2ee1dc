"""Old names kept working, with a warning: a module's ``__getattr__`` calls `alias` with its
renamed names (old -> (new, value)).

Why one home: a rename of a public name (issue 75: `PsumPlan` planned every kind, three things
were called `COLLECTIVES`) must not break a user's import, and every old name should say the
same thing the same way.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from libra_jax import config

__all__ = ["alias"]


def alias(module: str, name: str, renamed: Mapping[str, tuple[str, Any]]) -> Any:
    """The value `name` was renamed to in `module` (a DeprecationWarning naming the new name,
    notice ``name-renamed``, at the caller of the module's ``__getattr__``), or AttributeError
    where `name` is not one of `renamed`'s old names."""
    if name not in renamed:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new, value = renamed[name]
    config.notice("name-renamed", f"{module}.{name} is deprecated: it is {module}.{new}",
                  DeprecationWarning, stacklevel=3)
    return value
