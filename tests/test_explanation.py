"""libra_jax.explanation (`libra_jax.explain`): the plan with its predicted times, which are planner.simulate's."""
from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import planner
from libra_jax.explanation import Explanation

from conftest import mesh_of, mlp_step, shard

pytestmark = pytest.mark.usefixtures("jax_8")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def mlp_step(hidden: int = 64):
    """A data-parallel SGD step in plain JAX, gradients psummed under check_vma=False: 6
    gradient psums and a loss pmean over 8 devices."""
    rng = np.random.default_rng(0)
    sizes = [16, hidden, hidden, 8]
    params = {f"layer{i}": {"w": (rng.standard_normal((m, n)) * 0.3).astype(np.float32),
                            "b": np.zeros(n, np.float32)}
              for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))}

    def local(params, x):
        def loss(p):
            h = x
            for i in range(len(p)):
                h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
            return jnp.mean(h ** 2)
        loss_value, grads = jax.value_and_grad(loss)(params)
        grads = jax.tree.map(lambda g: jax.lax.psum(g, "x"), grads)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), jax.lax.pmean(loss_value, "x")

    mesh = mesh_of((8,), ("x",))
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()),
                                 check_vma=False))
    x = shard(rng.standard_normal((32, sizes[0])).astype(np.float32), mesh, P("x"))
    return step, (params, x)


def check(e: Explanation) -> None:
    assert e.scopes
    for s in e.scopes:
        assert s.backward_s == pytest.approx(planner.simulate(list(s.layers), list(s.buckets), s.cost),
                                             rel=1e-12)
        assert [r.nbytes for r in s.rows] == [sum(s.layers[i].grad_bytes
                                                  for i in range(b.first, b.last + 1)) for b in s.buckets]
        assert sum(len(r.tensors) for r in s.rows) == len(s.layers)
        for r in s.rows:
            assert r.ready_s <= r.start_s <= r.end_s <= s.backward_s + 1e-15
            assert 1 <= r.blocks <= libra_jax.MAX_BLOCKS and r.allocation in s.cost.slowdown
    assert e.backward_s == pytest.approx(sum(s.backward_s for s in e.scopes))


def test_explain_plain_jax_step():
    step, args = mlp_step()
    out = io.StringIO()
    e = libra_jax.explain(step, *args, file=out, use_rich=False)
    check(e)
    for s in e.scopes:  # with fusion, Libra's plan is never predicted slower than the baselines
        assert s.backward_s <= min(s.default_s, s.fusion_only_s) * (1 + 1e-9)
    names = {t for s in e.scopes for r in s.rows for t in r.tensors}
    assert {f"layer{i}.{k}" for i in range(3) for k in "wb"} <= names, names
    text = out.getvalue()
    assert "predicted backward: Libra" in text and "default allocation" in text
    assert "fusion only" in text and "layer0.w" in text
    # the report's prediction is the same plan
    assert e.report.predicted[0]["backward_s"] == pytest.approx(e.scopes[0].backward_s, rel=1e-12)
    # The whole step priced both ways (issue 73), said in one line with the report's numbers.
    price = e.report.step
    assert price is not None and e.predicted_ratio == price.predicted_ratio < 1
    line, = [t for t in " ".join(text.split()).split("what the prediction covers")[1:]]
    assert (f"predicted step: {price.optimized_s * 1e3:.2f} ms optimized, "
            f"{price.plain_s * 1e3:.2f} ms plain ({price.predicted_ratio:.2f}x)") in line
    assert (f"{price.plain_stagger_s * 1e3:.2f} ms of the devices' stagger at them" in line
            and f"{price.optimized_stagger_s * 1e3:.2f} ms of it stagger" in line)
    assert "on CPU a measured gain comes mostly from outside this prediction" not in text
    # The shipped CPU profile's 8 devices fill its 2 cores: said, as the model prices it.
    assert "at its solo rate, slowing no compute" in line
    assert "the compute it overlaps slowed" not in line
    # A GPU profile's collectives slow the compute beside them.
    gpu = io.StringIO()
    libra_jax.explain(step, *args, profile="h200", file=gpu)
    assert "the compute it overlaps slowed by those blocks" in " ".join(gpu.getvalue().split())


def test_explain_options_and_optimized_functions():
    step, args = mlp_step()
    unfused = libra_jax.explain(step, *args, fusion=False, file=None)
    assert all(len(r.tensors) == 1 for s in unfused.scopes for r in s.rows)
    check(unfused)
    opt = libra_jax.optimize(step)
    again = libra_jax.explain(opt, *args, file=None)  # explains what `opt` wraps
    assert [len(s.rows) for s in again.scopes] == [len(s.rows)
                                                  for s in libra_jax.explain(step, *args, file=None).scopes]
    assert "predicted backward" in str(again)


def test_explain_rich_table():
    pytest.importorskip("rich")
    step, args = mlp_step()
    e = libra_jax.explain(step, *args, file=None)
    text = e.table(use_rich=True, width=120)  # the terminal's width by default
    assert "tensors" in text and "layer0.w" in text


@pytest.mark.parametrize("name", ["cnn", "transformer", "fsdp"])
def test_explain_flax_examples(name):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    sys.path.insert(0, str(EXAMPLES))
    import common

    step, args = common.load_example(EXAMPLES / f"{name}.py").build(True)
    e = libra_jax.explain(step, *args, file=None)
    check(e)
    names = [t for s in e.scopes for r in s.rows for t in r.tensors]
    assert any("kernel" in t for t in names), names


def test_public_name_survives_module_import():
    import libra_jax.explanation  # noqa: F401

    assert callable(libra_jax.explain) and libra_jax.explain.__name__ == "explain"


def test_plans_keep_to_what_can_be_fused() -> None:
    """The loss's pmean comes after the update that uses every gradient, but does not depend on
    it: the update can move after a bucket holding the last gradient and the loss, so the
    gradients reach the loss (`reach`). The plan keeps to reach, so every planned bucket is what
    runs, and the prediction is of what runs."""
    step, args = mlp_step()
    opt = libra_jax.optimize(step)
    jax.block_until_ready(opt(*args))
    (entry,) = opt.last_report.predicted
    reach = entry["reach"]
    n = len(entry["layers"])
    assert reach == [n - 1] * n
    for b in entry["buckets"]:
        assert all(b.last <= reach[i] for i in range(b.first, b.last))
    gradient = [p for p in opt.last_report.plans if p.kind == "gradient"]
    assert len(gradient) == len(entry["buckets"])  # no bucket was cut at rewrite time


def test_timeline_prices_packing_like_simulate() -> None:
    from libra_jax import gantt

    layers = [planner.Layer(1e-3, 1 << 20), planner.Layer(2e-3, 1 << 20), planner.Layer(1e-3, 0)]
    cost = planner.CostModel(2e-5, {1: 1e9, 2: 2e9}, {1: 5e8, 2: 8e8}, {1: 1.1, 2: 1.4},
                             pack_s_per_byte=1e-9)
    for buckets in ([planner.Bucket(0, 1, 2), planner.Bucket(2, 2, 1)], [planner.Bucket(0, 2, 1)],
                    [planner.Bucket(0, 0, 1), planner.Bucket(1, 2, 2)]):
        tl = gantt.timeline(layers, buckets, cost)
        assert tl.backward_s == pytest.approx(planner.simulate(layers, buckets, cost), rel=1e-12)
        for c in tl.collectives:
            assert c.start <= c.pack_end <= c.latency_end
    fused = gantt.timeline(layers, [planner.Bucket(0, 2, 1)], cost).collectives[0]
    assert fused.pack_end - fused.start == pytest.approx(2 * (1 << 20) * 1e-9)


def test_dir_lists_each_public_name_once():
    import libra_jax

    libra_jax.explain  # noqa: B018 - loaded: now a module global as well as a lazy name
    names = dir(libra_jax)
    assert len(names) == len(set(names)) and "explain" in names and "patch_lax" in names


def test_gradients_are_named_by_their_parameter_under_global_norm_clipping():
    # A global norm reads every gradient, and every update reads the norm: each gradient
    # reached every output of its size, so same-sized biases all got one name.
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(4)
    sizes = [10, 10, 10, 10]
    params = {f"layer{i}": {"w": (rng.standard_normal((m, n)) * 0.3).astype(np.float32),
                            "b": np.zeros(n, np.float32)}
              for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = tx.init(params)
    mesh = mesh_of((8,), ("x",))

    def local(params, state, x):
        def loss(p):
            h = x
            for i in range(len(p)):
                h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
            return jax.lax.pmean(jnp.mean(h ** 2), "x")
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("x")),
                                 out_specs=(P(), P())))
    x = shard(rng.standard_normal((32, sizes[0])).astype(np.float32), mesh, P("x"))
    e = libra_jax.explain(step, params, state, x, fusion=False, file=None)
    names = sorted(t for s in e.scopes for r in s.rows for t in r.tensors)
    assert names == sorted(f"layer{i}.{k}" for i in range(3) for k in ("b", "w")), names


@pytest.mark.parametrize("jitted, closed_over", [(False, False), (True, False), (True, True)])
def test_gradients_written_into_refs_are_named_by_their_parameter(jitted, closed_over):
    """A step that keeps its parameters and optimizer state in `jax.Ref`s (JAX's Training
    Cookbook), through the route on an explicit mesh with the loss closing over the batch
    (split: ``split_closed_over=True``):
    the gradients update the references in place, and returns nothing of them; each is named
    by the parameter it is written into (``w``, ``v``: the path its parameter and momentum
    references share), not ``psum #16 [16, 32]``; also where the step closes over the
    references instead of taking them as arguments."""
    from jax.sharding import AxisType, NamedSharding
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:8])
    rng = np.random.default_rng(5)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        params = {"w": put(rng.standard_normal((16, 32)).astype(np.float32), P()),
                  "v": put(rng.standard_normal((32, 8)).astype(np.float32), P())}
        refs = jax.tree.map(jax.new_ref, params)
        momentum = jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), params)
        batch = {"x": put(rng.standard_normal((64, 16)).astype(np.float32), P("data")),
                 "y": put(rng.standard_normal((64, 8)).astype(np.float32), P("data"))}

        def step(refs, momentum, batch):
            def loss_fn(p):
                h = jnp.tanh(batch["x"] @ p["w"])
                return jnp.mean((h @ p["v"] - batch["y"]) ** 2)
            loss, grads = libra_jax.value_and_grad(loss_fn, split_closed_over=True)(
                jax.tree.map(lambda r: r[...], refs))

            def update(ref, m, g):
                m[...] = 0.9 * m[...] + g
                ref[...] = ref[...] - 0.1 * m[...]
            jax.tree.map(update, refs, momentum, grads)
            return loss
        if closed_over:
            e = libra_jax.explain(jax.jit(lambda batch: step(refs, momentum, batch)), batch,
                                  fusion=False, file=None)
        else:
            e = libra_jax.explain(jax.jit(step) if jitted else step, refs, momentum, batch,
                                  fusion=False, file=None)
    names = sorted(t for s in e.scopes for r in s.rows for t in r.tensors if "scalar" not in t)
    assert names == ["v", "w"], names


def test_table_uses_the_terminals_width(monkeypatch) -> None:
    """An 80-column terminal gets an 80-column table (rich's rendering), not a fixed 120."""
    pytest.importorskip("rich")
    import os

    monkeypatch.setenv("COLUMNS", "80")
    step, args = mlp_step()
    e = libra_jax.explain(step, *args, file=None)
    assert max(len(line) for line in e.table(use_rich=True).splitlines()) <= 80
    monkeypatch.setenv("COLUMNS", "150")
    assert os.environ["COLUMNS"] == "150"
    assert max(len(line) for line in e.table(use_rich=True).splitlines()) > 80


def test_explain_shows_which_gather_overlaps_which_compute():
    """FSDP under remat with ``prefetch=1``: one scope of six gathers (the forward's, then
    remat's re-gathers), each named by the parameter it gathers, issued one ahead beside the
    compute of the gather before it; the predicted pass is the model's, as issued; the table
    says so."""
    from libra_jax import planner
    from corpus import fsdp_remat
    case = fsdp_remat()
    # One call each (fusion=False): each gather beside the compute of the one before it.
    e = libra_jax.explain(case.step, case.state, *case.batch, prefetch=1, fusion=False,
                          file=None)
    g, = e.gathers
    assert [(r.tensor, r.kind, r.ahead) for r in g.rows] == (
        [(w, "forward", 1) for w in ("w1", "w2", "w3")]
        + [(w, "backward", 1) for w in ("w3", "w2", "w1")])
    assert [r.overlaps for r in g.rows] == [(), ("w1",), ("w2",), ("w3",), ("w3",), ("w2",)]
    assert g.distance == 1 and not g.why
    assert g.total_s == planner.simulate_gathers(list(g.steps), g.cost, distance=1,
                                                 blocks=list(g.blocks), lead_s=g.lead_s)
    assert g.one_call_s == g.plan.one_call_s and g.timeline().total_s == g.total_s
    text = " ".join(e.table(use_rich=False).split())  # (wrapped to the terminal's width)
    assert "6 all_gathers, issued 1 ahead" in text and "predicted pass:" in text
    assert "the model's choice" in text
    rich = pytest.importorskip("rich")
    assert rich and "beside the compute of" in e.table(use_rich=True, width=160)
    # The default on CPU: one call each, the model's choice and why it was not taken shown.
    e = libra_jax.explain(case.step, case.state, *case.batch, file=None)
    g, = e.gathers
    assert g.distance == 0 and len(g.rows) == 3 and all(r.ahead == 0 for r in g.rows)
    assert "measures as fast as issuing ahead or faster" in g.why
    # The forward's three are one call where the first is used (fusion, the default).
    assert g.groups == ((0, 2),) and {r.blocks for r in g.rows} == {g.rows[0].blocks}
    text = " ".join(e.table(use_rich=False).split())
    assert "3 all_gathers, where used in 1 call" in text
    assert "issued where used: on CPU" in text


# --- What a user reads: every gradient named, at any width (issue 71) -----------------------

def readme_pmean_step():
    """The README's first quickstart: psums after jax.grad, `libra_jax.pmean`."""
    mesh = mesh_of((8,), ("data",))

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    def train_step(params, batch):
        grads = libra_jax.pmean(jax.grad(loss_fn)(params, batch), "data")
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P("data")),
                                 out_specs=P(), check_vma=False))
    batch = (shard(np.linspace(-1, 1, 256, dtype=np.float32).reshape(64, 4), mesh, P("data")),
             shard(np.ones((64, 1), np.float32), mesh, P("data")))
    return step, ({"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}, batch), None


def readme_route_step(fsdp: bool):
    """The README's GSPMD (replicated parameters, SGD) and FSDP (rows split, Adam)
    quickstarts: the gradient by `libra_jax.value_and_grad`, the loss's pmean in the route."""
    optax = pytest.importorskip("optax")
    from jax.sharding import AxisType, NamedSharding
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8],
                         axis_types=(AxisType.Explicit,) if fsdp else None)
    rng = np.random.default_rng(0)
    tx = optax.adam(1e-3) if fsdp else optax.sgd(0.1)
    if fsdp:
        params = {"w1": shard(rng.standard_normal((16, 64), np.float32) / 4, mesh, P("data")),
                  "w2": shard(rng.standard_normal((64, 8), np.float32) / 8, mesh, P("data")),
                  "b": shard(np.zeros(8, np.float32), mesh, P())}
        x = shard(rng.standard_normal((64, 16), np.float32), mesh, P("data"))

        def loss_fn(params, x, y):
            h = jnp.tanh(x @ params["w1"])
            return jnp.mean((h @ params["w2"] + params["b"] - y) ** 2)
    else:
        params = {"w": shard(np.zeros((4, 1), np.float32), mesh, P()),
                  "b": shard(np.zeros(1, np.float32), mesh, P())}
        x = shard(rng.standard_normal((64, 4), np.float32), mesh, P("data"))

        def loss_fn(params, x, y):
            return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)
    y = shard(rng.standard_normal((64, 8 if fsdp else 1), np.float32), mesh, P("data"))

    def step(params, opt_state, x, y):
        loss, grads = libra_jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss
    del NamedSharding
    return jax.jit(step), (params, tx.init(params), x, y), mesh


def cookbook_ref_step():
    """JAX's Training Cookbook's layout: parameters in `jax.Ref`s, and Adam's moments in a
    tree of ``{"mu": ref, "nu": ref}`` per parameter (``opt.w.mu``)."""
    from jax.sharding import AxisType
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:8])
    rng = np.random.default_rng(5)
    with jax.set_mesh(mesh):
        params = {"linear_in": {"kernel": shard(rng.standard_normal((16, 32), np.float32),
                                                mesh, P())},
                  "linear_out": {"kernel": shard(rng.standard_normal((32, 8), np.float32),
                                                 mesh, P())}}
        state = {"params": jax.tree.map(jax.new_ref, params),
                 "opt": jax.tree.map(lambda p: {"mu": jax.new_ref(jnp.zeros_like(p)),
                                                "nu": jax.new_ref(jnp.zeros_like(p))}, params)}
    x = shard(rng.standard_normal((64, 16), np.float32), mesh, P("data"))
    y = shard(rng.standard_normal((64, 8), np.float32), mesh, P("data"))

    def step(state, x, y):
        def loss_fn(p, x, y):
            return jnp.mean((jnp.tanh(x @ p["linear_in"]["kernel"]) @ p["linear_out"]["kernel"]
                             - y) ** 2)
        loss, grads = libra_jax.value_and_grad(loss_fn)(
            jax.tree.map(lambda r: r[...], state["params"]), x, y)

        def adam(ref, moments, g):
            moments["mu"][...] = 0.9 * moments["mu"][...] + 0.1 * g
            moments["nu"][...] = 0.999 * moments["nu"][...] + 0.001 * g * g
            ref[...] = ref[...] - 1e-3 * moments["mu"][...] / (jnp.sqrt(moments["nu"][...]) + 1e-8)
        jax.tree.map(adam, state["params"], state["opt"], grads,
                     is_leaf=lambda t: isinstance(t, dict) and "mu" in t)
        return loss
    return step, (state, x, y), mesh


def example_step(name):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    sys.path.insert(0, str(EXAMPLES))
    import common
    step, args = common.load_example(EXAMPLES / f"{name}.py").build(True)
    return step, args, None


def parameter_names(params):
    """Each leaf's path, less the components all paths start with (``Block_0.Dense_0.kernel``,
    ``pos``)."""
    paths = [[str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    while len({p[0] for p in paths}) == 1 and all(len(p) > 1 for p in paths):
        paths = [p[1:] for p in paths]
    return {".".join(p) for p in paths}


CASES = {
    "readme-pmean": (readme_pmean_step, {"w", "b"}),
    "readme-gspmd": (lambda: readme_route_step(False), {"w", "b"}),
    "readme-fsdp": (lambda: readme_route_step(True), {"w1", "w2", "b"}),
    "cookbook-refs": (cookbook_ref_step, {"linear_in.kernel", "linear_out.kernel"}),
    "cnn": (lambda: example_step("cnn"), None),
    "transformer": (lambda: example_step("transformer"), None),
}


@pytest.mark.parametrize("columns", [60, 250])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_gradient_is_named_at_any_width(case, columns, monkeypatch):
    """`explain` hid names: ``+10 more`` alone where the first name was long (the
    transformer example), ``psum #14 [1], w`` (the bias unnamed), ``0.w`` for ``w``, a
    Cookbook gradient named after its Adam moment (``linear_out.kernel.mu``). Every gradient
    is named by its parameter's path, whole somewhere in the text (never cut or folded
    apart), in either rendering, at 60 columns and at 250; a loss's psum is not a gradient
    bucket; no predicted ratio (``+0.0%``); a "to try" line closes it."""
    monkeypatch.setenv("COLUMNS", str(columns))
    build, expected = CASES[case]
    step, args, mesh = build()
    if mesh is not None:
        with jax.set_mesh(mesh):
            e = libra_jax.explain(step, *args, file=None)
    else:
        e = libra_jax.explain(step, *args, file=None)
    got = {t for s in e.scopes for r in s.rows for t in r.tensors if "a loss or metric" not in t}
    if expected is None:  # an example's state: (params, opt_state), its parameters' paths
        expected = parameter_names(args[0][0])
    assert got == expected, (got, expected)
    renderings = [e.table(use_rich=False, width=columns)]
    try:
        import rich  # noqa: F401
        renderings.append(e.table(use_rich=True, width=columns))
    except ImportError:
        pass
    for text in renderings:
        words = set(re.findall(r"[\w.]+", text))
        assert expected <= words, expected - words
        lines = text.splitlines()
        assert all(len(line) <= columns or " " not in line.strip() for line in lines)
        assert "%" not in text and "+0.0" not in text
        last = max(k for k, line in enumerate(lines) if line.startswith("to try"))
        assert all(line.startswith("  ") for line in lines[last + 1:])  # (wrapped)
        assert "(a loss or metric?)" not in text
    if case.startswith("readme-") and case != "readme-pmean":
        # the route's loss pmean: said apart, not a bucket of the gradient table
        flat = " ".join(renderings[0].split())
        assert "1 psum of a loss or metric" in flat and "not a gradient" in flat


def test_identical_lines_merge_with_a_count():
    """A Linen step's loss and accuracy pmeans in the forward pass were two identical lines:
    one, with its count."""
    from libra_jax.explanation import _counted
    assert _counted(["  a", "  b", "  a"]) == ["  a (x2)", "  b"]
    mesh = mesh_of((8,), ("x",))
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((16, 4)).astype(np.float32)}

    def local(params, x, y):
        def loss(p):
            logits = x @ p["w"]
            return jnp.mean((logits - jax.nn.one_hot(y, 4)) ** 2), logits
        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        grads = jax.lax.psum(grads, "x")
        accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
        return (jax.tree.map(lambda p, g: p - 0.1 * g, params, grads),
                jax.lax.pmean(value, "x"), jax.lax.pmean(accuracy, "x"))
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x"), P("x")),
                                 out_specs=(P(), P(), P()), check_vma=False))
    x = shard(rng.standard_normal((32, 16)).astype(np.float32), mesh, P("x"))
    y = shard(rng.integers(0, 4, (32,)).astype(np.int32), mesh, P("x"))
    # (ready="written": each where the program has it; under "dataflow" both join the
    # gradient's bucket and are named in one line.)
    text = libra_jax.explain(step, params, x, y, ready="written",
                             file=None).table(use_rich=False)
    lines = [line for line in text.splitlines() if line.startswith("  ")]
    assert len(lines) == len(set(lines)), text
    assert any(line.endswith("(x2)") for line in lines), text
