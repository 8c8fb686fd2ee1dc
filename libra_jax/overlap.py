"""Deprecated: the start/done primitives live in `libra_jax.ops.start_done`, the packing of a
bucket into one buffer per dtype in `libra_jax.ops.packing`. This module re-exports them."""
from __future__ import annotations

from libra_jax import config
from libra_jax.ops.packing import PACK_ALIGN_BYTES, pack, packed_avals, packed_layout, split
from libra_jax.ops.start_done import libra_psum_done_p, libra_psum_start_p

__all__ = ["libra_psum_start_p", "libra_psum_done_p", "packed_layout", "packed_avals", "pack",
           "split", "PACK_ALIGN_BYTES"]

config.notice("overlap-deprecated",
              "libra_jax.overlap is deprecated: use libra_jax.ops.start_done (the primitives) "
              "and libra_jax.ops.packing (packing)", DeprecationWarning, stacklevel=2)
