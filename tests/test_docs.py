"""Every ```python block of README.md and docs/*.md runs and gives the right answer.

Each block is marked by the HTML comment on the line before it:
  <!-- doc-test: run NAME -->       executed in a fresh namespace, then CHECKS[NAME] on it
  <!-- doc-test: continue NAME -->  executed in the namespace of the block before it, then checked
  <!-- doc-test: skip: REASON -->   not executed (multi-process set-up, ...), with the reason
An unmarked block fails the test: nothing in the docs goes unchecked by accident.
"""
from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.usefixtures("jax_8")

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- doc-test: (?P<mark>[^\n]*?) -->\n)?^```python\n(?P<code>.*?)^```",
                   re.M | re.S)


def blocks() -> list[tuple[str, int, str | None, str]]:
    """(file, line, mark or None, code) of every python block, in order."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            out.append((path.name, line, m.group("mark"), m.group("code")))
    return out


def check_readme_intro(ns: dict) -> None:
    """The intro's step is one step of SGD on the *mean* gradient over the whole batch (the
    8x mistake of pmean-ing a check_vma gradient would fail this)."""
    x, y = (np.asarray(a) for a in ns["batch"])
    zero = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    grads = jax.grad(ns["loss_fn"])(zero, (x, y))  # one device, all 64 rows
    want = jax.tree.map(lambda p, g: np.asarray(p - 0.1 * g), zero, grads)
    got = jax.tree.map(np.asarray, ns["params"])
    for k in want:  # summation order differs: a few float32 ulps, not 8x
        np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=1e-7)
    assert np.abs(want["b"]).max() > 0.1  # a step that moved


def check_readme_gspmd(ns: dict) -> None:
    """The GSPMD step through the route is the GSPMD step (`jax.value_and_grad`), and its
    all-reduces are Libra's."""
    jax_ = ns["jax"]
    zero = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    loss, grads = jax.value_and_grad(ns["loss_fn"])(zero, tuple(map(np.asarray, ns["batch"])))
    for k in zero:  # one device, all 64 rows: summation order differs
        np.testing.assert_allclose(np.asarray(ns["params"][k]), np.asarray(-0.1 * grads[k]),
                                   rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(float(ns["loss"]), float(loss), rtol=2e-6)
    assert np.abs(np.asarray(grads["b"])).max() > 0.1  # a step that moved
    with jax_.set_mesh(ns["mesh"]):
        text = ns["fast_step"].lower(ns["params"], ns["opt_state"], ns["batch"]).as_text()
    assert "libra_allreduce_cpu" in text and "all_reduce" not in text


def check_readme_optimize(ns: dict) -> None:
    """The optimized step is the plain step's second update, and runs Libra's calls."""
    batch, first = ns["batch"], ns["params_before"]
    want = ns["step"](first, batch)
    got = ns["params"]
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=2e-6,
                                   atol=1e-7)
    text = ns["fast_step"].lower(first, batch).as_text()
    assert "libra_allreduce_cpu" in text and "all_reduce" not in text


def check_readme_nnx(ns: dict) -> None:
    """The NNX snippet's step updated the model in place, as nnx.jit(step) does, and its
    gradient all-reduce is Libra's."""
    from flax import nnx
    import optax

    from libra_jax.testing import assert_codegen_close

    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    want_loss = nnx.jit(ns["train_step"])(model, optimizer, ns["x"], ns["y"])
    assert_codegen_close([ns["loss"], nnx.state(ns["model"])], [want_loss, nnx.state(model)])
    assert int(ns["optimizer"].step[...]) == 1
    assert np.abs(np.asarray(ns["model"].bias[...])).max() > 0.01  # it moved
    e = ns["libra_jax"].explain(ns["train_step"], model, optimizer, ns["x"], ns["y"], file=None)
    assert any(p.kind == "gradient" for p in e.report.plans), e.report.plan_lines()


def check_readme_equinox(ns: dict) -> None:
    """The Equinox snippet: one SGD step, as eqx.filter_jit(step) takes it, the activation
    kept."""
    import equinox as eqx

    from libra_jax.testing import assert_codegen_close

    want_model, want_loss = eqx.filter_jit(ns["train_step"])(ns["model"], ns["x"], ns["y"])
    arrays = lambda t: eqx.filter(t, eqx.is_array)  # noqa: E731
    assert_codegen_close([arrays(ns["new_model"]), ns["loss"]], [arrays(want_model), want_loss])
    assert ns["new_model"].activation is jax.nn.gelu


def check_readme_nnx_route(ns: dict) -> None:
    """The NNX route snippet: one SGD step as the GSPMD step (`nnx.value_and_grad`) takes it,
    the kernel still laid out over ``model``, and the gradient all-reduces Libra's."""
    from flax import nnx
    import optax

    from libra_jax.testing import assert_codegen_close

    with jax.set_mesh(ns["mesh"]):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        model = nnx.Linear(4, 1, kernel_init=init, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @nnx.jit
        def gspmd_step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(ns["loss_fn"])(model, x, y)
            optimizer.update(model, grads)
            return loss
        want_loss = gspmd_step(model, optimizer, ns["x"], ns["y"])
        e = ns["libra_jax"].explain(ns["train_step"], model, optimizer, ns["x"], ns["y"],
                                    file=None)
    assert_codegen_close([ns["loss"], nnx.state(ns["model"])], [want_loss, nnx.state(model)])
    assert ns["model"].kernel[...].sharding.spec == P(None, "model")
    assert np.abs(np.asarray(ns["model"].bias[...])).max() > 0.01  # it moved
    assert any(p.kind == "gradient" for p in e.report.plans), e.report.plan_lines()


CHECKS = {"readme-intro": check_readme_intro, "readme-optimize": check_readme_optimize,
          "readme-gspmd": check_readme_gspmd, "readme-nnx": check_readme_nnx,
          "readme-equinox": check_readme_equinox, "readme-nnx-route": check_readme_nnx_route}


def test_every_python_block_is_marked():
    found = blocks()
    assert found, "no python blocks found"
    unmarked = [f"{f}:{line}" for f, line, mark, _ in found if mark is None]
    assert not unmarked, f"python blocks without a doc-test mark: {unmarked}"
    for f, line, mark, _ in found:
        assert re.fullmatch(r"(run|continue) [\w-]+|skip: .+", mark), (f, line, mark)
        if mark.split()[0] in ("run", "continue"):
            assert mark.split()[1] in CHECKS, f"{f}:{line}: no check named {mark.split()[1]}"


def test_python_blocks_run_and_give_the_right_answer():
    ns: dict = {}
    ran = 0
    for f, line, mark, code in blocks():
        kind = mark.split(":")[0].split()[0] if mark else "skip"
        if kind == "skip":
            continue
        if kind == "run":
            ns = {"__name__": f"doc_{line}"}
        ns["params_before"] = ns.get("params")
        exec(compile(code, f"{f}:{line}", "exec"), ns)  # noqa: S102 - the docs' own code
        CHECKS[mark.split()[1]](ns)
        ran += 1
    assert ran >= 2
