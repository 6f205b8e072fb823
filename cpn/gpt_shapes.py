"""Parameter tensors of cpn's GPT, per pipeline stage and tensor-parallel rank.

This is the single description of the model's parameters that both the cost model
(which predicts bytes) and the runtime (which holds the tensors) use; a runtime test
checks that the real modules match it, so predicted and measured bytes agree exactly.

The model is nanoGPT-shaped with an untied output head (a tied head would need an extra
gradient all-reduce between the first and last pipeline stage): token and position
embeddings, `layers` pre-LayerNorm blocks (attention: fused qkv + output projection; MLP:
4·hidden with GELU), a final LayerNorm and the output head. Every Linear and LayerNorm has
a bias except the head. Tensor parallelism is Megatron-style: qkv and the MLP's first
linear are column-parallel, the two output projections row-parallel (their biases are
added after the all-reduce, so every rank holds them whole), the token embedding and the
head are split over the vocabulary. The vocabulary is padded to a multiple of tp; padded
logits are masked, so the padding never changes the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from cpn.contracts.job import ModelSpec


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    sharded: bool  # split across the tensor-parallel group; else every tp rank has a copy

    @property
    def numel(self) -> int:
        return prod(self.shape)


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp, so the embedding splits evenly."""
    return -(-vocab // tp) * tp


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """Indices of the transformer blocks held by `stage` (pp divides layers)."""
    per = layers // pp
    return range(stage * per, (stage + 1) * per)


def block_parameters(index: int, hidden: int, tp: int) -> list[ParamShape]:
    h = hidden
    pre = f"blocks.{index}."
    return [
        ParamShape(pre + "ln_1.weight", (h,), False),
        ParamShape(pre + "ln_1.bias", (h,), False),
        ParamShape(pre + "attn.qkv.weight", (3 * h // tp, h), True),
        ParamShape(pre + "attn.qkv.bias", (3 * h // tp,), True),
        ParamShape(pre + "attn.proj.weight", (h, h // tp), True),
        ParamShape(pre + "attn.proj.bias", (h,), False),
        ParamShape(pre + "ln_2.weight", (h,), False),
        ParamShape(pre + "ln_2.bias", (h,), False),
        ParamShape(pre + "mlp.fc.weight", (4 * h // tp, h), True),
        ParamShape(pre + "mlp.fc.bias", (4 * h // tp,), True),
        ParamShape(pre + "mlp.proj.weight", (h, 4 * h // tp), True),
        ParamShape(pre + "mlp.proj.bias", (h,), False),
    ]


def stage_parameters(model: ModelSpec, pp: int, tp: int, stage: int) -> list[ParamShape]:
    """The parameters one tensor-parallel rank of `stage` holds, in module order."""
    h = model.hidden
    vocab_shard = padded_vocab(model.vocab, tp) // tp
    params: list[ParamShape] = []
    if stage == 0:
        params.append(ParamShape("wte.weight", (vocab_shard, h), True))
        params.append(ParamShape("wpe.weight", (model.seq_len, h), False))
    for i in stage_layers(model.layers, pp, stage):
        params.extend(block_parameters(i, h, tp))
    if stage == pp - 1:
        params.append(ParamShape("ln_f.weight", (h,), False))
        params.append(ParamShape("ln_f.bias", (h,), False))
        params.append(ParamShape("lm_head.weight", (vocab_shard, h), True))
    return params


def stage_numel(model: ModelSpec, pp: int, tp: int, stage: int) -> int:
    """Elements one tensor-parallel rank of `stage` holds."""
    return sum(p.numel for p in stage_parameters(model, pp, tp, stage))


def parameter_count(model: ModelSpec) -> int:
    """Parameters of the whole model (no tensor parallelism, no vocabulary padding)."""
    return stage_numel(model, 1, 1, 0)
