"""What the route's loss takes (`libra_jax.loss_inputs`, issue 69): arguments split by the rule
only where no layout says otherwise, closed-over values entering as GSPMD reads them, values
that are not arrays passed as they are, and no compiled program or layout call that outlives
the trace it was made for.

Each case is measured against plain `jax.value_and_grad` on the same mesh (class 3: two
programs, docs/bitwise.md), on auto and explicit meshes, eagerly and under `jax.jit`; the
optimized route against its XLA control bit for bit."""
from __future__ import annotations

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import libra_jax

from conftest import assert_bitwise, assert_trees_close as close, data_mesh as make_mesh
from conftest import shard as put

pytestmark = pytest.mark.usefixtures("jax_8")

KINDS = ("auto", "explicit")


def route(fn, **kw):
    return libra_jax.value_and_grad(fn, axis_name="data", **kw)


def read_whole(x, mesh):
    """`x` read whole, as a GSPMD loss reads an FSDP-sharded table: `reshard` on an explicit
    mesh, `with_sharding_constraint` on an auto one."""
    if jax.sharding.AxisType.Explicit in mesh.axis_types:
        return jax.sharding.reshard(x, P())
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def table_problem(mesh, table_spec):
    rng = np.random.default_rng(7)
    w = put(rng.standard_normal((16, 4)).astype(np.float32) / 4, mesh, P())
    table = put(rng.standard_normal((64, 4)).astype(np.float32), mesh, table_spec)
    x = put(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("data"))
    return w, table, x


def scores(w, table, x):
    """Each example scored against every row of the table: a loss that reads it whole."""
    logits = jnp.tanh(x @ w) @ table.T
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1))


# --- a closed-over FSDP-sharded table enters whole ------------------------------------------

@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_over_fsdp_sharded_table_is_read_whole(kind, jitted):
    """A frozen table placed P("data") (as FSDP shards it), closed over by the loss and read
    whole through reshard / with_sharding_constraint: it was split as the batch and the
    layout call dropped, so each shard scored against 8 of 64 rows (loss 4.5066 instead of
    7.6941, silently). It enters whole, as GSPMD reads it."""
    mesh = make_mesh(kind)
    w, table, x = table_problem(mesh, P("data"))

    def step(value_and_grad, w, table, x):
        def loss(w, x):
            return scores(w, read_whole(table, mesh), x)
        return value_and_grad(loss)(w, x)
    with jax.set_mesh(mesh):
        want = jax.jit(lambda *a: step(jax.value_and_grad, *a))(w, table, x)
        if jitted:
            got = jax.jit(lambda *a: step(route, *a))(w, table, x)
            optimized = libra_jax.optimize(lambda *a: step(route, *a))
            fast = jax.jit(optimized)(w, table, x)
            control = jax.jit(libra_jax.optimize(lambda *a: step(route, *a),
                                                 collectives="xla"))(w, table, x)
            jax.tree.map(assert_bitwise, fast, control)
        else:
            got = step(route, w, table, x)
    close(got, want)
    assert abs(float(got[0]) - float(want[0])) < 1e-5


def test_a_closed_over_batch_enters_whole_with_a_notice_unless_split_is_asked():
    """The one-release notice: an array laid out over the batch's axes that the loss closes
    over was split as the batch; now it enters whole (values GSPMD's) and the route says so,
    naming the array and the opt-in, `split_closed_over=True`, which splits it."""
    mesh = make_mesh("explicit")
    w, table, x = table_problem(mesh, P())
    seen = []

    def step(value_and_grad, w, x):
        def loss(w):
            seen.append(x.shape)
            return scores(w, table, x)
        return value_and_grad(loss)(w)
    with jax.set_mesh(mesh):
        want = jax.jit(lambda *a: step(jax.value_and_grad, *a))(w, x)
        with pytest.warns(UserWarning, match=r"closes over x float32\[64, 16\].*enters whole.*"
                                             r"split_closed_over=True.*closed-over-whole"):
            got = jax.jit(lambda *a: step(route, *a))(w, x)
        close(got, want)
        assert seen[-1] == (64, 16)
        split = jax.jit(lambda *a: step(
            lambda f: route(f, split_closed_over=True), *a))(w, x)
        assert seen[-1] == (8, 16)
    # Split, each shard scores its 8 examples against the whole table: the same loss.
    close(split, want)
    with pytest.raises(TypeError, match="split_closed_over must be True or False"):
        route(scores, split_closed_over="yes")


# --- a non-differentiated argument follows its visible layout -------------------------------

@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_replicated_argument_is_not_split_as_batch(kind, jitted):
    """`loss(w, table, x)` with `table` placed P() and argnums=0: the rule split every
    non-differentiated argument as batch (2.9825 instead of 5.2693 on an explicit mesh under
    jit). Its visible layout is followed: whole."""
    mesh = make_mesh(kind)
    w, table, x = table_problem(mesh, P())
    if kind == "auto" and jitted:
        # Traced on an auto mesh nothing shows a layout: in_specs says it.
        vg = route(scores, in_specs=(P(), P(), P("data")))
    else:
        vg = route(scores)
    with jax.set_mesh(mesh):
        want = jax.jit(jax.value_and_grad(scores))(w, table, x)
        got = jax.jit(vg)(w, table, x) if jitted else vg(w, table, x)
    close(got, want)


def test_an_argument_laid_out_against_the_rule_is_refused_in_one_line():
    """An argument split on another dimension than the leading one: the rule would split it
    against its layout, so the route asks for in_specs, naming it."""
    mesh = make_mesh("explicit")
    w, _, x = table_problem(mesh, P())
    table = put(np.ones((4, 64), np.float32), mesh, P(None, "data"))
    with pytest.raises(ValueError, match=r"argument 1 is laid out as P\(None, 'data'\), "
                                         r"which is neither.*give its PartitionSpec in in_specs"):
        route(lambda w, t, x: scores(w, t.T, x))(w, table, x)


# --- no compiled program outlives the values it was traced with -----------------------------

class Config:
    shift = 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_one_route_called_five_times_with_its_closure_changed(kind):
    """One route object called eagerly 5 times, what the loss closes over changed between
    the calls (a rebound float, a replaced weight, a list element, two arrays whose layouts
    swap): the first call's numbers came back. Each call is plain jax.value_and_grad's; and
    an attribute of a closed-over object, changed, too."""
    mesh = make_mesh(kind)
    rng = np.random.default_rng(11)
    w, _, x = table_problem(mesh, P())
    scale = 1.0
    weight = put(rng.standard_normal((4, 4)).astype(np.float32), mesh, P())
    offsets = [np.float32(0.0)]
    a = put(rng.standard_normal((64, 4)).astype(np.float32), mesh, P("data"))
    b = put(rng.standard_normal((64, 4)).astype(np.float32) * 3, mesh, P())

    def loss(w, x):
        h = jnp.tanh(x @ w) * scale + offsets[0]
        return (jnp.mean((h @ weight) ** 2) + scores(w, read_whole(a, mesh), x)
                + 0.5 * scores(w, read_whole(b, mesh), x))
    vg = route(loss)
    got, want = [], []

    def call():
        with jax.set_mesh(mesh):
            got.append(vg(w, x))
            want.append(jax.value_and_grad(loss)(w, x))
    call()
    scale = 3.0
    call()
    weight = weight * 10
    call()
    offsets[0] = np.float32(2.0)
    call()
    a, b = put(b, mesh, P("data")), put(a, mesh, P())
    call()
    losses = [float(g[0]) for g in got]
    assert len(set(losses)) == 5, losses
    for g, v in zip(got, want):
        close(g, v)

    config = Config()

    def shifted(w, x):
        return jnp.mean((jnp.tanh(x @ w) + config.shift) ** 2)
    vg = route(shifted)
    with jax.set_mesh(mesh):
        first = vg(w, x)
        config.shift = 4.0
        second = vg(w, x)
        close(second, jax.value_and_grad(shifted)(w, x))
    assert float(first[0]) != float(second[0])


# --- the layout calls: no process-wide swap -------------------------------------------------

def test_two_routes_tracing_at_once_in_two_threads():
    """Route A starts tracing (its layout calls served), route B starts while A is inside
    its loss, A finishes, then B's loss calls with_sharding_constraint. The swap was
    process-wide: A's exit put JAX's function back and B's call was refused. Forced by
    events; each thread's result is GSPMD's."""
    mesh = make_mesh("auto")
    w, table, x = table_problem(mesh, P())
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    results: dict = {}

    def constrained(w, table, x):
        # The activations laid out over the batch, as Flax's logical constraints do.
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
        return scores(w, table, x)

    def loss_a(w, table, x):
        a_in.set()
        assert b_in.wait(30), "B never entered its loss"
        return constrained(w, table, x)

    def loss_b(w, table, x):
        b_in.set()
        assert a_done.wait(30), "A never finished"
        return constrained(w, table, x)

    def run(name, loss, before=None, after=None):
        try:
            if before is not None:
                assert before.wait(30)
            results[name] = jax.jit(route(loss, in_specs=(P(), P(), P("data"))))(w, table, x)
        except BaseException as e:
            results[name] = e
        finally:
            if after is not None:
                after.set()
    threads = [threading.Thread(target=run, args=("a", loss_a, None, a_done)),
               threading.Thread(target=run, args=("b", loss_b, a_in, None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    want = jax.jit(jax.value_and_grad(scores))(w, table, x)
    for name in "ab":
        assert not isinstance(results[name], BaseException), (name, results[name])
        close(results[name], want)
    # Outside a route's trace, JAX's function as it is (its name and docstring too).
    assert jax.lax.with_sharding_constraint.__name__ == "with_sharding_constraint"
    with pytest.raises(ValueError):
        jax.jit(jax.shard_map(lambda v: jax.lax.with_sharding_constraint(
            v, NamedSharding(mesh, P("data"))), mesh=mesh, in_specs=P("data"),
            out_specs=P("data")))(x)


# --- aux_reduce=None, MaxText's argument layout, routes in routes ---------------------------

@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_aux_reduce_none_stacks_one_row_per_shard(kind, jitted):
    """Documented, and it failed for every leaf with JAX's "out_specs which require
    replication": each aux leaf stacked, row r shard r's."""
    mesh = make_mesh(kind)
    w, _, x = table_problem(mesh, P())

    def loss(w, x):
        h = x @ w
        return jnp.mean(h ** 2), {"mean": jnp.mean(h, 0), "count": jnp.sum(h > 0)}
    vg = route(loss, has_aux=True, aux_reduce=None)
    with jax.set_mesh(mesh):
        (value, aux), grads = jax.jit(vg)(w, x) if jitted else vg(w, x)
    shards = np.asarray(x).reshape(8, 8, 16) @ np.asarray(w)
    assert aux["mean"].shape == (8, 4) and aux["count"].shape == (8,)
    np.testing.assert_allclose(aux["mean"], shards.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(aux["count"], (shards > 0).sum((1, 2)))
    (want, _), want_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(w, x)
    close((value, grads), (want, want_grads))


class Transformer(nn.Module):
    """A model object as MaxText passes it: the loss calls its `apply`."""
    features: int = 8

    @nn.compact
    def __call__(self, x, deterministic):
        h = nn.Dense(self.features)(x)
        h = nn.Dropout(0.5)(h, deterministic=deterministic)
        return nn.Dense(4)(jnp.tanh(h))


class MaxTextConfig:
    label_smoothing = 0.1


def maxtext_loss_fn(model, config, data, dropout_rng, params, is_train=True):
    """MaxText's signature: the model and config first, the parameters fifth."""
    logits = model.apply({"params": params}, data["inputs"], deterministic=not is_train,
                         rngs={"dropout": dropout_rng})
    labels = optax.smooth_labels(jax.nn.one_hot(data["targets"], 4), config.label_smoothing)
    return jnp.mean(optax.softmax_cross_entropy(logits, labels))


@pytest.mark.parametrize("model_spec", [None, P()], ids=["None", "P()"])
def test_maxtext_argument_layout_trains(model_spec):
    """`in_specs=(None, None, P(batch), P(), param_specs)`: None marks the model and the
    config, which are not arrays; it was refused ("in_specs[0] is not a pytree prefix"), and
    P() there ended in JAX's "Cannot interpret value of type Transformer". Three steps of
    training, each GSPMD's (dropout off: its bits depend on the layout)."""
    mesh = make_mesh("auto")
    rng = np.random.default_rng(3)
    model, config = Transformer(), MaxTextConfig()
    data = put({"inputs": rng.standard_normal((64, 16)).astype(np.float32),
                "targets": rng.integers(0, 4, (64,)).astype(np.int32)}, mesh, P("data"))
    params = put(model.init(jax.random.key(0), data["inputs"][:1], True)["params"], mesh, P())
    param_specs = jax.tree.map(lambda _: P(), params)
    tx = optax.sgd(0.1)

    def train_step(value_and_grad, params, opt_state, data, key):
        loss, grads = value_and_grad(params, data, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def ours(params, data, key):
        return route(maxtext_loss_fn, argnums=4,
                     in_specs=(model_spec, model_spec, P("data"), P(), param_specs))(
            model, config, data, key, params, is_train=False)

    def plain(params, data, key):
        return jax.value_and_grad(maxtext_loss_fn, argnums=4)(
            model, config, data, key, params, is_train=False)
    states = {}
    for name, vg in (("route", ours), ("plain", plain)):
        step = jax.jit(lambda p, s, d, k, vg=vg: train_step(vg, p, s, d, k))
        p, s = params, tx.init(params)
        losses = []
        for i in range(3):
            p, s, loss = step(p, s, data, jax.random.key(i))
            losses.append(loss)
        states[name] = (p, losses)
    close(states["route"], states["plain"])


def test_a_route_inside_a_route_is_refused_in_one_line():
    """It ended in JAX's internal verifier errors."""
    mesh = make_mesh("auto")
    w, _, x = table_problem(mesh, P())

    def outer(w, x):
        return route(lambda w, x: jnp.mean((x @ w) ** 2))(w, x)[0]
    with pytest.raises(ValueError, match=r"^libra_jax.value_and_grad: called where \['data'\] "
                                         r"are already mapped"):
        jax.jit(route(outer))(w, x)


@pytest.mark.parametrize("kind", KINDS)
def test_a_replicated_weight_closed_over_eagerly_is_read(kind):
    """On an explicit mesh, eagerly, a replicated weight in the loss's own closure was refused
    as "neither its argument nor in its own closure": it is an input, read whole."""
    mesh = make_mesh(kind)
    w, table, x = table_problem(mesh, P())

    def loss(w, x):
        return scores(w, table, x)
    with jax.set_mesh(mesh):
        close(route(loss)(w, x), jax.jit(jax.value_and_grad(loss))(w, x))


def test_a_replicated_batch_shaped_array_beside_the_split_batch_is_named():
    """A replicated array shaped like the batch, closed over beside the split batch, met the
    batch's shard inside the route's shard_map: JAX's broadcasting TypeError named neither.
    The route names both and how each entered."""
    mesh = make_mesh("explicit")
    w, _, x = table_problem(mesh, P())
    targets = put(np.ones((64, 4), np.float32), mesh, P())

    def loss(w, x):
        return jnp.mean((x @ w - targets) ** 2)
    with jax.set_mesh(mesh), pytest.raises(
            ValueError, match=r"the loss failed on one shard's inputs .*split over \['data'\]: "
                              r"argument 1 float32\[64, 16\]; whole on every shard .*: the "
                              r"closed-over targets float32\[64, 4\]"):
        route(loss)(w, x)


# --- Equinox modules, as eqx.filter_value_and_grad differentiates them ----------------------

def eqx_model(key):
    import equinox as eqx

    class Block(eqx.Module):
        """Levanter's shape of module: `bool` and `int` fields, an integer array, a Dropout."""
        layers: list
        dropout: eqx.nn.Dropout
        inference: bool
        repeats: int
        offsets: jax.Array  # int32: not differentiated
        activation: object = jax.nn.gelu

        def __call__(self, x):
            h = x
            for _ in range(self.repeats):
                for layer in self.layers:
                    h = self.activation(layer(h))
            h = self.dropout(h, inference=self.inference)
            return h + self.offsets.astype(h.dtype)

    k1, k2 = jax.random.split(key)
    return Block([eqx.nn.Linear(16, 16, key=k1), eqx.nn.Linear(16, 4, key=k2)],
                 eqx.nn.Dropout(0.1), inference=True, repeats=1,
                 offsets=jnp.arange(4, dtype=jnp.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_an_equinox_module_with_bool_and_int_fields_trains(kind):
    """Levanter's GPT-2 is an Equinox module with bool fields: the route ended in JAX's "grad
    requires real- or complex-valued inputs ... got bool". A module passed as a
    differentiated argument is differentiated as eqx.filter_value_and_grad does (its inexact
    arrays; the rest static): 3 SGD steps, class 3 of eqx.filter_value_and_grad's, the
    gradient None where it is; optimized, bitwise its XLA control."""
    import equinox as eqx
    mesh = make_mesh(kind)
    rng = np.random.default_rng(4)
    x = put(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("data"))
    y = put(rng.standard_normal((64, 4)).astype(np.float32), mesh, P("data"))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def step_with(value_and_grad):
        def step(model, x, y):
            value, grads = value_and_grad(loss)(model, x, y)
            return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), value
        return step
    runs = {}
    with jax.set_mesh(mesh):
        for name, vg in (("route", route), ("plain", eqx.filter_value_and_grad)):
            model, losses = eqx_model(jax.random.key(0)), []
            step = eqx.filter_jit(step_with(vg))
            for _ in range(3):
                model, value = step(model, x, y)
                losses.append(value)
            runs[name] = (eqx.filter(model, eqx.is_inexact_array), losses)
        _, grads = route(loss)(eqx_model(jax.random.key(0)), x, y)
        model = eqx_model(jax.random.key(0))
        fast = eqx.filter_jit(libra_jax.optimize(step_with(route)))(model, x, y)
        control = eqx.filter_jit(libra_jax.optimize(step_with(route), collectives="xla"))(
            model, x, y)
    close(runs["route"], runs["plain"])
    assert grads.inference is None and grads.offsets is None and grads.repeats is None
    assert grads.layers[0].weight.shape == (16, 16)
    jax.tree.map(assert_bitwise, eqx.filter(fast, eqx.is_array), eqx.filter(control, eqx.is_array))
    # A plain pytree with a bool leaf keeps JAX's refusal.
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
        route(lambda p, x: jnp.mean(x @ p["w"]))({"w": jnp.ones((16, 4)), "flag": True}, x)


# --- Haliax named arrays, split as their arrays are -----------------------------------------

def import_haliax():
    """haliax, or a skip: its newest release (1.3) annotates one function with
    `jax._src.tree_util.BuiltInKeyEntry`, a private name JAX has removed (jax >= 0.10), so
    it imports only with that name supplied (a type annotation: nothing calls it). Installed
    by the ``haliax`` extra; CI's haliax stage runs this part."""
    import jax._src.tree_util as tree_util
    if not hasattr(tree_util, "BuiltInKeyEntry"):
        tree_util.BuiltInKeyEntry = object
    return pytest.importorskip("haliax")


@pytest.mark.parametrize("weight", ["replicated", "fsdp"])
@pytest.mark.parametrize("kind", KINDS)
def test_haliax_named_arrays_train(kind, weight):
    """Levanter's batches and parameters are Haliax NamedArrays: the route split the batch's
    array, and JAX rebuilt each NamedArray around its shard with the whole batch's axes
    (``batch`` 64 over 8 rows), so Haliax broadcast against the wrong sizes ("mul got
    incompatible shapes for broadcasting: (8, 16, 4), (64, 16, 4)"). Each NamedArray's axes
    are resized to its shard: 3 SGD steps of an Equinox module of NamedArrays (a `bool`
    field, a weight replicated or FSDP-sharded), class 3 of eqx.filter_value_and_grad's;
    optimized, bitwise its XLA control."""
    hax = import_haliax()
    import equinox as eqx
    Batch, Embed, Out = hax.Axis("batch", 64), hax.Axis("embed", 16), hax.Axis("out", 4)
    mesh = make_mesh(kind)
    rng = np.random.default_rng(5)

    class Dense(eqx.Module):
        w: hax.NamedArray
        b: hax.NamedArray
        inference: bool

        def __call__(self, x):
            # (read whole, as GSPMD's loss on an explicit mesh must; hax.dot calls a function
            # jax no longer has: a product and a sum instead)
            w = hax.named(read_whole(self.w.array, mesh), self.w.axes)
            return hax.tanh(hax.sum(hax.broadcast_axis(x, Out) * w, axis=Embed) + self.b)

    def model():
        w = put(rng.standard_normal((16, 4)).astype(np.float32) / 4, mesh,
                P("data") if weight == "fsdp" else P())
        return Dense(hax.named(w, (Embed, Out)), hax.zeros(Out), inference=True)

    x = hax.named(put(rng.standard_normal((64, 16)).astype(np.float32), mesh, P("data")),
                  (Batch, Embed))
    y = hax.named(put(rng.standard_normal((64, 4)).astype(np.float32), mesh, P("data")),
                  (Batch, Out))

    def loss(model, x, y):
        return hax.mean((model(x) - y) ** 2).scalar()

    def step_with(value_and_grad):
        def step(model, x, y):
            value, grads = value_and_grad(loss)(model, x, y)
            return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), value
        return step
    start = model()
    runs = {}
    with jax.set_mesh(mesh):
        for name, vg in (("route", route), ("plain", eqx.filter_value_and_grad)):
            current, losses = start, []
            step = eqx.filter_jit(step_with(vg))
            for _ in range(3):
                current, value = step(current, x, y)
                losses.append(value)
            runs[name] = (eqx.filter(current, eqx.is_inexact_array), losses)
        _, grads = route(loss)(start, x, y)
        fast = eqx.filter_jit(libra_jax.optimize(step_with(route)))(start, x, y)
        control = eqx.filter_jit(libra_jax.optimize(step_with(route), collectives="xla"))(
            start, x, y)
    close(runs["route"], runs["plain"])
    assert isinstance(grads.w, hax.NamedArray) and grads.w.axes == (Embed, Out)
    jax.tree.map(assert_bitwise, eqx.filter(fast, eqx.is_array), eqx.filter(control, eqx.is_array))
