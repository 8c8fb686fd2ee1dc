"""Calls a type checker must reject: each line below is an error, marked with the code mypy
gives it. `mypy` runs with ``warn_unused_ignores`` (pyproject.toml), so if one of these stops
being an error -- an annotation widened to ``Any``, a lazy export the checker cannot see --
its ``# type: ignore`` becomes unused and the check fails. The well-typed calls must pass.
Checked, never run (``.ci/run``'s lint stage; not collected by pytest: no ``test_`` prefix).
"""
from __future__ import annotations

import jax.numpy as jnp

import libra_jax
from libra_jax import model, planner

x = jnp.ones(4)


def well_typed() -> None:
    libra_jax.psum(x, "i", blocks=4)
    libra_jax.pmean(x, ("i", "j"), inplace=False)
    libra_jax.psum_scatter(x, "i", scatter_dimension=0, tiled=True, blocks=2)
    libra_jax.all_gather(x, ("i", "j"), axis=0, tiled=False, to="invarying", blocks=None)
    libra_jax.optimize(lambda v: v, profile="h100", fusion=False, overlap="sync")
    blocks: int = libra_jax.default_blocks(1 << 20, 8)
    profile: libra_jax.Profile = libra_jax.load_profile("h100")
    planner.plan([planner.Layer(compute_s=1e-3, grad_bytes=1024)], model.cost_model(profile, blocks))


def ill_typed() -> None:
    libra_jax.psum(x, "i", blocks="x")  # type: ignore[arg-type]
    libra_jax.psum(x, "i", inplace="yes")  # type: ignore[arg-type]
    libra_jax.pmean(x, "i", block=4)  # type: ignore[call-arg]
    libra_jax.psum_scatter(x, "i", blocks=2.5)  # type: ignore[arg-type]
    libra_jax.all_gather(x, "i", tiled="yes")  # type: ignore[arg-type]
    libra_jax.optimize(lambda v: v, fusion="yes")  # type: ignore[arg-type]
    libra_jax.optimize(lambda v: v, static_argnums=1.5)  # type: ignore[arg-type]
    libra_jax.default_blocks("1 MiB", 8)  # type: ignore[arg-type]
    libra_jax.load_profile(3)  # type: ignore[arg-type]
    planner.Layer(compute_s="fast", grad_bytes=1)  # type: ignore[arg-type]
    model.derive("h100", workers="8")  # type: ignore[arg-type]
