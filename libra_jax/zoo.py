"""Per-layer gradient sizes and FLOPs of four reference models, computed from their architectures.

The paper reproduction (``benchmarks/paper_reproduction.py``) and ``libra-jax simulate`` need, for
each model, the list of layers in backward order with each layer's gradient size and backward
compute. Nothing here is typed in from a table: every parameter count and FLOP count follows from
layer shapes, so the totals can be checked against the published parameter counts (the tests do).

Models (inputs as in their papers):

* ``vgg16``      -- VGG-16 (configuration D), 224x224x3, 1000 classes, conv and dense biases.
* ``resnet152``  -- ResNet-152 as in torchvision (stride in the 3x3 conv, convolutions without bias,
  batch-norm scale and shift trainable), 224x224x3.
* ``xception``   -- Xception as in Keras applications, 299x299x3; convolutions without bias;
  only the batch-norm scale and shift have gradients (moving statistics are not trained).
* ``bert-large`` -- BERT-large (24 layers, hidden 1024, 16 heads, FFN 4096, vocabulary 30522,
  512 positions, 2 token types) with its pre-training heads: the masked-LM head, whose decoder is
  tied to the word embedding (its gradient lands in the embedding's), and the next-sentence head.

An `Op` is one parameterised module (its gradient is all-reduced as one piece) or one
parameter-free operation (pooling, attention scores, the tied decoder) whose backward compute
still delays the gradients that follow it. Counts are per sample; `backward_layers` scales
them by the batch and turns them into `libra_jax.planner.Layer` objects.

FLOP conventions: a multiply-add is 2 FLOPs. A layer with weights costs its forward FLOPs twice in
backward (the input gradient and the weight gradient), except the first layer of the network,
which needs no input gradient. Normalisation and elementwise operations are memory-bound, so each
op also records the activation bytes its forward and backward passes move (fp32, 4 bytes per
element); `backward_layers` takes the larger of the FLOP time and the byte time (a roofline).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from libra_jax import collectives

if TYPE_CHECKING:  # pragma: no cover - import for type checkers only
    from libra_jax.planner import FsdpStep, GatherStep, Layer

__all__ = [
    "Op",
    "ModelSpec",
    "MODEL_NAMES",
    "get_model",
    "vgg16",
    "resnet152",
    "xception",
    "bert_large",
    "backward_layers",
    "backward_seconds",
    "forward_seconds",
    "layer_names_backward",
    "DEFAULT_BATCH",
    "Workload",
    "training_workload",
    "forward_gathers",
    "FsdpWorkload",
    "fsdp_workload",
]

BYTES_PER_ELEMENT = 4  # fp32 gradients and activations, as in the Libra artifact (params * 4 bytes)

# Backward FLOPs per output element of memory-bound ops (they are priced by bytes anyway).
NORM_BWD_FLOPS_PER_ELEMENT = 10
ELEMENTWISE_BWD_FLOPS_PER_ELEMENT = 2
# Activation passes (reads + writes of a tensor the size of the output) in the backward of ...
NORM_RELU_BWD_PASSES = 5  # batch/layer norm (+ fused ReLU/GELU): read x, dy, mask; write dx; reduce
ELEMENTWISE_BWD_PASSES = 3  # read dy and the saved input, write dx
NORM_FWD_PASSES = 3  # read x, write y, statistics pass


@dataclass(frozen=True)
class Op:
    """One backward step: a parameterised module or a parameter-free operation.

    All counts are per sample. ``params`` are trainable elements (the gradient has this many);
    ``*_act_bytes`` are activation bytes moved (weights excluded: their traffic does not grow with
    the batch and is added by `backward_layers`).
    """

    name: str
    kind: str
    params: int
    fwd_flops: float
    bwd_flops: float
    fwd_act_bytes: float
    bwd_act_bytes: float

    @property
    def grad_bytes(self) -> int:
        """Bytes of this op's gradient in fp32."""
        return self.params * BYTES_PER_ELEMENT


@dataclass(frozen=True)
class ModelSpec:
    """A model as a list of ops in forward order, plus the input description."""

    name: str
    ops: tuple[Op, ...]
    input_desc: str

    @property
    def param_count(self) -> int:
        """Trainable parameters, i.e. gradient elements per step."""
        return sum(op.params for op in self.ops)

    @property
    def grad_bytes(self) -> int:
        return self.param_count * BYTES_PER_ELEMENT

    def fwd_flops(self) -> float:
        """Forward FLOPs per sample."""
        return sum(op.fwd_flops for op in self.ops)

    def bwd_flops(self) -> float:
        """Backward FLOPs per sample."""
        return sum(op.bwd_flops for op in self.ops)


class _Builder:
    """Tracks the activation shape while ops are appended in forward order."""

    def __init__(self, h: int, w: int, c: int) -> None:
        self.h, self.w, self.c = h, w, c
        self.ops: list[Op] = []
        self._first_weight_op = True

    @property
    def elems(self) -> int:
        return self.h * self.w * self.c

    def _weighted(self, name: str, kind: str, params: int, flops: float, in_el: int, out_el: int) -> None:
        needs_dgrad = not self._first_weight_op
        self._first_weight_op = False
        bwd = flops * (2 if needs_dgrad else 1)
        bwd_bytes = BYTES_PER_ELEMENT * ((out_el + in_el) + ((out_el + in_el) if needs_dgrad else 0))
        self.ops.append(Op(name, kind, params, flops, bwd, BYTES_PER_ELEMENT * (in_el + out_el), bwd_bytes))

    def conv(self, name: str, cout: int, k: int, stride: int = 1, *, pad: int | str = "same",
             bias: bool = False, groups: int = 1) -> None:
        """Convolution. ``pad``: an int (torch style), ``"same"`` (Keras: ceil(H/s)) or ``"valid"``."""
        cin = self.c
        if pad == "same":
            ho, wo = math.ceil(self.h / stride), math.ceil(self.w / stride)
        elif pad == "valid":
            ho, wo = (self.h - k) // stride + 1, (self.w - k) // stride + 1
        else:
            assert isinstance(pad, int)
            ho, wo = (self.h + 2 * pad - k) // stride + 1, (self.w + 2 * pad - k) // stride + 1
        params = k * k * (cin // groups) * cout + (cout if bias else 0)
        flops = 2.0 * k * k * (cin // groups) * cout * ho * wo
        in_el = self.elems
        self.h, self.w, self.c = ho, wo, cout
        self._weighted(name, "conv", params, flops, in_el, self.elems)

    def separable(self, name: str, cout: int, k: int = 3) -> None:
        """Keras SeparableConv2D (depth multiplier 1, no bias): depthwise kxk then pointwise 1x1."""
        cin = self.c
        self.conv(name + "/depthwise", cin, k, 1, groups=cin)
        self.conv(name + "/pointwise", cout, 1, 1)

    def norm(self, name: str, kind: str = "batchnorm") -> None:
        """Batch norm (or layer norm) with scale and shift over the channel dim, ReLU fused."""
        el = self.elems
        self.ops.append(Op(name, kind, 2 * self.c, NORM_BWD_FLOPS_PER_ELEMENT / 2 * el,
                           NORM_BWD_FLOPS_PER_ELEMENT * el, BYTES_PER_ELEMENT * NORM_FWD_PASSES * el,
                           BYTES_PER_ELEMENT * NORM_RELU_BWD_PASSES * el))

    def pool(self, name: str, k: int, stride: int, *, pad: int | str = "same") -> None:
        in_el = self.elems
        if pad == "same":
            self.h, self.w = math.ceil(self.h / stride), math.ceil(self.w / stride)
        elif pad == "valid":
            self.h, self.w = (self.h - k) // stride + 1, (self.w - k) // stride + 1
        else:
            assert isinstance(pad, int)
            self.h, self.w = (self.h + 2 * pad - k) // stride + 1, (self.w + 2 * pad - k) // stride + 1
        out_el = self.elems
        self.ops.append(Op(name, "pool", 0, float(k * k * out_el), float(in_el),
                           BYTES_PER_ELEMENT * (in_el + out_el),
                           BYTES_PER_ELEMENT * (2 * out_el + in_el)))

    def global_pool(self, name: str) -> None:
        in_el = self.elems
        self.h = self.w = 1
        self.ops.append(Op(name, "pool", 0, float(in_el), float(in_el), BYTES_PER_ELEMENT * in_el,
                           BYTES_PER_ELEMENT * in_el))

    def dense(self, name: str, cout: int, *, bias: bool = True) -> None:
        cin = self.elems
        params = cin * cout + (cout if bias else 0)
        self.h = self.w = 1
        self.c = cout
        self._weighted(name, "dense", params, 2.0 * cin * cout, cin, cout)


def vgg16() -> ModelSpec:
    """VGG-16 (Simonyan & Zisserman, configuration D): 13 conv3x3 + 3 dense, all with bias."""
    b = _Builder(224, 224, 3)
    for stage, (width, reps) in enumerate([(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)], start=1):
        for r in range(1, reps + 1):
            b.conv(f"block{stage}_conv{r}", width, 3, pad=1, bias=True)
        b.pool(f"block{stage}_pool", 2, 2, pad="valid")
    b.h, b.w, b.c = 1, 1, b.elems  # flatten 7x7x512
    b.dense("fc1", 4096)
    b.dense("fc2", 4096)
    b.dense("predictions", 1000)
    return ModelSpec("vgg16", tuple(b.ops), "224x224x3 image")


def resnet152() -> ModelSpec:
    """ResNet-152 (He et al.; torchvision layout): bottlenecks [3, 8, 36, 3], expansion 4."""
    b = _Builder(224, 224, 3)
    b.conv("conv1", 64, 7, 2, pad=3)
    b.norm("bn1")
    b.pool("maxpool", 3, 2, pad=1)
    for stage, (width, blocks) in enumerate([(64, 3), (128, 8), (256, 36), (512, 3)], start=1):
        for i in range(blocks):
            stride = 2 if (i == 0 and stage > 1) else 1
            cin, h, w = b.c, b.h, b.w
            p = f"layer{stage}.{i}"
            b.conv(p + ".conv1", width, 1, pad=0)
            b.norm(p + ".bn1")
            b.conv(p + ".conv2", width, 3, stride, pad=1)
            b.norm(p + ".bn2")
            b.conv(p + ".conv3", 4 * width, 1, pad=0)
            b.norm(p + ".bn3")
            if i == 0:  # projection shortcut, computed from the block input
                out_h, out_w, out_c = b.h, b.w, b.c
                b.h, b.w, b.c = h, w, cin
                b.conv(p + ".downsample.0", 4 * width, 1, stride, pad=0)
                b.norm(p + ".downsample.1")
                assert (b.h, b.w, b.c) == (out_h, out_w, out_c)
    b.global_pool("avgpool")
    b.dense("fc", 1000)
    return ModelSpec("resnet152", tuple(b.ops), "224x224x3 image")


def xception() -> ModelSpec:
    """Xception (Chollet; Keras applications layout), 299x299x3 input."""
    b = _Builder(299, 299, 3)
    b.conv("block1_conv1", 32, 3, 2, pad="valid")
    b.norm("block1_conv1_bn")
    b.conv("block1_conv2", 64, 3, 1, pad="valid")
    b.norm("block1_conv2_bn")

    def entry_block(idx: int, width_a: int, width_b: int) -> None:
        h, w, c = b.h, b.w, b.c
        b.separable(f"block{idx}_sepconv1", width_a)
        b.norm(f"block{idx}_sepconv1_bn")
        b.separable(f"block{idx}_sepconv2", width_b)
        b.norm(f"block{idx}_sepconv2_bn")
        b.pool(f"block{idx}_pool", 3, 2)
        out = (b.h, b.w, b.c)
        b.h, b.w, b.c = h, w, c  # residual branch from the block input
        b.conv(f"block{idx}_residual", width_b, 1, 2)
        b.norm(f"block{idx}_residual_bn")
        assert (b.h, b.w, b.c) == out

    entry_block(2, 128, 128)
    entry_block(3, 256, 256)
    entry_block(4, 728, 728)
    for idx in range(5, 13):  # middle flow: 8 blocks of 3 separable convs, identity shortcut
        for j in range(1, 4):
            b.separable(f"block{idx}_sepconv{j}", 728)
            b.norm(f"block{idx}_sepconv{j}_bn")
    entry_block(13, 728, 1024)
    b.separable("block14_sepconv1", 1536)
    b.norm("block14_sepconv1_bn")
    b.separable("block14_sepconv2", 2048)
    b.norm("block14_sepconv2_bn")
    b.global_pool("avg_pool")
    b.dense("predictions", 1000)
    return ModelSpec("xception", tuple(b.ops), "299x299x3 image")


BERT_LARGE = dict(layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522, positions=512, types=2)


def bert_large(seq_len: int = 128, masked_fraction: float = 0.15) -> ModelSpec:
    """BERT-large with pre-training heads, for sequences of ``seq_len`` tokens.

    The masked-LM head runs on ``round(masked_fraction * seq_len)`` gathered positions (as the
    reference implementation does: 20 of 128). Its decoder reuses the word-embedding matrix, so it
    appears as a parameter-free op whose gradient is accumulated into the embedding's.
    """
    if not 1 <= seq_len <= BERT_LARGE["positions"]:
        raise ValueError(f"seq_len must be in 1..{BERT_LARGE['positions']}, got {seq_len}")
    h, f, s, v = BERT_LARGE["hidden"], BERT_LARGE["ffn"], seq_len, BERT_LARGE["vocab"]
    m = max(1, round(masked_fraction * s))
    ops: list[Op] = []
    E = BYTES_PER_ELEMENT

    def dense(name: str, rows: int, cin: int, cout: int) -> None:
        flops = 2.0 * rows * cin * cout
        ops.append(Op(name, "dense", cin * cout + cout, flops, 2 * flops, E * rows * (cin + cout),
                      2 * E * rows * (cin + cout)))

    def layernorm(name: str, rows: int) -> None:
        el = rows * h
        ops.append(Op(name, "layernorm", 2 * h, NORM_BWD_FLOPS_PER_ELEMENT / 2 * el,
                      NORM_BWD_FLOPS_PER_ELEMENT * el, E * NORM_FWD_PASSES * el,
                      E * NORM_RELU_BWD_PASSES * el))

    emb_params = (v + BERT_LARGE["positions"] + BERT_LARGE["types"]) * h
    # Embedding backward scatters dy into a dense gradient of the whole table (written once).
    ops.append(Op("embeddings", "embedding", emb_params, 0.0, 3.0 * s * h, E * 4 * s * h,
                  E * (3 * s * h + emb_params)))
    layernorm("embeddings/layernorm", s)
    heads = BERT_LARGE["heads"]
    for i in range(BERT_LARGE["layers"]):
        p = f"layer{i}"
        for proj in ("query", "key", "value"):
            dense(f"{p}/attention/{proj}", s, h, h)
        # scores = Q K^T and context = P V over all heads; softmax is elementwise on heads*s*s.
        mm = 2.0 * 2 * s * s * h
        probs = heads * s * s
        ops.append(Op(f"{p}/attention/core", "attention", 0, mm + 5.0 * probs, 2 * mm + 5.0 * probs,
                      E * (4 * s * h + 3 * probs), E * (8 * s * h + 2 * ELEMENTWISE_BWD_PASSES * probs)))
        dense(f"{p}/attention/output", s, h, h)
        layernorm(f"{p}/attention/layernorm", s)
        dense(f"{p}/intermediate", s, h, f)
        ops.append(Op(f"{p}/intermediate/gelu", "elementwise", 0, 8.0 * s * f,
                      ELEMENTWISE_BWD_FLOPS_PER_ELEMENT * 4.0 * s * f, 2 * E * s * f,
                      ELEMENTWISE_BWD_PASSES * E * s * f))
        dense(f"{p}/output", s, f, h)
        layernorm(f"{p}/output/layernorm", s)
    dense("pooler", 1, h, h)
    dense("cls/predictions/transform", m, h, h)
    layernorm("cls/predictions/transform/layernorm", m)
    dec = 2.0 * m * h * v
    ops.append(Op("cls/predictions/decoder(tied)", "dense", v, dec, 2 * dec, E * m * (h + v),
                  E * 2 * m * (h + v) + E * v * h))  # weight tied: only the output bias is new
    dense("cls/seq_relationship", 1, h, 2)
    return ModelSpec("bert-large", tuple(ops), f"{s} tokens")


_BUILDERS: dict[str, Callable[[], ModelSpec]] = {
    "vgg16": vgg16,
    "resnet152": resnet152,
    "xception": xception,
    "bert-large": bert_large,
}
MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def get_model(name: str, **kwargs: int | float) -> ModelSpec:
    """The `ModelSpec` called ``name`` (one of `MODEL_NAMES`); kwargs go to its builder."""
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}") from None
    return builder(**kwargs)


def _roofline_s(flops: float, act_bytes: float, weight_bytes: float, batch: int,
                flop_per_s: float, bytes_per_s: float) -> float:
    return max(batch * flops / flop_per_s, (batch * act_bytes + weight_bytes) / bytes_per_s)


def _check_rates(batch: int, flop_per_s: float, bytes_per_s: float) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    for label, value in (("flop_per_s", flop_per_s), ("bytes_per_s", bytes_per_s)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{label} must be positive and finite, got {value}")


def backward_layers(spec: ModelSpec, *, batch: int, flop_per_s: float, bytes_per_s: float) -> list[Layer]:
    """The model's backward pass as planner layers, in backward order (first = finishes first).

    Each parameterised op becomes one `libra_jax.planner.Layer` whose gradient is ready
    when its own backward ends. The compute of parameter-free ops (pooling, attention scores, the
    tied decoder's matmul) is folded into the next parameterised op in backward order, because
    those gradients cannot be ready before it; this keeps every layer's ready time exact. Op time
    is the roofline ``max(FLOPs / flop_per_s, bytes / bytes_per_s)`` for ``batch`` samples.
    """
    from libra_jax.planner import Layer

    _check_rates(batch, flop_per_s, bytes_per_s)
    layers: list[Layer] = []
    pending = 0.0
    for op in reversed(spec.ops):
        weight_bytes = 2 * op.grad_bytes  # read W, write dW
        pending += _roofline_s(op.bwd_flops, op.bwd_act_bytes, weight_bytes, batch, flop_per_s, bytes_per_s)
        if op.params:
            layers.append(Layer(compute_s=pending, grad_bytes=op.grad_bytes))
            pending = 0.0
    if pending and layers:  # parameter-free ops at the very start of the network
        last = layers[-1]
        layers[-1] = Layer(compute_s=last.compute_s + pending, grad_bytes=last.grad_bytes)
    return layers


def backward_seconds(spec: ModelSpec, *, batch: int, flop_per_s: float, bytes_per_s: float) -> float:
    """Total backward compute at full speed (the sum of `backward_layers` times)."""
    _check_rates(batch, flop_per_s, bytes_per_s)
    return sum(_roofline_s(op.bwd_flops, op.bwd_act_bytes, 2 * op.grad_bytes, batch, flop_per_s, bytes_per_s)
               for op in spec.ops)


def forward_seconds(spec: ModelSpec, *, batch: int, flop_per_s: float, bytes_per_s: float) -> float:
    """Forward compute at full speed: the same roofline, reading each weight once."""
    _check_rates(batch, flop_per_s, bytes_per_s)
    return sum(_roofline_s(op.fwd_flops, op.fwd_act_bytes, op.grad_bytes, batch, flop_per_s, bytes_per_s)
               for op in spec.ops)


def layer_names_backward(spec: ModelSpec) -> Sequence[str]:
    """Names of the parameterised ops in backward order, aligned with `backward_layers`."""
    return [op.name for op in reversed(spec.ops) if op.params]


# ----------------------------------------------------------------------------------------------
# Training workloads
# ----------------------------------------------------------------------------------------------

# Per-worker batch sizes of the Libra artifact's simulator (gpu_resource dp.py test_model list).
DEFAULT_BATCH: dict[str, int] = {"vgg16": 32, "resnet152": 8, "xception": 8, "bert-large": 2}
DEFAULT_BERT_SEQ_LEN = 128  # BERT pre-training phase 1 (assumption: the artifact does not say)
# SGD with momentum in fp32 reads weight, gradient and momentum and writes weight and momentum.
OPTIMIZER_BYTES_PER_PARAM = 5 * BYTES_PER_ELEMENT


@dataclass(frozen=True)
class Workload:
    """One data-parallel training step of a model on one worker, at full speed (no contention).

    ``layers`` are the planner's backward layers; forward and optimizer times bracket the
    backward pass in an iteration: ``iteration = forward_s + backward + optimizer_s``.
    """

    model: str
    batch: int
    layers: tuple[Layer, ...]
    forward_s: float
    optimizer_s: float

    @property
    def backward_compute_s(self) -> float:
        return sum(layer.compute_s for layer in self.layers)

    @property
    def grad_bytes(self) -> int:
        return sum(layer.grad_bytes for layer in self.layers)


def training_workload(name: str, *, flop_per_s: float, bytes_per_s: float, batch: int | None = None,
                      seq_len: int | None = None) -> Workload:
    """Build the `Workload` of model ``name`` on a device sustaining the given rates.

    ``batch`` defaults to `DEFAULT_BATCH`; ``seq_len`` (BERT only) to
    `DEFAULT_BERT_SEQ_LEN`. The optimizer step is memory-bound:
    ``params * OPTIMIZER_BYTES_PER_PARAM / bytes_per_s``.
    """
    if seq_len is not None and name != "bert-large":
        raise ValueError(f"seq_len applies to bert-large only, not {name!r}")
    spec = get_model(name, seq_len=seq_len or DEFAULT_BERT_SEQ_LEN) if name == "bert-large" else get_model(name)
    batch = DEFAULT_BATCH[name] if batch is None else batch
    layers = backward_layers(spec, batch=batch, flop_per_s=flop_per_s, bytes_per_s=bytes_per_s)
    return Workload(
        model=name,
        batch=batch,
        layers=tuple(layers),
        forward_s=forward_seconds(spec, batch=batch, flop_per_s=flop_per_s, bytes_per_s=bytes_per_s),
        optimizer_s=spec.param_count * OPTIMIZER_BYTES_PER_PARAM / bytes_per_s,
    )


def forward_gathers(spec: ModelSpec, *, batch: int, flop_per_s: float, bytes_per_s: float
                    ) -> tuple[float, list[GatherStep]]:
    """The forward pass of a sharded (FSDP) model as the planner's gathers: ``(lead_s, steps)``,
    a `libra_jax.planner.GatherStep` per parameterised op in forward order (its gathered weights
    in fp32, and the compute from the op to the next parameterised one: the parameter-free ops
    after it fold into it), after ``lead_s`` of parameter-free compute before the first."""
    from libra_jax.planner import GatherStep

    _check_rates(batch, flop_per_s, bytes_per_s)
    lead, steps = 0.0, []
    pending: tuple[float, int] | None = None  # (compute, bytes) of the step being built
    for op in spec.ops:
        seconds = _roofline_s(op.fwd_flops, op.fwd_act_bytes, op.grad_bytes, batch, flop_per_s,
                              bytes_per_s)
        if op.params:
            if pending is not None:
                steps.append(GatherStep(*pending))
            pending = (seconds, op.grad_bytes)
        elif pending is None:
            lead += seconds
        else:
            pending = (pending[0] + seconds, pending[1])
    if pending is not None:
        steps.append(GatherStep(*pending))
    return lead, steps


@dataclass(frozen=True)
class FsdpWorkload:
    """One FSDP (ZeRO-3) training step of a model on one of ``workers`` ranks at full speed:
    ``step`` (`libra_jax.planner.FsdpStep`: the forward gathers, the backward pass's
    re-gathers and reduce-scatters), and the optimizer's update of this rank's shard."""

    model: str
    batch: int
    workers: int
    step: FsdpStep
    optimizer_s: float

    @property
    def compute_s(self) -> float:
        """Forward and backward compute at full speed."""
        return (self.step.forward_lead_s + sum(s.compute_s for s in self.step.forward)
                + sum(layer.compute_s for layer in self.step.layers))

    @property
    def param_bytes(self) -> int:
        return sum(layer.grad_bytes for layer in self.step.layers)


def fsdp_workload(name: str, *, flop_per_s: float, bytes_per_s: float, workers: int,
                  batch: int | None = None, seq_len: int | None = None) -> FsdpWorkload:
    """The `FsdpWorkload` of model ``name``: every parameterised op's weights sharded over
    ``workers`` ranks, gathered before its forward and again before its backward (no
    activations recomputed), its gradient reduce-scattered. Defaults as `training_workload`;
    the optimizer updates ``1 / workers`` of the parameters."""
    from libra_jax.planner import FsdpStep, GatherStep, Layer

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    dp = training_workload(name, flop_per_s=flop_per_s, bytes_per_s=bytes_per_s, batch=batch,
                           seq_len=seq_len)
    spec = get_model(name, seq_len=seq_len or DEFAULT_BERT_SEQ_LEN) if name == "bert-large" else get_model(name)
    lead, forward = forward_gathers(spec, batch=dp.batch, flop_per_s=flop_per_s,
                                    bytes_per_s=bytes_per_s)
    scatter = next(row for row in collectives.ROWS if row.scatters)  # each gradient's kind
    layers = tuple(Layer(layer.compute_s, layer.grad_bytes, scatter) for layer in dp.layers)
    backward = tuple(GatherStep(layer.compute_s, layer.grad_bytes) for layer in dp.layers)
    return FsdpWorkload(name, dp.batch, workers, FsdpStep(tuple(forward), lead, backward, layers),
                        dp.optimizer_s / workers)
