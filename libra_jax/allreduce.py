"""The old name of `libra_jax.dropins` (renamed, issue 75: the module holds every kind's
drop-in, `psum_scatter`, `all_gather` and `all_to_all` too, not the all-reduce's alone).

Importing it imports that module and hands back the same object, so that a name, a private
attribute or a patch reached through the old name is the drop-ins' own; it says once, as a
DeprecationWarning (notice ``name-renamed``), which name to use.
"""
from __future__ import annotations

from libra_jax import _deprecated, dropins

_deprecated.module_alias(__name__, dropins)
