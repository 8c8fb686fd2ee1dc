"""`optimize`, `explain` and the drop-ins on the corpus of real-world-style steps (corpus.py).

Per step, jitted with its state donated:
* the hard criterion (class 2 of docs/bitwise.md): the optimized program with
  Libra's calls and the same rewritten program with XLA's all-reduce in their place
  (``optimize(collectives="xla")``) train to bitwise the same state and metrics;
* plain vs optimized (class 3: two programs, which XLA fuses and contracts differently per
  CPU): the losses within the bound; the trained state may differ by more after adaptive
  optimizer steps (reported, not required, in benchmarks/results/corpus.md);
* lowered for `cpu` and (``LIBRA_JAX_CUDA=p2p``) for `cuda`: Libra calls carrying the planned
  blocks, and no XLA all-reduce left;
* `explain` runs and names every gradient by its parameter's path;
* the drop-in, by function swap (the step's code calls `libra_jax.pmean`) and by
  `libra_jax.patch_lax()`: Libra calls in the program, losses within the bound of plain's.

CI: the full comparison (STEPS steps) on jax 0.10.2 (or with LIBRA_JAX_CORPUS_FULL=1); other
JAX versions run one step.
"""
from __future__ import annotations

import os
import re

import jax
import numpy as np
import pytest

import libra_jax
from libra_jax.rewrite import optimize

pytest.importorskip("flax")
pytest.importorskip("optax")

from conftest import assert_codegen_close  # noqa: E402
from corpus import CASES, fresh  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_8")

FULL = jax.__version__ == "0.10.2" or os.environ.get("LIBRA_JAX_CORPUS_FULL") == "1"
STEPS = 4 if FULL else 1
BLOCKS = re.compile(r"custom_call @libra_(?:allreduce|reduce_scatter|all_gather)_(?:cpu|cuda)"
                    r"(?:_start)?\("
                    r".*?blocks = (\d+)")


def train(fn, case, steps):
    state, metrics = fresh(case.state), []
    for _ in range(steps):
        state, m = fn(state, *case.batch, **case.kwargs)
        metrics.append(m)
    return state, metrics


def leaves_bytes(tree):
    """The bytes of every array leaf (a typed PRNG key's data; other leaves: their repr)."""
    def data(x):
        if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x).tobytes() if hasattr(x, "dtype") else repr(x)
    return [data(x) for x in jax.tree.leaves(tree)]


def losses(metrics):
    """Each step's loss (the metrics' first leaf), in its own dtype."""
    return np.stack([np.asarray(jax.tree.leaves(m)[0]).reshape(-1)[0] for m in metrics])


def jitted(fn, case):
    """`fn` compiled as the case's code compiles its step (`Case.compile`)."""
    return case.compile(fn)


@pytest.mark.parametrize("name", list(CASES))
def test_optimized_equals_its_xla_control_and_plain_agrees(name):
    case = CASES[name]()
    with case.context():
        plain = jitted(case.step, case)
        opt_fn = optimize(case.step, static_argnames=case.static_argnames)
        opt = jitted(opt_fn, case)
        control = jitted(optimize(case.step, collectives="xla",
                                  static_argnames=case.static_argnames), case)
        s_opt, m_opt = train(opt, case, STEPS)
        s_ctl, m_ctl = train(control, case, STEPS)
        s_plain, m_plain = train(plain, case, STEPS)
    assert leaves_bytes(s_opt) == leaves_bytes(s_ctl), "state: Libra vs its XLA control"
    assert leaves_bytes(m_opt) == leaves_bytes(m_ctl), "metrics: Libra vs its XLA control"
    assert_codegen_close(losses(m_opt), losses(m_plain))
    report = opt_fn.last_report
    kinds: dict[str, int] = {}
    for p in report.plans:
        kinds[p.kind] = kinds.get(p.kind, 0) + len(p.members)
    assert kinds == case.kinds, report.plan_lines()  # every psum classified as expected
    assert tuple(p.choice for p in report.loops) == case.loops, report.plan_lines()


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(CASES))
def test_lowers_to_libra_calls_with_the_planned_blocks(monkeypatch, name, platform):
    from libra_jax import _ffi
    if platform == "cuda" and not _ffi.HAS_CUDA:
        pytest.skip("libra_jax built without CUDA: the cuda lowering is XLA's (test_platform_matrix)")
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    case = CASES[name]()
    with case.context():
        opt_fn = optimize(case.step, static_argnames=case.static_argnames)
        text = case.trace(opt_fn).lower(lowering_platforms=(platform,)).as_text()
    lowered = sorted(int(b) for b in BLOCKS.findall(text))
    plans = opt_fn.last_report.plans
    assert lowered and set(lowered) <= {p.blocks for p in plans}, (
        lowered, opt_fn.last_report.plan_lines())
    # On CUDA's p2p path a reduce-scatter is XLA's (libra's are NCCL's: test_nccl.py).
    served = [p for p in plans if p.kind == "gradient"
              and (platform == "cpu" or p.collective == "all-reduce")]
    assert {p.blocks for p in served} <= set(lowered)
    assert "all_reduce" not in text
    if platform == "cpu":  # every gradient reduce-scatter is libra's, in a planned bucket
        assert "stablehlo.reduce_scatter" not in text and "stablehlo.all_gather" not in text
        assert text.count("@libra_reduce_scatter_cpu(") == sum(
            p.collective == "reduce-scatter" for p in plans)


@pytest.mark.parametrize("name", list(CASES))
def test_explain_names_every_gradient_by_its_parameter(name):
    case = CASES[name]()
    with case.context():
        e = libra_jax.explain(case.step, fresh(case.state), *case.batch, file=None,
                              static_argnames=case.static_argnames, **case.kwargs)
    # Scalars named as losses are no parameter's: a scope's pmean'ed loss and metrics (the
    # route's, planned with the backward pass's gradients: `rewrite.deferred`).
    names = [t for s in e.scopes for r in s.rows for t in r.tensors
             if not t.endswith("of a scalar (a loss or metric)")]
    assert names, str(e)
    leaf_paths = {jax.tree_util.keystr(p) for p, _ in
                  jax.tree_util.tree_flatten_with_path(case.state)[0]}
    # Each name is (the end of) a parameter's path; paths are shortened by their common prefix.
    parts = [re.sub(r"[\[\]'.]+", ".", p).strip(".") for p in leaf_paths]
    for n in names:
        assert any(p.endswith(n) for p in parts), (n, sorted(parts))
    assert len(set(names)) == len(names), names


@pytest.mark.parametrize("how", ["function swap", "patch_lax"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_drop_in_runs_libra_calls(name, how):
    case = CASES[name](pmean=libra_jax.pmean) if how == "function swap" else CASES[name]()
    if not case.drop_in:
        pytest.skip("the step has no psum of its own (a GSPMD step): optimize serves it")
    plain_case = CASES[name]()
    with case.context():
        if how == "patch_lax":
            with libra_jax.patch_lax():
                fn = jitted(case.step, case)
                text = case.trace(case.step).lower().as_text()
        else:
            fn = jitted(case.step, case)
            text = case.trace(case.step).lower().as_text()
        _, m_drop = train(fn, case, STEPS)
        _, m_plain = train(jitted(plain_case.step, plain_case), plain_case, STEPS)
    assert "libra_allreduce_cpu" in text
    # Autodiff's psums stay XLA's (optimize serves those), and a function swap does not
    # reach a library's own pmean (patch_lax does).
    if not case.autodiff_psums and not (case.library_psums and how == "function swap"):
        assert "all_reduce" not in text
    assert_codegen_close(losses(m_drop), losses(m_plain))


#: How each library's code compiles a step with `optimize` inside: called eagerly, under an
#: outer `jax.jit` (the case's static arguments marked there only), and the library's own.
COMPOSITIONS = {
    "eager": lambda case: optimize(case.step, static_argnames=case.static_argnames),
    "jax.jit(optimize)": lambda case: jax.jit(
        optimize(case.step), static_argnames=case.static_argnames or None),
    "library(optimize)": lambda case: case.library_jit(optimize(case.step)),
    "optimize(library)": lambda case: optimize(case.library_jit(case.step)),
}


@pytest.mark.parametrize("how", list(COMPOSITIONS))
@pytest.mark.parametrize("name", list(CASES))
def test_every_composition_trains_as_the_plain_step(name, how):
    """Each step trained 2 steps wrapped as people write it: the losses within class 3's
    bound of the plain step's, the state updated (in place, for NNX) and Libra's calls
    planned. `jax.jit` needs jax.jit-able state (not NNX's in-place objects, not Equinox's
    function leaves); the library forms are for the cases compiled by their library."""
    case = CASES[name]()
    if how.startswith(("library", "optimize(library")) and case.library_jit is None:
        pytest.skip("the step's library has no compile of its own (it is jax.jit)")
    if how == "jax.jit(optimize)" and case.library_jit is not None:
        pytest.skip("jax.jit cannot take this state (NNX in place, Equinox function leaves)")
    with case.context():
        fn = COMPOSITIONS[how](case)
        state = start = fresh(case.state)
        m_got = []
        for _ in range(2):
            state, m = fn(state, *case.batch, **case.kwargs)
            m_got.append(m)
        _, m_plain = train(jitted(case.step, case), case, 2)
    assert_codegen_close(losses(m_got), losses(m_plain))
    # The returned state moved from the start; an in-place step's own objects did too.
    for name_, trained in [("returned", state)] + ([("in place", start)] if case.in_place else []):
        moved = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                 for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(fresh(case.state)))
                 if hasattr(a, "dtype") and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)]
        assert max(moved) > 0, f"the {name_} state did not change"
    assert any(p.kind == "gradient" for p in _last_report(fn).plans)


def _last_report(fn):
    """The plan of an optimized function, also when a library's compile wraps it."""
    for f in (fn, getattr(fn, "__wrapped__", None), getattr(fn, "fun", None),
              getattr(fn, "_fun", None), getattr(fn, "f", None)):
        if getattr(f, "last_report", None) is not None:
            return f.last_report
    raise AssertionError(f"no optimize report reachable from {fn!r}")


FSDP = [name for name in CASES if name.startswith("fsdp-")]


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("name", FSDP)
def test_fsdp_steps_with_gathers_issued_ahead_equal_their_xla_control(name, prefetch):
    """``optimize(prefetch=d)`` on the FSDP steps: every forward gather (and remat's
    re-gathers) issued d ahead as a start/done pair; trained state and metrics bitwise its
    XLA control; losses within class 3's bound of plain; the kinds as with one call each."""
    case = CASES[name]()
    opt_fn = optimize(case.step, prefetch=prefetch)
    s_opt, m_opt = train(jitted(opt_fn, case), case, STEPS)
    s_ctl, m_ctl = train(jitted(optimize(case.step, prefetch=prefetch, collectives="xla"), case),
                         case, STEPS)
    _, m_plain = train(jitted(case.step, case), case, STEPS)
    assert leaves_bytes(s_opt) == leaves_bytes(s_ctl), "state: Libra vs its XLA control"
    assert leaves_bytes(m_opt) == leaves_bytes(m_ctl), "metrics: Libra vs its XLA control"
    assert_codegen_close(losses(m_opt), losses(m_plain))
    report = opt_fn.last_report
    gathers = [p for p in report.plans if p.collective == "all-gather"]
    assert gathers and {(p.overlap, p.ahead) for p in gathers} == {("prefetch", prefetch)}
    kinds: dict[str, int] = {}
    for p in report.plans:
        kinds[p.kind] = kinds.get(p.kind, 0) + len(p.members)
    assert kinds == case.kinds, report.plan_lines()


@pytest.mark.parametrize("name", list(CASES))
def test_buckets_are_ready_inside_the_backward_pass(name):
    """Every scope with two or more gradient layers (outside loop bodies) is planned with
    compute between its layers: its gradients become ready during the backward pass, not all
    at its end (the written order of ``pmean(jax.grad(...))``, before `rewrite.ready`).
    Where readiness stops at a call or a loop, explain says why."""
    case = CASES[name]()
    with case.context():
        e = libra_jax.explain(case.step, fresh(case.state), *case.batch, file=None,
                              static_argnames=case.static_argnames, **case.kwargs)
    for s in e.scopes:
        if s.in_loop or len(s.layers) < 2:
            continue
        stopped = [r.ready_why for r in s.rows if r.ready_why]
        assert any(layer.compute_s > 0 for layer in s.layers[1:]) or stopped, (name, str(e))
