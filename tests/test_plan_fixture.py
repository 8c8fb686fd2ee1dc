"""Plans are what tests/data/plans.json says (tests/plan_fixture.py): a change that means to
change plans regenerates the fixture in the same commit and says why."""
from __future__ import annotations

import json

import pytest

import plan_fixture

pytestmark = pytest.mark.usefixtures("jax_8")


@pytest.mark.parametrize("part", ["zoo", "random", "optimize"])
def test_plans_match_the_shared_fixture(part):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    want = json.loads(plan_fixture.FIXTURE.read_text())
    got = getattr(plan_fixture, f"{part}_plans")()
    prefix = {"zoo": "zoo/", "random": "random/", "optimize": ("example/", "corpus/")}[part]
    expected = {k: v for k, v in want.items() if k.startswith(prefix)}
    assert got.keys() == expected.keys()
    changed = sorted(k for k in got if got[k] != expected[k])
    assert not changed, ("plans changed (regenerate with `python tests/plan_fixture.py --write` "
                         f"only if that is meant, and say why): {changed}")
