"""A call's block count where none is given: resolved here, once, for every layer.

A collective left at ``blocks=None`` (a bare `libra_jax.psum`, or a call `optimize` issues
outside the planner's buckets: a loss's pmean, an exchange, a forward all-gather issued at
its place) launches with the model's choice when no overlapped compute is known
(`model.Derivation.no_overlap_blocks`), within what the data path can run (`block_cap`).
`resolve_blocks` is that rule: the lowering calls it once a call's group size is known, the
rewrite when it writes the count into a call, and `libra_jax.default_blocks` is its public
form. The planner's buckets choose among the same capped options (`capped_derivation`).

Why one home: the count was resolved at five sites from three profile sources and capped in
three places (issue 75); a call the rewrite left at its default and the same call lowered
bare must agree, and a change to the rule must reach every site (tests/test_blocks.py
patches `resolve_blocks` and sees each site follow).

The engine's own reduction of a count to what a buffer can use (C++ ``EffectiveBlocks``: a
1 KiB buffer runs on one worker whatever it is given) is the launch's, not this choice: it
stays in the engine, where the bytes are.
"""
from __future__ import annotations

from typing import Any

from libra_jax import _nccl, config, model
from libra_jax.collectives import Collective

__all__ = ["resolve_blocks", "block_cap", "capped_derivation"]


def block_cap(profile: model.Profile) -> tuple[int | None, str]:
    """The most blocks one call of a GPU plan may take, and why: on the ``nccl`` path the
    loaded NCCL's CTA limit (`libra_jax._nccl.Library.max_ctas`: a larger count would run with
    that many CTAs, so the model must not price it); ``(None, "")`` otherwise (CPU profiles,
    the other paths, no NCCL, or an NCCL that cannot limit CTAs at all)."""
    if profile.form == "fair-share" or config.cuda_path() != "nccl" or not _nccl.available()[0]:
        return None, ""
    lib = _nccl.library()
    if lib.max_ctas == 0:
        return None, ""
    return lib.max_ctas, (f"NCCL {lib.version} ({lib.route} CTA limits) runs an all-reduce on "
                          f"at most {lib.max_ctas} CTAs")


def capped_derivation(profile: Any, world: int) -> model.Derivation:
    """`profile`'s cost model for `world` ranks with the options above `block_cap` dropped.
    `profile`: a name, path or `model.Profile`."""
    resolved = profile if isinstance(profile, model.Profile) else model.resolve_profile(profile)
    cap, why = block_cap(resolved)
    return model.derive(resolved, world, max_blocks=cap, max_blocks_why=why)


def resolve_blocks(row: Collective, nbytes: int, world: int, profile: Any) -> int:
    """The block count of a `row` call of `nbytes` (the full, unsharded buffer per device)
    among `world` ranks with no count given: the model's choice with no overlapped compute
    known, within `block_cap`, 1 for nothing to move. `profile`: a name, path or
    `model.Profile` (the lowering passes its platform's default, `optimize` the one it plans
    with)."""
    if world < 2 or nbytes <= 0:
        return 1
    return capped_derivation(profile, world).no_overlap_blocks(nbytes, row)
