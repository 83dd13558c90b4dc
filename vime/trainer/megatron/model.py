"""Build a Megatron-core GPTModel for a Hugging Face checkpoint's layout: local layers or TransformerEngine's.

`transformer_impl` (Megatron-LM's `--transformer-impl`) picks the layer spec:
- "local": megatron-core's own layers with `SDPAttention` as core attention. Megatron's local spec would
  otherwise fall back to an unfused softmax(QK^T)V, measured 3x slower than transformers + SDPA on a
  418M model; SDPA brings flash / memory-efficient kernels and GQA without copied key/value heads.
  Everything else stays Megatron's: tensor-parallel linears, RMSNorm, rotary embedding, MoE layer and
  router (so router replay works).
- "transformer_engine": megatron-core's TransformerEngine spec (RMSNorm fused into the following
  linear, TE's fused attention). Needs the `transformer_engine` package; `decoder_spec` raises
  `TransformerEngineMissing` without it. Its norm weights carry other names (`hf_mapping`).

Importing this module imports megatron-core: the backend imports it lazily, and tests skip without it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from torch import Tensor

from vime.trainer.megatron.hf_mapping import ModelLayout
from vime.trainer.megatron.parallel import MegatronParallelConfig


class SDPAttention(DotProductAttention):
    """Megatron core attention computed by `scaled_dot_product_attention` (causal, no explicit mask).

    Same constructor as `DotProductAttention` (so it drops into a layer spec). Inputs are Megatron's
    [seq, batch, heads, head_dim] (keys/values with the local query-group count); output [seq, batch,
    heads * head_dim]. Right-padded batches need no mask: under a causal mask no real token attends to a
    later padding position.
    """

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed sequences nor attention bias")
        if attention_mask is not None:
            raise ValueError("SDPAttention is causal only; pass attention_mask=None (right-padded batches)")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        scale = self.softmax_scale if getattr(self, "softmax_scale", None) is not None else None
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


class ResponseRowsOutputLayer(torch.nn.Module):
    """Wraps GPTModel's output layer to apply the LM head only at the rows set in `rows`.

    The vocabulary projection of every position is the largest activation of a step ([tokens, vocab]);
    RL losses only need the positions that predict response tokens (the torch backend does the same).
    `rows` indexes the batch-major flattened [B * T] positions (`MicroBatch.logit_index`); None means
    all rows. The output is then [n, 1, vocab/tp] sequence-first, so GPTModel's transpose gives [1, n,
    vocab/tp]. Not used under sequence parallelism, where the layer gathers the sequence itself.

    With `project` off (the chunked head, `fused_head.py`) a call with `rows` set returns those rows'
    hidden states instead of logits, [n, 1, hidden], and keeps the head weight it would have used (the
    tied embedding or its own) in `weight_used`, so the loss computes logprobs a chunk of tokens at a
    time. Calls without `rows` (plain model calls) still return logits.
    """

    def __init__(self, inner: torch.nn.Module, project: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.project = project
        self.rows: Tensor | None = None
        self.weight_used: Tensor | None = None

    @property
    def weight(self) -> Tensor:  # GPTModel reads output_layer.weight (tied/untied embeddings)
        return self.inner.weight

    def forward(self, hidden: Tensor, **kwargs: Any) -> Any:
        if self.rows is None:
            return self.inner(hidden, **kwargs)
        s, b, h = hidden.shape
        hidden = hidden.transpose(0, 1).reshape(b * s, h).index_select(0, self.rows).unsqueeze(1)
        if not self.project:
            weight = kwargs.get("weight")
            # a plain attribute: nn.Module would register an assigned Parameter as this module's own,
            # and the model's state_dict (the resume checkpoint) would then hold it under a second name
            object.__setattr__(self, "weight_used", weight if weight is not None else self.inner.weight)
            return hidden, None
        return self.inner(hidden, **kwargs)


def transformer_config(
    layout: ModelLayout, parallel: MegatronParallelConfig, *, bf16: bool = True, replay: bool = False
) -> TransformerConfig:
    """The TransformerConfig that reproduces the HF model's forward (checked against transformers on GPU).

    `replay` turns on Megatron's router replay (`moe_enable_routing_replay`); fused router and permute
    kernels stay off because the fused router path skips the replay hook.
    """
    dtype = torch.bfloat16 if bf16 else torch.float32
    kw: dict[str, Any] = dict(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_attention_heads, num_query_groups=layout.num_key_value_heads,
        kv_channels=layout.head_dim, ffn_hidden_size=layout.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=layout.rms_norm_eps, qk_layernorm=layout.qk_norm,
        add_bias_linear=False, add_qkv_bias=layout.attention_bias, gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0, rotary_interleaved=False,
        # SwiGLU through megatron-core's own fused function (torch.compile'd, no TransformerEngine needed)
        bias_activation_fusion=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        variable_seq_lengths=True, calculate_per_token_loss=True,
        moe_token_dispatcher_type="alltoall",  # the only dispatcher that takes variable sequence lengths
        **parallel.transformer_kwargs(),
    )  # fmt: skip
    if layout.is_moe:
        kw.update(
            num_moe_experts=layout.num_experts, moe_router_topk=layout.top_k,
            moe_ffn_hidden_size=layout.moe_intermediate_size,
            moe_layer_freq=[int(i in layout.moe_layers) for i in range(layout.num_layers)],
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32", moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
            moe_enable_routing_replay=replay,
        )  # fmt: skip
        if layout.family == "glm4_moe":
            kw.update(
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=layout.routed_scaling_factor,
                moe_router_num_groups=layout.n_group if layout.n_group > 1 else None,
                moe_router_group_topk=layout.topk_group if layout.n_group > 1 else None,
                moe_shared_expert_intermediate_size=layout.shared_expert_intermediate_size or None,
            )  # fmt: skip
        else:
            if layout.top_k == 1 and layout.norm_topk_prob:
                raise ValueError("top-1 routing with norm_topk_prob (weight 1.0) has no Megatron equivalent: "
                                 "Megatron needs a pre-softmax router for top-1, which does not renormalise")
            # top-k over logits then softmax over the k == softmax, top-k, renormalise (norm_topk_prob)
            kw.update(moe_router_score_function="softmax", moe_router_pre_softmax=not layout.norm_topk_prob)
    return TransformerConfig(**kw)


class TransformerEngineMissing(ImportError):
    """transformer_impl "transformer_engine" was asked for where TransformerEngine does not import."""


def decoder_spec(config: TransformerConfig) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs, dense or MoE per layer as `moe_layer_freq` says: megatron-core's
    TransformerEngine specs when `config.transformer_impl` is "transformer_engine", else its local specs
    with `SDPAttention` as core attention."""
    if config.transformer_impl == "transformer_engine":
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError as exc:  # megatron-core's own fallback would fail later with less to go on
            raise TransformerEngineMissing(
                f"--transformer-impl transformer_engine needs TransformerEngine where the trainer runs, and "
                f"`import transformer_engine.pytorch` failed: {exc}; install it or use --transformer-impl local"
            ) from exc
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for spec in block.layer_specs:
        attention = spec.submodules.self_attention
        attention.submodules = dataclasses.replace(attention.submodules, core_attention=SDPAttention)
    return block


def padded_vocab_size(layout: ModelLayout, tensor_parallel_size: int) -> int:
    """Vocabulary rounded up to a multiple of the TP size (vocab-parallel embedding needs equal shards).
    Logits past `layout.vocab_size` are dropped before any loss."""
    tp = tensor_parallel_size
    return (layout.vocab_size + tp - 1) // tp * tp


def build_gpt_model(
    layout: ModelLayout, config: TransformerConfig, *, pre_process: bool, post_process: bool
) -> GPTModel:
    """This pipeline stage's GPTModel (random init; load weights with `weights.load_hf_weights`)."""
    return GPTModel(
        config=config, transformer_layer_spec=decoder_spec(config),
        vocab_size=padded_vocab_size(layout, config.tensor_model_parallel_size),
        max_sequence_length=layout.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=layout.tie_word_embeddings, position_embedding_type="rope",
        rotary_percent=layout.partial_rotary_factor, rotary_base=int(layout.rope_theta),
    )  # fmt: skip
