"""Renamed public names (libra_jax._deprecated): each old name still gives the new value, with
a DeprecationWarning naming the new name; an unknown name is an AttributeError as before."""
from __future__ import annotations

import pytest

import libra_jax
from libra_jax import collectives, planner, rewrite
from libra_jax.ops import lowering
from libra_jax.rewrite import report, transform

RENAMED = [
    (rewrite, "PsumPlan", "CallPlan", rewrite.CallPlan),
    (report, "PsumPlan", "CallPlan", rewrite.CallPlan),
    (planner, "COLLECTIVES", "KINDS", collectives.KINDS),
    (lowering, "COLLECTIVES", "collectives.BY_LAX", collectives.BY_LAX),
    (transform, "COLLECTIVES", "COLLECTIVE_CHOICES", transform.COLLECTIVE_CHOICES),
    (rewrite, "COLLECTIVES", "COLLECTIVE_CHOICES", transform.COLLECTIVE_CHOICES),
]


@pytest.mark.parametrize("module, old, new, value", RENAMED,
                         ids=[f"{m.__name__}.{old}" for m, old, _, _ in RENAMED])
def test_an_old_name_warns_and_gives_the_new_value(module, old, new, value):
    with pytest.warns(DeprecationWarning, match=rf"{module.__name__}\.{old} is deprecated: it is "
                      rf"{module.__name__}\.{new}"):
        got = getattr(module, old)
    assert got is value
    assert old not in getattr(module, "__all__", ())


def test_the_top_level_old_plan_name_is_the_call_plan():
    with pytest.warns(DeprecationWarning, match="CallPlan"):
        assert libra_jax.__getattr__("PsumPlan") is libra_jax.CallPlan
    assert "PsumPlan" not in libra_jax.__all__


def test_an_unknown_name_is_still_an_attribute_error():
    for module in (rewrite, planner, lowering, transform, report):
        with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
            module.NotAName  # noqa: B018
