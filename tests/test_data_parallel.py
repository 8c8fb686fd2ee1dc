"""`libra_jax.value_and_grad`: a GSPMD step's gradient, with all-reduces `optimize` plans.

Each test runs the same step written two ways on the same sharded inputs: as GSPMD code
(``jax.value_and_grad``: XLA's partitioner inserts the all-reduces) and through the route
(``libra_jax.value_and_grad``). They are two programs, so they agree within class 3's bound
(docs/bitwise.md: XLA's code generation differs per CPU), not bit for bit; the
optimized route is bitwise its XLA control. Then `optimize` must plan the route's all-reduces
as Libra calls, lowered for `cpu` and for `cuda`.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _ffi

from conftest import assert_bitwise, assert_codegen_close
from test_nccl import run, stub_env, stub_library  # noqa: F401  (the stub's fixtures)

pytestmark = pytest.mark.usefixtures("jax_8")

AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def make_mesh(shape=(8,), names=("data",), kind="auto"):
    n = int(np.prod(shape))
    devices = np.array(jax.devices("cpu")[:n]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(AXIS_TYPES[kind],) * len(shape))


def put(tree, mesh, spec):
    return jax.device_put(tree, NamedSharding(mesh, spec))


# --- The steps, each written for GSPMD; `grad_fn` is the only difference ----------------------

def mlp_loss(params, x, y):
    h = x
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    return jnp.mean((h @ w + b - y) ** 2)


def mlp_params(rng, sizes=(16, 32, 8)):
    return [(jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
             jnp.zeros((b,), jnp.float32)) for a, b in zip(sizes[:-1], sizes[1:])]


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = x.mean(axis=(1, 2))
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


def flax_loss(params, x, labels):
    logits = CNN().apply({"params": params}, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def optax_step(grad_fn, tx):
    """A Flax + optax train step with `grad_fn` in `jax.value_and_grad`'s place."""
    def step(params, opt_state, x, labels):
        (loss, metrics), grads = grad_fn(flax_loss, has_aux=True)(params, x, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics
    return step


def flax_state(mesh, batch, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 10, (batch,)).astype(np.int32)
    params = CNN().init(jax.random.key(seed), x[:1])["params"]
    tx = optax.adam(1e-3)
    return tx, put(params, mesh, P()), put(x, mesh, P("data")), put(labels, mesh, P("data"))


def route(fn, **kw):
    return libra_jax.value_and_grad(fn, axis_name="data", **kw)


def splitting_route(fn, **kw):
    """The route with the opt-in that splits a closed-over batch (`split_closed_over`)."""
    return route(fn, split_closed_over=True, **kw)


# --- Equal to the GSPMD step ------------------------------------------------------------------

def mesh_context(mesh):
    """`jax.set_mesh` for an explicit mesh (jax needs it to jit optax's init there)."""
    explicit = AxisType.Explicit in mesh.axis_types
    return jax.set_mesh(mesh) if explicit else contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("batch", [64, 128, 512])
def test_flax_value_grad_and_metric_match_gspmds(kind, batch):
    # GSPMD's step on the auto mesh (on an explicit one, jax 0.12 cannot shard optax's
    # cross-entropy); the route's on either.
    _, params, x, labels = flax_state(make_mesh(kind="auto"), batch)
    want = jax.jit(jax.value_and_grad(flax_loss, has_aux=True))(params, x, labels)
    _, params, x, labels = flax_state(make_mesh(kind=kind), batch)
    got = jax.jit(route(flax_loss, has_aux=True))(params, x, labels)
    assert_codegen_close(got, want)


def max_ulps(a, b) -> int:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    return int(np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))))


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_optax_step_under_jit_with_donation_matches_the_gspmd_step(kind):
    """The whole step, 3 Adam steps. Optimized, the route's step is bitwise its control (the
    same rewritten program with XLA's all-reduce: class 2). Against GSPMD's (class 3) the
    gradients agree within the bound (above), but Adam divides by the root of the second
    moment, so on a near-zero gradient a last-bit difference moves the parameter by hundreds
    of ulps (525 measured on an AVX2 CPU): the last loss is bounded, the parameters are checked
    for having moved as GSPMD's did (an Adam step moves one by about 1e5 ulp)."""
    tx = optax.adam(1e-3)
    outs = []
    for mesh, step in ((make_mesh(), optax_step(jax.value_and_grad, tx)),  # as above
                       (make_mesh(kind=kind), optax_step(route, tx)),
                       (make_mesh(kind=kind), libra_jax.optimize(optax_step(route, tx))),
                       (make_mesh(kind=kind), libra_jax.optimize(optax_step(route, tx),
                                                                 collectives="xla"))):
        _, params, x, labels = flax_state(mesh, 128)
        with mesh_context(mesh):
            opt_state = jax.jit(tx.init)(params)
            p, s = jax.tree.map(jnp.copy, (params, opt_state))  # donated below
            run = jax.jit(step, donate_argnums=(0, 1))
            for _ in range(3):
                p, s, loss, metrics = run(p, s, x, labels)
        outs.append((p, s, loss, metrics))
    gspmd, routed, optimized, control = outs
    jax.tree.map(assert_bitwise, optimized, control)
    for got in (gspmd, routed, optimized):
        assert_codegen_close(got[2], gspmd[2])  # the last step's loss
        moved = jax.tree.leaves(jax.tree.map(max_ulps, got[0], params))
        assert min(moved) > 1000, moved


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_plain_value_and_grad_with_argnums_matches_gspmd(kind):
    mesh = make_mesh(kind=kind)
    rng = np.random.default_rng(1)
    params = put(mlp_params(rng), mesh, P())
    x = put(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("data"))
    y = put(rng.standard_normal((64, 8)).astype(np.float32), mesh, P("data"))
    want = jax.jit(jax.value_and_grad(mlp_loss))(params, x, y)
    jitted = jax.jit(route(mlp_loss))(params, x, y)
    assert_codegen_close(jitted, want)
    # Called without jit: the route compiles its own program (the same one: bitwise), also
    # with a keyword argument (passed whole to every shard) that cannot key its cache.
    jax.tree.map(assert_bitwise, route(mlp_loss)(params, x, y), jitted)
    scaled_loss = route(lambda p, x, y, *, scale: scale * mlp_loss(p, x, y))
    for scale in (1.0, 2.0):
        value, _ = scaled_loss(params, x, y, scale=np.float32(scale) * np.ones(()))
        np.testing.assert_allclose(value, scale * want[0], rtol=1e-6)
    # Two differentiated arguments (argnums), and grad's form of result.
    def scaled(params, scale, x, y):
        return scale * mlp_loss(params, x, y)
    scale = put(jnp.float32(0.5), mesh, P())
    want = jax.jit(jax.grad(scaled, argnums=(0, 1)))(params, scale, x, y)
    got = jax.jit(libra_jax.grad(scaled, argnums=(0, 1)))(params, scale, x, y)
    assert_codegen_close(got, want)


def test_two_dimensional_mesh_with_replicated_parameters():
    """On a data x model mesh, the route maps every axis (XLA's all-reduce would otherwise be
    the fallback of a partly manual shard_map), bitwise its XLA control and within the bound
    of GSPMD's."""
    mesh = make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(2)
    params = put(mlp_params(rng), mesh, P())
    x = put(rng.standard_normal((32, 16)).astype(np.float32), mesh, P("data"))
    y = put(rng.standard_normal((32, 8)).astype(np.float32), mesh, P("data"))
    want = jax.jit(jax.value_and_grad(mlp_loss))(params, x, y)
    opt = libra_jax.optimize(route(mlp_loss))
    got = jax.jit(opt)(params, x, y)
    assert_codegen_close(got, want)
    control = libra_jax.optimize(route(mlp_loss), collectives="xla")
    jax.tree.map(assert_bitwise, got, jax.jit(control)(params, x, y))
    gradient = [p for p in opt.last_report.plans if p.kind == "gradient"]
    assert gradient and all(p.axes == ("data",) for p in gradient), opt.last_report.plan_lines()
    text = jax.jit(opt).lower(params, x, y).as_text()
    assert "libra_allreduce" in text and "all_reduce" not in text


def test_the_mesh_comes_from_set_mesh_or_the_inputs():
    mesh = make_mesh(kind="explicit")
    rng = np.random.default_rng(3)
    params = put(mlp_params(rng), mesh, P())
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = rng.standard_normal((64, 8)).astype(np.float32)
    want = jax.jit(jax.value_and_grad(mlp_loss))(params, put(x, mesh, P("data")),
                                                 put(y, mesh, P("data")))
    # Numpy batches traced under jax.set_mesh show the layout P() (replicated): they enter
    # whole, as GSPMD reads them (every shard computes the loss of all of it), and the
    # values are GSPMD's; split, eagerly, where no layout shows.
    with jax.set_mesh(mesh):
        got = jax.jit(route(mlp_loss))(jax.tree.map(np.asarray, params), x, y)
    assert_codegen_close(got, want)
    assert_codegen_close(route(mlp_loss, mesh=mesh)(params, x, y), want)
    # A batch placed replicated beside one split over "data" is not split by guess: the loss
    # fails on the shard's inputs, and the route says which entered how.
    with pytest.raises(ValueError, match=r"the loss failed on one shard's inputs .*split over "
                                         r"\['data'\]: argument 2 float32\[64, 8\]; whole on every "
                                         r"shard .*: argument 1 float32\[64, 16\]"):
        jax.jit(route(mlp_loss))(params, put(x, mesh, P()), put(y, mesh, P("data")))


# --- optimize plans the route ----------------------------------------------------------------

def test_optimize_plans_the_routes_all_reduces_on_cpu():
    mesh = make_mesh()
    tx, params, x, labels = flax_state(mesh, 64)
    opt_state = jax.jit(tx.init)(params)
    step = optax_step(route, tx)
    want = jax.jit(step)(params, opt_state, x, labels)
    opt = libra_jax.optimize(step)
    got = jax.jit(opt, donate_argnums=(0, 1))(*jax.tree.map(jnp.copy, (params, opt_state)),
                                            x, labels)
    control = jax.jit(libra_jax.optimize(step, collectives="xla"))(params, opt_state, x, labels)
    jax.tree.map(assert_bitwise, got, control)
    assert_codegen_close(got[1:], want[1:])  # optimizer state (linear in g, g*g), loss, metrics
    moved = jax.tree.leaves(jax.tree.map(max_ulps, got[0], params))
    assert min(moved) > 1000, moved
    report = opt.last_report
    gradient = [p for p in report.plans if p.kind == "gradient"]
    n_params = len(jax.tree.leaves(params))
    assert sum(len(p.members) for p in gradient) >= n_params, report.plan_lines()
    assert not report.notes
    text = jax.jit(opt).lower(params, opt_state, x, labels).as_text()
    assert "all_reduce" not in text and "libra_allreduce" in text


@pytest.mark.parametrize("mode", ["sync", "start-done"])
def test_route_lowers_for_cuda_to_libra_calls_on_the_p2p_path(monkeypatch, mode):
    if not _ffi.HAS_CUDA:
        pytest.skip("built without CUDA: the cuda lowering falls back to XLA's all-reduce")
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")
    mesh = make_mesh()
    rng = np.random.default_rng(4)
    params = put(mlp_params(rng), mesh, P())
    x = put(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("data"))
    y = put(rng.standard_normal((64, 8)).astype(np.float32), mesh, P("data"))
    opt = libra_jax.optimize(route(mlp_loss), profile="h100", overlap=mode)
    text = jax.jit(opt).trace(params, x, y).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(libra_allreduce_\w+)", text)
    gradient = [p for p in opt.last_report.plans if p.kind == "gradient"]
    assert gradient and calls, opt.last_report.plan_lines()
    assert "all_reduce" not in text
    if mode == "start-done":
        assert "libra_allreduce_cuda_start" in calls or any("start" in c for c in calls), calls


# The NCCL path, against the stub of libnccl (tests/test_nccl.py): in a process of its own.
NCCL_ROUTE = """
    import re, sys
    import jax, numpy as np
    jax.config.update("jax_num_cpu_devices", 8)
    from jax.sharding import NamedSharding, PartitionSpec as P
    import libra_jax
    sys.path.insert(0, sys.argv[1])
    from test_data_parallel import make_mesh, mlp_loss, mlp_params
    mesh = make_mesh()
    put = lambda t, s: jax.device_put(t, NamedSharding(mesh, s))
    rng = np.random.default_rng(4)
    args = (put(mlp_params(rng), P()), put(rng.standard_normal((64, 16)).astype(np.float32), P("data")),
            put(rng.standard_normal((64, 8)).astype(np.float32), P("data")))
    opt = libra_jax.optimize(libra_jax.value_and_grad(mlp_loss), profile="h100")
    with jax.set_mesh(mesh):  # a concrete mesh: NCCL's communicators need its devices
        text = jax.jit(opt).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    print("CALLS", sorted(set(re.findall(r"custom_call @(libra_allreduce_\\w+)", text))))
    print("XLA", "all_reduce" in text)
    print("GRADIENT", sorted({p.overlap for p in opt.last_report.plans if p.kind == "gradient"}))
"""


def test_route_lowers_for_cuda_to_nccl_calls_on_the_nccl_path(stub_env):
    if not _ffi.HAS_CUDA:
        pytest.skip("built without CUDA: the cuda lowering falls back to XLA's all-reduce")
    stub_env["LIBRA_JAX_CUDA"] = "nccl"
    out = run(NCCL_ROUTE, stub_env, str(Path(__file__).parent))
    assert "CALLS ['libra_allreduce_cuda_done', 'libra_allreduce_nccl_start']" in out, out
    assert "XLA False" in out and "GRADIENT ['start-done']" in out, out


# --- What it refuses, clearly ----------------------------------------------------------------

def fsdp_problem(mesh, seed=5):
    """An MLP 16 -> 32 -> 8 whose weights are sharded over ``data`` (FSDP: the first along its
    rows, the second along its columns) beside replicated biases, and a regression batch."""
    rng = np.random.default_rng(seed)
    (w1, b1), (w2, b2) = mlp_params(rng, (16, 32, 8))
    specs = [(P("data"), P()), (P(None, "data"), P())]
    params = [(put(w1, mesh, specs[0][0]), put(b1, mesh, P())),
              (put(w2, mesh, specs[1][0]), put(b2, mesh, P()))]
    x = put(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("data"))
    y = put(rng.standard_normal((64, 8)).astype(np.float32), mesh, P("data"))
    return params, specs, x, y


@pytest.mark.parametrize("visible", ["in_specs", "explicit", "eager"])
@pytest.mark.parametrize("shape", [(8,), (4, 2)], ids=["1-D", "data x model"])
def test_parameters_sharded_over_data_are_gathered_and_reduce_scattered(shape, visible):
    """FSDP through the route: weights sharded over ``data`` enter as shards, are gathered for
    the loss and leave as reduce-scatters, on a 1-D mesh and on a data x model mesh; their
    sharding seen by in_specs (an auto mesh under jax.jit), on an explicit mesh's traced
    values, or on concrete arrays (the route called eagerly). Value and gradients within
    class 3's bound of GSPMD's, the gradients laid out as their parameters; under `optimize`
    (traced: in_specs or an explicit mesh), bitwise its control, and every gather and
    reduce-scatter a Libra call."""
    names = ("data", "model")[:len(shape)]
    params, specs, x, y = fsdp_problem(make_mesh(shape, names))
    want = jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(mlp_loss))(params, x, y))
    mesh = make_mesh(shape, names, "explicit" if visible == "explicit" else "auto")
    params, specs, x, y = fsdp_problem(mesh)
    step = route(mlp_loss, **({"in_specs": (specs, P("data"), P("data"))}
                              if visible == "in_specs" else {}))
    with mesh_context(mesh):
        got = step(params, x, y) if visible == "eager" else jax.jit(step)(params, x, y)
    assert_codegen_close(jax.tree.map(np.asarray, got), want)
    for g, p in zip(jax.tree.leaves(got[1]), jax.tree.leaves(params)):
        assert g.sharding.is_equivalent_to(p.sharding, p.ndim), (g.sharding, p.sharding)
    if visible == "eager":
        return
    with mesh_context(mesh):
        opt = libra_jax.optimize(step)
        optimized = jax.jit(opt)(params, x, y)
        control = jax.jit(libra_jax.optimize(step, collectives="xla"))(params, x, y)
        text = jax.jit(opt).lower(params, x, y).as_text()
    assert_codegen_close(jax.tree.map(np.asarray, optimized), want)
    jax.tree.map(assert_bitwise, optimized, control)
    plans = [(p.collective, p.kind, len(p.members)) for p in opt.last_report.plans]
    # The two forward gathers are one call over both (`gathers.prefetch_gathers`' groups).
    assert plans.count(("all-gather", "forward", 2)) == 1, opt.last_report.plan_lines()
    # The two weights' reduce-scatters (one along dimension 1) are one call over both.
    assert [p for p in plans if p[:2] == ("reduce-scatter", "gradient")] == [
        ("reduce-scatter", "gradient", 2)], opt.last_report.plan_lines()
    assert text.count("@libra_all_gather_cpu(") == 1 and "@libra_reduce_scatter_cpu(" in text
    for xla in ("stablehlo.all_gather", "stablehlo.reduce_scatter", "all_reduce"):
        assert xla not in text, xla


def test_reduce_scatters_of_a_scanned_microbatch_accumulation_are_planned():
    """Microbatches summed in a `lax.scan` of the jitted sharded step, each one's gradient
    through the route: the reduce-scatters in the body are the body's gradients (the route's
    shard_map that autodiff's transpose made is all backward pass), planned as one bucket
    each iteration, and the loop's plan says so. Before, they were kind ``loop``, unplanned,
    and the report had no loop plan. Bitwise the XLA control, class 3 of GSPMD's step."""
    mesh = make_mesh()
    params, specs, x, y = fsdp_problem(mesh)
    xs = put(np.asarray(x).reshape(4, 16, 16), mesh, P(None, "data"))
    ys = put(np.asarray(y).reshape(4, 16, 8), mesh, P(None, "data"))

    def accumulate(value_and_grad):
        def step(params, xs, ys):
            def micro(acc, batch):
                loss, grads = value_and_grad(mlp_loss)(params, *batch)
                return jax.tree.map(jnp.add, acc, grads), loss
            acc, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), (xs, ys))
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, acc), losses
        return step
    step = accumulate(lambda f: route(f, in_specs=(specs, P("data"), P("data"))))
    with mesh_context(mesh):
        opt = libra_jax.optimize(step)
        got = jax.jit(opt)(params, xs, ys)
        control = jax.jit(libra_jax.optimize(step, collectives="xla"))(params, xs, ys)
        want = jax.jit(accumulate(jax.value_and_grad))(params, xs, ys)
    jax.tree.map(assert_bitwise, got, control)
    assert_codegen_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))
    report = opt.last_report
    # Both weights' reduce-scatters (one scattered along dimension 1) in one call.
    scatters = [p for p in report.plans if p.collective == "reduce-scatter"]
    assert [(p.kind, len(p.members)) for p in scatters] == [("gradient", 2)], scatters
    gradient = [p for p in report.plans if p.kind == "gradient"]
    loop, = report.loops
    assert (loop.gradient, loop.calls, loop.length) == (
        sum(len(p.members) for p in gradient), len(gradient), 4), (loop, report.plan_lines())


def closing_step(value_and_grad, seen, form="closure"):
    """A step whose loss closes over the batch and a frozen weight, as JAX's Training Cookbook
    writes it (``def loss_fn(params): ... batch ...`` inside the jitted step); `seen` gets the
    batch's shape the loss reads. ``form="partial"``: the batch as a `functools.partial`
    keyword instead."""
    import functools

    def step(params, frozen, batch):
        def loss_fn(params, batch=None):
            batch = batch if form == "partial" else batch_of_step
            seen.append(batch["x"].shape)
            h = jnp.tanh(batch["x"] @ params["w"] + frozen)
            return jnp.mean((h @ params["v"] - batch["y"]) ** 2)
        batch_of_step = batch
        fn = functools.partial(loss_fn, batch=batch) if form == "partial" else loss_fn
        loss, grads = value_and_grad(fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
    return step


def closing_problem(mesh):
    rng = np.random.default_rng(21)
    params = put({"w": rng.standard_normal((16, 32)).astype(np.float32) / 4,
                  "v": rng.standard_normal((32, 8)).astype(np.float32) / 6}, mesh, P())
    frozen = put(rng.standard_normal((32,)).astype(np.float32), mesh, P())
    batch = put({"x": rng.standard_normal((64, 16)).astype(np.float32),
                 "y": rng.standard_normal((64, 8)).astype(np.float32)}, mesh, P("data"))
    return params, frozen, batch


@pytest.mark.parametrize("kind, form, jitted", [
    ("explicit", "closure", True), ("explicit", "partial", True), ("auto", "closure", False)])
def test_a_loss_closing_over_the_batch_is_split_over_it(kind, form, jitted):
    """Opted in (``split_closed_over=True``), the batch the loss closes over (its cell, or a
    partial's keyword) is an input of the route's shard_map, split as a batch argument is:
    each shard's loss reads its (8, 16) rows, where its layout shows (an explicit mesh's
    traced value; a concrete array's). (Issue 69: without the opt-in it enters whole.)
    Before: on an explicit mesh JAX refused it from inside the route ("Closing over inputs to
    shard_map"), and a concrete one was read whole by every shard. The frozen weight it also
    closes over enters whole. Class 3 of GSPMD's step, bitwise the optimized XLA control."""
    mesh = make_mesh(kind=kind)
    params, frozen, batch = closing_problem(mesh)
    seen: list = []
    step = closing_step(splitting_route, seen, form)
    compile_ = jax.jit if jitted else (lambda f: f)
    with mesh_context(mesh):
        got = compile_(step)(params, frozen, batch)
        assert set(seen) == {(8, 16)}, seen
        want = jax.jit(closing_step(jax.value_and_grad, [], form))(params, frozen, batch)
        assert_codegen_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))
        if not jitted:
            return  # (under jit an auto mesh's traced batch shows no layout: the next test)
        opt = libra_jax.optimize(step)
        optimized = jax.jit(opt)(params, frozen, batch)
        control = jax.jit(libra_jax.optimize(step, collectives="xla"))(params, frozen, batch)
    assert set(seen) == {(8, 16)}, seen
    jax.tree.map(assert_bitwise, optimized, control)
    assert [p.kind for p in opt.last_report.plans if p.kind == "gradient"]


def test_a_batch_closed_over_on_an_auto_mesh_under_jit_is_said():
    """Traced on an auto mesh, a closed-over array's layout does not show: it stays closed
    over (every shard reads all of it, and the values are right), and where no input of the
    loss is split the route says so once, naming the array and the ways out."""
    mesh = make_mesh(kind="auto")
    params, frozen, batch = closing_problem(mesh)
    seen: list = []
    with pytest.warns(UserWarning, match=r"closes over float32\[64, 16\], float32\[64, 8\], "
                                         r"float32\[32\] traced on an auto-sharding mesh.*"
                                         r"closed-over-batch"):
        jax.jit(closing_step(route, seen))(params, frozen, batch)
    assert set(seen) == {(64, 16)}


def test_a_value_closed_over_out_of_reach_is_refused_in_one_line():
    """On an explicit mesh a traced array read from a function the loss calls (not its own
    closure) cannot enter the route's shard_map: JAX's NotImplementedError becomes one line
    naming the array and the way out."""
    mesh = make_mesh(kind="explicit")
    params, frozen, batch = closing_problem(mesh)

    def step(params, batch):
        def features():
            return batch["x"]

        def loss_fn(params):
            return jnp.mean((features() @ params["w"]) ** 2)
        return route(loss_fn)(params)
    refusal = (r"reads an array of an explicit-sharding mesh \(f32\[64@data,16\]\) that is "
               r"neither.*pass it to the loss as an argument")
    with mesh_context(mesh), pytest.raises(ValueError, match=refusal):
        jax.jit(step)(params, batch)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_batch_axes_of_one_device_are_dropped_from_every_collective(kind):
    """MaxText splits the batch over ('data', 'fsdp', 'sequence', ...), every axis but
    ``fsdp`` of one device on one slice, and names them all as the batch's axes. An axis of
    one device moves no data: the route leaves it out of every collective it makes, so the
    plan is the one of ``axis_name="fsdp"`` (the sharded weights' gathers and gradient
    reduce-scatters each one call, the loss's pmean, nothing over the size-1 axes, no reduce-scatter
    planned as forward work) and the values are bitwise that route's. Before, the route
    gathered over the size-1 axes too and left reduce-scatters of kind forward."""
    mesh = make_mesh((1, 8, 1), ("data", "fsdp", "sequence"), kind)
    rng = np.random.default_rng(5)
    (w1, b1), (w2, b2) = mlp_params(rng, (16, 32, 8))
    batch_axes = ("data", "fsdp", "sequence")
    params = [(put(w1, mesh, P(batch_axes)), put(b1, mesh, P())),
              (put(w2, mesh, P(None, "fsdp")), put(b2, mesh, P()))]
    x = put(rng.standard_normal((64, 16)).astype(np.float32), mesh, P(batch_axes))
    y = put(rng.standard_normal((64, 8)).astype(np.float32), mesh, P(batch_axes))
    # On an auto mesh a traced value shows no sharding: the layout is given by in_specs.
    specs = {} if kind == "explicit" else {"in_specs": (
        [(P(batch_axes), P()), (P(None, "fsdp"), P())], P(batch_axes), P(batch_axes))}
    with mesh_context(mesh):
        opt = libra_jax.optimize(libra_jax.value_and_grad(mlp_loss, axis_name=batch_axes,
                                                          **specs))
        got = jax.jit(opt)(params, x, y)
        one = libra_jax.optimize(libra_jax.value_and_grad(mlp_loss, axis_name="fsdp", **specs))
        want = jax.jit(one)(params, x, y)
    jax.tree.map(assert_bitwise, got, want)
    plans = [(p.collective, p.kind, p.axes) for p in opt.last_report.plans]
    assert sorted(plans) == sorted((p.collective, p.kind, p.axes)
                                   for p in one.last_report.plans), plans
    gathers = [p for p in opt.last_report.plans if p.collective.kind == "all-gather"]
    assert [(p.kind, p.axes, len(p.members)) for p in gathers] == [  # one call over both
        ("forward", ("fsdp",), 2)], plans
    scatters = [p for p in opt.last_report.plans if p.collective.kind == "reduce-scatter"]
    assert [(p.kind, p.axes, len(p.members)) for p in scatters] == [  # one call over both
        ("gradient", ("fsdp",), 2)], plans
    assert all(p[2] == ("fsdp",) for p in plans), plans


def test_sharding_under_jit_on_an_auto_mesh_is_not_seen_without_in_specs():
    """Under `jax.jit` on an auto mesh a traced value carries no sharding: the route takes
    the parameters as replicated (XLA gathers them before its shard_map), as documented;
    the gradients are still right, and replicated."""
    mesh = make_mesh()
    params, _, x, y = fsdp_problem(mesh)
    want = jax.jit(jax.value_and_grad(mlp_loss))(params, x, y)
    opt = libra_jax.optimize(route(mlp_loss))
    got = jax.jit(opt)(params, x, y)
    assert_codegen_close(got, want)
    assert all(g.sharding.is_fully_replicated for g in jax.tree.leaves(got[1]))
    assert {p.collective for p in opt.last_report.plans} == {"all-reduce"}


def test_sharding_the_route_cannot_serve_is_refused_by_leaf_and_axis():
    mesh = make_mesh((4, 2), ("data", "model"))
    params, specs, x, y = fsdp_problem(mesh)
    tensor_parallel = [(put(np.asarray(params[0][0]), mesh, P(None, "model")), params[0][1]),
                       params[1]]
    # Over an axis the batch is not split over (tensor parallelism): concrete, by in_specs,
    # and on an explicit mesh's traced values.
    with pytest.raises(ValueError, match=r"argument 0\[0\]\[0\] is sharded over 'model' .*"
                                         r"an axis the batch is not split over"):
        route(mlp_loss)(tensor_parallel, x, y)
    with pytest.raises(ValueError, match=r"argument 0\[1\]\[0\] is sharded over 'model'"):
        jax.jit(route(mlp_loss, in_specs=([(P("data"), P()), (P("model"), P())], P("data"),
                                          P("data"))))(params, x, y)
    explicit = make_mesh((4, 2), ("data", "model"), "explicit")
    on_explicit = [(put(np.asarray(params[0][0]), explicit, P(None, "model")),
                    put(np.asarray(params[0][1]), explicit, P()))]
    with jax.set_mesh(explicit), pytest.raises(ValueError,
                                               match=r"0\]\[0\] is sharded over 'model'"):
        jax.jit(route(mlp_loss))(on_explicit, put(np.asarray(x), explicit, P("data")),
                                 put(np.asarray(y), explicit, P("data")))
    # Uneven: a dimension that does not divide by the axis's devices.
    uneven = [(jnp.zeros((16, 10)), jnp.zeros(10)), (jnp.zeros((10, 8)), jnp.zeros(8))]
    with pytest.raises(ValueError, match=r"argument 0\[1\]\[0\] has dimension 0 of size 10, "
                                         r"which does not split evenly over the 4 devices of "
                                         r"'data'"):
        jax.jit(route(mlp_loss, in_specs=([(P(), P()), (P("data"), P())], P("data"),
                                          P("data"))))(uneven, x, y)
    with pytest.raises(ValueError, match=r"sharded over 'batch' .*not an axis of the mesh"):
        jax.jit(route(mlp_loss, in_specs=(P("batch"), P("data"), P("data"))))(params, x, y)
    with pytest.raises(ValueError, match=r"of shape \(32,\) is laid out by"):
        jax.jit(route(mlp_loss, in_specs=(P(None, "data"), P("data"), P("data"))))(params, x, y)


def mlp_batch(seed: int) -> tuple:
    """The MLP's parameters (replicated) and a batch of 64 rows split over an 8-device mesh."""
    mesh = make_mesh()
    rng = np.random.default_rng(seed)
    params = put(mlp_params(rng), mesh, P())
    x = put(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("data"))
    y = put(rng.standard_normal((64, 8)).astype(np.float32), mesh, P("data"))
    return params, x, y


def test_bad_calls_say_what_is_wrong():
    params, x, y = mlp_batch(6)
    with pytest.raises(ValueError, match="'batch' is not an axis of the mesh"):
        libra_jax.value_and_grad(mlp_loss, axis_name="batch")(params, x, y)
    with pytest.raises(ValueError, match=r"argument 1 has leading dimension 60, which does not "
                                         r"split over the 8 shards"):
        jax.jit(route(mlp_loss))(params, np.zeros((60, 16), np.float32),
                                 np.zeros((60, 8), np.float32))
    with pytest.raises(ValueError, match="no mesh"):
        route(mlp_loss)(jax.tree.map(np.asarray, params), np.asarray(x), np.asarray(y))
    with pytest.raises(TypeError, match="loss must be a float scalar"):
        jax.jit(route(lambda p, x, y: (x @ p[0][0])))(params, x, y)
    with pytest.raises(TypeError, match="argnums must be an int or a sequence of ints"):
        libra_jax.value_and_grad(mlp_loss, argnums="0")
    with pytest.raises(TypeError, match=r"argnums 3 but only 3 positional"):
        libra_jax.value_and_grad(mlp_loss, argnums=3)(params, x, y)
    with pytest.raises(ValueError, match="in_specs has 2 entries for 3"):
        route(mlp_loss, in_specs=(P(), P("data")))(params, x, y)

    def counts(p, x, y):
        return mlp_loss(p, x, y), {"n": jnp.sum(x[:, 0] > 0).astype(jnp.int32)}
    with pytest.raises(TypeError, match=r"aux\['n'\] is a int32 that differs from shard"):
        jax.jit(route(counts, has_aux=True))(params, x, y)


def test_aux_reduce_mean_of_an_integer_count_is_pmeans_float():
    """``aux_reduce="mean"`` averages an integer aux leaf as `jax.lax.pmean` does: int32
    counts summing to 37 over the 8 shards are float32 4.625 (the docstring said integer
    division, 4); ``"sum"`` keeps the count's int32, 37."""
    params, x, y = mlp_batch(9)
    mesh = make_mesh()
    flags = np.zeros(64, np.int32)
    flags[np.random.default_rng(9).permutation(64)[:37]] = 1
    flags = put(flags, mesh, P("data"))
    per_shard = flags.reshape(8, 8).sum(axis=1)
    assert int(per_shard.sum()) == 37 and len(set(per_shard.tolist())) > 1

    def counted(p, x, y, flags):
        return mlp_loss(p, x, y), {"n": jnp.sum(flags)}
    (_, mean), _ = jax.jit(route(counted, has_aux=True, aux_reduce="mean"))(params, x, y, flags)
    (_, total), _ = jax.jit(route(counted, has_aux=True, aux_reduce="sum"))(params, x, y, flags)
    pmean = jax.jit(jax.shard_map(lambda f: jax.lax.pmean(jnp.sum(f), "data"), mesh=mesh,
                                  in_specs=P("data"), out_specs=P()))(flags)
    assert mean["n"].dtype == pmean.dtype == jnp.float32 and mean["n"].shape == ()
    assert float(mean["n"]) == float(pmean) == 4.625
    assert total["n"].dtype == jnp.int32 and int(total["n"]) == 37
    # The docstring states this value (its example is the one pinned here) and no division.
    doc = " ".join(libra_jax.value_and_grad.__doc__.split())
    assert "float32 4.625" in doc and "integer division for integers" not in doc


def test_arguments_as_jax_value_and_grad_takes_them():
    # argnums as NumPy's integer or counted from the end, as JAX takes them: the same
    # gradients as argnums=0.
    params, x, y = mlp_batch(7)
    want = jax.jit(route(mlp_loss))(params, x, y)
    for argnums in (np.int64(0), -3, (np.int32(0),)):
        got = jax.jit(route(mlp_loss, argnums=argnums))(params, x, y)
        assert_bitwise(got if not isinstance(argnums, tuple) else (got[0], got[1][0]), want)
    last = jax.jit(route(lambda y, x, p: mlp_loss(p, x, y), argnums=-1))(y, x, params)
    assert_bitwise(last, want)


def test_bad_arguments_are_named_before_jax_sees_them():
    params, x, y = mlp_batch(8)
    with pytest.raises(TypeError, match="axis_name must be a mesh axis name.*got None"):
        libra_jax.value_and_grad(mlp_loss, axis_name=None)
    with pytest.raises(TypeError, match=r"has_aux=True the loss function must return a pair "
                                        r"\(loss, aux\).*got float32\[\]"):
        jax.jit(route(mlp_loss, has_aux=True))(params, x, y)
    with pytest.raises(TypeError, match=r"returned a tuple of 2; if it is \(loss, aux\), pass "
                                        r"has_aux=True"):
        jax.jit(route(lambda p, x, y: (mlp_loss(p, x, y), {"n": 1.0})))(params, x, y)
    with pytest.raises(TypeError, match=r"in_specs\[1\] must be a PartitionSpec .*got 'data'; "
                                        r"write P\('data'\)"):
        route(mlp_loss, in_specs=(P(), "data", P("data")))(params, x, y)
    with pytest.raises(ValueError, match=r"in_specs\[0\] is not a pytree prefix of positional "
                                         r"argument 0"):
        route(mlp_loss, in_specs=([(P(), P())], P("data"), P("data")))(params, x, y)


def test_every_integer_option_of_optimize_takes_numpy_integers():
    from libra_jax import config
    assert config.prefetch_mode(np.int64(1)) == 1
    assert config.prefetch_bytes(np.int64(1 << 20)) == 1 << 20
    with pytest.raises(ValueError, match="prefetch must be"):
        config.prefetch_mode(np.True_)
    with pytest.raises(ValueError, match="prefetch_bytes must be"):
        config.prefetch_bytes(True)
    with pytest.warns(UserWarning, match="nothing to plan"):
        libra_jax.optimize(lambda x: x, prefetch=np.int64(1), prefetch_bytes=np.int64(1 << 20),
                           blocks=np.int64(3))(np.ones(2))


# --- Today's sharding code: size-1 axes, explicit-sharding calls, NNX models -----------------

@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_parameters_laid_out_over_size_one_axes_are_replicated(kind):
    """An (8, 1) ``data x model`` mesh with kernels partitioned over ``model`` (as Flax's NNX
    tutorials lay them out): one device per model shard is replication, taken under jax.jit
    (traced values carry the spec on an explicit mesh) and by in_specs. The gradients are
    laid out as their parameters, as jax.grad's are."""
    mesh = make_mesh((8, 1), ("data", "model"), kind)
    rng = np.random.default_rng(9)
    params = [(put(w, mesh, P(None, "model")), put(b, mesh, P("model")))
              for w, b in mlp_params(rng)]
    x = put(rng.standard_normal((32, 16)).astype(np.float32), mesh, P("data"))
    y = put(rng.standard_normal((32, 8)).astype(np.float32), mesh, P("data"))
    with mesh_context(mesh):
        want = jax.jit(jax.value_and_grad(mlp_loss))(params, x, y)
        opt = libra_jax.optimize(route(mlp_loss))
        got = jax.jit(opt)(params, x, y)
        control = jax.jit(libra_jax.optimize(route(mlp_loss), collectives="xla"))(params, x, y)
        specs = route(mlp_loss, in_specs=(P("model"), P("data"), P("data")))
        by_specs = jax.jit(specs)(params, x, y)
    assert_codegen_close(got, want)
    jax.tree.map(assert_bitwise, got, control)
    assert_codegen_close(by_specs, want)
    assert [p.kind for p in opt.last_report.plans].count("gradient") >= 1
    if kind == "explicit":
        assert ([g.sharding.spec for g in jax.tree.leaves(got[1])]
                == [p.sharding.spec for p in jax.tree.leaves(params)])
    with pytest.raises(ValueError, match="is sharded"):  # a model axis of 2 is still refused
        two = make_mesh((4, 2), ("data", "model"), kind)
        route(mlp_loss)(put(jax.tree.map(np.asarray, params), two, P("model")),
                        put(np.asarray(x), two, P("data")), put(np.asarray(y), two, P("data")))


def _embed_lookup(x, w):
    from flax import nnx
    embed = nnx.Embed(4, 16, rngs=nnx.Rngs(0))
    return embed((x[:, 0] > 0).astype(jnp.int32), out_sharding=P("data")) @ w


def _logical_constraint(x, w, mesh):
    """MaxText's form: Flax's `with_logical_constraint` under logical axis rules."""
    import flax.linen as fnn
    with fnn.logical_axis_rules([("batch", "data"), ("embed", None)]):
        return fnn.with_logical_constraint(x @ w, ("batch", "embed"), mesh=mesh)


#: Calls in a loss that lay arrays out over mesh axes, which the route serves by leaving the
#: layout out while it traces the loss (each changes no value).
SERVED_LAYOUT_CALLS = {
    "with_sharding_constraint": lambda x, w, mesh: jax.lax.with_sharding_constraint(
        x @ w, P("data")),
    "reshard": lambda x, w, mesh: jax.sharding.reshard(x, P("data")) @ w,
    "auto_axes": lambda x, w, mesh: jax.sharding.auto_axes(lambda a, b: a @ b,
                                                           out_sharding=P("data"))(x, w),
    "nnx.Embed(out_sharding=)": lambda x, w, mesh: _embed_lookup(x, w),
    "flax with_logical_constraint": _logical_constraint,
    "in a custom_vjp's backward rule": lambda x, w, mesh: _tanh_constrained_backward(x @ w),
}


@jax.custom_vjp
def _tanh_constrained_backward(x):
    """tanh whose backward rule lays its cotangent out over ``data`` (traced while autodiff
    transposes the loss, after the loss's own trace)."""
    return jnp.tanh(x)


_tanh_constrained_backward.defvjp(
    lambda x: (jnp.tanh(x), x),
    lambda x, g: (jax.lax.with_sharding_constraint(g * (1 - jnp.tanh(x) ** 2), P("data")),))


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("call", list(SERVED_LAYOUT_CALLS))
def test_layout_calls_in_the_loss_are_left_out_of_the_routes_trace(call, kind):
    """JAX refuses them where every axis is manual (the route's shard_map), and they change no
    value: the route leaves their layout out while it traces the loss, so the loss trains as
    written: class 3 of GSPMD's step (which lays the arrays out as asked), bitwise the
    optimized step's XLA control. Before, each was refused ("Going from Manual AxisType...",
    "can only refer to Auto axes"). Outside the route the calls are JAX's again."""
    pytest.importorskip("flax")
    if (call, kind) == ("reshard", "auto"):
        pytest.skip("jax.sharding.reshard takes explicit axes only (GSPMD's step refuses it)")
    mesh = make_mesh((8, 1), ("data", "model"), kind)
    fn = SERVED_LAYOUT_CALLS[call]
    rng = np.random.default_rng(10)
    w = put(rng.standard_normal((16, 8)).astype(np.float32), mesh, P())
    x = put(rng.standard_normal((32, 16)).astype(np.float32), mesh, P("data"))

    def loss(w, x):
        return jnp.mean(fn(x, w, mesh) ** 2)
    with jax.set_mesh(mesh):
        got = jax.jit(route(loss))(w, x)
        want = jax.jit(jax.value_and_grad(loss))(w, x)
        step = lambda w, x: route(loss)(w, x)  # noqa: E731
        optimized = jax.jit(libra_jax.optimize(step))(w, x)
        control = jax.jit(libra_jax.optimize(step, collectives="xla"))(w, x)
    assert_codegen_close(got, want)
    jax.tree.map(assert_bitwise, optimized, control)
    assert jax.lax.with_sharding_constraint.__name__ == "with_sharding_constraint"
    assert jax.sharding.auto_axes.__name__ == "auto_axes"


def test_an_out_sharding_argument_in_the_loss_is_refused_by_name():
    """An ``out_sharding=`` argument of a `jax.numpy` function is checked inside JAX, out of
    the route's reach: refused in one line naming the call, where, and the ways out, instead
    of JAX's "cannot contain axis names that are of type Manual"."""
    mesh = make_mesh((8, 1), ("data", "model"), "explicit")
    rng = np.random.default_rng(10)
    w = put(rng.standard_normal((16, 8)).astype(np.float32), mesh, P())
    x = put(rng.standard_normal((32, 16)).astype(np.float32), mesh, P("data"))
    with jax.set_mesh(mesh), pytest.raises(ValueError) as info:
        jax.jit(route(lambda w, x: jnp.mean(jnp.dot(x, w, out_sharding=P("data")) ** 2)))(w, x)
    message = str(info.value)
    assert re.search(r"calls dot_general with a sharding \(an out_sharding= argument", message)
    assert __file__ in message, message  # the loss's line
    assert "keep jax.value_and_grad" in message and "every mesh axis is manual" in message


class NnxNet:
    """A Flax NNX model for the route: Linear, LayerNorm, Linear (per example: the route's
    loss is GSPMD's); its first kernel partitioned over ``model`` where the mesh has it."""

    @staticmethod
    def make(model_axis: bool, seed: int = 0):
        from flax import nnx

        init = nnx.initializers.lecun_normal()
        if model_axis:
            init = nnx.with_partitioning(init, (None, "model"))

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.a = nnx.Linear(12, 24, kernel_init=init, rngs=rngs)
                self.norm = nnx.LayerNorm(24, rngs=rngs)
                self.b = nnx.Linear(24, 4, rngs=rngs)

            def __call__(self, x):
                return self.b(nnx.gelu(self.norm(self.a(x))))
        return Net(nnx.Rngs(seed))


def nnx_step_with(grad_fn):
    """An NNX train step with `grad_fn` where `nnx.value_and_grad(loss)` would be."""
    def step(model, optimizer, x, y):
        loss, grads = grad_fn(model, x, y)
        optimizer.update(model, grads)
        return loss
    return step


def nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("shape", [(8,), (8, 1)])
def test_an_nnx_model_trains_through_the_route_as_with_nnx_value_and_grad(shape):
    """The model passed whole, as to `nnx.value_and_grad`: the gradient is the `nnx.State` of
    its `nnx.Param`s, and `nnx.Optimizer` updates the model in place; under `nnx.jit`,
    optimized, 3 SGD steps agree with the GSPMD step's within the bound and are bitwise the
    optimized step's XLA control; on (8, 1) the first kernel is laid out over ``model``."""
    from flax import nnx
    mesh = jax.make_mesh(shape, ("data", "model")[:len(shape)],
                         devices=jax.devices("cpu")[:8])
    rng = np.random.default_rng(11)
    x = put(rng.standard_normal((32, 12)).astype(np.float32), mesh, P("data"))
    y = put(rng.standard_normal((32, 4)).astype(np.float32), mesh, P("data"))


    def gspmd(model, x, y):
        return nnx.value_and_grad(nnx_loss)(model, x, y)

    def through_route(model, x, y):
        return route(nnx_loss)(model, x, y)

    trained = {}
    with jax.set_mesh(mesh):
        for name, step in [("gspmd", nnx.jit(nnx_step_with(gspmd))),
                           ("route", nnx.jit(libra_jax.optimize(nnx_step_with(through_route)))),
                           ("control", nnx.jit(libra_jax.optimize(nnx_step_with(through_route),
                                                                  collectives="xla")))]:
            model = NnxNet.make(len(shape) == 2)
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
            losses = [step(model, optimizer, x, y) for _ in range(3)]
            trained[name] = (losses, nnx.state(model, nnx.Param))
        value, grads = through_route(NnxNet.make(len(shape) == 2), x, y)  # eagerly
    assert isinstance(grads, nnx.State)
    assert jax.tree.structure(grads) == jax.tree.structure(trained["gspmd"][1])
    assert_codegen_close(trained["route"], trained["gspmd"])
    jax.tree.map(assert_bitwise, trained["route"], trained["control"])
    assert float(trained["route"][0][-1]) < float(trained["route"][0][0])
    if len(shape) == 2:
        kernel = trained["route"][1]["a"]["kernel"]
        assert kernel[...].sharding.spec == P(None, "model")


def test_an_nnx_model_sharded_over_data_trains_fsdp_under_nnx_jit():
    """A Flax NNX model whose kernels are partitioned over ``data`` (FSDP, on the explicit
    mesh of NNX's tutorials): through the route under `nnx.jit` and `nnx.jit(optimize)`, it
    trains as with `nnx.value_and_grad` (losses within class 3's bound), its kernels stay
    sharded, and optimize runs their gathers and reduce-scatters as Libra's."""
    from flax import nnx

    mesh = make_mesh(kind="explicit")
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", None))

    def step_with(grad_fn):
        def step(model, optimizer, x, y):
            loss, grads = grad_fn(nnx_loss)(model, x, y)
            optimizer.update(model, grads)
            return loss
        return step

    rng = np.random.default_rng(13)
    x, y = rng.standard_normal((64, 16), np.float32), rng.standard_normal((64, 8), np.float32)
    opt = libra_jax.optimize(step_with(libra_jax.value_and_grad))
    runs = {}
    for name, step in (("gspmd", nnx.jit(step_with(nnx.value_and_grad))),
                       ("route", nnx.jit(step_with(libra_jax.value_and_grad))),
                       ("optimized", nnx.jit(opt))):
        with jax.set_mesh(mesh):
            model = nnx.Sequential(nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0)),
                                   nnx.relu,
                                   nnx.Linear(32, 8, kernel_init=init, rngs=nnx.Rngs(1)))
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            batch = (put(x, mesh, P("data")), put(y, mesh, P("data")))
            runs[name] = np.float32([step(model, optimizer, *batch) for _ in range(3)])
        kernels = [layer.kernel for layer in (model.layers[0], model.layers[2])]
        assert all(k.value.sharding.spec == P("data", None) for k in kernels), name
    assert runs["gspmd"][-1] < runs["gspmd"][0]
    for name in ("route", "optimized"):
        assert_codegen_close(runs[name], runs["gspmd"])
    plans = [(p.collective, p.kind) for p in opt.last_report.plans]
    # The two kernels' forward gathers: one call over both.
    assert [len(p.members) for p in opt.last_report.plans
            if (p.collective, p.kind) == ("all-gather", "forward")] == [2], \
        opt.last_report.plan_lines()
    assert plans.count(("reduce-scatter", "gradient")) >= 1, opt.last_report.plan_lines()


def test_nnx_state_the_loss_updates_is_written_back():
    """What the loss does to the model's other state reaches the caller's objects, as
    `nnx.value_and_grad` does: batch statistics (each shard's, averaged over the shards:
    the running mean is GSPMD's) and the dropout stream (one draw a call), a separate
    `nnx.Rngs` argument's count too. An NNX object nested in an argument is refused."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(12, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
            self.drop = nnx.Dropout(0.25, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.a(x)))

    def loss(model, x, rngs):
        noise = jax.random.normal(rngs.noise(), x.shape)
        return jnp.mean(model(x + 0 * noise) ** 2)

    mesh = make_mesh()
    x = put(np.random.default_rng(12).standard_normal((32, 12)).astype(np.float32), mesh,
            P("data"))
    models = {k: Net(nnx.Rngs(0, dropout=1)) for k in ("route", "gspmd")}
    rngs = nnx.Rngs(noise=2)
    for _ in range(2):
        route(loss)(models["route"], x, rngs)
        nnx.jit(nnx.value_and_grad(loss))(models["gspmd"], x, nnx.Rngs(noise=2))
    route_bn, gspmd_bn = models["route"].bn, models["gspmd"].bn
    assert_codegen_close(route_bn.mean[...], gspmd_bn.mean[...])
    assert float(jnp.max(jnp.abs(route_bn.mean[...]))) > 0
    assert not np.allclose(route_bn.var[...], 1.0)  # moved (per shard: not GSPMD's variance)
    counts = {k: int(m.drop.rngs.count[...]) for k, m in models.items()}
    assert counts["route"] == counts["gspmd"] == 2, counts
    assert int(rngs.noise.count[...]) == 2
    with pytest.raises(TypeError, match="Flax NNX Net inside an argument's pytree"):
        route(lambda pair, x: loss(pair[0], x, rngs))((models["route"],), x)


# --- What optimize says of GSPMD steps and of collectives it does not plan --------------------

def test_optimize_names_the_route_for_a_gspmd_step(monkeypatch):
    monkeypatch.setattr("libra_jax.ops.base._warned", set())
    mesh = make_mesh()
    params, x, y = mlp_batch(7)
    step = jax.value_and_grad(mlp_loss)
    opt = libra_jax.optimize(step)
    with pytest.warns(UserWarning, match=r"inputs are sharded over mesh axes \('data',\): a "
                                         r"GSPMD step.*libra_jax.value_and_grad"):
        # Nothing planned: the same program.
        jax.tree.map(assert_bitwise, opt(params, x, y), jax.jit(step)(params, x, y))
    assert not opt.last_report.plans
    text = str(libra_jax.explain(step, params, x, y, file=None))
    assert "GSPMD step" in text and "libra_jax.value_and_grad" in text
    # Under jit on an auto mesh the tracers carry no sharding, but a jax.set_mesh context does,
    # and so do an explicit mesh's tracers.
    monkeypatch.setattr("libra_jax.ops.base._warned", set())
    with jax.set_mesh(mesh), pytest.warns(UserWarning, match="traced under the mesh"):
        jax.jit(libra_jax.optimize(step))(params, x, y)
    monkeypatch.setattr("libra_jax.ops.base._warned", set())
    explicit = make_mesh(kind="explicit")
    with pytest.warns(UserWarning, match=r"sharded over mesh axes \('data',\)"):
        jax.jit(libra_jax.optimize(step))(put(params, explicit, P()), put(x, explicit, P("data")),
                                          put(y, explicit, P("data")))


def test_optimize_says_once_which_collectives_it_leaves_to_xla(monkeypatch):
    """An FSDP-style shard_map step: the parameter is all-gathered forward, and its gradient
    is autodiff's reduce-scatter; optimize plans the loss psum and the gradient psum_scatter,
    runs the all-gather on libra's engine at the model's blocks (issue 44; before it, both
    were left to XLA) and names what it leaves: here a ppermute."""
    monkeypatch.setattr("libra_jax.ops.base._warned", set())
    mesh = make_mesh()
    perm = [(i, (i + 1) % 8) for i in range(8)]

    def local(w, x):
        def loss(w):
            full = jax.lax.all_gather(w, "data", tiled=True)
            return jax.lax.pmean(jnp.mean(jnp.tanh(x @ full) ** 2), "data")
        value, g = jax.value_and_grad(loss)(w)
        return value, w - 0.1 * g + 0.0 * jax.lax.ppermute(w, "data", perm)

    step = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")),
                         out_specs=(P(), P("data")))
    w = put(np.ones((16, 8), np.float32), mesh, P("data"))
    x = put(np.ones((64, 16), np.float32), mesh, P("data"))
    opt = libra_jax.optimize(step)
    with pytest.warns(UserWarning, match=r"plans psums and psum_scatters and runs all_gathers and all_to_alls; "
                                         r"these collectives keep their own lowering \(XLA's, or "
                                         r"libra's at their own blocks\): ppermute over "
                                         r"\('data',\) in top/shard_map\. optimize plans the "
                                         r"gradient"):
        assert_codegen_close(jax.jit(opt)(w, x), jax.jit(step)(w, x))
    report = opt.last_report
    assert report.unplanned == ["ppermute over ('data',) in top/shard_map"]
    assert sorted((p.kind, p.collective) for p in report.plans) == [
        ("forward", "all-gather"), ("forward", "all-reduce"), ("gradient", "reduce-scatter")]
    assert "collectives optimize leaves unplanned" in str(
        libra_jax.explain(step, w, x, file=None))


# --- Trainers as their frameworks write them ------------------------------------------------
#
# Steps written in the style of MaxText (a Flax linen decoder under logical axis rules),
# JAX's Training Cookbook (pure JAX, state in `jax.Ref`s, a loss closing over the batch) and
# Flax's NNX tutorials (an explicit mesh, `nnx.Embed`), each with one line changed: the
# gradient taken by the route. docs/gspmd.md ("Trainers as written") says which train as
# written.

MAXTEXT_BATCH = ("data", "fsdp", "sequence")
MAXTEXT_RULES = [("activation_batch", MAXTEXT_BATCH), ("embed", "fsdp"), ("mlp", None),
                 ("activation_mlp", None), ("layers", None)]


class MaxTextBlock(nn.Module):
    """A residual MLP block with logically partitioned kernels and an activation constraint,
    as MaxText's layers write them."""

    @nn.compact
    def __call__(self, x, _):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(jnp.tanh(h), ("activation_batch", "activation_mlp"))
        out = nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h)
        return x + out, None


class MaxTextDecoder(nn.Module):
    """Three blocks scanned over remat'd layers (MaxText's ``scan_layers``)."""

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(nn.remat(MaxTextBlock), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=3,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        return stack(name="layers")(x, None)[0]


def test_a_maxtext_style_step_trains_as_written():
    """MaxText's form: logical axis rules, the batch over ('data', 'fsdp', 'sequence') of
    which only ``fsdp`` has more than one device, the kernels sharded over ``fsdp`` (FSDP),
    `with_logical_constraint` in the loss, layers scanned over remat, an auto mesh under
    `jax.jit` (in_specs from the rules). Trains through the route as written (before: the
    constraint was refused): class 3 of GSPMD's step, bitwise the optimized XLA control, the
    kernels' gradients reduce-scattered and planned, every collective over ``fsdp`` alone."""
    mesh = make_mesh((1, 8, 1), MAXTEXT_BATCH)
    model = MaxTextDecoder()
    rng = np.random.default_rng(31)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.standard_normal((32, 16)).astype(np.float32)

    def loss(params, x, y):
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    def step_with(value_and_grad):
        def step(params, x, y):
            value, grads = value_and_grad(loss)(params, x, y)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value
        return step
    with jax.set_mesh(mesh), nn.logical_axis_rules(MAXTEXT_RULES):
        boxed = model.init(jax.random.key(0), x[:1])["params"]
        specs = nn.logical_to_mesh(nn.get_partition_spec(boxed))
        params = jax.tree.map(lambda a, s: put(a, mesh, s), nn.unbox(boxed), specs)
        x, y = put(x, mesh, P(MAXTEXT_BATCH)), put(y, mesh, P(MAXTEXT_BATCH))
        step = step_with(lambda f: libra_jax.value_and_grad(
            f, axis_name=MAXTEXT_BATCH, in_specs=(specs, P(MAXTEXT_BATCH), P(MAXTEXT_BATCH))))
        got = jax.jit(step)(params, x, y)
        want = jax.jit(step_with(jax.value_and_grad))(params, x, y)
        opt = libra_jax.optimize(step)
        optimized = jax.jit(opt)(params, x, y)
        control = jax.jit(libra_jax.optimize(step, collectives="xla"))(params, x, y)
    assert_codegen_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))
    jax.tree.map(assert_bitwise, optimized, control)
    plans = opt.last_report.plans
    scattered = [p for p in plans if p.collective == "reduce-scatter"]
    assert [(p.kind, len(p.members)) for p in scattered] == [("gradient", 2)], \
        opt.last_report.plan_lines()
    assert {p.axes for p in plans} == {("fsdp",)}, {p.axes for p in plans}


def test_a_cookbook_style_step_trains_once_its_out_sharding_is_dropped():
    """JAX's Training Cookbook's form: pure JAX on an explicit mesh, parameters and optimizer
    state in `jax.Ref`s updated in place, the loss closing over the batch, a matmul with
    ``out_sharding=``. As written the route refuses the ``out_sharding=`` in one line (JAX
    checks it inside itself); without it the step trains: class 3 of GSPMD's step, the
    closed-over batch split (``split_closed_over=True``), and `explain` names each gradient by
    its reference."""
    mesh = make_mesh(kind="explicit")
    rng = np.random.default_rng(32)
    params = {"w": rng.standard_normal((16, 32)).astype(np.float32) / 4,
              "v": rng.standard_normal((32, 8)).astype(np.float32) / 6}
    batch = {"x": rng.standard_normal((64, 16)).astype(np.float32),
             "y": rng.standard_normal((64, 8)).astype(np.float32)}

    def step_with(value_and_grad, out_sharding):
        def train_step(weights, momentum, batch):
            def loss_fn(w):
                h = jnp.tanh(jnp.dot(batch["x"], w["w"], out_sharding=out_sharding))
                return jnp.mean((h @ w["v"] - batch["y"]) ** 2)
            loss, grads = value_and_grad(loss_fn)(jax.tree.map(lambda r: r[...], weights))

            def update(ref, m, g):
                m[...] = 0.9 * m[...] + g
                ref[...] = ref[...] - 0.1 * m[...]
            jax.tree.map(update, weights, momentum, grads)
            return loss
        return train_step

    def state():
        weights = jax.tree.map(jax.new_ref, put(params, mesh, P()))
        return weights, jax.tree.map(lambda w: jax.new_ref(jnp.zeros_like(w[...])), weights)
    with jax.set_mesh(mesh):
        on_mesh = put(batch, mesh, P("data"))
        with pytest.raises(ValueError, match=r"calls dot_general with a sharding \(an "
                                             r"out_sharding= argument.*keep jax.value_and_grad"):
            jax.jit(step_with(splitting_route, P("data")))(*state(), on_mesh)
        results = []
        for grad_fn in (splitting_route, jax.value_and_grad):
            weights, momentum = state()
            losses = [jax.jit(step_with(grad_fn, None))(weights, momentum, on_mesh)
                      for _ in range(3)]
            results.append((losses, jax.tree.map(lambda r: np.asarray(r[...]), weights)))
        weights, momentum = state()
        e = libra_jax.explain(step_with(splitting_route, None), weights, momentum, on_mesh,
                              file=None)
    assert_codegen_close(results[0], results[1])
    named = sorted(t for s in e.scopes for r in s.rows for t in r.tensors if "scalar" not in t)
    assert named == ["v", "w"], named


def test_an_nnx_step_with_an_embedding_trains_on_an_explicit_mesh():
    """Flax NNX's form on an explicit mesh (its tutorials'): `nnx.Embed` called with
    ``out_sharding=`` (which it serves through `jax.sharding.auto_axes`), an `nnx.Optimizer`,
    `nnx.jit`. Trains through the route as written (before: refused): 3 steps class 3 of
    `nnx.value_and_grad`'s, bitwise the optimized step's XLA control."""
    from flax import nnx
    mesh = make_mesh((8, 1), ("batch", "model"), "explicit")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(32, 16, rngs=rngs)
            self.out = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, tokens):
            return self.out(self.embed(tokens, out_sharding=P("batch")))

    def loss_fn(model, tokens, y):
        return jnp.mean((model(tokens) - y) ** 2)

    rng = np.random.default_rng(33)
    tokens = put(rng.integers(0, 32, (64,)).astype(np.int32), mesh, P("batch"))
    y = put(rng.standard_normal((64, 4)).astype(np.float32), mesh, P("batch"))
    route_grad = libra_jax.value_and_grad(loss_fn, axis_name="batch")
    runs = {}
    with jax.set_mesh(mesh):
        for name, step in [("gspmd", nnx_step_with(nnx.value_and_grad(loss_fn))),
                           ("route", nnx_step_with(route_grad)),
                           ("optimized", libra_jax.optimize(nnx_step_with(route_grad))),
                           ("control", libra_jax.optimize(nnx_step_with(route_grad),
                                                          collectives="xla"))]:
            model = Net(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
            compiled = nnx.jit(step)
            losses = [compiled(model, optimizer, tokens, y) for _ in range(3)]
            runs[name] = (losses, jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
    assert_codegen_close(runs["route"], runs["gspmd"])
    jax.tree.map(assert_bitwise, runs["optimized"], runs["control"])
