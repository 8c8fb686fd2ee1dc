"""Comparing a step's results with another's: what is bitwise, and how close the rest is.

docs/bitwise.md sorts every comparison libra_jax makes into three classes:

1. **by construction**: a libra collective against `jax.lax.psum` on the same inputs (the same
   additions in the same order): `assert_bitwise`;
2. **the same program but the collective**: an optimized step against its
   ``optimize(step, collectives="xla")`` control: `assert_bitwise`, wherever XLA compiles the
   rest alike;
3. **by XLA's code generation**: two different programs (plain against optimized or the
   drop-in, the GSPMD route against GSPMD, hoisted against in-loop). Which products XLA
   contracts into fused multiply-adds, its vector widths and its fusion boundaries differ by
   CPU and by program, so these agree within a bound, not bit for bit: `assert_codegen_close`.

The bound, `CODEGEN_ULPS`, is in units of a leaf's largest magnitude times its dtype's
epsilon: a gradient is a sum with cancellation, whose rounding is that of its terms, not of
its result, so an elementwise relative tolerance would fail on its near-zero entries. It was
measured at every ISA a test machine offers (`benchmarks/codegen_bounds.py`; the table is
`benchmarks/results/codegen_bounds.md`), and a gradient off by a factor 1 + 1e-4 (about 839
units in float32) fails it. It bounds gradients, losses and one linear update of them;
parameters after several adaptive optimizer steps may differ by far more (Adam divides by
the root of the second moment, which magnifies a last-bit difference of a near-zero
gradient), so check those for having moved, and check the optimized step against its control
bit for bit.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CODEGEN_ULPS", "codegen_error", "codegen_errors", "assert_bitwise",
           "assert_codegen_close"]

#: Class 3's bound: ``|got - want| <= CODEGEN_ULPS * eps * max|want|`` in every leaf.
CODEGEN_ULPS = 16


def _paired_leaves(got: Any, want: Any) -> list[tuple[str, Any, Any]]:
    """(path, got's leaf, want's leaf) of two pytrees; AssertionError if their structures
    differ."""
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
    if str(got_tree) != str(want_tree):
        raise AssertionError(f"different trees: {got_tree} and {want_tree}")
    return [(jax.tree_util.keystr(path), a, b)
            for (path, a), (_, b) in zip(got_leaves, want_leaves)]


def assert_bitwise(got: Any, want: Any) -> None:
    """Classes 1 and 2: every leaf of the pytrees the same dtype, shape and bytes (NaNs with
    the same payload compare equal)."""
    for where, a, b in _paired_leaves(got, want):
        a, b = np.asarray(a), np.asarray(b)
        where = where or "the root"
        if a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(f"{where}: {a.dtype}{list(a.shape)} against "
                                 f"{b.dtype}{list(b.shape)}")
        if a.tobytes() != b.tobytes():
            diff = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))
            raise AssertionError(f"{where}: not bitwise, max |diff| = {diff}")


def codegen_error(got: Any, want: Any) -> float:
    """``max|got - want| / (eps * max|want|)`` of one array, `eps` its dtype's. 0 when equal;
    inf where dtypes, shapes, the places of NaNs or infinities, or non-float values differ,
    or where `want` is all zero and `got` is not."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return math.inf
    if not jnp.issubdtype(want.dtype, jnp.floating):  # integers, booleans: equal or not
        return 0.0 if got.tobytes() == want.tobytes() else math.inf
    a, b = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(b)
    if not np.array_equal(a[~finite], b[~finite], equal_nan=True) or \
            not np.all(np.isfinite(a[finite])):
        return math.inf
    a, b = a[finite], b[finite]
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    if diff == 0:
        return 0.0
    scale = float(np.max(np.abs(b)))
    return diff / (float(jnp.finfo(want.dtype).eps) * scale) if scale else math.inf


def codegen_errors(got: Any, want: Any) -> dict[str, float]:
    """`codegen_error` of every leaf of two pytrees of the same structure, by leaf path."""
    return {where: codegen_error(a, b) for where, a, b in _paired_leaves(got, want)}


def assert_codegen_close(got: Any, want: Any, *, ulps: float = CODEGEN_ULPS) -> None:
    """Class 3: every leaf of `got` within `ulps` (default `CODEGEN_ULPS`) of `want`'s, in
    units of eps times the leaf's largest magnitude (`codegen_error`)."""
    errors = codegen_errors(got, want)
    where, worst = max(errors.items(), key=lambda kv: kv[1], default=("", 0.0))
    if not worst <= ulps:
        raise AssertionError(
            f"{where or 'the root'} differs by {worst:.3g} x eps x max|want| (bound {ulps:g}: "
            f"libra_jax.testing, docs/bitwise.md, class 3)")
