"""libra_jax.collectives: one row per collective kind, and every other place that knows the
kinds reads it (the engine's enum, the model's table, the lowering's, the FFI targets)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from libra_jax import _libra_ffi, collectives, model, planner
from libra_jax.ops import lowering

ROOT = Path(__file__).resolve().parents[1]


def test_rows_are_the_engines_enum_in_order():
    header = (ROOT / "cpp" / "libra" / "dtype.h").read_text()
    enum = re.search(r"enum class Collective : int \{([^}]*)\}", header).group(1)
    names = [n.split("=")[0].strip() for n in enum.split(",")]
    assert [row.enum for row in collectives.ROWS] == list(range(len(names)))
    # The C++ rows (libra::kLayouts, indexed by the enum): name, sums, shard_in, shard_out,
    # exchanges.
    rows = re.findall(r'\{"([\w-]+)", (true|false), (true|false), (true|false), (true|false)\}',
                      header[header.index("kLayouts[]"):])
    assert [(name, *(flag == "true" for flag in flags)) for name, *flags in rows] == [
        (row.kind, row.sums, row.layout == "gathered", row.layout == "scattered",
         row.layout == "exchanged") for row in collectives.ROWS]


def test_every_table_of_kinds_is_the_rows():
    assert planner.KINDS == collectives.KINDS == tuple(model.COLLECTIVE_SHAPES)
    assert [collectives.lax_name(k) for k in collectives.KINDS] == [
        "psum", "psum_scatter", "all_gather", "all_to_all"]
    assert [row.gathers for row in collectives.ROWS] == [False, False, True, False]
    assert [row.sums for row in collectives.ROWS] == [True, True, False, False]
    assert {row.layout for row in collectives.ROWS} == set(collectives.LAYOUTS)


def test_target_names_follow_one_rule():
    reduce_scatter = collectives.BY_KIND["reduce-scatter"]
    assert reduce_scatter.target("nccl", "start") == "libra_reduce_scatter_nccl_start"
    assert reduce_scatter.role("nccl", "start") == "nccl_reduce_scatter_start"
    assert collectives.BY_KIND["all-reduce"].role("cpu") == "cpu"
    assert collectives.done_target("nccl") == collectives.done_target("cuda") == (
        "libra_allreduce_cuda_done")
    assert collectives.done_target("cpu") == "libra_allreduce_cpu_done"
    with pytest.raises(ValueError, match="no all-gather target for engine 'tpu'"):
        collectives.BY_KIND["all-gather"].target("tpu")
    # The extension registers each by that rule (tests/test_bazel.py checks every one).
    assert set(_libra_ffi.TARGETS.values()) <= {
        row.target(e, p) for row in collectives.ROWS for e in collectives.ENGINES
        for p in collectives.PHASES}


def test_a_new_row_goes_through_the_table_to_a_lowering(monkeypatch, jax_8):
    """docs/architecture.md, "Adding a collective", steps 1, 2 and 4 with a fake fourth row (a
    replicated kind, so that JAX's psum can stand for it): its target names follow from the
    row; its op, wired by `register_op` over `lowering.rule`, lowers to XLA's collective with
    the notice naming the kind until the extension has its target, then to the engine's
    custom call with the engine's attributes. Nothing else in the package is told of it."""
    import re

    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from conftest import mesh_of
    from libra_jax import _compat, _ffi
    from libra_jax.ops import base

    # 1. Its row.
    fake = collectives.Collective("fake_sum", "fake-sum", len(collectives.ROWS), "replicated",
                                  "fake_sum", collectives.BY_KIND["all-reduce"].shape,
                                  traffic_key="fake_sum_traffic", label="FS")
    monkeypatch.setattr(collectives, "ROWS", collectives.ROWS + (fake,))
    monkeypatch.setitem(collectives.BY_LAX, fake.lax, fake)
    monkeypatch.setitem(collectives.BY_KIND, fake.kind, fake)
    assert fake.target("cpu") == "libra_fake_sum_cpu"
    assert fake.target("nccl", "start") == "libra_fake_sum_nccl_start"
    assert not _ffi.has_target("fake-sum", "cpu")

    # 4. Its op: a primitive over the row, lowered by the platform's one rule.
    def lowering_of(platform):
        def rule(ctx, x, *, axes, blocks):
            call = lowering.Call(fake, axes, blocks, lambda aval: lowering.mirrored(False, axes))
            return lowering.lower(ctx, x, call, platform)
        return rule

    monkeypatch.setattr(base, "XLA_TWINS", dict(base.XLA_TWINS))  # ops.XLA_TWINS keeps its own
    fake_p = base.register_op(
        "libra_test_fake_sum", lowering=lowering_of,
        abstract_eval=lambda aval, *, axes, blocks: _compat.psum_p.abstract_eval(
            aval, axes=axes, axis_index_groups=None))
    mesh = mesh_of((8,), ("x",))

    def lowered():
        step = jax.jit(jax.shard_map(lambda v: fake_p.bind(v, axes=("x",), blocks=3),
                                     mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                     check_vma=False))
        return step.lower(np.ones((8, 4), np.float32)).as_text()

    # 2. Without the engine's target: XLA's collective, and the notice naming the kind.
    monkeypatch.setattr(base, "_warned", set())
    with pytest.warns(UserWarning, match=r"libra_jax\.fake_sum: no Libra fake-sum for cpu "
                                         r"\(the extension registers no fake-sum target\)"):
        text = lowered()
    assert "stablehlo.all_reduce" in text and "libra_fake_sum" not in text
    # With its target in the extension's table: the engine's call, with its attributes.
    monkeypatch.setattr(_ffi, "_NAMES", _ffi._NAMES | {fake.target("cpu")})
    text = lowered()
    call, = re.findall(r"custom_call @libra_fake_sum_cpu\(.*", text)
    assert "blocks = 3 : i64" in call and "world = 8 : i64" in call, call
    assert 'label = "fake_sum(\'x\',)"' in call, call
    assert "stablehlo.all_reduce" not in text


# --- The all-to-all's row, each piece taken out in turn (issue 72) ----------------------------

def _without(monkeypatch, **changes):
    """The real all-to-all row with `changes` (a piece taken out), in every table of rows."""
    import dataclasses
    real = collectives.BY_KIND["all-to-all"]
    row = dataclasses.replace(real, **changes)
    monkeypatch.setattr(collectives, "ROWS", tuple(row if r is real else r
                                                   for r in collectives.ROWS))
    monkeypatch.setitem(collectives.BY_KIND, row.kind, row)
    monkeypatch.setitem(collectives.BY_LAX, row.lax, row)
    sys.modules["libra_jax.model.derive"]._derive.cache_clear()  # priced afresh (and after)
    return row


@pytest.fixture(autouse=True)
def _fresh_derivations():
    yield
    sys.modules["libra_jax.model.derive"]._derive.cache_clear()


def test_the_all_to_all_without_its_model_shape_is_refused_by_name(monkeypatch):
    from libra_jax.model import forms
    row = _without(monkeypatch, shape=None)
    with pytest.raises(ValueError, match="the all-to-all collective's row has no model shape"):
        model.derive("cpu-host", 8)
    with pytest.raises(ValueError, match="the all-to-all collective's row has no model shape"):
        forms.ring_steps(8, row)
    assert forms.ring_steps(8, collectives.BY_KIND["all-reduce"]) == 14  # the other kinds priced as they were


def test_the_all_to_all_without_its_traffic_key_is_refused_by_name(monkeypatch):
    row = _without(monkeypatch, traffic_key=None)
    with pytest.raises(ValueError, match="the all-to-all collective's row has no traffic_key"):
        model.derive("cpu-host", 8)
    # A ring form prices it by its shape alone: no traffic key needed there.
    assert model.derive("h100", 8).cost.terms(row).traffic > 0


def test_the_all_to_all_without_its_emitter_or_bucket_form_is_refused_by_name(jax_8):
    """The forms the all-to-all's row holds none of (a bucket, a bucket class) and the
    parameters its emitter needs (`Site.exchange`), each asked for: `collectives.NoForm`
    naming the kind and what it lacks."""
    import jax
    import jax.numpy as jnp

    from libra_jax.rewrite.edits import fused_eqn, single_eqn
    from libra_jax.rewrite.sites import Site
    eqn = jax.make_jaxpr(jax.vmap(lambda x: jax.lax.psum(x, "x"), axis_name="x"))(
        jnp.ones((2, 3))).jaxpr.eqns[0]
    site = Site(0, ("x",), False, 12, None, eqn.outvars[0],
                collectives.BY_KIND["all-to-all"])  # no exchange
    with pytest.raises(collectives.NoForm, match=r"the all-to-all collective \(all_to_all\) has "
                                                 r"no all_to_all parameters \(Site.exchange\)"):
        single_eqn(eqn, site, 2, set())
    with pytest.raises(collectives.NoForm,
                       match=r"the all-to-all collective \(all_to_all\) has no bucket "):
        fused_eqn([eqn], [site], ("x",), False, 2)
    with pytest.raises(collectives.NoForm,
                       match=r"the all-to-all collective \(all_to_all\) has no bucket class"):
        site.bucket_class


@pytest.mark.parametrize("form", collectives.FORMS)
def test_the_all_to_all_without_each_of_its_forms_is_refused_by_name(monkeypatch, jax_8, form):
    """Each form of the real all-to-all's row taken out in turn (`collectives.FORMS`; one it
    holds none of is refused as it is): `optimize`, issuing the MoE step's all-to-alls, asks
    for it and gets `collectives.NoForm` naming the kind and the form. No plan, and no call
    of another kind: the step is refused, not issued as the all-reduce."""
    import jax

    import libra_jax
    import libra_jax.rewrite  # its forms (the emitter) given to the rows
    from test_exchange import moe_step

    real = collectives.BY_KIND["all-to-all"]
    message = rf"the all-to-all collective \(all_to_all\) has no {form}\b"
    if form not in real.forms:
        with pytest.raises(collectives.NoForm, match=message):
            real.form(form)
        return
    assert form in ("primitive", "emitter"), (
        f"the all-to-all's row holds a {form}: say here where `optimize` asks for it")
    _without(monkeypatch, forms={k: v for k, v in real.forms.items() if k != form})
    step, args = moe_step()
    opt = libra_jax.optimize(step)
    with pytest.raises(collectives.NoForm, match=message):
        jax.jit(opt).lower(*args)
    assert not opt.last_report  # nothing planned
    monkeypatch.undo()  # the real row back: issued as libra's all-to-all
    sys.modules["libra_jax.model.derive"]._derive.cache_clear()
    hlo = jax.jit(libra_jax.optimize(step)).lower(*args).compile().as_text()
    assert hlo.count("libra_all_to_all_cpu") == 4


def test_the_all_to_all_without_its_site_rule_or_engine_piece_stays_xlas(monkeypatch, jax_8):
    """Without its site rule `optimize` leaves each all-to-all as JAX's, named in its
    unplanned-collectives warning; without the engine's target its op lowers to XLA's
    all-to-all with the notice naming the kind. Never a call of another kind."""
    import jax

    import libra_jax
    from libra_jax import _ffi
    from libra_jax.rewrite import sites
    from test_exchange import moe_step

    step, args = moe_step()
    monkeypatch.delitem(sites.SITE_RULES, "all_to_all")
    with pytest.warns(UserWarning, match=r"all_to_all over \('data',\)"):
        opt = libra_jax.optimize(step)
        hlo = jax.jit(opt).lower(*args).compile().as_text()
    assert not [p for p in opt.last_report.plans if p.collective.exchanges]
    assert hlo.count(" all-to-all(") == 4 and "libra_all_to_all" not in hlo
    assert hlo.count("libra_allreduce_cpu") == hlo.count("custom_call_target=\"libra_allreduce")
    monkeypatch.undo()

    has_target = _ffi.has_target
    monkeypatch.setattr(_ffi, "has_target",
                        lambda kind, *rest: (collectives.row_of(kind).kind != "all-to-all"
                                             and has_target(kind, *rest)))
    from libra_jax.ops import base
    monkeypatch.setattr(base, "_warned", set())
    with pytest.warns(UserWarning, match="the extension registers no all-to-all target"):
        hlo = jax.jit(libra_jax.optimize(step)).lower(*args).compile().as_text()
    assert hlo.count(" all-to-all(") == 4 and "libra_all_to_all" not in hlo


# --- No behaviour keyed by a kind's name outside its row (issue 72) ---------------------------

def _kind_literals() -> dict[str, list[tuple[int, str]]]:
    """Each module's string constants that are a kind's name (the model's, `jax.lax`'s, or
    one of JAX's primitives of it), docstrings and ``__all__`` aside: (line, how it is used:
    "compare", "key" of a dict literal, or "other")."""
    import ast
    names = ({row.kind for row in collectives.ROWS} | {row.lax for row in collectives.ROWS}
             | {p for row in collectives.ROWS for p in row.jax_primitives})
    found: dict[str, list[tuple[int, str]]] = {}
    for path in sorted((ROOT / "libra_jax").rglob("*.py")):
        tree = ast.parse(path.read_text())
        skip, use = set(), {}
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
                skip.add(id(body[0].value))  # a docstring
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                skip.update(id(n) for n in ast.walk(node.value))
            if isinstance(node, ast.Compare):
                use.update({id(n): "compare" for n in [node.left, *node.comparators]})
            if isinstance(node, ast.Dict):
                use.update({id(k): "key" for k in node.keys if k is not None})
        hits = [(n.lineno, use.get(id(n), "other")) for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and n.value in names and id(n) not in skip]
        if hits:
            found[str(path.relative_to(ROOT))] = sorted(hits)
    return found


def test_no_module_branches_on_a_kinds_name():
    """A kind's behaviour is its row's (attributes and forms): outside libra_jax/collectives.py
    no code compares a value with a kind's name or keys a table by one, and the modules that
    write a name at all are these (each says why)."""
    found = _kind_literals()
    found.pop("libra_jax/collectives.py")
    assert not [(m, line) for m, hits in found.items() for line, use in hits
                if use == "compare"], found
    keyed = {m for m, hits in found.items() if any(use == "key" for _, use in hits)}
    assert keyed <= {"libra_jax/__init__.py",  # public function names -> their module
                     "libra_jax/_compat.py"}, found  # JAX's psum primitives (its names)
    assert set(found) <= {
        "libra_jax/__init__.py", "libra_jax/_compat.py",
        "libra_jax/explanation.py",  # nouns of its text ("2 psums of a loss or metric")
        # Where a kind's op or form is defined, its one naming of the kind (`provide`):
        "libra_jax/ops/psum.py", "libra_jax/ops/sharded.py", "libra_jax/ops/exchange.py",
        "libra_jax/rewrite/edits.py", "libra_jax/rewrite/sites.py"}, found


def test_a_row_equals_its_model_name_as_a_dtype_does():
    """Report fields hold rows: ``plan.collective == "all-gather"``, a set of them and a sort
    (written when they held the model's names) keep their meaning; rows are one object each."""
    gather = collectives.BY_KIND["all-gather"]
    reduce = collectives.BY_KIND["all-reduce"]
    assert gather == "all-gather" and gather != "all-reduce" and gather != "all_gather"
    assert gather != reduce and gather == collectives.row_of("all_gather")
    assert {gather, reduce} == {"all-gather", "all-reduce"} and "all-gather" in {gather}
    assert sorted([(reduce, 1), (gather, 2)]) == [(gather, 2), (reduce, 1)]  # as the names
    assert str(gather) == repr(gather) == "all_gather"
    assert {gather: 1}[collectives.row_of("all-gather")] == 1
    with pytest.raises(ValueError, match="no collective kind 'allgather'"):
        collectives.row_of("allgather")
