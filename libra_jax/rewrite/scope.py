"""What the rewrite's passes share: `optimize`'s options (`Options`, built and checked once)
and the program-wide state each pass reads and writes (`Scope`, the protocol `Rewriter`
implements).

Why a module of its own: the passes (`buckets`, `gathers`, ...) are functions of that state,
and `Rewriter` calls them; were they typed against `Rewriter` itself, each would import the
module that imports it (a cycle, hidden under ``if TYPE_CHECKING``). Both sides import this
module instead: `tests/test_layout.py` checks the import graph, type-only imports included.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import os
from collections.abc import Sequence
from typing import Any, Protocol

import jax

from libra_jax import config, model
from libra_jax.rewrite.ready import READY_MODES, Ready
from libra_jax.rewrite.report import OptimizeReport

__all__ = ["LOOP_MODES", "Options", "Scope"]


#: `optimize(loops=...)`: what happens to the psums that may leave a scan body (`loops`).
LOOP_MODES = ("auto", "hoist", "in-loop")


def _loop_mode(loops: str) -> str:
    return config.choice_option(loops, LOOP_MODES, "loops")


@dataclasses.dataclass(frozen=True)
class Options:
    profile: Any
    fusion: bool
    blocks: int | None
    overlap: str = "auto"
    loops: str = "auto"
    prefetch: str | int = "auto"    # `config.prefetch_mode`
    prefetch_bytes: int = config.DEFAULT_PREFETCH_BYTES
    ready: str = "dataflow"         # `READY_MODES`

    def __post_init__(self) -> None:
        # The options as their types say (`config`): a NumPy bool is kept as Python's, so
        # that equal options share a cache key.
        object.__setattr__(self, "fusion", config.bool_option(self.fusion, "fusion"))
        config.choice_option(self.ready, READY_MODES, "ready")
        profile = self.profile  # checked when made; a JSON document is read now, once
        if isinstance(profile, collections.abc.Mapping):
            object.__setattr__(self, "profile", model.resolve_profile(profile))
        elif not (profile is None or isinstance(profile, (str, os.PathLike, model.Profile))):
            raise TypeError("libra_jax.optimize: profile must be a profile name, a path, a "
                            "model.Profile or its JSON document (a dict), got "
                            f"{type(profile).__name__}")

    def cache_key(self) -> tuple:
        profile = self.profile
        if isinstance(profile, model.Profile):
            profile = ("profile", profile)  # a value (`model.Profile`): equal ones share
        elif profile is not None:
            profile = ("name", os.fspath(profile))
        return (profile, self.fusion, self.blocks, self.overlap, self.loops, self.prefetch,
                self.prefetch_bytes, self.ready)

    def resolved_profile(self) -> model.Profile:
        """The profile as a loaded `model.Profile`: resolved once per trace (None: the
        default backend's, `model.default_profile`)."""
        return model.resolve_profile(self.profile, jax.default_backend(),
                                     who="libra_jax.optimize")


class Scope(Protocol):
    """The state a rewrite pass reads and writes, shared by the program's scopes
    (`Rewriter` holds it): the options and the profile as resolved once, the report the passes
    fill, each scope's ready points (`ready`), the all-gathers' prefetch distance and why
    (`prefetch`, `prefetch_why`), remat's re-gathers taken out of their checkpoints
    (`regathered`), the results a pass renamed, by the variable the program as written has
    (`renamed`: `transposes`' moved reduce-scatters, whose gradients `explain` names), the
    ids of start/done pairs (`call_id`), the collectives no rule serves (`unplanned`), each
    scope's equation order as written before its collectives moved to their ready points
    (`written`), and the walk's two steps the passes call (`hoist_loops`, `sub_jaxprs`:
    `passes`)."""

    options: Options
    profile: model.Profile
    report: OptimizeReport
    ready: dict[str, dict[int, Ready]]
    prefetch: int | None
    prefetch_why: str
    regathered: dict[Any, Any]
    renamed: dict[Any, Any]
    unplanned: list[str]
    written: dict[str, list[int]]

    def call_id(self) -> int:
        """The id of the program's next start/done pair."""
        ...

    def hoist_loops(self, eqns: Sequence[Any], axis_sizes: dict, scope: str) -> list[Any]:
        """The scope's equations with its scans' hoistable psums taken out where planned."""
        ...

    def sub_jaxprs(self, eqn: Any, index: int, axis_sizes: dict, scope: str, in_loop: bool,
                   in_backward: bool = False) -> Any:
        """`eqn` with its sub-jaxprs rewritten, each a scope of its own."""
        ...
