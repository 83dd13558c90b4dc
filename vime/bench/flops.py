"""Model FLOPs of training a decoder-only transformer (Qwen3 / Llama layout, dense or Qwen3-MoE), for
MFU figures.

Used by the training-speed bench (`vime.bench.train_speed`), the Megatron GPU check's speed numbers
(`vime.bench.megatron_check`) and `bench/step_breakdown.py`, so all report MFU from the same formula.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# NVIDIA's H200 SXM datasheet figure for dense bf16 tensor-core throughput (the 1979 TFLOP/s figure
# assumes 2:4 sparsity, which training does not use).
H200_BF16_PEAK_FLOPS = 989e12

# Config keys of mixture-of-experts layouts whose per-token FLOPs are not modelled here (DeepSeek/GLM
# shared experts and dense first layers, Mixtral): the dense formula would overcount (all experts) or
# undercount (none). Qwen3-MoE's `num_experts` is modelled (`_mlp_params`).
_UNMODELLED_EXPERT_KEYS = ("n_routed_experts", "num_local_experts")


def _config_value(config: Mapping[str, Any] | Any, name: str, default: Any = None) -> Any:
    """One field of a Hugging Face config given as a dict (config.json) or a PretrainedConfig."""
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def _query_dim(config: Mapping[str, Any] | Any) -> tuple[int, int]:
    """(head_dim, q_dim = heads * head_dim). Qwen3 sets head_dim (128, not hidden / heads); Llama-style
    configs leave it out and derive it."""
    heads = int(_config_value(config, "num_attention_heads"))
    head_dim = int(_config_value(config, "head_dim", int(_config_value(config, "hidden_size")) // heads))
    return head_dim, heads * head_dim


def _expert_count(config: Mapping[str, Any] | Any) -> int:
    """Routed experts of a Qwen3-MoE layout (0 for a dense model or another layout). Its config names the
    count `num_experts`; transformers 5 answers and may save it as `num_local_experts`, which Mixtral
    also uses, so a Qwen3-MoE is told by its `moe_intermediate_size` and `num_experts_per_tok`."""
    if _config_value(config, "num_experts", 0):
        return int(_config_value(config, "num_experts"))
    qwen3_moe = _config_value(config, "moe_intermediate_size", 0) and _config_value(config, "num_experts_per_tok", 0)
    return int(_config_value(config, "num_local_experts", 0)) if qwen3_moe and not _config_value(config, "n_routed_experts", 0) else 0


def _mlp_params(config: Mapping[str, Any] | Any, layer: int) -> int:
    """Matmul parameters one token goes through in `layer`'s MLP: the gated MLP (gate, up, down) of a
    dense layer; for a Qwen3-MoE sparse layer the router and the `num_experts_per_tok` experts it
    routes to (the active parameters, not all experts)."""
    hidden = int(_config_value(config, "hidden_size"))
    experts = _expert_count(config)
    step = int(_config_value(config, "decoder_sparse_step", 1))
    sparse = experts > 0 and layer not in _config_value(config, "mlp_only_layers", []) and (layer + 1) % step == 0
    if not sparse:
        return 3 * hidden * int(_config_value(config, "intermediate_size"))
    top_k = int(_config_value(config, "num_experts_per_tok"))
    return hidden * experts + top_k * 3 * hidden * int(_config_value(config, "moe_intermediate_size"))


def matmul_params(config: Mapping[str, Any] | Any) -> int:
    """Parameters of the matmuls one token goes through: per layer the q/k/v/o projections and the
    MLP (`_mlp_params`: for mixture-of-experts layers the router and the routed experts only), plus
    the LM head. The input embedding is a lookup, not a matmul, so it does not count; a tied LM head
    still multiplies, so it counts once. Norms are left out (negligible).

    Raises ValueError for mixture-of-experts layouts that are not modelled (`_UNMODELLED_EXPERT_KEYS`)."""
    for key in _UNMODELLED_EXPERT_KEYS:
        if _config_value(config, key, 0) and not _expert_count(config):
            raise ValueError(f"training FLOPs of this mixture-of-experts layout ({key}) are not modelled; "
                             "dense and Qwen3-MoE configs only")  # fmt: skip
    hidden = int(_config_value(config, "hidden_size"))
    head_dim, q_dim = _query_dim(config)
    kv_heads = int(_config_value(config, "num_key_value_heads", _config_value(config, "num_attention_heads")))
    attention = hidden * (q_dim + 2 * kv_heads * head_dim) + q_dim * hidden
    layers = int(_config_value(config, "num_hidden_layers"))
    lm_head = int(_config_value(config, "vocab_size")) * hidden
    return layers * attention + sum(_mlp_params(config, i) for i in range(layers)) + lm_head


def training_flops_per_token(config: Mapping[str, Any] | Any, seq_len: float) -> float:
    """FLOPs of one training token (forward + backward) of a dense model with causal attention:

        6 * matmul_params + 6 * num_hidden_layers * seq_len * q_dim

    6 per matmul parameter is 2 for the forward multiply-add and 4 for the backward (input and weight
    gradients). The attention scores (QK^T) and the weighted sum (PV) cost 2 * seq_len * q_dim each per
    token forward without masking; the causal mask halves that, and the backward costs twice the
    forward, giving 6 * seq_len * q_dim per layer. Recompute (activation checkpointing) is not counted,
    as MFU conventionally excludes it.

    `seq_len` is the length of the sequence the token belongs to (prompt + response). For a batch of
    mixed lengths s_i the exact per-token attention term uses sum(s_i^2) / sum(s_i)
    (`attention_seq_len`); passing the mean length understates that term when lengths spread. The term is seq_len * q_dim next to about
    matmul_params / layers per layer (a sixth of the total for Qwen3-0.6B at 2048 tokens), so a short
    sequence's error is small.
    """
    _, q_dim = _query_dim(config)
    layers = int(_config_value(config, "num_hidden_layers"))
    return float(6 * matmul_params(config) + 6 * layers * seq_len * q_dim)


def attention_seq_len(lengths: Sequence[int]) -> float:
    """The `seq_len` that makes `training_flops_per_token` exact for a batch of sequences of these
    lengths: attention costs each token in proportion to its own sequence's length, so the token-weighted
    mean sum(s_i^2) / sum(s_i), not the plain mean."""
    total = sum(lengths)
    if total <= 0:
        raise ValueError("attention_seq_len needs at least one token")
    return sum(n * n for n in lengths) / total
