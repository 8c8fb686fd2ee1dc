"""libra's JAX primitives: one psum, a fused bucket, a start/done pair, and the sharded pair.

Layer: imports `libra_jax._compat`, `_ffi`, `_nccl`, `collectives`, `config` and `model`;
nothing above it (`dropins`, `rewrite`, the planner, the tools). Every primitive is wired by
one helper (`base.register_op`) from its abstract evaluation, its autodiff and batching rules
and a lowering per platform, built on that platform's one rule for every kind
(`lowering.rule`: a `lowering.Call` over the kind's row of `libra_jax.collectives`, libra's
call where it serves, else XLA's with one notice); each has an XLA twin (`XLA_TWINS`) for
`optimize(collectives="xla")`. Each op is its kind's row's "primitive" form
(`collectives.of_primitive` finds the kind of an equation's primitive); the ``collective``
param of a bucket or a start/done holds the row (given by its name when bound by hand, the
row it names: `base.register_op`'s primitives convert it).

- `psum`: `libra_psum_p`, the psum `jax.lax.psum` would bind, with a block count;
- `fused`: `libra_bucket_p`, a bucket of one kind's collectives as one call per dtype (a
  gradient bucket's psums, or reduce-scatters along dimension 0: the "bucket" form of those
  kinds' rows, `fused.Bucket`); its former names `libra_psum_fused_p` and
  `libra_reduce_scatter_fused_p` bind it, for a release;
- `start_done`: `libra_start_p` / `libra_done_p`, every kind's collective issued early and
  waited for where its result is needed (the "pair" form of those kinds' rows,
  `start_done.Pair`: a gradient bucket's all-reduce where the gradients are ready, one
  reduce-scatter or all-gather); its former names `libra_psum_start_p` / `libra_psum_done_p`
  and `libra_sharded_start_p` / `libra_sharded_done_p` bind it, for a release;
- `sharded`: `libra_reduce_scatter_p` / `libra_all_gather_p`, the `psum_scatter` and the
  `all_gather` `jax.lax` would bind, each other's transpose (their rows' "mirror" form,
  `sharded.Mirror`, names the JAX primitive each stands for);
- `exchange`: `libra_all_to_all_p`, the `all_to_all` `jax.lax` would bind (its transpose is
  itself, the axes swapped);
- `packing`: a bucket's members as one flat buffer and back, where the call it is lowered to
  takes one (XLA's collective standing in; libra's calls take the members as they are).

`jax.experimental.roofline` counts each as the all-reduce it is (`_compat.register_psum_rooflines`).
"""
from libra_jax import _compat
from libra_jax.ops.base import XLA_TWINS, register_op
from libra_jax.ops.exchange import libra_all_to_all_p
from libra_jax.ops.fused import libra_bucket_p, libra_psum_fused_p, libra_reduce_scatter_fused_p
from libra_jax.ops.psum import libra_psum_p
from libra_jax.ops.sharded import libra_all_gather_p, libra_reduce_scatter_p
from libra_jax.ops.start_done import (
    libra_done_p,
    libra_psum_done_p,
    libra_psum_start_p,
    libra_sharded_done_p,
    libra_sharded_start_p,
    libra_start_p,
)

# JAX's roofline counts them as its psum (a start for its bucket, its done as nothing; a
# reduce-scatter bucket or start as the all-reduce of its members, an upper bound; an
# all-gather's start as nothing, as before it had a rule).
_compat.register_psum_rooflines([libra_psum_p, libra_bucket_p, libra_start_p], [libra_done_p])

__all__ = ["XLA_TWINS", "register_op", "libra_psum_p", "libra_bucket_p", "libra_psum_fused_p",
           "libra_reduce_scatter_fused_p", "libra_all_to_all_p",
           "libra_start_p", "libra_done_p", "libra_reduce_scatter_p", "libra_all_gather_p",
           "libra_psum_start_p", "libra_psum_done_p", "libra_sharded_start_p",
           "libra_sharded_done_p"]
