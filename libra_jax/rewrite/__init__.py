"""`libra_jax.optimize`: rewrite a train step's psums into Libra all-reduces planned at trace time.

The package, by concern: `transform` (`optimize`, `rewrite_jaxpr`, what outer transformations
hand over), `report` (`OptimizeReport`, the profile and plan every process agrees on),
`rewriter` (the walk over a program's scopes), `shrink` (psums issued after the linear maps
that shrink them), `sites` (which equations are collectives to
serve: one rule per primitive, `sites.SITE_RULES`), `buckets` (the planner's buckets and how
each is issued), `gathers` (FSDP's all-gathers), `edits` (the equations written and their
schedule), `costs` (the roofline of the compute between collectives).

Contract of the rewrite (`rewrite_jaxpr`):

- Input: a closed jaxpr. Output: a closed jaxpr with the same input and output
  types whose equations compute the same values bit for bit (each psum's result
  is `jax.lax.psum`'s; compiled, XLA may still fuse and contract the two programs
  differently: docs/bitwise.md, class 3), in which every psum that
  can be served (`psum`, `psum_invariant`, and `libra_psum` without an
  explicit block count) is a `libra_psum` with a planned block count, or part
  of a `libra_bucket` (psums).
- Scope: psums are found in the jaxpr and, recursively, in the sub-jaxprs of
  `jit`, `shard_map`, `scan`, `while`, `cond`, `checkpoint` (remat),
  `custom_jvp_call`, `custom_vjp_call` and `closed_call` (`_compat.HIGHER_ORDER`). A psum
  that cannot be served (`axis_index_groups`, positional axes) or that hides
  in a higher-order primitive without a rule stays an XLA psum, and a one-time
  warning lists it.
- Planning happens per jaxpr (one scope = one stream of compute). A *gradient*
  psum is one on the backward pass (made by autodiff's transpose, e.g. the psum
  of a replicated input's cotangent that `check_vma` inserts, or reading a value
  the backward pass computed, e.g. an explicit `pmean(grads)`) whose result
  feeds no later psum (it goes to outputs or to the optimizer update); in a
  scope where no backward pass is visible, every psum whose result feeds no
  later psum. Gradient psums are handed to the planner in jaxpr order (the
  order the backward pass produces them), with the compute between them
  estimated by a roofline of the profile; psums over the same axes are fused
  into buckets. Other psums (kind "forward": the loss, metrics, forward
  statistics; "backward": a psum the rest of the backward pass depends on, such
  as a batch statistic's cotangent) get an allocation from
  `dropins.default_blocks` and no fusion.
- Loops: a `scan` body's psums whose result only goes, by data movement, into a
  stacked output (a stacked weight's gradient slice, `libra_jax.loops`) are
  hoisted before the scope is planned: the scan returns the slices unreduced and
  one psum of the stacked array follows it, a psum of this scope like any other
  (the same sums: summation is elementwise). `loops="auto"` hoists where the
  model prices that lower than keeping them in the body (`rewriter.loop_plan`).
  Then every loop body (`scan`, `while`, so `fori_loop`) is a scope of its own,
  planned by the same rule where the body shows a backward pass: its gradient
  psums (a train step scanned over substeps, gradient accumulation that
  all-reduces each microbatch, a kept stacked slice, a shared weight's
  cotangent) are planned for one iteration, fused into buckets with the body's
  compute between them, and every iteration issues that plan; each bucket is one
  call (no start/done pair in a body: its all-reduces are done within the
  iteration, where a pair could only overlap the rest of it). The body's other
  psums (kind "loop": a loss, a statistic, a forward loop's) get
  `dropins.default_blocks`. `OptimizeReport.loops` has a `LoopPlan` per loop.
- A bucket is one `libra_bucket` equation placed where its last member
  was; it all-reduces each dtype once (on CPU the members as they are; elsewhere
  concatenated per dtype and split back). Summation is elementwise in rank order either way,
  so results are bitwise those of the unfused psums. Equations between the
  bucket's members that use an earlier member's result move after it.
- A gradient bucket (fused or not) is issued either as that one call or as a
  `libra_start` where its last member was and a `libra_done`, with
  the uses that moved, just before the first equation that reads a result
  (`libra_jax.ops.start_done`); the values are the same. ``overlap="sync"`` or
  ``"start-done"`` forces one way; ``"auto"`` (the default) chooses per bucket
  (`buckets.split_buckets`).
- A psum of a known zero (a literal, or broadcast from one) is folded to ``z + z``,
  bitwise `jax.lax.psum`'s, with no call (`sites.fold_zero_psums`).
- A psum whose result feeds only a linear map that shrinks it (a `reduce_sum`: a broadcast
  bias's transpose under `check_vma`; a `dot_general` with an operand invariant over its
  axes: a one-hot contraction), through data movement, is issued after the map, at its
  output's size (`shrink.shrink_psums`, before loops are hoisted, in every scope and scan
  body): the same sums in another order, so class 3 of the step as written and bitwise its
  ``collectives="xla"`` control (docs/bitwise.md).
- Sharded data parallelism: a `psum_scatter` (JAX's `reduce_scatter`, or
  `libra_reduce_scatter` without an explicit block count) is a site as a psum is,
  classified by the same rule: the gradient of a sharded parameter (the transpose of a
  forward `all_gather`, or an explicit `psum_scatter` of gradients) is a gradient
  collective. A scope's gradient collectives over the same axes of one `Site.bucket_class`
  are one stream, planned as one sequence of buckets (each stream's buckets reach over the
  other streams' gradients; each is priced alone); a bucket of psum_scatters along their
  first dimension is one `libra_bucket` equation of kind psum_scatter (bitwise the unfused
  ones: the same sums), issued as one call. The gradient of ``all_gather(to='invarying')`` (a psum, then this rank's
  slice) becomes that slice's reduce-scatter first (`sites.scatter_sliced_psums`). Every
  `all_gather` it can serve becomes libra's, one call at the model's block count
  (`gathers.edit_gathers`); others stay XLA's, listed as unplanned.
- Deterministic: everything is visited in jaxpr order; no set or dict
  iteration order, hash or timing enters the plan.
"""

from __future__ import annotations

from typing import Any

from libra_jax import _deprecated
from libra_jax.ops import libra_bucket_p, libra_psum_fused_p
from libra_jax.rewrite.report import (
    NO_PROFILE_BROADCAST_ENV,
    CallPlan,
    LoopPlan,
    OptimizeReport,
    block_cap,
    check_plan_agreement,
    data_path_lines,
    shared_profile,
)
from libra_jax.rewrite.rewriter import LOOP_MODES
from libra_jax.rewrite.sites import UNPLANNED_NOTICE
from libra_jax.rewrite.transform import (
    COLLECTIVE_CHOICES,
    DISABLE_ENV,
    GSPMD_ROUTE,
    OVERLAP_ENV,
    OVERLAP_MODES,
    Outputs,
    StaticArgs,
    gspmd_notice,
    nnx_objects,
    optimize,
    outer_statics,
    rewrite_jaxpr,
    with_xla_collectives,
)

__all__ = ["optimize", "rewrite_jaxpr", "CallPlan", "LoopPlan", "OptimizeReport",
           "libra_bucket_p", "libra_psum_fused_p", "StaticArgs", "outer_statics", "Outputs", "nnx_objects",
           "block_cap", "shared_profile", "data_path_lines", "check_plan_agreement",
           "gspmd_notice", "with_xla_collectives", "DISABLE_ENV", "OVERLAP_ENV", "COLLECTIVE_CHOICES",
           "OVERLAP_MODES", "LOOP_MODES", "GSPMD_ROUTE", "UNPLANNED_NOTICE",
           "NO_PROFILE_BROADCAST_ENV"]


def __getattr__(name: str) -> Any:
    return _deprecated.alias(__name__, name, {"PsumPlan": ("CallPlan", CallPlan),
                                              "COLLECTIVES": ("COLLECTIVE_CHOICES",
                                                              COLLECTIVE_CHOICES)})
