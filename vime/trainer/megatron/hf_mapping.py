"""Hugging Face checkpoint <-> Megatron-core GPTModel: the model layout and the tensor name/shape mapping.

Pure torch (no megatron import), so it is tested on CPU machines. Names on the Megatron side are the
*global, unsharded* ones: global layer index, global expert index, full tensor-parallel tensors. The
backend (`megatron/weights.py`) turns them into this rank's shards and back.

Supported families (`ModelLayout.family`):
- `qwen3` (Qwen3ForCausalLM): QK-norm, GQA, SwiGLU, RMSNorm, optional tied embeddings;
- `qwen3_moe` (Qwen3MoeForCausalLM): the same attention, every layer (or `decoder_sparse_step`) MoE with
  a softmax top-k router, no shared expert;
- `glm4_moe` (Glm4MoeForCausalLM, GLM-4.5 / 4.5-Air): attention with QKV bias and partial rotary,
  the first `first_k_dense_replace` layers dense, then MoE layers with a sigmoid router with expert
  bias, grouped top-k, a scaling factor, and shared experts. Its next-token-prediction (MTP) layers
  are not part of the policy and are skipped on load.

Layouts that differ from the checkpoint:
- `linear_qkv` holds, per query group g: the group's query heads, then its key head, then its value head
  (Megatron's order, so a tensor-parallel split along dim 0 keeps whole groups together);
- a gated MLP's `linear_fc1` is `[gate; up]`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
}


@dataclass(frozen=True)
class ModelLayout:
    """The shape facts of a checkpoint that the mapping and the Megatron config need."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool = False
    qk_norm: bool = True
    partial_rotary_factor: float = 1.0
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    moe_intermediate_size: int = 0
    top_k: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # GLM-4.5 router
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelLayout":
        """Read a transformers config (object with attributes, e.g. `AutoConfig.from_pretrained`).

        Raises ValueError for an architecture this mapping does not know.
        """
        archs = list(getattr(config, "architectures", None) or [])
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            raise ValueError(f"Megatron backend supports {sorted(SUPPORTED_ARCHITECTURES)}, checkpoint is {archs}")
        rope = getattr(config, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        heads = config.num_attention_heads
        common = dict(
            family=family, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            num_attention_heads=heads, num_key_value_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
            tie_word_embeddings=bool(config.tie_word_embeddings), rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope_theta), max_position_embeddings=config.max_position_embeddings,
            attention_bias=bool(getattr(config, "attention_bias", False)), partial_rotary_factor=float(partial),
        )  # fmt: skip
        if family == "qwen3":
            return cls(**common)
        layers = range(config.num_hidden_layers)
        if family == "qwen3_moe":
            mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
            step = getattr(config, "decoder_sparse_step", 1) or 1
            moe = tuple(i for i in layers if i not in mlp_only and (i + 1) % step == 0)
            return cls(
                **common, num_experts=config.num_experts, moe_intermediate_size=config.moe_intermediate_size,
                top_k=config.num_experts_per_tok, moe_layers=moe, norm_topk_prob=bool(config.norm_topk_prob),
            )  # fmt: skip
        first_dense = config.first_k_dense_replace
        return cls(
            **{**common, "qk_norm": bool(getattr(config, "use_qk_norm", False))},
            num_experts=config.n_routed_experts, moe_intermediate_size=config.moe_intermediate_size,
            top_k=config.num_experts_per_tok, moe_layers=tuple(i for i in layers if i >= first_dense),
            norm_topk_prob=bool(config.norm_topk_prob),
            shared_expert_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
            routed_scaling_factor=float(config.routed_scaling_factor), n_group=int(config.n_group or 1),
            topk_group=int(config.topk_group or 1),
        )  # fmt: skip

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def megatron_names(self, transformer_impl: str = "local") -> list[str]:
        """Every global Megatron tensor name of the full model (what a TP=PP=EP=1 model has). With
        "transformer_engine" the input norm is part of `linear_qkv` and a dense layer's pre-MLP norm part
        of `linear_fc1` (TE's fused norm + linear), each as `layer_norm_weight`."""
        fused = transformer_impl == "transformer_engine"
        names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
        if not self.tie_word_embeddings:
            names.append("output_layer.weight")
        for i in range(self.num_layers):
            p = f"decoder.layers.{i}."
            names += [p + ("self_attention.linear_qkv.layer_norm_weight" if fused else "input_layernorm.weight"),
                      p + "self_attention.linear_qkv.weight", p + "self_attention.linear_proj.weight"]  # fmt: skip
            dense = i not in self.moe_layers
            names.append(p + ("mlp.linear_fc1.layer_norm_weight" if fused and dense else "pre_mlp_layernorm.weight"))
            if self.attention_bias:
                names.append(p + "self_attention.linear_qkv.bias")
            if self.qk_norm:
                names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
            if dense:
                names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
                continue
            names.append(p + "mlp.router.weight")
            if self.family == "glm4_moe":
                names.append(p + "mlp.router.expert_bias")
            for e in range(self.num_experts):
                names += [f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight",
                          f"{p}mlp.experts.local_experts.{e}.linear_fc2.weight"]  # fmt: skip
            if self.shared_expert_intermediate_size:
                names += [p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight"]
        return names


# ----------------------------------------------------------------------------------- the mapping

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

# per-layer tensors that map one to one: Megatron suffix -> HF suffix (after `model.layers.{i}.`)
_ONE_TO_ONE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    # the same norms fused into the next linear (transformer_impl "transformer_engine")
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class _Rule:
    hf_names: list[str]
    to_megatron: Callable[[list[Tensor]], Tensor]
    to_hf: Callable[[Tensor], list[Tensor]]


def _identity_rule(hf_name: str) -> _Rule:
    return _Rule([hf_name], lambda ts: ts[0], lambda t: [t])


def _gated_rule(prefix: str) -> _Rule:
    return _Rule(
        [prefix + "gate_proj.weight", prefix + "up_proj.weight"],
        lambda ts: torch.cat(ts, dim=0),
        lambda t: list(t.chunk(2, dim=0)),
    )


def _qkv_rule(prefix: str, layout: ModelLayout, suffix: str) -> _Rule:
    groups, hd = layout.num_key_value_heads, layout.head_dim
    q_per_group = layout.num_attention_heads // groups

    def combine(ts: list[Tensor]) -> Tensor:
        q, k, v = ts
        tail = q.shape[1:]
        parts = [q.reshape(groups, q_per_group * hd, *tail), k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)]
        return torch.cat(parts, dim=1).reshape(-1, *tail)

    def split(t: Tensor) -> list[Tensor]:
        tail = t.shape[1:]
        q, k, v = t.reshape(groups, (q_per_group + 2) * hd, *tail).split([q_per_group * hd, hd, hd], dim=1)
        return [x.reshape(-1, *tail) for x in (q, k, v)]

    return _Rule([f"{prefix}{n}_proj.{suffix}" for n in "qkv"], combine, split)


def rule_for(mcore_name: str, layout: ModelLayout) -> _Rule:
    """How one global Megatron tensor is made from (and split back into) HF checkpoint tensors.

    Raises KeyError for a name that is not a model weight of this layout (e.g. a buffer).
    """
    if mcore_name in _GLOBAL:
        if mcore_name == "output_layer.weight" and layout.tie_word_embeddings:
            raise KeyError(f"{mcore_name}: tied to the embedding in this checkpoint")
        return _identity_rule(_GLOBAL[mcore_name])
    m = _LAYER.match(mcore_name)
    if m is None:
        raise KeyError(f"{mcore_name}: not a weight the HF mapping knows")
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= layout.num_layers:
        raise KeyError(f"{mcore_name}: layer {layer} >= {layout.num_layers}")
    hf = f"model.layers.{layer}."
    if rest in _ONE_TO_ONE:
        return _identity_rule(hf + _ONE_TO_ONE[rest])
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv_rule(hf + "self_attn.", layout, rest.rsplit(".", 1)[1])
    if rest == "mlp.linear_fc1.weight":
        return _gated_rule(hf + "mlp.")
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return _gated_rule(hf + "mlp.shared_experts.")
    e = _EXPERT.match(rest)
    if e is not None:
        expert = f"{hf}mlp.experts.{int(e.group(1))}."
        if e.group(2) == "linear_fc1":
            return _gated_rule(expert)
        return _identity_rule(expert + "down_proj.weight")
    raise KeyError(f"{mcore_name}: not a weight the HF mapping knows")


def hf_to_megatron(mcore_name: str, read: Callable[[str], Tensor], layout: ModelLayout) -> Tensor:
    """The full global Megatron tensor `mcore_name`, reading HF checkpoint tensors with `read(name)`."""
    rule = rule_for(mcore_name, layout)
    return rule.to_megatron([read(n) for n in rule.hf_names])


def megatron_to_hf(mcore_name: str, tensor: Tensor, layout: ModelLayout) -> list[tuple[str, Tensor]]:
    """(HF checkpoint name, tensor) pairs for one full global Megatron tensor."""
    rule = rule_for(mcore_name, layout)
    return list(zip(rule.hf_names, rule.to_hf(tensor)))


def hf_checkpoint_names(layout: ModelLayout) -> list[str]:
    """Every HF checkpoint tensor name the policy uses (the MTP layers of GLM-4.5 are not among them)."""
    return [n for name in layout.megatron_names() for n in rule_for(name, layout).hf_names]
