"""Every ```python block of README.md and the documentation site (docs/, subfolders included)
runs and gives the right answer; the README's picture is the current plan.

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

from conftest import assert_codegen_close

pytestmark = pytest.mark.usefixtures("jax_8")

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- doc-test: (?P<mark>[^\n]*?) -->\n)?^```python\n(?P<code>.*?)^```",
                   re.M | re.S)


def blocks() -> list[tuple[str, int, str | None, str]]:
    """(file, line, mark or None, code) of every python block, in order."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            out.append((str(path.relative_to(ROOT)), line, m.group("mark"), m.group("code")))
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


def check_readme_fsdp(ns: dict) -> None:
    """The README's FSDP step: the parameters stay sharded as laid out, the loss is the plain
    loss (within class 3's bound: two programs), and every gather and reduce-scatter is a
    Libra call."""
    jax_ = ns["jax"]
    for k, spec in ns["layout"].items():  # laid out as at the start (the gradients were too)
        assert ns["params"][k].sharding.is_equivalent_to(
            jax_.sharding.NamedSharding(ns["mesh"], spec), ns["params"][k].ndim), k
    rng = np.random.default_rng(0)  # the start, made again from the same seed
    start = {"w1": rng.standard_normal((16, 64), np.float32) / 4,
             "w2": rng.standard_normal((64, 8), np.float32) / 8, "b": np.zeros(8, np.float32)}
    x, y = rng.standard_normal((64, 16), np.float32), rng.standard_normal((64, 8), np.float32)
    assert_codegen_close(np.float32(ns["loss"]), np.float32(ns["loss_fn"](start, x, y)))
    with jax_.set_mesh(ns["mesh"]):
        text = ns["fast_step"].lower(ns["params"], ns["opt_state"], ns["x"], ns["y"]).as_text()
    assert "@libra_all_gather_cpu(" in text and "@libra_reduce_scatter_cpu(" in text
    assert "stablehlo.all_gather" not in text and "stablehlo.reduce_scatter" not in text


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
          "readme-gspmd": check_readme_gspmd, "readme-fsdp": check_readme_fsdp,
          "readme-nnx": check_readme_nnx,
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


def chains() -> list[list[tuple[str, int, str, str]]]:
    """The runnable blocks, grouped as they run: a ``run`` block and the ``continue`` blocks
    after it."""
    out: list[list[tuple[str, int, str, str]]] = []
    for f, line, mark, code in blocks():
        kind = mark.split(":")[0].split()[0] if mark else "skip"
        if kind == "run":
            out.append([])
        if kind in ("run", "continue"):
            out[-1].append((f, line, mark.split()[1], code))
    return out


#: Runs a chain's blocks as pasted, in one fresh namespace, each followed by its check
#: (`CHECKS`, imported from this file), in a process of its own.
_CHAIN_RUNNER = """
import sys
blocks = {blocks!r}
ns = {{"__name__": "doc"}}
for where, name, code in blocks:
    ns["params_before"] = ns.get("params")
    exec(compile(code, where, "exec"), ns)
    sys.path.insert(0, {tests!r})
    import test_docs
    test_docs.CHECKS[name](ns)
    print("CHECKED", name)
"""


@pytest.mark.parametrize("chain", chains(), ids=lambda c: c[0][2])
def test_python_blocks_run_as_pasted_and_give_the_right_answer(chain):
    """Each chain in a fresh process with no XLA_FLAGS, as a reader pastes it: a snippet that
    needs 8 devices on a CPU must ask for them itself."""
    import os
    import subprocess
    import sys

    script = _CHAIN_RUNNER.format(blocks=[(f"{f}:{line}", name, code)
                                          for f, line, name, code in chain],
                                  tests=str(Path(__file__).parent))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.split() == [w for _, _, name, _ in chain for w in ("CHECKED", name)]


def test_every_chain_is_run():
    assert sum(len(c) for c in chains()) >= 7


def test_the_readme_picture_is_the_current_plan():
    """docs/images/plan.png is drawn by tools/plan_picture.py with the plan lines it records in
    docs/images/plan.json; they must be the example's plan today (tests/plan_fixture.py's
    `example_plan`, as the fixture computes it): redraw the picture when a plan changes."""
    import json

    from plan_fixture import example_plan

    recorded = json.loads((ROOT / "docs" / "images" / "plan.json").read_text())
    assert recorded["profile"] == "cpu-host"
    assert example_plan(recorded["name"], small=recorded["small"]) == recorded["plan_lines"], (
        "the plan changed: run python tools/plan_picture.py")
    assert (ROOT / "docs" / "images" / "plan.png").stat().st_size > 10_000
    readme = (ROOT / "README.md").read_text()
    assert "](docs/images/plan.png)" in readme and "examples/transformer.py" in readme


def test_every_page_is_linked_from_the_readme_or_the_site_nav():
    """A page nobody links to is a page nobody reads: each docs page is in mkdocs.yml's nav."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")]
    assert pages
    missing = [p for p in pages if p not in nav]
    assert not missing, missing


def test_the_api_reference_documents_every_public_name():
    """Every name of `libra_jax.__all__` has its mkdocstrings entry (``::: module.name``) in
    docs/api/ and a row in docs/api/index.md; `model`, `planner`, `config` and `testing` have
    theirs as whole modules."""
    import importlib

    import libra_jax

    api = ROOT / "docs" / "api"
    directives = set(re.findall(r"^::: ([\w.]+)", "".join(p.read_text() for p in api.glob("*.md")),
                                re.M))
    index = (api / "index.md").read_text()
    whole = [importlib.import_module(d) for d in directives if d in (
        "libra_jax.model", "libra_jax.planner", "libra_jax.config", "libra_jax.testing")]
    for name in libra_jax.__all__:
        in_a_module = any(name in getattr(m, "__all__", ()) for m in whole)
        assert in_a_module or any(d.endswith(f".{name}") for d in directives), name
        assert f"[`{name}`]" in index, name
    assert {"libra_jax.model", "libra_jax.planner", "libra_jax.config",
            "libra_jax.testing"} <= directives


def test_table_cells_keep_names_whole():
    """The site's tables (the API index's "Defined in" column) never break a name inside a
    code span: the stylesheet says so and mkdocs.yml loads it."""
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    rule = re.search(r"\.md-typeset table:not\(\[class\]\) td code \{([^}]*)\}", css)
    assert rule and "white-space: nowrap" in rule.group(1), css
    assert "stylesheets/extra.css" in (ROOT / "mkdocs.yml").read_text()
