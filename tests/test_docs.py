"""Every ```python block of README.md and the documentation site (docs/, subfolders included,
each page as the site builds it: pymdownx.snippets' `--8<--` lines replaced by what they
include) runs as pasted and gives the right answer, or says on the page what it is; the README's
picture is the current plan.

Each block is marked by the HTML comment on the line before it (the machine's mark), and the
page says the same in words a reader sees (the text before the block, comments left out):
  <!-- doc-test: run NAME -->       executed in a fresh process (no XLA_FLAGS), then
                                    CHECKS[NAME] on its namespace
  <!-- doc-test: continue NAME -->  executed after the block before it, in the same process and
                                    namespace, then checked; the paragraph before it says
                                    "Continues the LABEL snippet above", LABEL a name the text
                                    just before that chain's first block uses
  <!-- doc-test: sketch -->         not executed; the paragraph before it says "A sketch", and
                                    it is compiled unless that paragraph says "not valid Python"
An unmarked block fails the test: nothing in the docs goes unchecked by accident.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

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
#: pymdownx.snippets' include line (mkdocs.yml: base_path is the repository root).
SNIPPET = re.compile(r'^--8<-- "(?P<file>[^":]+)(?::(?P<section>[\w-]+))?"[ \t]*$', re.M)
SECTION_MARK = re.compile(r"^.*--8<-- \[(?:start|end):[\w-]+\].*\n?", re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
CONTINUES = re.compile(r"\bContinues the (?P<label>.+?) snippet above\b", re.S)


def page_text(path: Path) -> str:
    """The page's Markdown as the site builds it: each ``--8<-- "FILE:section"`` line replaced
    by that section of FILE, section markers dropped (README.md's text as it is)."""
    def include(m: re.Match) -> str:
        text = (ROOT / m["file"]).read_text()
        if m["section"]:
            start = re.search(rf"^.*--8<-- \[start:{m['section']}\].*$", text, re.M)
            end = re.search(rf"^.*--8<-- \[end:{m['section']}\].*$", text, re.M)
            assert start and end, f"{path}: no section {m['section']} in {m['file']}"
            text = text[start.end() + 1:end.start()]
        return SECTION_MARK.sub("", text).rstrip("\n")
    return SNIPPET.sub(include, path.read_text())


class Block(NamedTuple):
    where: str         # file:line (the line in the page as built, for a page with includes)
    mark: str | None   # the doc-test comment's text
    code: str
    before: list[str]  # the visible paragraphs (and headings) since the previous python block


def _paragraphs(text: str) -> list[str]:
    text = COMMENT.sub("", text)
    return [p.strip() for p in re.split(r"\n\s*\n|\n(?=#)", text) if p.strip()]


def page_blocks(path: Path, text: str | None = None) -> list[Block]:
    text = page_text(path) if text is None else text
    out, last = [], 0
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code"))
        out.append(Block(f"{path.relative_to(ROOT)}:{line}", m["mark"], m["code"],
                         _paragraphs(text[last:m.start()])))
        last = m.end()
    return out


def blocks() -> list[Block]:
    """Every python block of every page, in order."""
    return [b for path in DOCS for b in page_blocks(path)]


def kind(block: Block) -> str:
    return (block.mark or "").split(":")[0].split(" ")[0]


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
    """The Equinox template: its two steps are eqx.filter_jit(step)'s, the activation kept; and
    it trains with libra on (`optimize(step)`) and off (`enabled=False`, JAX's step: the
    template must not close over the model inside its shard_map, which JAX refuses at the
    second step), two steps each from the same model, the loss falling and the two runs
    agreeing."""
    import equinox as eqx

    from libra_jax.testing import assert_codegen_close

    libra_jax, train_step, x, y = ns["libra_jax"], ns["train_step"], ns["x"], ns["y"]
    start = eqx.nn.MLP(4, 1, 8, 1, activation=jax.nn.gelu, key=jax.random.key(0))
    arrays = lambda t: eqx.filter(t, eqx.is_array)  # noqa: E731
    runs = {}
    for name, step in [("plain", eqx.filter_jit(train_step)),
                       ("on", eqx.filter_jit(libra_jax.optimize(train_step))),
                       ("off", eqx.filter_jit(libra_jax.optimize(train_step, enabled=False)))]:
        model, losses = start, []
        for _ in range(2):
            model, loss = step(model, x, y)
            losses.append(np.float32(loss))
        assert losses[1] < losses[0], (name, losses)  # it trains
        runs[name] = (arrays(model), losses)
    assert_codegen_close(runs["on"], runs["off"])  # two programs: class 3's bound
    assert_codegen_close([arrays(ns["model"]), np.float32(ns["loss"])],
                         [runs["plain"][0], runs["plain"][1][-1]])
    assert ns["model"].activation is jax.nn.gelu


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
    unmarked = [b.where for b in found if b.mark is None]
    assert not unmarked, f"python blocks without a doc-test mark: {unmarked}"
    for b in found:
        assert re.fullmatch(r"(run|continue) [\w-]+|sketch", b.mark), (b.where, b.mark)
        if kind(b) in ("run", "continue"):
            assert b.mark.split()[1] in CHECKS, f"{b.where}: no check named {b.mark.split()[1]}"


def _chain_heads() -> dict[str, Block]:
    """Each continuation's `where`: the first block of its chain."""
    heads, head = {}, None
    for path in DOCS:
        head = None
        for b in page_blocks(path):
            if kind(b) == "run":
                head = b
            elif kind(b) == "continue":
                assert head is not None, f"{b.where}: continues no block of its page"
                heads[b.where] = head
    return heads


def test_continuations_and_sketches_say_so_where_a_reader_sees_it():
    """A block that does not run as pasted in a fresh process says so in the page's text, not in
    an HTML comment: a continuation names the snippet it continues ("Continues the `psum`
    snippet above"), a name used just before that snippet (its heading or paragraph); a sketch
    says "A sketch". A block that does run says neither."""
    heads = _chain_heads()
    problems = []
    for b in blocks():
        said = b.before[-1] if b.before else ""
        continues = CONTINUES.search(said)
        if kind(b) == "continue":
            if not continues:
                problems.append(f"{b.where}: a continuation, and the paragraph before it does "
                                f"not say 'Continues the ... snippet above': {said[:80]!r}")
            elif continues["label"] not in " ".join(heads[b.where].before[-2:]):
                problems.append(f"{b.where}: continues {continues['label']}, a name not used "
                                f"just before the chain's first block ({heads[b.where].where})")
        elif kind(b) == "sketch":
            if "A sketch" not in said:
                problems.append(f"{b.where}: a sketch, and the paragraph before it does not "
                                f"say 'A sketch': {said[:80]!r}")
        elif continues or "A sketch" in said:
            problems.append(f"{b.where}: runs as pasted, but its page says otherwise")
    assert not problems, "\n".join(problems)


def test_sketches_are_python():
    """A sketch is compiled (names it leaves to the reader may be undefined, not its syntax),
    unless its page says it is not valid Python."""
    sketches = [b for b in blocks() if kind(b) == "sketch"]
    for b in sketches:
        if "not valid Python" not in (b.before[-1] if b.before else ""):
            compile(b.code, b.where, "exec")


def chains() -> list[list[tuple[str, str, str]]]:
    """The runnable blocks, grouped as they run: a ``run`` block and the ``continue`` blocks
    after it, as (where, check name, code); a chain a page includes from another (the
    quickstart's from the README) runs once."""
    out: list[list[tuple[str, str, str]]] = []
    for b in blocks():
        if kind(b) == "run":
            out.append([])
        if kind(b) in ("run", "continue"):
            out[-1].append((b.where, b.mark.split()[1], b.code))
    unique: dict[tuple, list[tuple[str, str, str]]] = {}
    for chain in out:
        unique.setdefault(tuple((name, code) for _, name, code in chain), chain)
    return list(unique.values())


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


def run_chain(chain: list[tuple[str, str, str]]) -> None:
    """A chain in a fresh process with no XLA_FLAGS, as a reader pastes it: a snippet that
    needs 8 devices on a CPU must ask for them itself."""
    import os
    import subprocess
    import sys

    script = _CHAIN_RUNNER.format(blocks=chain, tests=str(Path(__file__).parent))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.split() == [w for _, name, _ in chain for w in ("CHECKED", name)]


@pytest.mark.parametrize("chain", chains(), ids=lambda c: c[0][1])
def test_python_blocks_run_as_pasted_and_give_the_right_answer(chain):
    run_chain(chain)


def test_every_chain_is_run():
    assert sum(len(c) for c in chains()) >= 7
    assert "readme-fsdp" in [c[0][1] for c in chains()]


def test_the_quickstart_page_is_the_readme_s_and_asks_for_devices_as_its_snippets_do():
    """docs/quickstart.md includes every python block of the README's quickstarts (FSDP's too),
    and no page tells a reader to set XLA_FLAGS for host devices: the snippets ask for them
    with ``jax.config.update("jax_num_cpu_devices", 8)``."""
    quickstart = [b.code for b in page_blocks(ROOT / "docs" / "quickstart.md")]
    readme = [b for b in page_blocks(ROOT / "README.md")]
    missing = [b.where for b in readme if b.code not in quickstart]
    assert not missing, f"README blocks not on docs/quickstart.md: {missing}"
    for path in DOCS:
        text = COMMENT.sub("", page_text(path))
        assert "XLA_FLAGS=--xla_force_host_platform_device_count" not in text, path
    assert all('jax.config.update("jax_num_cpu_devices", 8)' in b.code
               for b in readme if kind(b) == "run")


def test_every_option_of_optimize_has_its_own_heading():
    """docs/optimize.md: a ``###`` heading per keyword option of `libra_jax.optimize` (one may
    name two, `prefetch=` and `prefetch_bytes=`), under ``## Options``; the anchor other pages
    link to stays."""
    import inspect

    import libra_jax

    text = (ROOT / "docs" / "optimize.md").read_text()
    options = [n for n, p in inspect.signature(libra_jax.optimize).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(options) >= 12, options
    body = text.split("\n## Options\n", 1)
    assert len(body) == 2, "no '## Options' section"
    section = body[1].split("\n## ", 1)[0]
    headings = re.findall(r"^### (.*)$", section, re.M)
    for name in options:
        assert any(f"`{name}=`" in h for h in headings), f"no ### heading for {name}="
    assert "{#all-gathers-issued-ahead-prefetch}" in text


def test_troubleshooting_entries_are_nested_in_their_groups():
    """docs/troubleshooting.md: groups are ``##`` headings, each notice a ``### `id` {#id}``
    under one (the anchor libra_jax.config's pointers name), and the GSPMD route's notices are
    a group of their own, not deprecations."""
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    group, seen = None, {}
    for line in text.splitlines():
        if line.startswith("## "):
            assert "{#" not in line, f"a notice at group level: {line}"
            group = line[3:]
        elif line.startswith("### "):
            m = re.fullmatch(r"### `([a-z0-9-]+)` \{#([a-z0-9-]+)\}", line)
            assert m and m[1] == m[2], line
            assert group is not None, f"a notice before any group: {line}"
            seen[m[1]] = group
    assert len(seen) >= 20, seen
    for notice in ("closed-over-batch", "loss-is-a-sum", "closed-over-whole"):
        assert "value_and_grad" in seen[notice] and "Deprecation" not in seen[notice], (
            notice, seen[notice])


def test_the_readme_says_how_long_the_tests_take_and_offers_a_quick_subset():
    """The README's test command takes minutes on 2 cores: the README says how many, and gives
    a quick subset of test files that exist."""
    text = (ROOT / "README.md").read_text()
    after = text.split("<!-- test-command -->", 1)[1]
    after = after.split("\n## ", 1)[0]
    assert re.search(r"about \d+ minutes on a quiet 2-core machine", after), after[:600]
    rest = after.split("<!-- --8<-- [end:test-command] -->")[1]
    quick = re.search(r"^```\n(.*pytest.*)\n```", rest, re.M)
    assert quick, "no quick subset command after the test command"
    files = re.findall(r"tests/\S+\.py", quick[1])
    assert 2 <= len(files) <= 4 and all((ROOT / f).is_file() for f in files), files
    assert quick[1] in (ROOT / "docs" / "install.md").read_text()  # the site says the same


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
