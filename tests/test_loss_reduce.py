"""How the route's loss and aux combine over the batch (`value_and_grad(loss_reduce=,
aux_reduce=)`, issue 70): losses and metrics as trainers write them (T5X's sum over tokens,
a loss normalised by the batch's real-token count, clu-style metric dicts), each class 3 of
plain `jax.value_and_grad` under `jax.jit` on the same mesh, the optimized route bitwise its
XLA control."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import libra_jax

from conftest import assert_bitwise, assert_trees_close as close, data_mesh as make_mesh
from conftest import shard as put

pytestmark = pytest.mark.usefixtures("jax_8")

KINDS = ("auto", "explicit")


def problem(mesh, seed=0):
    """Parameters, and a padded batch of 64 sequences of 6 tokens (a mask of real ones)."""
    rng = np.random.default_rng(seed)
    w = put(rng.standard_normal((16, 8)).astype(np.float32) / 4, mesh, P())
    x = put(rng.standard_normal((64, 6, 16)).astype(np.float32), mesh, P("data"))
    y = put(rng.integers(0, 8, (64, 6)).astype(np.int32), mesh, P("data"))
    lengths = rng.integers(1, 7, (64,))
    mask = put((np.arange(6)[None] < lengths[:, None]).astype(np.float32), mesh, P("data"))
    return w, x, y, mask


def token_losses(w, x, y):
    logits = jnp.tanh(x @ w) * 3
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)[..., 0]


def sum_loss(w, x, y, mask):
    """T5X's default: the sum of the real tokens' losses."""
    return jnp.sum(token_losses(w, x, y) * mask)


def normalised_loss(w, x, y, mask):
    """Normalised by the batch's real-token count (T5X's NUM_REAL_TARGET_TOKENS)."""
    return jnp.sum(token_losses(w, x, y) * mask) / jnp.sum(mask)


def normalised_parts(w, x, y, mask):
    """The same loss as the pair it divides, for ``loss_reduce="ratio"``."""
    return jnp.sum(token_losses(w, x, y) * mask), jnp.sum(mask)


def check(kind, loss, want_loss, jitted=True, **options):
    mesh = make_mesh(kind)
    args = problem(mesh)
    vg = libra_jax.value_and_grad(loss, **options)
    with jax.set_mesh(mesh):
        want = jax.jit(jax.value_and_grad(want_loss))(*args)
        got = jax.jit(vg)(*args) if jitted else vg(*args)
        if jitted:
            fast = jax.jit(libra_jax.optimize(vg))(*args)
            control = jax.jit(libra_jax.optimize(vg, collectives="xla"))(*args)
            jax.tree.map(assert_bitwise, fast, control)
    close(got, want)
    return got, want


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_sum_loss_is_gspmds_under_loss_reduce_sum(kind, jitted):
    """T5X's sum loss: the mean of the shards' sums was 1/8 of GSPMD's (loss 76.30 for
    610.43, every gradient 1/8). ``loss_reduce="sum"`` sums the shards' losses."""
    got, want = check(kind, sum_loss, sum_loss, jitted, loss_reduce="sum")
    assert float(got[0]) > 100


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_globally_normalised_loss_is_gspmds_as_a_ratio(kind, jitted):
    """Normalised by the whole batch's real-token count: a mean of shard means differs;
    written as the pair it divides, ``loss_reduce="ratio"`` sums both over the shards, then
    divides."""
    check(kind, normalised_parts, normalised_loss, jitted, loss_reduce="ratio")


def test_the_default_is_the_mean_of_the_shards_losses():
    """``"mean"`` (the default) is what the route did: GSPMD's for a mean over examples."""
    def mean_loss(w, x, y, mask):
        return jnp.mean(token_losses(w, x, y))
    check("explicit", mean_loss, mean_loss)
    check("explicit", mean_loss, mean_loss, loss_reduce="mean")


def notices(loss, **options):
    """The notices' ids the route's trace of `loss` gives (under jax.jit), in order."""
    import warnings
    mesh = make_mesh("auto")
    with warnings.catch_warnings(record=True) as caught, jax.set_mesh(mesh):
        warnings.simplefilter("always")
        jax.jit(libra_jax.value_and_grad(loss, **options))(*problem(mesh))
    return [str(w.message).split("[libra_jax notice ")[1].split(":")[0]
            for w in caught if "[libra_jax notice " in str(w.message)]


def test_a_sum_loss_under_the_default_is_noticed():
    """T5X's sum loss under the default reduction was 1/8 of GSPMD's, and nothing said so: a
    notice names the option. A mean, a loss normalised by a count (a division after the sum)
    and an explicit reduction give none."""
    assert notices(sum_loss) == ["loss-is-a-sum"]
    # through additions and casts: a sum is still a sum
    assert notices(lambda *a: (sum_loss(*a) - 1.0).astype(jnp.bfloat16).astype(
        jnp.float32)) == ["loss-is-a-sum"]
    assert notices(lambda w, x, y, mask: jnp.mean(token_losses(w, x, y))) == []
    assert notices(normalised_loss) == []
    assert notices(lambda *a: sum_loss(*a) / 384.0) == []
    assert notices(sum_loss, loss_reduce="mean") == []
    assert notices(sum_loss, loss_reduce="sum") == []
    assert notices(normalised_parts, loss_reduce="ratio") == []


def test_a_penalty_under_a_sum_is_refused_in_one_line():
    """A term the same on every shard (a weight penalty) added to a summed loss would count
    once per shard: refused, naming the option."""
    def penalised(w, x, y, mask):
        return sum_loss(w, x, y, mask) + 0.01 * jnp.sum(w ** 2)
    mesh = make_mesh("auto")
    with pytest.raises(ValueError, match=r"^libra_jax.value_and_grad: with loss_reduce='sum' "
                                         r"the loss adds a term that is the same on every "
                                         r"shard"):
        jax.jit(libra_jax.value_and_grad(penalised, loss_reduce="sum"))(*problem(mesh))


def test_bad_loss_reduce_is_named():
    with pytest.raises(ValueError, match="loss_reduce must be one of 'mean', 'sum', 'ratio'"):
        libra_jax.value_and_grad(sum_loss, loss_reduce="total")
    mesh = make_mesh("auto")
    with pytest.raises(TypeError, match=r"loss_reduce='ratio'.*a pair \(numerator, "
                                        r"denominator\)"):
        jax.jit(libra_jax.value_and_grad(sum_loss, loss_reduce="ratio"))(*problem(mesh))


# --- aux as clu-style metrics ---------------------------------------------------------------

def metrics_loss(w, x, y, mask):
    losses = token_losses(w, x, y)
    correct = (jnp.argmax(jnp.tanh(x @ w), -1) == y) * mask
    metrics = {"loss_sum": jnp.sum(losses * mask), "tokens": jnp.sum(mask),
               "examples": jnp.asarray(x.shape[0], jnp.int32),
               "accuracy": (jnp.sum(correct), jnp.sum(mask))}
    return jnp.sum(losses * mask) / jnp.sum(mask), metrics


@pytest.mark.parametrize("kind", KINDS)
def test_aux_reduce_per_leaf_as_clu_metrics_need(kind):
    """One reduction per metric (a pytree prefix of aux): per-token sums and counts summed,
    accuracy as a ratio of sums, a per-shard value stacked. With one "sum" for all, six of
    T5X's metrics were wrong."""
    mesh = make_mesh(kind)
    args = problem(mesh)
    reduce = {"loss_sum": "sum", "tokens": "sum", "examples": "sum", "accuracy": "ratio",
              "first_loss": None}

    def parts(w, x, y, mask):
        loss, metrics = metrics_loss(w, x, y, mask)
        metrics["first_loss"] = token_losses(w, x, y)[0, 0]  # per shard: its first token's
        return (jnp.sum(token_losses(w, x, y) * mask), jnp.sum(mask)), metrics
    vg = libra_jax.value_and_grad(parts, has_aux=True, loss_reduce="ratio", aux_reduce=reduce)
    with jax.set_mesh(mesh):
        (value, aux), grads = jax.jit(vg)(*args)
        (want, whole), want_grads = jax.jit(jax.value_and_grad(metrics_loss, has_aux=True))(
            *args)
        fast = jax.jit(libra_jax.optimize(vg))(*args)
        control = jax.jit(libra_jax.optimize(vg, collectives="xla"))(*args)
    jax.tree.map(assert_bitwise, fast, control)
    close((value, grads), (want, want_grads))
    close(aux["loss_sum"], whole["loss_sum"])
    assert float(aux["tokens"]) == float(whole["tokens"])
    assert int(aux["examples"]) == 64
    num, den = whole["accuracy"]
    close(aux["accuracy"], num / den)
    losses = np.asarray(token_losses(*args[:3]))
    close(aux["first_loss"], losses[::8, 0])
    with pytest.raises(ValueError, match=r"aux_reduce\['accuracy'\] must be one of"):
        libra_jax.value_and_grad(parts, has_aux=True, aux_reduce={"accuracy": "max"})
