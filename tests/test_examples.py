"""The examples run a few steps at small sizes, plain and optimized, with matching results."""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("flax")

pytestmark = pytest.mark.usefixtures("jax_8")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import common  # noqa: E402
from conftest import assert_codegen_close  # noqa: E402


@pytest.mark.parametrize("name, options", [("mlp", {}), ("cnn", {}), ("transformer", {}),
                                           ("transformer", {"variant": "pmap"}), ("fsdp", {})])
def test_example_trains_with_matching_results(name, options):
    module = common.load_example(EXAMPLES / f"{name}.py")
    step, args = module.build(True, **options)
    res = common.train(step, args, 3, progress=False, control=True)
    plain, opt = res.losses["plain"], res.losses["optimized"]
    assert len(plain) == len(opt) == 3 and np.all(np.isfinite(plain))
    # Plain vs optimized: two programs (class 3 of docs/bitwise.md), which XLA
    # fuses, and contracts a*b+c, differently: the losses within the bound.
    assert_codegen_close(np.float32(opt), np.float32(plain))
    # The hard criterion (class 2): Libra's calls and XLA's all-reduce in their place, in the
    # same rewritten program, train to bitwise the same state (parameters, optimizer state)
    # and losses.
    assert res.identical("optimized", "control"), name
    assert res.losses["control"] == opt
    assert plain[-1] < plain[0]  # it learns
    report = res.report
    assert report is not None and report.num_psums > 0
    assert any(p.kind == "gradient" for p in report.plans)
    assert len(res.times["plain"]) == 3 - common.WARMUP
    if name == "mlp":  # the printed result says what is bitwise and what is within the bound
        import contextlib
        import io
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            common.print_result(res, "mlp")
        text = out.getvalue()
        assert "within class 3's bound of 16" in text, text
        assert "final state: bitwise control's" in text, text
        assert "False" not in text and "True" not in text, text
    if name == "fsdp":  # GSPMD's step beside the route's: every collective of the route Libra's
        assert common.plain_step(step) is not step
        collectives = {p.collective for p in report.plans}
        assert {"all-gather", "reduce-scatter"} <= collectives, report.plan_lines()
        for arm, state in res.states.items():  # laid out as FSDP, in every arm
            sharded = [x.sharding.spec for x in jax.tree.leaves(state[0])
                       if not x.sharding.is_fully_replicated]
            assert len(sharded) >= 6, (arm, sharded)


def test_multiprocess_example_trains_across_two_processes():
    """examples/multiprocess.py launches itself as 2 processes x 4 devices and trains the MLP;
    process 0 prints the loss of every step (tests/test_multiprocess.py compares the numbers
    with a single-process run)."""
    import subprocess

    proc = subprocess.run([sys.executable, str(EXAMPLES / "multiprocess.py"), "--small",
                           "--steps", "3"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout
    assert "2 processes x 4 host CPU devices" in proc.stdout
    assert "the same plan on every process" in proc.stdout


def test_end_to_end_reads_the_engine_debug_log():
    # benchmarks/end_to_end.py --overlap runs an example under LIBRA_JAX_DEBUG=1 in a child
    # process; that child once failed on import and the committed table's section came out
    # empty. Now a failing child raises, and a working one yields each arm's all-reduces.
    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    import end_to_end

    lines = end_to_end.overlap("mlp", {}).splitlines()
    assert [line.split(":")[0] for line in lines] == ["- mlp, fusion=True", "- mlp, fusion=False"]
    for line in lines:
        count = int(line.split(": ")[1].split()[0])
        assert count >= 2, line


def test_demo_checks_its_parameters_against_the_bound():
    """examples/demo.py: jax.lax.psum's step and libra_jax.psum's, two programs (class 3 of
    docs/bitwise.md): it exits 0 only when the parameters agree within the bound."""
    import subprocess

    proc = subprocess.run([sys.executable, str(EXAMPLES / "demo.py"), "--steps", "2",
                           "--hidden", "64", "--batch", "4"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "largest difference" in proc.stdout, proc.stdout
    assert "within class 3's bound of 16 (two programs: docs/bitwise.md)" in proc.stdout
