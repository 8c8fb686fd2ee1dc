"""The rewrite of a scope's all-to-alls (an expert-parallel layer's dispatch and combine):
each libra's, one call where it was, at the model's block count for it with no overlap known
(`ops.blocks.resolve_blocks`), or the count it was given (kind "user"). Planning them for
overlap (start/done, fusion) waits until the model shows a block count matters for them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from libra_jax import model
from libra_jax.ops import blocks as block_rule
from libra_jax.rewrite.edits import Edits, single_eqn
from libra_jax.rewrite.report import CallPlan
from libra_jax.rewrite.sites import Site, backward_sites, group_size

__all__ = ["edit_exchanges"]


def edit_exchanges(eqns: Sequence[Any], exchanges: Sequence[Site], axis_sizes: dict,
                   scope: str, in_loop: bool, in_backward: bool, profile: model.Profile,
                   invars: set, edits: Edits) -> list[CallPlan]:
    """Each all-to-all (`sites.exchange_site`) replaced by libra's in `edits`, and its plan:
    kind "user" where it carries its own block count (left as it is), "loop" in a loop
    body, "backward" on the backward pass (autodiff's transpose of one), else "forward"."""
    if not exchanges:
        return []
    backward = backward_sites(eqns, exchanges) or set()
    plans = []
    for site in exchanges:
        k = site.explicit_blocks
        kind = ("user" if k is not None else "loop" if in_loop
                else "backward" if in_backward or site.index in backward else "forward")
        if k is None:
            k = block_rule.resolve_blocks(site.collective, site.nbytes,
                                          group_size(axis_sizes, site.axes), profile)
            edits.replacements[site.index] = single_eqn(eqns[site.index], site, k, invars)
        plans.append(CallPlan(scope, site.axes, (site.index,), site.nbytes, int(k), kind,
                              "sync", site.collective))
    return plans
