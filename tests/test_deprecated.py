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


def test_the_old_module_name_is_the_drop_ins_module():
    # libra_jax.allreduce held every kind's drop-in: renamed libra_jax.dropins. The old name
    # imports the same module object (a patch through it is the drop-ins' own), with the
    # notice. In a fresh process: the notice comes once, on the first import.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import warnings
        import libra_jax
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import libra_jax.allreduce as old
            from libra_jax import allreduce as old_attr
        import libra_jax.dropins as new
        assert old is new and old_attr is new, (old, new)
        assert old.psum is libra_jax.psum and old.libra_psum_p is new.libra_psum_p
        said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
                and "libra_jax.allreduce" in str(w.message)]
        assert len(said) == 1, said
        assert "it is libra_jax.dropins" in said[0] and "name-renamed" in said[0], said
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]
