"""`libra_jax.rewrite.shrink`: a psum that feeds only a linear map shrinking it (a broadcast
bias's `reduce_sum`, a one-hot contraction's `dot_general`) is issued after the map, at its
output's size, and planned as the gradient it is; the values bitwise the XLA control's and
class 3 of the plain step's (docs/bitwise.md)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from libra_jax.rewrite import optimize
from libra_jax.rewrite.shrink import shrink_psums

from conftest import assert_bitwise, assert_codegen_close, mesh_of, shard

pytestmark = pytest.mark.usefixtures("jax_8")

ROWS, POSITIONS, FEATURES, LAYERS = 2, 16, 128, 3   # per device
ACTIVATION = ROWS * POSITIONS * FEATURES * 4         # the cotangent psummed today
BIAS = FEATURES * 4
WEIGHT = FEATURES * FEATURES * 4


def _haliax_layer(h, w, b):
    """A layer as haliax writes it: the bias broadcast to the activation's shape, then
    added (under check_vma the `pvary` follows the broadcast)."""
    h = h @ w
    return jnp.tanh(h + jnp.broadcast_to(b, h.shape))


def _data_parallel(loss, check_vma=True):
    mesh = mesh_of((8,), ("data",))

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        if not check_vma:
            grads = jax.lax.psum(grads, "data")
        return (jax.lax.pmean(value, "data"),
                jax.tree.map(lambda p, g: p - 0.01 * g, params, grads))
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                                 check_vma=check_vma))


def _x(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8 * ROWS, POSITIONS, FEATURES)).astype(np.float32)
    return shard(x, mesh_of((8,), ("data",)), P("data"))


def _checked(step, *args, **options):
    """The optimized step's report, its values bitwise its XLA control's (the same rewritten
    program) and within class 3 of the plain step's (another summation order)."""
    opt = optimize(step, **options)
    got = jax.jit(opt)(*args)
    control = jax.jit(optimize(step, collectives="xla", **options))(*args)
    jax.tree.map(assert_bitwise, got, control)
    assert_codegen_close(got, step(*args))
    return opt.last_report


def _gradient_bytes(report, scope_suffix=""):
    # (Less the loss's pmean, a 4-byte bucket of its own under fusion=False: nothing reads
    # it, so it is planned with the gradients: `rewrite.sites.value_sites`.)
    return sorted(p.nbytes for p in report.plans
                  if p.kind == "gradient" and p.scope.endswith(scope_suffix) and p.nbytes != 4)


def test_a_haliax_bias_is_planned_at_the_bias_bytes():
    rng = np.random.default_rng(1)
    params = {"w": (rng.standard_normal((FEATURES, FEATURES)) * 0.05).astype(np.float32),
              "b": (rng.standard_normal(FEATURES) * 0.1).astype(np.float32)}

    def loss(p, x):
        return jnp.mean(_haliax_layer(x, p["w"], p["b"]) ** 2)
    report = _checked(_data_parallel(loss), params, _x(), fusion=False)
    assert _gradient_bytes(report) == [BIAS, WEIGHT], report.plan_lines()


@pytest.mark.parametrize("loops", ["in-loop", "hoist", "remat"])
def test_a_haliax_bias_in_a_scan_over_layers_is_planned_at_the_bias_bytes(loops):
    """Levanter's GPT-2: the bias's psum sits in the backward scan's body; moved past the
    broadcast's transpose it is a stacked slice the scope may hoist too. Under remat (as
    Levanter scans) it sits in the body's `checkpoint`, where it stays, at the bias's size
    (kind "loop": no psum of that scope shows it is on the backward pass, the weight's
    neither)."""
    rng = np.random.default_rng(2)
    params = {"w": (rng.standard_normal((LAYERS, FEATURES, FEATURES)) * 0.05).astype(np.float32),
              "b": (rng.standard_normal((LAYERS, FEATURES)) * 0.1).astype(np.float32)}
    layer = lambda h, wb: (_haliax_layer(h, *wb), None)  # noqa: E731

    def loss(p, x):
        h, _ = jax.lax.scan(jax.checkpoint(layer) if loops == "remat" else layer, x,
                            (p["w"], p["b"]))
        return jnp.mean(h ** 2)
    report = _checked(_data_parallel(loss), params, _x(), fusion=False,
                      loops="auto" if loops == "remat" else loops)
    assert ACTIVATION not in [p.nbytes for p in report.plans], report.plan_lines()
    if loops == "remat":
        body = sorted(p.nbytes for p in report.plans if p.scope.endswith("scan#2/remat2"))
        assert body == [BIAS, WEIGHT], report.plan_lines()
    elif loops == "in-loop":
        assert _gradient_bytes(report, "scan#2") == [BIAS, WEIGHT], report.plan_lines()
    else:
        assert _gradient_bytes(report) == [LAYERS * BIAS, LAYERS * WEIGHT], report.plan_lines()


def test_a_t5x_relative_position_bias_is_planned_at_the_embedding_bytes():
    """T5X's relative-position bias: an embedding contracted with an invariant one-hot of
    the position buckets; its cotangent's psum moves past the broadcast over the rows and the
    contraction, from [heads, q, k] to the embedding's [buckets, heads]."""
    heads, buckets = 4, 8
    rng = np.random.default_rng(3)
    params = {"w": (rng.standard_normal((FEATURES, FEATURES)) * 0.05).astype(np.float32),
              "emb": rng.standard_normal((buckets, heads)).astype(np.float32)}

    def loss(p, x):
        q = x @ p["w"]
        logits = jnp.einsum("bqd,bkd->bqk", q, x) / FEATURES
        relative = jnp.arange(POSITIONS)[None, :] - jnp.arange(POSITIONS)[:, None]
        one_hot = jax.nn.one_hot(jnp.clip(relative + buckets // 2, 0, buckets - 1), buckets)
        bias = jnp.einsum("qkn,nh->hqk", one_hot, p["emb"])
        return jnp.mean(jax.nn.softmax(logits[:, None] + bias[None]) ** 2)
    report = _checked(_data_parallel(loss), params, _x(), fusion=False)
    assert _gradient_bytes(report) == [buckets * heads * 4, WEIGHT], report.plan_lines()


# --- What is not moved -------------------------------------------------------------------------

def _shrunk(fn, *avals):
    """(the primitive names of `fn`'s jaxpr after `shrink_psums`, in order) of the shard_map
    body of `fn` over 8 devices."""
    jaxpr = jax.make_jaxpr(fn)(*avals).jaxpr
    body, = [e.params["jaxpr"] for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    body = getattr(body, "jaxpr", body)
    return [e.primitive.name for e in shrink_psums(body.eqns, body.outvars)]


def _body(local, check_vma=True, n_in=1):
    mesh = mesh_of((8,), ("data",))
    return jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * n_in, out_specs=P(),
                         check_vma=check_vma)


def _psum(x):
    return jax.lax.psum(x, "data")


def test_a_psum_feeding_a_shrinking_reduce_sum_moves_with_or_without_check_vma():
    x = jax.ShapeDtypeStruct((16, 4), np.float32)
    for check_vma, name in ((True, "psum_invariant"), (False, "psum")):
        names = _shrunk(_body(lambda x: _psum(x).sum(0), check_vma), x)
        assert names.index("reduce_sum") < names.index(name), names


def test_a_psum_with_another_reader_is_not_moved():
    x = jax.ShapeDtypeStruct((16, 4), np.float32)
    names = _shrunk(_body(lambda x: (lambda s: s.sum(0) + s[0])(_psum(x))), x)
    assert names.index("psum_invariant") < names.index("reduce_sum"), names
    # nor one the scope returns
    mesh = mesh_of((8,), ("data",))
    both = jax.shard_map(lambda x: (lambda s: (s.sum(0), s))(_psum(x)), mesh=mesh,
                         in_specs=P("data"), out_specs=(P(), P()))
    names = _shrunk(both, x)
    assert names.index("psum_invariant") < names.index("reduce_sum"), names


def test_a_psum_contracted_with_a_varying_operand_is_not_moved():
    x = jax.ShapeDtypeStruct((16, 8), np.float32)
    y = jax.ShapeDtypeStruct((8, 2), np.float32)
    mesh = mesh_of((8,), ("data",))

    def contract(in_spec):
        return jax.shard_map(lambda x, y: _psum(x) @ y, mesh=mesh, in_specs=(P("data"), in_spec),
                             out_specs=P() if in_spec == P() else P("data"))
    varying = _shrunk(contract(P("data")), x, jax.ShapeDtypeStruct((64, 2), np.float32))
    assert varying.index("psum_invariant") < varying.index("dot_general"), varying
    invariant = _shrunk(contract(P()), x, y)  # the same contraction of an invariant operand
    assert invariant.index("dot_general") < invariant.index("psum_invariant"), invariant
    assert invariant[invariant.index("dot_general") - 1] == "pvary", invariant
    # Without check_vma types say nothing of the other operand: not moved.
    untyped = jax.shard_map(lambda x, y: _psum(x) @ y, mesh=mesh, in_specs=(P("data"), P()),
                            out_specs=P(), check_vma=False)
    names = _shrunk(untyped, x, y)
    assert names.index("psum") < names.index("dot_general"), names


def test_a_psum_is_not_moved_past_a_map_that_does_not_shrink_it():
    x = jax.ShapeDtypeStruct((16, 4), np.float32)
    y = jax.ShapeDtypeStruct((4, 64), np.float32)
    mesh = mesh_of((8,), ("data",))
    grows = jax.shard_map(lambda x, y: _psum(x) @ y, mesh=mesh, in_specs=(P("data"), P()),
                          out_specs=P())
    names = _shrunk(grows, x, y)
    assert names.index("psum_invariant") < names.index("dot_general"), names
    reshaped = _shrunk(_body(lambda x: _psum(x).reshape(8)), x)
    assert reshaped.index("psum_invariant") < reshaped.index("reshape"), reshaped


def test_values_of_a_moved_forward_psum_are_bitwise_the_control():
    """A forward psum moved past a sum (the loss of per-example terms): class 3 of the plain
    step, bitwise its XLA control."""
    step = jax.jit(_body(lambda x: _psum(x * x).sum(axis=(0, 1))))
    x = _x(4)
    opt = optimize(step)
    got = jax.jit(opt)(x)
    assert_bitwise(got, jax.jit(optimize(step, collectives="xla"))(x))
    assert_codegen_close(got, step(x))
    assert [p.nbytes for p in opt.last_report.plans] == [BIAS], opt.last_report.plan_lines()
