"""A corpus of data-parallel train steps written the way people write them (Flax linen with
BatchNorm under `jax.pmap`, a transformer with dropout, Flax NNX functional and in place,
Equinox, `jax.set_mesh` with autodiff's psums, static configuration, optax chains with
clipping, schedules and gradient accumulation, scan over layers, train steps inside loops,
GSPMD steps through `libra_jax.value_and_grad`), small enough for 8 host devices.

Each case builds ``Case(step, state, batch, kwargs, static_argnames)``: ``step(state, *batch,
**kwargs) -> (state, metrics)``, compiled by ``case.compile`` (`jax.jit` with the state
donated, or the library's own: `nnx.jit`, `eqx.filter_jit`). `pmean` is the function the
step's own code calls (``jax.lax.pmean`` or ``libra_jax.pmean``: the drop-in by function swap).
Used by tests/test_corpus.py and benchmarks/corpus.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

N = 8  # devices


@dataclasses.dataclass
class Case:
    step: Callable[..., Any]
    state: Any
    batch: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    static_argnames: tuple[str, ...] = ()
    pmap: bool = False           # a jax.pmap step (state and batch carry a device axis)
    autodiff_psums: bool = False  # gradients summed by autodiff (check_vma), not by pmean
    library_psums: bool = False   # a library's own pmean (Flax BatchNorm): swapping misses it
    context: Callable[[], Any] = contextlib.nullcontext  # entered around tracing and running
    # How many psums of each kind `optimize` must find (`rewrite.CallPlan.kind`).
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    # Per scan whose psums could leave the loop, `optimize`'s choice (`rewrite.LoopPlan`).
    loops: tuple[str, ...] = ()
    drop_in: bool = True  # the step's own code has a psum a drop-in can take over
    # The library's own compile (`nnx.jit`, `eqx.filter_jit`) where `jax.jit` cannot take the
    # step (NNX's in-place updates, Equinox's function leaves); None: `jax.jit`, the state
    # donated.
    library_jit: Callable[..., Any] | None = None
    in_place: bool = False  # the step updates its state's objects in place (NNX)

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` compiled as this case's code compiles its step."""
        if self.library_jit is not None:
            return self.library_jit(fn)
        return jax.jit(fn, donate_argnums=0, static_argnames=self.static_argnames or None)

    def trace(self, fn: Callable[..., Any]) -> Any:
        """``fn(state, *batch, **kwargs)`` traced by `jax.jit` over the state's arrays (other
        leaves, an Equinox model's functions, fixed; array outputs only), for lowering to a
        platform: `nnx.jit` and `eqx.filter_jit` have no ``trace``."""
        flat, tree = jax.tree.flatten(fresh(self.state))

        def over_arrays(arrays: list[Any], *batch: Any, **kwargs: Any) -> list[Any]:
            it = iter(arrays)
            state = jax.tree.unflatten(tree, [next(it) if hasattr(x, "dtype") else x
                                              for x in flat])
            return [x for x in jax.tree.leaves(fn(state, *batch, **kwargs))
                    if hasattr(x, "dtype")]
        return jax.jit(over_arrays, static_argnames=self.static_argnames or None).trace(
            [x for x in flat if hasattr(x, "dtype")], *self.batch, **self.kwargs)


def fresh(tree: Any) -> Any:
    """A copy of a case's state, its arrays new (the compiled steps donate them): jax arrays
    (typed PRNG keys too) by jnp.copy, numpy ones by np.array, other leaves (an Equinox
    model's functions) as they are."""
    def copy(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jnp.copy(x)
        return np.array(x) if isinstance(x, (np.ndarray, np.generic)) else x
    return jax.tree.map(copy, tree)


def _lax_pmean(x: Any, axis_name: Any) -> Any:
    """`jax.lax.pmean`, looked up when called (so `libra_jax.patch_lax` reaches it)."""
    return jax.lax.pmean(x, axis_name)


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:N]), ("data",))


def _shard(x: Any, mesh: jax.sharding.Mesh) -> Any:
    return jax.device_put(x, NamedSharding(mesh, P("data")))


def moe_step(tokens: int = 32, width: int = 16) -> tuple[Callable[..., Any], dict, Any]:
    """A mixture-of-experts layer, one expert per device (tests/test_exchange.py,
    benchmarks/moe_cpu.py): tokens dispatched to their expert by an all-to-all, computed
    there, combined back by another (both again, transposed, in the backward pass); the
    experts' weights sharded over the devices, a replicated router's gradient all-reduced by
    autodiff. (the shard_mapped step, unjitted; its parameters and batch, placed)."""
    n, mesh = N, _mesh()
    rng = np.random.default_rng(3)
    params = {"experts": rng.standard_normal((n, width, width)).astype(np.float32) / width**0.5,
              "router": rng.standard_normal((width, width)).astype(np.float32) / width**0.5}
    x = rng.standard_normal((n * tokens, width)).astype(np.float32)

    def local(params: dict, x: Any) -> Any:
        def loss(p: dict) -> Any:
            h = jnp.tanh(x @ p["router"])
            sent = jax.lax.all_to_all(h.reshape(n, tokens // n, width), "data", 0, 0,
                                      tiled=True)
            done = jnp.tanh(sent @ p["experts"][0])
            back = jax.lax.all_to_all(done, "data", 0, 0, tiled=True)
            return jax.lax.pmean(jnp.mean((back.reshape(tokens, width) - x) ** 2), "data")
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), value
    specs = {"experts": P("data"), "router": P()}
    step = jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")), out_specs=(specs, P()))
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    return step, placed, _shard(x, mesh)


def _mse_step(predict: Callable[..., Any], tx: Any, mesh: jax.sharding.Mesh,
              pmean: Callable[..., Any]) -> Callable[..., Any]:
    """A `check_vma` shard_map step of a mean-squared-error regression: the loss `pmean`ed
    inside (autodiff sums the gradients), an optax update; state ``{"params", "opt"}``."""
    import optax

    def local(state, x, y):
        def loss_fn(p):
            return pmean(jnp.mean((predict(p, x) - y) ** 2), "data")
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=(P(), P()))


def flax_batchnorm_pmap(pmean: Callable[..., Any] | None = None) -> Case:
    """Flax linen CNN-ish MLP with BatchNorm (cross-replica statistics, mutable
    `batch_stats`) under `jax.pmap` with `donate_argnums`; metrics `pmean`ed."""
    pmean = pmean or _lax_pmean
    import flax.linen as nn
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.Dense(32)(x)
            x = nn.BatchNorm(use_running_average=not train, axis_name="batch", momentum=0.9)(x)
            x = nn.relu(x)
            return nn.Dense(4)(x)

    net = Net()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 8, 16)).astype(np.float32)
    y = rng.integers(0, 4, (N, 8))
    variables = net.init(jax.random.key(0), x[0], train=False)
    tx = optax.sgd(0.1, momentum=0.9)
    state = {"params": variables["params"], "batch_stats": variables["batch_stats"],
             "opt": tx.init(variables["params"])}

    def step(state, x, y):
        def loss_fn(params):
            logits, updates = net.apply({"params": params, "batch_stats": state["batch_stats"]},
                                        x, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, (logits, updates["batch_stats"])
        (loss, (logits, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"])
        grads = pmean(grads, "batch")
        updates, opt = tx.update(grads, state["opt"], state["params"])
        metrics = {"loss": pmean(loss, "batch"),
                   "accuracy": pmean(jnp.mean(jnp.argmax(logits, -1) == y), "batch")}
        return {"params": optax.apply_updates(state["params"], updates), "batch_stats": stats,
                "opt": opt}, metrics

    replicate = functools.partial(jax.tree.map, lambda a: np.broadcast_to(a, (N, *a.shape)))
    pstep = jax.pmap(step, axis_name="batch", donate_argnums=0)
    # 6 parameters; BatchNorm's statistics (one pmean of mean and mean of squares, Flax
    # concatenates them) and that pmean's cotangent in the backward pass; loss and accuracy,
    # which nothing reads, with the gradients (`rewrite.sites.value_sites`).
    return Case(pstep, replicate(state), (x, y), pmap=True, library_psums=True,
                kinds={"gradient": 8, "forward": 1, "backward": 1})


def transformer_dropout(pmean: Callable[..., Any] | None = None) -> Case:
    """A one-block Flax linen transformer with dropout, its key passed as a keyword argument;
    `shard_map` with `check_vma=False` and an explicit `pmean` of the gradients (AdamW)."""
    pmean = pmean or _lax_pmean
    import flax.linen as nn
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, tokens, train: bool):
            h = nn.Embed(32, 16)(tokens)
            h = h + nn.SelfAttention(num_heads=2, dropout_rate=0.1, deterministic=not train)(h)
            h = nn.LayerNorm()(h)
            h = h + nn.Dropout(0.1, deterministic=not train)(nn.Dense(16)(h))
            return nn.Dense(32)(h)

    mesh = _mesh()
    model = Block()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 32, (N * 2, 6))
    params = model.init(jax.random.key(1), tokens[:2], train=False)["params"]
    tx = optax.adamw(3e-3)
    state = {"params": params, "opt": tx.init(params)}

    def local(state, tokens, key):
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))

        def loss_fn(params):
            logits = model.apply({"params": params}, tokens, train=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], tokens[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        grads = pmean(grads, "data")
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, \
            {"loss": pmean(loss, "data")}

    sm = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=(P(), P()),
                       check_vma=False)

    def step(state, tokens, *, dropout_rng):
        return sm(state, tokens, dropout_rng)

    # Embed 1, attention 8 (q, k, v, out: kernel and bias), LayerNorm 2, Dense 2 + 2; the loss.
    return Case(step, state, (_shard(tokens, mesh),), {"dropout_rng": jax.random.key(7)},
                kinds={"gradient": 16})


def nnx_model(pmean: Callable[..., Any] | None = None) -> Case:
    """A Flax NNX model, split into graph and state, trained functionally in `shard_map`
    (`check_vma=True`: autodiff inserts the gradient psums; the loss is `pmean`ed inside)."""
    pmean = pmean or _lax_pmean
    from flax import nnx
    import optax

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(12, 24, rngs=rngs)
            self.b = nnx.Linear(24, 3, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.gelu(self.a(x)))

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    mesh = _mesh()
    tx = optax.adam(1e-2)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((N * 4, 12)).astype(np.float32)
    y = rng.standard_normal((N * 4, 3)).astype(np.float32)

    step = _mse_step(lambda p, x: nnx.merge(graphdef, p)(x), tx, mesh, pmean)
    return Case(step, {"params": params, "opt": tx.init(params)},
                (_shard(x, mesh), _shard(y, mesh)), autodiff_psums=True,
                kinds={"gradient": 5})


def nnx_in_place(pmean: Callable[..., Any] | None = None) -> Case:
    """A Flax NNX step in the style of its documentation: `nnx.Optimizer`, `nnx.MultiMetric`,
    dropout drawing from `Rngs`, BatchNorm synchronising its statistics over the data axis,
    every update in place inside an `nnx.shard_map`; compiled by `nnx.jit`."""
    pmean = pmean or _lax_pmean
    from flax import nnx
    import optax

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(12, 24, rngs=rngs)
            self.bn = nnx.BatchNorm(24, axis_name="data", rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.b = nnx.Linear(24, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(nnx.relu(self.bn(self.a(x)))))

    mesh = _mesh()
    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                              accuracy=nnx.metrics.Accuracy())

    @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P(), P("data"), P("data")), out_specs=P(),
                   check_vma=False)
    def train_step(model, optimizer, metrics, x, y):
        def loss_fn(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits
        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        loss = pmean(loss, "data")
        optimizer.update(model, pmean(grads, "data"))
        metrics.update(loss=loss, logits=logits, labels=y)
        return loss

    def step(state, x, y):
        train_step(*state, x, y)  # in place
        return state, state[2].compute()["loss"]

    rng = np.random.default_rng(10)
    x = rng.standard_normal((N * 4, 12)).astype(np.float32)
    y = rng.integers(0, 4, N * 4).astype(np.int32)
    return Case(step, (model, optimizer, metrics), (_shard(x, mesh), _shard(y, mesh)),
                library_jit=nnx.jit, in_place=True, library_psums=True,
                kinds={"gradient": 6, "forward": 2, "backward": 1})


def equinox_mlp(pmean: Callable[..., Any] | None = None) -> Case:
    """An Equinox MLP (its activation, a function, is a leaf of the model) trained with optax
    in a `shard_map`, compiled by `eqx.filter_jit`."""
    pmean = pmean or _lax_pmean
    import equinox as eqx
    import optax

    mesh = _mesh()
    model = eqx.nn.MLP(12, 3, 16, 2, activation=jax.nn.gelu, key=jax.random.key(11))
    tx = optax.adam(1e-2)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((N * 4, 12)).astype(np.float32)
    y = rng.standard_normal((N * 4, 3)).astype(np.float32)

    def step(state, x, y):
        model, opt_state = state

        def local(x, y):
            def loss_fn(model):
                return jnp.mean((jax.vmap(model)(x) - y) ** 2)
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
            return pmean(loss, "data"), pmean(grads, "data")
        loss, grads = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")),
                                    out_specs=P(), check_vma=False)(x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return (eqx.apply_updates(model, updates), opt_state), loss

    return Case(step, (model, tx.init(eqx.filter(model, eqx.is_array))),
                (_shard(x, mesh), _shard(y, mesh)), library_jit=eqx.filter_jit,
                kinds={"gradient": 7})


def set_mesh_autodiff(pmean: Callable[..., Any] | None = None) -> Case:
    """`jax.shard_map` without `mesh=`, under `jax.set_mesh`; gradient psums inserted by
    autodiff (`check_vma=True`), plain SGD, no psum in the step's own code but the loss's."""
    pmean = pmean or _lax_pmean
    mesh = _mesh()
    rng = np.random.default_rng(3)
    params = {"w1": (rng.standard_normal((8, 16)) * 0.3).astype(np.float32),
              "b1": np.zeros(16, np.float32),
              "w2": (rng.standard_normal((16, 2)) * 0.3).astype(np.float32)}
    x = rng.standard_normal((N * 4, 8)).astype(np.float32)

    def local(params, x):
        def loss_fn(p):
            h = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
            return pmean(jnp.mean(h ** 2), "data")
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), loss

    step = jax.shard_map(local, in_specs=(P(), P("data")), out_specs=(P(), P()))
    return Case(step, params, (_shard(x, mesh),), autodiff_psums=True,
                context=lambda: jax.set_mesh(mesh), kinds={"gradient": 4})


def static_config(pmean: Callable[..., Any] | None = None) -> Case:
    """Static configuration: a frozen config dataclass, a `train` flag and a learning-rate
    schedule function, passed by keyword and marked static."""
    pmean = pmean or _lax_pmean
    @dataclasses.dataclass(frozen=True)
    class Config:
        hidden: int = 16
        weight_decay: float = 1e-4

    mesh = _mesh()
    rng = np.random.default_rng(4)
    params = {"w": (rng.standard_normal((6, 16)) * 0.3).astype(np.float32),
              "v": (rng.standard_normal((16, 1)) * 0.3).astype(np.float32)}
    x = rng.standard_normal((N * 4, 6)).astype(np.float32)

    def schedule(i):
        return 0.1 / (1.0 + i)

    def step(params, x, *, config, train, lr):
        def local(params, x):
            def loss_fn(p):
                h = jax.nn.relu(x @ p["w"])
                if train:
                    h = h * 0.9
                reg = config.weight_decay * sum(jnp.sum(v ** 2) for v in jax.tree.leaves(p))
                return jnp.mean((h @ p["v"]) ** 2) + reg
            loss, grads = jax.value_and_grad(loss_fn)(params)
            grads = pmean(grads, "data")
            return jax.tree.map(lambda p, g: p - lr(0) * g, params, grads), pmean(loss, "data")
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                             check_vma=False)(params, x)

    return Case(step, params, (_shard(x, mesh),),
                {"config": Config(), "train": True, "lr": schedule},
                static_argnames=("config", "train", "lr"), kinds={"gradient": 3})


def optax_clip_schedule_accumulate(pmean: Callable[..., Any] | None = None) -> Case:
    """optax: global-norm clipping (one norm reads every gradient before any update), a
    warm-up cosine schedule and gradient accumulation (`optax.MultiSteps`)."""
    pmean = pmean or _lax_pmean
    import optax

    mesh = _mesh()
    rng = np.random.default_rng(5)
    params = {f"layer{i}": {"w": (rng.standard_normal((10, 10)) * 0.3).astype(np.float32),
                            "b": np.zeros(10, np.float32)} for i in range(3)}
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    tx = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0),
                                      optax.adamw(schedule)), every_k_schedule=2)
    x = rng.standard_normal((N * 4, 10)).astype(np.float32)

    def local(state, x):
        def loss_fn(p):
            h = x
            for i in range(3):
                h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
            return jnp.mean(h ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        grads = pmean(grads, "data")
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, \
            pmean(loss, "data")

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                         check_vma=False)
    return Case(step, {"params": params, "opt": tx.init(params)}, (_shard(x, mesh),),
                kinds={"gradient": 7})


def flax_nn_scan(pmean: Callable[..., Any] | None = None) -> Case:
    """Scan over layers, Flax's way: `nn.scan` over 4 identical blocks (stacked parameters),
    in `shard_map` with `check_vma=True` (autodiff's gradient psums sit in the backward scan's
    body), optax Adam."""
    pmean = pmean or _lax_pmean
    import flax.linen as nn
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + jnp.tanh(nn.Dense(24)(nn.LayerNorm()(h))), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(24)(x)
            h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=4)()(h, None)
            return nn.Dense(2)(h)

    net = Net()
    mesh = _mesh()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((N * 4, 10)).astype(np.float32)
    y = rng.standard_normal((N * 4, 2)).astype(np.float32)
    params = net.init(jax.random.key(6), x[:1])["params"]
    tx = optax.adam(1e-2)

    step = _mse_step(lambda p, x: net.apply({"params": p}, x), tx, mesh, pmean)
    # Dense in 2, Dense out 2, the scanned block's Dense 2 and LayerNorm 2, hoisted; the loss.
    return Case(step, {"params": params, "opt": tx.init(params)},
                (_shard(x, mesh), _shard(y, mesh)), autodiff_psums=True,
                kinds={"gradient": 9}, loops=("hoist",))


def stacked_scan_shared(pmean: Callable[..., Any] | None = None) -> Case:
    """Scan over layers, by hand (MaxText-style): `lax.scan` over stacked weights that also
    closes over one weight every layer shares. The stacked weights' psums leave the loop; the
    shared weight's cotangent accumulates in the carry, so its psum stays in the body."""
    pmean = pmean or _lax_pmean
    mesh = _mesh()
    rng = np.random.default_rng(7)
    L, D = 6, 16
    params = {"layers": {"w": (rng.standard_normal((L, D, D)) * 0.2).astype(np.float32),
                         "b": np.zeros((L, D), np.float32)},
              "shared": (rng.standard_normal((D, D)) * 0.2).astype(np.float32),
              "head": (rng.standard_normal((D, 1)) * 0.2).astype(np.float32)}
    x = rng.standard_normal((N * 4, D)).astype(np.float32)

    def local(params, x):
        def loss_fn(p):
            def layer(h, w):
                return jnp.tanh(h @ w["w"] + w["b"]) + 0.1 * (h @ p["shared"]), None
            h, _ = jax.lax.scan(layer, x, p["layers"])
            return pmean(jnp.mean((h @ p["head"]) ** 2), "data")
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda a, g: a - 0.05 * g, params, grads), loss

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    # head, and the stacked w and b (hoisted): gradient; the shared weight's psum stays in the
    # loop, the body's one gradient psum, planned there for each iteration.
    return Case(step, params, (_shard(x, mesh),), autodiff_psums=True,
                kinds={"gradient": 5}, loops=("hoist",))


def pmap_substeps(pmean: Callable[..., Any] | None = None) -> Case:
    """A `jax.pmap` trainer that runs several optimizer steps per call (VDM-style): a
    `lax.scan` over 4 substeps, each a whole train step (loss, gradient `pmean`ed over the
    devices, AdamW update), the parameters and optimizer state in the carry."""
    pmean = pmean or _lax_pmean
    import flax.linen as nn
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.gelu(nn.Dense(32)(x))
            return nn.Dense(3)(nn.LayerNorm()(h + nn.Dense(32)(h)))

    net = Net()
    rng = np.random.default_rng(14)
    substeps = 4
    x = rng.standard_normal((N, substeps, 8, 12)).astype(np.float32)
    y = rng.standard_normal((N, substeps, 8, 3)).astype(np.float32)
    params = net.init(jax.random.key(14), x[0, 0])["params"]
    tx = optax.adamw(1e-2)

    def step(state, x, y):
        def substep(carry, batch):
            params, opt = carry
            xb, yb = batch
            loss, grads = jax.value_and_grad(
                lambda p: jnp.mean((net.apply({"params": p}, xb) - yb) ** 2))(params)
            grads = pmean(grads, "batch")
            updates, opt = tx.update(grads, opt, params)
            return (optax.apply_updates(params, updates), opt), pmean(loss, "batch")
        (params, opt), losses = jax.lax.scan(substep, (state["params"], state["opt"]), (x, y))
        return {"params": params, "opt": opt}, {"loss": losses[-1]}

    replicate = functools.partial(jax.tree.map, lambda a: np.broadcast_to(a, (N, *a.shape)))
    pstep = jax.pmap(step, axis_name="batch", donate_argnums=0)
    # 8 parameters, planned per substep in the scan's body; each substep's loss with them.
    return Case(pstep, replicate({"params": params, "opt": tx.init(params)}), (x, y),
                pmap=True, kinds={"gradient": 9}, loops=("in-loop",))


def accumulate_pmean_per_microbatch(pmean: Callable[..., Any] | None = None) -> Case:
    """Gradient accumulation that all-reduces each microbatch: a `lax.scan` over 4
    microbatches in a `shard_map` (no `check_vma`), each one's gradient `pmean`ed and added
    to the carry, one SGD-with-momentum update after the loop."""
    pmean = pmean or _lax_pmean
    import optax

    mesh = _mesh()
    rng = np.random.default_rng(15)
    params = {"w1": (rng.standard_normal((12, 24)) * 0.3).astype(np.float32),
              "b1": np.zeros(24, np.float32),
              "w2": (rng.standard_normal((24, 3)) * 0.3).astype(np.float32),
              "b2": np.zeros(3, np.float32)}
    x = rng.standard_normal((N * 16, 12)).astype(np.float32)
    y = rng.standard_normal((N * 16, 3)).astype(np.float32)
    tx = optax.sgd(0.05, momentum=0.9)

    def local(state, x, y):
        def loss_fn(p, xb, yb):
            return jnp.mean((jnp.tanh(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - yb) ** 2)

        def micro(acc, batch):
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], *batch)
            grads = pmean(grads, "data")
            return jax.tree.map(jnp.add, acc, grads), loss
        micro_batches = (x.reshape(4, -1, 12), y.reshape(4, -1, 3))
        grads, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, state["params"]),
                                     micro_batches)
        grads = jax.tree.map(lambda g: g / 4, grads)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt": opt},
                pmean(jnp.mean(losses), "data"))

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=(P(), P()), check_vma=False)
    # 4 parameters, planned per microbatch in the scan's body; the mean loss, read from the
    # scan (which holds the backward pass), planned at top level as a gradient by the rule.
    return Case(step, {"params": params, "opt": tx.init(params)},
                (_shard(x, mesh), _shard(y, mesh)), kinds={"gradient": 5},
                loops=("in-loop",))


def gspmd_route(pmean: Callable[..., Any] | None = None) -> Case:
    """A GSPMD step (`jax.jit` over `NamedSharding` inputs under `jax.set_mesh`, no psum of its
    own) with its gradient taken by `libra_jax.value_and_grad` in `jax.value_and_grad`'s place;
    Flax linen MLP, optax AdamW, an accuracy metric in `aux`."""
    del pmean  # a GSPMD step calls no pmean: nothing for a drop-in to swap
    import flax.linen as nn
    import optax

    import libra_jax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.gelu(nn.Dense(32)(x)))

    net = MLP()
    mesh = _mesh()
    rng = np.random.default_rng(8)
    x = rng.standard_normal((N * 4, 12)).astype(np.float32)
    labels = rng.integers(0, 4, (N * 4,)).astype(np.int32)
    params = net.init(jax.random.key(8), x[:1])["params"]
    tx = optax.adamw(1e-2)

    def loss_fn(p, x, labels):
        logits = net.apply({"params": p}, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}

    def step(state, x, labels):
        (loss, metrics), grads = libra_jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], x, labels)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt": opt},
                {"loss": loss, **metrics})

    state = jax.device_put({"params": params, "opt": tx.init(params)}, NamedSharding(mesh, P()))
    # 4 parameters, in the backward shard_map; the loss and the accuracy, pmean'ed by the
    # route in the forward shard_map, where no backward pass shows (rewrite's rule: planned).
    return Case(step, state, (_shard(x, mesh), _shard(labels, mesh)), autodiff_psums=True,
                context=lambda: jax.set_mesh(mesh), kinds={"gradient": 6},
                drop_in=False)


def gspmd_route_size_one_axis(pmean: Callable[..., Any] | None = None) -> Case:
    """The route on a ``('batch', 'model')`` mesh of (8, 1) explicit axes, as Flax's NNX
    tutorials lay a model out: kernels partitioned over ``'model'``, of one device, so
    replicated; plain `jax.value_and_grad`-style loss, optax SGD with momentum."""
    del pmean  # a GSPMD step calls no pmean
    import optax

    import libra_jax

    mesh = jax.make_mesh((N, 1), ("batch", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu")[:N])
    rng = np.random.default_rng(12)
    lay = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    params = {"w1": (rng.standard_normal((12, 32)) * 0.3).astype(np.float32),
              "b1": np.zeros(32, np.float32),
              "w2": (rng.standard_normal((32, 3)) * 0.3).astype(np.float32)}
    params = {k: jax.device_put(v, NamedSharding(mesh, lay[k])) for k, v in params.items()}
    x = jax.device_put(rng.standard_normal((N * 4, 12)).astype(np.float32),
                       NamedSharding(mesh, P("batch")))
    y = jax.device_put(rng.standard_normal((N * 4, 3)).astype(np.float32),
                       NamedSharding(mesh, P("batch")))
    tx = optax.sgd(0.05, momentum=0.9)

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    def step(state, x, y):
        loss, grads = libra_jax.value_and_grad(loss_fn, axis_name="batch")(state["params"], x, y)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    with jax.set_mesh(mesh):  # optax's init jitted on the explicit mesh's arrays
        state = {"params": params, "opt": tx.init(params)}
    # 3 parameters and the loss (as gspmd-route).
    return Case(step, state, (x, y), autodiff_psums=True, context=lambda: jax.set_mesh(mesh),
                kinds={"gradient": 4}, drop_in=False)


def nnx_route(pmean: Callable[..., Any] | None = None) -> Case:
    """A Flax NNX model (LayerNorm, dropout from its `Rngs`) through the route as through
    `nnx.value_and_grad`: the model passed whole, the gradient an `nnx.State`,
    `nnx.Optimizer` updating the model in place; compiled by `nnx.jit`."""
    del pmean  # a GSPMD step calls no pmean
    from flax import nnx
    import optax

    import libra_jax

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(12, 24, rngs=rngs)
            self.norm = nnx.LayerNorm(24, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.b = nnx.Linear(24, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(nnx.gelu(self.norm(self.a(x)))))

    mesh = _mesh()
    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    def loss_fn(model, x, y):
        logits = model(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == y)

    def step(state, x, y):
        model, optimizer = state
        (loss, accuracy), grads = libra_jax.value_and_grad(loss_fn, has_aux=True)(model, x, y)
        optimizer.update(model, grads)
        return state, {"loss": loss, "accuracy": accuracy}

    rng = np.random.default_rng(13)
    x = rng.standard_normal((N * 4, 12)).astype(np.float32)
    y = rng.integers(0, 4, N * 4).astype(np.int32)
    return Case(step, (model, optimizer), (_shard(x, mesh), _shard(y, mesh)),
                library_jit=nnx.jit, in_place=True, autodiff_psums=True, drop_in=False,
                kinds={"gradient": 8})  # 6 parameters; the loss and accuracy (as gspmd-route)


def _fsdp_problem(seed: int) -> tuple[jax.sharding.Mesh, dict[str, np.ndarray], np.ndarray,
                                       np.ndarray]:
    """The FSDP steps' mesh, three weights of an MLP 16 -> 32 -> 32 -> 16 (every dimension
    divisible by N), and a regression batch (x, y)."""
    rng = np.random.default_rng(seed)
    params = {"w1": (rng.standard_normal((16, 32)) * 0.3).astype(np.float32),
              "w2": (rng.standard_normal((32, 32)) * 0.2).astype(np.float32),
              "w3": (rng.standard_normal((32, 16)) * 0.2).astype(np.float32)}
    x = rng.standard_normal((N * 4, 16)).astype(np.float32)
    y = rng.standard_normal((N * 4, 16)).astype(np.float32)
    return _mesh(), params, x, y


def fsdp_remat(pmean: Callable[..., Any] | None = None) -> Case:
    """FSDP (ZeRO-3) under `shard_map`: every weight sharded over the data axis along its first
    dimension, all-gathered where a layer reads it, each layer under `jax.checkpoint` (remat
    gathers the weight again in the backward pass); `check_vma`: the gradients are the
    all-gathers' transposes, psum_scatters, one per weight; SGD on the shards."""
    pmean = pmean or _lax_pmean
    mesh, params, x, y = _fsdp_problem(21)

    @jax.checkpoint
    def layer(w, h):
        return jnp.tanh(h @ jax.lax.all_gather(w, "data", tiled=True))

    def local(params, x, y):
        def loss_fn(p):
            h = x
            for name in ("w1", "w2", "w3"):
                h = layer(p[name], h)
            return pmean(jnp.mean((h - y) ** 2), "data")
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    step = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data"), P("data")),
                         out_specs=(P("data"), P()))
    # Gradients: the 3 psum_scatters; forward: the 3 all-gathers and the loss's psum;
    # backward: remat's 3 re-gathers.
    return Case(step, {k: _shard(v, mesh) for k, v in params.items()},
                (_shard(x, mesh), _shard(y, mesh)),
                kinds={"gradient": 3, "forward": 4, "backward": 3})


def fsdp_explicit_psum_scatter(pmean: Callable[..., Any] | None = None) -> Case:
    """FSDP written out (`check_vma=False`): the weights all-gathered before the loss, the
    full gradients taken locally and reduce-scattered explicitly by
    `jax.lax.psum_scatter(..., tiled=True)` (mean over ranks); the last weight is sharded
    along its second dimension (scatter_dimension=1: in the others' bucket all the same)."""
    pmean = pmean or _lax_pmean
    mesh, params, x, y = _fsdp_problem(22)
    dims = {"w1": 0, "w2": 0, "w3": 1}

    def local(params, x, y):
        full = {k: jax.lax.all_gather(w, "data", axis=dims[k], tiled=True)
                for k, w in params.items()}

        def loss_fn(p):
            h = x
            for name in ("w1", "w2", "w3"):
                h = jnp.tanh(h @ p[name])
            return jnp.mean((h - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(full)
        grads = {k: jax.lax.psum_scatter(g, "data", scatter_dimension=dims[k], tiled=True) / N
                 for k, g in grads.items()}
        return ({k: params[k] - 0.1 * grads[k] for k in params}, pmean(loss, "data"))

    specs = {"w1": P("data"), "w2": P("data"), "w3": P(None, "data")}
    step = jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data"), P("data")),
                         out_specs=(specs, P()), check_vma=False)
    state = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    return Case(step, state, (_shard(x, mesh), _shard(y, mesh)),
                kinds={"gradient": 3, "forward": 4})  # forward: 3 all-gathers, the loss


def fsdp_mixed_replicated(pmean: Callable[..., Any] | None = None) -> Case:
    """FSDP beside replicated parameters, as sharded transformers keep their norms: the weights
    sharded and all-gathered (gradients: psum_scatters), a scale and a bias per layer
    replicated (gradients: the psums `check_vma` inserts); momentum SGD, its state sharded
    as the parameters are. One backward stream of all-reduces and reduce-scatters for the
    planner."""
    pmean = pmean or _lax_pmean
    mesh, weights, x, y = _fsdp_problem(23)
    params = {"weights": weights,
              "scale": {k: np.ones(w.shape[1], np.float32) for k, w in weights.items()},
              "bias": {k: np.zeros(w.shape[1], np.float32) for k, w in weights.items()}}
    specs = {"weights": P("data"), "scale": P(), "bias": P()}

    def local(state, x, y):
        def loss_fn(p):
            h = x
            for name in ("w1", "w2", "w3"):
                full = jax.lax.all_gather(p["weights"][name], "data", tiled=True)
                h = jnp.tanh(h @ full) * p["scale"][name] + p["bias"][name]
            return pmean(jnp.mean((h - y) ** 2), "data")
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
        params = jax.tree.map(lambda p, m: p - 0.05 * m, state["params"], momentum)
        return {"params": params, "momentum": momentum}, loss

    state_specs = {"params": specs, "momentum": specs}
    step = jax.shard_map(local, mesh=mesh, in_specs=(state_specs, P("data"), P("data")),
                         out_specs=(state_specs, P()))
    state = {"params": params, "momentum": jax.tree.map(np.zeros_like, params)}
    shardings = {part: {k: NamedSharding(mesh, spec) for k, spec in specs.items()}
                 for part in state}
    return Case(step, jax.device_put(state, shardings), (_shard(x, mesh), _shard(y, mesh)),
                autodiff_psums=True, kinds={"gradient": 10, "forward": 3})


def _fsdp_route_case(seed: int, mesh: jax.sharding.Mesh, tx: Any, in_specs: bool,
                     kinds: dict[str, int]) -> Case:
    """A GSPMD step of the FSDP problem (`_fsdp_problem`) through `libra_jax.value_and_grad`:
    the weights sharded over ``data`` (the last along its columns), a bias per layer
    replicated, the optimizer's state laid out as the parameters. With `in_specs`, the
    layout is given to the route (an auto mesh: traced values carry none); without, it is
    read from the explicit mesh's traced values."""
    import libra_jax

    _, weights, x, y = _fsdp_problem(seed)
    layout = {"w1": P("data"), "w2": P("data"), "w3": P(None, "data")}
    params = {"weights": weights, "bias": {k: np.zeros(w.shape[1], np.float32)
                                           for k, w in weights.items()}}
    specs = {"weights": layout, "bias": {k: P() for k in weights}}

    def loss_fn(p, x, y):
        h = x
        for name in ("w1", "w2", "w3"):
            h = jnp.tanh(h @ p["weights"][name] + p["bias"][name])
        return jnp.mean((h - y) ** 2)

    grad_fn = libra_jax.value_and_grad(
        loss_fn, in_specs=(specs, P("data"), P("data")) if in_specs else None)

    def step(state, x, y):
        loss, grads = grad_fn(state["params"], x, y)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax_apply(state["params"], updates), "opt": opt}, loss

    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    with jax.set_mesh(mesh):  # optax's init on the explicit mesh's arrays
        state = {"params": params, "opt": tx.init(params)}
    batch = tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    return Case(step, state, batch, autodiff_psums=True, context=lambda: jax.set_mesh(mesh),
                kinds=kinds, drop_in=False)


def optax_apply(params: Any, updates: Any) -> Any:
    import optax
    return optax.apply_updates(params, updates)


def fsdp_gspmd_route(pmean: Callable[..., Any] | None = None) -> Case:
    """FSDP as GSPMD code on an explicit-sharding 1-D mesh (traced values carry their
    sharding), through the route; optax AdamW."""
    del pmean  # a GSPMD step calls no pmean
    import optax
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:N]), ("data",),
                             axis_types=(jax.sharding.AxisType.Explicit,))
    # Forward: 3 all-gathers and the loss's pmean; gradients: 3 reduce-scatters, 3 biases'
    # psums (and the loss, as gspmd-route).
    return _fsdp_route_case(24, mesh, optax.adamw(1e-2), in_specs=False,
                            kinds={"forward": 3, "gradient": 7})


def fsdp_gspmd_route_2d(pmean: Callable[..., Any] | None = None) -> Case:
    """FSDP as GSPMD code on an auto (data 4 x model 2) mesh, parameters sharded over data
    only, their layout given by ``in_specs``; momentum SGD."""
    del pmean  # a GSPMD step calls no pmean
    import optax
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:N]).reshape(4, 2), ("data", "model"))
    return _fsdp_route_case(25, mesh, optax.sgd(0.05, momentum=0.9), in_specs=True,
                            kinds={"forward": 3, "gradient": 7})


CASES: dict[str, Callable[..., Case]] = {
    "flax-batchnorm-pmap": flax_batchnorm_pmap,
    "transformer-dropout": transformer_dropout,
    "nnx": nnx_model,
    "nnx-in-place": nnx_in_place,
    "equinox-mlp": equinox_mlp,
    "set-mesh-autodiff": set_mesh_autodiff,
    "static-config": static_config,
    "optax-clip-schedule-multisteps": optax_clip_schedule_accumulate,
    "flax-nn-scan": flax_nn_scan,
    "stacked-scan-shared": stacked_scan_shared,
    "pmap-substeps": pmap_substeps,
    "accumulate-pmean-per-microbatch": accumulate_pmean_per_microbatch,
    "gspmd-route": gspmd_route,
    "gspmd-route-size-one-axis": gspmd_route_size_one_axis,
    "nnx-route": nnx_route,
    "fsdp-remat": fsdp_remat,
    "fsdp-explicit-psum-scatter": fsdp_explicit_psum_scatter,
    "fsdp-mixed-replicated": fsdp_mixed_replicated,
    "fsdp-gspmd-route": fsdp_gspmd_route,
    "fsdp-gspmd-route-2d": fsdp_gspmd_route_2d,
}
