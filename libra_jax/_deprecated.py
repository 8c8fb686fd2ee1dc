"""Old names kept working, with a warning: a module's ``__getattr__`` calls `alias` with its
renamed names (old -> (new, value)); a renamed module's old file calls `module_alias`.

Why one home: a rename of a public name (issue 75: `PsumPlan` planned every kind, three things
were called `COLLECTIVES`) must not break a user's import, and every old name should say the
same thing the same way.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from libra_jax import config

__all__ = ["alias", "module_alias"]


def _say(old: str, new: str, stacklevel: int) -> None:
    """The one DeprecationWarning of a renamed name (notice ``name-renamed``)."""
    config.notice("name-renamed", f"{old} is deprecated: it is {new}", DeprecationWarning,
                  stacklevel=stacklevel + 1)


def alias(module: str, name: str, renamed: Mapping[str, tuple[str, Any]]) -> Any:
    """The value `name` was renamed to in `module` (a DeprecationWarning naming the new name,
    notice ``name-renamed``, at the caller of the module's ``__getattr__``), or AttributeError
    where `name` is not one of `renamed`'s old names."""
    if name not in renamed:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new, value = renamed[name]
    _say(f"{module}.{name}", f"{module}.{new}", stacklevel=3)
    return value


def module_alias(old: str, new: ModuleType) -> None:
    """Module `old` (being imported) made module `new`: the same object under the old name
    (`sys.modules`), said once, at its import, as `alias` says a name."""
    _say(old, new.__name__, stacklevel=3)
    sys.modules[old] = new
